"""When each simulated host's link was busy, from a run's ``--link-trace``.

``python -m tfdist.cli.tools.trace_study RUN_DIR [--png PICTURE] [--start S] [--seconds N]``
reads ``RUN_DIR/launch/link_trace.json`` (``launch.py --hosts N --link-rate RATE
--link-trace``) and prints, per host and direction, the mean use of the link
while the job trained (from its first step's end to its last progress report)
and the fractions of that time in which it ran full (>= 80 % of the rate) and
idle (< 10 %). ``--png`` draws every link's use over ``--seconds`` from
``--start`` seconds into the training steps' window: one row per host and
direction, so a worker's read, push and wait can be lined up with the ps
host's links.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from tfdist.launcher.machine import linktrace


def load(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "launch", "link_trace.json")) as f:
        return json.load(f)


def table(trace: dict) -> str:
    """The figures as a markdown table (pure)."""
    figures = linktrace.summary(trace, trace["rate_bits_per_sec"])
    tasks = trace.get("host_tasks", {})
    lines = ["| host (tasks) | direction | mean use | full | idle |", "|---|---|---|---|---|"]
    for host, ways in figures.items():
        for way, label in (("tx", "out"), ("rx", "in")):
            f = ways[way]
            lines.append(f"| {host} ({', '.join(tasks.get(host, []))}) | {label} | "
                         f"{f['mean']:.2f} | {f['full']:.2f} | {f['idle']:.2f} |")
    return "\n".join(lines)


def window(trace: dict, start: float, seconds: float) -> tuple[list[float], dict]:
    """Times (s from the training steps' window's start) and each link's use, for ``seconds``
    from ``start`` into the training steps' window (pure)."""
    use = linktrace.utilisation(trace, trace["rate_bits_per_sec"])
    lo, hi = linktrace.training_window(trace, use)
    times = trace["seconds"][1:]  # a sample's use is the span that ends at it
    t0 = times[lo] if lo < len(times) else 0.0
    keep = [i for i in range(lo, hi) if start <= times[i] - t0 < start + seconds]
    return ([times[i] - t0 for i in keep],
            {host: {way: [v[i] for i in keep] for way, v in ways.items()}
             for host, ways in use.items()})


def draw(trace: dict, path: str, start: float, seconds: float, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, use = window(trace, start, seconds)
    tasks = trace.get("host_tasks", {})
    rows = [(host, way) for host in use for way in ("tx", "rx")]
    fig, axes = plt.subplots(len(rows), 1, sharex=True, squeeze=False,
                             figsize=(9, 0.75 + 0.62 * len(rows)))
    ms = [t * 1e3 for t in times]
    for ax, (host, way) in zip(axes[:, 0], rows):
        ax.fill_between(ms, [min(v, 1.2) for v in use[host][way]], step="pre",
                        color="tab:orange" if way == "tx" else "tab:blue")
        ax.set_ylim(0, 1.15)
        ax.set_yticks([0, 1], ["0", "rate"], fontsize=7)
        label = f"{host} {'out' if way == 'tx' else 'in'}\n{', '.join(tasks.get(host, []))}"
        ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=8)
    axes[-1, 0].set_xlabel(f"ms (10 ms samples) from {start:g} s into the training steps' window")
    if title:
        axes[0, 0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class TraceStudyConfig:
    """The study's flags (``tfdist/cli/tools/trace_study.py``), checked."""
    run_dir: str
    png: str | None = None
    start: float = 2.0
    seconds: float = 1.0
    title: str | None = None


def run(config: TraceStudyConfig) -> int:
    """Print the run's table (and draw its picture); 2 with one line if there is no trace."""
    try:
        trace = load(config.run_dir)
        text = table(trace)
    except FileNotFoundError:
        print(f"error: no launch/link_trace.json under {config.run_dir}; run launch.py with "
              "--hosts N --link-rate RATE --link-trace", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        print(f"error: {config.run_dir}/launch/link_trace.json is not a link trace "
              f"({type(err).__name__}: {err})", file=sys.stderr)
        return 2
    print(text)
    if config.png:
        draw(trace, config.png, config.start, config.seconds, config.title)
    return 0
