"""--all-reduce-bucket: multiworker's gradients all-reduced in buckets, last layers first."""

import re

import pytest

from conftest import REPO, launch_cmd, read_results, refused_line

SPEC = str(REPO / "tests" / "training" / "fit_tasks.py") + ":"


@pytest.mark.parametrize("argv,says", [
    (["--all-reduce-bucket", "0"], "--all-reduce-bucket '0' is not a positive size"),
    (["--all-reduce-bucket", "lots"], "--all-reduce-bucket 'lots' is not a positive size"),
    (["--all-reduce-bucket", "64k", "--strategy", "none"],
     "--all-reduce-bucket applies to --strategy multiworker only"),
])
def test_a_bad_bucket_is_one_line_and_exit_2(tmp_path, capsys, argv, says):
    assert says in refused_line(argv, tmp_path, capsys)


def test_sizes_are_read():
    from tfdist.training.config import parse_size

    assert parse_size("262144", "f") == parse_size("256k", "f") == parse_size("256KiB", "f")
    assert parse_size("1m", "f") == 1 << 20 and parse_size(None, "f") is None


def _train(spawn, model_dir, *args):
    p = spawn(launch_cmd("multiworker", "--workers", "2", train_args=[
        "--task", SPEC + "TWO_OUTPUTS", "--steps", "30", "--global-batch-size", "64",
        "--log-every", "30", "--model-dir", str(model_dir), *args]))
    assert p.wait(timeout=300) == 0, p.output
    hashes = set(re.findall(r"weights_sha256=([0-9a-f]{64})", p.output))
    assert len(hashes) == 1, p.output[-3000:]  # every worker ends with the same weights
    return read_results(model_dir)["weights_sha256"]


@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_buckets_change_when_bytes_move_not_the_sum(tmp_path, spawn, dtype):
    """Two workers: each element's sum is a + b in any packing, so one bucket per
    variable and one for the whole model give the same weights, bit for bit."""
    small = _train(spawn, tmp_path / "small", "--all-reduce-bucket", "1",
                   "--gradient-dtype", dtype)
    whole = _train(spawn, tmp_path / "whole", "--all-reduce-bucket", "64m",
                   "--gradient-dtype", dtype)
    assert small == whole
