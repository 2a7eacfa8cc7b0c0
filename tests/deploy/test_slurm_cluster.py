"""The sbatch scripts on a real Slurm: slurmctld and two slurmd nodes, node9 and node10.

``slurm/local-cluster.sh`` builds the cluster in namespaces on this host
(installing Debian's slurm-wlm and munge first when they are missing) and the
jobs go through real ``sbatch``/``srun``. node9 and node10 are the names
that TensorFlow's resolver put in the wrong order (text sort: node10 first).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import descendants_alive

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "slurm" / "local-cluster.sh"
STEPS_PER_EPOCH = 60_000 // 128  # --epochs 1 at the scripts' --global-batch-size 128
SHORT = ["--model", "logreg", "--log-every", "100"]
# logreg after one epoch: 0.916-0.918 measured (multiworker and ps, seed 42).
MIN_ACCURACY = 0.90

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


def _namespaces_allowed() -> str | None:
    """Why this host cannot run the emulated cluster, or None."""
    if sys.platform != "linux":
        return "Linux namespaces are needed"
    if os.geteuid() != 0:
        return "root is needed (namespaces, bridge, slurmd)"
    probe = subprocess.run(["unshare", "--mount", "--net", "--uts", "true"], capture_output=True)
    if probe.returncode != 0:
        return "the OS forbids mount/network/UTS namespaces here"
    return None


class Cluster:
    def __init__(self, state: Path, out: Path):
        self.state, self.out = state, out
        self.env = {**os.environ, "SLURM_LOCAL_DIR": str(state), "PYTHON": sys.executable,
                    "TF_CPP_MIN_LOG_LEVEL": "2"}
        self.env.pop("TF_CONFIG", None)

    def run(self, *cmd, timeout=60, check=True, env=None) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(SCRIPT), "exec", "--", *cmd], cwd=ROOT, env=env or self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"{cmd}: {proc.stdout}{proc.stderr}"
        return proc

    def submit(self, name: str, script: str, *args, het: tuple = (),
               env_extra: dict | None = None) -> tuple[str, Path]:
        """sbatch the script; its log is ``out/<name>.out``, its model dir ``out/<name>``."""
        log = self.out / f"{name}.out"
        env = {**self.env, "MODEL_DIR": str(self.out / name), **(env_extra or {})}
        proc = self.run("sbatch", "--parsable", f"--output={log}", *het, f"slurm/{script}", *args,
                        env=env)
        return re.match(r"\d+", proc.stdout).group(0), log  # "<job id>[;cluster]"

    def wait(self, job_id: str, log: Path, timeout: float) -> str:
        """The job's log once it has left the queue (requeues included), after checking it
        completed with exit code 0 in every component.

        Polled rather than ``sbatch --wait``, whose polling interval grows:
        it returned up to 26 s after the job had ended here.
        """
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip():
            if time.monotonic() > deadline:
                self.run("scancel", job_id, check=False)
                break
            time.sleep(0.5)
        text = log.read_text() if log.exists() else "(no log)"
        states = self.run("scontrol", "show", "job", job_id).stdout
        ends = re.findall(r"JobState=(\S+).*?ExitCode=(\S+)", states, re.S)
        assert ends and all(e == ("COMPLETED", "0:0") for e in ends), \
            f"job {job_id}: {ends}\n{text[-4000:]}\n{self.logs()}"
        return text

    def job(self, job_id: str) -> dict[str, str]:
        text = self.run("scontrol", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n" + p.read_text()[-3000:]
                         for p in sorted((self.state / "log").glob("*")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why_not = _namespaces_allowed()
    if why_not:
        pytest.skip(f"no emulated Slurm cluster: {why_not}")
    state = tmp_path_factory.mktemp("slurm-state")
    c = Cluster(state, tmp_path_factory.mktemp("slurm-out"))
    try:
        # Includes `apt-get install slurm-wlm munge` (about a minute) where missing.
        up = subprocess.run([str(SCRIPT), "up"], cwd=ROOT, env=c.env, capture_output=True,
                            text=True, timeout=400)
        assert up.returncode == 0, up.stdout + up.stderr + c.logs()
        yield c
    finally:
        # The processes holding the namespaces: gone after `down`, so are the namespaces.
        holders = [int(p.read_text()) for p in (state / "run").glob("*.holder")]
        subprocess.run([str(SCRIPT), "down"], cwd=ROOT, env=c.env, capture_output=True, timeout=60)
        left = descendants_alive(str(state)) + descendants_alive(str(c.out))  # daemons, job tasks
        left += [f"namespace holder {pid}" for pid in holders if _running(pid)]
        assert not left, f"left behind: {left}"


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _results(cluster: Cluster, name: str) -> dict:
    return json.loads((cluster.out / name / "results.json").read_text())


def test_multiworker_and_ps_jobs_share_the_nodes(cluster):
    """Both scripts at once: accuracy, step accounting, identical weights, no port clash."""
    mw, mw_log = cluster.submit("multiworker", "train_multiworker.sbatch", *SHORT)
    # Two nodes only: the ps job's worker component gets one (the script asks for two).
    ps, ps_log = cluster.submit("ps", "train_ps.sbatch", *SHORT, het=(":", "--nodes=1"))
    mw_text = cluster.wait(mw, mw_log, timeout=240)
    ps_text = cluster.wait(ps, ps_log, timeout=240)

    mw_results = _results(cluster, "multiworker")
    assert mw_results["strategy"] == "multiworker" and mw_results["num_workers"] == 2
    assert mw_results["global_steps"] == STEPS_PER_EPOCH
    assert mw_results["steps_per_worker"] == {"worker:0": STEPS_PER_EPOCH, "worker:1": STEPS_PER_EPOCH}
    assert mw_results["test_accuracy"] >= MIN_ACCURACY, mw_results
    # Both workers print the hash of the weights they ended with: the same model.
    hashes = re.findall(r"weights_sha256=([0-9a-f]{64})", mw_text)
    assert len(hashes) == 2 and len(set(hashes)) == 1, hashes
    assert hashes[0] == mw_results["weights_sha256"]

    ps_results = _results(cluster, "ps")
    assert (ps_results["strategy"], ps_results["num_workers"], ps_results["num_ps"]) == ("ps", 2, 1)
    assert ps_results["global_steps"] == STEPS_PER_EPOCH
    assert sum(ps_results["steps_per_worker"].values()) == STEPS_PER_EPOCH
    assert ps_results["test_accuracy"] >= MIN_ACCURACY, ps_results
    # Slurm's order: the CPU-only component (chief, ps) on node9, the workers on node10.
    serving = dict(re.findall(r"^(\S+) serving at (node\d+):\d+", ps_text, re.M))
    assert serving == {"ps:0": "node9", "worker:0": "node10", "worker:1": "node10"}, ps_text[-3000:]
    # Both jobs ran on node9 at the same time, on ports of their own (from
    # their job ids: slurm/requeue.sh); one fixed port would have clashed.
    jobs = {name: cluster.job(job_id) for name, job_id in (("mw", mw), ("ps", ps))}
    mw_job, ps_job = jobs["mw"], jobs["ps"]
    assert mw_job["StartTime"] < ps_job["EndTime"] and ps_job["StartTime"] < mw_job["EndTime"], jobs
    ps_port = int(re.search(r"^ps:0 serving at node9:(\d+)", ps_text, re.M).group(1))
    assert ps_port == 20000 + int(ps) % 4000 * 10 + 1  # rank 1: the node's second port


@pytest.mark.long
def test_scancel_term_requeues_and_resumes_with_exact_steps(cluster):
    steps = 1500
    job_id, log = cluster.submit("preempted", "train_multiworker.sbatch", *SHORT, "--steps", str(steps))
    deadline = time.monotonic() + 120
    while not (log.exists() and re.search(r"^step [3-9]\d\d/", log.read_text(), re.M)):
        assert time.monotonic() < deadline, \
            f"no step 300 yet: {log.read_text()[-3000:] if log.exists() else '(no log)'}"
        time.sleep(0.5)
    # Slurm's preemption: SIGTERM to every task of the job's steps.
    cluster.run("scancel", "--signal=TERM", job_id)
    # Slurm holds a requeued job for two minutes before it may start again;
    # the emulated cluster has no reason to wait.
    deadline = time.monotonic() + 150
    while True:
        job = cluster.job(job_id)
        # Released only once the first run has fully ended (its nodes idle
        # again): a start while its batch script is still exiting fails, and
        # Slurm then holds the job ("launch_failed_requeued_held").
        if (job.get("Restarts") == "1" and job.get("JobState") == "PENDING"
                and set(cluster.run("sinfo", "-h", "-N", "-o", "%t").stdout.split()) == {"idle"}):
            cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
            break
        assert time.monotonic() < deadline, (
            f"job {job_id} not requeued: JobState={job.get('JobState')} Reason={job.get('Reason')} "
            f"Restarts={job.get('Restarts')}\n{log.read_text()[-4000:]}\n{cluster.logs()}"
        )
        time.sleep(0.5)
    text = cluster.wait(job_id, log, timeout=240)

    saved = [int(s) for s in re.findall(r"^preempted: checkpoint saved at step (\d+)", text, re.M)]
    assert len(saved) == 2 and saved[0] == saved[1] and 0 < saved[0] < steps, saved
    assert f"exit code 42: requeueing job {job_id}" in text
    assert re.findall(r"^resumed from \S+ at step (\d+)", text, re.M) == [str(saved[0])] * 2
    results = _results(cluster, "preempted")
    assert results["global_steps"] == steps
    assert results["resumed_from_step"] == saved[0]
    assert results["steps_this_run"] == steps - saved[0]  # zero steps lost or repeated
    assert results["test_accuracy"] >= MIN_ACCURACY


@pytest.mark.long
def test_a_sidecar_evaluator_follows_the_job_to_its_last_checkpoint(cluster):
    """EVALUATOR=1: an evaluator step beside the workers evaluates their checkpoints and
    adds its history to results.json; the job ends 0 and trains as without it."""
    job_id, log = cluster.submit("with-evaluator", "train_multiworker.sbatch", *SHORT,
                                 "--checkpoint-every", "150", env_extra={"EVALUATOR": "1"})
    text = cluster.wait(job_id, log, timeout=300)
    results = _results(cluster, "with-evaluator")
    assert results["global_steps"] == STEPS_PER_EPOCH
    record = results["sidecar_evaluation"]
    assert record is not None and record["member"] == "evaluator:0", text[-3000:]
    steps = [e["step"] for e in record["evaluations"]]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS_PER_EPOCH, steps
    # The last checkpoint holds the final weights: the chief's own evaluation of them.
    assert abs(record["evaluations"][-1]["val_accuracy"] - results["test_accuracy"]) < 1e-5
    assert re.search(r"^evaluator:0: checkpoint step \d+ val_accuracy", text, re.M), text[-3000:]
