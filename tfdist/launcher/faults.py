"""Faults the launcher injects, and how it recovers: kill, preempt, hang, partition, slow,
restart, relaunch.

``parse_fault``, ``parse_slow`` and ``plan_recovery`` check the flags (pure;
``launch.py`` hands them the raw specs, never its argparse namespace).
``FaultInjector`` and ``TaskRestarter`` are supervisor hooks: they read the
job's state and return actions. ``Slowdown`` runs a task at a fraction of
its speed from outside the process, as a slower or busier host would: a
cgroup v1 ``cpu`` controller CFS quota (``launcher/cgroups.py``), or where cgroups cannot be written a
SIGSTOP/SIGCONT duty cycle; never code inside the training step.
"""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time
from dataclasses import dataclass

from tfdist import protocol
from tfdist.launcher import cgroups
from tfdist.launcher.plan import LaunchError
from tfdist.launcher.state import JobState, RestartTask, SetLink, SignalTask, SlowTask
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
MAX_TASK_RESTARTS = 3  # per task: a worker that keeps dying is not a transient fault


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
    task: str
    seconds: float | None = None
    step: int | None = None
    lift_after: float | None = None
    ran: int | None = None
    down: str | None = None

    @property
    def host(self) -> int | None:
        """The simulated host's index, for a partition."""
        return int(self.task[len("host"):]) if self.action == "partition" else None

    @property
    def ends_process(self) -> bool:
        """A kill or preempt: several on one task fire one per process of it."""
        return self.action in ("kill", "preempt")

    def __str__(self) -> str:
        when = (f"step={self.step}" if self.step is not None else
                f"ran={self.ran}" if self.ran is not None else
                f"down={self.down}" if self.down is not None else f"{self.seconds:g}s")
        lift = f"+{self.lift_after:g}s" if self.lift_after is not None else ""
        return f"--{self.action} {self.task}@{when}{lift}"


@dataclass(frozen=True)
class Slow:
    """``--slow``: run ``task`` at ``fraction`` of its speed, from the start or from WHEN on."""

    task: str
    fraction: float
    seconds: float | None = None
    step: int | None = None

    @property
    def from_start(self) -> bool:
        return self.seconds is None and self.step is None

    def __str__(self) -> str:
        when = ("" if self.from_start else
                f"@step={self.step}" if self.step is not None else f"@{self.seconds:g}s")
        return f"--slow {self.task}={self.fraction:g}{when}"


_TASK = r"(chief|worker|ps|local):(\d+)"
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
    task = f"{role}:{int(index)}"
    if step is not None:
        return Fault(action, task, step=int(step))
    if ran is not None:
        return Fault(action, task, ran=int(ran))
    if down_role is not None:
        down = f"{down_role}:{int(down_index)}"
        if down == task:
            raise LaunchError(f"--{action} {spec!r} waits for {task} itself to be down; "
                              f"@down= names another task, e.g. --{action} ps:0@down=worker:1")
        return Fault(action, task, down=down)
    return Fault(action, task, seconds=float(seconds))


def _parse_lasting(action: str, spec: str) -> Fault:
    m = (_HANG_RX if action == "hang" else _PARTITION_RX).match(spec.strip())
    if not m:
        raise LaunchError(f"--{action} {spec!r} is not a {action} spec; expected "
                          f"{LASTING_SPEC[action]}; WHEN as for --kill (@20, @step=150)")
    *target, step, seconds, lift = m.groups()
    task = f"{target[0]}:{int(target[1])}" if action == "hang" else f"host{int(target[0])}"
    lift_after = float(lift) if lift is not None else None
    if lift_after is not None and lift_after <= 0:
        raise LaunchError(f"--{action} {spec!r}: +SECONDS must be above 0 (how long the "
                          f"{action} lasts), received {lift_after:g}; leave it out to "
                          "last until the launcher ends")
    return Fault(action, task, seconds=float(seconds) if seconds is not None else None,
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


@dataclass(frozen=True)
class RecoveryPlan:
    faults: tuple[Fault, ...] = ()
    restart_tasks: bool = False
    restart_delay: float = 2.0
    max_restarts: int = 0
    slow: tuple[Slow, ...] = ()


def plan_recovery(kind: StrategyKind, tasks, *, kill=(), preempt=(), slow=(), hang=(),
                  partition=(), hosts: int = 0, restart_tasks: bool = False,
                  restart_delay: float = 2.0, max_restarts: int = 0) -> RecoveryPlan:
    """Check the fault, slow-down and restart flags (their raw specs) against the cluster (pure).

    ``hosts``: how many simulated hosts (``--hosts``; 0: none), which a
    ``--partition`` needs.
    """
    names = list(tasks)
    specs = {"kill": kill or (), "preempt": preempt or (), "hang": hang or (),
             "partition": partition or ()}
    faults = tuple(parse_fault(action, spec) for action in FAULT_ACTIONS for spec in specs[action])
    slowed = tuple(parse_slow(spec) for spec in (slow or ()))
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
        for task in (item.task, getattr(item, "down", None)):
            if task is not None and task not in names:
                raise LaunchError(
                    f"{item} names a task this cluster does not have; tasks: {', '.join(names)}"
                )
    tasks_slowed = [s.task for s in slowed]
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


# --- hooks: read the job's state, return actions ----------------------------------------

STEP_EVENTS = (protocol.PROGRESS, protocol.CHECKPOINT, protocol.PREEMPTED, protocol.DONE)


class FaultInjector:
    """Fires each fault (and each timed slow-down) once, when its time or step comes.

    Steps come from every task's progress events (``protocol``: the files
    ``event_paths`` name, read at each poll); times count from the launcher's
    start. ``@ran=N`` counts the steps the target's current process has run:
    its own events since its ``started`` event, or for a ps worker (which
    emits none) its local steps in the chief's ``steps_per_worker`` since the
    first report after it (re)started. ``@down=TASK`` is due while that task
    has exited in the current attempt.

    Several kills or preemptions of one task fire in the order given, one per
    process of it: each waits until the one before has fired and a new
    process of the task (a restart or a relaunch) runs, then for its own WHEN.
    """

    def __init__(self, faults, log=print, clock=time.monotonic, grace: float | None = None,
                 event_paths=()):
        self.readers = [protocol.EventReader(p) for p in event_paths]
        self.waiting = list(faults)
        self.fired: list[str] = []
        # Each fault fired: kind, target, when; hangs and partitions: when lifted, and by what.
        self.records: list[dict] = []
        self._lasting: list[tuple[Fault, int | None, dict]] = []
        self.slowed: list[str] = []
        self.log = log
        self.clock = clock
        self.grace = grace
        self.started = clock()
        self.step = -1
        self._terminating: list[tuple[str, int, float]] = []  # task, pid, SIGKILL deadline
        # For @ran= and the one-per-process rule: each task's current pid, the
        # pid the last kill or preempt of it hit, [first, latest] step of its
        # current process's own events, and a ps worker's local steps (base, now).
        self._pids: dict[str, int] = {}
        self._hit: dict[str, int] = {}
        self._own: dict[str, list[int]] = {}
        self._local: dict[str, list[int]] = {}

    def on_event(self, event: protocol.Event) -> None:
        if event.kind in STEP_EVENTS and isinstance(event.step, int):
            self.step = max(self.step, event.step)
            if event.task in self._own:
                own = self._own[event.task]
                own[1] = max(own[1], event.step)
        if event.kind == protocol.STARTED and isinstance(event.step, int):
            self._own[event.task] = [event.step, event.step]
        per_worker = event.data.get("steps_per_worker") if event.kind == protocol.PROGRESS \
            else None
        if isinstance(per_worker, dict):
            for worker, count in per_worker.items():
                if not isinstance(count, int):
                    continue
                local = self._local.get(worker)
                # A relaunch starts the count again (a new ps:0): a new base.
                if local is None or count < local[0]:
                    self._local[worker] = [count, count]
                else:
                    local[1] = count

    def ran(self, task: str) -> int | None:
        """Steps the task's current process has run, once known."""
        if task in self._own:
            first, latest = self._own[task]
            return latest - first
        if task in self._local:
            base, now = self._local[task]
            return now - base
        return None

    def _track(self, state: JobState) -> None:
        """A task with a new process counts @ran= from its own start."""
        for view in state.tasks:
            if self._pids.get(view.name) != view.pid:
                self._pids[view.name] = view.pid
                self._own.pop(view.name, None)
                self._local.pop(view.name, None)

    def _reached(self, fault, state: JobState | None, elapsed: float) -> bool:
        if fault.step is not None:
            return self.step >= fault.step
        if fault.seconds is not None:
            return elapsed >= fault.seconds
        if getattr(fault, "ran", None) is not None:
            ran = self.ran(fault.task)
            return ran is not None and ran >= fault.ran
        if getattr(fault, "down", None) is not None and state is not None:
            view = state.task(fault.down)
            return view is not None and not view.running
        return False

    def due(self, state: JobState | None = None) -> list:
        if state is not None:
            self._track(state)
        for reader in self.readers:
            for event in reader.read():
                self.on_event(event)
        elapsed = self.clock() - self.started
        ready, queued = [], set()
        for fault in self.waiting:
            if isinstance(fault, Fault) and fault.ends_process:
                if fault.task in queued:
                    continue  # an earlier kill or preempt of this task comes first
                queued.add(fault.task)
                if fault.task in self._hit:
                    # Only on a newer process of the task than the last one hit.
                    view = state.task(fault.task) if state is not None else None
                    if view is None or not view.running or view.pid == self._hit[fault.task]:
                        continue
            if self._reached(fault, state, elapsed):
                ready.append(fault)
        self.waiting = [f for f in self.waiting if not any(f is r for r in ready)]
        return ready

    def __call__(self, state: JobState) -> list:
        actions = self._enforce_grace(state) + self._lift_due(state)
        for fault in self.due(state):
            at = f"at {self.clock() - self.started:.1f}s, step {max(self.step, 0)}"
            if isinstance(fault, Fault) and fault.action == "partition":
                actions.append(SetLink(fault.host, up=False))
                self._fired(fault, None, state.attempt)
                self.log(f"[launch] fault {fault}: {fault.task}'s link is down {at}"
                         + (f"; back up in {fault.lift_after:g}s" if fault.lift_after else
                            "; until the launcher ends"))
                continue
            task = state.task(fault.task)
            if task is None or not task.running:
                self.log(f"[launch] {'slow' if isinstance(fault, Slow) else 'fault'} {fault}: "
                         f"{fault.task} is not running; skipped")
                continue
            if isinstance(fault, Slow):
                actions.append(SlowTask(fault.task, fault.fraction))
                self.slowed.append(str(fault))
                self.log(f"[launch] slow {fault}: {fault.task} (pid {task.pid}) runs at "
                         f"{fault.fraction:.0%} of its speed from now on, {at}")
                continue
            sig = FAULT_ACTIONS[fault.action]
            # A kill or a hang takes the whole task, as if its host died or
            # froze; a preemption signals the task's own process, as
            # Kubernetes does.
            actions.append(SignalTask(fault.task, sig, group=fault.action != "preempt",
                                      pid=task.pid))
            if fault.action == "preempt" and self.grace is not None:
                self._terminating.append((fault.task, task.pid, self.clock() + self.grace))
            if fault.ends_process:
                self._hit[fault.task] = task.pid
            self._fired(fault, task.pid, state.attempt)
            lasts = ("" if fault.action != "hang" else
                     f"; SIGCONT in {fault.lift_after:g}s" if fault.lift_after else
                     "; stopped until the launcher ends")
            self.log(f"[launch] fault {fault}: sent {signal.Signals(sig).name} to {fault.task} "
                     f"(pid {task.pid}) {at}{lasts}")
        return actions

    def _fired(self, fault: Fault, pid: int | None, attempt: int = 0) -> None:
        self.fired.append(str(fault))
        record = {"kind": fault.action, "target": fault.task,
                  "at_seconds": round(self.clock() - self.started, 2),
                  "at_step": max(self.step, 0)}
        if fault.ends_process:
            # Which attempt and process it hit, and the steps that process had run.
            record.update(attempt=attempt, pid=pid)
            if (ran := self.ran(fault.task)) is not None:
                record["target_ran"] = ran
        if fault.action in LASTING:
            record.update(lift_after=fault.lift_after, lifted_at_seconds=None, lifted_by=None)
            self._lasting.append((fault, pid, record))
        self.records.append(record)

    def _lift_due(self, state: JobState) -> list:
        """Hangs and partitions whose +SECONDS are over: SIGCONT, link up."""
        now, keep, actions = self.clock() - self.started, [], []
        for fault, pid, record in self._lasting:
            if fault.action == "hang" and fault.lift_after is None:
                # Stopped for good, until its process ends (killed as stuck,
                # say, and restarted): then the hang is over with it.
                task = state.task(fault.task)
                if task is None or task.pid != pid or not task.running:
                    record.update(lifted_at_seconds=round(now, 2), lifted_by="task gone")
                    continue
            if fault.lift_after is None or now < record["at_seconds"] + fault.lift_after:
                keep.append((fault, pid, record))
                continue
            record.update(lifted_at_seconds=round(now, 2), lifted_by="schedule")
            if fault.action == "partition":
                actions.append(SetLink(fault.host, up=True))
                self.log(f"[launch] fault {fault} lifted: {fault.task}'s link is up again at "
                         f"{now:.1f}s")
                continue
            task = state.task(fault.task)
            if task is None or task.pid != pid or not task.running:
                record["lifted_by"] = "task gone"
                continue
            actions.append(SignalTask(fault.task, signal.SIGCONT, group=True, pid=pid))
            self.log(f"[launch] fault {fault} lifted: sent SIGCONT to {fault.task} (pid {pid}) "
                     f"at {now:.1f}s")
        self._lasting = keep
        return actions

    def end_attempt(self) -> None:
        """The supervisor has continued every stopped task and raised every
        link (``Supervisor.stop``): the hangs and partitions still on are
        recorded as lifted by that cleanup."""
        now = round(self.clock() - self.started, 2)
        for _, _, record in self._lasting:
            record.update(lifted_at_seconds=now, lifted_by="launcher cleanup")
        self._lasting = []

    def _enforce_grace(self, state: JobState) -> list:
        """A preempted task still running ``--grace`` s later is SIGKILLed, as
        a cluster manager does (TensorFlow may have swallowed the SIGTERM)."""
        now, keep, actions = self.clock(), [], []
        for name, pid, deadline in self._terminating:
            task = state.task(name)
            if task is None or task.pid != pid or not task.running:
                continue
            if now < deadline:
                keep.append((name, pid, deadline))
                continue
            self.log(f"[launch] {name} still running {self.grace:g}s (--grace) after "
                     "its SIGTERM; SIGKILL, as a cluster manager would")
            actions.append(SignalTask(name, signal.SIGKILL, group=True, pid=pid))
        self._terminating = keep
        return actions


class TaskRestarter:
    """Restarts a dead worker (of a kind whose workers may rejoin) after a delay.

    Under ps the coordinator waits for a lost worker to come back at the same
    address, and gives it work again once it does.
    """

    def __init__(self, delay: float, log=print, limit: int = MAX_TASK_RESTARTS,
                 clock=time.monotonic, roles: tuple[str, ...] = ("worker",), event_paths=()):
        self.delay, self.log, self.limit, self.clock, self.roles = delay, log, limit, clock, roles
        self.restarts: dict[str, int] = {}
        self._due: dict[str, float] = {}
        # Tasks the chief reported stuck (protocol.STUCK), and the processes
        # already killed for it: a stuck task is ended, then restarted as a
        # dead one, as a cluster manager's liveness check would.
        self.readers = [protocol.EventReader(p) for p in event_paths]
        self._stuck: dict[str, str] = {}  # task -> who reported it
        self._killed: set[int] = set()

    def new_attempt(self) -> None:
        """A relaunched job starts with no restart pending (counts are kept)."""
        self._due.clear()

    def restartable(self, name: str) -> bool:
        return name.partition(":")[0] in self.roles

    def _stuck_kills(self, state: JobState) -> list:
        for reader in self.readers:
            for event in reader.read():
                peer = event.data.get("peer") if event.kind == protocol.STUCK else None
                if isinstance(peer, str):
                    self._stuck[peer] = event.task
        actions = []
        for name, by in list(self._stuck.items()):
            view = state.task(name)
            del self._stuck[name]
            if view is None or not view.running or view.pid in self._killed \
                    or not self.restartable(name) or self.restarts.get(name, 0) >= self.limit:
                continue
            self._killed.add(view.pid)
            self.log(f"[launch] {name} (pid {view.pid}) is stuck ({by} found it answering "
                     "nothing for --stuck-timeout): killing it to restart it, as a cluster "
                     "manager's liveness check would")
            actions.append(SignalTask(name, signal.SIGKILL, group=True, pid=view.pid))
        return actions

    def __call__(self, state: JobState) -> list:
        now, actions = self.clock(), self._stuck_kills(state)
        for t in state.tasks:
            # Exit 0 is a server that saw its chief finish: nothing to restart;
            # a full or read-only disk, or a model that cannot be exported, would fail it again.
            if (t.exit_code in (None, 0, protocol.Exit.STORAGE, protocol.Exit.EXPORT)
                    or not self.restartable(t.name)):
                continue
            if self.restarts.get(t.name, 0) >= self.limit:
                continue
            if t.name not in self._due:
                self._due[t.name] = now + self.delay
                self.log(f"[launch] {t.name} is down (exit {t.exit_code}); "
                         f"restarting it in {self.delay:g}s")
                continue
            if now < self._due[t.name]:
                continue
            del self._due[t.name]
            self.restarts[t.name] = self.restarts.get(t.name, 0) + 1
            actions.append(RestartTask(t.name, f"restart {self.restarts[t.name]} of at most "
                                                f"{self.limit}"))
        return actions


# --- slow-downs ------------------------------------------------------------------------------

# Seconds per SIGCONT/SIGSTOP cycle: long enough that this thread's wake-up
# delay on a busy machine (a few ms) is small against FRACTION of it, short
# enough for a peer's RPC deadlines and the coordination heartbeats.
DUTY_PERIOD = 0.2


class Slowdown:
    """Holds every slowed task at its fraction, across restarts and relaunches.

    ``method`` is ``"cgroup"`` (a cgroup per task, created here, with a CFS
    quota of FRACTION x the cores the task would use, which its process
    joins before exec, so every thread it starts is counted) or
    ``"signals"`` (a thread stops and continues the task's process group,
    FRACTION of each 200 ms on). ``close`` removes the cgroups.
    """

    def __init__(self, cores: dict[str, int], log=print, method: str = "auto",
                 root: str | None = None):
        self.cores, self.log = cores, log
        self.root = root or cgroups.cpu_cgroup_root()
        if method == "auto":
            problem = cgroups.cgroup_problem(self.root)
            method = "cgroup" if problem is None else "signals"
            if problem is not None:
                self.log(f"[launch] slow: no CPU-quota cgroup here ({problem}); "
                         "using a SIGSTOP/SIGCONT duty cycle instead")
        self.method = method
        self.active: dict[str, float] = {}
        self.cgroups: dict[str, str] = {}
        self._pids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def activate(self, task: str, fraction: float) -> None:
        self.active[task] = fraction
        if self.method == "cgroup":
            path = self.cgroups.get(task) or os.path.join(
                self.root, f"{cgroups.CGROUP_PREFIX}{os.getpid()}-{task.replace(':', '-')}")
            self.cgroups[task] = path  # removed by close() even if creating it fails
            cgroups.create(path, cgroups.quota_us(fraction, self.cores.get(task, 1)))
        elif self._thread is None:
            self._thread = threading.Thread(target=self._duty_cycle, daemon=True)
            self._thread.start()

    def describe(self, task: str) -> str:
        fraction = self.active[task]
        if self.method == "cgroup":
            quota = cgroups.quota_us(fraction, self.cores.get(task, 1))
            return (f"{task} at {fraction:.0%}: CFS quota {quota}"
                    f" us per {cgroups.CFS_PERIOD_US} us ({self.cores.get(task, 1)} core(s)) in "
                    f"{self.cgroups[task]}")
        return f"{task} at {fraction:.0%}: SIGCONT {fraction:.0%} of every {DUTY_PERIOD * 1000:.0f} ms"

    def cgroup_for(self, task: str) -> str | None:
        """The cgroup a (re)starting task joins before exec, if it is slowed."""
        return self.cgroups.get(task) if task in self.active else None

    def attach(self, task: str, pid: int) -> None:
        """Slow the running process ``pid`` of ``task`` (a no-op for a task not slowed)."""
        if task not in self.active:
            return
        if self.method == "cgroup":
            cgroups.join(self.cgroups[task], pid)
        else:
            with self._lock:
                self._pids[task] = pid
            # Stopped until the next cycle continues it: a process attached
            # mid-cycle would otherwise run free for up to a whole period.
            _killpg(pid, signal.SIGSTOP)

    def hold(self, task: str, pid: int, held: bool) -> None:
        """A hung task leaves the duty cycle (which would continue it) and
        rejoins it when the hang is lifted. (A cycle under way ends with its
        SIGSTOP, so the task stays stopped.) A cgroup quota needs nothing."""
        if self.method != "signals" or task not in self.active:
            return
        with self._lock:
            if held:
                self._pids.pop(task, None)
            else:
                self._pids[task] = pid

    def _duty_cycle(self) -> None:
        try:  # wake on time even when the cores are busy (allowed for root)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        except OSError:
            pass
        while not self._stop.is_set():
            start = time.monotonic()
            with self._lock:
                targets = sorted(((self.active[t], pid) for t, pid in self._pids.items()
                                  if t in self.active))
            for _, pid in targets:
                _killpg(pid, signal.SIGCONT)
            for fraction, pid in targets:
                left = start + fraction * DUTY_PERIOD - time.monotonic()
                if left > 0 and self._stop.wait(left):
                    break
                _killpg(pid, signal.SIGSTOP)
            left = start + DUTY_PERIOD - time.monotonic()
            if left > 0:
                self._stop.wait(left)
        self.resume()

    def resume(self) -> None:
        """Every stopped task runs again, and the duty cycle lets go of it: it
        is about to be stopped, and a stopped process cannot act on SIGTERM.
        A task started afterwards is attached again."""
        with self._lock:
            pids = list(self._pids.values())
            self._pids.clear()
        for pid in pids:
            _killpg(pid, signal.SIGCONT)

    def close(self) -> None:
        """Stop the duty cycle and remove the cgroups (their tasks have exited by now)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.resume()
        for path in self.cgroups.values():
            cgroups.remove(path, log=self.log)
        self.cgroups.clear()


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
