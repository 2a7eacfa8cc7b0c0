"""The engine contract: one interface for starting and supervising members.

The supervisor and the attempt loop (``launcher.attempts``) use only this: an
``Engine`` opens the job's ground (the local engine its simulated hosts and
launch files, Ray its cluster), places each attempt's ``Formation``, starts one
member at a time (the member's command line is made there, once, from its typed
flags), signals, polls, waits for and stops members, gives the job its
membership view under ``--min-workers``, and closes. Nothing outside an engine
asks which engine it is: a method every engine implements answers instead
(``tests/launcher/test_engines.py`` fails if one lacks a method).
"""

from __future__ import annotations

import abc
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Callable, Mapping

from tfdist.launcher.config import MemberArgs

# One lock for every engine's output pumps (restarted members' too): a line is whole.
SINK_LOCK = threading.Lock()


@dataclass
class MemberProcess:
    """One running member: its process handle (a ``Popen``, or a Ray engine's
    ``RayProc`` with the same ``pid``/``poll``/``wait``), the thread relaying its
    output, and the lines it printed."""

    name: str
    proc: subprocess.Popen
    pump: threading.Thread
    lines: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Placement:
    """Where a member runs on this machine: its host's network namespace, its cgroups,
    its cores (the local engine applies it between fork and exec)."""

    netns: str | None = None  # /proc/<pid>/ns/net of the host's holder process
    cgroup: str | None = None  # a cgroup directory to join before exec (a slowed member)
    memory_cgroup: str | None = None  # ... and one that limits its memory (--memory-limit)
    host_cgroups: tuple[str, ...] = ()  # its host's CPU budget and account (--host-cpus)
    cpus: tuple[int, ...] = ()  # a CPU set of its own (empty: every core)


def _nowhere(name: str) -> Placement:
    return Placement()


@dataclass(frozen=True)
class Formation:
    """What each member of an attempt starts with: its TF_CONFIG (an engine that
    places members itself builds its own), every member's flags, typed, each
    member's own environment (thread pools, its events file), where it runs on
    this machine (``place``, asked at each start), and the environment added for
    every member (the elastic record's path)."""

    tf_configs: Mapping[str, dict | None]
    member: MemberArgs
    envs: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    place: Callable[[str], Placement] = _nowhere
    env: Mapping[str, str] = field(default_factory=dict)

    def member_env(self, name: str) -> dict[str, str]:
        return {**self.envs.get(name, {}), **self.env}


class Engine(abc.ABC):
    """Starts and supervises the members of a formation (see the module)."""

    # The simulated hosts the members run on (``machine.network.SimulatedHosts``:
    # partitions, byte counters, link traces), or None; the link measured at open.
    hosts = None
    link: dict | None = None

    @abc.abstractmethod
    def open(self, log) -> int | None:
        """Ready the job's ground before the first attempt: ``None``, or the exit code to
        end with (the machine cannot; nothing started)."""

    @abc.abstractmethod
    def new_attempt(self, attempt: int, formation: Formation) -> None:
        """This attempt's members start from ``formation`` (an engine that places
        members places them anew)."""

    @abc.abstractmethod
    def start(self, name: str) -> MemberProcess:
        """Start member ``name`` of the current formation (again, for a restart)."""

    @abc.abstractmethod
    def signal(self, member: MemberProcess, sig: int, group: bool = True) -> None:
        """Send ``sig`` to the member's process (``group``: its whole process group)."""

    @abc.abstractmethod
    def poll(self, member: MemberProcess) -> int | None:
        """The member's exit code, or ``None`` while it runs."""

    @abc.abstractmethod
    def wait(self, members: list[MemberProcess], timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for ``members`` to end by themselves."""

    @abc.abstractmethod
    def stop(self, members: list[MemberProcess], grace: float) -> None:
        """SIGTERM, then SIGKILL after ``grace``: every member ended and reaped."""

    @abc.abstractmethod
    def membership(self, plan, event_paths: list[str], record_path: str | None, log):
        """``--min-workers``: the hook that owns which workers form the cluster
        (``launcher.membership.Membership``), as this engine's members come and go."""

    @abc.abstractmethod
    def reads_memory(self) -> bool:
        """Whether members' memory (``VmHWM``) can be read from this host's ``/proc``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what ``open`` and the attempts took (whatever happened)."""
