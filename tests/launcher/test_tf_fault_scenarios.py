"""TensorFlow's own parameter-server fault scenarios, on real processes through launch.py.

TensorFlow tests its ``ClusterCoordinator`` against these faults in
``tensorflow/python/distribute/coordinator/fault_tolerance_test_base.py``
(in-process servers it stops and starts); here each one is a cluster of real
``train.py`` processes that the launcher kills, preempts and restarts:

1. two workers killed at once (``testTwoWorkersPreempted``);
2. the same worker killed three times (``testWorkerPreemptionMidstFunction`` /
   ``testWorkerContinuousFailure``, one process after another);
3. the ps killed while a worker is being restarted
   (``testPSFailureWhileRecoveryFromWokerFailure``);
4. the chief preempted twice in a row, the second time early in its relaunch;
5. a worker killed in the middle of a multi-step call (``--steps-per-execution
   20``; ``testWorkerPreemptionMidstFunction``).

Every fault fires on an event (a progress step, a task's own steps since it
(re)started: ``@ran=``, another task down: ``@down=``), never after a sleep.
The first tests here are the launcher's parsing and firing of those WHENs
(pure, no TensorFlow).

Step accounting under ps (``results.json``): ``completed_steps`` ==
``scheduled_steps`` == the steps asked for (each scheduled once, none
missing); ``global_steps`` (the ps-held update count) == ``applied_steps`` ==
``scheduled_steps`` + ``reexecuted_steps``, where a killed worker's call may
have applied some of its steps before the coordinator reran it elsewhere:
at most ``--steps-per-execution`` per kill.
"""

import json
import re
import signal
import subprocess
import sys

import pytest

from tfdist import protocol
from conftest import (REPO, child_env, descendants_alive, launch_cmd, read_results,
                      recovery_plan)
from tfdist.launcher import plan as plans
from tfdist.launcher.recovery import faults
from tfdist.launcher.recovery import injector as injectors
from tfdist.launcher.state import JobState, SignalMember, MemberView
from tfdist.strategies import kinds

LOGREG_BAR = 0.90  # softmax regression on MNIST tops out near 0.92-0.93
CNN_BAR = 0.90


# --- the launcher's WHENs for these scenarios (pure) ------------------------------------

@pytest.mark.parametrize("action,spec,expected,text", [
    ("kill", "worker:1@ran=40", faults.Fault("kill", "worker:1", ran=40), "worker:1@ran=40"),
    ("preempt", "chief:0@ran=0", faults.Fault("preempt", "chief:0", ran=0), "chief:0@ran=0"),
    ("kill", "ps:0@down=worker:1", faults.Fault("kill", "ps:0", down="worker:1"),
     "ps:0@down=worker:1"),
])
def test_parse_ran_and_down(action, spec, expected, text):
    fault = faults.parse_fault(action, spec)
    assert fault == expected and str(fault) == f"--{action} {text}"


@pytest.mark.parametrize("spec,words", [
    ("worker:1@ran=", ["'worker:1@ran='", "@ran=40", "@down=worker:1"]),
    ("worker:1@ran=-3", ["'worker:1@ran=-3'", "ROLE:INDEX@WHEN"]),
    ("worker:1@down=worker1", ["'worker:1@down=worker1'", "ROLE:INDEX@WHEN"]),
    ("worker:1@down=worker:1", ["waits for worker:1 itself", "@down= names another task"]),
    ("worker:1@step=5,ran=3", ["'worker:1@step=5,ran=3'"]),
])
def test_parse_ran_and_down_rejects_bad_specs(spec, words):
    with pytest.raises(plans.LaunchError) as err:
        faults.parse_fault("kill", spec)
    for word in words:
        assert word in str(err.value)


def test_a_down_naming_a_task_the_cluster_does_not_have_is_refused():
    tasks = plans.build_cluster(kinds.get("ps"), 2, ps=1, ports=[1, 2, 3, 4])
    with pytest.raises(plans.LaunchError) as err:
        recovery_plan(kinds.get("ps"), tasks, kill=["ps:0@down=worker:5"])
    assert "does not have" in str(err.value) and "ps:0@down=worker:5" in str(err.value)


@pytest.mark.parametrize("flags,words", [
    (["--kill", "ps:0@down=worker:7"], ["ps:0@down=worker:7", "does not have"]),
    (["--preempt", "chief:0@ran=x"], ["'chief:0@ran=x'", "@ran=40"]),
    (["--kill", "worker:0@down=worker:0"], ["itself"]),
])
def test_bad_ran_or_down_flags_exit_2_with_one_line_and_write_nothing(tmp_path, flags, words):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "--strategy", "ps", "--workers", "2",
         "--ps", "1", *flags, "--", "--model-dir", str(run_dir)],
        env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0]
    assert not run_dir.exists() and proc.stdout == ""


TASKS = ("chief:0", "worker:0", "worker:1", "ps:0")


def _state(pids=None, exits=None, attempt=0):
    pids, exits = pids or {}, exits or {}
    return JobState(tuple(MemberView(n, pids.get(n, 100 + i), exits.get(n))
                          for i, n in enumerate(TASKS)), attempt)


def test_kills_of_one_task_fire_in_order_one_per_process(tmp_path):
    chief = str(tmp_path / "chief-0.jsonl")
    log = protocol.EventLog("chief:0", chief)
    injector = injectors.FaultInjector(
        [faults.Fault("kill", "worker:1", step=100), faults.Fault("kill", "worker:1", ran=10),
         faults.Fault("kill", "worker:1", ran=10)],
        log=lambda m: None, event_paths=[chief])
    # worker:1's local steps reach 10 before step 100: the ran=10 kills wait their turn.
    log.emit(protocol.PROGRESS, 50, steps_per_worker={"worker:0": 20, "worker:1": 0})
    assert injector(_state()) == []
    log.emit(protocol.PROGRESS, 80, steps_per_worker={"worker:0": 30, "worker:1": 20})
    assert injector(_state()) == []
    log.emit(protocol.PROGRESS, 100, steps_per_worker={"worker:0": 40, "worker:1": 25})
    assert injector(_state()) == [SignalMember("worker:1", signal.SIGKILL, group=True, pid=102)]
    # Down, then restarted: a new process, counting from the first report after its start.
    assert injector(_state(exits={"worker:1": -9})) == []
    log.emit(protocol.PROGRESS, 120, steps_per_worker={"worker:0": 50, "worker:1": 25})
    assert injector(_state(pids={"worker:1": 202})) == []
    log.emit(protocol.PROGRESS, 140, steps_per_worker={"worker:0": 55, "worker:1": 34})
    assert injector(_state(pids={"worker:1": 202})) == []
    log.emit(protocol.PROGRESS, 160, steps_per_worker={"worker:0": 60, "worker:1": 35})
    assert injector(_state(pids={"worker:1": 202})) == [
        SignalMember("worker:1", signal.SIGKILL, group=True, pid=202)]
    # The same process is never hit twice, however far it runs.
    log.emit(protocol.PROGRESS, 200, steps_per_worker={"worker:0": 60, "worker:1": 80})
    assert injector(_state(pids={"worker:1": 202})) == []
    log.emit(protocol.PROGRESS, 210, steps_per_worker={"worker:0": 60, "worker:1": 80})
    assert injector(_state(pids={"worker:1": 303})) == []
    log.emit(protocol.PROGRESS, 220, steps_per_worker={"worker:0": 60, "worker:1": 90})
    assert injector(_state(pids={"worker:1": 303}))[0].pid == 303
    assert injector.waiting == [] and len(injector.fired) == 3
    assert [(r["pid"], r["target_ran"]) for r in injector.records] == [
        (102, 25), (202, 10), (303, 10)]


def test_ran_counts_a_task_s_own_steps_from_its_process_start(tmp_path):
    # The chief preempted, then again once its relaunched process has run 0 steps
    # past its resumed step (its first step done: the 'started' event).
    chief = str(tmp_path / "chief-0.jsonl")
    log = protocol.EventLog("chief:0", chief)
    injector = injectors.FaultInjector(
        [faults.Fault("preempt", "chief:0", step=300), faults.Fault("preempt", "chief:0", ran=0)],
        log=lambda m: None, event_paths=[chief])
    log.emit(protocol.STARTED, 0)
    log.emit(protocol.PROGRESS, 300)
    (first,) = injector(_state())
    assert first.sig == signal.SIGTERM and first.pid == 100
    log.emit(protocol.PREEMPTED, 340)
    assert injector(_state(exits={"chief:0": 42})) == []
    # The relaunch: every task a new process; the chief has not stepped yet.
    relaunched = {n: 500 + i for i, n in enumerate(TASKS)}
    assert injector(_state(pids=relaunched, attempt=1)) == []
    log.emit(protocol.STARTED, 341)
    (second,) = injector(_state(pids=relaunched, attempt=1))
    assert second.pid == 500 and second.sig == signal.SIGTERM
    assert [(r["attempt"], r["target_ran"]) for r in injector.records] == [(0, 300), (1, 0)]


def test_down_is_due_while_that_task_is_down():
    injector = injectors.FaultInjector(
        [faults.Fault("kill", "ps:0", down="worker:1")], log=lambda m: None)
    assert injector(_state()) == []
    (kill,) = injector(_state(exits={"worker:1": -9}))
    assert kill == SignalMember("ps:0", signal.SIGKILL, group=True, pid=103)
    assert injector.records[0]["target"] == "ps:0" and injector.waiting == []


# --- the scenarios, on real processes ------------------------------------------------------

TRAIN = ["--model", "logreg", "--log-every", "100"]


def _ints(pattern, lines):
    return [int(m.group(1)) for l in lines if (m := re.search(pattern, l))]


def _index(lines, pattern):
    return next(i for i, l in enumerate(lines) if re.search(pattern, l))


def _outcome(model_dir):
    with open(f"{model_dir}/launch/outcome.json") as f:
        return json.load(f)


def _checkpoint_position(model_dir):
    """(completed_steps, global_step) stored in the newest checkpoint."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(f"{model_dir}/checkpoints"))
    return (int(reader.get_tensor("completed_steps/.ATTRIBUTES/VARIABLE_VALUE")),
            int(reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE")))


def _check_ps_accounting(r, steps, kills, per_call):
    """Every requested step scheduled once and none missing; each kill re-applied at
    most one call's steps (the call it cut short)."""
    assert r["completed_steps"] == steps
    assert r["scheduled_steps"] == steps - r["resumed_from_step"]
    assert r["reexecuted_steps"] == r["applied_steps"] - r["scheduled_steps"]
    assert 0 <= r["reexecuted_steps"] <= kills * per_call, r
    # Counted on ps:0 when a call finishes: the cut-short call counts for the worker
    # that reran it (once more if it had finished just as its worker died).
    counted = sum(r["steps_per_worker"].values())
    assert r["scheduled_steps"] <= counted <= r["scheduled_steps"] + kills * per_call, r


def _report(name, r, outcome, **more):
    """One line of measured figures (shown with pytest -s), for docs/reliability.md."""
    keys = ("completed_steps", "scheduled_steps", "applied_steps", "reexecuted_steps",
            "global_steps", "resumed_from_step", "steps_per_worker")
    figures = {k: r.get(k) for k in keys} | {"test_accuracy": round(r["test_accuracy"], 4)}
    figures |= {"faults": [(f["kind"], f["target"], f["at_step"], f.get("attempt"),
                            f.get("target_ran")) for f in outcome["faults"]],
                "restarts": outcome.get("restarts_per_task"),
                "relaunches": outcome["job_relaunches"], **more}
    print(f"\nSCENARIO {name}: {figures}")


def _exits(lines):
    """The launcher's exit lines, in order: (task, code)."""
    return [(m.group(1), int(m.group(2))) for l in lines
            if (m := re.match(r"^\[launch\] (\S+) exited with code (-?\d+)", l))]


def _no_traceback(lines):
    assert not any("Traceback" in l for l in lines), "\n".join(lines[-40:])


@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.timeout(200)
def test_two_workers_killed_at_once_the_job_finishes_with_exact_steps(tmp_path, spawn):
    # TF: testTwoWorkersPreempted. Both kills are due at the same poll (the same
    # progress event), so they land together; worker:0 carries the job while
    # both restart and rejoin.
    model_dir = str(tmp_path / "two")
    p = spawn(launch_cmd("ps", "--workers", "3", "--ps", "1", "--timeout", "150", "--grace", "3",
                         "--kill", "worker:1@step=300", "--kill", "worker:2@step=300",
                         "--restart-tasks", "--restart-delay", "1",
                         train_args=[*TRAIN, "--steps", "1200", "--steps-per-execution", "5",
                                     "--model-dir", model_dir]))
    assert p.wait(180) == 0, p.output
    lines = p.lines
    for w in ("worker:1", "worker:2"):
        assert f"[launch] {w} exited with code -9 (killed by SIGKILL)" in lines
        assert any(l.startswith(f"[launch] restarted {w} (pid ") for l in lines)
    first = _index(lines, r"^\[launch\] fault --kill worker:[12]@step=300: sent SIGKILL")
    after = _ints(r"^\[chief:0\] step (\d+)/1200", lines[first:])
    assert after and after[0] > 300 and after[-1] == 1200
    outcome = _outcome(model_dir)
    kills = outcome["faults"]
    assert sorted(k["target"] for k in kills) == ["worker:1", "worker:2"]
    # The same poll: the same step seen, the same instant recorded.
    assert kills[0]["at_step"] == kills[1]["at_step"] >= 300
    assert kills[0]["at_seconds"] == kills[1]["at_seconds"]
    assert outcome["restarts_per_task"] == {"worker:1": 1, "worker:2": 1}
    assert outcome["exit_code"] == 0 and outcome["job_relaunches"] == 0
    r = read_results(model_dir)
    assert r["resumed_from_step"] == 0
    _check_ps_accounting(r, 1200, kills=2, per_call=5)
    assert r["global_steps"] == r["applied_steps"] == 1200 + r["reexecuted_steps"]
    assert r["test_accuracy"] >= LOGREG_BAR
    assert _checkpoint_position(model_dir) == (1200, r["global_steps"])
    _no_traceback([l for l in lines if l.startswith("[chief:0]")])
    _report('two-workers', r, _outcome(model_dir), exits=_exits(lines))
    assert descendants_alive(model_dir) == []


@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.timeout(300)
def test_the_same_worker_killed_three_times_is_restarted_three_times(tmp_path, spawn):
    # TF: testWorkerContinuousFailure. Each later kill waits for worker:1's next
    # process to have run 20 local steps (@ran=20): it has rejoined and got work.
    # Each restart (1 s delay, TensorFlow's start, rejoining) took ~3,500 of
    # worker:0's steps here: with 8,000 steps the third kill came at 7,214-7,561;
    # 12,000 leave a margin of about one more restart.
    model_dir = str(tmp_path / "thrice")
    p = spawn(launch_cmd("ps", "--workers", "2", "--ps", "1", "--timeout", "240", "--grace", "3",
                         "--kill", "worker:1@step=200", "--kill", "worker:1@ran=20",
                         "--kill", "worker:1@ran=20", "--restart-tasks", "--restart-delay", "1",
                         train_args=["--model", "logreg", "--log-every", "50", "--steps", "12000",
                                     "--steps-per-execution", "5", "--model-dir", model_dir]))
    assert p.wait(270) == 0, p.output
    lines = p.lines
    assert sum(l == "[launch] worker:1 exited with code -9 (killed by SIGKILL)"
               for l in lines) == 3
    assert [n for l in lines for n in _ints(r"^\[launch\] restarted worker:1 \(pid \d+\), same "
                                            r"TF_CONFIG; restart (\d) of at most 3", [l])] == [1, 2, 3]
    assert not any(l.startswith("[launch] never due") for l in lines)
    outcome = _outcome(model_dir)
    kills = outcome["faults"]
    assert [k["target"] for k in kills] == ["worker:1"] * 3 and len(outcome["faults_fired"]) == 3
    assert len({k["pid"] for k in kills}) == 3  # three processes, one after another
    assert all(k["target_ran"] >= 20 for k in kills[1:])
    assert outcome["restarts_per_task"] == {"worker:1": 3} and outcome["task_restarts"] == 3
    r = read_results(model_dir)
    _check_ps_accounting(r, 12000, kills=3, per_call=5)
    assert r["global_steps"] == r["applied_steps"] == 12000 + r["reexecuted_steps"]
    assert r["test_accuracy"] >= LOGREG_BAR
    assert _checkpoint_position(model_dir) == (12000, r["global_steps"])
    _no_traceback([l for l in lines if l.startswith("[chief:0]")])
    _report('thrice', r, _outcome(model_dir), exits=_exits(lines))
    assert descendants_alive(model_dir) == []


@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.timeout(300)
def test_ps_killed_while_a_worker_restarts_the_relaunch_resumes(tmp_path, spawn):
    # TF: testPSFailureWhileRecoveryFromWokerFailure. ps:0 is killed at the first
    # poll that finds worker:1 down, inside its 3 s --restart-delay.
    model_dir = str(tmp_path / "psrec")
    p = spawn(launch_cmd("ps", "--workers", "2", "--ps", "1", "--timeout", "250", "--grace", "3",
                         "--kill", "worker:1@step=300", "--kill", "ps:0@down=worker:1",
                         "--restart-tasks", "--restart-delay", "3", "--max-restarts", "1",
                         train_args=[*TRAIN, "--steps", "1200", "--steps-per-execution", "5",
                                     "--checkpoint-every", "200", "--model-dir", model_dir]))
    assert p.wait(280) == 0, p.output
    lines = p.lines
    down = _index(lines, r"^\[launch\] worker:1 exited with code -9")
    ps_kill = _index(lines, r"^\[launch\] fault --kill ps:0@down=worker:1: sent SIGKILL to ps:0")
    assert down < ps_kill
    relaunch = _index(lines, r"^\[launch\] relaunching the job \(1 of --max-restarts=1\) after "
                             r"exit 75")
    chief = [l for l in lines[:relaunch] if l.startswith("[chief:0] ")]
    errors = [l for l in chief if l.startswith("[chief:0] error:")]
    assert len(errors) == 1, "\n".join(chief[-30:])
    # It names every peer it cannot reach: ps:0, and worker:1 if still down then.
    assert re.search(r"chief:0 lost (worker:1 \(localhost:\d+\), )?ps:0 \(localhost:\d+\) "
                     r"while training at step \d+", errors[0]), errors[0]
    assert "relaunch the same command" in errors[0]
    assert "[launch] chief:0 exited with code 75" in lines[:relaunch]
    _no_traceback([l for l in lines if l.startswith("[chief:0]")])
    saved = _ints(r"^\[chief:0\] checkpoint saved at step (\d+)", lines[:relaunch])
    (resumed,) = _ints(r"^\[chief:0\] resumed from \S+ at step (\d+)", lines[relaunch:])
    # The newest checkpoint announced, or the next one if the kill fell between
    # its write and its line.
    assert max(saved) <= resumed <= max(saved) + 200 and resumed >= 200
    outcome = _outcome(model_dir)
    assert [k["target"] for k in outcome["faults"]] == ["worker:1", "ps:0"]
    assert outcome["job_relaunches"] == 1 and outcome["exit_code"] == 0
    r = read_results(model_dir)
    assert r["resumed_from_step"] == resumed
    # The relaunch lost no worker: every step it scheduled applied exactly once.
    _check_ps_accounting(r, 1200, kills=0, per_call=5)
    assert r["test_accuracy"] >= LOGREG_BAR
    assert _checkpoint_position(model_dir) == (1200, r["global_steps"])
    _report('ps-while-restart', r, _outcome(model_dir), exits=_exits(lines))
    assert descendants_alive(model_dir) == []


@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.timeout(300)
def test_chief_preempted_twice_in_a_row_loses_no_step(tmp_path, spawn):
    # The second SIGTERM hits the relaunched chief at its first step (@ran=0:
    # its 'started' event, right after it resumed).
    model_dir = str(tmp_path / "twice")
    p = spawn(launch_cmd("ps", "--workers", "2", "--ps", "1", "--timeout", "250", "--grace", "10",
                         "--preempt", "chief:0@step=300", "--preempt", "chief:0@ran=0",
                         "--max-restarts", "2", "--restart-delay", "1",
                         train_args=[*TRAIN, "--steps", "1200", "--steps-per-execution", "5",
                                     "--model-dir", model_dir]))
    assert p.wait(280) == 0, p.output
    lines = p.lines
    preempted = _ints(r"^\[chief:0\] preempted: checkpoint saved at step (\d+)", lines)
    resumed = _ints(r"^\[chief:0\] resumed from \S+ at step (\d+)", lines)
    assert len(preempted) == 2 and preempted[0] >= 300, "\n".join(lines[-40:])
    # Each relaunch starts exactly where the preemption saved: zero steps lost.
    assert resumed == preempted
    assert sum(l == "[launch] chief:0 exited with code 42" for l in lines) == 2
    assert sum(l.startswith("[launch] relaunching the job") and "after exit 42" in l
               for l in lines) == 2
    outcome = _outcome(model_dir)
    assert [(k["kind"], k["target"], k["attempt"]) for k in outcome["faults"]] == [
        ("preempt", "chief:0", 0), ("preempt", "chief:0", 1)]
    assert outcome["faults"][1]["target_ran"] == 0
    assert outcome["job_relaunches"] == 2 and outcome["exit_code"] == 0
    r = read_results(model_dir)
    assert r["resumed_from_step"] == preempted[1]
    _check_ps_accounting(r, 1200, kills=0, per_call=5)
    # No worker lost: the ps-held step counts every step exactly once.
    assert r["global_steps"] == 1200
    assert r["test_accuracy"] >= LOGREG_BAR
    assert _checkpoint_position(model_dir) == (1200, 1200)
    _no_traceback(lines)
    _report('preempt-twice', r, _outcome(model_dir), exits=_exits(lines))
    assert descendants_alive(model_dir) == []


# The long tier, as the other scenarios: make test keeps the same fault, a ps worker
# killed mid-run with no step missing (tests/launcher/test_faults.py) (CI time).
@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.timeout(200)
def test_worker_killed_inside_a_multi_step_call_its_call_reruns_elsewhere(tmp_path, spawn):
    # TF: testWorkerPreemptionMidstFunction. Each call runs 20 steps and every
    # worker always has one (8 calls in flight for 2 workers): the kill lands inside
    # one; the coordinator reruns that call on worker:0.
    model_dir = str(tmp_path / "mid")
    p = spawn(launch_cmd("ps", "--workers", "2", "--ps", "1", "--timeout", "150", "--grace", "3",
                         "--kill", "worker:1@step=300",
                         train_args=[*TRAIN, "--steps", "1200", "--steps-per-execution", "20",
                                     "--model-dir", model_dir]))
    assert p.wait(180) == 0, p.output
    lines = p.lines
    assert "[launch] worker:1 exited with code -9 (killed by SIGKILL)" in lines
    (kill,) = _outcome(model_dir)["faults"]
    r = read_results(model_dir)
    _check_ps_accounting(r, 1200, kills=1, per_call=20)
    assert r["global_steps"] == r["applied_steps"] == 1200 + r["reexecuted_steps"]
    # From well after the kill on, worker:1's count stands still and worker:0's
    # grows: worker:0 ran the rest, the cut-short call included.
    later = [tuple(int(n) for n in m.groups()) for l in lines if (m := re.match(
        r"^\[chief:0\] step (\d+)/1200 .*local_steps worker:0=(\d+) worker:1=(\d+)", l))
        and int(m.group(1)) >= kill["at_step"] + 100]
    assert len(later) >= 2, p.output
    per_worker = r["steps_per_worker"]
    assert {w1 for _, _, w1 in later} == {per_worker["worker:1"]}
    assert later[0][1] < later[-1][1] <= per_worker["worker:0"]
    assert r["test_accuracy"] >= LOGREG_BAR
    assert _checkpoint_position(model_dir) == (1200, r["global_steps"])
    _no_traceback([l for l in lines if l.startswith("[chief:0]")])
    _report('mid-call', r, _outcome(model_dir), exits=_exits(lines))
    assert descendants_alive(model_dir) == []
