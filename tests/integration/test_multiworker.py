"""Multi-worker all-reduce on a simulated cluster of real processes."""

import json
import signal
import sys
import time

import pytest

from tfdist.launcher.plan import free_ports
from conftest import REPO, child_env, descendants_alive, launch_cmd, read_results

pytestmark = pytest.mark.multiprocess


# The long tier: make test keeps two siblings of the same kind, each launching two
# workers that must end with identical weights: tests/training/test_task_features.py
# (the example task, BatchNormalization's statistics included) and
# tests/launcher/test_sim_cluster.py (over a shaped link) (CI time)
@pytest.mark.long
@pytest.mark.timeout(300)
def test_two_workers_train_to_identical_weights(tmp_path, spawn):
    model_dir = str(tmp_path / "mw2")
    p = spawn(launch_cmd("multiworker", "--workers", "2", "--timeout", "240",
                         train_args=["--steps", "300", "--log-every", "100", "--model-dir", model_dir]))
    assert p.wait(260) == 0, p.output
    results = read_results(model_dir)
    assert results["strategy"] == "multiworker" and results["replicas_in_sync"] == 2
    assert results["global_steps"] == 300
    assert results["steps_per_worker"] == {"worker:0": 300, "worker:1": 300}
    assert results["test_accuracy"] >= 0.97
    # worker:1 prints its hash; the chief's summary has the chief's.
    hashes = {
        line.split("]")[0][1:]: line.rsplit("weights_sha256=", 1)[1]
        for line in p.lines if "weights_sha256=" in line
    }
    assert hashes == {"worker:0": results["weights_sha256"], "worker:1": results["weights_sha256"]}
    # Exactly one results.json: the chief's. worker:1 kept nothing of its own.
    assert sorted(x.name for x in (tmp_path / "mw2").rglob("results.json")) == ["results.json"]
    assert any(l.startswith("[worker:1] step 300/300") for l in p.lines)
    # The saved TF_CONFIGs replay the tasks.
    saved = json.loads((tmp_path / "mw2" / "launch" / "worker-1.tf_config.json").read_text())
    assert saved["task"] == {"type": "worker", "index": 1}
    assert descendants_alive(model_dir) == []


# The long tier: make test keeps a sibling of the same kind (CI time)
@pytest.mark.long
@pytest.mark.timeout(300)
def test_three_workers_uneven_batch_end_cleanly(tmp_path, spawn):
    # 99 = 3 x 33 per replica; 60000 is not a multiple of 99.
    model_dir = str(tmp_path / "mw3")
    p = spawn(launch_cmd("multiworker", "--workers", "3", "--timeout", "240",
                         train_args=["--steps", "40", "--global-batch-size", "99", "--log-every", "20",
                                     "--model-dir", model_dir]))
    assert p.wait(260) == 0, p.output
    results = read_results(model_dir)
    assert results["global_steps"] == 40 and len(results["steps_per_worker"]) == 3
    assert sum(1 for l in p.lines if "weights_sha256=" + results["weights_sha256"] in l) == 3
    assert descendants_alive(model_dir) == []


@pytest.mark.long  # make test: a lost host under elastic, a hung worker, a preemption
@pytest.mark.timeout(240)
def test_killed_worker_fails_the_job_fast_and_leaves_nothing(tmp_path, spawn):
    model_dir = str(tmp_path / "mwkill")
    # The launcher's temporary directory: worker:1, killed, never removes its
    # private checkpoints; the launcher must.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    p = spawn(launch_cmd("multiworker", "--workers", "2", "--timeout", "200", "--grace", "3",
                         train_args=["--steps", "100000", "--log-every", "20", "--model-dir", model_dir]),
              env=child_env(TMPDIR=scratch))
    p.wait_for_line(r"^\[worker:1\] step 20/", timeout=150)
    pid = _task_pid(model_dir, "worker-1")
    import os
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    code = p.wait(90)
    assert code != 0
    assert time.monotonic() - killed_at < 60
    assert any("worker:1 exited with code -9" in l for l in p.lines)
    assert descendants_alive(model_dir) == []
    assert sorted(str(f) for f in scratch.rglob("*")) == []


# The long tier: tests/launcher/test_netns.py's SIGTERM test stays in make test (CI time)
@pytest.mark.long
@pytest.mark.timeout(240)
def test_launcher_sigterm_stops_every_task(tmp_path, spawn):
    model_dir = str(tmp_path / "mwterm")
    p = spawn(launch_cmd("multiworker", "--workers", "2", "--grace", "3",
                         train_args=["--steps", "100000", "--log-every", "20", "--model-dir", model_dir]))
    p.wait_for_line(r"^\[worker:0\] step 20/", timeout=150)
    assert len(descendants_alive(model_dir)) >= 2
    p.proc.send_signal(signal.SIGTERM)
    assert p.wait(60) == 143, p.output  # 128 + SIGTERM, as a shell reports it
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.timeout(120)
def test_lonely_worker_gives_up_naming_the_missing_task(tmp_path, spawn):
    port0, port1 = free_ports(2)
    tf_config = {"cluster": {"worker": [f"localhost:{port0}", f"localhost:{port1}"]},
                 "task": {"type": "worker", "index": 0}}
    p = spawn([sys.executable, str(REPO / "train.py"), "--strategy=multiworker", "--steps=5",
               "--startup-timeout=10", "--model-dir", str(tmp_path / "alone")],
              env=child_env(tf_config=tf_config))
    started = time.monotonic()
    code = p.wait(90)
    assert code != 0, p.output
    assert time.monotonic() - started < 80
    error = [l for l in p.lines if l.startswith("error:")]
    assert len(error) == 1 and f"worker:1 (localhost:{port1})" in error[0]
    assert "--startup-timeout=10" in error[0]


def _task_pid(model_dir, task_file):
    """The pid of the train.py process running the given task of this run."""
    needle = f"{task_file}.tf_config.json"
    import os
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if model_dir.encode() in cmd and b"tfdist.cli.train" in cmd:  # a launched task
            index = task_file.rsplit("-", 1)[1]
            if f'"type": "worker", "index": {index}'.encode() in env:
                return int(pid)
    raise AssertionError(f"no process for {needle}")
