"""A few-step run of train.run in this process: outputs, resume, dry run."""

import json
import os

import pytest

from tfdist.cli import train
from conftest import tensorboard_tags, read_results
from tfdist.strategies import parse_tf_config
from tfdist.training.config import TrainConfig

REQUIRED = {
    "strategy", "task", "num_workers", "num_ps", "replicas_in_sync", "global_batch_size",
    "global_steps", "steps_per_worker", "wall_seconds", "examples_per_sec", "test_accuracy",
    "test_loss", "weights_sha256", "tf_version", "keras_version",
}


def test_flat_scalars_turn_per_worker_fields_into_paths():
    from tfdist.training.loop.reporting import flat_scalars

    fields = {"worker:0": {"accepted": 3, "dropped": 1}, "worker:1": None, "note": "x"}
    assert flat_scalars("train/gradients_per_worker", fields) == {
        "train/gradients_per_worker/worker:0/accepted": 3,
        "train/gradients_per_worker/worker:0/dropped": 1}
    assert flat_scalars("train/staleness_mean", 0.5) == {"train/staleness_mean": 0.5}
    assert flat_scalars("train/flag", True) == {}


def test_mirrored_few_steps_writes_outputs_and_resumes(tmp_path, capsys):
    model_dir = str(tmp_path / "run")
    config = TrainConfig(strategy="mirrored", steps=30, log_every=10, model_dir=model_dir,
                      steps_per_execution=4, data_dir=os.environ.get("TFDS_DATA_DIR"))
    results = train.run(config)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("SUMMARY strategy=mirrored")
    # Four steps per call: progress at the first call past each 10 steps.
    assert [l.split()[1] for l in out if l.startswith("step ")] == ["12/30", "20/30", "30/30"]
    on_disk = read_results(model_dir)
    assert REQUIRED <= set(on_disk)
    assert on_disk == json.loads(json.dumps(results))
    assert on_disk["global_steps"] == 30 and on_disk["steps_per_worker"] == {"local:0": 30}
    assert on_disk["test_accuracy"] > 0.5  # 30 steps of Adam already learn a lot
    assert os.path.exists(os.path.join(model_dir, "model.keras"))
    tags = tensorboard_tags(os.path.join(model_dir, "logs"))
    assert {"train/learning_rate", "train/loss", "test/accuracy"} <= tags["scalars"], tags
    # The HParams dashboard's record of the run's defining flags.
    assert "_hparams_/session_start_info" in tags["plugin"], tags
    assert os.path.exists(os.path.join(model_dir, "checkpoints", "checkpoint"))

    resumed = train.run(TrainConfig(**{**config.__dict__, "steps": 40}))
    assert "resumed from" in capsys.readouterr().out
    assert resumed["resumed_from_step"] == 30 and resumed["global_steps"] == 40
    assert resumed["steps_this_run"] == 10


def test_logreg_sgd_learns(tmp_path):
    results = train.run(TrainConfig(
        strategy="auto", task="mnist-logreg", optimizer="sgd", learning_rate=0.5, steps=100,
        log_every=50, steps_per_execution=10, model_dir=str(tmp_path / "lr"),
        data_dir=os.environ.get("TFDS_DATA_DIR"),
    ))
    assert results["strategy"] == "mirrored" and results["task"] == "mnist-logreg"
    assert results["test_accuracy"] > 0.85


def test_dry_run_prints_plan_and_starts_nothing(tmp_path, capsys):
    cluster = {"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"], "ps": ["localhost:4"]}
    config = TrainConfig(
        dry_run=True, model_dir=str(tmp_path / "m"),
        cluster=parse_tf_config(json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 0}})),
    )
    assert train.run(config) is None
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["strategy"] == "ps" and plan["role"] == "ps" and plan["task"] == "ps:0"
    assert plan["devices"]["visible_gpus"] == [] and "variables" in plan["action"]
    assert plan["cluster"] == cluster and plan["num_workers"] == 3
    assert not (tmp_path / "m").exists()


def test_no_strategy_baseline_with_periodic_eval(tmp_path, capsys):
    results = train.run(TrainConfig(
        strategy="none", task="mnist-logreg", optimizer="sgd", learning_rate=0.5, steps=60,
        eval_every=25, log_every=30, model_dir=str(tmp_path / "none"),
        data_dir=os.environ.get("TFDS_DATA_DIR"),
    ))
    out = capsys.readouterr().out
    assert results["strategy"] == "none" and results["replicas_in_sync"] == 1
    # Evaluations at 25 and 50, then the final one at 60; each on the whole test split.
    curve = results["eval_curve"]
    assert [p["step"] for p in curve] == [25, 50, 60]
    assert out.count("eval step ") == 2
    seconds = [p["seconds"] for p in curve]
    assert seconds == sorted(seconds) and results["eval_seconds"] > 0
    assert curve[-1]["test_accuracy"] == round(results["test_accuracy"], 5)
    assert curve[0]["test_accuracy"] > 0.7


def test_resume_replays_the_data_exactly(tmp_path):
    """Stopping and resuming gives the weights of an uninterrupted run."""
    common = dict(strategy="none", task="mnist-logreg", optimizer="sgd", learning_rate=0.5,
                  lr_schedule="constant", log_every=100, steps_per_execution=5,
                  data_dir=os.environ.get("TFDS_DATA_DIR"))
    straight = train.run(TrainConfig(steps=20, model_dir=str(tmp_path / "a"), **common))
    train.run(TrainConfig(steps=10, model_dir=str(tmp_path / "b"), **common))
    resumed = train.run(TrainConfig(steps=20, model_dir=str(tmp_path / "b"), **common))
    assert resumed["resumed_from_step"] == 10
    assert resumed["weights_sha256"] == straight["weights_sha256"]


def _lines_before_progress(lines):
    first = next(i for i, line in enumerate(lines) if line.startswith("step "))
    return lines[:first]


def test_tensorflow_start_up_noise_is_hidden_unless_verbose(tmp_path):
    """A short run prints at most one line of its own before the first progress line."""
    import subprocess
    import sys

    from conftest import REPO, child_env

    def start(*extra):
        return subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), "--strategy=mirrored", "--model", "logreg",
             "--steps", "20", "--log-every", "10", "--model-dir", str(tmp_path / f"m{len(extra)}"),
             *extra],
            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def lines(proc):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-2000:] + err[-2000:]
        # stderr first: TensorFlow's lines come before any progress line.
        return err.splitlines() + out.splitlines()

    # Both at once: each is mostly TensorFlow's start-up (half the test's time).
    quiet_run, loud_run = start(), start("--verbose")
    try:
        quiet = _lines_before_progress(lines(quiet_run))
        loud = _lines_before_progress(lines(loud_run))
    finally:
        for proc in (quiet_run, loud_run):
            proc.kill()
            proc.wait(timeout=10)
    assert len(quiet) <= 1, quiet
    assert any("oneDNN" in line or "cuda" in line for line in loud), loud


def test_noise_filter_keeps_real_errors():
    from tfdist.training.noise import is_noise

    assert is_noise("WARNING: All log messages before absl::InitializeLog() is called are "
                    "written to STDERR")
    assert is_noise("I0000 00:00:1795430094.083141   25104 port.cc:153] oneDNN custom operations")
    assert is_noise("E0000 00:00:1795429843.804549   13920 cuda_platform.cc:52] failed call to "
                    "cuInit: INTERNAL: CUDA error")
    assert not is_noise("E0000 00:00:1795429843.804549   13920 coordination_service.cc:1] "
                        "tasks are unhealthy")
    assert not is_noise("error: --epochs=0 is not allowed")
    assert not is_noise("Traceback (most recent call last):")


def test_noise_filter_drops_a_dropped_records_continuation_lines_only():
    from tfdist.training.noise import NoiseFilter

    lines = [
        "I0000 00:00:1795480062.677044   23916 coordination_service.cc:502] Waiting for 1/2 tasks to connect.",
        "I0000 00:00:1795480062.677073   23916 coordination_service.cc:505] Example stragglers:",
        "/job:worker/replica:0/task:1",
        "E0000 00:00:1795429843.804549   13920 coordination_service.cc:1] tasks are unhealthy",
        "a continuation of that error record",
        "I0000 00:00:1795480062.677389   23899 coordination_service_agent.cc:245] connected.",
        "Fatal Python error: Segmentation fault",
        "I0000 00:00:1795480062.677389   23899 port.cc:1] oneDNN",
        "Traceback (most recent call last):",
        "  File \"x.py\", line 1, in <module>",
    ]
    f = NoiseFilter()
    kept = [line for line in lines if f.keep(line)]
    assert kept == [lines[3], lines[4], lines[6], lines[8], lines[9]]
