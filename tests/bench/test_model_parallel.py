"""The scenarios suite's model-parallel study (bench/model_parallel.py): its pure parts."""

import pytest

from tfdist.bench import model_parallel as mp
from tfdist.bench import scenarios
from tfdist.cli import bench as cli


def _plan(*flags):
    config = cli.parse_args(["--suite", "scenarios", "--out", "/tmp/o", "--staleness-workers", "",
                             *flags])
    return scenarios.plan_runs(config)


def test_the_study_alone_runs_every_stage_and_micro_batch_count_and_no_mnist_cnn():
    runs = _plan("--scenarios", "model-parallel")
    assert [r.variant for r in runs] == ["none"] + [f"S{s}-M{m}" for s in (1, 2, 4)
                                                    for m in (1, 2, 4, 8)]
    by = {r.variant: " ".join(r.cmd) for r in runs}
    assert "launch.py" not in by["none"] and "--task mnist-mlp" in by["none"]
    assert "--strategy pipeline --workers 4" in by["S4-M8"] and "--micro-batches 8" in by["S4-M8"]
    assert all(f"--global-batch-size {mp.GLOBAL_BATCH}" in c for c in by.values())
    # The data-parallel scenarios leave the pipelined kind to this study.
    assert not any(r.kind == "pipeline" for r in _plan("--scenarios", "uniform"))


def test_bubble_model():
    assert mp.bubble(1, 4) == 0 and mp.bubble(2, 1) == 0.5 and mp.bubble(4, 8) == pytest.approx(3 / 11)


def _result(eps, held=None):
    total = 3_201_064
    return {"examples_per_sec": eps, "test_accuracy": 0.95, "peak_rss_bytes": 800 * 2**20,
            "pipeline": None if held is None else {"parameter_bytes_per_task": held,
                                                   "model_parameter_bytes": total}}


def test_summary_idle_fraction_targets_and_table():
    runs = _plan("--scenarios", "model-parallel")
    half = {"worker:0": 1_593_344, "worker:1": 1_607_720}
    one = {"worker:0": 3_201_064}
    results = {"mp-none": _result(4000.0)}
    for m in (1, 2, 4, 8):
        results[f"mp-S1-M{m}"] = _result(1000.0, one)
        # S = 2 exactly as the model says: T(2, M) = T(1, M) / 2 / (1 - bubble).
        results[f"mp-S2-M{m}"] = _result(1000.0 * 2 * (1 - mp.bubble(2, m)), half)
    rows = mp.summarize(results, {}, [r for r in runs if isinstance(r, mp.ModelParallelRun)])
    by = {r["variant"]: r for r in rows}
    assert by["S2-M4"]["measured_idle"] == pytest.approx(mp.bubble(2, 4))
    assert by["S2-M4"]["worst_share_error"] < 0.01
    assert not by["S4-M4"]["ok"]
    targets = mp.check(rows)
    assert [t["met"] for t in targets] == [True, True], targets
    # A measured idle 20 points off the model misses the target.
    results["mp-S2-M8"] = _result(1000.0 * 2 * (1 - mp.bubble(2, 8) - 0.2), half)
    rows = mp.summarize(results, {}, [r for r in runs if isinstance(r, mp.ModelParallelRun)])
    assert mp.check(rows)[0]["met"] is False
    table = "\n".join(mp.render(rows))
    assert "| 2 | 4 |" in table and "FAILED (see runs/mp-S4-M1.log)" in table
    assert "worker:0 1,593 (50%)" in table
