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
    jobs = [start_job(spawn, tmp_path / "zero1", "--shard-state", "optimizer"),
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
