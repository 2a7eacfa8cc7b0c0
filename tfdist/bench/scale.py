"""The scaling curves against the predictor: every measured run of ``results/scale``.

    python bench.py --predict-check results/scale

``DIR/runs/<name>/`` holds each run's ``results.json`` and ``outcome.json``
(``results/scale/measure.sh`` runs them: ``launch.py --hosts N --host-cpus C``,
one simulated host per worker, the chief and the ps on one more);
``DIR/digest.json``, where present, lists runs whose files were not kept by
what the predictor reads of them.
``DIR/plan.json`` names the runs the predictor's costs are fitted on
(``fit``: the one-worker profile of each task, then one cost per run: the
byte CPU, the kernel's, the chief's dispatch, ps:0's sync) and those measured
after the fit to check it (``held_out``); every other run is a point the model
was not fitted on either; ``seen`` lists held-out runs the model's form was
revised after (checked, no longer held out). Written:
``DIR/scale.md`` (examples/s and scaling efficiency per cell, predicted against
measured with the error), ``DIR/scale.json`` and ``DIR/scale.png`` (measured
points on the predicted curves), and ``DIR/predicted_1024.png`` (the
prediction out to 1,024 workers and where each strategy overtakes another).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from tfdist.bench import predict as pr

RATES = {None: "unshaped", 100e6: "100 Mbit/s", 1e9: "1 Gbit/s", 10e9: "10 Gbit/s"}
# What the predicted figure to 1,024 workers assumes a real cluster adds: each
# message round's latency (gRPC over TCP on a data-centre network) and ps tasks on
# machines of their own, one per 8 workers.
LATENCY = 50e-6
WORKERS_PER_PS = 8
BIG = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def load(directory: str) -> tuple[dict[str, pr.Measured], dict]:
    """Every run under ``directory/runs`` that finished, those ``digest.json`` lists
    (runs whose own files were not kept), and ``plan.json``."""
    runs = digest(os.path.join(directory, "digest.json"))
    root = os.path.join(directory, "runs")
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        try:
            runs[name] = pr.read_run(os.path.join(root, name))
        except (pr.PredictError, KeyError):
            continue  # a run that failed: scale.md lists it from runs.log
    with open(os.path.join(directory, "plan.json")) as f:
        return dict(sorted(runs.items())), json.load(f)


def digest(path: str) -> dict[str, pr.Measured]:
    """``{run: Measured}`` from a digest: per run, the fields ``read_run`` takes from its
    records (the 23 CNN runs of batches A-D kept only these); {} when there is none."""
    try:
        with open(path) as f:
            listed = json.load(f)["runs"]
    except FileNotFoundError:
        return {}
    return {name: pr.Measured(
        r["strategy"], pr.Target(r["workers"], ps=r["ps"], link_bits_per_sec=r["link_bits_per_sec"],
                                 cores=r["cores"], per_worker_batch=r["per_worker_batch"],
                                 machine_cores=r["machine_cores"]),
        r["examples_per_sec"], r["params"], r["task"]) for name, r in listed.items()}


def _solve(low: float, high: float, too_fast, steps: int = 60) -> float:
    """The value in [low, high] where ``too_fast`` turns False (bisection)."""
    for _ in range(steps):
        mid = (low + high) / 2
        low, high = (mid, high) if too_fast(mid) else (low, mid)
    return (low + high) / 2


FIT_RANGES = {"cpu_per_byte": 1e-6, "ring_cpu_per_byte": 1e-6, "kernel_per_byte": 1e-6,
              "dispatch_seconds": 1.0, "sync_seconds": 1.0}


def fit(runs: dict[str, pr.Measured], plan: dict) -> tuple[dict[str, pr.Profile], dict]:
    """Each task's profile and the costs, fitted in ``plan['fit']``'s order: ``{run: what}``,
    ``profile`` (a one-worker run: its compute) or a cost solved so the run is predicted
    exactly (one of ``FIT_RANGES``); ``plan['costs']``, where given, replaces the
    calibration's costs before the fit (another task's fitted costs)."""
    costs = {**pr.CALIBRATION, **plan.get("costs", {})}
    profiles: dict[str, pr.Profile] = {}
    for name, what in plan["fit"].items():
        run = runs[name]
        if what == "profile":
            profiles[run.task] = pr.profile_of(run, **costs)
            continue
        if what not in FIT_RANGES:
            raise pr.PredictError(f"plan.json fits {what!r} on {name}; allowed: profile, "
                                  f"{', '.join(FIT_RANGES)}")

        def too_fast(value, run=run, what=what):
            prof = replace(profiles[run.task], **{what: value})
            return pr.predict(prof, run.target, run.strategy).examples_per_sec > run.examples_per_sec

        costs[what] = _solve(0.0, FIT_RANGES[what], too_fast)
        profiles = {t: replace(p, **{what: costs[what]}) for t, p in profiles.items()}
    return profiles, costs


def rows(runs: dict[str, pr.Measured], plan: dict, profiles: dict[str, pr.Profile]) -> list[dict]:
    """One row per run: measured and predicted examples/s, the error, the bound, its role."""
    out = []
    ones: dict[tuple, float] = {}
    for r in runs.values():  # a cell measured again keeps its first one-worker run
        if r.target.workers == 1:
            ones.setdefault(_cell(r), r.examples_per_sec)
    for name, run in runs.items():
        if run.task not in profiles:
            continue
        p = pr.predict(profiles[run.task], run.target, run.strategy)
        one = ones.get(_cell(run))
        role = ("fit" if name in plan["fit"] else
                "seen" if name in plan.get("seen", ()) else
                "held out" if name in plan.get("held_out", ()) else "checked")
        out.append({"run": name, "task": run.task, "strategy": run.strategy,
                    "workers": run.target.workers, "ps": run.target.ps,
                    "cores": run.target.cores, "link": rate_name(run.target.link_bits_per_sec),
                    "measured": run.examples_per_sec, "predicted": p.examples_per_sec,
                    "error": pr.error(p.examples_per_sec, run.examples_per_sec),
                    "bound": p.bound, "role": role, "again": name.endswith(RERUN),
                    "efficiency": (run.examples_per_sec / (run.target.workers * one)
                                   if one else None)})
    return sorted(out, key=lambda r: (r["task"], r["link"], r["strategy"], r["ps"], r["workers"]))


def rate_name(bits_per_sec: float | None) -> str:
    """A link rate as the tables write it: ``unshaped``, ``300 Mbit/s``, ``1 Gbit/s``."""
    if bits_per_sec in RATES:
        return RATES[bits_per_sec]
    return (f"{bits_per_sec / 1e9:g} Gbit/s" if bits_per_sec >= 1e9
            else f"{bits_per_sec / 1e6:g} Mbit/s")


def _cell(run: pr.Measured) -> tuple:
    """A scaling curve: everything but the worker count. One multiworker worker sends
    nothing, so its link does not count: the unshaped one-worker run is every link's."""
    t = run.target
    mw = pr.all_reduces(run.strategy)
    return (run.task, run.strategy, 0 if mw else t.ps, t.cores,
            None if mw else t.link_bits_per_sec, t.per_worker_batch)


RERUN = "-rerun"  # measure.sh's tag for a cell measured again


def summary(table: list[dict]) -> dict:
    """The median and largest absolute error over the points not fitted, and the held-out
    ones; each held-out cell against the mean of its runs (NAME and NAME-rerun); the fit
    runs the model cannot reproduce (more than 1 % off: no cost in range matches them)."""
    checked = [abs(r["error"]) for r in table if r["role"] != "fit"]
    held = [abs(r["error"]) for r in table if r["role"] == "held out"]
    cells: dict[str, list[dict]] = {}
    for r in table:
        if r["role"] == "held out":
            cells.setdefault(r["run"].removesuffix(RERUN), []).append(r)
    held_cells = {name: pr.error(rs[0]["predicted"], sum(r["measured"] for r in rs) / len(rs))
                  for name, rs in cells.items()}
    return {"points": len(checked), "median_abs_error": pr.median(checked),
            "max_abs_error": max(checked, default=None),
            "held_out": len(held), "held_out_max_abs_error": max(held, default=None),
            "held_out_cells": held_cells,
            "unmatched_fits": [r["run"] for r in table
                               if r["role"] == "fit" and abs(r["error"]) > 0.01]}


def render(table: list[dict], costs: dict, profiles: dict, numbers: dict) -> list[str]:
    """scale.md's tables (pure)."""
    lines = ["| task | strategy | ps | workers | cores per host | links | measured examples/s "
             "| efficiency | predicted | error | bound (predicted) | role |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        ps = "" if pr.all_reduces(r["strategy"]) else r["ps"]
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else ""
        lines.append(f"| {r['task']} | {r['strategy']} | {ps} | {r['workers']} | {r['cores']:g} "
                     f"| {r['link']} | {r['measured']:,.0f} | {eff} | {r['predicted']:,.0f} "
                     f"| {r['error']:+.1%} | {r['bound']} | {r['role']}"
                     f"{' (measured again)' if r.get('again') else ''} |")
    lines += ["", f"Over the {numbers['points']} points not fitted: median absolute error "
              f"{numbers['median_abs_error']:.1%}, largest {numbers['max_abs_error']:.1%}"
              + (f"; the {numbers['held_out']} held-out points (measured after the fit): "
                 f"largest {numbers['held_out_max_abs_error']:.1%}" if numbers["held_out"] else "")
              + ".", ""]
    if len(numbers.get("held_out_cells", {})) < numbers["held_out"]:  # a cell measured twice
        lines += ["Held-out cells against the mean of their runs: " + "; ".join(
            f"{name} {err:+.1%}" for name, err in numbers["held_out_cells"].items()) + ".", ""]
    if numbers.get("unmatched_fits"):
        lines += ["Fit runs no cost in range reproduces (the model's form does not fit them): "
                  + ", ".join(numbers["unmatched_fits"]) + ".", ""]
    lines += ["Fitted costs: " + ", ".join(f"{k} {v:.4g}" for k, v in costs.items())
              + "; profiles: " + "; ".join(
                  f"{t}: {p.compute_seconds * 1e3:.2f} ms per step at {p.per_worker_batch} "
                  f"examples on {p.cores:g} cores" for t, p in profiles.items())]
    return lines


def crossovers(profile: pr.Profile) -> list[dict]:
    """Where each strategy overtakes another out to 1,024 workers, per link rate (predicted)."""
    out = []
    for rate in (100e6, 1e9, 10e9):
        for first, second in (("multiworker", "ps"), ("ps", "multiworker"),
                              ("ps-sync", "ps"), ("multiworker", "ps-sync")):
            n = _crossover(profile, rate, first, second)
            out.append({"link": RATES[rate], "leader": first, "overtaken_by": second,
                        "workers": n})
    return out


HEADER = ["# Scaling curves, measured and predicted", "",
          "Each row one run (`runs/<name>/`: its `results.json` and `outcome.json`, or "
          "what `digest.json` kept of them; "
          "`measure.sh` ran them, `runs.log` says when and at what load). *Efficiency*: "
          "examples/s ÷ (workers × the one-worker run's of the same curve). *Predicted*: "
          "`bench.py --predict-check` (`tfdist/bench/scale.py`); *role*: fitted on, checked "
          "against, held out (named in `plan.json` before it was measured), or seen (held out, "
          "but the model was revised after it).", ""]
WINNERS_NOTE = ("Hosts of one core, a ps per 8 workers on its own machine, 50 µs per message "
                "round; the CNN's profile, and the same compute with 100 times the parameters. "
                "Each cell: the fastest, its examples/s, how far ahead of the next, its bound.")
SIZES = (1, 100)  # the profile's parameters, and 100 times them (a what-if: the same compute)
WINNER_WORKERS = (2, 16, 128, 1024)


def winners(profile: pr.Profile) -> list[dict]:
    """Which strategy the model predicts fastest per link rate, model size and worker count."""
    out = []
    for rate in (100e6, 1e9, 10e9):
        for size in SIZES:
            prof = replace(profile, params=profile.params * size)
            for n in WINNER_WORKERS:
                ranked = sorted(pr.predict_all(prof, big_target(n, rate)),
                                key=lambda p: -p.examples_per_sec)
                out.append({"link": RATES[rate], "params": prof.params, "workers": n,
                            "winner": ranked[0].strategy, "bound": ranked[0].bound,
                            "examples_per_sec": ranked[0].examples_per_sec,
                            "ahead_of_next": ranked[0].examples_per_sec / ranked[1].examples_per_sec})
    return out


def render_winners(found: list[dict]) -> list[str]:
    """The winners as a table (pure): one row per link rate and size, one column per N."""
    lines = ["| links | parameters | " + " | ".join(f"{n} workers" for n in WINNER_WORKERS) + " |",
             "|---|---|" + "---|" * len(WINNER_WORKERS)]
    rows: dict[tuple, list[str]] = {}
    for w in found:
        rows.setdefault((w["link"], w["params"]), []).append(
            f"{w['winner']} {w['examples_per_sec']:,.0f} ({w['ahead_of_next']:.1f}×; {w['bound']})")
    for (link, params), cells in rows.items():
        lines.append(f"| {link} | {params / 1e6:.1f} M | " + " | ".join(cells) + " |")
    return lines


def big_target(workers: int, rate: float) -> pr.Target:
    """A real cluster of ``workers``: one core per host, a ps per 8 workers on its own machine."""
    return pr.Target(workers, ps=max(1, workers // WORKERS_PER_PS), link_bits_per_sec=rate,
                     cores=1.0, latency=LATENCY, ps_own_hosts=True)


def _crossover(profile: pr.Profile, rate: float, first: str, second: str) -> int | None:
    """The fewest workers of BIG at which ``second`` passes ``first`` after trailing it."""
    trailing = False
    for n in BIG:
        t = big_target(n, rate)
        a = pr.predict(profile, t, first).examples_per_sec
        b = pr.predict(profile, t, second).examples_per_sec
        if b <= a:
            trailing = True
        elif trailing:
            return n
    return None


def plot(table: list[dict], profiles: dict, directory: str) -> list[str]:
    """scale.png (measured on predicted) and predicted_1024.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(9, 4.4))
    curves = {}
    for r in table:
        curves.setdefault((r["task"], r["strategy"], r["ps"], r["link"]), []).append(r)
    for i, (key, pts) in enumerate(sorted(curves.items())):
        colour = plt.cm.tab20(i % 20)  # more curves than the default cycle's 10 colours
        pts = sorted(pts, key=lambda r: r["workers"])
        label = f"{key[1]}{'' if pr.all_reduces(key[1]) else ' ' + str(key[2]) + ' ps'}, {key[3]}"
        ax.plot([p["workers"] for p in pts], [p["measured"] for p in pts], "o", color=colour,
                label=label)
        ax.plot([p["workers"] for p in pts], [p["predicted"] for p in pts], "--", color=colour)
    ax.set_xlabel("workers (each host its own CPU budget)")
    ax.set_ylabel("examples/s")
    ax.set_title("Measured (points) and predicted (dashed): "
                 + ", ".join(sorted({r["task"] for r in table})))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    written.append(_save(fig, plt, directory, "scale.png"))
    for task, profile in profiles.items():
        fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), sharey=True)
        for ax, rate in zip(axes, (100e6, 1e9, 10e9)):
            for s in pr.STRATEGIES:
                ax.plot(BIG, [pr.predict(profile, big_target(n, rate), s).examples_per_sec
                              for n in BIG], marker=".", label=s)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{RATES[rate]} links (predicted)")
            ax.set_xlabel("workers")
        axes[0].set_ylabel(f"{task}: examples/s, predicted")
        axes[0].legend()
        written.append(_save(fig, plt, directory, "predicted_1024.png"))
        break  # one task's figure: the first profile's (the CNN's)
    return written


def _save(fig, plt, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(directory: str, out=print) -> int:
    """``bench.py --predict-check DIR``: fit, compare, write; the exit code."""
    try:
        runs, plan = load(directory)
        profiles, costs = fit(runs, plan)
    except (OSError, KeyError, pr.PredictError) as err:
        print(f"error: --predict-check {directory}: {err}", file=sys.stderr)
        return 2
    table = rows(runs, plan, profiles)
    numbers = summary(table)
    first = next(iter(profiles.values()))
    record = {"rows": table, "summary": numbers, "costs": costs,
              "profiles": {t: vars(p) for t, p in profiles.items()},
              "crossovers": crossovers(first), "winners": winners(first)}
    with open(os.path.join(directory, "scale.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(directory, "scale.md"), "w") as f:
        f.write("\n".join(HEADER + render(table, costs, profiles, numbers)
                          + ["", "## Predicted, not measured: the fastest strategy to 1,024 "
                             "workers", "", WINNERS_NOTE, ""]
                          + render_winners(record["winners"])) + "\n")
    for path in plot(table, profiles, directory):
        out(f"wrote {path}")
    out("\n".join(render(table, costs, profiles, numbers)))
    return 0
