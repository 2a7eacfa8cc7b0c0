"""The scenarios suite's "big sparse embedding" study: the ``ctr`` task, where ps wins.

    python bench.py --suite scenarios --scenarios sparse --out results/sparse

The built-in ``ctr`` task (a 2-million-row x 16 embedding table, 128 MB, and
Adagrad; ``models/ctr.py``) under the one-process baseline, ``multiworker``
(2 workers: the table mirrored on each, its gradients all-gathered as
TensorFlow reduces row-sparse gradients) and ``ps`` and ``ps-sync`` (2
workers, 2 ps: the table split over both, ``training/sharding.py``). Every
cluster run has one simulated host per computing task (the chief and the ps
share one more), so the launcher counts each host's bytes; it also samples
each task's peak resident memory. The target, a ratio measured in the same
run: async ``ps`` at least 2x ``multiworker``'s examples/s at a test AUC
within 0.005 of it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from tfdist.bench.common import BASELINE, LAUNCH, Run, TRAIN, cell, group_by_config, hosts_for
from tfdist.strategies import kinds as strategy_kinds

SPARSE = "sparse"
TITLE = "big sparse embedding: the ctr task (2M x 16 table, Adagrad), 2 workers, ps tasks 2"
WORKERS, PS = 2, 2
PS_OVER_MULTIWORKER = 2.0  # the target: async ps's examples/s over multiworker's ...
AUC_SLACK = 0.005  # ... at a test AUC within this of multiworker's


@dataclass(frozen=True)
class SparseRun(Run):
    """A run of the study; its launch outcome (peak memory, bytes) sits beside its results."""

    scenario: str = SPARSE
    phase: str = SPARSE
    variant: str = ""
    peer: str = ""  # as a scenarios run's: no tutorial peer runs this study


def plan(args, python: str = sys.executable) -> list[SparseRun]:
    """The study's runs (pure): the baseline, then each multi-process kind once."""
    flags = ["--task", "ctr", "--steps", str(args.sparse_steps),
             "--global-batch-size", str(args.sparse_global_batch), "--seed", str(args.seed),
             "--steps-per-execution", str(args.steps_per_execution), "--eval-every", "0",
             "--log-every", str(max(1, args.sparse_steps // 4))]
    runs = []

    def add(key: str, prefix: list[str]):
        name = f"spa-{key}"
        model_dir = os.path.join(args.out, "runs", name)
        kind = strategy_kinds.get(key)
        runs.append(SparseRun(name, kind.name, 1 if kind.single_process else WORKERS,
                              (*prefix, *flags, "--model-dir", model_dir), model_dir,
                              f"{SPARSE}/{key}", variant=key))

    add(BASELINE, [python, TRAIN, f"--strategy={BASELINE}"])
    for name, kind in strategy_kinds.all_kinds().items():
        if kind.single_process or kind.pipelined:  # the ctr model is no chain of stages
            continue
        cmd = [python, LAUNCH, "--strategy", name, "--workers", str(WORKERS),
               "--timeout", str(args.run_timeout), "--hosts", str(hosts_for(kind, WORKERS, PS if kind.min_ps else 0))]
        add(name, cmd + (["--ps", str(PS)] if kind.min_ps else []) + ["--"])
    return runs


def busiest_host(traffic: dict | None) -> tuple[str, float] | None:
    """The host that moved the most bytes per step (sent + received), and that figure."""
    hosts = (traffic or {}).get("hosts") or {}
    per_step = {name: h["tx_bytes_per_step"] + h["rx_bytes_per_step"] for name, h in hosts.items()
                if h.get("tx_bytes_per_step") is not None}
    if not per_step:
        return None
    name = max(per_step, key=per_step.get)
    tasks = ", ".join(hosts[name]["tasks"])
    return f"{name} ({tasks})", per_step[name]


def summarize(results: dict[str, dict], outcomes: dict[str, dict], runs: list[SparseRun]) -> list[dict]:
    """One row per kind (pure): examples/s, AUC and its ceiling, memory, bytes."""
    rows = []
    for config, group in group_by_config(runs).items():
        run = group[0]
        res, out = results.get(run.name), outcomes.get(run.name) or {}
        row = {"config": config, "scenario": SPARSE, "variant": run.variant, "kind": run.kind,
               "peer": "",
               "workers": run.workers, "ps": PS if strategy_kinds.get(run.kind).min_ps else 0,
               "ok": res is not None, "failed": [] if res is not None else [run.name]}
        if res is not None:
            metrics = res.get("test_metrics") or {}
            row.update(examples_per_sec=res["examples_per_sec"], auc=metrics.get("auc"),
                       auc_ceiling=res.get("auc_ceiling"), global_steps=res.get("global_steps"),
                       ps_variable_bytes=res.get("ps_variable_bytes"),
                       peak_rss_bytes_chief=res.get("peak_rss_bytes"))
        row["peak_rss_bytes"] = out.get("peak_rss_bytes")
        row["busiest_host"] = busiest_host(out.get("traffic"))
        rows.append(row)
    base = next((r for r in rows if r["variant"] == BASELINE and r["ok"]), None)
    for row in rows:
        if base is not None and row["ok"]:
            row["ratio"] = row["examples_per_sec"] / base["examples_per_sec"]
    return rows


def check(rows: list[dict]) -> list[dict]:
    """The study's target, measured in this run (pure); [] when the study did not run."""
    by = {r["variant"]: r for r in rows if r["scenario"] == SPARSE}
    ps, mw = by.get("ps"), by.get("multiworker")
    if ps is None and mw is None:
        return []
    what = (f"{SPARSE}: ps ≥ {PS_OVER_MULTIWORKER:g}× multiworker's examples/s at a test AUC "
            f"within {AUC_SLACK} of it")
    if not (ps and mw and ps["ok"] and mw["ok"]) or ps.get("auc") is None or mw.get("auc") is None:
        return [{"target": what, "met": None, "text": "not measured (a run failed)"}]
    ratio = ps["examples_per_sec"] / mw["examples_per_sec"]
    gap = abs(ps["auc"] - mw["auc"])
    parts = [f"{ratio:.2f}×" if ratio >= PS_OVER_MULTIWORKER else
             f"{ratio:.2f}× against ≥ {PS_OVER_MULTIWORKER:g}×: missed by "
             f"{PS_OVER_MULTIWORKER - ratio:.2f}×",
             f"AUC {ps['auc']:.4f} vs {mw['auc']:.4f}"
             + ("" if gap <= AUC_SLACK else f" (apart by {gap:.4f}, more than {AUC_SLACK})")]
    return [{"target": what, "met": ratio >= PS_OVER_MULTIWORKER and gap <= AUC_SLACK,
             "ratio": ratio, "text": "; ".join(parts)}]


def render(rows: list[dict]) -> list[str]:
    """The study's section of scenarios.md (pure); [] when it did not run."""
    rows = [r for r in rows if r["scenario"] == SPARSE]
    if not rows:
        return []
    lines = [f"## {TITLE}", "",
             "examples/s: steady state of one run; *× none*: against the one-process run of the "
             "same task. Peak memory: each task's peak resident set (MiB), sampled by the "
             "launcher. Bytes: the simulated host that moved the most per step (sent + "
             "received). Variable bytes: what each ps holds (table shard and Adagrad slot).", "",
             "| strategy | workers | ps | examples/s | × none | test AUC | AUC ceiling "
             "| peak memory per task, MiB | busiest host, MB per step | ps variable bytes, MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if not row["ok"]:
            lines.append(f"| {row['variant']} | {row['workers']} | {row['ps']} "
                         f"| FAILED (see runs/{row['failed'][0]}.log) | | | | | | |")
            continue
        peaks = row.get("peak_rss_bytes") or {}
        if not peaks and row.get("peak_rss_bytes_chief"):
            peaks = {"one process": row["peak_rss_bytes_chief"]}
        memory = ", ".join(f"{t} {cell(b / 2**20, ',.0f')}" for t, b in peaks.items()) or "–"
        host = row.get("busiest_host")
        held = row.get("ps_variable_bytes") or {}
        lines.append(
            f"| {row['variant']} | {row['workers']} | {row['ps']} | {row['examples_per_sec']:,.0f} "
            f"| {cell(row.get('ratio'), '.2f')} | {cell(row.get('auc'), '.4f')} "
            f"| {cell(row.get('auc_ceiling'), '.4f')} | {memory} "
            f"| {f'{host[1] / 1e6:.3f} ({host[0]})' if host else '–'} "
            f"| {', '.join(f'{t} {b / 1e6:.0f}' for t, b in held.items()) or '–'} |")
    return lines + [""]
