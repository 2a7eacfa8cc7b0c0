"""The scenarios suite's report: ``scenarios.md`` and the plots."""

from __future__ import annotations

import os
import textwrap

from tfdist.bench.suites import model_parallel, scaling, sparse
from tfdist.bench.common import BASELINE
from tfdist.strategies import kinds as strategy_kinds
from tfdist.bench.suites.scenario_plan import PEERS, SCENARIOS, UNIFORM, variants


# --- the report -----------------------------------------------------------------

def _fmt(value, spec, missing="–"):
    return missing if value is None else format(value, spec)


def _label(row: dict) -> str:
    if row["config"] == BASELINE:
        return f"{BASELINE} (1 process, baseline)"
    if row["peer"]:
        return next(p.label for p in PEERS if p.key == row["peer"]) + " — *peer*"
    scenario = SCENARIOS.get(row["scenario"])
    for v in variants(scenario.workers if scenario else row["workers"],
                      scenario.half if scenario else ()):
        if v.key == row["variant"]:
            return v.label
    return row["variant"]


def _runs_cell(row: dict) -> str:
    return " / ".join(f"{r['phase'][:3]} {_fmt(r['examples_per_sec'], ',.0f', 'FAILED')}"
                      for r in row["runs"])


def render_markdown(rows: list[dict], targets: list[dict], settings: dict, machine: str,
                    seconds: float | None) -> str:
    lines = ["# Which strategy when: scenarios, tutorial peers, staleness", "",
             f"Machine: {machine}.  ",
             "Work: " + ", ".join(f"{k} {v}" for k, v in settings.items()) + ".  "]
    if seconds is not None:
        lines.append(f"Suite wall time: {seconds / 60:.1f} min ({seconds:.0f} s).")
    lines += ["", "examples/s: steady state (start-up and evaluation excluded), the best of the "
              "cell's runs; *each run* lists them (*thr*: the short throughput run, *acc*: the "
              "accuracy run, *rep*: its second round, for the runs a peer is compared with). "
              "*× none*: against the one-process baseline of this bench run. "
              "Accuracy, time to target (start-up included, evaluation excluded), staleness "
              "and dropped gradients: from the accuracy run.", ""]
    base = [r for r in rows if r["config"] == BASELINE]
    for name, scenario in SCENARIOS.items():
        srows = [r for r in rows if r["scenario"] == name and not r["peer"]]
        if not srows:
            continue
        target = srows[0].get("target")
        lines += [f"## {scenario.title}", "",
                  f"| strategy | workers | examples/s | × none | test accuracy | time to {target} s "
                  "| staleness mean / p99 | dropped gradients | steps per worker | each run |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in (base if name == UNIFORM else []) + srows:
            lines.append(_table_row(row))
        lines.append("")
    peer_rows = [r for r in rows if r["peer"]]
    if peer_rows:
        lines += ["## Tutorial peers (uniform scenario)", "",
                  "Written after TensorFlow's tutorials (`bench/peers/`), launched by `launch.py` "
                  "on the same simulated cluster: the same CNN, optimizer, learning-rate schedule, "
                  "global batch and steps; its steps per call are the most, up to ours, that "
                  "make every call whole (its peer_results.json has both). "
                  "Each pair ran once in the accuracy pass and again in later rounds (*rep*), "
                  "ours just before the peer; each side's figure is the best of its runs. "
                  "A peer's examples/s leaves out its "
                  "first Keras epoch (start-up). *ours ÷ peer* compares with our runs of "
                  "the same length over the same part of the run: from our "
                  "first evaluation at or past the peer's first epoch end (*from step*) to the end "
                  "(evaluation left out); *ours, steady* is our whole steady-state figure.", "",
                  "| peer | examples/s | test accuracy | ours | ours examples/s | from step "
                  "| ours ÷ peer | ours accuracy | ours, steady | peer's runs |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in peer_rows:
            if not row["ok"]:
                lines.append(f"| {_label(row)} | FAILED (see runs/{row['failed'][0]}.log) | | | | | | | | |")
                continue
            lines.append(f"| {_label(row)} | {row['examples_per_sec']:,.0f} | {row['test_accuracy']:.4f} "
                         f"| {row.get('ours') or '–'} | {_fmt(row.get('ours_examples_per_sec'), ',.0f')} "
                         f"| {_fmt(row.get('ours_from_step'), 'd')} "
                         f"| {_fmt(row.get('ours_over_peer'), '.2f')} "
                         f"| {_fmt(row.get('ours_test_accuracy'), '.4f')} "
                         f"| {_fmt(row.get('ours_steady_examples_per_sec'), ',.0f')} "
                         f"| {_runs_cell(row)} |")
        lines.append("")
    lines += render_staleness(rows)
    lines += render_links(rows)
    lines += scaling.render(rows)
    lines += sparse.render(rows)
    lines += model_parallel.render(rows)
    lines += ["## Targets (ratios measured in this run)", ""]
    for t in targets:
        mark = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        lines.append(f"- {t['target']}: {mark}: {t['text']}")
    return "\n".join(lines) + "\n"


def render_staleness(rows: list[dict]) -> list[str]:
    """The staleness study's section: one line per worker count and learning rate."""
    st_rows = [r for r in rows if r["scenario"] == "staleness"]
    if not st_rows:
        return []
    lines = ["## Staleness study: async ps, softmax regression, plain SGD", "",
             "Batch 100, one step per call, constant learning rate, as in the classic "
             "walk-through. Staleness: updates other workers applied between a step's read "
             "of the weights and its own update.", "",
             "| workers | learning rate | staleness mean | p99 | max | test accuracy | examples/s |",
             "|---|---|---|---|---|---|---|"]
    for row in st_rows:
        if not row["ok"]:
            lines.append(f"| {row['workers']} | {row['variant']} | FAILED | | | | |")
            continue
        st = row["staleness"] or {}
        lines.append(f"| {row['workers']} | {_fmt(row.get('learning_rate'), 'g')} "
                     f"| {_fmt(st.get('mean'), '.2f')} | {_fmt(st.get('p99'), 'g')} "
                     f"| {_fmt(st.get('max'), 'g')} | {row['test_accuracy']:.4f} "
                     f"| {row['examples_per_sec']:,.0f} |")
    lines.append("")
    return lines


def render_links(rows: list[dict]) -> list[str]:
    """The section on the network's limit (pure): every scenario cell on shaped links."""
    linked = [r for r in rows if r.get("link") and not r["peer"] and r["scenario"] in SCENARIOS]
    if not linked:
        return []
    lines = ["## Against the network's limit (cells on shaped links)", "",
             "Bytes: each simulated host's interface counters over the run whose examples/s "
             "the row shows, per step (headers included). *Busiest link*: the host and "
             "direction that moved the most; the traffic model's figure for it beside "
             "(`docs/performance.md`); *worst host*: the host and direction where the model "
             "is furthest off. *Link limit*: the examples/s at which the busiest link would "
             "be busy all the time (its set rate over its bytes per step, times the global "
             "batch); *fraction*: of it reached. ps-sync's update reads the weights only "
             "after the gradients came in, so its *serial limit* adds both directions.", "",
             "| strategy | examples/s | busiest link | MB per step | model | measured ÷ model "
             "| worst host, measured ÷ model | link limit, examples/s | fraction "
             "| serial limit, fraction |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in linked:
        link = row["link"]
        worst = link.get("model_worst") or {}
        serial = (f"{link['serial_limit_examples_per_sec']:,.0f}, {link['serial_fraction']:.0%}"
                  if "serial_fraction" in link else "")
        lines.append(
            f"| {_label(row)} | {row['examples_per_sec']:,.0f} "
            f"| {link['host']} {link['direction']} ({', '.join(link['tasks'])}) "
            f"| {link['bytes_per_step'] / 1e6:.3f} "
            f"| {_fmt((link.get('model_bytes_per_step') or 0) / 1e6 or None, '.3f')} "
            f"| {_fmt(link.get('model_ratio'), '.2f')} "
            f"| {worst.get('host', '–')} {worst.get('direction', '')} "
            f"{_fmt(worst.get('ratio'), '.2f')} "
            f"| {link['limit_examples_per_sec']:,.0f} | {link['fraction']:.0%} | {serial} |")
    return lines + [""]


def _table_row(row: dict) -> str:
    if not row["ok"] and "examples_per_sec" not in row:
        logs = ", ".join(f"runs/{n}.log" for n in row["failed"])
        return f"| {_label(row)} | {row['workers']} | FAILED (see {logs}) | | | | | | | |"
    st = row.get("staleness")
    stale = f"{st['mean']:.2f} / {st['p99']:g}" if st else ""
    steps = row.get("steps_per_worker") or {}
    share = " / ".join(str(v) for v in steps.values()) if len(steps) > 1 else ""
    failed = f" (FAILED: {', '.join(row['failed'])})" if row["failed"] else ""
    return (f"| {_label(row)} | {row['workers']} | {row['examples_per_sec']:,.0f} "
            f"| {_fmt(row.get('ratio'), '.2f')} | {_fmt(row.get('test_accuracy'), '.4f')} "
            f"| {_fmt(row.get('time_to_target'), '.1f', 'not reached')} | {stale} "
            f"| {_fmt(row.get('dropped'), 'd', '')} | {share} | {_runs_cell(row)}{failed} |")


# --- plots -----------------------------------------------------------------------

MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LINESTYLES = ("-", "--", "-.", ":")


def short_machine(machine: str) -> str:
    return machine.split(", Linux")[0]


def plot(rows: list[dict], results: dict[str, dict], out: str, machine: str) -> list[str]:
    """The throughput bars, the accuracy curves per scenario and the staleness
    study, each drawn when its rows exist; the PNGs' paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    where = short_machine(machine)
    srows = [r for r in rows if r["scenario"] in SCENARIOS and not r["peer"]
             and "examples_per_sec" in r]
    base = next((r for r in rows if r["config"] == BASELINE and "examples_per_sec" in r), None)
    scen = [s for s in SCENARIOS if any(r["scenario"] == s for r in srows)]
    keys = list(dict.fromkeys(r["variant"] for r in srows))
    # One colour, marker and line per strategy in every plot and panel.
    legend = {v.key: v.generic for v in variants(2, tuple(strategy_kinds.all_kinds()))}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {BASELINE: dict(color="black", marker="*", linestyle=":")}
    for i, key in enumerate(keys):
        styles[key] = dict(color=colours[i % len(colours)], marker=MARKERS[i % len(MARKERS)],
                           linestyle=LINESTYLES[i % len(LINESTYLES)])
    kept = dict(where=where, out=out, styles=styles, legend=legend)
    if srows:
        paths.append(_plot_throughput(plt, srows, scen, keys, base, **kept))
    if scen:
        paths.append(_plot_accuracy(plt, rows, results, srows, scen, **kept))
    st = [r for r in rows if r["scenario"] == "staleness" and "examples_per_sec" in r]
    if st:
        paths.append(_plot_staleness(plt, st, where, out))
    scaled = scaling.plot(plt, rows, where, out, save)
    piped = model_parallel.plot(plt, rows, where, out, save)
    return paths + [p for p in (scaled, piped) if p]


def _plot_throughput(plt, srows, scen, keys, base, *, where, out, styles, legend) -> str:
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        xs, ys, lows, highs = [], [], [], []
        for j, s in enumerate(scen):
            row = next((r for r in srows if r["scenario"] == s and r["variant"] == key), None)
            if row is None:
                continue
            each = row["examples_per_sec_each"]
            xs.append(j + (i - (len(keys) - 1) / 2) * width)
            ys.append(row["examples_per_sec"])
            lows.append(row["examples_per_sec"] - min(each))
            highs.append(0)
        ax.bar(xs, ys, width, label=legend.get(key, key), hatch=("", "//", "..", "xx", "\\\\")[i % 5],
               color=styles[key]["color"], edgecolor="black", linewidth=0.5)
        # Run-to-run spread: from the slowest run up to the best (the bar).
        ax.errorbar(xs, ys, yerr=[lows, highs], fmt="none", ecolor="black", capsize=3,
                    linewidth=1)
    if base is not None:
        ax.axhline(base["examples_per_sec"], color="grey", linestyle="--", linewidth=1,
                   label=f"none (1 process): {base['examples_per_sec']:,.0f}")
    ax.set_xticks(range(len(scen)))
    ax.set_xticklabels([SCENARIOS[s].label for s in scen])
    ax.set_ylabel("examples/s (steady state; bar: best run, whisker: slowest run)")
    ax.set_title(f"Throughput per scenario and strategy\n{where}", fontsize=10)
    ax.legend(fontsize=8, ncol=3, loc="upper right")
    return save(fig, out, "scenarios_throughput.png")


def _plot_accuracy(plt, rows, results, srows, scen, *, where, out, styles, legend) -> str:
    acc_runs = {row["config"]: run["name"] for row in rows if not row["peer"]
                for run in row.get("runs", ()) if run["phase"] == "accuracy"}
    cols = 2
    nrows = (len(scen) + 1) // 2
    fig, axes = plt.subplots(nrows, cols, figsize=(10, 3.6 * nrows), squeeze=False)
    for ax, s in zip(axes.flat, scen):
        target = next((r.get("target") for r in srows if r["scenario"] == s), None)
        configs = ([BASELINE] if s == UNIFORM else []) + \
            [r["config"] for r in srows if r["scenario"] == s]
        low = 1.0
        for config in configs:
            res = results.get(acc_runs.get(config, ""), {})
            curve = res.get("eval_curve") or []
            if not curve:
                continue
            ys = [p["test_accuracy"] for p in curve]
            low = min(low, min(ys))
            key = config.split("/")[-1]
            ax.plot([p["seconds"] for p in curve], ys, markersize=4,
                    label=legend.get(key, key), **styles[key])
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1)
            ax.set_ylim(max(low - 0.005, target - 0.08), 1.0)
        ax.set_title(textwrap.fill(SCENARIOS[s].title, 60), fontsize=9)
        ax.set_xlabel("seconds since start (evaluation excluded)", fontsize=8)
        ax.set_ylabel("test accuracy", fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(scen):]:
        ax.axis("off")
    fig.suptitle(f"Test accuracy against time, per scenario (dotted: target) — {where}",
                 fontsize=10)
    return save(fig, out, "scenarios_accuracy.png")


def _plot_staleness(plt, st, where, out) -> str:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    lrs = sorted({r["learning_rate"] for r in st})
    for i, lr in enumerate(lrs):
        pts = sorted((r["workers"], r) for r in st if r["learning_rate"] == lr)
        ws = [w for w, _ in pts]
        style = dict(marker=MARKERS[i % len(MARKERS)], linestyle=LINESTYLES[i % len(LINESTYLES)])
        left.plot(ws, [(r["staleness"] or {}).get("mean") for _, r in pts],
                  label=f"lr {lr:g}: mean", **style)
        left.plot(ws, [(r["staleness"] or {}).get("p99") for _, r in pts], alpha=0.5,
                  label=f"lr {lr:g}: p99", marker=style["marker"], linestyle=":")
        right.plot(ws, [r["test_accuracy"] for _, r in pts], label=f"lr {lr:g}", **style)
    for ax in (left, right):
        ax.set_xlabel("workers")
        ax.set_xticks(sorted({r["workers"] for r in st}))
        ax.legend(fontsize=8)
    left.set_ylabel("staleness (updates by others between read and apply)")
    right.set_ylabel("final test accuracy")
    left.set_title("Staleness against workers", fontsize=10)
    right.set_title("Accuracy against workers", fontsize=10)
    fig.suptitle(f"Async ps, softmax regression, SGD, batch 100 — {where}", fontsize=10)
    return save(fig, out, "staleness.png")


def save(fig, out: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
