"""``launch.py --evaluator``: one more member, a sidecar evaluator outside the
training cluster, whose exit never decides the job's (training.sidecar does the
evaluating; tests/training/test_sidecar.py tests it alone).

The unit tests build the config and the supervisor's decisions without a
process; the jobs run real members: one quick job in the default tier, the
comparison with a job without the evaluator and the evaluator killed mid-run
in the long tier.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO, child_env, launch_cmd, read_results, tensorboard_tags
from tfdist.cli import launch
from tfdist.launcher import job, policy
from tfdist.launcher.plan import LaunchError
from tfdist.launcher.recovery import faults
from tfdist.launcher.supervisor import decide, evaluator_status
from tfdist.strategies import kinds

LOGREG = ["--task", "mnist-logreg", "--seed", "7", "--log-every", "20"]


def _config(*argv):
    args, train_args = launch.parse_args(list(argv))
    return job.build_config(launch.request_from_args(args, train_args))


# --- the plan and the refusals (no process) -------------------------------------------

def test_the_evaluator_is_one_more_member_outside_the_training_cluster():
    config = _config("--strategy", "multiworker", "--workers", "2", "--evaluator",
                     "--kill", "evaluator:0@step=5", "--", "--steps", "30")
    assert config.names == ["worker:0", "worker:1", "evaluator:0"]
    evaluator = config.plan.tf_configs["evaluator:0"]
    assert evaluator["task"] == {"type": "evaluator", "index": 0}
    worker = config.plan.tf_configs["worker:0"]
    # It knows the training cluster; the training members do not know it.
    assert {k: v for k, v in evaluator["cluster"].items() if k != "evaluator"} == \
        worker["cluster"]
    assert "evaluator" not in worker["cluster"]
    assert len(set(evaluator["cluster"]["evaluator"] + worker["cluster"]["worker"])) == 3
    # The launcher's fault flags can target it; it takes no computing core.
    assert config.recovery.faults == (faults.Fault("kill", "evaluator:0", step=5),)
    assert not config.cores["evaluator:0"].cpus


def test_with_hosts_the_evaluator_runs_on_host_0_beside_the_coordinating_members():
    config = _config("--strategy", "ps", "--workers", "2", "--ps", "1", "--hosts", "3",
                     "--evaluator", "--", "--steps", "30")
    plan = config.plan
    assert plan.host_of["evaluator:0"] == 0
    on_host0 = [n for n, h in plan.host_of.items() if h == 0]
    assert on_host0 == ["chief:0", "ps:0", "evaluator:0"]
    assert plan.tf_configs["evaluator:0"]["cluster"]["evaluator"] == ["10.77.0.11:2224"]


@pytest.mark.parametrize("argv, says", [
    (["--strategy", "none", "--workers", "1"], "--strategy none is one process"),
    (["--strategy", "mirrored", "--workers", "1"], "--strategy mirrored is one process"),
    (["--strategy", "multiworker", "--workers", "2", "--min-workers", "1"],
     "not combined with --min-workers"),
    (["--strategy", "multiworker", "--workers", "2", "--program", "train.py"],
     "--program runs another program"),
    (["--strategy", "multiworker", "--workers", "2", "--engine", "ray"],
     "--evaluator does not apply with --engine ray"),
])
def test_an_evaluator_where_none_can_follow_is_refused_in_one_line(argv, says):
    with pytest.raises(LaunchError) as refused:
        _config(*argv, "--evaluator", "--", "--steps", "30")
    line = str(refused.value)
    assert says in line and "\n" not in line, line
    assert "--evaluator" in line


def test_the_launcher_refuses_under_none_with_exit_2_before_anything_starts(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(launch_cmd("none", "--workers", "1", "--evaluator",
                                     train_args=["--steps", "5", "--model-dir", str(run)]),
                          env=child_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: --evaluator"), proc.stderr
    assert "Traceback" not in proc.stderr and not run.exists()


def test_the_evaluator_of_a_pipeline_refuses_in_its_own_check(tmp_path):
    """The sidecar cannot read a pipeline's checkpoint: the evaluator's own
    ``--check-only`` says so, one line, exit 2, before any member starts."""
    run = tmp_path / "run"
    proc = subprocess.run(launch_cmd("pipeline", "--workers", "2", "--evaluator",
                                     train_args=["--task", "mnist-mlp", "--steps", "5",
                                                 "--model-dir", str(run)]),
                          env=child_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pipeline's checkpoint holds its stages" in errors[0], proc.stderr
    assert "evaluator:0" in errors[0]
    assert not (run / "launch").exists()


# --- the supervisor's decisions (pure) ---------------------------------------------------

@pytest.mark.parametrize("kind", ["multiworker", "ps", "ps-sync"])
def test_the_evaluator_never_decides_the_job(kind):
    k = kinds.get(kind)
    assert not policy.decides(k, "evaluator:0")
    training = {"chief:0": 0} if kind != "multiworker" else {"worker:0": 0, "worker:1": 0}
    # Killed, failed or still running: the job's outcome is training's.
    for code in (-signal.SIGKILL, 2, None):
        assert decide(k, {**training, "evaluator:0": code}) == 0
    running = {name: None for name in training}
    assert decide(k, {**running, "evaluator:0": -signal.SIGKILL}) is None


def test_outcome_json_names_what_became_of_the_evaluator():
    assert evaluator_status(0) == {"status": "finished", "exit_code": 0}
    assert evaluator_status(2) == {"status": "failed", "exit_code": 2}
    assert evaluator_status(-9) == {"status": "killed", "exit_code": -9, "signal": "SIGKILL"}
    assert evaluator_status(None) == {"status": "stopped", "exit_code": None}


# --- real jobs -----------------------------------------------------------------------------

def _run(spawn, model_dir, *launch_args, steps=60):
    p = spawn(launch_cmd("multiworker", "--workers", "2", "--timeout", "400", *launch_args,
                         train_args=[*LOGREG, "--steps", str(steps), "--checkpoint-every", "20",
                                     "--model-dir", str(model_dir)]))
    return p, p.wait(450)


def _outcome(model_dir):
    with open(os.path.join(model_dir, "launch", "outcome.json")) as f:
        return json.load(f)


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_the_evaluator_follows_the_job_to_its_final_checkpoint(tmp_path, spawn):
    model_dir = tmp_path / "run"
    p, code = _run(spawn, model_dir, "--evaluator")
    assert code == 0, p.output
    results = read_results(model_dir)
    record = results["sidecar_evaluation"]
    assert record["member"] == "evaluator:0" and record["examples"] == 10000
    steps = [e["step"] for e in record["evaluations"]]
    # At least one point, each at a checkpoint's step, in order, the last the final one
    # (a checkpoint superseded while another was evaluated is skipped, by design).
    assert steps and steps == sorted(set(steps)) and steps[-1] == 60, steps
    assert all(s % 20 == 0 for s in steps), steps
    # The final checkpoint holds the chief's final weights: the same figures.
    last = record["evaluations"][-1]
    assert abs(last["val_accuracy"] - results["test_accuracy"]) < 1e-5
    assert abs(last["val_loss"] - results["test_loss"]) < 1e-5
    assert {"val_accuracy", "val_loss"} <= tensorboard_tags(
        str(model_dir / "logs" / "eval"))["scalars"]
    assert _outcome(model_dir)["evaluators"] == {
        "evaluator:0": {"status": "finished", "exit_code": 0}}
    assert "[launch] evaluator:0: finished; the job's exit code is training's" in p.lines


@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.timeout(900)
def test_the_evaluator_changes_nothing_of_the_training(tmp_path, spawn):
    alone, with_evaluator = tmp_path / "alone", tmp_path / "beside"
    p, code = _run(spawn, alone)
    assert code == 0, p.output
    p, code = _run(spawn, with_evaluator, "--evaluator")
    assert code == 0, p.output
    a, b = read_results(alone), read_results(with_evaluator)
    assert a["weights_sha256"] == b["weights_sha256"]
    assert a["global_steps"] == b["global_steps"] == 60
    assert a["sidecar_evaluation"] is None
    assert b["sidecar_evaluation"]["evaluations"][-1]["step"] == 60
    assert _outcome(alone)["evaluators"] is None


@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.timeout(600)
def test_an_evaluator_killed_mid_run_leaves_the_job_exit_0(tmp_path, spawn):
    model_dir = tmp_path / "run"
    p, code = _run(spawn, model_dir, "--evaluator", "--kill", "evaluator:0@step=40",
                   steps=300)
    assert code == 0, p.output
    fired = _outcome(model_dir)["faults_fired"]
    assert any("evaluator:0" in str(f) for f in fired), fired
    assert _outcome(model_dir)["evaluators"]["evaluator:0"]["status"] == "killed"
    results = read_results(model_dir)
    # The training ran to its end; the killed evaluator added nothing to its record.
    assert results["global_steps"] == 300 and results["sidecar_evaluation"] is None
    # It was not restarted into the cluster, nor counted as a lost worker.
    assert _outcome(model_dir)["task_restarts"] == 0
    assert sum("restarted evaluator" in line for line in p.lines) == 0
