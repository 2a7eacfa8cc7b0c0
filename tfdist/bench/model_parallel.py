"""The scenarios suite's "model parallel" study: ``--strategy pipeline`` over S stages and M micro-batches.

    python bench.py --suite scenarios --scenarios model-parallel --out results/model-parallel

``mnist-mlp`` (four ~200k-parameter Dense layers, a chain) under the
one-process baseline and under ``pipeline`` with S = 1, 2, 4 stages (one
worker task each, the chief driving them) and M = 1, 2, 4, 8 micro-batches
per step, at one global batch and seed. For each cell: steady examples/s,
test accuracy, each worker's parameter bytes (against 1/S of the model) and
every task's peak memory, and the idle ("bubble") fraction against GPipe's
model (S - 1) / (M + S - 1).

The measured idle fraction of a stage is 1 - busy / step, where step is the
cell's measured step time and busy the stage's share of the work: the S = 1
run at the same M does all of it on one task, so busy = T(1, M) / S for
stages of equal weight (the cut is within 3 % of equal). What is not the
stages' compute (the activations' transfers, the client's dispatch, CPU
contention between tasks) counts as idle too: on a host with fewer cores
than tasks the stages cannot all run at once, and the measured figure says so.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from tfdist.bench.common import BASELINE, LAUNCH, TRAIN, Run, group_by_config

MODEL_PARALLEL = "model-parallel"
TITLE = "model parallel: mnist-mlp cut into S stages, M micro-batches per step (pipeline)"
TASK = "mnist-mlp"
STAGES = (1, 2, 4)
MICRO_BATCHES = (1, 2, 4, 8)
GLOBAL_BATCH = 128
STEPS = 150
BUBBLE_SLACK = 0.10  # the target: measured idle within 10 points of the model, M >= 4
SHARE_SLACK = 0.10  # and each worker's parameter bytes within 10 % of 1/S


@dataclass(frozen=True)
class ModelParallelRun(Run):
    scenario: str = MODEL_PARALLEL
    phase: str = MODEL_PARALLEL
    variant: str = ""
    peer: str = ""
    stages: int = 0  # 0: the one-process baseline
    micro_batches: int = 1


def bubble(stages: int, micro_batches: int) -> float:
    """GPipe's idle fraction: each stage waits S - 1 of its M + S - 1 micro-batch slots."""
    return (stages - 1) / (micro_batches + stages - 1)


def plan(args, python: str = sys.executable) -> list[ModelParallelRun]:
    """The study's runs (pure): the baseline, then every (S, M) cell."""
    flags = ["--task", TASK, "--steps", str(STEPS), "--global-batch-size", str(GLOBAL_BATCH),
             "--seed", str(args.seed), "--eval-every", "0", "--log-every", str(STEPS // 3)]
    flags += ["--data-dir", args.data_dir] if args.data_dir else []

    def add(key, cmd, stages=0, micro=1):
        name = f"mp-{key}"
        model_dir = os.path.join(args.out, "runs", name)
        return ModelParallelRun(name, "pipeline" if stages else BASELINE, max(1, stages),
                                (*cmd, *flags, "--model-dir", model_dir), model_dir,
                                f"{MODEL_PARALLEL}/{key}", variant=key, stages=stages,
                                micro_batches=micro)

    runs = [add(BASELINE, [python, TRAIN, f"--strategy={BASELINE}"])]
    for s in STAGES:
        for m in MICRO_BATCHES:
            runs.append(add(f"S{s}-M{m}", [python, LAUNCH, "--strategy", "pipeline",
                                           "--workers", str(s), "--timeout",
                                           str(args.run_timeout), "--", "--micro-batches",
                                           str(m)], s, m))
    return runs


def summarize(results: dict[str, dict], outcomes: dict[str, dict],
              runs: list[ModelParallelRun]) -> list[dict]:
    """One row per cell (pure): examples/s, accuracy, bytes per worker, idle fraction."""
    rows = []
    for config, group in group_by_config(runs).items():
        run = group[0]
        res, out = results.get(run.name), outcomes.get(run.name) or {}
        row = {"config": config, "scenario": MODEL_PARALLEL, "variant": run.variant,
               "kind": run.kind, "peer": "", "workers": run.workers, "stages": run.stages,
               "micro_batches": run.micro_batches, "ok": res is not None,
               "failed": [] if res is not None else [run.name]}
        if res is not None:
            pipe = res.get("pipeline") or {}
            row.update(examples_per_sec=res["examples_per_sec"],
                       test_accuracy=res.get("test_accuracy"),
                       parameter_bytes=pipe.get("parameter_bytes_per_task"),
                       model_parameter_bytes=pipe.get("model_parameter_bytes"),
                       peak_rss_bytes_chief=res.get("peak_rss_bytes"))
        row["peak_rss_bytes"] = out.get("peak_rss_bytes")
        rows.append(row)
    by = {(r["stages"], r["micro_batches"]): r for r in rows if r["ok"]}
    for row in rows:
        if not row["ok"] or not row["stages"]:
            continue
        s, m = row["stages"], row["micro_batches"]
        row["predicted_bubble"] = bubble(s, m)
        one = by.get((1, m))
        if one is not None:
            # busy = T(1, M) / S; idle = 1 - busy / T(S, M); T = batch / examples/s.
            row["measured_idle"] = 1 - row["examples_per_sec"] / (s * one["examples_per_sec"])
        held, total = row.get("parameter_bytes") or {}, row.get("model_parameter_bytes")
        if held and total:
            row["worst_share_error"] = max(abs(b / total - 1 / s) * s for b in held.values())
    return rows


def check(rows: list[dict]) -> list[dict]:
    """The study's targets, measured in this run (pure); [] when it did not run."""
    cells = [r for r in rows if r["scenario"] == MODEL_PARALLEL and r["stages"] > 1]
    if not cells:
        return []
    out = []
    bubble_what = (f"{MODEL_PARALLEL}: measured idle within {BUBBLE_SLACK:.0%} points of "
                   "(S-1)/(M+S-1) for M ≥ 4")
    judged = [r for r in cells if r["micro_batches"] >= 4 and "measured_idle" in r]
    if not judged:
        out.append({"target": bubble_what, "met": None, "text": "not measured (a run failed)"})
    else:
        off = [r for r in judged
               if abs(r["measured_idle"] - r["predicted_bubble"]) > BUBBLE_SLACK]
        text = "; ".join(f"S={r['stages']} M={r['micro_batches']}: {r['measured_idle']:.2f} vs "
                         f"{r['predicted_bubble']:.2f}" for r in judged)
        out.append({"target": bubble_what, "met": not off, "text": text})
    share_what = (f"{MODEL_PARALLEL}: each worker's parameter bytes within "
                  f"{SHARE_SLACK:.0%} of 1/S of the model")
    shares = [r for r in cells if "worst_share_error" in r]
    if shares:
        worst = max(shares, key=lambda r: r["worst_share_error"])
        out.append({"target": share_what,
                    "met": worst["worst_share_error"] <= SHARE_SLACK,
                    "text": f"worst {worst['worst_share_error']:.1%} (S={worst['stages']})"})
    return out


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "–"


def render(rows: list[dict]) -> list[str]:
    """The study's section of scenarios.md (pure); [] when it did not run."""
    rows = [r for r in rows if r["scenario"] == MODEL_PARALLEL]
    if not rows:
        return []
    lines = [f"## {TITLE}", "",
             f"Global batch {GLOBAL_BATCH}, {STEPS} steps, one worker task per stage and the "
             "chief driving them. examples/s: steady state of one run. Idle: predicted "
             "(S-1)/(M+S-1) against measured 1 - T(1,M) / (S·T(S,M)) (the S = 1 run at the "
             "same M is all of the work on one task). Parameter bytes: each worker's share "
             "of the model's weights. Peak memory: each task's peak resident set (MiB).", "",
             "| S | M | examples/s | test accuracy | idle predicted | idle measured "
             "| parameter bytes per worker, kB (share) | peak memory per task, MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        label = (f"{row['stages']} | {row['micro_batches']}" if row["stages"]
                 else "one process | –")
        if not row["ok"]:
            lines.append(f"| {label} | FAILED (see runs/{row['failed'][0]}.log) | | | | | |")
            continue
        held, total = row.get("parameter_bytes") or {}, row.get("model_parameter_bytes")
        shares = ", ".join(f"{t} {b / 1e3:,.0f} ({b / total:.0%})" for t, b in held.items()
                           ) if held and total else "–"
        peaks = row.get("peak_rss_bytes") or {}
        if not peaks and row.get("peak_rss_bytes_chief"):
            peaks = {"one process": row["peak_rss_bytes_chief"]}
        memory = ", ".join(f"{t} {b / 2**20:,.0f}" for t, b in peaks.items()) or "–"
        lines.append(f"| {label} | {row['examples_per_sec']:,.0f} "
                     f"| {_fmt(row.get('test_accuracy'), '.4f')} "
                     f"| {_fmt(row.get('predicted_bubble'), '.2f')} "
                     f"| {_fmt(row.get('measured_idle'), '.2f')} | {shares} | {memory} |")
    return lines + [""]


def plot(plt, rows: list[dict], where: str, out: str, save) -> str | None:
    """model_parallel.png: examples/s, and idle predicted against measured, per S over M."""
    rows = [r for r in rows if r["scenario"] == MODEL_PARALLEL and r.get("examples_per_sec")
            and r["stages"]]
    if not rows:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, s in enumerate(sorted({r["stages"] for r in rows})):
        c = colours[i % len(colours)]
        cells = sorted((r for r in rows if r["stages"] == s), key=lambda r: r["micro_batches"])
        ms = [r["micro_batches"] for r in cells]
        left.plot(ms, [r["examples_per_sec"] for r in cells], marker="o", color=c, label=f"S={s}")
        if s > 1:
            right.plot(ms, [bubble(s, m) for m in ms], linestyle="--", color=c,
                       label=f"S={s}: (S-1)/(M+S-1)")
            idle = [r for r in cells if "measured_idle" in r]
            right.plot([r["micro_batches"] for r in idle], [r["measured_idle"] for r in idle],
                       marker="o", color=c, label=f"S={s}: measured")
    for ax in (left, right):
        ax.set_xlabel("micro-batches per step (M)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(MICRO_BATCHES), [str(m) for m in MICRO_BATCHES])
        ax.legend(fontsize=7)
    left.set_ylabel("examples/s")
    right.set_ylabel("idle fraction of a stage")
    left.set_title("Throughput", fontsize=10)
    right.set_title("The bubble: predicted and measured", fontsize=10)
    fig.suptitle(f"pipeline, {TASK}, global batch {GLOBAL_BATCH} — {where}", fontsize=10)
    return save(fig, out, "model_parallel.png")
