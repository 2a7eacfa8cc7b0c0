"""The evaluation suite (bench/suites/evaluation.py): its plan, summary and report, pure."""

import pytest

from tfdist.bench.common import BenchError, cluster_cores
from tfdist.bench.suites import evaluation
from tfdist.cli import bench as cli
from tfdist.strategies import kinds as strategy_kinds


def _plan(*flags):
    return evaluation.plan(cli.parse_args(["--suite", "evaluation", "--out", "/tmp/o", *flags]),
                           python="py")


def test_the_pairs_are_interleaved_with_every_task_at_half_a_core():
    runs = _plan("--repeats", "2")
    assert [r.name for r in runs] == [
        f"eval-{kind}-{where}-r{pair}" for pair in (1, 2) for kind in ("multiworker", "ps")
        for where in ("shared", "chief")]
    by = {r.name: " ".join(r.cmd) for r in runs}
    mw, ps = by["eval-multiworker-shared-r1"], by["eval-ps-chief-r2"]
    assert "--slow worker:0=0.5 --slow worker:1=0.5 --" in mw and "chief:0" not in mw
    # Each fraction is of the task's own cores: half a core each, whatever it may use.
    cores = cluster_cores(strategy_kinds.get("ps"), 2)
    assert sorted(cores) == ["chief:0", "ps:0", "worker:0", "worker:1"]
    for task, n in cores.items():
        assert f"--slow {task}={0.5 / n:g}" in ps
    assert "--strategy ps --workers 2" in ps and "--ps 1" in ps
    for name, cmd in by.items():
        where = "shared" if "-shared-" in name else "chief"
        assert f"--eval-every 0" in cmd and f"--evaluate-on {where}" in cmd
        assert "--steps 20" in cmd
        assert cmd.endswith(f"--model-dir /tmp/o/runs/{name}")


def test_repeats_below_one_are_refused():
    with pytest.raises(BenchError, match="--repeats 0"):
        _plan("--repeats", "0")


def test_each_pair_is_its_own_ratio_and_a_failed_side_fails_the_row():
    runs = _plan("--repeats", "1")
    shared = {"where": "members", "seconds": 1.0, "all_reduce_seconds": 0.1,
              "batch_seconds_per_member": {"worker:0": 0.8, "worker:1": 0.9}}
    results = {
        "eval-multiworker-shared-r1": {"evaluation": shared, "test_accuracy": 0.89},
        "eval-multiworker-chief-r1": {"evaluation": {"where": "chief", "seconds": 2.0},
                                      "test_accuracy": 0.89},
        "eval-ps-shared-r1": {"evaluation": {"where": "workers", "seconds": 1.5, "shards": 10}},
    }
    rows = evaluation.summarize(results, runs)
    mw, ps = rows
    assert mw["ok"] and mw["ratio"] == pytest.approx(0.5)
    assert not ps["ok"] and ps["ratio"] is None and ps["failed"] == ["eval-ps-chief-r1"]
    text = evaluation.render(rows, {"pairs": 1}, "a machine", "0.10 0.20 0.30")
    assert "| multiworker | 1 | 1.00 s | 2.00 s | 0.50× |" in text
    assert "worker:1 batches 0.90 s, all-reduce 0.10 s" in text
    assert "FAILED (see runs/eval-ps-chief-r1.log)" in text
