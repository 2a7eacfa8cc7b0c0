"""``--carry-all-reduce auto``: the plain step or the carried one, whichever is faster here.

The carried step (``sync.carried``) hides the first layers' forward pass
behind the all-reduce, which pays where the link is slow against compute; where
the link is fast, its all-reduce's CPU work runs beside the convolutions and the
step gets slower (docs/performance.md has both). Which case a cluster is in
depends on its links and its processors, neither known in advance, and both
steps give the same weights bit for bit, so the trainer measures: a few
windows of each, alternated so that a machine's drift weighs on both, then the
faster for the rest of the run.

Pure bookkeeping, no TensorFlow: the trainer runs the kind ``next_kind`` names,
records each call's steps and seconds, and once ``next_kind`` is None sums the
``totals`` over every worker (every worker must choose the same step: their
collectives must match) and asks ``choose``.
"""

from __future__ import annotations

from dataclasses import dataclass

PLAIN, CARRIED = "plain", "carried"


@dataclass(frozen=True)
class TrialResult:
    """What the trial measured, summed over the workers, and what it chose."""

    plain_ms: float  # per step
    carried_ms: float
    steps_each: int  # timed steps of each kind, per replica (each worker's, with one each)
    carried: bool
    seconds: float = 0.0  # the trial's wall time on the chief, its untimed calls included

    def line(self) -> str:
        chosen = "carried over the step's end" if self.carried else "plain"
        return (f"all-reduce: {chosen} for the rest of the run (--carry-all-reduce auto: "
                f"carried {self.carried_ms:.1f} ms a step, plain {self.plain_ms:.1f} ms, "
                f"{self.steps_each} timed steps of each)")


class CarryTrial:
    """Windows of ``window`` timed steps, plain and carried in turn, ``rounds`` of each.

    A window's first ``warm`` calls are not timed: they pay for the switch (the
    run's first trace, each carried call's first run, the carried step's start
    with nothing pending, the flush of its last update before a plain call), which
    the rest of the run does not. A timed call counts whole in the window it
    starts in, however many steps it runs (``--steps-per-execution``), so a window
    may run over.
    """

    def __init__(self, window: int = 10, rounds: int = 2, warm: int = 2):
        if window < 1 or rounds < 1 or warm < 0:
            raise ValueError(f"window and rounds must be positive and warm not negative, "
                             f"got {window}, {rounds}, {warm}")
        self.order = [PLAIN, CARRIED] * rounds
        self.window = window
        self._index = 0
        self._in_window = 0
        self.warm = warm
        self._warmed = 0  # calls of the window not timed so far
        self.seconds = {PLAIN: 0.0, CARRIED: 0.0}
        self.wall = 0.0  # every call's seconds, the untimed ones too
        self.steps = {PLAIN: 0, CARRIED: 0}

    def next_kind(self) -> str | None:
        """The step the next call runs, or None once every window is measured."""
        return self.order[self._index] if self._index < len(self.order) else None

    def record(self, steps: int, seconds: float) -> None:
        """One call of the current window."""
        kind = self.next_kind()
        if kind is None:
            raise RuntimeError("the trial is over: nothing more to record")
        self.wall += seconds
        if self._warmed < self.warm:
            self._warmed += 1
            return
        self.seconds[kind] += seconds
        self.steps[kind] += steps
        self._in_window += steps
        if self._in_window >= self.window:
            self._index, self._in_window, self._warmed = self._index + 1, 0, 0

    def totals(self) -> list[float]:
        """This worker's figures, in the order ``choose`` takes them summed."""
        return [self.seconds[PLAIN], float(self.steps[PLAIN]),
                self.seconds[CARRIED], float(self.steps[CARRIED])]

    def choose(self, summed: list[float], replicas: int) -> TrialResult:
        """The faster step per step from every worker's ``totals`` summed; a tie
        keeps the plain step (the simpler one)."""
        plain_s, plain_n, carried_s, carried_n = summed
        plain_ms = 1000 * plain_s / max(plain_n, 1)
        carried_ms = 1000 * carried_s / max(carried_n, 1)
        return TrialResult(plain_ms=plain_ms, carried_ms=carried_ms,
                           steps_each=int(round(min(plain_n, carried_n) / max(replicas, 1))),
                           carried=carried_n > 0 and carried_ms < plain_ms,
                           seconds=round(self.wall, 3))
