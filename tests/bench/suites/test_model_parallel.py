"""The scenarios suite's model-parallel study (bench/suites/model_parallel.py): its pure parts."""

import pytest

from tfdist.bench.suites import model_parallel as mp
from tfdist.bench.suites import scenarios
from tfdist.cli import bench as cli


def _plan(*flags):
    config = cli.parse_args(["--suite", "scenarios", "--out", "/tmp/o", "--staleness-workers", "",
                             *flags])
    return scenarios.plan_runs(config)


def test_the_study_alone_runs_every_stage_and_micro_batch_count_and_no_mnist_cnn():
    runs = _plan("--scenarios", "model-parallel")
    cells = [f"S{s}-M{m}{x}" for s in (1, 2, 4) for m in (1, 2, 4, 8)
             for x in ("", "-1f1b", "-dataflow") if not (x == "-1f1b" and (m < s or s == 1))]
    assert [r.variant for r in runs] == (["none"] + cells + ["dense-chain-none"]
                                         + [f"dense-chain-{c}" for c in cells])
    assert "S2-M1-1f1b" not in cells and "S4-M4-1f1b" in cells  # 1F1B needs M >= S
    by = {r.variant: " ".join(r.cmd) for r in runs}
    assert "launch.py" not in by["none"] and "--task mnist-mlp" in by["none"]
    assert "--strategy pipeline --workers 4" in by["S4-M8"] and "--micro-batches 8" in by["S4-M8"]
    assert "--schedule gpipe" in by["S4-M8"] and "--schedule 1f1b" in by["S4-M8-1f1b"]
    assert "--schedule dataflow" in by["S1-M1-dataflow"]
    assert all(f"--global-batch-size {mp.GLOBAL_BATCH}" in c for k, c in by.items()
               if not k.startswith("dense-chain"))
    assert "--task dense-chain" in by["dense-chain-S2-M8"]
    assert "--global-batch-size 256" in by["dense-chain-S2-M8"]
    # The data-parallel scenarios leave the pipelined kind to this study.
    assert not any(r.kind == "pipeline" for r in _plan("--scenarios", "uniform"))


def test_bubble_model():
    assert mp.bubble(1, 4) == 0 and mp.bubble(2, 1) == 0.5 and mp.bubble(4, 8) == pytest.approx(3 / 11)


def _result(eps, held=None, idle=None):
    total = 3_201_064
    return {"examples_per_sec": eps, "test_accuracy": 0.95, "peak_rss_bytes": 800 * 2**20,
            "pipeline": None if held is None else {
                "parameter_bytes_per_task": held, "model_parameter_bytes": total,
                "measured_idle": idle and {t: idle for t in held},
                "transfers_per_step": {"between_stages": 16, "total": 21}}}


def test_summary_idle_fraction_targets_and_table():
    runs = _plan("--scenarios", "model-parallel")
    half = {"worker:0": 1_593_344, "worker:1": 1_607_720}
    one = {"worker:0": 3_201_064}
    results = {"mp-none": _result(4000.0)}
    for m in (1, 2, 4, 8):
        results[f"mp-S1-M{m}"] = _result(1000.0, one, 0.0)
        # Each stage idle exactly as the model says.
        results[f"mp-S2-M{m}"] = _result(1500.0, half, mp.bubble(2, m))
    rows = mp.summarize(results, {}, [r for r in runs if isinstance(r, mp.ModelParallelRun)])
    by = {r["variant"]: r for r in rows}
    assert by["S2-M4"]["measured_idle"] == pytest.approx(mp.bubble(2, 4))
    assert by["S2-M4"]["worst_share_error"] < 0.01
    assert not by["S4-M4"]["ok"]
    targets = mp.check(rows)
    assert [t["met"] for t in targets] == [True, True], targets
    # A stage idle 20 points off the model misses the target.
    results["mp-S2-M8"] = _result(1500.0, half, mp.bubble(2, 8) + 0.2)
    rows = mp.summarize(results, {}, [r for r in runs if isinstance(r, mp.ModelParallelRun)])
    assert mp.check(rows)[0]["met"] is False
    table = "\n".join(mp.render(rows))
    assert "| mnist-mlp | gpipe | 2 | 4 |" in table and "FAILED (see runs/mp-S4-M1.log)" in table
    assert "worker:0 1,593 (50%)" in table and "| 16 / 21 |" in table
    assert "worker:0 0.20, worker:1 0.20" in table


def test_overlapping_slots_get_lanes_of_their_own_and_the_fewest_lanes():
    assert mp.lanes([(0, 2), (1, 3), (2, 4), (5, 6)]) == [0, 1, 0, 0]
    assert mp.lanes([(3, 4), (0, 10), (1, 2)]) == [1, 0, 1]
    assert mp.lanes([]) == []
