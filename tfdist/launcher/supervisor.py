"""Supervision of one attempt: the poll loop.

The ``Supervisor`` owns the attempt's member processes, through its engine
(``launcher.engine.api.Engine``: start, signal, poll, wait, stop). Each poll it
reaps exits, shows the hooks (fault injection, member restarts, membership) a
``JobState`` snapshot, applies the actions they return, and asks the strategy
kind whether the job's outcome is known (``decide``). The attempts around it
(relaunches, re-formations) are ``launcher.attempts``'; the outcome record
``launcher.outcome``'s.
"""

from __future__ import annotations

import math
import os
import signal
import time

from tfdist import protocol
from tfdist.launcher import policy
from tfdist.launcher.engine.api import Engine, MemberProcess
from tfdist.launcher.state import JobState, RestartMember, SetLink, SignalMember, SlowMember, MemberView
from tfdist.protocol import Exit
from tfdist.strategies.kinds import StrategyKind


def decide(kind: StrategyKind, exits: dict[str, int | None]) -> int | None:
    """The job's exit code once it is known, else ``None`` (pure).

    Only the tasks whose exits the strategy kind says decide count (every
    task of a sync job; the chief under ps, whose servers stop when it is
    gone): the first failure among them decides, else their success.
    """
    # A deciding task ended by a signal (a kill, the OOM killer, its own
    # watchdog giving up on a peer) is, to the job, a lost task: the code
    # its survivors report, and a relaunch resumes from the checkpoint.
    deciding = [Exit.TASK_LOST if code is not None and code < 0 else code
                for name, code in exits.items() if policy.decides(kind, name)]
    failed = [code for code in deciding if code not in (None, 0)]
    if failed:
        return failed[0]
    if deciding and all(code == 0 for code in deciding):
        return 0
    return None


def storage_line(name: str, lines: list[str], relaunches: bool = False) -> str:
    """The launcher's one line for a task that ended with ``Exit.STORAGE`` (pure).

    The cause is read from the task's own ``error:`` line (``protocol``'s
    words); ``relaunches``: whether ``--max-restarts`` would have relaunched
    another failure.
    """
    said = next((line for line in reversed(lines) if line.startswith("error:")), "")
    cause = next((c for c in protocol.STORAGE_CAUSES if c in said),
                 "the disk is full or read-only")
    why = ("not relaunched under --max-restarts" if relaunches else "not relaunched") + \
        ": it would fail again until that is fixed"
    return (f"[launch] {name} exited with code {int(Exit.STORAGE)}: a write into --model-dir "
            f"failed, {cause} (its error line above names the file); {why}. Free space or make "
            "the directory writable, then run the same launch.py command to resume from the "
            "previous checkpoint")


# How long a job whose training ended well waits for its sidecar evaluator
# (--evaluator) to evaluate the final checkpoint and add its history to
# results.json: one evaluation of a test split takes seconds to a minute here,
# and the evaluator itself waits at most a minute for the chief's record.
EVALUATOR_WAIT = 300.0


def evaluator_status(code: int | None) -> dict:
    """What became of a sidecar evaluator, for ``outcome.json`` (pure): ``finished``
    (exit 0), ``failed`` (its own exit code), ``killed`` (by a signal) or ``stopped``
    (still running when the launcher ended the job)."""
    if code is None:
        return {"status": "stopped", "exit_code": None}
    if code < 0:
        return {"status": "killed", "exit_code": code, "signal": signal.Signals(-code).name}
    return {"status": "finished" if code == 0 else "failed", "exit_code": code}


class Supervisor:
    """One attempt of the job: its processes, their exits, the hooks' actions."""

    poll = 0.1  # seconds between polls
    evaluator_wait = EVALUATOR_WAIT

    def __init__(self, kind: StrategyKind, engine: Engine, log=print, grace: float = 5.0,
                 slowdown=None, attempt: int = 0, network=None, relaunches: bool = False):
        self.kind, self.engine, self.log = kind, engine, log
        self.relaunches = relaunches  # --max-restarts has relaunches left
        self.grace, self.slowdown, self.attempt = grace, slowdown, attempt
        self.network = network  # SimulatedHosts, for --partition
        self.members: dict[str, MemberProcess] = {}
        self.exits: dict[str, int | None] = {}
        self.starts: dict[str, int] = {}
        # What stop() must undo whatever happens: tasks hung by SIGSTOP (their
        # pid), hosts whose link is down.
        self.hung: dict[str, int] = {}
        self.links_down: set[int] = set()  # the attempt loop carries them between attempts
        # --min-workers: a host cut off for good stays cut off between
        # attempts (the job re-forms without it); lifted when the job ends.
        self.keep_links = False
        # --evaluator: what became of each sidecar evaluator (evaluator_status),
        # set when the attempt ends.
        self.evaluators: dict[str, dict] = {}

    # --- processes ---------------------------------------------------------------

    def start(self, names) -> None:
        for name in names:
            self._start(name)

    def _start(self, name: str) -> MemberProcess:
        member = self.engine.start(name)
        self.members[name] = member
        self.exits[name] = None
        self.starts[name] = self.starts.get(name, 0) + 1
        if self.slowdown is not None:
            self.slowdown.attach(name, member.proc.pid)
        return member

    def state(self) -> JobState:
        return JobState(tuple(MemberView(n, t.proc.pid, self.exits[n], self.starts[n])
                              for n, t in self.members.items()), self.attempt)

    def reap(self) -> None:
        for name, t in self.members.items():
            if self.exits[name] is None and (code := self.engine.poll(t)) is not None:
                self.exits[name] = code
                self.hung.pop(name, None)
                if code == Exit.STORAGE:
                    t.pump.join(timeout=2)  # its last lines (the error) may still be in the pipe
                    self.log(storage_line(name, t.lines, self.relaunches))
                    continue
                how = f" (killed by {signal.Signals(-code).name})" if code < 0 else ""
                self.log(f"[launch] {name} exited with code {code}{how}")

    def apply(self, action) -> None:
        if isinstance(action, SetLink):
            if self.network is None:
                raise RuntimeError(f"{action} without simulated hosts")
            self.network.set_link(action.host, action.up)
            (self.links_down.discard if action.up else self.links_down.add)(action.host)
            return
        member = self.members.get(action.member)
        if member is None:
            return
        if isinstance(action, SignalMember):
            if self.engine.poll(member) is not None or (
                    action.pid is not None and action.pid != member.proc.pid):
                return  # gone, or already replaced by a restart
            if action.sig == signal.SIGSTOP:
                self.hung[action.member] = member.proc.pid
                if self.slowdown is not None:
                    self.slowdown.hold(action.member, member.proc.pid, held=True)
            self.engine.signal(member, action.sig, group=action.group)
            if action.sig == signal.SIGCONT and self.hung.pop(action.member, None) is not None \
                    and self.slowdown is not None:
                self.slowdown.hold(action.member, member.proc.pid, held=False)
        elif isinstance(action, RestartMember):
            member.pump.join(timeout=5)
            new = self._start(action.member)
            ended = self.engine.poll(new)
            if ended is not None:
                # The engine could not start it again (a Ray task whose node is
                # gone): already ended, so no pid to name.
                self.log(f"[launch] could not restart {action.member}: it ended at once "
                         f"(code {ended})")
            else:
                self.log(f"[launch] restarted {action.member} (pid {new.proc.pid}), same TF_CONFIG"
                         + (f"; {action.note}" if action.note else ""))
        elif isinstance(action, SlowMember):
            if self.slowdown is None:
                raise RuntimeError(f"{action} without a Slowdown")
            self.slowdown.activate(action.member, action.fraction)
            if self.engine.poll(member) is None:
                self.slowdown.attach(action.member, member.proc.pid)
        else:
            raise TypeError(f"unknown action {action!r}")

    def stop(self) -> None:
        """Every task stopped: SIGTERM, then SIGKILL after ``grace``; before
        that, every hung task continued and every downed link brought up."""
        self.lift_all()
        if self.slowdown is not None:
            self.slowdown.resume()  # a stopped process cannot act on SIGTERM
        self.engine.stop(list(self.members.values()), self.grace)

    def lift_all(self) -> None:
        """Undo every hang and partition still on: a stopped process cannot
        act on SIGTERM, and a relaunch needs its links."""
        for name, pid in list(self.hung.items()):
            self.log(f"[launch] {name} (pid {pid}) is still hung: SIGCONT before stopping it")
            member = self.members.get(name)
            if member is not None and member.proc.pid == pid:
                self.engine.signal(member, signal.SIGCONT)  # its engine's way (Ray: the actor)
            else:
                try:
                    os.killpg(pid, signal.SIGCONT)
                except (ProcessLookupError, PermissionError):
                    pass
            del self.hung[name]
        if self.keep_links:
            return
        for host in sorted(self.links_down):
            self.log(f"[launch] host{host}'s link is still down: bringing it up")
            try:
                self.network.set_link(host, True)
            except (OSError, RuntimeError, ValueError) as err:  # the namespaces go with the holders
                self.log(f"[launch] warning: could not bring host{host}'s link up: {err}")
        self.links_down.clear()

    # --- the poll loop -------------------------------------------------------------

    def run(self, timeout: float | None, hooks=()) -> int:
        """Wait for the job's outcome (``timeout`` None: however long it takes); stop
        every task whatever it is."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        try:
            while True:
                self.reap()
                for hook in hooks:
                    for action in hook(self.state()):
                        self.apply(action)
                code = decide(self.kind, self.exits)
                if code is not None:
                    # The outcome is known: a task still hung or cut off
                    # could not checkpoint or see its chief gone.
                    self.lift_all()
                    if code == Exit.PREEMPTED:
                        # Every worker saves at the agreed step and exits by
                        # itself; a SIGTERM now would be read as another notice.
                        self.log("[launch] job preempted: waiting for every task to checkpoint "
                                 "and exit")
                        self.engine.wait(self._training(), self.grace)
                        self.reap()
                    elif code != 0:
                        self.log(f"[launch] job failed (exit {code}); stopping the other tasks")
                    else:
                        # Servers notice the chief is gone and exit on their own.
                        self.engine.wait(self._training(), self.grace)
                        self._wait_evaluators()
                    return code
                if time.monotonic() > deadline:
                    self.log(f"[launch] error: job still running after --timeout={timeout:g}s; "
                             "stopping it")
                    return Exit.TIMEOUT
                time.sleep(self.poll)
        finally:
            self.evaluators = {n: evaluator_status(self.exits[n]) for n in self.members
                               if policy.is_evaluator(n)}
            self.stop()

    def _training(self) -> list[MemberProcess]:
        """The members of the training cluster (the sidecar evaluator is not)."""
        return [m for n, m in self.members.items() if not policy.is_evaluator(n)]

    def _wait_evaluators(self) -> None:
        """Training ended well: a sidecar evaluator still running evaluates the final
        checkpoint and ends by itself; it is given ``evaluator_wait`` seconds."""
        live = [m for n, m in self.members.items()
                if policy.is_evaluator(n) and self.exits[n] is None]
        if not live:
            return
        self.log(f"[launch] training done; waiting up to {self.evaluator_wait:g}s for the "
                 "evaluator to evaluate the final checkpoint")
        self.engine.wait(live, self.evaluator_wait)
        self.reap()
        if any(self.exits[n] is None for n in self.members if policy.is_evaluator(n)):
            self.log("[launch] the evaluator did not finish in time: stopping it (the job's "
                     "outcome is training's)")
