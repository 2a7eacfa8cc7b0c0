"""The scenarios suite's big sparse embedding study (bench/suites/sparse.py): its pure parts."""

import pytest

from tfdist.bench.suites import scenarios, sparse
from tfdist.bench.suites import scenario_plan as splan
from tfdist.cli import bench as cli
from tfdist.bench.common import BenchError


def _plan(*flags):
    config = cli.parse_args(["--suite", "scenarios", "--out", "/tmp/o", "--staleness-workers", "",
                             *flags])
    return splan.plan_runs(config)


def test_the_study_alone_runs_ctr_under_each_strategy_and_no_mnist_run():
    runs = _plan("--scenarios", "sparse", "--sparse-steps", "40", "--sparse-global-batch", "256")
    assert [r.config for r in runs] == ["sparse/none", "sparse/multiworker", "sparse/ps",
                                        "sparse/ps-sync"]
    for r in runs:
        cmd = " ".join(r.cmd)
        assert "--task ctr --steps 40 --global-batch-size 256" in cmd
        assert cmd.endswith(f"--model-dir /tmp/o/runs/{r.name}")
    by = {r.variant: " ".join(r.cmd) for r in runs}
    assert "--hosts" not in by["none"] and "launch.py" not in by["none"]
    assert "--hosts 2 --" in by["multiworker"] and "--ps" not in by["multiworker"]
    # The chief and both ps share a third host: the launcher counts each host's bytes.
    assert "--hosts 3 --ps 2 --" in by["ps"] and "--hosts 3 --ps 2 --" in by["ps-sync"]


def test_the_whole_suite_includes_the_study_and_a_bad_name_is_one_line():
    assert sum(r.config.startswith("sparse/") for r in _plan()) == 4
    assert not any(r.config.startswith("sparse/") for r in _plan("--scenarios", "uniform"))
    with pytest.raises(BenchError, match="allowed: uniform, slow, links, more, sparse"):
        _plan("--scenarios", "sparce")


def _results(eps, auc):
    return {"examples_per_sec": eps, "test_metrics": {"auc": auc}, "auc_ceiling": 0.8,
            "global_steps": 40, "ps_variable_bytes": None, "peak_rss_bytes": 900 * 2**20}


def test_summary_ratios_target_and_table():
    runs = _plan("--scenarios", "sparse")
    results = {"spa-none": _results(1000.0, 0.79), "spa-multiworker": _results(500.0, 0.79),
               "spa-ps": _results(1500.0, 0.788)}  # ps-sync failed
    outcomes = {"spa-ps": {"peak_rss_bytes": {"ps:0": 800 * 2**20, "chief:0": 700 * 2**20},
                           "traffic": {"hosts": {
                               "host0": {"tasks": ["chief:0", "ps:0", "ps:1"],
                                         "tx_bytes_per_step": 3_000_000, "rx_bytes_per_step": 1_000_000},
                               "host1": {"tasks": ["worker:0"], "tx_bytes_per_step": 500_000,
                                         "rx_bytes_per_step": 1_500_000}}}}}
    rows = sparse.summarize(results, outcomes, runs)
    by = {r["variant"]: r for r in rows}
    assert by["ps"]["ratio"] == 1.5 and by["multiworker"]["ratio"] == 0.5
    assert by["ps"]["busiest_host"] == ("host0 (chief:0, ps:0, ps:1)", 4_000_000)
    assert not by["ps-sync"]["ok"] and by["ps-sync"]["failed"] == ["spa-ps-sync"]
    [target] = sparse.check(rows)
    assert target["met"] and target["ratio"] == 3.0
    table = "\n".join(sparse.render(rows))
    assert "| ps | 2 | 2 | 1,500 | 1.50 | 0.7880 | 0.8000 | ps:0 800, chief:0 700 | 4.000 (host0" in table
    assert "| none | 1 | 0 | 1,000 | 1.00 | 0.7900 | 0.8000 | one process 900 | – |" in table
    assert "| ps-sync | 2 | 2 | FAILED (see runs/spa-ps-sync.log)" in table
    # The AUC condition: ps faster but 0.006 apart misses, and says by how much.
    results["spa-ps"] = _results(1500.0, 0.784)
    [target] = sparse.check(sparse.summarize(results, outcomes, runs))
    assert target["met"] is False and "apart by 0.0060" in target["text"]
    results["spa-ps"] = _results(900.0, 0.79)
    [target] = sparse.check(sparse.summarize(results, outcomes, runs))
    assert target["met"] is False and "missed by 0.20×" in target["text"]
    assert sparse.check([r for r in rows if r["variant"] == "none"]) == []
