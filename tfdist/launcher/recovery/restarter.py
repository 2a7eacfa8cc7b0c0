"""A supervisor hook that restarts a dead (or reported stuck) worker after a delay, at most
``MAX_MEMBER_RESTARTS`` times, as a cluster manager would."""

from __future__ import annotations

import signal
import time

from tfdist import protocol
from tfdist.launcher.recovery.faults import MAX_MEMBER_RESTARTS
from tfdist.launcher.state import JobState, RestartMember, SignalMember

class MemberRestarter:
    """Restarts a dead worker (of a kind whose workers may rejoin) after a delay.

    Under ps the coordinator waits for a lost worker to come back at the same
    address, and gives it work again once it does.
    """

    def __init__(self, delay: float, log=print, limit: int = MAX_MEMBER_RESTARTS,
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
                    self._stuck[peer] = event.member
        actions = []
        for name, by in list(self._stuck.items()):
            view = state.member(name)
            del self._stuck[name]
            if view is None or not view.running or view.pid in self._killed \
                    or not self.restartable(name) or self.restarts.get(name, 0) >= self.limit:
                continue
            self._killed.add(view.pid)
            self.log(f"[launch] {name} (pid {view.pid}) is stuck ({by} found it answering "
                     "nothing for --stuck-timeout): killing it to restart it, as a cluster "
                     "manager's liveness check would")
            actions.append(SignalMember(name, signal.SIGKILL, group=True, pid=view.pid))
        return actions

    def __call__(self, state: JobState) -> list:
        now, actions = self.clock(), self._stuck_kills(state)
        for t in state.members:
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
            actions.append(RestartMember(t.name, f"restart {self.restarts[t.name]} of at most "
                                                f"{self.limit}"))
        return actions


# --- slow-downs ------------------------------------------------------------------------------
