"""Under ps, a worker killed while the workers evaluate the final shards: the coordinator
runs the lost worker's closure again on the other worker, each shard is merged once, the
job ends 0 and results.json's figures are one process's evaluation of model.keras.
"""

import json
import os
import signal

import pytest

from conftest import descendants_alive, launch_cmd, read_results
from tfdist.linux import live_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

TEST_EXAMPLES = 10_000  # MNIST's test split


def task_pid(marker: str, role: str, index: int) -> int:
    """The pid of the job's task ``role:index`` (its TF_CONFIG names it)."""
    for pid, cmd, env in live_processes(environ=True):
        if marker not in cmd or not env:
            continue
        for entry in env:
            if entry.startswith(b"TF_CONFIG="):
                task = json.loads(entry[len(b"TF_CONFIG="):]).get("task", {})
                if task.get("type") == role and task.get("index") == index:
                    return pid
    raise AssertionError(f"no live {role}:{index} with {marker} in its command line")


@pytest.mark.timeout(700)
def test_a_worker_killed_during_the_sharded_evaluation(tmp_path, spawn):
    from test_shared_evaluation import assert_equal_to_one_process, evaluate_saved

    from tfdist.training.workload import tasks

    model_dir = str(tmp_path / "run")
    p = spawn(launch_cmd("ps", "--workers", "2", "--ps", "1", "--timeout", "600",
                         train_args=["--task", "mnist-cnn", "--steps", "30", "--log-every",
                                     "10", "--eval-shards", "20", "--model-dir", model_dir]))
    p.wait_for_line(r"the test split: \d+ shards scheduled on the workers", timeout=500)
    os.kill(task_pid(model_dir, "worker", 1), signal.SIGKILL)
    # Killed before the chief had the evaluation's figures (results.json comes after them).
    killed_during = not os.path.exists(f"{model_dir}/results.json")
    assert p.wait(120) == 0, p.output
    assert killed_during, "the evaluation ended before the kill: it tests nothing"
    assert descendants_alive(model_dir) == []
    results = read_results(model_dir)
    record = results["evaluation"]
    # The count asked, 20, and the shards made: 10 batches of 1,000 make 10 of them.
    assert record["where"] == "workers" and record["shards"] == 10, record
    assert record["shards_asked"] == 20, record
    assert record["examples"] == TEST_EXAMPLES == sum(record["examples_per_member"].values())
    assert set(record["examples_per_member"]) <= {"worker:0", "worker:1"}
    assert_equal_to_one_process(results, evaluate_saved(
        model_dir, tasks.load(tasks.parse_spec("mnist-cnn", [])).dataset("test")))
