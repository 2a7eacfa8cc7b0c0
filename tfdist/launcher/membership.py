"""Elastic membership as a supervisor hook: which workers form the cluster, and each change.

``Membership`` is what every engine's view shares (the record, the events read,
each change logged); ``HostMembership`` decides on simulated hosts (a lost
host's worker left out, taken back when its host returns); the Ray engine's
``NodeMembership`` (``launcher/engine/ray_engine.py``) on Ray's nodes. An engine
gives the job its own (``Engine.membership``). The plan and the pure batch
arithmetic are ``launcher.recovery.elastic``'s.
"""

from __future__ import annotations

import signal
import time

from tfdist import protocol
from tfdist.launcher.recovery.elastic import ROLE, ElasticPlan, member_configs, workers_text
from tfdist.launcher.state import JobState, RestartMember, SignalMember
from tfdist.protocol import Exit

__all__ = ["ElasticPlan", "HostMembership", "Membership", "workers_text"]


class Membership:
    """Which workers form the cluster, each change and why: what every engine's
    membership hook shares (``HostMembership`` on simulated hosts; the Ray engine's
    ``NodeMembership``). Each poll it reads the members' progress events (the
    newest checkpoint, the last step, the first step of each formation);
    ``after_attempt`` says whether the cluster is re-formed."""

    def __init__(self, plan: ElasticPlan, names: list[str], event_paths=(), log=print,
                 clock=time.monotonic, record_path: str | None = None, live: bool = False):
        self.plan, self.log, self.clock = plan, log, clock
        self.record_path = record_path  # the file the chief copies into results.json
        # ps: workers leave and rejoin the running cluster (the coordinator
        # reschedules a gone worker's steps), no re-formation.
        self.live = live
        # Who is told to save and stop when a worker comes back: the
        # coordinator if the cluster has one (ps-sync's chief), else a worker
        # (multiworker's workers agree on the step among themselves).
        self.saver = next((n for n in names if n.partition(":")[0] == "chief"), None)
        self.all_names = list(names)
        self.workers = [n for n in names if n.partition(":")[0] == ROLE]
        self.members = list(self.workers)
        self.readers = [protocol.EventReader(p) for p in event_paths]
        self.links_down = lambda: set()
        self.history: list[dict] = [{"step": 0, "workers": len(self.workers),
                                     "why": "start", "members": list(self.workers)}]
        self.checkpoint = 0  # newest checkpoint seen (steps it holds)
        self.last_step = 0  # newest step any task reported
        self.down_since: dict[str, float] = {}
        self.lost: list[str] = []  # members given up on in this attempt
        self.growing: list[str] = []  # workers coming back: the preemption was ours
        self.started = False  # the current formation ran its first step
        self.changed_at: float | None = None  # wall time of the loss or return
        self.short_since: float | None = None  # ps: fewer than M workers since
        self.back_seen: float | None = None  # a left worker's host first seen up again
        # A worker whose process failed first while its host was reachable (and
        # its exit code), in this attempt; each worker's such failures; the
        # workers the job went on without for them (never grown back).
        self.failed: tuple[str, int] | None = None
        self.failures: dict[str, int] = {}
        self.dropped: list[str] = []
        self._write()

    # --- what the supervisor starts ------------------------------------------------

    @property
    def names(self) -> list[str]:
        if self.live:
            return list(self.all_names)  # a left worker is started again by the hook
        return [n for n in self.all_names if n.partition(":")[0] != ROLE or n in self.members]

    def configs(self, tf_configs: dict[str, dict | None]) -> dict[str, dict]:
        """Each member's TF_CONFIG in a cluster of only the members (``tf_configs``:
        the whole cluster's)."""
        keep = [n for n in self.all_names if n in self.names]
        return member_configs(tf_configs, keep)

    def env(self) -> dict[str, str]:
        """What every task is told: where the membership is kept."""
        return {protocol.MEMBERSHIP_ENV: self.record_path} if self.record_path else {}

    def _write(self) -> None:
        if self.record_path is None:
            return
        try:
            protocol.write_json_atomic(self.record_path, self.record())
        except OSError as err:
            self.log(f"[launch] warning: could not write {self.record_path} "
                     f"({err.strerror or err}); results.json will have no membership")

    def record(self) -> list[dict]:
        return [{k: v for k, v in h.items() if k in ("step", "workers", "why")}
                for h in self.history]

    def new_attempt(self, links_down) -> None:
        self.links_down = links_down
        self.down_since, self.lost, self.growing, self.started = {}, [], [], False
        self.back_seen, self.failed = None, None

    # --- the hook --------------------------------------------------------------------

    def _read(self) -> None:
        for reader in self.readers:
            for event in reader.read():
                if not isinstance(event.step, int):
                    continue
                if event.kind in (protocol.CHECKPOINT, protocol.PREEMPTED):
                    self.checkpoint = max(self.checkpoint, event.step)
                if event.kind in (protocol.PROGRESS, protocol.CHECKPOINT, protocol.STARTED):
                    self.last_step = max(self.last_step, event.step)
                if event.kind == protocol.STARTED and not self.started:
                    self.started = True
                    if self.changed_at is not None and len(self.history) > 1:
                        self._first_step(self.history[-1], event)

    def _first_step(self, entry: dict, event: protocol.Event) -> None:
        """The new formation's first step: when, and the step it really resumed
        from (a checkpoint being written when the tasks were stopped is not
        listed, so the one before it is restored)."""
        entry["first_step_after_seconds"] = round(event.time - self.changed_at, 1)
        resumed = event.data.get("resumed_from")
        if self.live or not isinstance(resumed, int) or resumed == entry["step"]:
            return
        entry["step"] = resumed
        if "last_step_before" in entry:
            entry["steps_redone_at_least"] = max(0, entry["last_step_before"] - resumed)
        self._write()

    def _change(self, why: str, back: bool) -> None:
        redone = max(0, self.last_step - self.checkpoint)
        entry = {"step": self.checkpoint, "workers": len(self.members), "why": why,
                 "members": list(self.members), "last_step_before": self.last_step,
                 "steps_redone_at_least": redone}
        self.history.append(entry)
        self._write()
        self.log(f"[launch] {why}: {'growing back to' if back else 'continuing with'} "
                 f"{workers_text(len(self.members))} from step {self.checkpoint}"
                 + (f" (steps {self.checkpoint}-{self.last_step} redone)" if redone else ""))
        self.last_step = self.checkpoint


class HostMembership(Membership):
    """The membership hook on simulated hosts (the local engine's view).

    Each poll it also reads the simulated hosts' links (``links_down``: a
    callable, the live supervisor's set). A member whose host has been down for
    ``rejoin_timeout`` ends the attempt (every member SIGKILLed: the survivors
    are blocked in a collective); a lost worker whose host is up again preempts
    the job (SIGTERM: every worker saves at one agreed step), and
    ``after_attempt`` re-forms the cluster.
    """

    def __init__(self, plan: ElasticPlan, names: list[str], host_of: dict[str, int],
                 event_paths=(), log=print, clock=time.monotonic,
                 record_path: str | None = None, live: bool = False):
        self.host_of = dict(host_of)
        super().__init__(plan, names, event_paths, log, clock, record_path, live)

    def __call__(self, state: JobState) -> list:
        self._read()
        down = self.links_down()
        now = self.clock()
        if self.live:
            return self._live(state, down, now)
        for name in self.members:
            if self.host_of.get(name) in down:
                self.down_since.setdefault(name, now)
            else:
                self.down_since.pop(name, None)
        self._note_failure(state, down)
        if self.down_since and not self.lost:
            failed = any(t.exit_code not in (None, 0) for t in state.members)
            waited = now - min(self.down_since.values())
            if failed or waited >= self.plan.rejoin_timeout:
                # The survivors are blocked in (or have left) a collective with
                # the lost one: nothing is saved by waiting; end the attempt.
                self.lost = sorted(self.down_since, key=self.all_names.index)
                self.changed_at = time.time() - waited
                self.log(f"[launch] {', '.join(self.lost)} unreachable for {waited:.0f} s"
                         + (" and the others' all-reduce failed" if failed else "")
                         + ": stopping this formation of the cluster to re-form it")
                return [SignalMember(t.name, signal.SIGKILL, pid=t.pid)
                        for t in state.members if t.running]
            return []
        back = [w for w in self.workers if w not in self.members and w not in self.dropped
                and self.host_of.get(w) not in down]
        if back and self.back_seen is None:
            self.back_seen = time.time()  # the return, which the grow-back is timed from
        if back and self.started and not self.growing and not self.down_since:
            first = next((t for t in state.members if t.running and (
                t.name == self.saver if self.saver else t.name in self.members)), None)
            if first is not None:
                self.growing = back
                self.changed_at = self.back_seen
                self.log(f"[launch] {', '.join(back)}: host reachable again; SIGTERM to "
                         f"{first.name}: the job checkpoints where it is and stops (exit 42), "
                         f"then re-forms with {workers_text(len(self.members) + len(back))}")
                return [SignalMember(first.name, signal.SIGTERM, group=False, pid=first.pid)]
        return []

    def _note_failure(self, state: JobState, down: set) -> None:
        """The first member to fail in this attempt while its host is reachable: the
        one whose loss ended it (the others then report the lost peer, exit 75,
        or are stopped), preferring a code other than 75 when several end at once."""
        if self.failed is not None or self.down_since:
            return
        ended = [(t.name, t.exit_code) for t in state.members if t.name in self.members
                 and t.exit_code not in (None, 0, Exit.PREEMPTED)
                 and self.host_of.get(t.name) not in down]
        if ended:
            self.failed = next((e for e in ended if e[1] != Exit.TASK_LOST), ended[0])

    def _live(self, state: JobState, down: set, now: float) -> list:
        """ps: a worker whose host is gone leaves the running job (its steps go
        to the others), and is started again, same TF_CONFIG, once its host
        is back; fewer than M workers for ``rejoin_timeout`` ends the job."""
        if self.lost:
            return []  # the job is being stopped
        actions: list = []
        for name in list(self.members):
            view = state.member(name)
            host = self.host_of.get(name)
            if host not in down:
                self.down_since.pop(name, None)
                continue
            since = self.down_since.setdefault(name, now)
            ended = view is None or not view.running
            if not ended and now - since < self.plan.rejoin_timeout:
                continue
            if not ended:
                actions.append(SignalMember(name, signal.SIGKILL, pid=view.pid))
            self.members.remove(name)
            self.changed_at = time.time()
            self._live_change(f"{name} left (host{host} unreachable"
                              + (", its task ended)" if ended else
                                 f" for {now - since:.0f} s)"), "going on with")
        for name in self.workers:
            if name in self.members or self.host_of.get(name) in down:
                continue
            view = state.member(name)
            if view is not None and view.running:
                continue
            self.members = [w for w in self.workers if w in self.members or w == name]
            self.changed_at = time.time()
            actions.append(RestartMember(name, note="its host is reachable again"))
            self._live_change(f"{name} back (host{self.host_of.get(name)} reachable again)",
                              "growing back to")
        if len(self.members) >= self.plan.min_workers:
            self.short_since = None
        elif self.short_since is None:
            self.short_since = now
        elif now - self.short_since >= self.plan.rejoin_timeout:
            self.lost = [w for w in self.workers if w not in self.members]
            self.log(f"[launch] {len(self.members)} worker(s) left for "
                     f"{self.plan.rejoin_timeout:g} s (--rejoin-timeout), below --min-workers="
                     f"{self.plan.min_workers}; stopping (exit {int(Exit.TASK_LOST)}): run the "
                     "same command when capacity is back to resume from the newest checkpoint")
            actions += [SignalMember(t.name, signal.SIGKILL, pid=t.pid)
                        for t in state.members if t.running]
        return actions

    def _live_change(self, why: str, verb: str) -> None:
        self.history.append({"step": self.last_step, "workers": len(self.members), "why": why,
                             "members": list(self.members)})
        self._write()
        self.log(f"[launch] {why}: {verb} {workers_text(len(self.members))} at step {self.last_step}")

    # --- between attempts --------------------------------------------------------------

    def after_attempt(self, code: int, wait_links) -> int | None:
        """After an attempt ended with ``code``: ``None`` to re-form (the members
        changed), else the code to go on with as before (relaunch or end).

        ``wait_links(seconds)`` keeps the fault schedule running (a partition
        lifted when due) while a lost member's host may still come back.
        """
        self._read()
        if self.live:
            return Exit.TASK_LOST if self.lost else code
        if code == Exit.PREEMPTED and self.growing:
            back = self.growing
            self.members = [w for w in self.workers if w in self.members or w in back]
            hosts = ", ".join(f"host{self.host_of[w]}" for w in back)
            why = f"{', '.join(back)} back ({hosts} reachable again)"
            self._change(why, back=True)
            return None
        if code == Exit.OK:
            return code
        if not self.lost:
            return code if code == Exit.PREEMPTED else self._after_failure(code)
        down_for = self.clock() - min(self.down_since.values())
        if down_for < self.plan.rejoin_timeout:
            wait_links(self.plan.rejoin_timeout - down_for)
        down = self.links_down()
        gone = [w for w in self.lost if self.host_of.get(w) in down]
        if not gone:
            return code  # back in time: relaunched as any lost task is (--max-restarts)
        survivors = [w for w in self.members if w not in gone]
        hosts = ", ".join(f"host{self.host_of[w]}" for w in gone)
        if len(survivors) < self.plan.min_workers:
            self.log(f"[launch] {', '.join(gone)} lost for good ({hosts} unreachable for "
                     f"{self.plan.rejoin_timeout:g} s): {len(survivors)} worker(s) left, below "
                     f"--min-workers={self.plan.min_workers}; stopping (exit "
                     f"{int(Exit.TASK_LOST)}): run the same command when capacity is back to "
                     "resume from the newest checkpoint")
            return Exit.TASK_LOST
        self.members = survivors
        self._change(f"{', '.join(gone)} lost for good ({hosts} unreachable for "
                     f"{self.plan.rejoin_timeout:g} s)", back=False)
        return None

    def _after_failure(self, code: int) -> int | None:
        """A worker failed with its host reachable: relaunched with it (the code, for
        --max-restarts) until it has failed more than --max-restarts times (once,
        with --shrink-at-once); then re-formed without it (``None``), if M remain."""
        if self.failed is None:
            return code
        name, exit_code = self.failed
        count = self.failures[name] = self.failures.get(name, 0) + 1
        if not self.plan.at_once and count <= self.plan.max_restarts:
            return code
        survivors = [w for w in self.members if w != name]
        why = (f"{name} failed {count} time(s) with its host reachable (last exit "
               f"{exit_code}" + (", --shrink-at-once)" if self.plan.at_once else
                                 f", --max-restarts={self.plan.max_restarts})"))
        if len(survivors) < self.plan.min_workers:
            self.log(f"[launch] {why}: {len(survivors)} worker(s) left without it, below "
                     f"--min-workers={self.plan.min_workers}: the job cannot go on without "
                     f"it (exit {code})")
            return code
        self.members = survivors
        self.dropped.append(name)
        self._change(why, back=False)
        return None
