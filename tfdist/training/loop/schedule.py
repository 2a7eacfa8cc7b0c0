"""When things happen in a run: a pure object, no TensorFlow.

The controller asks it, after every call, whether a progress line, an
evaluation or a checkpoint is due, and how many steps the next call runs.

- A call runs up to ``steps_per_execution`` steps, never across an epoch end
  or a ``checkpoint_every`` boundary: a checkpoint holds exactly the steps
  before it, wherever a run stops or resumes.
- Progress lines and evaluations are due at the first call end at or past
  each multiple of their interval (they do not cut calls short), and at the
  end for progress; the final evaluation is the controller's own.
- A resumed run starts at ``start_step``; nothing is due at it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tfdist.strategies.tf_config import ConfigError


class ScheduleError(ConfigError):
    """An impossible schedule; ``str(err)`` is one line naming the flag."""


@dataclass(frozen=True)
class Schedule:
    """Every cadence of a run as pure arithmetic (no TensorFlow): the next call's size,
    whether a progress line, evaluation or checkpoint is due after a call, and the
    position a resumed run starts at. The controller asks; it decides nothing else."""

    total_steps: int
    steps_per_epoch: int
    steps_per_execution: int = 1
    checkpoint_every: int | None = None  # steps; epoch ends and the end always checkpoint
    eval_every: int = 0  # 0: only the final evaluation
    log_every: int = 100
    start_step: int = 0
    export_every: int = 0  # 0: no periodic export (the end exports, with --export)

    def __post_init__(self):
        positive = {
            "total_steps": self.total_steps, "steps_per_epoch": self.steps_per_epoch,
            "steps_per_execution": self.steps_per_execution, "log_every": self.log_every,
        }
        if self.checkpoint_every is not None:
            positive["checkpoint_every"] = self.checkpoint_every
        for name, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ScheduleError(f"--{name.replace('_', '-')}={value!r} must be a positive integer")
        for name in ("eval_every", "export_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(f"--{name.replace('_', '-')}={value!r} must be 0 or a "
                                    "positive integer")
        if not 0 <= self.start_step:
            raise ScheduleError(f"resume position {self.start_step} is negative")

    @property
    def finished(self) -> bool:
        return self.start_step >= self.total_steps

    def call_size(self, step: int) -> int:
        """Steps the call starting after ``step`` completed steps runs (0 at the end)."""
        if step >= self.total_steps:
            return 0
        n = min(self.steps_per_execution, self.total_steps - step,
                self.steps_per_epoch - step % self.steps_per_epoch)
        if self.checkpoint_every:
            n = min(n, self.checkpoint_every - step % self.checkpoint_every)
        return n

    def calls(self, step: int | None = None) -> list[int]:
        """Every call's size from ``step`` (default: the resume position) to the end."""
        step = self.start_step if step is None else step
        sizes = []
        while (n := self.call_size(step)) > 0:
            sizes.append(n)
            step += n
        return sizes

    def checkpoint_due(self, step: int) -> bool:
        """Epoch ends, every ``checkpoint_every`` steps, and the end."""
        if step <= self.start_step:
            return False
        return (
            step >= self.total_steps
            or step % self.steps_per_epoch == 0
            or bool(self.checkpoint_every and step % self.checkpoint_every == 0)
        )

    def log_due(self, before: int, after: int) -> bool:
        """A call took the run from ``before`` to ``after`` steps: print progress?"""
        return after > self.start_step and (
            after >= self.total_steps or _crossed(before, after, self.log_every)
        )

    def eval_due(self, before: int, after: int) -> bool:
        """An evaluation during training (the final one is not this)."""
        return bool(self.eval_every) and after < self.total_steps and _crossed(
            before, after, self.eval_every
        )

    def export_due(self, before: int, after: int) -> bool:
        """A periodic export (``--export-every``) after this call; the end's is not this."""
        return bool(self.export_every) and _crossed(before, after, self.export_every)

    def weights_read_due(self, before: int, after: int) -> bool:
        """Whether anything reads the weights after this call besides what
        ``drain_due`` covers: the task's callbacks at a progress line, a periodic
        export. A trainer whose calls leave an update pending must apply it first."""
        return self.log_due(before, after) or self.export_due(before, after)

    def epoch_ends(self, before: int, after: int) -> bool:
        """Whether a call from ``before`` to ``after`` steps ended an epoch (or the run)."""
        return after > self.start_step and (after >= self.total_steps
                                            or _crossed(before, after, self.steps_per_epoch))

    def drain_due(self, before: int, after: int) -> bool:
        """Must every scheduled step be applied now (checkpoint, evaluation, end)?"""
        return (self.checkpoint_due(after) or self.eval_due(before, after)
                or after >= self.total_steps)

    def epoch(self, step: int) -> int:
        """The 1-based epoch the ``step``-th step belongs to."""
        return (max(step, 1) - 1) // self.steps_per_epoch + 1


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in ``(before, after]``."""
    return after // every > before // every
