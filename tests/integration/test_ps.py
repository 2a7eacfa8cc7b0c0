"""Asynchronous parameter-server training on real loopback processes."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, child_env, descendants_alive, launch_cmd, read_results

pytestmark = pytest.mark.multiprocess


# 36 s on an idle 2-core host; at load 15-20 it once ran past a 240 s --timeout.
@pytest.mark.timeout(480)
def test_one_ps_two_workers_reach_accuracy_with_no_lost_update(tmp_path, spawn):
    model_dir = str(tmp_path / "ps1")
    p = spawn(launch_cmd("ps", "--workers", "2", "--ps", "1", "--timeout", "420",
                         train_args=["--steps", "400", "--steps-per-execution", "5",
                                     "--log-every", "100", "--eval-every", "150",
                                     "--model-dir", model_dir]))
    assert p.wait(450) == 0, p.output
    results = read_results(model_dir)
    assert results["strategy"] == "ps" and results["num_workers"] == 2 and results["num_ps"] == 1
    assert results["test_accuracy"] >= 0.97
    # Every scheduled step applied exactly once to the ps-held counter.
    assert results["global_steps"] == results["scheduled_steps"] == 400
    workers = results["steps_per_worker"]
    assert set(workers) == {"worker:0", "worker:1"} and all(n > 0 for n in workers.values())
    assert sum(workers.values()) == 400
    assert set(results["staleness"]) >= {"mean", "p50", "p99", "max"}
    assert results["staleness"]["count"] == 400
    assert sum(results["staleness"]["histogram"].values()) == 400
    # The chief drains the closures at each evaluation, so it sees exact steps.
    assert [p["step"] for p in results["eval_curve"]] == [150, 300, 400]
    assert results["variables_per_ps"] == {"ps:0": 8}
    progress = [l for l in p.lines if l.startswith("[chief:0] step ")]
    assert progress and all("local_steps worker:0=" in l and "staleness" in l for l in progress)
    # ps and workers stopped by themselves once the chief was done.
    assert any(l.startswith("[ps:0]") and "chief" in l and "gone" in l for l in p.lines)
    assert descendants_alive(model_dir) == []


# The long tier: make test splits variables over ps tasks in test_sharding.py (CI time)
@pytest.mark.long
@pytest.mark.timeout(300)
def test_two_ps_tasks_share_the_variables(tmp_path, spawn):
    model_dir = str(tmp_path / "ps2")
    p = spawn(launch_cmd("ps", "--workers", "1", "--ps", "2", "--timeout", "240",
                         train_args=["--steps", "20", "--steps-per-execution", "5", "--log-every", "10", "--model-dir", model_dir]))
    assert p.wait(270) == 0, p.output
    results = read_results(model_dir)
    placement = results["variables_per_ps"]
    assert set(placement) == {"ps:0", "ps:1"} and all(n > 0 for n in placement.values())
    assert sum(placement.values()) == 8  # whole variables, round-robin
    assert results["global_steps"] == 20
    assert descendants_alive(model_dir) == []


def test_ps_task_device_setup_hides_every_gpu(tmp_path):
    """Apply the ps task's real device setup in a fresh process and look."""
    tf_config = {"cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ["localhost:3"]},
                 "task": {"type": "ps", "index": 0}}
    code = (
        "import json, os, tensorflow as tf\n"
        "from strategies import from_environ\n"
        "from strategies.devices import configure_devices\n"
        "plan = configure_devices('ps', from_environ(os.environ))\n"
        "print(json.dumps({'plan': plan, 'visible': [d.name for d in tf.config.get_visible_devices('GPU')],"
        " 'logical': [d.name for d in tf.config.list_logical_devices('GPU')],"
        " 'cpu': len(tf.config.list_logical_devices('CPU'))}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(tf_config=tf_config),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["visible"] == [] and report["logical"] == [] and report["cpu"] >= 1
    assert report["plan"]["visible_gpus"] == [] and report["plan"]["memory_growth"] is False
