"""When each gradient bucket's all-reduce ran against the backward pass, from a profile.

``python -m tfdist.cli.tools.overlap RUN_DIR/logs/profile-worker-1 ... [--png PICTURE]``
reads a task's ``--profile-steps`` trace (TensorFlow's XSpace) and prints, per
step, the backward pass (the ops TensorFlow names ``gradient_tape/...``: their
first start and last end) and each all-reduce bucket's collective (start, end),
in milliseconds from the step's first backward op, and how much of the
transfers ran while backward ops were still running. ``--png`` draws each
trace's median step, one panel per trace.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from dataclasses import dataclass


def events(profile_dir: str) -> list[tuple[float, float, str]]:
    """(start ms, end ms, op name) of every TF op on the host, sorted by start."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = sorted(glob.glob(os.path.join(profile_dir, "plugins", "profile", "*", "*.xplane.pb")))
    if not files:
        raise FileNotFoundError(f"no profile (*.xplane.pb) under {profile_dir}")
    space = xplane_pb2.XSpace()
    with open(files[-1], "rb") as f:
        space.ParseFromString(f.read())
    out = []
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        names = plane.event_metadata
        for line in plane.lines:
            for e in line.events:
                start = (line.timestamp_ns + e.offset_ps / 1000) / 1e6
                out.append((start, start + e.duration_ps / 1e9, names[e.metadata_id].name))
    return sorted(out)


def _bucket(name: str) -> int | None:
    """The all-reduce bucket an op is (0: the first issued), else None."""
    op, _, kind = name.rpartition(":")
    if kind != "CollectiveReduceV2":
        return None
    base = op.rsplit("/", 1)[-1]
    tail = base.rpartition("_")[2]
    return int(tail) if base != "CollectiveReduceV2" and tail.isdigit() else 0


def steps(evs) -> list[dict]:
    """Per step (ending at its last bucket): the backward span and each bucket's span."""
    collectives = [(s, e, _bucket(n)) for s, e, n in evs if _bucket(n) is not None]
    if not collectives:
        return []
    buckets = max(b for _, _, b in collectives) + 1
    out, previous_end = [], float("-inf")
    # A step: bucket 0's collective and the buckets issued after it.
    firsts = [c for c in collectives if c[2] == 0]
    for i, first in enumerate(firsts):
        upto = firsts[i + 1][0] if i + 1 < len(firsts) else float("inf")
        mine = [c for c in collectives if first[0] <= c[0] < upto]
        end = max(e for _, e, _ in mine)
        backward = [(s, e) for s, e, n in evs
                    if "gradient_tape/" in n and previous_end <= s <= end]
        previous_end = end
        if not backward or len(mine) != buckets:
            continue
        t0 = min(s for s, _ in backward)
        b_end = max(e for _, e in backward)
        row = {"backward": [0.0, round(b_end - t0, 2)],
               "buckets": [[round(s - t0, 2), round(e - t0, 2)] for s, e, _ in
                           sorted(mine, key=lambda c: c[2])]}
        # Transfer time while the backward pass was still running.
        row["overlapped_ms"] = round(sum(max(0.0, min(e, b_end) - max(s, t0))
                                         for s, e, _ in mine), 2)
        row["transfer_ms"] = round(sum(e - s for s, e, _ in mine), 2)
        out.append(row)
    return out


def draw(panels: list[tuple[str, dict]], path: str) -> None:
    """One step per panel (title, step row), on one time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [1 + len(step["buckets"]) for _, step in panels]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(7.5, 0.9 + 0.42 * sum(heights)),
                             gridspec_kw={"height_ratios": heights})
    for ax, (title, step) in zip(axes[:, 0], panels):
        rows = [("backward pass", step["backward"], "tab:blue")] + [
            (f"bucket {i + 1} all-reduce", b, "tab:orange")
            for i, b in enumerate(step["buckets"])]
        for y, (_, (start, end), color) in enumerate(rows):
            ax.broken_barh([(start, end - start)], (y - 0.35, 0.7), color=color)
        ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{title}: {step['overlapped_ms']:.0f} of {step['transfer_ms']:.0f} ms "
                     "of transfer under the backward pass", fontsize=9)
    axes[-1, 0].set_xlabel("ms from the step's first backward op")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class OverlapConfig:
    """The study's flags (``tfdist/cli/tools/overlap.py``)."""
    profile_dirs: tuple[str, ...]
    png: str | None = None
    labels: tuple[str, ...] = ()  # a panel's title, one per profile directory


def run(config: OverlapConfig) -> int:
    """One JSON line per profile (and the picture); 2 with one line if a profile is missing."""
    panels = []
    for i, path in enumerate(config.profile_dirs):
        try:
            rows = steps(events(path))
        except FileNotFoundError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(json.dumps({"profile": path, "steps": rows}))
        if rows:
            middle = sorted(rows, key=lambda r: r["overlapped_ms"])[len(rows) // 2]
            panels.append((config.labels[i] if i < len(config.labels) else path, middle))
    if config.png and panels:
        draw(panels, config.png)
    return 0
