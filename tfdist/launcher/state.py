"""The job as the supervisor sees it, and what hooks may ask it to do (pure, typed).

Hooks (fault injection, task restarts, slow-downs, partitions) read a ``JobState``
snapshot and return actions; only the supervisor starts, signals or
replaces processes, so the task list has one owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class MemberView:
    name: str
    pid: int
    exit_code: int | None = None  # None while it runs
    starts: int = 1  # 1 + how many times it was restarted within this attempt

    @property
    def running(self) -> bool:
        return self.exit_code is None


@dataclass(frozen=True)
class JobState:
    members: tuple[MemberView, ...]
    attempt: int = 0  # job relaunches so far

    def member(self, name: str) -> MemberView | None:
        return next((t for t in self.members if t.name == name), None)

    @property
    def exits(self) -> dict[str, int | None]:
        return {t.name: t.exit_code for t in self.members}


@dataclass(frozen=True)
class SignalMember:
    """Send ``sig`` to the task's process (``group``: its whole process group)."""

    member: str
    sig: int
    group: bool = True
    pid: int | None = None  # only if it is still this process (not a restarted one)


@dataclass(frozen=True)
class RestartMember:
    """Start the task again with the same TF_CONFIG; ``note`` ends the log line."""

    member: str
    note: str = ""


@dataclass(frozen=True)
class SlowMember:
    """From now on, run the task at ``fraction`` of its speed (restarts included)."""

    member: str
    fraction: float


@dataclass(frozen=True)
class SetLink:
    """Take simulated host ``host``'s link down (``up=False``: a partition) or bring it back."""

    host: int
    up: bool

    @property
    def member(self) -> str:
        return f"host{self.host}"


Action = Union[SignalMember, RestartMember, SlowMember, SetLink]
