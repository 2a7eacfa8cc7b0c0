"""The evaluation suite: the final evaluation shared by the workers against the chief alone.

    python bench.py --suite evaluation --out results/evaluation    # ~10 min on 2 CPU cores

Two workers, every task of the cluster held to half a core (``launch.py --slow
ROLE:I=F``, F of its own cores), train ``--model`` for a few steps (``--steps``, else 20)
with no evaluation on the way, then evaluate the test split once:

  multiworker  ``--evaluate-on shared`` (each worker its half of the batches, one
               all-reduce of the metrics' states) against ``--evaluate-on chief``
  ps           ``--evaluate-on shared`` (``--eval-shards``' shards scheduled on
               the workers) against ``--evaluate-on chief``

Each pair runs ``--repeats`` times, interleaved (shared, chief, shared, chief),
so a slow spell of the host falls on both sides. The figure is each run's
``results.json`` ``evaluation.seconds`` (the final evaluation's wall time on
the chief); the ratio is shared ÷ chief of the same pair, measured in this
run, against the target ``TARGET``. The record's phases (each member's
batches, the all-reduce) say which term bounds a pair. Writes
``<out>/evaluation.md`` and ``<out>/evaluation.json``; each run's log and model
dir go under ``<out>/runs/``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

from tfdist.bench.common import (BenchError, Run, cell, cluster_cores, cluster_prefix,
                                 machine_description, run_all)
from tfdist.bench.config import BenchConfig
from tfdist.strategies import kinds as strategy_kinds

# Shared time ÷ chief-alone time of the same run's final evaluation: sharing must pay off.
TARGET = 0.6
WORKERS = 2
SLOW = 0.5
STEPS = 20
KINDS = ("multiworker", "ps")
WHERE = ("shared", "chief")


@dataclass(frozen=True)
class EvalRun(Run):
    """One run of the suite: ``where`` is its ``--evaluate-on``; ``pair`` its repeat."""

    where: str = "shared"
    pair: int = 1


def slow_flags(kind) -> list[str]:
    """``--slow ROLE:I=F`` holding every task of a 2-worker cluster of ``kind`` to
    ``SLOW`` of a core: F is of the task's own cores (the ps chief and the ps may
    use all of the machine's, a pinned worker its one)."""
    out = []
    for name, cores in cluster_cores(kind, WORKERS).items():
        out += ["--slow", f"{name}={SLOW / cores:g}"]
    return out


def plan(args: BenchConfig, python: str = sys.executable) -> list[EvalRun]:
    """The suite's runs (pure): each pair once per repeat, interleaved."""
    if args.repeats < 1:
        raise BenchError(f"--repeats {args.repeats} must be at least 1")
    flags = ["--model", args.model, "--steps", str(args.steps or STEPS),
             "--global-batch-size", str(args.global_batch_size), "--seed", str(args.seed),
             "--eval-every", "0", "--log-every", str(args.steps or STEPS)]
    flags += ["--data-dir", args.data_dir] if args.data_dir else []
    runs = []
    for pair in range(1, args.repeats + 1):
        for name in KINDS:
            kind = strategy_kinds.get(name)
            prefix = cluster_prefix(python, kind, WORKERS, args.run_timeout)
            prefix = [*prefix[:-1], *slow_flags(kind), "--"]
            for where in WHERE:
                run_name = f"eval-{name}-{where}-r{pair}"
                model_dir = os.path.join(args.out, "runs", run_name)
                cmd = (*prefix, *flags, "--evaluate-on", where, "--model-dir", model_dir)
                runs.append(EvalRun(run_name, name, WORKERS, cmd, model_dir, f"{name}/{where}",
                                    where=where, pair=pair))
    return runs


def summarize(results: dict[str, dict], runs: list[EvalRun]) -> list[dict]:
    """One row per kind and pair (pure): both sides' records and their ratio."""
    rows = []
    for name in KINDS:
        for pair in sorted({r.pair for r in runs if r.kind == name}):
            sides = {r.where: results.get(r.name) for r in runs
                     if r.kind == name and r.pair == pair}
            records = {where: (res or {}).get("evaluation") for where, res in sides.items()}
            seconds = {where: (rec or {}).get("seconds") for where, rec in records.items()}
            both = all(isinstance(seconds.get(w), (int, float)) for w in WHERE)
            rows.append({
                "kind": name, "pair": pair, "ok": both,
                "failed": [r.name for r in runs if r.kind == name and r.pair == pair
                           and results.get(r.name) is None],
                "seconds": seconds, "records": records,
                "ratio": seconds["shared"] / seconds["chief"] if both and seconds["chief"] else None,
                "test_accuracy": {w: (res or {}).get("test_accuracy") for w, res in sides.items()},
            })
    return rows


def _phases(record: dict | None) -> str:
    """A shared record's bounding terms: each member's batches, the all-reduce."""
    if not record:
        return ""
    parts = []
    for member, seconds in (record.get("batch_seconds_per_member") or {}).items():
        parts.append(f"{member} batches {seconds:.2f} s")
    if isinstance(record.get("all_reduce_seconds"), (int, float)):
        parts.append(f"all-reduce {record['all_reduce_seconds']:.2f} s")
    if record.get("where") == "workers":
        parts.append(f"{record.get('shards')} shards")
    return ", ".join(parts)


def render(rows: list[dict], settings: dict, machine: str, load: str) -> str:
    """evaluation.md (pure)."""
    lines = ["# The final evaluation shared by the workers against the chief alone", "",
             f"Machine: {machine}. Load before the suite: {load}.", "",
             *(f"- {k}: {v}" for k, v in settings.items()), "",
             f"Target: shared ÷ chief ≤ {TARGET} (`results.json` `evaluation.seconds`, "
             "the same pair of this run).", "",
             "| strategy | pair | shared | chief alone | ratio | test accuracy (shared, chief) "
             "| shared's terms |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        if not row["ok"]:
            lines.append(f"| {row['kind']} | {row['pair']} | FAILED "
                         f"(see runs/{row['failed'][0] if row['failed'] else '?'}.log) | | | | |")
            continue
        acc = row["test_accuracy"]
        lines.append(
            f"| {row['kind']} | {row['pair']} | {row['seconds']['shared']:.2f} s "
            f"| {row['seconds']['chief']:.2f} s | {row['ratio']:.2f}× "
            f"| {cell(acc.get('shared'), '.4f')}, {cell(acc.get('chief'), '.4f')} "
            f"| {_phases(row['records'].get('shared'))} |")
    return "\n".join(lines) + "\n"


def run(args: BenchConfig) -> int:
    """The suite: plan, run each in fresh processes, write the report; the exit code."""
    try:
        runs = plan(args)
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    started = time.perf_counter()
    results = run_all(runs, args.run_timeout + 60)
    rows = summarize(results, runs)
    settings = {"model": args.model, "workers": WORKERS, "steps": args.steps or STEPS,
                "global batch": args.global_batch_size, "seed": args.seed,
                "slow": f"every task at {SLOW} of a core", "pairs": args.repeats,
                "suite seconds": round(time.perf_counter() - started)}
    machine = machine_description()
    with open(os.path.join(args.out, "evaluation.md"), "w") as f:
        f.write(render(rows, settings, machine, load))
    with open(os.path.join(args.out, "evaluation.json"), "w") as f:
        json.dump({"machine": machine, "load": load, "settings": settings, "rows": rows},
                  f, indent=1, sort_keys=True)
    print(f"[bench] wrote {args.out}/evaluation.md, evaluation.json", flush=True)
    for row in rows:
        print(f"[bench] {row['kind']} pair {row['pair']}: ratio "
              f"{cell(row['ratio'], '.2f')} (target ≤ {TARGET})", flush=True)
    return 0 if all(r["ok"] for r in rows) else 1
