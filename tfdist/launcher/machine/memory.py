"""Each task's memory: its peak, sampled while the job runs, and its limit.

**Limits** (``--memory-limit ROLE=SIZE``): each task of that role runs in a
memory cgroup of its own (``cgroups.create_memory``), as a container or a
Slurm job step with a memory limit would: past it, the kernel's OOM killer
ends the task. That is how a model too large for one ps is shown to train
when split over several.

**Peaks**:
The kernel keeps a process's high-water mark of resident memory (``VmHWM`` in
``/proc/<pid>/status``). The launcher reads it at every poll, so the figure
survives however the task ends: a ps task is stopped by the launcher, not by
itself, and a killed task reports nothing of its own. The last sample of a
task can trail its true peak only by what it grew in its final poll interval
(0.1 s), which the high-water mark makes small: it never goes down.
"""

from __future__ import annotations

import os
import re

from tfdist.launcher.machine import cgroups
from tfdist.linux import vm_hwm_bytes
from tfdist.launcher.state import JobState

UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
# A TensorFlow process with a tiny model holds about 650 MB resident, not all
# of it charged to its cgroup (shared library pages): none starts below this.
MIN_LIMIT = 256 << 20


class MemoryLimitError(ValueError):
    """A bad --memory-limit: ``str(err)`` is the one line shown (exit 2)."""


def parse_size(text: str) -> int:
    """``1200M``, ``1.5G``, ``800m``, ``1073741824`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]?)i?[bB]?\s*", text)
    if not m:
        raise MemoryLimitError(f"--memory-limit size {text!r} is not a size; use e.g. 1200M or 1.5G")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def parse_limits(specs: list[str] | None, roles: dict[str, list[str]]) -> dict[str, int]:
    """``["ps=1200M", ...]`` -> each limited task's bytes, for the job's ``roles``
    (``{role: [task names]}``); MemoryLimitError for anything that cannot apply."""
    out: dict[str, int] = {}
    for spec in specs or []:
        role, eq, size = spec.partition("=")
        role = role.strip()
        if not eq or role not in roles:
            raise MemoryLimitError(
                f"--memory-limit {spec!r}: use ROLE=SIZE with a role of this job "
                f"({', '.join(roles)}), e.g. ps=1200M")
        limit = parse_size(size)
        if limit < MIN_LIMIT:
            raise MemoryLimitError(
                f"--memory-limit {spec!r} is {limit / 2**20:.0f} MiB, below the {MIN_LIMIT >> 20} MiB "
                "a TensorFlow task needs to start; raise it")
        for name in roles[role]:
            out[name] = limit
    return out


def limits_problem() -> str | None:
    """Why this process cannot limit a task's memory, or ``None`` (it tries one cgroup)."""
    return cgroups.memory_problem(cgroups.cgroup_root("memory"))


class MemoryLimits:
    """A memory cgroup per limited task, for the launcher's life; ``close`` removes them."""

    def __init__(self, limits: dict[str, int], log=print, root: str | None = None):
        self.limits, self.log = dict(limits), log
        self.root = root or cgroups.cgroup_root("memory")
        self.paths: dict[str, str] = {}
        # launch.py checked that memory cgroups can be made (limits_problem)
        # before anything started.
        for name, limit in self.limits.items():
            path = os.path.join(self.root, f"{cgroups.CGROUP_PREFIX}{os.getpid()}-mem-"
                                           f"{name.replace(':', '-')}")
            self.paths[name] = path  # removed by close() even if creating it fails
            cgroups.create_memory(path, limit)
        if limits:
            log("[launch] memory limits: " + ", ".join(
                f"{n} {b / 2**20:.0f} MiB" for n, b in self.limits.items()))

    def cgroup_for(self, name: str) -> str | None:
        return self.paths.get(name)

    def record(self) -> dict[str, dict]:
        """Each limited task's limit and the most its cgroup was charged (outcome.json)."""
        return {n: {"limit_bytes": self.limits[n], "max_usage_bytes": cgroups.max_usage(p)}
                for n, p in self.paths.items()}

    def oom_killed(self) -> dict[str, int]:
        """Each limited task the OOM killer ended, and how many times."""
        counts = {n: cgroups.oom_kills(p) for n, p in self.paths.items()}
        return {n: c for n, c in counts.items() if c}

    def close(self) -> None:
        for path in self.paths.values():
            cgroups.remove(path, log=self.log)
        self.paths.clear()


class PeakMemory:
    """A launcher hook that only watches: the largest ``VmHWM`` of each task name,
    over its restarts and the job's relaunches (each a process of its own)."""

    def __init__(self, read=vm_hwm_bytes):
        self.read = read
        self.peaks: dict[str, int] = {}

    def __call__(self, state: JobState) -> tuple:
        for member in state.members:
            if member.running and (value := self.read(member.pid)) is not None:
                self.peaks[member.name] = max(value, self.peaks.get(member.name, 0))
        return ()

    def describe(self) -> str:
        return ", ".join(f"{name} {value / 2**20:.0f} MiB" for name, value in self.peaks.items())
