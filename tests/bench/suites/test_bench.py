"""The benchmark (bench/): the pure parts, and a few-step smoke run (no performance assertions)."""

import json
import os
import subprocess
import sys

import pytest

from tfdist.bench import common
from tfdist.bench.suites import default as suite
from tfdist.cli import bench as cli
from tfdist.bench.suites import scenarios as scen
from tfdist.bench.suites import scenario_plan as splan, scenario_report as srep, scenario_summary as ssum
from conftest import REPO, child_env, descendants_alive


def args(**kw):
    return cli.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_plan_runs_same_work_for_every_strategy(tmp_path):
    runs = suite.plan_runs(args(workers="1,2", out=str(tmp_path), steps=50, repeats=1),
                           python="py")
    assert [r.name for r in runs] == [
        "none", "synthetic", "mirrored", "multiworker-1w", "multiworker-2w", "ps-1w", "ps-2w",
        "ps-sync-1w", "ps-sync-2w",
    ]
    for run in runs:
        cmd = list(run.cmd)
        # Identical work: steps, batch, seed and steps per call in every command.
        for flag, value in [("--steps", "50"), ("--global-batch-size", "128"), ("--seed", "42"),
                            ("--steps-per-execution", "10")]:
            assert cmd[cmd.index(flag) + 1] == value, (run.name, flag)
        assert cmd[cmd.index("--model-dir") + 1] == str(tmp_path / "runs" / run.name)
    ps = {r.name: list(r.cmd) for r in runs}["ps-2w"]
    assert ps[1].endswith("launch.py") and ps[ps.index("--workers") + 1] == "2"
    assert ps[ps.index("--ps") + 1] == "1" and "--" in ps
    synthetic = list(runs[1].cmd)
    assert "--synthetic-data" in synthetic and "--strategy=none" in synthetic


def test_repeats_are_interleaved_and_the_best_counts(tmp_path):
    runs = suite.plan_runs(args(only="none,ps", out=str(tmp_path), repeats=2), python="py")
    # Every configuration once, then again: a slow spell hits all of them.
    assert [(r.name, r.config) for r in runs] == [
        ("none-r1", "none"), ("ps-2w-r1", "ps-2w"), ("none-r2", "none"), ("ps-2w-r2", "ps-2w"),
    ]
    assert len({r.model_dir for r in runs}) == 4
    result = lambda eps: {"examples_per_sec": eps, "test_accuracy": 0.99, "global_steps": 10}
    results = {"none-r1": result(1000.0), "none-r2": result(1200.0),
               "ps-2w-r1": result(800.0), "ps-2w-r2": result(1020.0)}
    rows = {r["name"]: r for r in suite.summarize(results, runs, 0.99)}
    assert rows["none"]["examples_per_sec"] == 1200.0
    assert rows["ps-2w"]["examples_per_sec_each"] == [800.0, 1020.0]
    assert rows["ps-2w"]["ratio"] == pytest.approx(0.85) and rows["ps-2w"]["meets_target"]
    # One failed repeat fails the row, and the table names that run's log.
    del results["ps-2w-r2"]
    rows = {r["name"]: r for r in suite.summarize(results, runs, 0.99)}
    assert not rows["ps-2w"]["ok"] and rows["ps-2w"]["failed"] == ["ps-2w-r2"]
    md = suite.render_markdown(list(rows.values()), {}, "m", 0.99)
    assert "| ps-2w | 2 | FAILED (see runs/ps-2w-r2.log)" in md


@pytest.mark.parametrize("flag, words", [
    (["--workers", "0,2"], ["'0,2'", "positive"]),
    (["--only", "ps,horovod"], ["horovod", "allowed"]),
    (["--only", "ps"], ["'none'", "baseline"]),
    (["--repeats", "0"], ["--repeats 0", "at least 1"]),
])
def test_bad_input_one_line(flag, words, capsys, tmp_path):
    assert cli.main([*flag, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
    assert all(w in err[0] for w in words)
    assert not (tmp_path / "o").exists()


def test_summarize_ratios_and_time_to_target():
    runs = suite.plan_runs(args(only="none,synthetic,ps", workers="2", repeats=1), python="py")
    curve = lambda *pts: [{"seconds": s, "test_accuracy": a, "step": 0} for s, a in pts]
    results = {
        "none": {"examples_per_sec": 1000.0, "test_accuracy": 0.99, "global_steps": 10,
                 "eval_curve": curve((5, 0.95), (10, 0.991))},
        "synthetic": {"examples_per_sec": 1250.0, "test_accuracy": 0.1, "global_steps": 10},
        "ps-2w": {"examples_per_sec": 850.0, "test_accuracy": 0.99, "global_steps": 10,
                  "eval_curve": curve((6, 0.97), (12, 0.985), (15, 0.992))},
    }
    rows = {r["name"]: r for r in suite.summarize(results, runs, 0.99)}
    assert rows["none"]["ratio"] == 1.0 and rows["none"]["time_to_target"] == 10
    assert rows["ps-2w"]["ratio"] == pytest.approx(0.85) and rows["ps-2w"]["meets_target"]
    assert rows["ps-2w"]["tta_ratio"] == pytest.approx(1.5)
    # Real data at 1000/s against 1250/s in memory: the input pipeline costs 20 %.
    assert rows["synthetic"]["ratio"] == pytest.approx(0.8) and not rows["synthetic"]["meets_target"]
    assert common.time_to_target(results["ps-2w"]["eval_curve"], 0.999) is None
    md = suite.render_markdown(list(rows.values()), {"steps": 10}, "test machine", 0.99)
    assert "| ps-2w | 2 | 0.9900 | 850 | 0.85 | ≥ 0.8 met |" in md
    assert md.splitlines()[-1].endswith("| 850 |")  # each run's figure
    assert "**missed**" in md


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_smoke_run_writes_table_and_plots(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench.py"), "--only", "none,ps", "--steps", "20",
         "--eval-every", "10", "--steps-per-execution", "5", "--repeats", "1", "--out", str(out),
         "--run-timeout", "200"],
        env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "benchmark.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"none", "ps-2w"} and all(r["ok"] for r in rows.values())
    assert rows["none"]["global_steps"] == rows["ps-2w"]["global_steps"] == 20
    assert sum(rows["ps-2w"]["steps_per_worker"].values()) == 20
    assert [p["step"] for p in report["results"]["ps-2w"]["eval_curve"]] == [10, 20]
    md = (out / "benchmark.md").read_text()
    assert "| none | 1 |" in md and "| ps-2w | 2 |" in md
    for name in ("accuracy_vs_time.png", "throughput.png", "ps_workers.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert descendants_alive(str(out)) == []


# --- the scenarios suite (bench/suites/scenarios.py): pure parts ---------------------------------

def scenario_args(tmp_path, *extra):
    return cli.parse_args(["--suite", "scenarios", "--out", str(tmp_path), *extra])


def test_scenarios_plan_every_cell_twice_interleaved_with_peers_after_their_run(tmp_path):
    runs = splan.plan_runs(scenario_args(tmp_path, "--staleness-workers", "",
                                        "--scenarios", "uniform,slow,links,more",
                                        "--short-scenarios", "uniform,slow,links,more"), python="py")
    names = [r.name for r in runs]
    half = {"uniform": ("multiworker-bf16",),
            "links": ("multiworker-bf16", "ps-bf16", "ps-sync-bf16")}
    cells = [f"{s}-{v}" for s in ("uniform", "slow", "links", "more")
             for v in ("multiworker", "ps", "ps-sync", "ps-sync-backup", *half.get(s, ()))]
    # Pass 1: the baseline and every cell's short run; pass 2: the accuracy runs.
    assert names[:21] == ["thr-none"] + [f"thr-{c}" for c in cells]
    accuracy = [r.name for r in runs if r.phase == "accuracy"]
    assert [n for n in accuracy if "peer" not in n] == ["acc-none"] + [f"acc-{c}" for c in cells]
    # Each peer runs right after the run it is compared with; each pair again
    # in a second round, after every accuracy run.
    pairs = [("keras3", "none"), ("tf_keras-multiworker", "uniform-multiworker"),
             ("tf_keras-ps", "uniform-ps")]
    for peer, ours in pairs:
        assert names[names.index(f"acc-uniform-peer-{peer}") - 1] == f"acc-{ours}"
    assert names[len(names) - 6:] == [n for _, ours in pairs
                                      for n in (f"rep-{ours}", f"rep-uniform-peer-{_}")]
    assert {r.phase for r in runs[len(runs) - 6:]} == {"repeat"}
    cmd = {r.name: list(r.cmd) for r in runs}
    for name in names[len(names) - 6:]:  # the same command, its own directory
        first = cmd["acc-" + name[4:]]
        assert cmd[name][:-1] == first[:-1] and cmd[name][-1] != first[-1]
    slow = cmd["thr-slow-ps-sync-backup"]
    # Slowed from step 10 on, which a progress event every 10 steps reports.
    assert slow[slow.index("--slow") + 1] == "worker:1=0.3@step=10"
    assert slow[slow.index("--log-every") + 1] == "10"
    assert cmd["acc-uniform-ps"][cmd["acc-uniform-ps"].index("--log-every") + 1] == "200"
    assert slow[slow.index("--replicas-to-aggregate") + 1] == "1"
    assert cmd["acc-slow-ps-sync"][cmd["acc-slow-ps-sync"].index("--replicas-to-aggregate") + 1] == "2"
    # Links: one host per worker, one more for the ps chief and ps; shaped.
    for name, hosts in [("acc-links-multiworker", "2"), ("acc-links-ps", "3")]:
        assert cmd[name][cmd[name].index("--hosts") + 1] == hosts
        assert cmd[name][cmd[name].index("--link-rate") + 1] == "100mbit"
    # 16-bit gradients: the same cell's flags and the dtype; ps-sync still K = N.
    for name in ("acc-uniform-multiworker-bf16", "thr-links-ps-bf16", "thr-links-ps-sync-bf16"):
        assert cmd[name][cmd[name].index("--gradient-dtype") + 1] == "bfloat16"
    assert "--gradient-dtype" not in cmd["thr-links-ps"]
    bf16 = cmd["thr-links-ps-sync-bf16"]
    assert bf16[bf16.index("--replicas-to-aggregate") + 1] == "2"
    more = cmd["thr-more-ps-sync-backup"]
    assert more[more.index("--workers") + 1] == "4"
    assert more[more.index("--replicas-to-aggregate") + 1] == "3"
    assert int(more[more.index("--global-batch-size") + 1]) % 3 == 0
    # Same work in a scenario: short runs share length, accuracy runs theirs.
    for name in names:
        c = cmd[name]
        if name.startswith("thr-"):
            assert c[c.index("--steps") + 1] == "200" and c[c.index("--eval-every") + 1] == "0"
        elif "uniform" in name or name.endswith("-none"):
            assert c[c.index("--epochs") + 1] == "3", name
        else:
            assert c[c.index("--steps") + 1] == "160", name
    peer = cmd["acc-uniform-peer-tf_keras-ps"]
    assert peer[peer.index("--program") + 1].endswith("bench/peers/tf_keras_ps.py")
    assert peer[peer.index("--strategy") + 1] == "ps"
    assert cmd["acc-uniform-peer-keras3"][1].endswith("bench/peers/keras3_fit.py")


def test_short_runs_only_where_asked(tmp_path):
    every = {"", "uniform", "slow", "links", "more"}  # "": the baseline
    runs = splan.plan_runs(scenario_args(tmp_path, "--staleness-workers", ""), python="py")
    assert {r.scenario for r in runs if r.phase == "throughput"} == every  # default
    assert {r.scenario for r in runs if r.phase == "accuracy"} == every
    runs = splan.plan_runs(scenario_args(tmp_path, "--staleness-workers", "",
                                        "--short-scenarios", "uniform,slow"), python="py")
    assert {r.scenario for r in runs if r.phase == "throughput"} == {"", "uniform", "slow"}
    assert {r.scenario for r in runs if r.phase == "accuracy"} == every


def test_scenarios_without_tf_keras_keep_the_keras3_peer_only(tmp_path):
    runs = splan.plan_runs(scenario_args(tmp_path, "--scenarios", "uniform"), python="py",
                          have_tf_keras=False)
    assert {r.peer for r in runs if r.peer} == {"keras3"}
    # Only the pairs that run are repeated.
    assert [r.name for r in runs if r.phase == "repeat"] == ["rep-none", "rep-uniform-peer-keras3"]
    once = splan.plan_runs(scenario_args(tmp_path, "--scenarios", "uniform", "--peer-repeats", "1"),
                          python="py", have_tf_keras=False)
    assert not [r for r in once if r.phase == "repeat"] and [r.peer for r in once if r.peer] == ["keras3"]
    assert not [r for r in splan.plan_runs(scenario_args(tmp_path, "--no-peers"), python="py")
                if r.peer]


def test_staleness_study_grid(tmp_path):
    runs = splan.plan_staleness(scenario_args(tmp_path, "--staleness-workers", "1,4",
                                             "--staleness-lrs", "0.1,1"), python="py")
    assert [r.config for r in runs] == ["staleness/1w-lr0.1", "staleness/1w-lr1",
                                        "staleness/4w-lr0.1", "staleness/4w-lr1"]
    c = list(runs[-1].cmd)
    for flag, value in [("--model", "logreg"), ("--optimizer", "sgd"), ("--learning-rate", "1"),
                        ("--lr-schedule", "constant"), ("--workers", "4"),
                        ("--steps-per-execution", "1")]:
        assert c[c.index(flag) + 1] == value, flag
    assert runs[-1].kind == splan.staleness_kind().name
    assert splan.plan_staleness(scenario_args(tmp_path, "--staleness-workers", ""), python="py") == []


@pytest.mark.parametrize("flags, words", [
    (["--scenarios", "uniform,moon"], ["moon", "allowed"]),
    (["--staleness-lrs", "0.1,x"], ["--staleness-lrs", "positive"]),
    (["--peer-repeats", "0"], ["--peer-repeats", "at least 1"]),
    (["--report-only"], ["--report-only", "scenarios.json", "run the suite first"]),
])
def test_scenarios_bad_input_one_line(flags, words, capsys, tmp_path):
    assert cli.main(["--suite", "scenarios", *flags, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and all(w in err[0] for w in words)
    assert not (tmp_path / "o").exists()


def fake_results(runs, eps, accuracy=0.992):
    """A results dict per run: examples/s from ``eps(run)``, a two-point curve."""
    out = {}
    for r in runs:
        res = {"examples_per_sec": eps(r), "test_accuracy": accuracy, "global_steps": 10,
               "eval_curve": [{"seconds": 10.0, "test_accuracy": 0.95, "step": 5},
                              {"seconds": 20.0, "test_accuracy": accuracy, "step": 10}]}
        if r.variant == "ps":
            res["staleness"] = {"mean": 0.8, "p99": 2, "max": 3}
        if r.variant.startswith("ps-sync"):
            res["stale_gradients_dropped"] = 7 if r.variant.endswith("backup") else 0
        if r.scenario == "staleness":
            res["learning_rate"] = float(r.variant.split("=")[1])
            res["staleness"] = {"mean": 0.1 * r.workers, "p99": r.workers, "max": r.workers}
        out[r.name] = res
    return out


def test_scenarios_summary_targets_and_table(tmp_path):
    a = scenario_args(tmp_path, "--scenarios", "uniform,slow", "--staleness-workers", "1,2",
                      "--staleness-lrs", "0.5", "--peer-repeats", "1")
    runs = splan.plan_runs(a, python="py")
    speed = {"none": 1000.0, "multiworker": 900.0, "ps": 800.0, "ps-sync": 400.0,
             "ps-sync-backup": 700.0, "peer-keras3": 950.0, "peer-tf_keras-multiworker": 1000.0,
             "peer-tf_keras-ps": 500.0}
    # The short run is slower; the accuracy run counts. In "slow", ps is 2x multiworker.
    eps = lambda r: (speed.get(r.variant, 300.0) * (0.9 if r.phase == "throughput" else 1.0)
                     * (0.5 if r.scenario == "slow" and r.variant == "multiworker" else 1.0))
    results = fake_results(runs, eps)
    rows = ssum.summarize(results, runs, {"uniform": 0.99, "slow": 0.97, "links": 0.97, "more": 0.97})
    by = {r["config"]: r for r in rows}
    assert by["uniform/ps"]["examples_per_sec"] == 800.0
    assert by["uniform/ps"]["examples_per_sec_each"] == [720.0, 800.0]
    assert by["uniform/ps"]["ratio"] == pytest.approx(0.8)
    assert by["uniform/ps"]["staleness"]["mean"] == 0.8
    assert by["slow/ps-sync-backup"]["dropped"] == 7
    assert by["uniform/ps"]["time_to_target"] == 20.0
    assert by["slow/ps"]["time_to_target"] == 20.0 and by["slow/ps"]["target"] == 0.97
    # The baseline is timed against the uniform scenario's target.
    assert by["none"]["target"] == 0.99 and by["none"]["time_to_target"] == 20.0
    assert by["uniform/peer-tf_keras-multiworker"]["ours_over_peer"] == pytest.approx(0.9)
    assert by["uniform/peer-tf_keras-ps"]["ours_over_peer"] == pytest.approx(1.6)
    assert "ratio" not in by["uniform/peer-keras3"]  # peers are compared with ours, not none
    targets = {t["target"]: t for t in ssum.check_targets(rows)}
    mw_peer = next(t for k, t in targets.items() if "MultiWorker" in k)
    assert mw_peer["met"] is False and "missed by 0.10×" in mw_peer["text"]
    assert next(t for k, t in targets.items() if "ParameterServer" in k)["met"] is True
    assert next(t for k, t in targets.items() if k.startswith("slow: ps ≥ 1.5× multiworker"))["met"]
    backup = next(t for k, t in targets.items() if k.startswith("slow: ps-sync-backup ≥ 1.5×"))
    assert backup["met"] is True and backup["ratio"] == pytest.approx(1.75)
    accuracy = next(t for k, t in targets.items() if k.startswith("uniform: every strategy"))
    assert accuracy["met"] is True
    md = srep.render_markdown(rows, ssum.check_targets(rows), {"model": "cnn"}, "test machine", 61.0)
    assert "Suite wall time: 1.0 min (61 s)." in md
    assert "| ps | 2 | 800 | 0.80 | 0.9920 | 20.0 | 0.80 / 2 |  |  | thr 720 / acc 800 |" in md
    assert "| ps-sync K=1 (1 backup) | 2 | 700 |" in md
    assert "**missed**" in md and "## Staleness study" in md
    assert "| 2 | 0.5 | 0.20 | 2 | 2 | 0.9920 |" in md


def test_scenarios_targets_say_what_is_missing_and_failed_runs(tmp_path):
    runs = splan.plan_runs(scenario_args(tmp_path, "--scenarios", "uniform,slow", "--no-peers",
                                        "--staleness-workers", ""), python="py")
    results = fake_results(runs, lambda r: 500.0, accuracy=0.985)
    del results["acc-slow-ps"]
    rows = ssum.summarize(results, runs, {"uniform": 0.99, "slow": 0.97})
    by = {r["config"]: r for r in rows}
    assert not by["slow/ps"]["ok"] and by["slow/ps"]["examples_per_sec"] == 500.0
    targets = ssum.check_targets(rows)
    backup = next(t for t in targets if t["target"].startswith("slow: ps-sync-backup"))
    assert backup["met"] is False and "1.00× against ≥ 1.5×: missed by 0.50× (33% short)" in backup["text"]
    accuracy = next(t for t in targets if "every strategy" in t["target"])
    assert accuracy["met"] is False and "short by 0.0050" in accuracy["text"]
    md = srep.render_markdown(rows, targets, {}, "m", None)
    assert "FAILED: acc-slow-ps" in md


def test_scenario_plots_are_written(tmp_path):
    a = scenario_args(tmp_path, "--scenarios", "uniform,more", "--staleness-workers", "1,2",
                      "--staleness-lrs", "0.1,1")
    runs = splan.plan_runs(a, python="py")
    results = fake_results(runs, lambda r: 100.0 + 10 * r.workers)
    rows = ssum.summarize(results, runs, {"uniform": 0.99, "more": 0.97})
    paths = srep.plot(rows, results, str(tmp_path), "2 CPU cores (test), no GPU, Linux x")
    assert sorted(os.path.basename(p) for p in paths) == [
        "scenarios_accuracy.png", "scenarios_throughput.png", "staleness.png"]
    for p in paths:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_peer_chunks_divide_the_run_and_the_calls():
    import importlib.util as iu

    spec = iu.spec_from_file_location("peer_lib", REPO / "tfdist" / "bench" / "peers" / "peer_lib.py")
    peer_lib = iu.module_from_spec(spec)
    spec.loader.exec_module(peer_lib)
    # 3 epochs at batch 128: 1,404 steps, which 10 does not divide: epochs of
    # 234 steps (as the evaluation), 9 steps per call, every call whole.
    assert peer_lib.chunk_size(1404, 234, 10) == (234, 9)
    assert peer_lib.chunk_size(240, 60, 10) == (60, 10)
    assert peer_lib.chunk_size(100, 0, 10) == (20, 10)
    assert peer_lib.chunk_size(7, 0, 1) == (1, 1)
    for total, every, spe in [(1404, 234, 10), (40, 10, 10), (240, 60, 10), (100, 0, 10),
                              (7, 0, 1), (1410, 235, 10), (20, 10, 5), (13, 0, 10)]:
        size, calls = peer_lib.chunk_size(total, every, spe)
        assert total % size == 0 and (total // size >= 2 or total == size), (total, every, spe)
        assert size % calls == 0 and 1 <= calls <= spe, (total, every, spe, size, calls)
    # A multiple of the calls within a factor of two of the cadence wins;
    # one further off (30: 47 short epochs) does not.
    assert peer_lib.chunk_size(1410, 235, 10) == (470, 10)
    assert peer_lib.chunk_size(1410, 100, 10) == (141, 3)
    figs = peer_lib.figures([10.0, 12.0, 14.0], chunk=100, batch=128, started=4.0)
    assert figs["startup_seconds"] == 6.0 and figs["examples_per_sec"] == pytest.approx(200 * 128 / 4)
    with pytest.raises(ValueError):
        peer_lib.figures([10.0], chunk=100, batch=128)


def test_tf_keras_is_imported_by_the_peers_only():
    # Keras 2 is the tutorials' stack, for comparison: the library stays on Keras 3.
    users = sorted(str(p.relative_to(REPO)) for p in REPO.rglob("*.py")
                   if p.relative_to(REPO).parts[0] not in (".venv", "build", "runs", "results", "tests")
                   and "import tf_keras" in p.read_text())
    assert users and all(u.startswith("tfdist/bench/peers/") for u in users), users


# The long tier: make test keeps the benchmark's smoke run (same command, tables and
# plots) and tests/launcher/test_sim_cluster.py's slow ps worker (CI time)
@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.timeout(300)
def test_scenarios_smoke_slow_worker_writes_tables_and_plots(tmp_path):
    # The scenarios path end to end at its smallest: the baseline and async ps
    # with worker:1 at 0.3, accuracy runs only, no peers, no staleness study.
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench.py"), "--suite", "scenarios", "--scenarios", "slow",
         "--only", "none,ps", "--no-peers", "--staleness-workers", "", "--short-steps", "0",
         "--steps", "20", "--accuracy-steps", "20", "--accuracy-eval-every", "10",
         "--steps-per-execution", "5", "--out", str(out), "--run-timeout", "200"],
        env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "scenarios.json").read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == {"none", "slow/ps"} and all(r["ok"] for r in rows.values())
    ps = rows["slow/ps"]
    assert sum(ps["steps_per_worker"].values()) == 20 and ps["staleness"] is not None
    assert [p["step"] for p in report["results"]["acc-slow-ps"]["eval_curve"]] == [10, 20]
    launched = (out / "runs" / "acc-slow-ps" / "launch" / "outcome.json").read_text()
    assert "worker:1=0.3" in launched
    assert report["suite_seconds"] > 0 and "the suite took" in proc.stdout
    md = (out / "scenarios.md").read_text()
    assert "## one worker slowed" in md and "| ps | 2 |" in md
    for name in ("scenarios_throughput.png", "scenarios_accuracy.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert descendants_alive(str(out)) == []


@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.timeout(200)
def test_tutorial_peer_runs_under_the_launcher_and_reports(tmp_path):
    # The multi-worker Keras tutorial's way (tf_keras), started by launch.py --program.
    pytest.importorskip("tf_keras", reason="tf-keras (the [dev] extra) is not installed")
    run_dir = tmp_path / "peer"
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "--strategy", "multiworker", "--workers", "2",
         "--program", str(REPO / "tfdist" / "bench" / "peers" / "tf_keras_multiworker.py"), "--",
         "--steps", "20", "--eval-every", "10", "--steps-per-execution", "5",
         "--model-dir", str(run_dir)],
        env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = splan.PeerResults.load(str(run_dir / splan.PEER_RESULTS))
    assert record.num_workers == 2 and record.total_steps == 20 and record.steady_steps == 10
    assert record.keras_version.startswith("2.") and 0.0 < record.test_accuracy <= 1.0
    assert record.examples_per_sec > 0
    assert "bench/peers/tf_keras_multiworker.py" in (run_dir / "launch" / "commands.sh").read_text()
    assert descendants_alive(str(run_dir)) == []


def test_report_only_writes_the_same_report_and_plots_from_the_record(tmp_path):
    a = scenario_args(tmp_path, "--scenarios", "uniform,slow", "--staleness-workers", "1,2",
                      "--staleness-lrs", "0.5", "--peer-repeats", "1")
    runs = splan.plan_runs(a, python="py")
    results = fake_results(runs, lambda r: 100.0 + 10 * r.workers)
    rows = ssum.summarize(results, runs, {"uniform": 0.99, "slow": 0.97})
    settings = {k: f"value of {k}" for k in scen.SETTINGS_ORDER}
    expected = srep.render_markdown(rows, ssum.check_targets(rows), settings, "m", 600.0)
    out = tmp_path / "o"
    out.mkdir()
    (out / "scenarios.json").write_text(json.dumps(
        {"machine": "m", "settings": settings, "suite_seconds": 600.0, "rows": rows,
         "targets": [], "results": results}, sort_keys=True))
    assert cli.main(["--suite", "scenarios", "--report-only", "--out", str(out)]) == 0
    assert (out / "scenarios.md").read_text() == expected
    assert "Work: model value of model, global batch value of global batch, seed" in expected
    for name in ("scenarios_throughput.png", "scenarios_accuracy.png", "staleness.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_rate_from_counts_from_the_first_evaluation_past_a_step():
    res = {"global_batch_size": 100, "eval_curve": [
        {"step": 120, "seconds": 5.0, "test_accuracy": 0.9},
        {"step": 240, "seconds": 8.0, "test_accuracy": 0.95},
        {"step": 600, "seconds": 17.0, "test_accuracy": 0.99}]}
    assert ssum.rate_from(res, 234) == (pytest.approx(360 * 100 / 9.0), 240)
    assert ssum.rate_from(res, 100) == (pytest.approx(480 * 100 / 12.0), 120)
    assert ssum.rate_from(res, 600) is None  # only the final point: no span
    assert ssum.rate_from(res, 700) is None
    assert ssum.rate_from({"global_batch_size": 1}, 10) is None


def test_peer_ratio_covers_the_part_of_the_run_the_peer_measures(tmp_path):
    a = scenario_args(tmp_path, "--scenarios", "uniform", "--staleness-workers", "")
    runs = splan.plan_runs(a, python="py")
    results = fake_results(runs, lambda r: 7000.0)
    ours = results["acc-uniform-multiworker"]
    # Our whole steady figure (7,000) includes a slow start; from step 240 on: 7,449.6.
    ours.update(global_batch_size=128, eval_curve=[
        {"step": 240, "seconds": 10.0, "test_accuracy": 0.98},
        {"step": 1404, "seconds": 30.0, "test_accuracy": 0.992}])
    peer = results["acc-uniform-peer-tf_keras-multiworker"]
    peer.update(examples_per_sec=7200.0, steps_per_epoch=234)
    # The second round: ours slower (its best stays the first), the peer faster.
    results["rep-uniform-multiworker"].update(global_batch_size=128, eval_curve=[
        {"step": 240, "seconds": 10.0, "test_accuracy": 0.98},
        {"step": 1404, "seconds": 40.0, "test_accuracy": 0.992}])
    results["rep-uniform-peer-tf_keras-multiworker"].update(examples_per_sec=6000.0)
    rows = {r["config"]: r for r in ssum.summarize(results, runs, {"uniform": 0.99})}
    row = rows["uniform/peer-tf_keras-multiworker"]
    assert row["examples_per_sec"] == 7200.0 and len(row["runs"]) == 2
    assert row["ours_from_step"] == 240 and row["ours_steady_examples_per_sec"] == 7000.0
    assert row["ours_examples_per_sec"] == pytest.approx(1164 * 128 / 20.0)
    assert row["ours_over_peer"] == pytest.approx(1164 * 128 / 20.0 / 7200.0)
    # A peer record without its epoch length: our whole steady figure.
    keras3 = rows["uniform/peer-keras3"]
    assert keras3["ours_from_step"] is None and keras3["ours_over_peer"] == pytest.approx(1.0)
    md = srep.render_markdown(rows.values(), ssum.check_targets(list(rows.values())), {}, "m", None)
    assert "| 7,450 | 240 | 1.03 | 0.9920 | 7,000 | acc 7,200 / rep 6,000 |" in md
