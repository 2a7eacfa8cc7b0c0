"""The scenarios suite's scaling study: more workers when the network is the bound.

    python bench.py --suite scenarios --scenarios scaling --out results/links

Every multi-process kind (``ps-sync`` with K = N) on 1, 2, 3 and 4 workers
(``--scaling-workers``), each computing task on a simulated host of its own
(the chief and the ps share one more) with its link shaped to 100 Mbit/s
each way: examples/s, and each host's bytes per step measured against the
traffic model. What each kind must move per step grows differently with N:
the ring all-reduce sends 2(N-1)/N of the gradients from every host, async
ps sends the weights out of the ps host once per step whatever N, and
ps-sync sends them once per worker per update. One more run per kind, at
the most workers on unshaped links, shows how fast the same cluster goes
when the network is not the bound: on this machine's cores, compute.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from tfdist.bench import link_limit
from tfdist.bench.common import Run, cell, cluster_prefix, group_by_config, parse_only, parse_workers
from tfdist.strategies import kinds as strategy_kinds

SCALING = "scaling"
LINK_RATE = "100mbit"
# 120 splits into 1, 2, 3 and 4 equal per-worker batches.
GLOBAL_BATCH = 120
UNSHAPED = "unshaped"


@dataclass(frozen=True)
class ScalingRun(Run):
    """A run of the study: a kind on ``workers`` simulated hosts, shaped or not."""

    scenario: str = SCALING
    phase: str = SCALING
    variant: str = ""  # the kind's name
    peer: str = ""  # as a scenarios run's: no tutorial peer runs this study
    shaped: bool = True


def plan(args, python: str = sys.executable) -> list[ScalingRun]:
    """The study's runs (pure): each worker count, each kind, shaped; then the most
    workers unshaped."""
    counts = parse_workers(args.scaling_workers, "--scaling-workers")
    flags = ["--model", args.model, "--steps", str(args.scaling_steps),
             "--global-batch-size", str(GLOBAL_BATCH), "--seed", str(args.seed),
             "--steps-per-execution", str(args.steps_per_execution), "--eval-every", "0",
             "--log-every", str(max(1, args.scaling_steps // 4))]
    flags += ["--data-dir", args.data_dir] if args.data_dir else []
    only = parse_only(args.only)
    kinds = [k for k in strategy_kinds.all_kinds().values()
             if not k.single_process and not k.pipelined and k.name in only]
    runs = []
    for workers, shaped in [(n, True) for n in counts] + [(counts[-1], False)]:
        for kind in kinds:
            k_flags = (["--replicas-to-aggregate", str(workers)]
                       if kind.aggregates_gradients else [])
            tag = f"{workers}w" + ("" if shaped else f"-{UNSHAPED}")
            name = f"sca-{kind.name}-{tag}"
            model_dir = os.path.join(args.out, "runs", name)
            prefix = cluster_prefix(python, kind, workers, args.run_timeout,
                                    link_rate=LINK_RATE if shaped else None)
            runs.append(ScalingRun(name, kind.name, workers,
                                   (*prefix, *flags, *k_flags, "--model-dir", model_dir),
                                   model_dir, f"{SCALING}/{kind.name}/{tag}",
                                   variant=kind.name, shaped=shaped))
    return runs


def summarize(results: dict[str, dict], outcomes: dict[str, dict],
              runs: list[ScalingRun]) -> list[dict]:
    """One row per kind and worker count (pure): examples/s and the link's figures."""
    rows = []
    for config, group in group_by_config(runs).items():
        run = group[0]
        res = results.get(run.name)
        row = {"config": config, "scenario": SCALING, "variant": run.variant, "kind": run.kind,
               "peer": "", "workers": run.workers, "shaped": run.shaped,
               "ok": res is not None, "failed": [] if res is not None else [run.name]}
        if res is not None:
            row.update(examples_per_sec=res["examples_per_sec"], test_accuracy=res.get("test_accuracy"),
                       link=link_limit.figures(res, outcomes.get(run.name)))
        rows.append(row)
    return rows


def _mb(value) -> str:
    return cell(value / 1e6 if isinstance(value, (int, float)) else None, ".3f")


def render(rows: list[dict]) -> list[str]:
    """The study's section of scenarios.md (pure); [] when it did not run."""
    rows = [r for r in rows if r["scenario"] == SCALING]
    if not rows:
        return []
    top = max(r["workers"] for r in rows)
    lines = [f"## Scaling when the network is the bound: 1 to {top} workers, "
             f"{LINK_RATE.replace('mbit', ' Mbit/s')} links", "",
             f"Global batch {GLOBAL_BATCH}; one short run per cell. *Busiest link*: the host "
             "and direction that moved the most bytes per step (measured; the traffic model's "
             "figure beside it). *Link limit*: the examples/s at which that link would be "
             "busy all the time; *fraction*: of it reached. *Unshaped*: the same cluster "
             "on unshaped links: what the cores allow.", "",
             "| strategy | workers | examples/s | busiest link | MB per step, measured "
             "| model | measured ÷ model | link limit, examples/s | fraction |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: (r["variant"], not r["shaped"], r["workers"])):
        label = row["variant"] + ("" if row["shaped"] else f" ({UNSHAPED})")
        if not row["ok"]:
            lines.append(f"| {label} | {row['workers']} | FAILED (see runs/{row['failed'][0]}.log) "
                         "| | | | | | |")
            continue
        link = row.get("link")
        if not link:
            why = "unshaped" if not row["shaped"] else "no traffic (one task)"
            lines.append(f"| {label} | {row['workers']} | {row['examples_per_sec']:,.0f} | {why} "
                         "| | | | | |")
            continue
        lines.append(
            f"| {label} | {row['workers']} | {row['examples_per_sec']:,.0f} "
            f"| {link['host']} {link['direction']} | {_mb(link['bytes_per_step'])} "
            f"| {_mb(link.get('model_bytes_per_step'))} | {cell(link.get('model_ratio'), '.2f')} "
            f"| {link['limit_examples_per_sec']:,.0f} | {link['fraction']:.0%} |")
    return lines + [""]


def plot(plt, rows: list[dict], where: str, out: str, save) -> str | None:
    """scaling.png: examples/s and the busiest link's bytes per step against workers."""
    rows = [r for r in rows if r["scenario"] == SCALING and r.get("examples_per_sec")]
    if not rows:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, kind in enumerate(dict.fromkeys(r["variant"] for r in rows)):
        c = colours[i % len(colours)]
        shaped = sorted((r for r in rows if r["variant"] == kind and r["shaped"]),
                        key=lambda r: r["workers"])
        ws = [r["workers"] for r in shaped]
        left.plot(ws, [r["examples_per_sec"] for r in shaped], marker="o", color=c,
                  label=f"{kind}: measured")
        limited = [r for r in shaped if r.get("link")]
        left.plot([r["workers"] for r in limited],
                  [r["link"]["limit_examples_per_sec"] for r in limited], linestyle="--",
                  color=c, alpha=0.7, label=f"{kind}: link limit")
        for r in (r for r in rows if r["variant"] == kind and not r["shaped"]):
            left.scatter([r["workers"]], [r["examples_per_sec"]], marker="*", s=120, color=c,
                         label=f"{kind}: unshaped links")
        right.plot([r["workers"] for r in limited], [r["link"]["bytes_per_step"] / 1e6
                                                     for r in limited],
                   marker="o", color=c, label=f"{kind}: measured")
        right.plot([r["workers"] for r in limited],
                   [(r["link"].get("model_bytes_per_step") or 0) / 1e6 for r in limited],
                   linestyle="--", color=c, alpha=0.7, label=f"{kind}: model")
    for ax in (left, right):
        ax.set_xlabel("workers")
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        ax.legend(fontsize=7)
    left.set_yscale("log")
    left.set_ylabel("examples/s (log scale)")
    right.set_ylabel("MB per step, busiest host and direction")
    left.set_title("Throughput against workers", fontsize=10)
    right.set_title("Bytes per step on the busiest link", fontsize=10)
    fig.suptitle(f"{LINK_RATE.replace('mbit', ' Mbit/s')} simulated links, CNN, global batch "
                 f"{GLOBAL_BATCH} — {where}", fontsize=10)
    return save(fig, out, "scaling.png")
