"""Synchronous parameter servers (``--strategy ps-sync``): the plan, and real loopback runs.

The runs use logreg (softmax regression tops out near 0.92 on MNIST and
reaches ~0.91 in 300 steps here), so they stay short on shared CPUs.
"""

import json
import subprocess
import sys

import pytest

from conftest import REPO, child_env, descendants_alive, launch_cmd, read_results

CLUSTER = {"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"],
           "ps": ["localhost:4"]}
# Startup (TF import, connecting, tracing) took 13-70 s on the shared 2-core host.
TRAIN = ["--model", "logreg", "--log-every", "100", "--startup-timeout", "180"]


def _train(role, *args, cluster=CLUSTER):
    tf_config = {"cluster": cluster, "task": {"type": role, "index": 0}}
    return subprocess.run([sys.executable, "train.py", "--strategy", "ps-sync", *args],
                          cwd=REPO, env=child_env(tf_config=tf_config),
                          capture_output=True, text=True, timeout=120)


# --- the plan (no TensorFlow server starts) ---------------------------------------


def test_dry_run_explains_each_role():
    plans = {}
    for role in ("chief", "worker", "ps"):
        proc = _train(role, "--dry-run")
        assert proc.returncode == 0, proc.stderr
        plans[role] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {p["strategy"] for p in plans.values()} == {"ps-sync"}
    assert "K fresh gradients" in plans["chief"]["action"]
    assert "dropped" in plans["chief"]["action"]
    assert "global/K examples" in plans["worker"]["action"]
    assert "gradient queues" in plans["ps"]["action"]


@pytest.mark.parametrize("args, message", [
    (["--replicas-to-aggregate", "3"], "--replicas-to-aggregate=3 is more than the 2 worker(s)"),
    (["--replicas-to-aggregate", "0"], "--replicas-to-aggregate=0 is not allowed"),
    (["--global-batch-size", "100", "--replicas-to-aggregate", "3"], "more than the 2"),
    (["--global-batch-size", "129"], "--global-batch-size=129 does not split into 2 gradients"),
])
def test_bad_aggregation_is_one_line_and_exit_2(args, message):
    proc = _train("chief", *args, "--dry-run")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert message in proc.stderr


def test_a_dry_run_refuses_bad_aggregation_before_tensorflow_is_imported():
    """A dry run lists GPUs with TensorFlow (seconds to import), but only after the
    checks that need none: bad flags are answered at once."""
    script = ("import sys, train\n"
              "code = train.main(['--strategy', 'ps-sync', '--replicas-to-aggregate', '3',"
              " '--dry-run'])\n"
              "assert 'tensorflow' not in sys.modules, 'TensorFlow was imported'\n"
              "print(code)\n")
    tf_config = {"cluster": CLUSTER, "task": {"type": "chief", "index": 0}}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO,
                          env=child_env(tf_config=tf_config), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "2"
    assert proc.stderr.startswith("error: --replicas-to-aggregate=3 is more than the 2 worker(s)")


def test_replicas_to_aggregate_belongs_to_ps_sync_only():
    tf_config = {"cluster": CLUSTER, "task": {"type": "chief", "index": 0}}
    proc = subprocess.run([sys.executable, "train.py", "--strategy", "ps",
                           "--replicas-to-aggregate", "1", "--dry-run"],
                          cwd=REPO, env=child_env(tf_config=tf_config),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --replicas-to-aggregate applies to --strategy ps-sync")


def test_default_k_is_the_number_of_workers_and_sets_the_gradient_batch():
    from tfdist.strategies.tf_config import parse_tf_config
    from tfdist.training.config import TrainConfig
    from tfdist.training.plan import resolve

    cluster = parse_tf_config(json.dumps({"cluster": {**CLUSTER, "worker": ["a:1", "b:1", "c:1", "d:1"]},
                                      "task": {"type": "chief", "index": 0}}))

    def plan(**kw):
        return resolve(TrainConfig(cluster=cluster, global_batch_size=128, **kw), [],
                       train_examples=60_000)

    p = plan(strategy="ps-sync")
    assert p.gradients_per_update == 4 and p.examples_per_gradient == 32
    p = plan(strategy="ps-sync", replicas_to_aggregate=1)
    assert p.gradients_per_update == 1 and p.examples_per_gradient == 128
    # Other strategies: one gradient per update, on the whole global batch.
    assert plan(strategy="ps").gradients_per_update == 1


def test_tokens_are_given_again_only_after_no_update_for_a_while():
    """A restarted worker's token can be taken by its dead closure's dequeue, so the
    chief gives the tokens again when no update comes; never while updates come (a
    long call, or a pause between calls), and not before the first update's own wait
    (the workers' first run of the closure) has had FIRST_REISSUE_AFTER seconds."""
    from tfdist.training.ps.ps_sync_trainer import FIRST_REISSUE_AFTER, tokens_due

    assert not tokens_due(step=160, seen=120, restored=100, since_start=30)  # updates came
    assert tokens_due(step=160, seen=160, restored=100, since_start=30)  # none since
    # Before this process's first update (resumed at 100, or a new run at 0).
    assert not tokens_due(step=100, seen=100, restored=100, since_start=30)
    assert not tokens_due(step=0, seen=0, restored=0, since_start=FIRST_REISSUE_AFTER - 1)
    assert tokens_due(step=0, seen=0, restored=0, since_start=FIRST_REISSUE_AFTER)


def test_a_pause_for_the_evaluation_loses_no_token_and_leaves_no_stop():
    """The sharded evaluation ends every step closure with a STOP (PsSyncTrainer.workers_free):
    a STOP taken together with a step's token puts that token back (the worker has not
    computed on it), and the resume takes the pause's STOPs out, keeping the newest token."""
    import tensorflow as tf
    from tfdist.training.ps.ps_sync_trainer import STOP, newest_token, drop_stops

    queue = tf.queue.FIFOQueue(16, [tf.int64], shapes=[[]])
    take = newest_token(queue)

    def held():
        return queue.dequeue_many(queue.size()).numpy().tolist()

    queue.enqueue_many([tf.constant([6, 7, STOP], tf.int64)])
    assert int(take()) == STOP and held() == [7]
    # The newest wins, as without a pause.
    queue.enqueue_many([tf.constant([3, 5, 4], tf.int64)])
    assert int(take()) == 5 and held() == []
    # A closure that woke on the STOP alone: nothing to keep, the queue empty.
    queue.enqueue(tf.constant(STOP, tf.int64))
    assert int(take()) == STOP and held() == []
    # The resume: a STOP left by a closure that ended on `stopping` goes; a token stays.
    queue.enqueue_many([tf.constant([9, STOP], tf.int64)])
    drop_stops(queue)
    assert int(take()) == 9
    queue.enqueue_many([tf.constant([STOP, STOP], tf.int64)])
    drop_stops(queue)
    assert held() == []
    drop_stops(queue)  # nothing held
    assert held() == []


def test_the_kind_names_its_trainer_and_is_never_auto():
    from tfdist.strategies import kinds

    kind = kinds.get("ps-sync")
    from tfdist.training.assemble import TRAINERS

    assert TRAINERS[kind.trainer].__name__ == "PsSyncTrainer"
    assert TRAINERS[kinds.get("ps").trainer].__name__ == "PsTrainer"
    assert not kind.asynchronous and kind.min_ps == 1
    from tfdist.launcher import policy

    assert policy.layout(kind, 2, 1) == {"chief": 1, "worker": 2, "ps": 1}
    from tfdist.strategies.tf_config import parse_tf_config

    cluster = parse_tf_config(json.dumps({"cluster": CLUSTER, "task": {"type": "chief", "index": 0}}))
    assert kinds.resolve("auto", cluster).name == "ps"


# --- real clusters ----------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.long  # ps-sync stays in make test through the guide's FIRST and GAN
@pytest.mark.timeout(420)
def test_k_equals_n_every_worker_gives_one_fresh_gradient_per_update(tmp_path, spawn):
    STEPS = 150
    # The CNN for 150 steps at the default global batch (64 per gradient x K = 2);
    # the long tier's preemption test trains 300 (a whole epoch took 41 s here).
    model_dir = str(tmp_path / "k2")
    p = spawn(launch_cmd("ps-sync", "--workers", "2", "--ps", "1", "--timeout", "360",
                         train_args=["--model", "cnn", "--steps", str(STEPS), "--log-every", "50",
                                     "--startup-timeout", "180", "--model-dir", model_dir]))
    assert p.wait(390) == 0, p.output
    r = read_results(model_dir)
    assert r["strategy"] == "ps-sync" and r["replicas_to_aggregate"] == 2
    assert r["global_batch_size"] == 128
    assert r["test_accuracy"] >= 0.95  # 0.9775 measured
    assert r["global_steps"] == r["applied_steps"] == STEPS
    assert r["aggregated_gradients"] == 2 * r["global_steps"]
    assert r["stale_gradients_applied"] == 0
    # K = N: an update needs both workers, so no gradient can go stale, and
    # one token per worker per step means each gave exactly one per update.
    assert r["stale_gradients_dropped"] == 0
    per_worker = r["gradients_per_worker"]
    assert set(per_worker) == {"worker:0", "worker:1"}
    for counts in per_worker.values():
        assert counts["accepted"] == STEPS and counts["dropped"] == 0 and counts["skipped"] == 0
        assert counts["computed"] == counts["accepted"] + counts["pending"]
    assert r["update_interval"]["count"] > 0
    assert 0 < r["update_interval"]["p50"] <= r["update_interval"]["p99"]
    progress = [l for l in p.lines if l.startswith("[chief:0] step ")]
    assert progress and all("aggregated" in l and "worker:1=" in l for l in progress)
    assert any(f"step {STEPS}/{STEPS}" in l and f"aggregated {2 * STEPS} dropped 0" in l for l in progress)
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_k1_of_2_the_slowed_worker_is_the_backup_and_its_late_gradients_drop(tmp_path, spawn):
    model_dir = str(tmp_path / "k1")
    p = spawn(launch_cmd("ps-sync", "--workers", "2", "--ps", "1", "--timeout", "360",
                         # Slowed once both compute (slowed from its start, its start-up
                         # outlasted the whole run: it never took a token). The CNN, so a
                         # gradient costs compute, not just a round trip.
                         "--slow", "worker:1=0.25@step=20",
                         train_args=["--model", "cnn", "--log-every", "100", "--startup-timeout",
                                     "180", "--steps", "300", "--replicas-to-aggregate", "1",
                                     "--model-dir", model_dir]))
    assert p.wait(390) == 0, p.output
    r = read_results(model_dir)
    assert r["replicas_to_aggregate"] == 1 and r["global_steps"] == 300
    assert r["aggregated_gradients"] == r["global_steps"]
    assert r["stale_gradients_applied"] == 0
    # Both workers race for every update; the loser's gradient arrives late.
    assert r["stale_gradients_dropped"] > 0
    per_worker = r["gradients_per_worker"]
    assert sum(c["accepted"] for c in per_worker.values()) == 300
    assert sum(c["dropped"] for c in per_worker.values()) == r["stale_gradients_dropped"]
    for counts in per_worker.values():
        assert counts["computed"] == counts["accepted"] + counts["dropped"] + counts["pending"]
        assert counts["pending"] >= 0
    # The slowed worker loses most races: its accepted share is the smaller.
    assert per_worker["worker:1"]["accepted"] < per_worker["worker:0"]["accepted"], per_worker
    assert any("slow worker:1=0.25@step=20" in l for l in p.lines if l.startswith("[launch]")), \
        p.output
    assert r["test_accuracy"] >= 0.88
    assert descendants_alive(model_dir) == []


def _kill_worker_1(spawn, model_dir, *train_args, launch_args=()):
    """Two workers, one ps; worker:1 is SIGKILLed at step 100 of 400."""
    return spawn(launch_cmd("ps-sync", "--workers", "2", "--ps", "1", "--timeout", "360",
                            "--grace", "3", "--kill", "worker:1@step=100", *launch_args,
                            train_args=["--model", "logreg", "--log-every", "50", "--steps",
                                        "400", "--model-dir", model_dir, *train_args]))


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_lost_worker_with_k_at_most_live_workers_training_goes_on(tmp_path, spawn):
    model_dir = str(tmp_path / "lost1")
    p = _kill_worker_1(spawn, model_dir, "--replicas-to-aggregate", "1",
                       "--startup-timeout", "180")
    assert p.wait(390) == 0, p.output
    assert any(l.startswith("[launch] worker:1 exited with code -9") for l in p.lines)
    r = read_results(model_dir)
    assert r["global_steps"] == 400 and r["aggregated_gradients"] == 400
    counts = r["gradients_per_worker"]
    # worker:1 gave nothing after its death; worker:0 carried the rest.
    assert counts["worker:1"]["accepted"] <= 100
    assert counts["worker:0"]["accepted"] >= 300
    assert r["test_accuracy"] >= 0.88


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_lost_worker_with_k_above_live_workers_is_one_line_and_exit_75(tmp_path, spawn):
    model_dir = str(tmp_path / "lost2")
    # K = N = 2 by default: one worker cannot make an update alone.
    p = _kill_worker_1(spawn, model_dir, "--stuck-timeout", "40")
    assert p.wait(390) == 75, p.output
    errors = [l for l in p.lines if l.startswith("[chief:0] error:")]
    assert len(errors) == 1, p.output
    assert "no training step completed for 40s" in errors[0] and "worker:1" in errors[0]
    assert "worker:0" not in errors[0]


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_restarted_worker_brings_the_updates_back_with_k_equal_to_n(tmp_path, spawn):
    """K = N = 2, worker:1 killed and restarted. Its dead closure's token
    dequeue stays pending on ps:0 and may take the token meant for its new
    process (it did in one run of two before the chief re-issued tokens):
    the updates must still come back, each from both workers."""
    model_dir = str(tmp_path / "restarted")
    p = _kill_worker_1(spawn, model_dir, "--startup-timeout", "40", launch_args=["--restart-tasks"])
    assert p.wait(390) == 0, p.output
    assert any(l.startswith("[launch] restarted worker:1") for l in p.lines), p.output
    r = read_results(model_dir)
    assert r["global_steps"] == 400 and r["aggregated_gradients"] == 800
    assert r["stale_gradients_applied"] == 0
    # One gradient per worker per update, re-issued tokens or not.
    assert all(c["accepted"] == 400 for c in r["gradients_per_worker"].values()), r
    assert r["test_accuracy"] >= 0.88
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_chief_preemption_saves_exits_42_and_the_relaunch_resumes(tmp_path, spawn):
    model_dir = str(tmp_path / "preempt")
    p = spawn(launch_cmd("ps-sync", "--workers", "2", "--ps", "1", "--timeout", "540",
                         "--grace", "10", "--preempt", "chief:0@step=100", "--max-restarts", "1",
                         "--restart-delay", "1",
                         train_args=[*TRAIN, "--steps", "300", "--log-every", "50",
                                     "--model-dir", model_dir]))
    assert p.wait(570) == 0, p.output
    lines = p.lines
    saved = [int(l.rsplit("step ", 1)[1].split(";")[0]) for l in lines
             if l.startswith("[chief:0] preempted: checkpoint saved at step ")]
    assert len(saved) == 1 and 100 <= saved[0] < 300, saved
    assert any(l == "[launch] chief:0 exited with code 42" for l in lines)
    assert not any("Traceback" in l for l in lines), "\n".join(lines[-40:])
    r = read_results(model_dir)
    # Nothing lost: the relaunch starts where the preemption saved.
    assert r["resumed_from_step"] == saved[0]
    assert r["global_steps"] == 300 and r["applied_steps"] == 300 - saved[0]
    # This run's counts: K x the updates it applied.
    assert r["aggregated_gradients"] == 2 * r["applied_steps"]
    assert r["stale_gradients_applied"] == 0
    assert descendants_alive(model_dir) == []
