"""The sidecar evaluator (training.sidecar): TF_CONFIG's ``evaluator`` task runs
``train.py`` outside the training cluster and evaluates each new checkpoint.

These run real ``train.py`` processes one after the other (a run, then its
evaluator reading the finished directory), so they need no cluster; a job with
an evaluator beside its members is in tests/launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, child_env

TIMEOUT = 240.0
TWO_WORKERS = {"cluster": {"worker": ["localhost:1", "localhost:2"],
                           "evaluator": ["localhost:3"]},
               "task": {"type": "evaluator", "index": 0}}


def _train(argv, tf_config=None, timeout=TIMEOUT):
    return subprocess.run([sys.executable, str(REPO / "train.py"), *argv],
                          env=child_env(tf_config), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def _errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def test_the_evaluator_evaluates_the_run_and_adds_its_history_to_results(tmp_path):
    run = str(tmp_path / "run")
    flags = ["--task", "mnist-logreg", "--steps", "40", "--checkpoint-every", "20",
             "--model-dir", run]
    trained = _train(["--strategy", "none", *flags])
    assert trained.returncode == 0, trained.stderr[-2000:]
    before = json.load(open(os.path.join(run, "results.json")))

    evaluated = _train(["--strategy", "multiworker", *flags], TWO_WORKERS)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    after = json.load(open(os.path.join(run, "results.json")))
    record = after["sidecar_evaluation"]
    assert record["member"] == "evaluator:0" and record["split"] == "test"
    assert record["examples"] == 10000
    # The newest checkpoint is the run's last: it is the one evaluated, and on the
    # same weights the chief's own evaluation gave the same figures.
    assert [e["step"] for e in record["evaluations"]] == [40]
    last = record["evaluations"][-1]
    assert abs(last["val_accuracy"] - before["test_accuracy"]) < 1e-5
    assert abs(last["val_loss"] - before["test_loss"]) < 1e-5
    # The chief's record is otherwise untouched.
    assert before["sidecar_evaluation"] is None
    assert {k: v for k, v in after.items() if k != "sidecar_evaluation"} == {
        k: v for k, v in before.items() if k != "sidecar_evaluation"}
    assert os.listdir(os.path.join(run, "logs", "eval"))


def test_an_evaluator_with_no_checkpoint_to_read_is_one_line_and_exit_2(tmp_path):
    run = tmp_path / "empty"
    proc = _train(["--strategy", "multiworker", "--task", "mnist-logreg", "--steps", "40",
                   "--model-dir", str(run), "--startup-timeout", "2"], TWO_WORKERS)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = _errors(proc)
    assert len(errors) == 1 and "no checkpoint appeared" in errors[0], proc.stderr[-2000:]
    assert "--startup-timeout" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not (run / "results.json").exists()


def test_the_evaluator_refuses_a_pipeline_in_one_line(tmp_path):
    tf_config = {"cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"],
                             "evaluator": ["localhost:3"]},
                 "task": {"type": "evaluator", "index": 0}}
    proc = _train(["--strategy", "pipeline", "--task", "mnist-mlp", "--steps", "10",
                   "--model-dir", str(tmp_path / "run"), "--startup-timeout", "2"], tf_config)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = _errors(proc)
    assert len(errors) == 1 and "pipeline's checkpoint holds its stages" in errors[0]
