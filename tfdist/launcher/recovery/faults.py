"""The faults a launch asks for, and its recovery, as a pure plan: kill, preempt, hang,
partition, slow, restart, relaunch.

``parse_fault``, ``parse_slow`` and ``plan_recovery`` check the specs (pure;
the command hands them the raw specs, never its argparse namespace) into a
``RecoveryPlan``. What fires them is elsewhere, one concern each:
``launcher/recovery/injector.py`` (``FaultInjector``), ``launcher/recovery/restarter.py``
(``MemberRestarter``) and ``launcher/machine/slowdown.py`` (``Slowdown``).
"""

from __future__ import annotations

import math
import re
import signal
from dataclasses import dataclass

from tfdist import protocol
from tfdist.launcher.plan import LaunchError
from tfdist.strategies import kinds
from tfdist.strategies.kinds import StrategyKind

# The signal each task fault sends; ``partition`` takes a simulated host's link down instead.
FAULT_ACTIONS = {"kill": signal.SIGKILL, "preempt": signal.SIGTERM, "hang": signal.SIGSTOP,
                 "partition": None}
# Faults that last: lifted after +SECONDS if given, and always when the launcher ends.
LASTING = ("hang", "partition")
FAULT_SPEC = ("ROLE:INDEX@WHEN, WHEN being seconds (@20, @2.5s), a step reached (@step=150), "
              "steps the task's current process has run (@ran=40) or another task down "
              "(@down=worker:1)")
LASTING_SPEC = {
    "hang": "ROLE:INDEX@WHEN[+SECONDS], e.g. worker:1@step=150+20 (stopped for 20 s; "
            "without +SECONDS until the launcher ends)",
    "partition": "hostN@WHEN[+SECONDS], e.g. host1@30+10 (host1's link down for 10 s; "
                 "without +SECONDS until the launcher ends)",
}
SLOW_SPEC = "ROLE:INDEX=FRACTION[@WHEN], FRACTION in (0, 1), e.g. worker:1=0.25 or worker:1=0.5@step=200"
MAX_MEMBER_RESTARTS = 3  # per task: a worker that keeps dying is not a transient fault


@dataclass(frozen=True)
class Fault:
    """``--kill``/``--preempt``/``--hang``: signal ``task`` once ``seconds`` or ``step`` is
    reached; ``--partition``: take host ``task`` (``host1``) off its link then.

    ``lift_after``: a hang or partition is lifted that many seconds later
    (``None``: only when the launcher ends). A kill or preempt may instead
    wait for ``ran`` steps run by the task's current process (a restarted or
    relaunched one counts from its own start), or for task ``down`` to be
    down (exited; a restart may be pending).
    """

    action: str
    member: str
    seconds: float | None = None
    step: int | None = None
    lift_after: float | None = None
    ran: int | None = None
    down: str | None = None

    @property
    def host(self) -> int | None:
        """The simulated host's index, for a partition."""
        return int(self.member[len("host"):]) if self.action == "partition" else None

    @property
    def ends_process(self) -> bool:
        """A kill or preempt: several on one task fire one per process of it."""
        return self.action in ("kill", "preempt")

    def __str__(self) -> str:
        when = (f"step={self.step}" if self.step is not None else
                f"ran={self.ran}" if self.ran is not None else
                f"down={self.down}" if self.down is not None else f"{self.seconds:g}s")
        lift = f"+{self.lift_after:g}s" if self.lift_after is not None else ""
        return f"--{self.action} {self.member}@{when}{lift}"


@dataclass(frozen=True)
class Slow:
    """``--slow``: run ``task`` at ``fraction`` of its speed, from the start or from WHEN on."""

    member: str
    fraction: float
    seconds: float | None = None
    step: int | None = None

    @property
    def from_start(self) -> bool:
        return self.seconds is None and self.step is None

    def __str__(self) -> str:
        when = ("" if self.from_start else
                f"@step={self.step}" if self.step is not None else f"@{self.seconds:g}s")
        return f"--slow {self.member}={self.fraction:g}{when}"


_TASK = r"(chief|worker|ps|local|evaluator):(\d+)"
_WHEN = r"(?:step=(\d+)|(\d+(?:\.\d+)?)s?)"
_FAULT_RX = re.compile(rf"^{_TASK}@(?:{_WHEN}|ran=(\d+)|down={_TASK})$")
_LIFT = r"(?:\+(\d+(?:\.\d+)?)s?)?"
_HANG_RX = re.compile(rf"^{_TASK}@{_WHEN}{_LIFT}$")
_PARTITION_RX = re.compile(rf"^host(\d+)@{_WHEN}{_LIFT}$")
_SLOW_RX = re.compile(rf"^{_TASK}=(\d*\.?\d+)(?:@{_WHEN})?$")


def parse_fault(action: str, spec: str) -> Fault:
    """``worker:1@20`` / ``ps:0@step=150`` (``--hang worker:1@20+5``, ``--partition
    host1@step=100+10``) into a Fault, or LaunchError (pure)."""
    if action not in FAULT_ACTIONS:
        raise LaunchError(f"unknown fault action {action!r}; allowed: {', '.join(FAULT_ACTIONS)}")
    if action in LASTING:
        return _parse_lasting(action, spec)
    m = _FAULT_RX.match(spec.strip())
    if not m:
        raise LaunchError(
            f"--{action} {spec!r} is not a fault spec; expected {FAULT_SPEC}, "
            f"e.g. --{action} worker:1@step=150"
        )
    role, index, step, seconds, ran, down_role, down_index = m.groups()
    member = f"{role}:{int(index)}"
    if step is not None:
        return Fault(action, member, step=int(step))
    if ran is not None:
        return Fault(action, member, ran=int(ran))
    if down_role is not None:
        down = f"{down_role}:{int(down_index)}"
        if down == member:
            raise LaunchError(f"--{action} {spec!r} waits for {member} itself to be down; "
                              f"@down= names another task, e.g. --{action} ps:0@down=worker:1")
        return Fault(action, member, down=down)
    return Fault(action, member, seconds=float(seconds))


def _parse_lasting(action: str, spec: str) -> Fault:
    m = (_HANG_RX if action == "hang" else _PARTITION_RX).match(spec.strip())
    if not m:
        raise LaunchError(f"--{action} {spec!r} is not a {action} spec; expected "
                          f"{LASTING_SPEC[action]}; WHEN as for --kill (@20, @step=150)")
    *target, step, seconds, lift = m.groups()
    member = f"{target[0]}:{int(target[1])}" if action == "hang" else f"host{int(target[0])}"
    lift_after = float(lift) if lift is not None else None
    if lift_after is not None and lift_after <= 0:
        raise LaunchError(f"--{action} {spec!r}: +SECONDS must be above 0 (how long the "
                          f"{action} lasts), received {lift_after:g}; leave it out to "
                          "last until the launcher ends")
    return Fault(action, member, seconds=float(seconds) if seconds is not None else None,
                 step=int(step) if step is not None else None, lift_after=lift_after)


def parse_slow(spec: str) -> Slow:
    """``worker:1=0.25`` / ``worker:1=0.5@step=200`` into a Slow, or LaunchError (pure)."""
    m = _SLOW_RX.match(spec.strip())
    if not m:
        raise LaunchError(f"--slow {spec!r} is not a slow-down spec; expected {SLOW_SPEC}")
    role, index, fraction, step, seconds = m.groups()
    value = float(fraction)
    if not 0 < value < 1:
        raise LaunchError(f"--slow {spec!r}: FRACTION must be above 0 and below 1 "
                          f"(0.25: a quarter of the task's speed), received {value:g}")
    return Slow(f"{role}:{int(index)}", value,
                seconds=float(seconds) if seconds is not None else None,
                step=int(step) if step is not None else None)


# --restart-delay's default (``launcher.config.Recovery``, which imports it from here).
RESTART_DELAY = 2.0


@dataclass(frozen=True)
class RecoveryPlan:
    faults: tuple[Fault, ...] = ()
    restart_tasks: bool = False
    restart_delay: float = RESTART_DELAY
    max_restarts: int = 0
    slow: tuple[Slow, ...] = ()


def plan_recovery(kind: StrategyKind, members, asked, again, hosts: int = 0) -> RecoveryPlan:
    """Check the fault, slow-down and restart flags (their raw specs) against the cluster (pure).

    ``asked``: the request's ``Faults`` (``kill``, ``preempt``, ``hang``,
    ``partition``, ``slow``: each a tuple of specs); ``again``: its ``Recovery``
    (``restart_tasks``, ``restart_delay``, ``max_restarts``); ``hosts``: how many
    simulated hosts (``--hosts``; 0: none), which a ``--partition`` needs.
    """
    names = list(members)
    restart_tasks, restart_delay = again.restart_tasks, again.restart_delay
    max_restarts = again.max_restarts
    faults = tuple(parse_fault(action, spec) for action in FAULT_ACTIONS
                   for spec in getattr(asked, action))
    slowed = tuple(parse_slow(spec) for spec in asked.slow)
    for fault in faults:
        if fault.action != "partition":
            continue
        if not hosts:
            raise LaunchError(f"{fault} takes a simulated host's link down; it needs "
                              "--hosts N (N >= 2): without it every task shares one loopback")
        if fault.host >= hosts:
            raise LaunchError(f"{fault} names a host this launch does not have; hosts: "
                              + ", ".join(f"host{i}" for i in range(hosts)))
    for item in (*faults, *slowed):
        if isinstance(item, Fault) and item.action == "partition":
            continue
        for member in (item.member, getattr(item, "down", None)):
            if member is not None and member not in names:
                raise LaunchError(
                    f"{item} names a task this cluster does not have; tasks: {', '.join(names)}"
                )
    tasks_slowed = [s.member for s in slowed]
    if len(set(tasks_slowed)) != len(tasks_slowed):
        raise LaunchError(f"--slow names {max(tasks_slowed, key=tasks_slowed.count)} twice; "
                          "one --slow per task")
    if max_restarts < 0:
        raise LaunchError(f"--max-restarts={max_restarts}; use 0 (never) or more")
    if not 0 <= restart_delay < math.inf:
        raise LaunchError(f"--restart-delay={restart_delay:g}; use 0 or more seconds")
    if restart_tasks and not kind.restartable_roles:
        able = [k.name for k in kinds.all_kinds().values() if k.restartable_roles]
        raise LaunchError(
            f"--restart-tasks restarts lost workers under --strategy {'|'.join(able)}, received "
            f"--strategy {kind.name}, whose workers cannot rejoin a running all-reduce; "
            "use --max-restarts N to relaunch the whole job from its checkpoint"
        )
    return RecoveryPlan(faults, bool(restart_tasks), restart_delay, max_restarts, slowed)


def should_relaunch(code: int, attempt: int, max_restarts: int) -> bool:
    """Relaunch after this attempt's exit ``code``? (pure)

    Failures a relaunch can cure: a lost task, a preemption, a crash. Bad
    input, a diverged run (it would diverge again), a full or read-only run
    directory (it stays so until someone frees space), a model that cannot be
    exported (``--export``: it would fail again), a timeout and success end
    the job.
    """
    return code not in (protocol.Exit.OK, protocol.Exit.BAD_INPUT, protocol.Exit.DIVERGED,
                        protocol.Exit.STORAGE, protocol.Exit.EXPORT,
                        protocol.Exit.TIMEOUT, protocol.Exit.INTERRUPTED,
                        protocol.Exit.TERMINATED) \
        and attempt < max_restarts

