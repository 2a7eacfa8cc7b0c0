"""The scaling curves against the predictor (pure but for files): the fit on the planned
runs, each run's error and role, the summary, the predicted crossovers, and the command."""

import json
from dataclasses import replace

import pytest

from tfdist.bench import predict as pr, scale
from tfdist.cli import bench as cli

CNN = 225_034


def write(root, name, strategy, workers, examples_per_sec, ps=0, cores=0.5, rate=None):
    d = root / "runs" / name
    d.mkdir(parents=True)
    batch = 64 if strategy == "ps" else 64 * workers
    (d / "results.json").write_text(json.dumps({
        "strategy": strategy, "num_workers": workers, "num_ps": ps, "global_batch_size": batch,
        "examples_per_sec": examples_per_sec, "trainable_params": CNN, "task": "mnist-cnn"}))
    (d / "outcome.json").write_text(json.dumps({
        "link": {"set_bits_per_sec": rate} if rate else None,
        "host_cpus": {f"host{i}": {"cores": cores} for i in range(workers + (ps > 0))}}))


@pytest.fixture
def measured(tmp_path, monkeypatch):
    # The runs' machine is read as this one's: two cores, as where they ran.
    monkeypatch.setattr(pr.os, "cpu_count", lambda: 2)
    # Made by the model itself with known costs: 40 ms a step, 4 ns per byte, 3 ms dispatch.
    truth = pr.Profile("mnist-cnn", CNN, 64, 0.040, 0.5, cpu_per_byte=2e-9, hidden=0.36,
                       dispatch_seconds=0.003, kernel_per_byte=3e-9, ring_cpu_per_byte=2e-9)
    cells = [("mw1", "multiworker", 1, 0, 0.5, None), ("mw2", "multiworker", 2, 0, 0.5, None),
             ("ps1", "ps", 1, 1, 0.4, None),
             ("mw4", "multiworker", 4, 0, 0.5, None), ("ps4", "ps", 4, 1, 0.4, None),
             ("ps2", "ps", 2, 1, 0.4, None), ("mw2s", "multiworker", 2, 0, 0.5, 100e6)]
    for name, s, n, ps, cores, rate in cells:
        target = pr.Target(n, ps=max(ps, 1), link_bits_per_sec=rate, cores=cores,
                           per_worker_batch=64, machine_cores=2.0)
        write(tmp_path, name, s, n, pr.predict(truth, target, s).examples_per_sec, ps, cores, rate)
    (tmp_path / "plan.json").write_text(json.dumps({
        "fit": {"mw1": "profile", "ps1": "cpu_per_byte", "mw2": "ring_cpu_per_byte",
                "mw4": "kernel_per_byte", "ps4": "dispatch_seconds"}, "held_out": ["mw2s"]}))
    return tmp_path, truth


def test_the_fit_recovers_the_costs_that_made_the_runs(measured):
    root, truth = measured
    runs, plan = scale.load(str(root))
    profiles, costs = scale.fit(runs, plan)
    assert profiles["mnist-cnn"].compute_seconds == pytest.approx(0.040, rel=1e-6)
    assert costs["cpu_per_byte"] == pytest.approx(2e-9, rel=1e-4)
    assert costs["ring_cpu_per_byte"] == pytest.approx(2e-9, rel=1e-4)
    assert costs["dispatch_seconds"] == pytest.approx(0.003, rel=1e-4)
    assert costs["kernel_per_byte"] == pytest.approx(3e-9, rel=1e-4)
    table = scale.rows(runs, plan, profiles)
    roles = {r["run"]: r["role"] for r in table}
    assert roles == {"mw1": "fit", "mw2": "fit", "ps4": "fit", "ps2": "checked", "mw4": "fit",
                     "ps1": "fit", "mw2s": "held out"}
    assert max(abs(r["error"]) for r in table) < 1e-4
    eff = {r["run"]: r["efficiency"] for r in table}
    assert eff["mw1"] == pytest.approx(1.0) and eff["mw2"] < 1.0
    numbers = scale.summary(table)
    assert numbers["points"] == 2 and numbers["held_out"] == 1


def test_costs_given_in_the_plan_start_the_fit(measured):
    root, _ = measured
    runs, plan = scale.load(str(root))
    plan = {"fit": {"mw1": "profile", "ps1": "cpu_per_byte"},
            "costs": {"dispatch_seconds": 0.003, "kernel_per_byte": 3e-9}}
    profiles, costs = scale.fit(runs, plan)
    assert costs["dispatch_seconds"] == 0.003 and profiles["mnist-cnn"].kernel_per_byte == 3e-9
    assert costs["cpu_per_byte"] == pytest.approx(2e-9, rel=1e-4)


def test_an_error_is_reported_against_the_measurement(measured):
    root, _ = measured
    runs, plan = scale.load(str(root))
    profiles, _ = scale.fit(runs, plan)
    slower = {**runs, "ps2": pr.Measured("ps", runs["ps2"].target,
                                         runs["ps2"].examples_per_sec / 2, CNN, "mnist-cnn")}
    row = next(r for r in scale.rows(slower, plan, profiles) if r["run"] == "ps2")
    assert row["error"] == pytest.approx(1.0, rel=1e-4)  # predicted twice what ran
    assert scale.summary(scale.rows(slower, plan, profiles))["max_abs_error"] == pytest.approx(
        1.0, rel=1e-4)


def test_a_digest_lists_runs_whose_files_were_not_kept(measured):
    root, _ = measured
    run = scale.load(str(root))[0]["ps2"]
    listed = {"strategy": "ps", "workers": 2, "ps": 1, "cores": 0.4, "link_bits_per_sec": None,
              "per_worker_batch": 64, "params": CNN, "machine_cores": 2.0,
              "examples_per_sec": run.examples_per_sec, "task": "mnist-cnn"}
    (root / "digest.json").write_text(json.dumps({"runs": {"ps2d": listed}}))
    plan = {**json.loads((root / "plan.json").read_text()), "seen": ["mw2s"]}
    (root / "plan.json").write_text(json.dumps(plan))
    runs, plan = scale.load(str(root))
    assert runs["ps2d"] == run  # read as its files would be
    table = scale.rows(runs, plan, scale.fit(runs, plan)[0])
    roles = {r["run"]: r["role"] for r in table}
    assert roles["ps2d"] == "checked" and roles["mw2s"] == "seen"
    # A held-out point the model was revised after is checked, not held out.
    assert scale.summary(table)["held_out"] == 0 and scale.summary(table)["points"] == 3


def test_a_held_out_cell_measured_twice_is_checked_against_its_runs_mean(measured):
    root, _ = measured
    runs, plan = scale.load(str(root))
    again = runs["mw2s"].examples_per_sec * 1.5
    runs["mw2s-rerun"] = pr.Measured("multiworker", runs["mw2s"].target, again, CNN, "mnist-cnn")
    plan = {**plan, "held_out": ["mw2s", "mw2s-rerun"]}
    table = scale.rows(runs, plan, scale.fit(runs, plan)[0])
    numbers = scale.summary(table)
    assert numbers["held_out"] == 2
    # predicted = the first run's rate; the mean is 1.25 times it
    assert numbers["held_out_cells"] == {"mw2s": pytest.approx(1 / 1.25 - 1, rel=1e-3)}
    text = "\n".join(scale.render(table, {}, {}, numbers))
    assert "Held-out cells against the mean of their runs: mw2s -20.0%" in text
    assert "| held out (measured again) |" in text


def test_a_fit_run_no_cost_reproduces_is_named(measured):
    root, _ = measured
    runs, plan = scale.load(str(root))
    # Ten times faster than its compute alone allows: no byte CPU of 0 or more matches it.
    runs["ps1"] = replace(runs["ps1"], examples_per_sec=runs["ps1"].examples_per_sec * 10)
    numbers = scale.summary(scale.rows(runs, plan, scale.fit(runs, plan)[0]))
    assert numbers["unmatched_fits"] == ["ps1"]


def test_a_rate_no_table_names_is_written_as_tc_would_set_it():
    assert [scale.rate_name(r) for r in (None, 100e6, 300e6, 1e9, 2.5e9)] == [
        "unshaped", "100 Mbit/s", "300 Mbit/s", "1 Gbit/s", "2.5 Gbit/s"]


def test_crossovers_are_where_the_leader_changes():
    profile = pr.Profile("mnist-cnn", CNN, 64, 0.010, 1.0)
    found = scale.crossovers(profile)
    assert {c["link"] for c in found} == {"100 Mbit/s", "1 Gbit/s", "10 Gbit/s"}
    for c in found:
        if c["workers"] is None:
            continue
        at = scale.big_target(c["workers"], {"100 Mbit/s": 100e6, "1 Gbit/s": 1e9,
                                             "10 Gbit/s": 10e9}[c["link"]])
        assert (pr.predict(profile, at, c["overtaken_by"]).examples_per_sec
                > pr.predict(profile, at, c["leader"]).examples_per_sec)


def test_the_command_writes_the_table_and_plots(measured, capsys):
    root, _ = measured
    assert cli.main(["--predict-check", str(root)]) == 0
    text = (root / "scale.md").read_text()
    assert "| mnist-cnn | multiworker |  | 4 | 0.5 | unshaped |" in text
    assert (root / "scale.png").exists() and (root / "predicted_1024.png").exists()
    assert json.loads((root / "scale.json").read_text())["summary"]["points"] == 2


def test_the_predict_command_and_its_bad_input(measured, capsys):
    root, _ = measured
    run = str(root / "runs" / "mw1")
    assert cli.main(["--predict", run, "--workers", "1,1024", "--predict-link-rate", "1gbit"]) == 0
    out = capsys.readouterr().out
    assert "| 1024 | multiworker |" in out and "predicted, not measured" in out
    assert cli.main(["--predict", run, "--predict-link-rate", "fast"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --predict: --predict-link-rate 'fast' is not a rate")
    assert "\n" not in err
    assert cli.main(["--predict", run, "--predict-shard-state", "optimizer",
                     "--predict-ps", "2"]) == 0
    assert "| ps |" not in capsys.readouterr().out
    assert cli.main(["--predict-check", str(root / "nowhere")]) == 2
