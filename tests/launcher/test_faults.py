"""Faults injected by the launcher into real loopback clusters, and the recovery.

Every fault fires when a step is reached (``@step=N``: a progress or
checkpoint line), never after a sleep. The models are logreg, to keep CI
fast: softmax regression tops out near 0.92-0.93 on MNIST and reaches
~0.92 in a few hundred steps here, so ``>= 0.90`` says the recovered model
is trained (a restart from scratch or a broken restore scores lower or ~0.1).
"""

import re

import pytest

from conftest import descendants_alive, launch_cmd, read_results

pytestmark = pytest.mark.multiprocess

LOGREG_BAR = 0.90
TRAIN = ["--model", "logreg", "--log-every", "100"]


def _checkpoint_position(model_dir):
    """(completed_steps, global_step) stored in the newest checkpoint."""
    import tensorflow as tf

    path = tf.train.latest_checkpoint(f"{model_dir}/checkpoints")
    reader = tf.train.load_checkpoint(path)
    return (int(reader.get_tensor("completed_steps/.ATTRIBUTES/VARIABLE_VALUE")),
            int(reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE")))


def _ints(pattern, lines):
    return [int(m.group(1)) for l in lines if (m := re.search(pattern, l))]


def _index(lines, pattern):
    return next(i for i, l in enumerate(lines) if re.search(pattern, l))


@pytest.mark.long  # make test: the soak's ps job survives one fault
@pytest.mark.timeout(200)
def test_ps_lost_worker_training_goes_on_and_no_step_is_missing(tmp_path, spawn):
    model_dir = str(tmp_path / "pswk")
    p = spawn(launch_cmd("ps", "--workers", "2", "--ps", "1", "--timeout", "150", "--grace", "3",
                         "--kill", "worker:1@step=300",
                         train_args=[*TRAIN, "--steps", "1200", "--steps-per-execution", "5",
                                     "--model-dir", model_dir]))
    assert p.wait(180) == 0, p.output
    lines = p.lines
    fault = _index(lines, r"^\[launch\] fault --kill worker:1@step=300: sent SIGKILL")
    assert any(l.startswith("[launch] worker:1 exited with code -9") for l in lines)
    # Training went on without worker:1: progress after the kill, to the end.
    after = _ints(r"^\[chief:0\] step (\d+)/1200", lines[fault:])
    assert after and after[-1] == 1200 and after[0] > 300
    r = read_results(model_dir)
    assert r["completed_steps"] == r["scheduled_steps"] == 1200 and r["resumed_from_step"] == 0
    # No scheduled step missing; a closure caught by the kill may have run twice.
    assert r["applied_steps"] >= r["scheduled_steps"]
    assert r["reexecuted_steps"] == r["applied_steps"] - r["scheduled_steps"]
    assert r["global_steps"] == r["applied_steps"]
    assert r["test_accuracy"] >= LOGREG_BAR
    assert _checkpoint_position(model_dir) == (1200, r["global_steps"])
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.timeout(200)
def test_ps_restarted_worker_rejoins_and_gets_work(tmp_path, spawn):
    # One worker: the run can only finish if the restarted one is given work.
    model_dir = str(tmp_path / "psrs")
    p = spawn(launch_cmd("ps", "--workers", "1", "--ps", "1", "--timeout", "150", "--grace", "3",
                         "--kill", "worker:0@step=300", "--restart-tasks", "--restart-delay", "1",
                         train_args=[*TRAIN, "--steps", "800", "--steps-per-execution", "5",
                                     "--model-dir", model_dir]))
    assert p.wait(180) == 0, p.output
    lines = p.lines
    restarted = _index(lines, r"^\[launch\] restarted worker:0 \(pid \d+\), same TF_CONFIG")
    assert _ints(r"^\[chief:0\] step (\d+)/800", lines[restarted:])[-1] == 800
    assert any("task restarts 1" in l for l in lines)
    r = read_results(model_dir)
    assert r["completed_steps"] == r["scheduled_steps"] == 800
    assert r["applied_steps"] >= 800 and r["reexecuted_steps"] == r["applied_steps"] - 800
    # Counted on ps:0 per finished call: the lost worker's unfinished call
    # counts once, when its rerun finishes (at most one more call if it
    # finished just as the worker died).
    assert 800 <= r["steps_per_worker"]["worker:0"] <= 800 + 5
    assert r["test_accuracy"] >= LOGREG_BAR
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.timeout(300)
def test_ps_lost_ps_task_then_lost_chief_relaunch_resumes_each_time(tmp_path, spawn):
    model_dir = str(tmp_path / "psps")
    p = spawn(launch_cmd("ps", "--workers", "2", "--ps", "1", "--timeout", "250", "--grace", "3",
                         "--kill", "ps:0@step=400", "--kill", "chief:0@step=900",
                         "--max-restarts", "2", "--restart-delay", "1",
                         train_args=[*TRAIN, "--steps", "1200", "--steps-per-execution", "5",
                                     "--checkpoint-every", "200", "--model-dir", model_dir]))
    assert p.wait(280) == 0, p.output
    lines = p.lines
    chief = [l for l in lines if l.startswith("[chief:0] ")]
    # Losing the ps: one line naming it, no Python or gRPC stack, exit 75.
    errors = [l for l in chief if l.startswith("[chief:0] error:")]
    assert len(errors) == 1, "\n".join(chief[-30:])
    assert "lost ps:0 (localhost:" in errors[0] and "relaunch the same command" in errors[0]
    assert not any("Traceback" in l for l in chief)
    assert any(l == "[launch] chief:0 exited with code 75" for l in lines)
    assert any(l == "[launch] chief:0 exited with code -9 (killed by SIGKILL)" for l in lines)
    assert sum(l.startswith("[launch] relaunching the job") for l in lines) == 2
    # Each relaunch resumed from the newest checkpoint written before its fault.
    saved = [(i, s) for i, l in enumerate(lines)
             for s in _ints(r"^\[chief:0\] checkpoint saved at step (\d+)", [l])]
    resumed = [(i, s) for i, l in enumerate(lines)
               for s in _ints(r"^\[chief:0\] resumed from \S+ at step (\d+)", [l])]
    assert len(resumed) == 2
    for i, step in resumed:
        # The newest one announced, or the next one if the kill fell between
        # its write and its line.
        newest = max(s for j, s in saved if j < i)
        assert newest <= step <= newest + 200, (step, newest)
    assert resumed[0][1] in (200, 400) and resumed[1][1] >= 800
    r = read_results(model_dir)
    assert r["completed_steps"] == 1200 and r["resumed_from_step"] == resumed[1][1]
    assert r["scheduled_steps"] == 1200 - resumed[1][1]
    assert r["test_accuracy"] >= LOGREG_BAR
    assert _checkpoint_position(model_dir)[0] == 1200
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.timeout(240)
def test_multiworker_lost_worker_fails_fast_and_relaunch_resumes(tmp_path, spawn):
    model_dir = str(tmp_path / "mwk")
    p = spawn(launch_cmd("multiworker", "--workers", "2", "--timeout", "200", "--grace", "3",
                         "--kill", "worker:1@step=300", "--max-restarts", "1",
                         "--restart-delay", "1",
                         train_args=[*TRAIN, "--steps", "700", "--checkpoint-every", "100",
                                     "--model-dir", model_dir]))
    p.wait_for_line(r"^\[launch\] fault --kill worker:1@step=300", timeout=150)
    # Bounded: the survivor fails (or is stopped) and the job is relaunched.
    p.wait_for_line(r"^\[launch\] relaunching the job", timeout=60)
    assert p.wait(150) == 0, p.output
    lines = p.lines
    assert any(l == "[launch] worker:1 exited with code -9 (killed by SIGKILL)" for l in lines)
    first = lines[:_index(lines, r"^\[launch\] relaunching the job")]
    announced = _ints(r"^\[worker:0\] checkpoint saved at step (\d+)", first)
    r = read_results(model_dir)
    # The kill cannot be ahead of worker:1 by more than a step or so: the
    # all-reduce holds worker:0 back; its last checkpoint is where it resumes.
    assert r["resumed_from_step"] == max(announced) and 200 <= max(announced) <= 400
    assert r["global_steps"] == 700 and r["steps_this_run"] == 700 - r["resumed_from_step"]
    assert r["test_accuracy"] >= LOGREG_BAR
    hashes = {l.rsplit("weights_sha256=", 1)[1] for l in lines if "weights_sha256=" in l
              and not l.startswith("[launch]")}
    assert hashes == {r["weights_sha256"]}
    assert _checkpoint_position(model_dir) == (700, 700)
    assert descendants_alive(model_dir) == []


@pytest.mark.timeout(240)
def test_multiworker_preemption_checkpoints_at_an_agreed_step_and_loses_none(tmp_path, spawn):
    model_dir = str(tmp_path / "mwp")
    p = spawn(launch_cmd("multiworker", "--workers", "2", "--timeout", "200", "--grace", "10",
                         "--preempt", "worker:1@step=300", "--max-restarts", "1",
                         "--restart-delay", "1",
                         train_args=[*TRAIN, "--steps", "700", "--model-dir", model_dir]))
    assert p.wait(230) == 0, p.output
    lines = p.lines
    at = {w: _ints(rf"^\[{w}\] preempted: checkpoint saved at step (\d+)", lines)
          for w in ("worker:0", "worker:1")}
    assert len(at["worker:0"]) == 1 and at["worker:0"] == at["worker:1"], at
    step = at["worker:0"][0]
    assert 300 <= step < 500
    assert sum(l.startswith("[launch] worker:") and l.endswith("exited with code 42")
               for l in lines) == 2
    assert any(l.startswith("[launch] relaunching the job") and "after exit 42" in l for l in lines)
    assert not any("Traceback" in l for l in lines), "\n".join(lines[-40:])
    assert {f"[worker:{i}] resumed from" for i in (0, 1)} <= {
        l.split(" ", 2)[0] + " resumed from" for l in lines if " resumed from " in l}
    r = read_results(model_dir)
    # Zero steps lost: the relaunch starts exactly where the preemption saved.
    assert r["resumed_from_step"] == step
    assert r["global_steps"] == 700 and r["steps_this_run"] == 700 - step
    assert r["test_accuracy"] >= LOGREG_BAR
    assert _checkpoint_position(model_dir) == (700, 700)
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.timeout(200)
def test_kill_while_checkpointing_every_step_never_breaks_the_resume(tmp_path, spawn):
    """A checkpoint every step, so the kill very likely lands inside a write."""
    model_dir = str(tmp_path / "ckk")
    p = spawn(launch_cmd("mirrored", "--workers", "1", "--timeout", "150", "--grace", "3",
                         "--kill", "local:0@step=150", "--max-restarts", "1",
                         "--restart-delay", "0",
                         train_args=["--model", "logreg", "--log-every", "50", "--steps", "300",
                                     "--checkpoint-every", "1", "--model-dir", model_dir]))
    assert p.wait(180) == 0, p.output
    lines = p.lines
    assert any(l == "[launch] local:0 exited with code -9 (killed by SIGKILL)" for l in lines)
    # The first attempt's lines are all out before the relaunch is logged.
    first = lines[:_index(lines, r"^\[launch\] relaunching the job")]
    announced = _ints(r"^\[local:0\] checkpoint saved at step (\d+)", first)
    r = read_results(model_dir)
    # The newest announced checkpoint, or the next one if the kill fell
    # between its write and its line; never an unreadable one, never 0.
    assert max(announced) <= r["resumed_from_step"] <= max(announced) + 1
    assert r["global_steps"] == 300 and r["steps_this_run"] == 300 - r["resumed_from_step"]
    assert descendants_alive(model_dir) == []
