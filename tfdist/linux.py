"""TensorFlow-free Linux calls the launcher and training share; imports nothing of the project.

A process's peak resident memory (``VmHWM`` of ``/proc/<pid>/status``: the one
reader, for the launcher's per-member peaks and a member's own), the live
processes (``/proc``), and what runs in a child between fork and exec: tied to
its parent's life (``PR_SET_PDEATHSIG``), moved into a network namespace
(``setns``) or a cgroup.
"""

from __future__ import annotations

import ctypes
import os
import signal

CLONE_NEWNET = 0x40000000
_UNITS = {"kB": 1024, "mB": 1 << 20, "gB": 1 << 30}

_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL("libc.so.6", use_errno=True)
    return _libc


def die_with_parent() -> None:  # runs in the child between fork and exec
    # Linux: if the launcher is killed outright, the kernel kills the child too.
    try:
        libc().prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def enter_netns(path: str) -> None:
    """Join the network namespace at ``path`` (``/proc/<pid>/ns/net``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc().setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def join_cgroup(path: str, pid: int) -> None:
    """Move process ``pid`` into the cgroup ``path`` (cgroup v1: all its threads)."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(pid))


# --- memory ---------------------------------------------------------------------------

def vm_hwm(status: str) -> int | None:
    """The ``VmHWM`` of a ``/proc/<pid>/status`` text, in bytes (pure)."""
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            try:
                value, unit = line.split()[1:3]
                return int(value) * _UNITS.get(unit, 1)
            except (ValueError, IndexError):
                return None
    return None


def vm_hwm_bytes(pid: int | str, proc: str = "/proc") -> int | None:
    """The peak resident set of process ``pid`` (or ``"self"``) in bytes, or ``None``
    (gone, unreadable)."""
    try:
        with open(f"{proc}/{pid}/status") as f:
            return vm_hwm(f.read())
    except OSError:
        return None


# --- processes ------------------------------------------------------------------------

def live_processes(environ: bool = False):
    """``(pid, command line, environment entries or None)`` of every live process
    (zombies and this one left out): the one ``/proc`` scan the soak and the
    tests ask."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            env = None
            if environ:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
        except (OSError, IndexError):
            continue
        if state != "Z":
            yield int(pid), cmd, env
