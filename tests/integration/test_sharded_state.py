"""--shard-state (training.sync.zero) on simulated clusters of real processes: the same
update as plain multiworker, every worker's weights the same bytes, checkpoints whole."""

import pytest

from conftest import descendants_alive, launch_cmd, read_results

pytestmark = pytest.mark.multiprocess


def start_job(spawn, model_dir, *train_args, workers=2, steps=40, timeout=200):
    """One multiworker job started on mnist-logreg."""
    return spawn(launch_cmd("multiworker", "--workers", str(workers), "--timeout",
                            str(timeout - 20),
                            train_args=["--task", "mnist-logreg", "--steps", str(steps),
                                        "--log-every", str(steps), "--model-dir", str(model_dir),
                                        *train_args]))


def finish_job(p, model_dir, timeout=200):
    """A started job's results and {member: weights_sha256} from every worker's line."""
    assert p.wait(timeout) == 0, p.output
    results = read_results(model_dir)
    hashes = {line.split("]")[0][1:]: line.rsplit("weights_sha256=", 1)[1].split()[0]
              for line in p.lines if "weights_sha256=" in line}
    assert descendants_alive(str(model_dir)) == []
    return results, hashes


# The one quick multiprocess test of its kind in make test (two short jobs).
@pytest.mark.timeout(240)
def test_optimizer_sharded_over_two_workers_matches_plain(tmp_path, spawn):
    # Both jobs at once (each launch has its own network namespace and ports).
    # Buckets of 8 KiB cut the 784 x 10 kernel into blocks of rows (shard_layout).
    jobs = [start_job(spawn, tmp_path / "zero1", "--shard-state", "optimizer",
                      "--all-reduce-bucket", "8k"),
            start_job(spawn, tmp_path / "plain")]
    sharded, hashes = finish_job(jobs[0], tmp_path / "zero1")
    assert sharded["shard_state"] == "optimizer" and sharded["global_steps"] == 40
    # Every worker's full weights are the same bytes: the chief's summary and worker:1's line.
    assert set(hashes) == {"worker:0", "worker:1"}
    assert set(hashes.values()) == {sharded["weights_sha256"]}
    # Each worker holds half of Adam's slots (7850 parameters, 2 slots, float32).
    assert sharded["state_bytes"]["worker:1"]["slots"] == 2 * 4 * 3925
    assert set(sharded["peak_rss_bytes_per_worker"]) == {"worker:0", "worker:1"}
    plain, _ = finish_job(jobs[1], tmp_path / "plain")
    assert plain["shard_state"] == "off"
    assert plain["state_bytes"]["worker:1"]["slots"] == 2 * 4 * 7850
    # The same update up to the order of a sum: the same accuracy at the same step.
    assert abs(sharded["test_accuracy"] - plain["test_accuracy"]) <= 0.005
    assert abs(sharded["test_loss"] - plain["test_loss"]) <= 0.01


CONSTANT = ("--lr-schedule", "constant", "--global-batch-size", "96")
LONG = 400  # seconds a job of the long tier may take (several run at once)


def _copy(src, dst):
    """A run directory copied for a second continuation (its launch records left behind)."""
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("launch", ".lock"))


@pytest.mark.long
@pytest.mark.timeout(900)
def test_sharded_checkpoints_resume_exactly_sharded_or_plain(tmp_path, spawn):
    """Checkpoints hold the whole state: a sharded run's resumes sharded or plain, a plain
    run's resumes sharded, each landing on the uninterrupted run's weights. With two
    workers the reduce-scatter's sum and the all-reduce's are the same two terms, so the
    sharded and the plain update are the same bytes, and every case must match exactly."""
    s20, p20, whole = tmp_path / "s20", tmp_path / "p20", tmp_path / "s40"
    sharded = ("--shard-state", "optimizer", "--all-reduce-bucket", "8k")  # the kernel cut
    first = [start_job(spawn, s20, *sharded, *CONSTANT, steps=20, timeout=LONG),
             start_job(spawn, p20, *CONSTANT, steps=20, timeout=LONG),
             start_job(spawn, whole, *sharded, *CONSTANT, timeout=LONG)]
    for p, d in zip(first, (s20, p20, whole)):
        finish_job(p, d, timeout=LONG)
    reference = read_results(whole)["weights_sha256"]
    _copy(s20, tmp_path / "s20-plain")
    cases = {"sharded-sharded": (s20, sharded), "sharded-plain": (tmp_path / "s20-plain", ()),
             "plain-sharded": (p20, sharded)}
    second = {name: start_job(spawn, d, *args, *CONSTANT, timeout=LONG)
              for name, (d, args) in cases.items()}
    for name, p in second.items():
        results, hashes = finish_job(p, cases[name][0], timeout=LONG)
        assert any("resumed from" in line and "at step 20" in line for line in p.lines), name
        assert results["global_steps"] == 40, name
        assert set(hashes.values()) == {reference}, name


@pytest.mark.long
@pytest.mark.timeout(900)
def test_sharded_checkpoint_resumes_at_another_worker_count(tmp_path, spawn):
    """Two workers' sharded checkpoint, re-sliced for three (sharded) or read whole
    (plain): both resume at its step, every worker ends on the same weights, and the two
    continuations (the same update, summed in another order) agree on accuracy."""
    s20 = tmp_path / "s20"
    finish_job(start_job(spawn, s20, "--shard-state", "gradients", *CONSTANT, steps=20,
                         timeout=LONG), s20,
               timeout=LONG)
    _copy(s20, tmp_path / "plain3")
    # Three workers re-slice a layout whose kernel was cut in blocks of rows (8 KiB buckets).
    runs = {"sharded3": (s20, ("--shard-state", "gradients", "--all-reduce-bucket", "8k")),
            "plain3": (tmp_path / "plain3", ())}
    started = {name: start_job(spawn, d, *args, *CONSTANT, workers=3, timeout=LONG)
               for name, (d, args) in runs.items()}
    accuracy = {}
    for name, p in started.items():
        results, hashes = finish_job(p, runs[name][0], timeout=LONG)
        assert any("resumed from" in line and "at step 20" in line for line in p.lines), name
        assert len(hashes) == 3 and set(hashes.values()) == {results["weights_sha256"]}, name
        accuracy[name] = results["test_accuracy"]
    assert abs(accuracy["sharded3"] - accuracy["plain3"]) <= 0.005, accuracy


def _wide(*args):
    """wide-mlp narrowed to a four-layer chain of 63 k parameters, in 8 KiB buckets (its
    widest kernels cut into blocks of rows), with the run's other arguments."""
    return ("--task-option", "width=96", "--all-reduce-bucket", "8k", *args)


def start_wide(spawn, model_dir, *train_args, workers=2, steps=30, timeout=2 * LONG):
    # Several jobs of TensorFlow processes start at once on two cores: time to trace.
    return spawn(launch_cmd("multiworker", "--workers", str(workers), "--timeout",
                            str(timeout - 20),
                            train_args=["--task", "wide-mlp", "--steps", str(steps),
                                        "--log-every", "10", "--model-dir", str(model_dir),
                                        "--startup-timeout", str(timeout - 100),
                                        *train_args]))


WEIGHTS = ("--shard-state", "weights")


@pytest.mark.long
@pytest.mark.timeout(1500)
def test_weights_sharded_makes_the_plain_update(tmp_path, spawn):
    """--shard-state weights (layer by layer: each layer's shard gathered in its forward
    pass and again in its backward pass, its gradients reduce-scattered there) makes the
    plain update: with two workers the same bytes as plain multiworker, every worker on
    the same weights; with SGD, 16-bit gradients (the reduce-scatter in bfloat16) and two
    batches a step, plain's accuracy."""
    sgd = ("--optimizer", "sgd", "--gradient-dtype", "bfloat16",
           "--gradient-accumulation-steps", "2")
    # No name a prefix of another: finish_job looks for processes by their model dir.
    runs = {"adam-weights": WEIGHTS, "adam-plain": (), "sgd-weights": WEIGHTS + sgd,
            "sgd-plain": sgd}
    started = {n: start_wide(spawn, tmp_path / n, *_wide(*CONSTANT, *a))
               for n, a in runs.items()}
    out = {n: finish_job(p, tmp_path / n, timeout=2 * LONG) for n, p in started.items()}
    sharded, hashes = out["adam-weights"]
    assert sharded["shard_state"] == "weights" and sharded["global_steps"] == 30
    assert set(hashes) == {"worker:0", "worker:1"}
    assert set(hashes.values()) == {sharded["weights_sha256"]}
    assert sharded["weights_sha256"] == out["adam-plain"][0]["weights_sha256"]
    # The state held while stepping, as docs/sharding.md counts it: the weights shard plus
    # the largest layer gathered (784 x 64 + 64), that layer's gradient plus the summed
    # shard, Adam's two slots of the shard. Here the largest layer is 79 % of the model,
    # so at two workers the weights held (0.5 + 0.79 of the model) exceed plain's whole
    # model: the weights level saves only where each layer is small against the model.
    held = sharded["state_bytes"]["worker:1"]
    plain = out["adam-plain"][0]["state_bytes"]["worker:1"]
    total, largest = plain["weights"] // 4, 784 * 64 + 64
    assert total == 63_338 and plain["slots"] == 2 * 4 * total
    shard = held["slots"] // (2 * 4)
    # Half the model, each bucket's padding to a multiple of two at most (~40 buckets).
    assert total <= 2 * shard <= total + 40, (shard, total)
    assert held == {"weights": 4 * (shard + largest), "gradients": 4 * (largest + shard),
                    "slots": 2 * 4 * shard}, held
    wsgd, hashes = out["sgd-weights"]
    assert wsgd["global_steps"] == 30 and len(hashes) == 2 and len(set(hashes.values())) == 1
    assert abs(wsgd["test_accuracy"] - out["sgd-plain"][0]["test_accuracy"]) <= 0.005


@pytest.mark.long
@pytest.mark.timeout(1500)
def test_weights_sharded_checkpoints_resume_plain_sharded_and_at_three_workers(tmp_path,
                                                                                spawn):
    """A weights-sharded checkpoint resumes under weights, under plain and at three
    workers; a plain one resumes under weights. The two-worker continuations are the
    same update (the same bytes); the three-worker one agrees on accuracy with plain's
    three-worker continuation of the same checkpoint (three workers split each global
    batch otherwise than two, so their runs see other batches: against a two-worker
    continuation the accuracy differed by 0.014)."""
    first = {n: start_wide(spawn, tmp_path / n, *_wide(*CONSTANT, *a), steps=10)
             for n, a in {"sharded10": WEIGHTS, "plain10": ()}.items()}
    for n, p in first.items():
        finish_job(p, tmp_path / n, timeout=2 * LONG)
    _copy(tmp_path / "sharded10", tmp_path / "as-plain")
    _copy(tmp_path / "sharded10", tmp_path / "at-three")
    _copy(tmp_path / "sharded10", tmp_path / "plain-three")
    cases = {"sharded10": (WEIGHTS, 2), "as-plain": ((), 2), "plain10": (WEIGHTS, 2),
             "at-three": (WEIGHTS, 3), "plain-three": ((), 3)}
    second = {n: start_wide(spawn, tmp_path / n, *_wide(*CONSTANT, *a), workers=k)
              for n, (a, k) in cases.items()}
    ends = {}
    for name, p in second.items():
        results, hashes = finish_job(p, tmp_path / name, timeout=2 * LONG)
        assert any("resumed from" in line and "at step 10" in line for line in p.lines), name
        assert results["global_steps"] == 30, name
        assert len(set(hashes.values())) == 1 and len(hashes) == cases[name][1], name
        ends[name] = results
    assert len({ends[n]["weights_sha256"] for n in ("sharded10", "as-plain", "plain10")}) == 1
    assert abs(ends["at-three"]["test_accuracy"] - ends["plain-three"]["test_accuracy"]) <= 0.005
