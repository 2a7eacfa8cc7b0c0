"""The network's limit in the scenarios suite (pure): link figures, the scaling study's
plan, rows and report, and the network targets."""

import pytest

from tfdist.bench import link_limit
from tfdist.bench.suites import scaling
from tfdist.cli import bench as cli
from tfdist.bench.suites import scenarios as scen
from tfdist.bench.suites import scenario_plan as splan, scenario_report as srep, scenario_summary as ssum

CNN = 225_034
MBIT100 = 100_000_000
WIRE = 1514 / 1448  # the model's payload in frames


def outcome(hosts: dict, trainer: str, steps: int = 100, shares=None, rate=MBIT100):
    """A launch outcome's ``traffic`` and ``link``: {hostN: (tasks, tx/step, rx/step)}."""
    return {"link": {"set_bits_per_sec": rate, "measured_bits_per_sec": 0.964 * rate},
            "traffic": {"steps": steps, "trainer": trainer, "worker_shares": shares,
                        "hosts": {name: {"tasks": tasks, "tx_bytes": tx * steps,
                                         "rx_bytes": rx * steps, "tx_bytes_per_step": tx,
                                         "rx_bytes_per_step": rx}
                                  for name, (tasks, tx, rx) in hosts.items()}}}


def result(examples_per_sec, batch=128, dtype="float32", params=CNN):
    return {"examples_per_sec": examples_per_sec, "global_batch_size": batch,
            "trainable_params": params, "gradient_dtype": dtype}


def test_async_ps_limit_is_the_ps_hosts_outgoing_link():
    rec = outcome({"host0": (["chief:0", "ps:0"], 950_000, 946_000),
                   "host1": (["worker:0"], 520_000, 521_000),
                   "host2": (["worker:1"], 426_000, 427_000)}, "ps",
                  shares={"worker:0": 0.55, "worker:1": 0.45})
    f = link_limit.figures(result(1292), rec)
    assert (f["host"], f["direction"]) == ("host0", "tx")
    assert f["tasks"] == ["chief:0", "ps:0"]
    # 12.5 MB/s over 0.95 MB per step, 128 examples a step.
    assert f["limit_examples_per_sec"] == pytest.approx(12.5e6 / 950_000 * 128)
    assert f["fraction"] == pytest.approx(1292 / f["limit_examples_per_sec"])
    # The model: every weight read out of the ps once per step.
    assert f["model_bytes_per_step"] == round(4 * CNN * WIRE)
    assert f["model_ratio"] == pytest.approx(950_000 / (4 * CNN * WIRE), rel=1e-5)
    assert "serial_fraction" not in f  # async: both directions at once


def test_ps_sync_also_gets_the_serial_limit_of_both_directions():
    rec = outcome({"host0": (["chief:0", "ps:0"], 1_900_000, 1_890_000),
                   "host1": (["worker:0"], 945_000, 950_000),
                   "host2": (["worker:1"], 945_000, 950_000)}, "ps-sync")
    f = link_limit.figures(result(466), rec)
    assert f["serial_limit_examples_per_sec"] == pytest.approx(12.5e6 / 3_790_000 * 128)
    assert f["serial_fraction"] > f["fraction"]
    assert f["model_bytes_per_step"] == round(2 * 4 * CNN * WIRE)


def test_the_models_worst_host_is_reported_and_small_flows_are_left_out():
    # host0 (the chief alone) moves a few kB where the model has no flow: not checked.
    rec = outcome({"host0": (["chief:0"], 3_000, 3_000),
                   "host1": (["ps:0"], 1_000_000, 950_000),
                   "host2": (["worker:0"], 475_000, 500_000),
                   "host3": (["worker:1"], 475_000, 460_000)}, "ps")
    f = link_limit.figures(result(1500), rec)
    # The model: each worker reads half the weights a step, 0.47 MB in frames.
    assert (f["model_worst"]["host"], f["model_worst"]["direction"]) == ("host1", "tx")
    assert f["model_worst"]["ratio"] == pytest.approx(1_000_000 / (4 * CNN * WIRE), rel=1e-5)


def test_no_figures_without_shaped_links_or_steps():
    rec = outcome({"host0": (["worker:0"], 1, 1)}, "sync")
    assert link_limit.figures(result(1), {**rec, "link": None}) is None
    rec["traffic"]["steps"] = None
    assert link_limit.figures(result(1), rec) is None
    assert link_limit.figures(result(1), None) is None


def test_without_the_parameter_count_only_the_measured_side():
    rec = outcome({"host0": (["worker:0"], 900_000, 900_000),
                   "host1": (["worker:1"], 900_000, 900_000)}, "sync")
    f = link_limit.figures(result(1000, params=None), rec)
    assert "model_bytes_per_step" not in f and f["fraction"] > 0


# --- the scaling study ------------------------------------------------------------------

def scaling_args(tmp_path, *extra):
    return cli.parse_args(["--suite", "scenarios", "--scenarios", "scaling", "--out",
                           str(tmp_path), "--staleness-workers", "", *extra])


def test_scaling_plans_each_kind_on_each_worker_count_then_unshaped(tmp_path):
    runs = splan.plan_runs(scaling_args(tmp_path, "--scaling-workers", "1,2,4"), python="py")
    assert all(isinstance(r, scaling.ScalingRun) for r in runs)  # the study alone
    names = [r.name for r in runs]
    kinds = ("multiworker", "ps", "ps-sync")
    assert names == [f"sca-{k}-{n}w" for n in (1, 2, 4) for k in kinds] + \
        [f"sca-{k}-4w-unshaped" for k in kinds]
    cmd = {r.name: list(r.cmd) for r in runs}
    ps4 = cmd["sca-ps-4w"]
    assert ps4[ps4.index("--hosts") + 1] == "5" and ps4[ps4.index("--link-rate") + 1] == "100mbit"
    # One worker alone sends nothing: no simulated hosts to shape.
    assert "--hosts" not in cmd["sca-multiworker-1w"]
    assert "--hosts" not in cmd["sca-ps-4w-unshaped"]
    sync = cmd["sca-ps-sync-4w"]
    assert sync[sync.index("--replicas-to-aggregate") + 1] == "4"
    for c in cmd.values():
        assert c[c.index("--global-batch-size") + 1] == "120"
        assert c[c.index("--eval-every") + 1] == "0"


def test_bad_scaling_workers_is_one_line(tmp_path):
    with pytest.raises(scen.BenchError, match="--scaling-workers 'two'"):
        splan.plan_runs(scaling_args(tmp_path, "--scaling-workers", "two"), python="py")
    assert scen.run(scaling_args(tmp_path, "--scaling-workers", "0")) == 2


def test_scaling_rows_report_and_plot(tmp_path):
    runs = splan.plan_runs(scaling_args(tmp_path, "--scaling-workers", "1,2"), python="py")
    two = outcome({"host0": (["worker:0"], 950_000, 950_000),
                   "host1": (["worker:1"], 950_000, 950_000)}, "sync")
    results = {r.name: result(1000 + 100 * r.workers, batch=120) for r in runs}
    del results["sca-ps-sync-2w"]  # a failed run is a row that says so
    rows = scaling.summarize(results, {"sca-multiworker-2w": two}, runs)
    by = {r["config"]: r for r in rows}
    assert by["scaling/multiworker/2w"]["link"]["bytes_per_step"] == 950_000
    assert by["scaling/multiworker/1w"]["link"] is None
    assert by["scaling/ps-sync/2w"]["ok"] is False
    md = "\n".join(scaling.render(rows))
    assert "FAILED (see runs/sca-ps-sync-2w.log)" in md
    assert "| multiworker | 2 | 1,200 | host0 tx | 0.950 | 0.941 | 1.01 |" in md
    assert "multiworker (unshaped) | 2 | 1,200 | unshaped" in md
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = scaling.plot(plt, rows, "test machine", str(tmp_path), srep.save)
    assert path.endswith("scaling.png") and (tmp_path / "scaling.png").stat().st_size > 0


# --- the network targets -------------------------------------------------------------------

def linked_row(config, eps, fraction, model_ratio=1.05, serial=None, accuracy=None):
    scenario, _, variant = config.partition("/")
    link = {"fraction": fraction, "model_worst": {"host": "host0", "direction": "tx",
                                                  "ratio": model_ratio}}
    if serial is not None:
        link["serial_fraction"] = serial
    return {"config": config, "scenario": scenario, "variant": variant, "peer": "",
            "examples_per_sec": eps, "link": link, "test_accuracy": accuracy}


def test_network_targets_met_and_missed_by_how_much():
    rows = [linked_row("links/multiworker", 1500, 0.87),
            linked_row("links/ps", 1290, 0.77, model_ratio=1.16),
            linked_row("links/ps-sync", 466, 0.55, serial=1.05),
            linked_row("links/multiworker-bf16", 2550, 0.80),
            {"config": "uniform/multiworker", "scenario": "uniform", "variant": "multiworker",
             "peer": "", "examples_per_sec": 1, "test_accuracy": 0.9916},
            {"config": "uniform/multiworker-bf16", "scenario": "uniform",
             "variant": "multiworker-bf16", "peer": "", "examples_per_sec": 1,
             "test_accuracy": 0.9890}]
    targets = ssum.check_links(rows, {r["config"]: r for r in rows})
    by = {t["target"].split(" ")[1]: t for t in targets}
    fraction = next(t for t in targets if "link-bound limit" in t["target"])
    assert fraction["met"] is False
    assert "ps 77% (8 points short)" in fraction["text"]
    assert "ps-sync 55% (30 points short), 105% of its serial limit" in fraction["text"]
    half = next(t for t in targets if "bfloat16" in t["target"])
    assert half["ratio"] == pytest.approx(1.7) and half["met"] is False  # accuracy: 0.0026 lower
    assert "lower by 0.0026" in half["text"]
    model = next(t for t in targets if "traffic model" in t["target"])
    assert model["met"] is False and "links/ps 1.16" in model["text"]
    assert by  # every target has a label


def test_no_network_targets_without_shaped_runs():
    assert ssum.check_links([], {}) == []
