"""cgroups (v1): the one module that creates, joins and removes them.

CPU quotas (``cpu``): ``slowdown.Slowdown`` makes one per slowed task; a task
joins its cgroup between fork and exec (``engine.local.child_setup``), or,
already running, when a slow-down starts; either way through :func:`join`.
Memory limits (``memory``): ``memory.MemoryLimits`` makes one per limited
task (``launch.py --memory-limit``), joined between fork and exec.
Host budgets (``cpu`` and ``cpuacct``): ``hostcpus.HostCpus`` makes one of
each per simulated host (``launch.py --host-cpus``), joined between fork and
exec by every member on that host.
"""

from __future__ import annotations

import os
import signal
import time

from tfdist import linux

CFS_PERIOD_US = 100_000
CGROUP_PREFIX = "showcase-"


def cpu_cgroup_root(mounts: str = "/proc/self/mounts", own: str = "/proc/self/cgroup") -> str | None:
    """The directory of this process's cgroup in the v1 ``cpu`` hierarchy, or ``None``."""
    return cgroup_root("cpu", mounts, own)


def cgroup_root(controller: str, mounts: str = "/proc/self/mounts",
                own: str = "/proc/self/cgroup") -> str | None:
    """The directory of this process's cgroup in the v1 ``controller`` hierarchy, or ``None``."""
    try:
        with open(mounts) as f:
            lines = f.read().splitlines()
        with open(own) as f:
            groups = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup" and controller in parts[3].split(","):
            mount = parts[1]
            for g in groups:
                _, controllers, path = g.split(":", 2)
                if controller in controllers.split(","):
                    return os.path.join(mount, path.lstrip("/"))
            return mount
    return None


def cgroup_problem(root: str | None = None) -> str | None:
    """Why this process cannot make a CPU-quota cgroup, or ``None`` (it tries one)."""
    root = root or cpu_cgroup_root()
    if root is None:
        return "no cgroup v1 cpu controller is mounted"
    if not os.path.exists(os.path.join(root, "cpu.cfs_quota_us")):
        return f"{root} has no cpu.cfs_quota_us"
    probe = os.path.join(root, f"{CGROUP_PREFIX}probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        try:
            with open(os.path.join(probe, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(CFS_PERIOD_US))
        finally:
            os.rmdir(probe)
    except OSError as err:
        return f"cannot create a cgroup in {root}: {err.strerror}"
    return None


def quota_us(fraction: float, cores: int, period_us: int = CFS_PERIOD_US) -> int:
    """CPU time per period for ``fraction`` of ``cores`` cores (pure; the kernel's minimum is 1 ms)."""
    return max(1000, int(round(fraction * cores * period_us)))


def create(path: str, quota: int, period_us: int = CFS_PERIOD_US) -> None:
    """Make (or keep) the cgroup ``path`` with ``quota`` us of CPU time per period."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
        f.write(str(period_us))
    with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
        f.write(str(quota))


def memory_problem(root: str | None) -> str | None:
    """Why this process cannot make a memory-limit cgroup under ``root``, or ``None`` (it tries one)."""
    if root is None:
        return "no cgroup v1 memory controller is mounted"
    probe = os.path.join(root, f"{CGROUP_PREFIX}probe-{os.getpid()}")
    try:
        create_memory(probe, 1 << 30)
        os.rmdir(probe)
    except OSError as err:
        return f"cannot create a memory cgroup in {root}: {err.strerror}"
    return None


def create_memory(path: str, limit_bytes: int) -> None:
    """Make the cgroup ``path`` whose processes may hold ``limit_bytes`` of memory, swap
    included (where the kernel accounts swap): past it the kernel's OOM killer ends one."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit_bytes))
    memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
    if os.path.exists(memsw):  # else a limited task could page out to swap instead
        with open(memsw, "w") as f:
            f.write(str(limit_bytes))


def max_usage(path: str) -> int | None:
    """The most memory the cgroup ``path`` was charged at once, in bytes: its
    processes' own pages (a shared library's pages are charged to whoever read
    them first, so this is what its limit compares with, not the resident set)."""
    try:
        with open(os.path.join(path, "memory.max_usage_in_bytes")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def oom_kills(path: str) -> int:
    """How many processes the kernel's OOM killer ended in the cgroup ``path``
    (``memory.oom_control``'s ``oom_kill``; 0 where it is not counted)."""
    try:
        with open(os.path.join(path, "memory.oom_control")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cpu_usage_seconds(path: str) -> float | None:
    """The CPU time the processes of the ``cpuacct`` cgroup ``path`` used, in seconds
    (exited ones included), or ``None`` where it cannot be read."""
    try:
        with open(os.path.join(path, "cpuacct.usage")) as f:
            return int(f.read()) / 1e9
    except (OSError, ValueError):
        return None


def throttled_seconds(path: str) -> float | None:
    """How long the ``cpu`` cgroup ``path``'s processes were held back by its quota
    (``cpu.stat``'s ``throttled_time``), in seconds, or ``None``."""
    try:
        with open(os.path.join(path, "cpu.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "throttled_time":
                    return int(value) / 1e9
    except (OSError, ValueError):
        pass
    return None


def join(path: str, pid: int) -> None:
    """Move process ``pid`` into the cgroup ``path`` (cgroup v1: all its threads); the
    one writer is ``tfdist.linux.join_cgroup``, which a member's placement also calls
    between fork and exec."""
    linux.join_cgroup(path, pid)


def remove(path: str, timeout: float = 10.0, log=print) -> None:
    """Remove one of our cgroups, ending whatever is still in it.

    The tasks have been reaped, but a child they started (a watchdog) can
    still be inside, exiting at the cgroup's slowed pace: the quota is
    lifted first and such leftovers are killed, as no process may outlive
    the launcher.
    """
    try:
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
            f.write("-1")
    except OSError:
        pass
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as err:
            if time.monotonic() > deadline:
                log(f"[launch] warning: could not remove cgroup {path}: {err}")
                return
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                leftovers = [int(pid) for pid in f.read().split()]
        except OSError:
            leftovers = []
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


