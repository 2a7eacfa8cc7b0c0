"""A supervisor hook that fires each planned fault (and timed slow-down) once, when its
time or step comes (``faults.RecoveryPlan``): it reads the job's state and returns actions."""

from __future__ import annotations

import signal
import time

from tfdist import protocol
from tfdist.launcher.recovery.faults import FAULT_ACTIONS, LASTING, Fault, Slow
from tfdist.launcher.state import JobState, SetLink, SignalMember, SlowMember

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
            if event.member in self._own:
                own = self._own[event.member]
                own[1] = max(own[1], event.step)
        if event.kind == protocol.STARTED and isinstance(event.step, int):
            self._own[event.member] = [event.step, event.step]
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

    def ran(self, member: str) -> int | None:
        """Steps the task's current process has run, once known."""
        if member in self._own:
            first, latest = self._own[member]
            return latest - first
        if member in self._local:
            base, now = self._local[member]
            return now - base
        return None

    def _track(self, state: JobState) -> None:
        """A task with a new process counts @ran= from its own start."""
        for view in state.members:
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
            ran = self.ran(fault.member)
            return ran is not None and ran >= fault.ran
        if getattr(fault, "down", None) is not None and state is not None:
            view = state.member(fault.down)
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
                if fault.member in queued:
                    continue  # an earlier kill or preempt of this task comes first
                queued.add(fault.member)
                if fault.member in self._hit:
                    # Only on a newer process of the task than the last one hit.
                    view = state.member(fault.member) if state is not None else None
                    if view is None or not view.running or view.pid == self._hit[fault.member]:
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
                self.log(f"[launch] fault {fault}: {fault.member}'s link is down {at}"
                         + (f"; back up in {fault.lift_after:g}s" if fault.lift_after else
                            "; until the launcher ends"))
                continue
            member = state.member(fault.member)
            if member is None or not member.running:
                self.log(f"[launch] {'slow' if isinstance(fault, Slow) else 'fault'} {fault}: "
                         f"{fault.member} is not running; skipped")
                continue
            if isinstance(fault, Slow):
                actions.append(SlowMember(fault.member, fault.fraction))
                self.slowed.append(str(fault))
                self.log(f"[launch] slow {fault}: {fault.member} (pid {member.pid}) runs at "
                         f"{fault.fraction:.0%} of its speed from now on, {at}")
                continue
            sig = FAULT_ACTIONS[fault.action]
            # A kill or a hang takes the whole task, as if its host died or
            # froze; a preemption signals the task's own process, as
            # Kubernetes does.
            actions.append(SignalMember(fault.member, sig, group=fault.action != "preempt",
                                      pid=member.pid))
            if fault.action == "preempt" and self.grace is not None:
                self._terminating.append((fault.member, member.pid, self.clock() + self.grace))
            if fault.ends_process:
                self._hit[fault.member] = member.pid
            self._fired(fault, member.pid, state.attempt)
            lasts = ("" if fault.action != "hang" else
                     f"; SIGCONT in {fault.lift_after:g}s" if fault.lift_after else
                     "; stopped until the launcher ends")
            self.log(f"[launch] fault {fault}: sent {signal.Signals(sig).name} to {fault.member} "
                     f"(pid {member.pid}) {at}{lasts}")
        return actions

    def _fired(self, fault: Fault, pid: int | None, attempt: int = 0) -> None:
        self.fired.append(str(fault))
        record = {"kind": fault.action, "target": fault.member,
                  "at_seconds": round(self.clock() - self.started, 2),
                  "at_step": max(self.step, 0)}
        if fault.ends_process:
            # Which attempt and process it hit, and the steps that process had run.
            record.update(attempt=attempt, pid=pid)
            if (ran := self.ran(fault.member)) is not None:
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
                member = state.member(fault.member)
                if member is None or member.pid != pid or not member.running:
                    record.update(lifted_at_seconds=round(now, 2), lifted_by="task gone")
                    continue
            if fault.lift_after is None or now < record["at_seconds"] + fault.lift_after:
                keep.append((fault, pid, record))
                continue
            record.update(lifted_at_seconds=round(now, 2), lifted_by="schedule")
            if fault.action == "partition":
                actions.append(SetLink(fault.host, up=True))
                self.log(f"[launch] fault {fault} lifted: {fault.member}'s link is up again at "
                         f"{now:.1f}s")
                continue
            member = state.member(fault.member)
            if member is None or member.pid != pid or not member.running:
                record["lifted_by"] = "task gone"
                continue
            actions.append(SignalMember(fault.member, signal.SIGCONT, group=True, pid=pid))
            self.log(f"[launch] fault {fault} lifted: sent SIGCONT to {fault.member} (pid {pid}) "
                     f"at {now:.1f}s")
        self._lasting = keep
        return actions

    def end_attempt(self, keep_partitions: bool = False) -> None:
        """The supervisor has continued every stopped task and raised every
        link (``Supervisor.stop``): the hangs and partitions still on are
        recorded as lifted by that cleanup. ``keep_partitions``: the links
        stayed down (``--min-workers``), so partitions stay on schedule."""
        now = round(self.clock() - self.started, 2)
        keep = []
        for item in self._lasting:
            if keep_partitions and item[0].action == "partition":
                keep.append(item)
                continue
            item[2].update(lifted_at_seconds=now, lifted_by="launcher cleanup")
        self._lasting = keep

    def _enforce_grace(self, state: JobState) -> list:
        """A preempted task still running ``--grace`` s later is SIGKILLed, as
        a cluster manager does (TensorFlow may have swallowed the SIGTERM)."""
        now, keep, actions = self.clock(), [], []
        for name, pid, deadline in self._terminating:
            member = state.member(name)
            if member is None or member.pid != pid or not member.running:
                continue
            if now < deadline:
                keep.append((name, pid, deadline))
                continue
            self.log(f"[launch] {name} still running {self.grace:g}s (--grace) after "
                     "its SIGTERM; SIGKILL, as a cluster manager would")
            actions.append(SignalMember(name, signal.SIGKILL, group=True, pid=pid))
        self._terminating = keep
        return actions
