"""--profile-steps A:B: a TensorFlow profiler trace of those steps per task, in the run's logs."""

import glob
import os

import pytest

from conftest import REPO, launch_cmd

SPEC = str(REPO / "tests" / "training" / "fit_tasks.py") + ":"


@pytest.mark.parametrize("text,steps", [("0:1", (0, 1)), ("20:25", (20, 25)), (None, None)])
def test_a_range_of_steps_is_read(text, steps):
    from tfdist.training.loop.profiling import parse_steps

    assert parse_steps(text) == steps


@pytest.mark.parametrize("text", ["5", "5:5", "6:5", "-1:3", "a:b", "3:"])
def test_a_bad_range_is_one_line_and_exit_2(tmp_path, capsys, text):
    from tfdist.cli import train

    code = train.main([f"--profile-steps={text}", "--dry-run", "--model-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--profile-steps" in err[0] and "A:B" in err[0], err
    assert not (tmp_path / "r").exists()


def _traces(model_dir, task):
    return glob.glob(os.path.join(model_dir, "logs", f"profile-{task}", "plugins", "profile",
                                  "*", "*.xplane.pb"))


def test_the_steps_are_traced_into_the_runs_logs(tmp_path, capsys):
    import tfdist

    tfdist.fit(SPEC + "BLOBS", "none", options=tfdist.TrainOptions(
        model_dir=str(tmp_path), steps=30, global_batch_size=64, profile_steps="10:15",
        log_every=100))
    traces = _traces(tmp_path, "local-0")
    assert len(traces) == 1, os.listdir(tmp_path / "logs")
    data = open(traces[0], "rb").read()
    # The calls of those steps are marked as steps ("train" step markers) on the timeline.
    assert b"train" in data and len(data) > 1000
    assert "profile of steps 10:15 written to" in capsys.readouterr().out


def test_without_the_flag_there_is_no_trace(tmp_path):
    import tfdist

    tfdist.fit(SPEC + "BLOBS", "none", options=tfdist.TrainOptions(
        model_dir=str(tmp_path), steps=5, global_batch_size=64))
    assert not glob.glob(str(tmp_path / "logs" / "profile-*"))


@pytest.mark.multiprocess
@pytest.mark.long
def test_every_multiworker_worker_writes_its_trace(tmp_path, spawn):
    p = spawn(launch_cmd("multiworker", "--workers", "2", train_args=[
        "--task", SPEC + "BLOBS", "--steps", "40", "--global-batch-size", "64",
        "--profile-steps", "20:25", "--model-dir", str(tmp_path)]))
    assert p.wait(timeout=300) == 0, p.output
    for task in ("worker-0", "worker-1"):
        assert len(_traces(tmp_path, task)) == 1, (task, os.listdir(tmp_path / "logs"))


@pytest.mark.multiprocess
@pytest.mark.long
def test_under_ps_the_chief_takes_every_serving_tasks_trace(tmp_path, spawn):
    p = spawn(launch_cmd("ps", "--workers", "2", "--ps", "1", train_args=[
        "--task", SPEC + "BLOBS", "--steps", "60", "--global-batch-size", "64",
        "--profile-steps", "30:40", "--model-dir", str(tmp_path)]))
    assert p.wait(timeout=300) == 0, p.output
    for task in ("chief-0", "worker-0", "worker-1", "ps-0"):
        assert len(_traces(tmp_path, task)) == 1, (task, os.listdir(tmp_path / "logs"))
