"""``Slowdown``: a task at a fraction of its speed from outside the process, as a slower or
busier host would: a cgroup v1 ``cpu`` controller CFS quota (``launcher/machine/cgroups.py``), or
where cgroups cannot be written a SIGSTOP/SIGCONT duty cycle; never code inside the
training step."""

from __future__ import annotations

import os
import signal
import threading
import time

from tfdist.launcher.machine import cgroups

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

    def activate(self, member: str, fraction: float) -> None:
        self.active[member] = fraction
        if self.method == "cgroup":
            path = self.cgroups.get(member) or os.path.join(
                self.root, f"{cgroups.CGROUP_PREFIX}{os.getpid()}-{member.replace(':', '-')}")
            self.cgroups[member] = path  # removed by close() even if creating it fails
            cgroups.create(path, cgroups.quota_us(fraction, self.cores.get(member, 1)))
        elif self._thread is None:
            self._thread = threading.Thread(target=self._duty_cycle, daemon=True)
            self._thread.start()

    def describe(self, member: str) -> str:
        fraction = self.active[member]
        if self.method == "cgroup":
            quota = cgroups.quota_us(fraction, self.cores.get(member, 1))
            return (f"{member} at {fraction:.0%}: CFS quota {quota}"
                    f" us per {cgroups.CFS_PERIOD_US} us ({self.cores.get(member, 1)} core(s)) in "
                    f"{self.cgroups[member]}")
        return f"{member} at {fraction:.0%}: SIGCONT {fraction:.0%} of every {DUTY_PERIOD * 1000:.0f} ms"

    def cgroup_for(self, member: str) -> str | None:
        """The cgroup a (re)starting task joins before exec, if it is slowed."""
        return self.cgroups.get(member) if member in self.active else None

    def attach(self, member: str, pid: int) -> None:
        """Slow the running process ``pid`` of ``task`` (a no-op for a task not slowed)."""
        if member not in self.active:
            return
        if self.method == "cgroup":
            cgroups.join(self.cgroups[member], pid)
        else:
            with self._lock:
                self._pids[member] = pid
            # Stopped until the next cycle continues it: a process attached
            # mid-cycle would otherwise run free for up to a whole period.
            _killpg(pid, signal.SIGSTOP)

    def hold(self, member: str, pid: int, held: bool) -> None:
        """A hung task leaves the duty cycle (which would continue it) and
        rejoins it when the hang is lifted. (A cycle under way ends with its
        SIGSTOP, so the task stays stopped.) A cgroup quota needs nothing."""
        if self.method != "signals" or member not in self.active:
            return
        with self._lock:
            if held:
                self._pids.pop(member, None)
            else:
                self._pids[member] = pid

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
