"""The launcher's pure stages, without a cluster (one test starts a trivial child to read its CPU set)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import recovery_plan

from tfdist.cli import launch
from tfdist import protocol
from tfdist.launcher import attempts, files, job, supervisor
from tfdist.launcher.recovery import faults
from tfdist.launcher.machine import network
from tfdist.launcher.engine import local
from tfdist.launcher.recovery import injector as injectors
from tfdist.launcher import plan as plans
from tfdist.launcher.config import LaunchConfig, MemberArgs
from tfdist.launcher.engine.api import Formation, Placement
from tfdist.options import TrainOptions
from tfdist.strategies import ConfigError, kinds, parse_tf_config

REPO = Path(__file__).resolve().parents[2]


def test_multiworker_cluster_one_tf_config_per_worker():
    tasks = plans.build_cluster(kinds.get("multiworker"), 3, ports=[11, 12, 13], host="127.0.0.1")
    assert list(tasks) == ["worker:0", "worker:1", "worker:2"]
    roles = {"worker": ["127.0.0.1:11", "127.0.0.1:12", "127.0.0.1:13"]}
    for i, (name, tf_config) in enumerate(tasks.items()):
        assert tf_config == {"cluster": roles, "task": {"type": "worker", "index": i}}
        cluster = parse_tf_config(json.dumps(tf_config))  # our own parser accepts it
        assert cluster.member_name == name and cluster.is_chief == (i == 0)
        assert kinds.resolve("auto", cluster).name == "multiworker"


def test_ps_cluster_has_a_chief_workers_and_ps():
    tasks = plans.build_cluster(kinds.get("ps"), 2, ps=2, ports=[1, 2, 3, 4, 5])
    assert list(tasks) == ["chief:0", "worker:0", "worker:1", "ps:0", "ps:1"]
    assert tasks["ps:1"]["cluster"] == {
        "chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"],
        "ps": ["localhost:4", "localhost:5"],
    }
    assert tasks["ps:1"]["task"] == {"type": "ps", "index": 1}


def test_mirrored_is_one_task_without_tf_config():
    assert plans.build_cluster(kinds.get("mirrored"), 1) == {"local:0": None}


@pytest.mark.parametrize("args,words", [
    (("horovod", 2), "unknown --strategy 'horovod'"),
    (("ps", 2, 0), "--ps >= 1"),
    (("multiworker", 2, 1), "takes no ps tasks"),
    (("multiworker", 0), "at least 1 worker"),
    (("mirrored", 2), "one process"),
])
def test_bad_layouts(args, words):
    # An unknown name fails where the launcher turns it into a kind; a bad
    # layout of a known kind fails in the plan, as a LaunchError.
    strategy, *rest = args
    error = plans.LaunchError if strategy in kinds.names() else ConfigError
    with pytest.raises(error, match=words.replace("(", r"\(")):
        plans.build_cluster(kinds.get(strategy), *rest, ports=list(range(1, 10)))


def test_free_ports_are_distinct():
    ports = plans.free_ports(5)
    assert len(set(ports)) == 5 and all(0 < p < 65536 for p in ports)


@pytest.mark.parametrize("strategy,exits,expected", [
    ("multiworker", {"worker:0": None, "worker:1": None}, None),
    ("multiworker", {"worker:0": 0, "worker:1": None}, None),
    ("multiworker", {"worker:0": None, "worker:1": -9}, 75),  # a lost task: relaunch resumes
    ("ps", {"chief:0": -9, "worker:0": None, "ps:0": None}, 75),
    ("multiworker", {"worker:0": 0, "worker:1": 0}, 0),
    ("ps", {"chief:0": None, "worker:0": -9, "ps:0": None}, None),  # chief reschedules
    ("ps", {"chief:0": 0, "worker:0": None, "ps:0": None}, 0),
    ("ps", {"chief:0": 1, "worker:0": None, "ps:0": None}, 1),
])
def test_decide(strategy, exits, expected):
    assert supervisor.decide(kinds.get(strategy), exits) == expected


def test_saved_files_replay_each_task(tmp_path):
    tasks = plans.build_cluster(kinds.get("multiworker"), 2, ports=[21, 22])
    member = MemberArgs(options=TrainOptions(epochs=2))
    config = LaunchConfig(kind=kinds.get("multiworker"), plan=plans.ClusterPlan(tasks),
                          member=member)
    cmd = local.member_command(config, Formation(tasks, member), python="python")
    files.save_launch_files(str(tmp_path), tasks, cmd)
    for name, tf_config in tasks.items():
        saved = json.loads((tmp_path / f"{name.replace(':', '-')}.tf_config.json").read_text())
        assert saved == tf_config
    script = (tmp_path / "commands.sh").read_text()
    assert script.count("--strategy=multiworker --epochs 2") == 2
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
    got_use, warning = network.decide_netns(mode, kinds.get(strategy), probe)
    assert got_use is use
    assert (warning is not None) is warns
    assert bool(calls) is probed
    if warns:
        assert problem in warning and "--netns on" in warning and "\n" not in warning


def test_netns_on_without_namespaces_is_an_error_naming_the_cause():
    probe, _ = _probe("unshare: unshare failed: Operation not permitted")
    with pytest.raises(plans.LaunchError, match="Operation not permitted.*--netns auto"):
        network.decide_netns("on", kinds.get("multiworker"), probe)
    with pytest.raises(plans.LaunchError, match="unknown --netns 'yes'"):
        network.decide_netns("yes", kinds.get("multiworker"), probe)


def test_netns_command_reruns_this_launcher_inside_and_keeps_the_train_args():
    cmd = network.netns_command(["--strategy", "ps", "--ps", "1"], ["--epochs", "1"], python="py")
    assert cmd[:4] == ["unshare", "--user", "--map-root-user", "--net"]
    assert cmd[4:7] == ["py", "-m", launch.__name__]  # the command users run, re-run inside
    assert cmd[7:] == ["--strategy", "ps", "--ps", "1", network.INSIDE_FLAG, "--", "--epochs", "1"]
    args, train_args = launch.parse_args(cmd[7:])
    assert args.netns_inside and train_args == ["--epochs", "1"]


def test_inner_launcher_does_not_decide_again(monkeypatch, tmp_path):
    # Inside the namespace a second unshare would nest namespaces forever.
    monkeypatch.setattr(network, "netns_problem", lambda: pytest.fail("probed inside"))
    monkeypatch.setattr(network, "hosts_problem", lambda: pytest.fail("probed inside"))
    monkeypatch.setattr(attempts, "run_job", lambda *a, **k: 0)
    monkeypatch.setattr(network, "loopback_up", lambda: None)
    monkeypatch.setattr(network, "run_in_netns", lambda *a: pytest.fail("re-entered"))
    monkeypatch.setattr(job.signal, "signal", lambda *a: None)  # keep pytest's handlers
    assert launch.main(["--strategy", "multiworker", network.INSIDE_FLAG, "--", "--steps", "1",
                        "--model-dir", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "launch" / "worker-1.tf_config.json").exists()


def test_mnist_is_prepared_by_a_module_entry_point_not_a_code_string():
    cmd = network.prepare_data_command("/data", python="py")
    assert cmd == ["py", "-m", "tfdist.cli.tools.prepare_data", "--data-dir", "/data"]
    assert network.prepare_data_command("", python="py") == ["py", "-m", "tfdist.cli.tools.prepare_data"]


def test_prepare_data_module_reports_missing_data_in_one_line(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "tfdist.cli.tools.prepare_data", "--data-dir",
                           str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("error: MNIST could not be loaded"), \
        proc.stderr
    assert sum(l.startswith("error:") for l in lines) == 1


def test_mnist_prepared_looks_for_a_tfds_copy(tmp_path):
    assert not network.mnist_prepared(str(tmp_path))
    (tmp_path / "mnist" / "3.0.1").mkdir(parents=True)
    (tmp_path / "mnist" / "3.0.1" / "dataset_info.json").write_text("{}")
    assert network.mnist_prepared(str(tmp_path))


def test_core_shares_split_cores_between_computing_tasks():
    mw = plans.build_cluster(kinds.get("multiworker"), 2, ports=[1, 2])
    # Each worker also gets cores of its own, and an inter-op pool as large as
    # the host's (a one-thread pool deadlocks a ps worker).
    assert plans.share_cores(kinds.get("multiworker"), mw, 8) == {
        "worker:0": plans.CoreShare({"TF_NUM_INTRAOP_THREADS": "4",
                                         "TF_NUM_INTEROP_THREADS": "8"}, (0, 1, 2, 3)),
        "worker:1": plans.CoreShare({"TF_NUM_INTRAOP_THREADS": "4",
                                         "TF_NUM_INTEROP_THREADS": "8"}, (4, 5, 6, 7)),
    }
    ps_kind = kinds.get("ps")
    ps = plans.build_cluster(ps_kind, 3, ps=1, ports=[1, 2, 3, 4, 5])
    env = {n: s.env["TF_NUM_INTRAOP_THREADS"]
           for n, s in plans.share_cores(ps_kind, ps, 2).items()}
    # The ps chief only dispatches and the ps only applies updates; never below one thread.
    assert env == {"chief:0": "1", "worker:0": "1", "worker:1": "1", "worker:2": "1", "ps:0": "1"}
    ps6 = {n: s.env["TF_NUM_INTRAOP_THREADS"]
           for n, s in plans.share_cores(ps_kind, ps, 6).items()}
    assert ps6["worker:0"] == "2" and ps6["chief:0"] == ps6["ps:0"] == "1"
    pinned = {n: s.cpus for n, s in plans.share_cores(ps_kind, ps, 6).items()}
    assert pinned == {"chief:0": (), "worker:0": (0, 1), "worker:1": (2, 3), "worker:2": (4, 5),
                      "ps:0": ()}
    # More busy tasks than cores: nobody is pinned.
    assert all(s.cpus == () for s in plans.share_cores(ps_kind, ps, 2).values())
    # The CPU set is a placement, not an environment variable passed to the task.
    assert all(not any("CPU" in k for k in s.env)
               for s in plans.share_cores(ps_kind, ps, 6).values())


def test_pipeline_stages_share_cores_unpinned():
    kind = kinds.get("pipeline")
    cluster = plans.build_cluster(kind, 2, ports=[1, 2, 3])
    shares = plans.share_cores(kind, cluster, 2)
    # Each stage still sizes its pool to its share, but no stage is pinned.
    assert {n: s.env["TF_NUM_INTRAOP_THREADS"] for n, s in shares.items()} == {
        "chief:0": "1", "worker:0": "1", "worker:1": "1"}
    assert all(s.cpus == () for s in shares.values())
    mw = kinds.get("multiworker")
    assert all(s.cpus for s in plans.share_cores(
        mw, plans.build_cluster(mw, 2, ports=[1, 2]), 2).values())


def test_pinned_task_runs_on_its_own_cores(tmp_path):
    """The CPU set reaches the child process (Linux)."""
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs Linux and 2 usable cores to observe pinning")
    out = tmp_path / "out.txt"
    code = f"import os; open({str(out)!r}, 'w').write(repr(sorted(os.sched_getaffinity(0))))"
    task = local.start_member("worker:1", None, [sys.executable, "-c", code], {},
                              sink=open(os.devnull, "w"), place=Placement(cpus=(1,)))
    assert task.proc.wait(30) == 0
    assert out.read_text() == "[1]"
# --- fault injection and recovery flags (pure) ------------------------------------

@pytest.mark.parametrize("action,spec,expected", [
    ("kill", "worker:1@20", faults.Fault("kill", "worker:1", seconds=20.0)),
    ("kill", "worker:1@2.5s", faults.Fault("kill", "worker:1", seconds=2.5)),
    ("preempt", "chief:0@step=150", faults.Fault("preempt", "chief:0", step=150)),
    ("kill", " ps:0@step=0 ", faults.Fault("kill", "ps:0", step=0)),
    ("kill", "local:0@step=7", faults.Fault("kill", "local:0", step=7)),
    ("kill", "evaluator:0@step=40", faults.Fault("kill", "evaluator:0", step=40)),
])
def test_parse_fault(action, spec, expected):
    assert faults.parse_fault(action, spec) == expected


@pytest.mark.parametrize("spec", [
    "worker1@20", "worker:1", "worker:x@20", "worker:1@-3", "worker:1@step=abc",
    "@20", "trainer:0@5", "worker:1@20m", "worker:1@step=", "worker:1@step=5@6",
])
def test_parse_fault_rejects_with_the_expected_form(spec):
    with pytest.raises(plans.LaunchError) as err:
        faults.parse_fault("kill", spec)
    message = str(err.value)
    assert repr(spec) in message and "ROLE:INDEX@WHEN" in message and "@step=" in message


def _recovery(tasks, strategy="ps", **flags):
    """plan_recovery with the launcher's defaults, as launch.py calls it."""
    return recovery_plan(kinds.get(strategy), tasks, **flags)


def test_plan_recovery_checks_tasks_and_flags():
    tasks = plans.build_cluster(kinds.get("ps"), 2, ps=1, ports=[1, 2, 3, 4])
    plan = _recovery(tasks, kill=["worker:1@step=10"], preempt=["chief:0@5"],
                     restart_tasks=True, max_restarts=2)
    assert plan.faults == (faults.Fault("kill", "worker:1", step=10),
                           faults.Fault("preempt", "chief:0", seconds=5.0))
    assert plan.restart_tasks and plan.max_restarts == 2
    assert _recovery(tasks) == faults.RecoveryPlan()


@pytest.mark.parametrize("kwargs,words", [
    (dict(kill=["worker:2@5"]), ["worker:2", "does not have", "chief:0, worker:0, worker:1, ps:0"]),
    (dict(preempt=["local:0@5"]), ["local:0", "does not have"]),
    (dict(max_restarts=-1), ["--max-restarts=-1", "0 (never)"]),
    (dict(restart_delay=-1), ["--restart-delay=-1"]),
    (dict(strategy="multiworker", restart_tasks=True), ["--restart-tasks", "--max-restarts"]),
])
def test_plan_recovery_rejects(kwargs, words):
    strategy = kwargs.get("strategy", "ps")
    tasks = (plans.build_cluster(kinds.get("ps"), 2, ps=1, ports=[1, 2, 3, 4]) if strategy == "ps"
             else plans.build_cluster(kinds.get(strategy), 2, ports=[1, 2]))
    with pytest.raises(plans.LaunchError) as err:
        _recovery(tasks, **kwargs)
    for word in words:
        assert word in str(err.value)


def test_fault_injector_fires_each_fault_once_when_due(tmp_path):
    now = [100.0]
    chief, worker = str(tmp_path / "chief-0.jsonl"), str(tmp_path / "worker-0.jsonl")
    injector = injectors.FaultInjector(
        [faults.Fault("kill", "worker:1", step=150), faults.Fault("preempt", "ps:0", seconds=20)],
        log=lambda m: None, clock=lambda: now[0], event_paths=[chief, worker],
    )
    assert injector.due() == []
    protocol.EventLog("chief:0", chief).emit(protocol.PROGRESS, 149)
    protocol.EventLog("chief:0", chief).emit(protocol.EVAL, 160)  # not a step report
    assert injector.due() == []
    protocol.EventLog("worker:0", worker).emit(protocol.CHECKPOINT, 152, path="x")
    assert injector.due() == [faults.Fault("kill", "worker:1", step=150)]
    protocol.EventLog("chief:0", chief).emit(protocol.PROGRESS, 10)  # a relaunch starts lower
    assert injector.due() == []
    now[0] = 120.0
    assert injector.due() == [faults.Fault("preempt", "ps:0", seconds=20)]
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
    (65, 0, 3, False),   # nor a diverged run: it would diverge again
])
def test_should_relaunch(code, attempt, max_restarts, expected):
    assert faults.should_relaunch(code, attempt, max_restarts) is expected


@pytest.mark.parametrize("flags,words", [
    (["--kill", "worker1@20"], ["'worker1@20'", "ROLE:INDEX@WHEN"]),
    (["--preempt", "worker:5@step=3"], ["worker:5", "does not have"]),
    (["--max-restarts", "-2"], ["--max-restarts=-2"]),
    # Stuck tasks and partitions.
    (["--hang", "worker:1@20+0"], ["--hang 'worker:1@20+0'", "+SECONDS must be above 0"]),
    (["--hang", "worker:9@5"], ["--hang worker:9@5s", "does not have"]),
    (["--hang", "worker:1"], ["'worker:1'", "ROLE:INDEX@WHEN[+SECONDS]"]),
    (["--partition", "worker:1@5"], ["'worker:1@5'", "hostN@WHEN[+SECONDS]"]),
    (["--partition", "host1@5"], ["--partition host1@5s", "needs --hosts N"]),
    (["--hosts", "2", "--partition", "host2@5+3"], ["host2", "does not have", "host0, host1"]),
    # Simulated hosts, links and slow workers.
    (["--hosts", "9"], ["--hosts=9", "4 task(s)"]),
    (["--hosts", "2", "--link-rate", "fast"], ["--link-rate 'fast'", "100mbit"]),
    (["--link-rate", "1gbit"], ["add --hosts N"]),
    (["--slow", "worker:1=2"], ["--slow 'worker:1=2'", "below 1"]),
    (["--slow", "worker:7=0.5"], ["worker:7", "does not have"]),
    (["--hosts", "2", "--host", "10.0.0.1"], ["--host", "--hosts"]),
    (["--hosts", "2", "--netns", "off"], ["--netns off"]),
    (["--program", "no/such/peer.py"], ["--program", "peer.py", "not a file"]),
])
def test_bad_launcher_flags_exit_2_with_one_line_and_touch_nothing(tmp_path, flags, words):
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


def test_program_replaces_train_py_with_the_same_arguments(tmp_path, monkeypatch):
    # --program: another trainer (a tutorial peer) on the same cluster and flags.
    five = MemberArgs(options=TrainOptions(steps=5))
    config = LaunchConfig(kind=kinds.get("ps"), plan=plans.ClusterPlan({}), member=five)
    formation = Formation({}, five)
    plain = local.member_command(config, formation, python="py")
    peer = local.member_command(dataclasses.replace(config, program="/p/peer.py"), formation,
                                python="py")
    assert tuple(plain[1:3]) == local.TRAIN == ("-m", "tfdist.cli.train")
    assert peer[1] == "/p/peer.py"
    assert plain[3:] == peer[2:] == ["--strategy=ps", "--steps", "5"]
    from tfdist.cli import launch
    from tfdist.launcher import job

    monkeypatch.chdir(REPO)
    args, rest = launch.parse_args(["--strategy", "ps", "--ps", "1", "--program",
                                    "tfdist/bench/peers/keras3_fit.py", "--"])
    program = job.build_config(launch.request_from_args(args, rest)).program
    assert os.path.isabs(program) and program.endswith("tfdist/bench/peers/keras3_fit.py")


def test_train_flags_are_read_by_exact_flag_not_prefix():
    # argparse's default abbreviation matching read "--model logreg" as "--model-dir".
    from tfdist.cli import launch

    member = launch.member_args(["--model-dir", "runs/x", "--model", "logreg"])
    assert member.options.model_dir == "runs/x" and member.model == "logreg"
    assert launch.member_args(["--model", "logreg"]).options.model_dir is None


# --- every task's own check before anything is written; launch.py --dry-run ---------------

def _launch(*argv, cwd):
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=240)


def test_a_bad_train_flag_stops_the_launch_before_launch_dir_is_written(tmp_path):
    run_dir = tmp_path / "run"
    p = _launch("--strategy", "multiworker", "--workers", "2", "--",
                "--learning-rate", "inf", "--model-dir", str(run_dir), cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.splitlines() == [
        "error: --learning-rate=inf is not allowed; it must be a finite number"]
    assert p.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("limit,says", [
    ("gpu=1G", "error: --memory-limit 'gpu=1G': use ROLE=SIZE with a role of this job (chief, "
               "worker, ps), e.g. ps=1200M"),
    ("ps=64M", "error: --memory-limit 'ps=64M' is 64 MiB, below the 256 MiB a TensorFlow task "
               "needs to start; raise it"),
])
def test_a_bad_memory_limit_is_one_line_and_nothing_is_written(tmp_path, limit, says):
    p = _launch("--strategy", "ps", "--ps", "2", "--memory-limit", limit, "--",
                "--steps", "5", "--model-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.splitlines() == [says], p.stderr
    assert p.stdout == "" and list(tmp_path.iterdir()) == []


def test_a_symlinked_launch_dir_is_refused_and_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "launch").symlink_to(elsewhere)
    p = _launch("--strategy", "multiworker", "--", "--steps", "5", "--model-dir", str(run_dir),
                cwd=tmp_path)
    assert p.returncode == 2 and "is a symbolic link" in p.stderr, p.stderr
    assert list(elsewhere.iterdir()) == []


def test_saving_launch_files_replaces_a_planted_file_link(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep")
    launch_dir = tmp_path / "launch"
    launch_dir.mkdir()
    (launch_dir / "commands.sh").symlink_to(target)
    cluster = plans.loopback_plan(kinds.get("multiworker"), 2, 0, False, [1001, 1002], "localhost")
    files.save_launch_files(str(launch_dir), cluster, ["python", "train.py"])
    assert target.read_text() == "keep"
    assert not (launch_dir / "commands.sh").is_symlink()
    assert "worker:1" in (launch_dir / "commands.sh").read_text()


def test_dry_run_shows_every_task_and_the_default_batch_for_three_workers(tmp_path):
    p = _launch("--strategy", "multiworker", "--workers", "3", "--dry-run", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [l.split()[0] for l in lines[:3]] == ["worker:0", "worker:1", "worker:2"]
    assert "write checkpoints" in lines[0] and "keep checkpoints private" in lines[2]
    assert lines[3].startswith("global batch 192 (64 per replica x 3 in sync), 312 steps")
    assert list(tmp_path.iterdir()) == []


def test_train_flags_after_the_separator_are_refused_where_they_belong(tmp_path):
    p = _launch("--strategy", "ps", "--ps", "1", "--", "--dry-run", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.startswith("error: pass --dry-run to launch.py")
    assert len(p.stderr.splitlines()) == 1


@pytest.mark.parametrize("strategy,cluster,expected,task", [
    ("multiworker", {"worker": ["a:1", "b:1", "c:1"]}, 192, "mnist-cnn"),
    ("ps", {"chief": ["a:1"], "worker": ["b:1", "c:1", "d:1"], "ps": ["e:1"]}, 64, "mnist-cnn"),
    ("ps-sync", {"chief": ["a:1"], "worker": ["b:1", "c:1", "d:1"], "ps": ["e:1"]}, 192, "mnist-cnn"),
    ("none", None, 64, "mnist-cnn"),
    # A built-in task's own per-replica batch (ctr: 256).
    ("multiworker", {"worker": ["a:1", "b:1"]}, 512, "ctr"),
    ("none", None, 256, "ctr"),
])
def test_the_default_global_batch_is_per_replica_times_replicas(strategy, cluster, expected, task):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    if cluster:
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": "1"}})
    p = subprocess.run([sys.executable, str(REPO / "train.py"), f"--strategy={strategy}",
                        "--task", task, "--check-only"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["global_batch_size"] == expected


def test_scale_gives_the_first_step_the_launchers_cpu_and_the_jobs_wall_time():
    import time

    from tfdist.launcher import outcome

    started = time.time() - 30.0
    # A relaunch appends to the same events file: the job's first step is the earliest.
    events = {"worker:0": [protocol.Event(protocol.STARTED, "worker:0", 0, started + 12.0),
                           protocol.Event(protocol.STARTED, "worker:0", 50, started + 25.0)],
              "worker:1": [protocol.Event(protocol.STARTED, "worker:1", 0, started + 12.5)]}
    lines = []
    figures = outcome.scale(events, started, lines.append)
    assert figures["first_step_seconds"] == 12.0
    assert 30.0 <= figures["job_seconds"] < 40.0 and figures["launcher_cpu_seconds"] > 0
    assert lines[0].startswith("[launch] launcher CPU ") and "first step 12 s" in lines[0]
    assert outcome.scale({}, started, lines.append)["first_step_seconds"] is None
