"""Each task's peak resident memory, sampled by the launcher while the job runs.

The kernel keeps a process's high-water mark of resident memory (``VmHWM`` in
``/proc/<pid>/status``). The launcher reads it at every poll, so the figure
survives however the task ends: a ps task is stopped by the launcher, not by
itself, and a killed task reports nothing of its own. The last sample of a
task can trail its true peak only by what it grew in its final poll interval
(0.1 s), which the high-water mark makes small: it never goes down.
"""

from __future__ import annotations

from launcher.state import JobState


def vm_hwm_bytes(pid: int, proc: str = "/proc") -> int | None:
    """The peak resident set of process ``pid`` in bytes, or ``None`` (gone, unreadable)."""
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    value, unit = line.split()[1:3]
                    return int(value) * {"kB": 1024, "mB": 1 << 20, "gB": 1 << 30}.get(unit, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakMemory:
    """A launcher hook that only watches: the largest ``VmHWM`` of each task name,
    over its restarts and the job's relaunches (each a process of its own)."""

    def __init__(self, read=vm_hwm_bytes):
        self.read = read
        self.peaks: dict[str, int] = {}

    def __call__(self, state: JobState) -> tuple:
        for task in state.tasks:
            if task.running and (value := self.read(task.pid)) is not None:
                self.peaks[task.name] = max(value, self.peaks.get(task.name, 0))
        return ()

    def describe(self) -> str:
        return ", ".join(f"{name} {value / 2**20:.0f} MiB" for name, value in self.peaks.items())
