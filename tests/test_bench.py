"""bench.py: the pure parts, and a few-step smoke run (no performance assertions)."""

import json
import os
import subprocess
import sys

import pytest

import bench
from conftest import REPO, child_env, descendants_alive


def args(**kw):
    return bench.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_plan_runs_same_work_for_every_strategy(tmp_path):
    runs = bench.plan_runs(args(workers="1,2", out=str(tmp_path), steps=50, repeats=1),
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
    runs = bench.plan_runs(args(only="none,ps", out=str(tmp_path), repeats=2), python="py")
    # Every configuration once, then again: a slow spell hits all of them.
    assert [(r.name, r.config) for r in runs] == [
        ("none-r1", "none"), ("ps-2w-r1", "ps-2w"), ("none-r2", "none"), ("ps-2w-r2", "ps-2w"),
    ]
    assert len({r.model_dir for r in runs}) == 4
    result = lambda eps: {"examples_per_sec": eps, "test_accuracy": 0.99, "global_steps": 10}
    results = {"none-r1": result(1000.0), "none-r2": result(1200.0),
               "ps-2w-r1": result(800.0), "ps-2w-r2": result(1020.0)}
    rows = {r["name"]: r for r in bench.summarize(results, runs, 0.99)}
    assert rows["none"]["examples_per_sec"] == 1200.0
    assert rows["ps-2w"]["examples_per_sec_each"] == [800.0, 1020.0]
    assert rows["ps-2w"]["ratio"] == pytest.approx(0.85) and rows["ps-2w"]["meets_target"]
    # One failed repeat fails the row, and the table names that run's log.
    del results["ps-2w-r2"]
    rows = {r["name"]: r for r in bench.summarize(results, runs, 0.99)}
    assert not rows["ps-2w"]["ok"] and rows["ps-2w"]["failed"] == ["ps-2w-r2"]
    md = bench.render_markdown(list(rows.values()), {}, "m", 0.99)
    assert "| ps-2w | 2 | FAILED (see runs/ps-2w-r2.log)" in md


@pytest.mark.parametrize("flag, words", [
    (["--workers", "0,2"], ["'0,2'", "positive"]),
    (["--only", "ps,horovod"], ["horovod", "allowed"]),
    (["--only", "ps"], ["'none'", "baseline"]),
    (["--repeats", "0"], ["--repeats 0", "at least 1"]),
])
def test_bad_input_one_line(flag, words, capsys, tmp_path):
    assert bench.main([*flag, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
    assert all(w in err[0] for w in words)
    assert not (tmp_path / "o").exists()


def test_summarize_ratios_and_time_to_target():
    runs = bench.plan_runs(args(only="none,synthetic,ps", workers="2", repeats=1), python="py")
    curve = lambda *pts: [{"seconds": s, "test_accuracy": a, "step": 0} for s, a in pts]
    results = {
        "none": {"examples_per_sec": 1000.0, "test_accuracy": 0.99, "global_steps": 10,
                 "eval_curve": curve((5, 0.95), (10, 0.991))},
        "synthetic": {"examples_per_sec": 1250.0, "test_accuracy": 0.1, "global_steps": 10},
        "ps-2w": {"examples_per_sec": 850.0, "test_accuracy": 0.99, "global_steps": 10,
                  "eval_curve": curve((6, 0.97), (12, 0.985), (15, 0.992))},
    }
    rows = {r["name"]: r for r in bench.summarize(results, runs, 0.99)}
    assert rows["none"]["ratio"] == 1.0 and rows["none"]["time_to_target"] == 10
    assert rows["ps-2w"]["ratio"] == pytest.approx(0.85) and rows["ps-2w"]["meets_target"]
    assert rows["ps-2w"]["tta_ratio"] == pytest.approx(1.5)
    # Real data at 1000/s against 1250/s in memory: the input pipeline costs 20 %.
    assert rows["synthetic"]["ratio"] == pytest.approx(0.8) and not rows["synthetic"]["meets_target"]
    assert bench.time_to_target(results["ps-2w"]["eval_curve"], 0.999) is None
    md = bench.render_markdown(list(rows.values()), {"steps": 10}, "test machine", 0.99)
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
