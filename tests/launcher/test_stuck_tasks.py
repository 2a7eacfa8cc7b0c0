"""--hang and --partition on real processes: a task stopped and continued, a
host's link down and up again, and nothing left stopped or down afterwards.

The first three run a tiny ``--program`` (no TensorFlow) on every task, so
they see the launcher's mechanics alone; the rest run real jobs through a
hang and check that a stuck task is found within ``--stuck-timeout`` under
every multi-process strategy, printing the time from the launcher's fault
line to the line that reports it (``[detection] ...``, run with ``-s``).
Every wait has a timeout; tests synchronise on the launcher's lines and on
the processes' state in /proc, never on a sleep.
"""

import json
import re
import signal
import time

import pytest

from conftest import descendants_alive, launch_cmd, read_results
from tfdist.launcher.machine import network

pytestmark = pytest.mark.multiprocess

# Each task: print a tick every 0.1 s for SECONDS (argv: the program's flags,
# ignored), then exit 0; a SIGTERM is announced, then exit 0. worker:1 also serves TCP on its
# TF_CONFIG port; worker:0 says each 0.2 s whether it can reach that port.
TICKER = r"""
import json, os, signal, socket, sys, threading, time
def on_term(signum, frame):
    print("SIGTERM received", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
cfg = json.loads(os.environ["TF_CONFIG"])
me = f"{cfg['task']['type']}:{cfg['task']['index']}"
seconds = float(os.environ.get("TICK_SECONDS", "6"))
peer = cfg["cluster"]["worker"][1]
host, port = peer.rsplit(":", 1)
if me == "worker:1":
    srv = socket.create_server(("0.0.0.0", int(port)))
    def serve():
        while True:
            conn, _ = srv.accept()
            conn.close()
    threading.Thread(target=serve, daemon=True).start()
end = time.monotonic() + seconds
while time.monotonic() < end:
    if me == "worker:0" and os.environ.get("PROBE_PEER"):
        try:
            socket.create_connection((host, int(port)), timeout=0.3).close()
            print("reach ok", flush=True)
        except OSError as err:
            print(f"reach fail {type(err).__name__}", flush=True)
    else:
        print("tick", flush=True)
    time.sleep(0.2)
"""


def _program(tmp_path):
    path = tmp_path / "ticker.py"
    path.write_text(TICKER)
    return str(path)


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _wait_state(pid, wanted, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _state(pid)
        if (state == "T") == wanted:
            return state
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} still in state {_state(pid)!r} after {timeout}s")


def _stopped_with(marker):
    """Processes whose command line holds ``marker`` and that are stopped (T)."""
    import subprocess

    out = subprocess.run(["ps", "-eo", "stat,args"], capture_output=True, text=True).stdout
    return [l for l in out.splitlines()[1:] if l.startswith("T") and marker in l]


def _outcome(model_dir):
    with open(f"{model_dir}/launch/outcome.json") as f:
        return json.load(f)


@pytest.mark.long
@pytest.mark.timeout(90)
def test_a_hung_task_is_stopped_then_continued_after_its_seconds(tmp_path, spawn):
    model_dir = str(tmp_path / "hang")
    p = spawn(launch_cmd("multiworker", "--workers", "2", "--timeout", "60", "--grace", "3",
                         "--program", _program(tmp_path), "--hang", "worker:1@1+2",
                         train_args=["--model-dir", model_dir]))
    line = p.wait_for_line(r"^\[launch\] fault --hang worker:1@1s\+2s: sent SIGSTOP", 60)
    pid = int(re.search(r"\(pid (\d+)\)", line).group(1))
    assert "SIGCONT in 2s" in line
    _wait_state(pid, wanted=True)  # stopped: the whole task, alive
    p.wait_for_line(rf"^\[launch\] fault --hang worker:1@1s\+2s lifted: sent SIGCONT to "
                    rf"worker:1 \(pid {pid}\)", 30)
    _wait_state(pid, wanted=False)
    assert p.wait(60) == 0, p.output
    (record,) = _outcome(model_dir)["faults"]
    assert record["kind"] == "hang" and record["target"] == "worker:1"
    assert record["lifted_by"] == "schedule" and record["lift_after"] == 2.0
    assert record["lifted_at_seconds"] >= record["at_seconds"] + 2.0
    assert _stopped_with(model_dir) == [] and descendants_alive(model_dir) == []


# The long tier: the hung-then-continued test above stays in make test (CI time)
@pytest.mark.long
@pytest.mark.timeout(90)
def test_a_task_hung_for_good_is_continued_before_the_launcher_stops_it(tmp_path, spawn):
    # Hung until the end: the job's --timeout stops it. A stopped task cannot
    # act on SIGTERM: the launcher continues it first, so it sees the
    # SIGTERM (before --grace's SIGKILL, which it would never see).
    model_dir = str(tmp_path / "hung")
    p = spawn(launch_cmd("multiworker", "--workers", "2", "--timeout", "4", "--grace", "30",
                         "--program", _program(tmp_path), "--hang", "worker:1@1",
                         train_args=["--model-dir", model_dir]),
              env=None)
    line = p.wait_for_line(r"^\[launch\] fault --hang worker:1@1s: sent SIGSTOP", 60)
    assert "stopped until the launcher ends" in line
    _wait_state(int(re.search(r"\(pid (\d+)\)", line).group(1)), wanted=True)
    assert p.wait(60) == 124, p.output
    lines = p.lines
    assert any(re.match(r"^\[launch\] worker:1 \(pid \d+\) is still hung: SIGCONT before "
                        r"stopping it$", l) for l in lines), p.output
    assert "[worker:1] SIGTERM received" in lines, p.output
    (record,) = _outcome(model_dir)["faults"]
    assert record["lifted_by"] == "launcher cleanup" and record["lift_after"] is None
    assert _stopped_with(model_dir) == [] and descendants_alive(model_dir) == []


HOSTS_PROBLEM = network.hosts_problem()


@pytest.mark.skipif(HOSTS_PROBLEM is not None, reason=f"no simulated hosts here: {HOSTS_PROBLEM}")
@pytest.mark.long
@pytest.mark.timeout(120)
def test_a_partitioned_host_is_unreachable_then_reachable_again(tmp_path, spawn):
    import os

    from conftest import child_env

    model_dir = str(tmp_path / "part")
    env = child_env(PROBE_PEER="1", TICK_SECONDS="10")
    p = spawn(launch_cmd("multiworker", "--workers", "2", "--hosts", "2", "--timeout", "60",
                         "--grace", "3", "--program", _program(tmp_path),
                         "--partition", "host1@3+3", train_args=["--model-dir", model_dir]),
              env=env)
    p.wait_for_line(r"^\[worker:0\] reach ok", 60)
    down = p.wait_for_line(r"^\[launch\] fault --partition host1@3s\+3s: host1's link is down", 30)
    assert "back up in 3s" in down
    up = p.wait_for_line(r"^\[launch\] fault --partition host1@3s\+3s lifted: host1's link is "
                         r"up again", 30)
    assert p.wait(60) == 0, p.output
    lines = p.lines
    i_down, i_up = lines.index(down), lines.index(up)
    during = [l for l in lines[i_down:i_up] if l.startswith("[worker:0] reach")]
    after = [l for l in lines[i_up:] if l.startswith("[worker:0] reach")]
    # The first probe after the down line may have been sent before it.
    assert any(l.startswith("[worker:0] reach fail") for l in during), p.output
    assert after and after[-1] == "[worker:0] reach ok", p.output
    (record,) = _outcome(model_dir)["faults"]
    assert record["kind"] == "partition" and record["target"] == "host1"
    assert record["lifted_by"] == "schedule"
    assert descendants_alive(model_dir) == [] and os.path.isdir(model_dir)


@pytest.mark.long
@pytest.mark.timeout(300)
def test_ps_worker_hung_then_continued_the_job_finishes_with_exact_step_accounting(tmp_path,
                                                                                   spawn):
    model_dir = str(tmp_path / "pshang")
    p = spawn(launch_cmd("ps", "--workers", "2", "--ps", "1", "--timeout", "240", "--grace", "3",
                         "--hang", "worker:1@step=300+15",
                         train_args=["--model", "logreg", "--log-every", "100", "--steps", "1200",
                                     "--steps-per-execution", "5", "--model-dir", model_dir]))
    p.wait_for_line(r"^\[launch\] fault --hang worker:1@step=300\+15s: sent SIGSTOP", 200)
    p.wait_for_line(r"^\[launch\] fault --hang worker:1@step=300\+15s lifted", 60)
    assert p.wait(240) == 0, p.output
    r = read_results(model_dir)
    assert r["completed_steps"] == r["scheduled_steps"] == 1200
    # A stopped worker loses no closure: nothing is re-executed.
    assert r["global_steps"] == r["applied_steps"] == 1200 and r["reexecuted_steps"] == 0
    # 15 s is under the default --stuck-timeout (30 s): a pause, not a stuck worker.
    assert r["stuck_workers"] == []
    assert not any("Traceback" in l for l in p.lines)
    assert _stopped_with(model_dir) == [] and descendants_alive(model_dir) == []


@pytest.mark.timeout(300)
def test_multiworker_hung_worker_the_survivor_ends_with_one_line_naming_it_and_75(tmp_path,
                                                                                  spawn):
    # TensorFlow's coordination service (hosted by worker:0) misses worker:1's
    # heartbeats for --stuck-timeout and aborts the collectives: worker:0
    # stops waiting in the all-reduce and names the stuck task.
    model_dir = str(tmp_path / "mwhung")
    p = spawn(launch_cmd("multiworker", "--workers", "2", "--timeout", "200", "--grace", "3",
                         "--hang", "worker:1@step=300",
                         train_args=["--model", "logreg", "--log-every", "100", "--steps", "1200",
                                     "--stuck-timeout", "5", "--model-dir", model_dir]))
    hung = _seen(p, r"^\[launch\] fault --hang worker:1@step=300: sent SIGSTOP", 200)
    error = _seen(p, r"^\[worker:0\] error:", 90)
    p.wait_for_line(r"^\[launch\] worker:0 exited with code 75$", 30)
    assert p.wait(60) == 75, p.output
    _report("multiworker, worker stopped, --stuck-timeout 5", hung, error)
    survivor = [l for l in p.lines if l.startswith("[worker:0] ")]
    errors = [l for l in survivor if l.startswith("[worker:0] error:")]
    assert len(errors) == 1, "\n".join(survivor[-20:])
    assert "worker:0 lost contact with worker:1 while training" in errors[0]
    assert not any("Traceback" in l for l in survivor)
    (record,) = _outcome(model_dir)["faults"]
    assert record["kind"] == "hang" and record["lifted_by"] == "launcher cleanup"
    assert _stopped_with(model_dir) == [] and descendants_alive(model_dir) == []


# --- found stuck within --stuck-timeout (ps, ps-sync) ---------------------------------

PS_TRAIN = ["--model", "logreg", "--log-every", "100", "--steps-per-execution", "5"]


def _seen(p, pattern, timeout):
    """The line matching ``pattern`` and when this test saw it (monotonic)."""
    line = p.wait_for_line(pattern, timeout)
    return line, time.monotonic()


def _report(what, fault, detected):
    """Print the time from the launcher's fault line to the detecting line."""
    seconds = detected[1] - fault[1]
    print(f"\n[detection] {what}: {seconds:.1f}s from the launcher's fault line to "
          f"{detected[0][:110]!r}", flush=True)
    return seconds


def _one_error(p, member, *words):
    own = [l for l in p.lines if l.startswith(f"[{member}] ")]
    errors = [l for l in own if l.startswith(f"[{member}] error:")]
    assert len(errors) == 1, "\n".join(own[-20:])
    for word in words:
        assert word in errors[0], errors[0]
    assert not any("Traceback" in l for l in own), "\n".join(own[-40:])
    return errors[0]


def _all_exited(p, codes: dict[str, int]):
    """Every task's own exit line says what it should (``None``: stopped by the launcher)."""
    for member, code in codes.items():
        pattern = rf"^\[launch\] {re.escape(member)} exited with code {code}$"
        assert any(re.match(pattern, l) for l in p.lines), (member, code, p.output[-3000:])


def _ps_worker_1_stopped_for_good(spawn, model_dir, timeout, *recovery):
    """ps, 2 workers, 1,200 steps, --stuck-timeout 8; worker:1 stopped for
    good at step 300; ``timeout``: the job's time limit; ``recovery``: the
    launcher's relaunch or restart flags."""
    return spawn(launch_cmd("ps", "--workers", "2", "--ps", "1", "--timeout", str(timeout),
                            "--grace", "3", "--hang", "worker:1@step=300", *recovery,
                            "--restart-delay", "1",
                            train_args=[*PS_TRAIN, "--steps", "1200", "--stuck-timeout", "8",
                                        "--model-dir", model_dir]))


@pytest.mark.long
@pytest.mark.timeout(420)
def test_ps_worker_hung_for_good_steps_go_on_elsewhere_until_a_checkpoint_then_75_and_relaunch(
        tmp_path, spawn):
    # The chief reruns the stuck worker's call on worker:0 and training goes
    # on; the next checkpoint cannot be written while a task of the cluster
    # does not answer (TensorFlow would block the chief's save on it: see
    # docs/reliability.md), so the chief, probing before the save, ends the
    # attempt naming worker:1, and the relaunch resumes from the newest
    # checkpoint.
    model_dir = str(tmp_path / "psreroute")
    p = _ps_worker_1_stopped_for_good(spawn, model_dir, 360, "--max-restarts", "1")
    hung = _seen(p, r"^\[launch\] fault --hang worker:1@step=300: sent SIGSTOP", 200)
    error = _seen(p, r"^\[chief:0\] error:", 90)
    warned = [l for l in p.lines if l.startswith("[chief:0] warning: chief:0: worker:1 (")]
    if warned:
        assert "(--stuck-timeout=8); rerunning its 5 step(s)" in warned[0], warned[0]
        # Ended at the checkpoint (the chief's probe before the save), or by
        # the stall watchdog when TensorFlow's dispatch stalled after the
        # reroute (docs/reliability.md).
        assert ("the checkpoint at step " in error[0]
                or "no training step completed" in error[0]), error[0]
    else:
        # TensorFlow's dispatch stalled before the chief's main thread got
        # back to its wait (seen once, docs/reliability.md): only the
        # stall watchdog can end it.
        assert "no training step completed" in error[0], error[0]
    # One line naming worker:1 whichever way.
    assert "stuck tasks (they accept connections but do not answer): worker:1 (" in error[0]
    assert p.wait(300) == 0, p.output
    _report("ps, worker stopped for good, --stuck-timeout 8 (ended)", hung, error)
    _one_error(p, "chief:0")
    assert any(l == "[launch] chief:0 exited with code 75" for l in p.lines)
    r = read_results(model_dir)
    # The first checkpoint (the epoch's end, step 937) is the one that
    # was refused: the relaunch starts again from step 0 and finishes exactly.
    assert r["resumed_from_step"] == 0, r["resumed_from_step"]
    assert r["completed_steps"] == r["scheduled_steps"] == 1200
    assert r["global_steps"] == 1200 + r["reexecuted_steps"] and r["reexecuted_steps"] >= 0
    assert r["stuck_workers"] == []
    assert not any("Traceback" in l for l in p.lines)
    assert _stopped_with(model_dir) == [] and descendants_alive(model_dir) == []


def _replaced_in_one_attempt(p, model_dir):
    """worker:1, killed as stuck and restarted: no error line, no traceback,
    the hang over with its process, nothing left behind."""
    assert not any(l.startswith("[chief:0] error:") for l in p.lines), p.output[-3000:]
    assert not any("Traceback" in l for l in p.lines)
    (record,) = _outcome(model_dir)["faults"]
    assert record["kind"] == "hang" and record["lifted_by"] == "task gone", record
    assert _stopped_with(model_dir) == [] and descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.timeout(300)
def test_ps_worker_hung_for_good_under_restart_tasks_is_replaced_and_the_job_finishes(
        tmp_path, spawn):
    # The chief reports the stuck worker (a typed event); the launcher, as a
    # cluster manager's liveness check would, kills it and restarts it; the
    # coordinator recovers from a dead worker as it always does, and the job
    # finishes in one attempt with exact accounting.
    model_dir = str(tmp_path / "psreplace")
    p = _ps_worker_1_stopped_for_good(spawn, model_dir, 240, "--restart-tasks")
    hung = _seen(p, r"^\[launch\] fault --hang worker:1@step=300: sent SIGSTOP", 200)
    killed = _seen(p, r"^\[launch\] worker:1 \(pid \d+\) is stuck \(chief:0 found it", 60)
    p.wait_for_line(r"^\[launch\] restarted worker:1 ", 60)
    assert p.wait(200) == 0, p.output
    _report("ps, worker stopped for good, --restart-tasks, --stuck-timeout 8 (killed)", hung,
            killed)
    r = read_results(model_dir)
    assert r["completed_steps"] == r["scheduled_steps"] == 1200
    assert r["global_steps"] == r["applied_steps"] == 1200 + r["reexecuted_steps"]
    assert r["reexecuted_steps"] >= 0
    assert [s["worker"] for s in r["stuck_workers"]] in ([], ["worker:1"]), r["stuck_workers"]
    _replaced_in_one_attempt(p, model_dir)


@pytest.mark.long
@pytest.mark.timeout(300)
def test_ps_worker_hung_past_the_bound_then_continued_rejoins(tmp_path, spawn):
    model_dir = str(tmp_path / "psrejoin")
    p = spawn(launch_cmd("ps", "--workers", "2", "--ps", "1", "--timeout", "240", "--grace", "3",
                         "--hang", "worker:1@step=300+15",
                         train_args=[*PS_TRAIN, "--steps", "6000", "--stuck-timeout", "8",
                                     "--model-dir", model_dir]))
    hung = _seen(p, r"^\[launch\] fault --hang worker:1@step=300\+15s: sent SIGSTOP", 200)
    warned = _seen(p, r"^\[chief:0\] warning: chief:0: worker:1 \(", 60)
    p.wait_for_line(r"^\[launch\] fault --hang worker:1@step=300\+15s lifted", 60)
    assert p.wait(200) == 0, p.output
    _report("ps, worker stopped 15 s, --stuck-timeout 8", hung, warned)
    r = read_results(model_dir)
    assert r["completed_steps"] == r["scheduled_steps"] == 6000
    # The stuck call ran to its end once continued: its steps were applied
    # twice (once by the rerun), and counted so.
    assert r["global_steps"] == r["applied_steps"] == 6000 + r["reexecuted_steps"]
    (stuck,) = r["stuck_workers"]
    assert stuck["worker"] == "worker:1" and stuck["outcome"] == "rejoined", stuck
    assert stuck["came_back"] is True
    # Back, it ran more calls than the stuck one.
    assert stuck["steps_after"] > stuck["rerouted_steps"], stuck
    assert r["reexecuted_steps"] == stuck["rerouted_steps"]
    assert not any("Traceback" in l for l in p.lines)
    assert _stopped_with(model_dir) == [] and descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ps", "ps-sync"])
def test_a_stuck_ps_task_ends_the_chief_with_one_line_naming_it_and_75(strategy, tmp_path,
                                                                         spawn):
    model_dir = str(tmp_path / "pshung")
    p = spawn(launch_cmd(strategy, "--workers", "2", "--ps", "1", "--timeout", "240",
                         "--grace", "3", "--hang", "ps:0@step=300",
                         train_args=[*PS_TRAIN, "--steps", "1200", "--stuck-timeout", "8",
                                     "--model-dir", model_dir]))
    hung = _seen(p, r"^\[launch\] fault --hang ps:0@step=300: sent SIGSTOP", 200)
    error = _seen(p, r"^\[chief:0\] error:", 60)
    assert p.wait(60) == 75, p.output
    _report(f"{strategy}, ps:0 stopped, --stuck-timeout 8", hung, error)
    _one_error(p, "chief:0", "ps:0 (")
    _all_exited(p, {"chief:0": 75})
    (record,) = _outcome(model_dir)["faults"]
    assert record["target"] == "ps:0" and record["lifted_by"] == "launcher cleanup"
    assert _stopped_with(model_dir) == [] and descendants_alive(model_dir) == []


def _ps_sync_worker_1_stopped(spawn, model_dir, at_step, log_every):
    """ps-sync, K = N = 2, checkpoints every 100 of 600 steps; worker:1
    stopped for good when the launcher sees ``at_step`` (progress every
    ``log_every``); one relaunch allowed."""
    return spawn(launch_cmd("ps-sync", "--workers", "2", "--ps", "1", "--timeout", "360",
                            "--grace", "3", "--hang", f"worker:1@step={at_step}",
                            "--max-restarts", "1", "--restart-delay", "1",
                            train_args=["--model", "logreg", "--log-every", str(log_every),
                                        "--steps", "600", "--checkpoint-every", "100",
                                        "--stuck-timeout", "8", "--model-dir", model_dir]))


@pytest.mark.long
@pytest.mark.timeout(420)
def test_ps_sync_k_equals_n_stuck_worker_is_named_75_and_the_relaunch_finishes(tmp_path,
                                                                                 spawn):
    # Stopped between checkpoints (every 100): no update completes, and the
    # stall watchdog names it (a stop as a checkpoint is due: the next test).
    model_dir = str(tmp_path / "syncstuck")
    p = _ps_sync_worker_1_stopped(spawn, model_dir, at_step=250, log_every=50)
    hung = _seen(p, r"^\[launch\] fault --hang worker:1@step=250: sent SIGSTOP", 200)
    error = _seen(p, r"^\[chief:0\] error:", 60)
    assert "(--stuck-timeout); stuck tasks (they accept connections but do not answer): " \
           "worker:1 (" in error[0], error[0]
    assert "worker:0" not in error[0]
    assert p.wait(300) == 0, p.output
    _report("ps-sync K=N, worker stopped, --stuck-timeout 8", hung, error)
    _one_error(p, "chief:0")
    lines = p.lines
    assert any(l == "[launch] chief:0 exited with code 75" for l in lines)
    assert not any("Traceback" in l for l in lines), "\n".join(lines[-40:])
    r = read_results(model_dir)
    # Resumed from the newest checkpoint (every 100 steps; stopped at 250).
    assert r["resumed_from_step"] == 200, r["resumed_from_step"]
    assert r["global_steps"] == 600 and r["applied_steps"] == 600 - r["resumed_from_step"]
    assert r["aggregated_gradients"] == 2 * r["applied_steps"]
    assert r["stuck_workers"] == []
    assert _stopped_with(model_dir) == [] and descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.timeout(420)
def test_a_worker_stopped_as_a_checkpoint_is_due_ends_the_chief_in_one_line_and_the_relaunch_finishes(
        tmp_path, spawn):
    """The launcher stops worker:1 when it sees step 300, the step the chief
    checkpoints at: the stop lands before the save (the chief's probe finds
    it: exit 75) or inside it (TensorFlow blocks the save holding the GIL;
    the chief's guard process ends it: SIGKILL). One line either way."""
    model_dir = str(tmp_path / "savestuck")
    p = _ps_sync_worker_1_stopped(spawn, model_dir, at_step=300, log_every=100)
    hung = _seen(p, r"^\[launch\] fault --hang worker:1@step=300: sent SIGSTOP", 200)
    error = _seen(p, r"^\[chief:0\] error:", 60)
    assert "stuck tasks (they accept connections but do not answer): worker:1 (" in error[0], \
        error[0]
    assert "worker:0" not in error[0]
    assert p.wait(300) == 0, p.output
    _report("ps-sync K=N, worker stopped as a checkpoint is due, --stuck-timeout 8", hung, error)
    _one_error(p, "chief:0")
    lines = p.lines
    ended = [l for l in lines if l.startswith("[launch] chief:0 exited with code ")]
    assert ended[0] in ("[launch] chief:0 exited with code 75",
                        "[launch] chief:0 exited with code -9 (killed by SIGKILL)"), ended
    if ended[0].endswith("75"):
        assert "the checkpoint at step 300 would wait" in error[0] \
            or "no training step completed" in error[0], error[0]
    else:
        assert "the checkpoint save at step 300 has waited over 8s" in error[0], error[0]
    r = read_results(model_dir)
    assert r["resumed_from_step"] in (200, 300), r["resumed_from_step"]
    assert r["global_steps"] == 600 and r["applied_steps"] == 600 - r["resumed_from_step"]
    assert r["aggregated_gradients"] == 2 * r["applied_steps"]
    assert _stopped_with(model_dir) == [] and descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.timeout(420)
def test_ps_sync_a_stuck_backup_worker_updates_go_on_until_a_checkpoint_then_75_and_relaunch(
        tmp_path, spawn):
    # K = 2 of 3: worker:0 and worker:2 make every update without worker:1;
    # the next checkpoint would block on the stuck task (as under ps): the
    # chief ends the attempt naming it, the relaunch finishes exactly.
    model_dir = str(tmp_path / "syncbackup")
    p = spawn(launch_cmd("ps-sync", "--workers", "3", "--ps", "1", "--timeout", "360",
                         "--grace", "3", "--hang", "worker:1@step=200", "--max-restarts", "1",
                         "--restart-delay", "1",
                         train_args=["--model", "logreg", "--log-every", "100", "--steps", "900",
                                     "--replicas-to-aggregate", "2", "--stuck-timeout", "8",
                                     "--checkpoint-every", "300", "--model-dir", model_dir]))
    hung = _seen(p, r"^\[launch\] fault --hang worker:1@step=200: sent SIGSTOP", 200)
    # Updates went on without worker:1 (K = 2 live workers).
    on = _seen(p, r"^\[chief:0\] step 300/900 ", 60)
    error = _seen(p, r"^\[chief:0\] error:", 60)
    assert "the checkpoint at step 300 " in error[0], error[0]
    assert "stuck tasks (they accept connections but do not answer): worker:1 (" in error[0]
    assert p.wait(300) == 0, p.output
    _report("ps-sync K=2 of 3, backup stopped, --stuck-timeout 8 (ended at the checkpoint)",
            hung, error)
    _one_error(p, "chief:0")
    r = read_results(model_dir)
    assert r["resumed_from_step"] in (0, 300), r["resumed_from_step"]
    assert r["global_steps"] == 900 and r["applied_steps"] == 900 - r["resumed_from_step"]
    assert r["aggregated_gradients"] == 2 * r["applied_steps"]
    assert r["stale_gradients_applied"] == 0
    assert not any("Traceback" in l for l in p.lines)
    assert _stopped_with(model_dir) == [] and descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.timeout(420)
def test_ps_sync_a_stuck_backup_under_restart_tasks_is_replaced_at_the_checkpoint_and_the_job_finishes(
        tmp_path, spawn):
    # K = 2 of 3: updates go on without worker:1; at the checkpoint the
    # chief's probe finds it stuck and reports it; the launcher kills and
    # restarts it (a restarting task refuses connections and does not hold
    # a save), so the save goes ahead and the job ends in one attempt.
    model_dir = str(tmp_path / "syncreplace")
    p = spawn(launch_cmd("ps-sync", "--workers", "3", "--ps", "1", "--timeout", "360",
                         "--grace", "3", "--hang", "worker:1@step=200", "--restart-tasks",
                         "--restart-delay", "1",
                         train_args=["--model", "logreg", "--log-every", "100", "--steps", "900",
                                     "--replicas-to-aggregate", "2", "--stuck-timeout", "8",
                                     "--checkpoint-every", "300", "--model-dir", model_dir]))
    hung = _seen(p, r"^\[launch\] fault --hang worker:1@step=200: sent SIGSTOP", 200)
    killed = _seen(p, r"^\[launch\] worker:1 \(pid \d+\) is stuck \(chief:0 found it", 90)
    p.wait_for_line(r"^\[chief:0\] checkpoint saved at step 300:", 90)
    assert p.wait(300) == 0, p.output
    _report("ps-sync K=2 of 3, backup stopped, --restart-tasks, --stuck-timeout 8 (killed at the "
            "checkpoint)", hung, killed)
    r = read_results(model_dir)
    assert r["resumed_from_step"] == 0 and r["global_steps"] == r["applied_steps"] == 900
    assert r["aggregated_gradients"] == 2 * 900 and r["stale_gradients_applied"] == 0
    _replaced_in_one_attempt(p, model_dir)
