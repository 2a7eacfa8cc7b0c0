"""launch.py's flags become one frozen LaunchConfig; nothing below it sees the command line."""

import ast
import dataclasses

import pytest

from tfdist.cli import launch
from conftest import REPO
from tfdist.launcher import job
from tfdist.launcher.recovery import faults
from tfdist.strategies import kinds
from tfdist.options import TrainOptions

LAUNCHER = REPO / "tfdist" / "launcher"


def _config(*argv):
    args, train_args = launch.parse_args(list(argv))
    return job.build_config(launch.request_from_args(args, train_args))


def test_flags_become_one_frozen_config_with_the_kind_object():
    config = _config("--strategy", "ps", "--workers", "2", "--ps", "1",
                     "--slow", "worker:1=0.3", "--kill", "worker:0@step=50", "--restart-tasks",
                     "--", "--steps", "30")
    assert config.kind is kinds.get("ps")
    assert config.names == ["chief:0", "worker:0", "worker:1", "ps:0"]
    assert config.recovery.slow == (faults.Slow("worker:1", 0.3),)
    assert config.recovery.faults == (faults.Fault("kill", "worker:0", step=50),)
    assert config.recovery.restart_tasks
    assert config.options == TrainOptions(steps=30, model_dir="runs/ps")
    assert config.member.argv() == ["--steps", "30", "--model-dir", "runs/ps"]
    assert config.launch_dir == "runs/ps/launch"
    assert set(config.cores) == set(config.names)
    assert config.launch_argv[:2] == ("--strategy", "ps")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timeout = 1.0


def test_the_cpu_set_is_a_placement_not_an_environment_variable():
    config = _config("--strategy", "multiworker", "--workers", "2", "--")
    for share in config.cores.values():
        assert all(key.startswith("TF_NUM_") for key in share.env)


def _functions(path):
    return [n for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_launcher_function_takes_the_flags():
    # launcher/machine/network.py's main is `python -m launcher.machine.network`, its own command.
    offenders = [f"{p.name}:{f.name}" for p in sorted(LAUNCHER.glob("*.py"))
                 for f in _functions(p)
                 if {a.arg for a in f.args.args + f.args.kwonlyargs} & {"args", "namespace"}]
    assert offenders == []
    assert not any("getattr(args" in p.read_text() for p in LAUNCHER.glob("*.py"))


def test_only_one_function_joins_a_cgroup():
    writers = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tfdist").rglob("*.py")
                     if '"cgroup.procs"), "w"' in p.read_text())
    assert writers == ["tfdist/linux.py"]


def test_the_attempts_share_one_run_context_led_by_the_config():
    import dataclasses as dc
    import inspect

    from tfdist.launcher import attempts

    assert dc.fields(attempts.RunContext)[0].name == "config"
    for fn in (attempts.run_job, attempts.attempts, attempts.reform):
        first = next(iter(inspect.signature(fn).parameters.values()))
        assert first.name == "run" and first.annotation in (attempts.RunContext, "RunContext")


def test_a_relative_task_file_is_the_one_beside_the_launcher(tmp_path, monkeypatch):
    """Every task starts in the project's directory; --task's relative file
    path is made absolute from the launcher's own, so all tasks load that file."""
    from tfdist.cli import launch

    monkeypatch.chdir(tmp_path)
    kind = kinds.get("mirrored")
    member = job.resolve_member(kind, launch.member_args(["--task", "mine/task.py", "--epochs", "2"]))
    assert member.argv()[:2] == ["--task", str(tmp_path / "mine" / "task.py")]
    assert member.options.epochs == 2
    member = job.resolve_member(kind, launch.member_args(["--task=t.py:OBJ"]))
    assert member.task == f"{tmp_path / 't.py'}:OBJ"
    # Built-in names and import paths are not files.
    for spec in ("mnist-cnn", "pkg.mod:NAME"):
        assert job.resolve_member(kind, launch.member_args(["--task", spec])).task == spec
