"""The launcher's pure stages, without a cluster (one test starts a trivial child to read its CPU set)."""

import json
import os
import sys

import pytest

import launch
from strategies import parse_tf_config, resolve_strategy_name


def test_multiworker_cluster_one_tf_config_per_worker():
    tasks = launch.build_cluster("multiworker", 3, ports=[11, 12, 13], host="127.0.0.1")
    assert list(tasks) == ["worker:0", "worker:1", "worker:2"]
    cluster = {"worker": ["127.0.0.1:11", "127.0.0.1:12", "127.0.0.1:13"]}
    for i, (name, tf_config) in enumerate(tasks.items()):
        assert tf_config == {"cluster": cluster, "task": {"type": "worker", "index": i}}
        cfg = parse_tf_config(json.dumps(tf_config))  # our own parser accepts it
        assert cfg.task_name == name and cfg.is_chief == (i == 0)
        assert resolve_strategy_name("auto", cfg) == "multiworker"


def test_ps_cluster_has_a_chief_workers_and_ps():
    tasks = launch.build_cluster("ps", 2, ps=2, ports=[1, 2, 3, 4, 5])
    assert list(tasks) == ["chief:0", "worker:0", "worker:1", "ps:0", "ps:1"]
    assert tasks["ps:1"]["cluster"] == {
        "chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"],
        "ps": ["localhost:4", "localhost:5"],
    }
    assert tasks["ps:1"]["task"] == {"type": "ps", "index": 1}


def test_mirrored_is_one_task_without_tf_config():
    assert launch.build_cluster("mirrored", 1) == {"local:0": None}


@pytest.mark.parametrize("args,words", [
    (("horovod", 2), "unknown --strategy 'horovod'"),
    (("ps", 2, 0), "--ps >= 1"),
    (("multiworker", 2, 1), "takes no ps tasks"),
    (("multiworker", 0), "at least 1 worker"),
    (("mirrored", 2), "one process"),
])
def test_bad_layouts(args, words):
    with pytest.raises(launch.LaunchError, match=words.replace("(", r"\(")):
        launch.build_cluster(*args, ports=list(range(1, 10)))


def test_free_ports_are_distinct():
    ports = launch.free_ports(5)
    assert len(set(ports)) == 5 and all(0 < p < 65536 for p in ports)


@pytest.mark.parametrize("strategy,exits,expected", [
    ("multiworker", {"worker:0": None, "worker:1": None}, None),
    ("multiworker", {"worker:0": 0, "worker:1": None}, None),
    ("multiworker", {"worker:0": None, "worker:1": -9}, -9),
    ("multiworker", {"worker:0": 0, "worker:1": 0}, 0),
    ("ps", {"chief:0": None, "worker:0": -9, "ps:0": None}, None),  # chief reschedules
    ("ps", {"chief:0": 0, "worker:0": None, "ps:0": None}, 0),
    ("ps", {"chief:0": 1, "worker:0": None, "ps:0": None}, 1),
])
def test_decide(strategy, exits, expected):
    assert launch.decide(strategy, exits) == expected


def test_saved_files_replay_each_task(tmp_path):
    tasks = launch.build_cluster("multiworker", 2, ports=[21, 22])
    cmd = launch.task_command("multiworker", ["--epochs", "1"], python="python")
    launch.save_launch_files(str(tmp_path), tasks, cmd)
    for name, tf_config in tasks.items():
        saved = json.loads((tmp_path / f"{name.replace(':', '-')}.tf_config.json").read_text())
        assert saved == tf_config
    script = (tmp_path / "commands.sh").read_text()
    assert script.count("--strategy=multiworker --epochs 1") == 2
    assert "worker-1.tf_config.json" in script


def _probe(answer):
    calls = []

    def probe():
        calls.append(1)
        return answer
    return probe, calls


@pytest.mark.parametrize("mode,strategy,problem,use,warns,probed", [
    ("auto", "multiworker", None, True, False, True),
    ("on", "ps", None, True, False, True),
    ("auto", "ps", "unshare: Operation not permitted", False, True, True),
    ("off", "multiworker", None, False, False, False),   # no probe, no namespace
    ("auto", "mirrored", None, False, False, False),     # one process opens no port
    ("on", "mirrored", "denied", False, False, False),
])
def test_decide_netns(mode, strategy, problem, use, warns, probed):
    probe, calls = _probe(problem)
    got_use, warning = launch.decide_netns(mode, strategy, probe)
    assert got_use is use
    assert (warning is not None) is warns
    assert bool(calls) is probed
    if warns:
        assert problem in warning and "--netns on" in warning and "\n" not in warning


def test_netns_on_without_namespaces_is_an_error_naming_the_cause():
    probe, _ = _probe("unshare: unshare failed: Operation not permitted")
    with pytest.raises(launch.LaunchError, match="Operation not permitted.*--netns auto"):
        launch.decide_netns("on", "multiworker", probe)
    with pytest.raises(launch.LaunchError, match="unknown --netns 'yes'"):
        launch.decide_netns("yes", "multiworker", probe)


def test_netns_command_reruns_this_launcher_inside_and_keeps_the_train_args():
    cmd = launch.netns_command(["--strategy", "ps", "--ps", "1"], ["--epochs", "1"], python="py")
    assert cmd[:4] == ["unshare", "--user", "--map-root-user", "--net"]
    assert cmd[4:6] == ["py", launch.__file__]
    assert cmd[6:] == ["--strategy", "ps", "--ps", "1", launch.INSIDE_FLAG, "--", "--epochs", "1"]
    args, train_args = launch.parse_args(cmd[6:])
    assert args.netns_inside and train_args == ["--epochs", "1"]


def test_inner_launcher_does_not_decide_again(monkeypatch):
    # Inside the namespace a second unshare would nest namespaces forever.
    monkeypatch.setattr(launch, "netns_problem", lambda: pytest.fail("probed inside"))
    monkeypatch.setattr(launch, "start_tasks", lambda *a, **k: [])
    monkeypatch.setattr(launch, "supervise", lambda *a, **k: 0)
    monkeypatch.setattr(launch, "loopback_up", lambda: None)
    monkeypatch.setattr(launch, "save_launch_files", lambda *a: None)
    monkeypatch.setattr(launch, "run_in_netns", lambda *a: pytest.fail("re-entered"))
    monkeypatch.setattr(launch.signal, "signal", lambda *a: None)  # keep pytest's handlers
    assert launch.main(["--strategy", "multiworker", launch.INSIDE_FLAG, "--", "--steps", "1"]) == 0


def test_mnist_prepared_looks_for_a_tfds_copy(tmp_path):
    assert not launch.mnist_prepared(str(tmp_path))
    (tmp_path / "mnist" / "3.0.1").mkdir(parents=True)
    (tmp_path / "mnist" / "3.0.1" / "dataset_info.json").write_text("{}")
    assert launch.mnist_prepared(str(tmp_path))


def test_thread_env_splits_cores_between_computing_tasks():
    mw = launch.build_cluster("multiworker", 2, ports=[1, 2])
    # Each worker also gets cores of its own, and an inter-op pool as large as
    # the host's (a one-thread pool deadlocks a ps worker).
    assert launch.thread_env("multiworker", mw, 8) == {
        "worker:0": {"TF_NUM_INTRAOP_THREADS": "4", "LAUNCH_CPUS": "0,1,2,3",
                     "TF_NUM_INTEROP_THREADS": "8"},
        "worker:1": {"TF_NUM_INTRAOP_THREADS": "4", "LAUNCH_CPUS": "4,5,6,7",
                     "TF_NUM_INTEROP_THREADS": "8"},
    }
    ps = launch.build_cluster("ps", 3, ps=1, ports=[1, 2, 3, 4, 5])
    env = {n: e["TF_NUM_INTRAOP_THREADS"] for n, e in launch.thread_env("ps", ps, 2).items()}
    # The ps chief only dispatches and the ps only applies updates; never below one thread.
    assert env == {"chief:0": "1", "worker:0": "1", "worker:1": "1", "worker:2": "1", "ps:0": "1"}
    ps6 = {n: e["TF_NUM_INTRAOP_THREADS"] for n, e in launch.thread_env("ps", ps, 6).items()}
    assert ps6["worker:0"] == "2" and ps6["chief:0"] == ps6["ps:0"] == "1"
    pinned = {n: e.get("LAUNCH_CPUS") for n, e in launch.thread_env("ps", ps, 6).items()}
    assert pinned == {"chief:0": None, "worker:0": "0,1", "worker:1": "2,3", "worker:2": "4,5",
                      "ps:0": None}
    # More busy tasks than cores: nobody is pinned.
    assert all("LAUNCH_CPUS" not in e for e in launch.thread_env("ps", ps, 2).values())


def test_pinned_task_runs_on_its_own_cores(tmp_path):
    """The CPU set reaches the child process (Linux)."""
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs Linux and 2 usable cores to observe pinning")
    out = tmp_path / "out.txt"
    code = f"import os; open({str(out)!r}, 'w').write(repr(sorted(os.sched_getaffinity(0))))"
    (task,) = launch.start_tasks({"worker:1": None}, [sys.executable, "-c", code], {},
                                 sink=open(os.devnull, "w"),
                                 task_envs={"worker:1": {"LAUNCH_CPUS": "1"}})
    assert task.proc.wait(30) == 0
    assert out.read_text() == "[1]"
# --- fault injection and recovery flags (pure) ------------------------------------

@pytest.mark.parametrize("action,spec,expected", [
    ("kill", "worker:1@20", launch.Fault("kill", "worker:1", seconds=20.0)),
    ("kill", "worker:1@2.5s", launch.Fault("kill", "worker:1", seconds=2.5)),
    ("preempt", "chief:0@step=150", launch.Fault("preempt", "chief:0", step=150)),
    ("kill", " ps:0@step=0 ", launch.Fault("kill", "ps:0", step=0)),
    ("kill", "local:0@step=7", launch.Fault("kill", "local:0", step=7)),
])
def test_parse_fault(action, spec, expected):
    assert launch.parse_fault(action, spec) == expected


@pytest.mark.parametrize("spec", [
    "worker1@20", "worker:1", "worker:x@20", "worker:1@-3", "worker:1@step=abc",
    "@20", "evaluator:0@5", "worker:1@20m", "worker:1@step=", "worker:1@step=5@6",
])
def test_parse_fault_rejects_with_the_expected_form(spec):
    with pytest.raises(launch.LaunchError) as err:
        launch.parse_fault("kill", spec)
    message = str(err.value)
    assert repr(spec) in message and "ROLE:INDEX@WHEN" in message and "@step=" in message


def _args(strategy="ps", kill=None, preempt=None, restart_tasks=False, max_restarts=0,
          restart_delay=2.0):
    import argparse
    return argparse.Namespace(strategy=strategy, kill=kill, preempt=preempt,
                              restart_tasks=restart_tasks, max_restarts=max_restarts,
                              restart_delay=restart_delay)


def test_plan_recovery_checks_tasks_and_flags():
    tasks = launch.build_cluster("ps", 2, ps=1, ports=[1, 2, 3, 4])
    plan = launch.plan_recovery(_args(kill=["worker:1@step=10"], preempt=["chief:0@5"],
                                      restart_tasks=True, max_restarts=2), tasks)
    assert plan.faults == (launch.Fault("kill", "worker:1", step=10),
                           launch.Fault("preempt", "chief:0", seconds=5.0))
    assert plan.restart_tasks and plan.max_restarts == 2
    assert launch.plan_recovery(_args(), tasks) == launch.RecoveryPlan()


@pytest.mark.parametrize("kwargs,words", [
    (dict(kill=["worker:2@5"]), ["worker:2", "does not have", "chief:0, worker:0, worker:1, ps:0"]),
    (dict(preempt=["local:0@5"]), ["local:0", "does not have"]),
    (dict(max_restarts=-1), ["--max-restarts=-1", "0 (never)"]),
    (dict(restart_delay=-1), ["--restart-delay=-1"]),
    (dict(strategy="multiworker", restart_tasks=True), ["--restart-tasks", "--max-restarts"]),
])
def test_plan_recovery_rejects(kwargs, words):
    strategy = kwargs.get("strategy", "ps")
    tasks = (launch.build_cluster("ps", 2, ps=1, ports=[1, 2, 3, 4]) if strategy == "ps"
             else launch.build_cluster(strategy, 2, ports=[1, 2]))
    with pytest.raises(launch.LaunchError) as err:
        launch.plan_recovery(_args(**kwargs), tasks)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("line,step", [
    ("step 150/936 epoch 1 loss 0.1 accuracy 0.9 steps/s 1.0 examples/s 5", 150),
    ("checkpoint saved at step 468: runs/x/checkpoints/ckpt-468", 468),
    ("resumed from runs/x/checkpoints/ckpt-400 at step 400 (global step 400)", None),
    ("stepping 3/4", None),
    ("SUMMARY strategy=ps global_steps=9", None),
])
def test_step_in_line(line, step):
    assert launch.step_in_line(line) == step


def test_fault_injector_fires_each_fault_once_when_due():
    now = [100.0]
    injector = launch.FaultInjector(
        [launch.Fault("kill", "worker:1", step=150), launch.Fault("preempt", "ps:0", seconds=20)],
        log=lambda m: None, clock=lambda: now[0],
    )
    assert injector.due() == []
    injector.on_line("chief:0", "step 149/900 epoch 1 loss 1")
    assert injector.due() == []
    injector.on_line("worker:0", "checkpoint saved at step 152: x")
    assert injector.due() == [launch.Fault("kill", "worker:1", step=150)]
    injector.on_line("chief:0", "step 10/900 epoch 1 loss 1")  # a relaunch starts lower
    assert injector.due() == []
    now[0] = 120.0
    assert injector.due() == [launch.Fault("preempt", "ps:0", seconds=20)]
    assert injector.due() == [] and injector.waiting == []


@pytest.mark.parametrize("code,attempt,max_restarts,expected", [
    (0, 0, 3, False),
    (-9, 0, 1, True),
    (42, 0, 1, True),
    (75, 1, 2, True),
    (75, 2, 2, False),
    (1, 0, 0, False),
    (2, 0, 3, False),    # bad input does not heal
    (124, 0, 3, False),  # nor does a timeout
])
def test_should_relaunch(code, attempt, max_restarts, expected):
    assert launch.should_relaunch(code, attempt, max_restarts) is expected


@pytest.mark.parametrize("flags,words", [
    (["--kill", "worker1@20"], ["'worker1@20'", "ROLE:INDEX@WHEN"]),
    (["--preempt", "worker:5@step=3"], ["worker:5", "does not have"]),
    (["--max-restarts", "-2"], ["--max-restarts=-2"]),
])
def test_bad_fault_flags_exit_2_with_one_line_and_touch_nothing(tmp_path, flags, words):
    import subprocess
    import sys

    from conftest import REPO, child_env
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "results.json").write_text('{"keep": true}\n')
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "--strategy", "ps", "--workers", "2",
         "--ps", "1", *flags, "--", "--model-dir", str(run_dir)],
        env=child_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0]
    assert sorted(p.name for p in run_dir.iterdir()) == ["results.json"]
    assert proc.stdout == ""


def test_train_args_are_read_by_exact_flag_not_prefix():
    # argparse's default abbreviation matching read "--model logreg" as "--model-dir".
    args = ["--model-dir", "runs/x", "--model", "logreg"]
    assert launch._train_arg(args, "--model-dir", "default") == "runs/x"
    assert launch._train_arg(["--model", "logreg"], "--model-dir", "default") == "default"
