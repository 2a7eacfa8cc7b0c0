"""What both conformance suites (Keras fit's features, Keras's guides) share: the
cluster each strategy is launched on, and one launched run read back."""

import re

from conftest import launch_cmd, read_results

EPOCHS, BATCH = 2, 64
CLUSTERS = {"multiworker": ["--workers", "2"], "ps": ["--workers", "2", "--ps", "1"],
            "ps-sync": ["--workers", "2", "--ps", "1"],
            # Model parallelism: the model cut into two stages, one per worker.
            "pipeline": ["--workers", "2"]}
# Each micro-batch half the batch: the loss and metrics are means over micro-batches.
TRAIN_ARGS = {"pipeline": ["--micro-batches", "2"]}


def launched_results(tmp_path, spawn, strategy: str, task: str, log_every: int) -> dict:
    """``task`` trained under ``strategy`` on its cluster; its results.json. Under
    multiworker every worker must end with the chief's weights."""
    p = spawn(launch_cmd(strategy, *CLUSTERS[strategy], train_args=[
        "--task", task, "--epochs", str(EPOCHS), "--global-batch-size", str(BATCH),
        "--log-every", str(log_every), "--model-dir", str(tmp_path),
        *TRAIN_ARGS.get(strategy, ())]))
    assert p.wait(timeout=300) == 0, p.output
    results = read_results(tmp_path)
    if strategy == "multiworker":
        hashes = set(re.findall(r"weights_sha256=([0-9a-f]{64})", p.output))
        assert hashes == {results["weights_sha256"]}
    return results
