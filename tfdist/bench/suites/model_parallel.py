"""The scenarios suite's "model parallel" study: ``--strategy pipeline`` over S stages and M micro-batches.

    python bench.py --suite scenarios --scenarios model-parallel --out results/model-parallel

``mnist-mlp`` (four ~200k-parameter Dense layers, a chain) under the
one-process baseline and under ``pipeline`` with S = 1, 2, 4 stages (one
worker task each, the chief driving them) and M = 1, 2, 4, 8 micro-batches
per step, at one global batch and seed. For each cell: steady examples/s,
test accuracy, each worker's parameter bytes (against 1/S of the model) and
every task's peak memory, and the idle ("bubble") fraction against GPipe's
model (S - 1) / (M + S - 1).

``dense-chain`` (4 x Dense(2048) over 256 features, 13 M parameters, a
compute-heavy chain) runs the same cells at global batch 256, and both run
GPipe, 1F1B and dataflow (``--schedule``; 1F1B where M >= S).

The measured idle fraction of a stage is 1 - busy / step: busy is the time
covered by the stage's own slots (each forward, backward and its update, stamped on the
stage's task from the moment its input is there), step the chief's measured
time per step (``training.pipeline.pipeline_trainer``). Time a stage's thread
waits for a core counts as busy: on a host shared with other jobs the
measured idle is then an underestimate. Transfers per step: the tensors that
cross between tasks in the traced step, against 2 (S - 1) M.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from tfdist.bench.common import BASELINE, LAUNCH, Run, TRAIN, cell, group_by_config

MODEL_PARALLEL = "model-parallel"
TITLE = "model parallel: a chain cut into S stages, M micro-batches per step (pipeline)"
TASK = "mnist-mlp"
# (task, global batch): the small MLP and the compute-heavy chain.
TASKS = (("mnist-mlp", 128), ("dense-chain", 256))
SCHEDULES = ("gpipe", "1f1b", "dataflow")
DEFAULT_SCHEDULE = "dataflow"  # --schedule's default: the one the throughput plot draws
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
    task: str = TASK
    schedule: str = "gpipe"


def bubble(stages: int, micro_batches: int) -> float:
    """GPipe's idle fraction: each stage waits S - 1 of its M + S - 1 micro-batch slots."""
    return (stages - 1) / (micro_batches + stages - 1)


def plan(args, python: str = sys.executable) -> list[ModelParallelRun]:
    """The study's runs (pure): per task, the baseline, then every (S, M, schedule) cell."""
    runs = []
    for task, batch in TASKS:
        flags = ["--task", task, "--steps", str(STEPS), "--global-batch-size", str(batch),
                 "--seed", str(args.seed), "--eval-every", "0", "--log-every", str(STEPS // 3)]
        flags += ["--data-dir", args.data_dir] if args.data_dir else []
        prefix = "" if task == TASK else f"{task}-"

        def add(key, cmd, stages=0, micro=1, schedule="gpipe"):
            name = f"mp-{prefix}{key}"
            model_dir = os.path.join(args.out, "runs", name)
            return ModelParallelRun(name, "pipeline" if stages else BASELINE, max(1, stages),
                                    (*cmd, *flags, "--model-dir", model_dir), model_dir,
                                    f"{MODEL_PARALLEL}/{prefix}{key}", variant=prefix + key,
                                    stages=stages, micro_batches=micro, task=task,
                                    schedule=schedule)

        runs.append(add(BASELINE, [python, TRAIN, f"--strategy={BASELINE}"]))
        for s in STAGES:
            for m in MICRO_BATCHES:
                for schedule in SCHEDULES:
                    if schedule == "1f1b" and (m < s or s == 1):
                        continue  # 1F1B needs M >= S, and is GPipe at S = 1
                    key = f"S{s}-M{m}" + ("" if schedule == "gpipe" else f"-{schedule}")
                    runs.append(add(key, [python, LAUNCH, "--strategy", "pipeline",
                                          "--workers", str(s), "--timeout",
                                          str(args.run_timeout), "--", "--micro-batches",
                                          str(m), "--schedule", schedule], s, m, schedule))
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
               "micro_batches": run.micro_batches, "task": run.task,
               "schedule": run.schedule, "ok": res is not None,
               "failed": [] if res is not None else [run.name]}
        if res is not None:
            pipe = res.get("pipeline") or {}
            row.update(examples_per_sec=res["examples_per_sec"],
                       test_accuracy=res.get("test_accuracy"),
                       parameter_bytes=pipe.get("parameter_bytes_per_task"),
                       model_parameter_bytes=pipe.get("model_parameter_bytes"),
                       peak_rss_bytes_chief=res.get("peak_rss_bytes"),
                       stage_idle=pipe.get("measured_idle"),
                       busy_seconds=pipe.get("busy_seconds_per_step"),
                       transfers=pipe.get("transfers_per_step"),
                       slots=pipe.get("last_step_slots"))
        row["peak_rss_bytes"] = out.get("peak_rss_bytes")
        rows.append(row)
    for row in rows:
        if not row["ok"] or not row["stages"]:
            continue
        s, m = row["stages"], row["micro_batches"]
        row["predicted_bubble"] = bubble(s, m)
        if row.get("stage_idle"):
            # Measured on each stage's task; the row's figure is its least idle
            # stage (the one the others wait for) and its most idle.
            row["measured_idle"] = min(row["stage_idle"].values())
            row["most_idle"] = max(row["stage_idle"].values())
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
        text = "; ".join(f"{r.get('task', TASK)} {r.get('schedule', 'gpipe')} S={r['stages']} "
                         f"M={r['micro_batches']}: {r['measured_idle']:.2f} vs "
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


def render(rows: list[dict]) -> list[str]:
    """The study's section of scenarios.md (pure); [] when it did not run."""
    rows = [r for r in rows if r["scenario"] == MODEL_PARALLEL]
    if not rows:
        return []
    lines = [f"## {TITLE}", "",
             f"{', '.join(f'{t} at global batch {b}' for t, b in TASKS)}; {STEPS} steps, one "
             "worker task per stage and the chief driving them. examples/s: steady state of "
             "one run. Idle: predicted (S-1)/(M+S-1) against measured per stage, 1 - busy / "
             "step (busy: the time the stage's own slots cover, stamped on its task; under "
             "dataflow they may overlap). Transfers: tensors "
             "crossing between tasks per step (between stages / in all; the minimum between "
             "stages is 2 (S-1) M). Parameter bytes: each worker's share of the model's "
             "weights. Peak memory: each task's peak resident set (MiB).", "",
             "| task | schedule | S | M | examples/s | test accuracy | idle predicted "
             "| idle measured per stage | transfers per step "
             "| parameter bytes per worker, kB (share) | peak memory per task, MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        label = (f"{row.get('task', TASK)} | {row.get('schedule', 'gpipe')} | {row['stages']} | "
                 f"{row['micro_batches']}" if row["stages"]
                 else f"{row.get('task', TASK)} | – | one process | –")
        if not row["ok"]:
            lines.append(f"| {label} | FAILED (see runs/{row['failed'][0]}.log) "
                         "| | | | | | |")
            continue
        held, total = row.get("parameter_bytes") or {}, row.get("model_parameter_bytes")
        shares = ", ".join(f"{t} {b / 1e3:,.0f} ({b / total:.0%})" for t, b in held.items()
                           ) if held and total else "–"
        peaks = row.get("peak_rss_bytes") or {}
        if not peaks and row.get("peak_rss_bytes_chief"):
            peaks = {"one process": row["peak_rss_bytes_chief"]}
        memory = ", ".join(f"{t} {b / 2**20:,.0f}" for t, b in peaks.items()) or "–"
        idle = ", ".join(f"{t} {v:.2f}" for t, v in (row.get("stage_idle") or {}).items()) or "–"
        moved = row.get("transfers") or {}
        transfers = (f"{moved['between_stages']} / {moved['total']}" if moved else "–")
        lines.append(f"| {label} | {row['examples_per_sec']:,.0f} "
                     f"| {cell(row.get('test_accuracy'), '.4f')} "
                     f"| {cell(row.get('predicted_bubble'), '.2f')} "
                     f"| {idle} | {transfers} | {shares} | {memory} |")
    return lines + [""]


def lanes(spans: list[tuple[float, float]]) -> list[int]:
    """A lane per (start, end) span so that spans in one lane do not overlap, the
    fewest lanes taken first (pure): a stage's slots under dataflow overlap."""
    ends: list[float] = []  # each lane's latest end
    out = [0] * len(spans)
    for i in sorted(range(len(spans)), key=lambda i: spans[i][0]):
        start, end = spans[i]
        free = [k for k, e in enumerate(ends) if e <= start]
        if free:
            out[i] = free[0]
            ends[free[0]] = end
        else:
            out[i] = len(ends)
            ends.append(end)
    return out


def plot_schedule(plt, cells: list[tuple[str, dict]], title: str):
    """One step's slots per stage task, one panel per (label, last_step_slots):
    forwards light, backwards dark, the update grey; the gaps are the bubble.
    Slots that overlap (dataflow) are drawn in lanes of the stage's row, each from
    its input's arrival to its end (waiting for a thread included)."""
    fig, axes = plt.subplots(len(cells), 1, figsize=(11, 1.2 + 1.1 * len(cells)), squeeze=False)
    for ax, (label, slots) in zip(axes[:, 0], cells):
        names = list(slots)
        longest = max(e for row in slots.values() for *_, e in row)
        for y, name in enumerate(names):
            lane_of = lanes([(start, end) for _, _, start, end in slots[name]])
            height = 0.8 / (max(lane_of) + 1)
            for (kind, m, start, end), lane in zip(slots[name], lane_of):
                colour = {"F": "#9ecae1", "B": "#3182bd"}.get(kind, "#969696")
                bottom = y - 0.4 + lane * height
                ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (bottom, height),
                               facecolors=colour, edgecolors="white", linewidth=0.5)
                if kind != "U" and (end - start) > 0.04 * longest:
                    ax.text((start + end) / 2 * 1e3, bottom + height / 2, f"{kind}{m}",
                            ha="center", va="center", fontsize=6)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(label, fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("ms from the step's first slot (F: forward, B: backward, grey: "
                           "the stage's update)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot(plt, rows: list[dict], where: str, out: str, save) -> str | None:
    """model_parallel.png: examples/s, and idle predicted against measured, per S over M."""
    rows = [r for r in rows if r["scenario"] == MODEL_PARALLEL and r.get("examples_per_sec")
            and r["stages"]]
    shown = [(f"{r['task']} {r['schedule']} S={r['stages']} M={r['micro_batches']}", r["slots"])
             for r in rows if r.get("slots") and r["stages"] == 2 and r["micro_batches"] == 8]
    if shown:
        save(plot_schedule(plt, shown, f"one step per stage task — {where}"), out,
             "pipeline_schedule.png")
    rows = [r for r in rows
            if r.get("task", TASK) == TASK and r.get("schedule") == DEFAULT_SCHEDULE]
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
    fig.suptitle(f"pipeline ({DEFAULT_SCHEDULE}), {TASK}, global batch {GLOBAL_BATCH} — {where}",
                 fontsize=10)
    return save(fig, out, "model_parallel.png")
