"""When each simulated host's link was busy: its bytes each way every 10 ms (``--link-trace``).

``outcome.json``'s traffic record says how many bytes a step moved over each
link, and the link table how far a job stays from the link's limit; neither
says *when* a link idled. A link full 70 % of the time may be 70 % full all
the time (the transfers are too small to fill it) or full, then idle while
every task computes or waits on the same message: the remedies differ, and
only a timeline tells them apart. TensorFlow's profiler (``--profile-steps``)
shows each task's ops, not the wire.

A thread of the launcher, which holds the hosts' bridge ends in its own
namespace, reads their counters (``/proc/net/dev``) every ``interval``
seconds for the whole job, up to ``MAX_SECONDS`` (then it stops sampling and
says so in the record); ``launch/link_trace.json`` keeps the bytes each host
sent and received in each interval. Reading the file costs some 50 µs, so
sampling takes well under 1 % of a core. ``python -m tfdist.cli.tools.trace_study
RUN_DIR`` prints each link's figures and draws the timeline.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from tfdist import protocol
from tfdist.launcher.machine.network import host_counters, parse_net_dev, read_net_dev

INTERVAL = 0.01
# Ten minutes of samples at 10 ms: some 2 MB of JSON for three hosts.
MAX_SECONDS = 600.0
# A bin at or above this fraction of the rate counts as full, below IDLE as idle.
FULL, IDLE = 0.8, 0.1


class LinkTrace:
    """Samples every host's counters on a daemon thread from ``start`` until ``stop``."""

    def __init__(self, hosts: int, read: Callable[[], str] = read_net_dev,
                 interval: float = INTERVAL, max_seconds: float = MAX_SECONDS,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.hosts, self.interval, self.max_seconds = hosts, interval, max_seconds
        self._read, self._clock = read, clock
        # The wall time of the first sample, to line the trace up with the
        # tasks' events (their times are wall times).
        self.wall_start = wall()
        self._samples: list[tuple[float, dict]] = []
        self._error: str | None = None
        self._truncated = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-trace", daemon=True)

    def start(self) -> "LinkTrace":
        self._sample()
        self._thread.start()
        return self

    def _sample(self) -> bool:
        try:
            counters = host_counters(parse_net_dev(self._read()), self.hosts)
        except (OSError, KeyError, ValueError) as err:
            # A host's veth gone (the job is ending): keep what was read.
            self._error = repr(err)
            return False
        self._samples.append((self._clock(), counters))
        return True

    def _run(self) -> None:
        start = self._clock()
        while True:
            now = self._clock()
            # Sleeping to the next multiple of the interval keeps the samples
            # even: a late wake-up skips the ticks it missed (sampling them at
            # once would make samples microseconds long) instead of shifting all.
            tick = int((now - start) / self.interval) + 1 if self.interval > 0 else 0
            if self._stop.wait(max(0.0, start + tick * self.interval - now)):
                return
            if self._clock() - start > self.max_seconds:
                self._truncated = True
                return
            if not self._sample():
                return

    def stop(self) -> dict:
        """Stop sampling (a last sample is taken) and return the record (``record``)."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        if not self._truncated and self._error is None:
            self._sample()
        return {**record(self._samples, self.interval, truncated=self._truncated,
                         error=self._error), "wall_start": self.wall_start}


def record(samples: list[tuple[float, dict]], interval: float, truncated: bool = False,
           error: str | None = None) -> dict:
    """The samples as ``link_trace.json`` keeps them (pure): times from the first
    sample and, per host, the bytes sent and received since the previous one."""
    times = [round(t - samples[0][0], 5) for t, _ in samples] if samples else []
    hosts = sorted(samples[0][1]) if samples else []
    out: dict = {"interval_seconds": interval, "seconds": times,
                 "hosts": {f"host{h}": {"tx_bytes": [], "rx_bytes": []} for h in hosts},
                 "truncated": truncated}
    if error is not None:
        out["error"] = error
    for (_, before), (_, after) in zip(samples, samples[1:]):
        for h in hosts:
            for way in ("tx_bytes", "rx_bytes"):
                out["hosts"][f"host{h}"][way].append(after[h][way] - before[h][way])
    return out


def _spans(trace: dict) -> list[float]:
    """Each sample's length in seconds (pure)."""
    seconds = trace["seconds"]
    return [b - a for a, b in zip(seconds, seconds[1:])]


def utilisation(trace: dict, rate_bits: float) -> dict[str, dict[str, list[float]]]:
    """Each host's link use per sample each way, as a fraction of ``rate_bits`` (pure)."""
    spans = _spans(trace)
    out = {}
    for host, ways in trace["hosts"].items():
        out[host] = {way.partition("_")[0]: [
            (n * 8 / (rate_bits * dt)) if dt > 0 else 0.0 for n, dt in zip(counts, spans)]
            for way, counts in ways.items()}
    return out


def busy_window(use: dict[str, dict[str, list[float]]]) -> tuple[int, int]:
    """The samples from the first to the last in which any link ran at IDLE or more of
    its rate (pure): the job's transfers, without the start-up before them and the
    end after them. ``(0, 0)`` when no link ever did."""
    width = max((len(v) for ways in use.values() for v in ways.values()), default=0)
    busy = [i for i in range(width)
            if any(i < len(v) and v[i] >= IDLE for ways in use.values() for v in ways.values())]
    return (busy[0], busy[-1] + 1) if busy else (0, 0)


def training_window(trace: dict, use: dict[str, dict[str, list[float]]]) -> tuple[int, int]:
    """The samples of the training steps (pure): those ending within the trace's
    ``training_seconds`` (from the tasks' events: the first step's end to the last
    progress report), else the busy window."""
    span = trace.get("training_seconds")
    if not span:
        return busy_window(use)
    ends = trace["seconds"][1:]
    inside = [i for i, t in enumerate(ends) if span[0] <= t <= span[1]]
    return (inside[0], inside[-1] + 1) if inside else busy_window(use)


def training_span(events: list[tuple[str, float]], wall_start: float) -> list[float] | None:
    """``(kind, wall time)`` of the tasks' events -> the training steps' span in trace
    seconds (pure): from the first ``started`` (a first step ran) to the last
    ``progress``; ``None`` without both."""
    starts = [t for kind, t in events if kind == protocol.STARTED]
    ends = [t for kind, t in events if kind == protocol.PROGRESS]
    if not starts or not ends or max(ends) <= min(starts):
        return None
    return [round(min(starts) - wall_start, 3), round(max(ends) - wall_start, 3)]


def summary(trace: dict, rate_bits: float) -> dict[str, dict[str, dict[str, float]]]:
    """Per host and direction, over the training steps (``training_window``; pure): the
    link's mean use (its bytes over the window's time at the rate), and the fractions
    of that time in samples where it was full (>= FULL) and idle (< IDLE). Weighted
    by time: a sample a few microseconds long that caught a packet runs far above
    the rate, and must not count as much as a whole one."""
    use = utilisation(trace, rate_bits)
    lo, hi = training_window(trace, use)
    spans = _spans(trace)[lo:hi]
    total = sum(spans) or 1.0
    out: dict = {}
    for host, ways in use.items():
        out[host] = {}
        for way, values in ways.items():
            sent = sum(trace["hosts"][host][f"{way}_bytes"][lo:hi])
            window = values[lo:hi]
            out[host][way] = {
                "mean": round(sent * 8 / (rate_bits * total), 3),
                "full": round(sum(dt for v, dt in zip(window, spans) if v >= FULL) / total, 3),
                "idle": round(sum(dt for v, dt in zip(window, spans) if v < IDLE) / total, 3)}
    return out


def describe(figures: dict, seconds: float, host_tasks: dict[str, list[str]]) -> str:
    """The launcher's one line on the trace (pure)."""
    parts = []
    for host, ways in figures.items():
        tasks = ", ".join(host_tasks.get(host, []))
        parts.append(f"{host} ({tasks}) out {ways['tx']['mean']:.2f} in {ways['rx']['mean']:.2f}")
    return (f"[launch] link trace: {seconds:.1f} s of every link each "
            f"{INTERVAL * 1e3:.0f} ms; mean use of the rate while training: " + "; ".join(parts)
            + " (launch/link_trace.json; python -m tfdist.cli.tools.trace_study draws it)")
