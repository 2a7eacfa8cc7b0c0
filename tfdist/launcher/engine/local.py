"""The local engine: every member a process of this host.

A member is one ``tfdist-train`` process. Between fork and exec it is tied to
the launcher's life (``PR_SET_PDEATHSIG``), moved into its simulated host's
network namespace, into its slow-down and memory cgroups, and onto its cores
(``Placement``, built for each member by the attempt loop from the machine's
objects and handed in as ``place``), so all of that holds from its first
instruction and for every thread it starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from tfdist import linux
from tfdist.launcher import files
from tfdist.launcher.config import LaunchConfig
from tfdist.launcher.membership import HostMembership
from tfdist.launcher.engine.api import SINK_LOCK, Engine, Formation, MemberProcess, Placement
from tfdist.protocol import Exit

# Every member runs the installed package's command, from the launcher's own
# directory: relative paths (--model-dir, --data-dir) mean the same on every
# member, and the user's own packages beside them stay importable.
TRAIN = ("-m", "tfdist.cli.train")


def member_command(config: LaunchConfig, formation: Formation,
                   python: str = sys.executable) -> list[str]:
    """What every member runs: ``train.py``, or ``--program`` with the same arguments,
    so another trainer (the benchmark's tutorial peers) runs on the same simulated
    cluster, TF_CONFIGs, pinning and slow-downs. Its flags are made here, from the
    typed ones (``MemberArgs.argv``)."""
    program = config.program
    return [python, *((program,) if program else TRAIN), f"--strategy={config.kind.name}",
            *formation.member.argv()]


def child_setup(place: Placement):
    """What runs in a member between fork and exec."""

    def setup():
        linux.die_with_parent()
        if place.netns:
            linux.enter_netns(place.netns)
        for path in (place.cgroup, place.memory_cgroup, *place.host_cgroups):
            if path:
                linux.join_cgroup(path, os.getpid())
        if place.cpus:
            try:
                os.sched_setaffinity(0, set(place.cpus))
            except OSError:  # a container that forbids it: run unpinned
                pass

    return setup


def _pump(member_name: str, stream, sink, keep: list[str], on_line=None):
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        keep.append(line)
        with SINK_LOCK:
            sink.write(f"[{member_name}] {line}\n")
            sink.flush()
        if on_line is not None:
            on_line(member_name, line)
    stream.close()


def start_member(name: str, tf_config: dict | None, command: list[str], env: dict[str, str],
                 sink=None, member_env: dict[str, str] | None = None,
                 place: Placement | None = None) -> MemberProcess:
    """Start one member; ``member_env`` adds variables under ``env`` (the caller's wins)."""
    sink = sink or sys.stdout
    full_env = {**(member_env or {}), **env}
    full_env.pop("TF_CONFIG", None)
    if tf_config is not None:
        full_env["TF_CONFIG"] = json.dumps(tf_config)
    proc = subprocess.Popen(
        command, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=child_setup(place or Placement()),
    )
    keep: list[str] = []
    pump = threading.Thread(target=_pump, args=(name, proc.stdout, sink, keep), daemon=True)
    pump.start()
    return MemberProcess(name, proc, pump, keep)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_all(members: list[MemberProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for t in members:
        try:
            t.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def stop_members(members: list[MemberProcess], grace: float, group_signal=signal_group) -> None:
    """SIGTERM, then SIGKILL after ``grace``: TF's own SIGTERM handler may ignore the first."""
    live = [t for t in members if t.proc.poll() is None]
    for t in live:
        group_signal(t.proc, signal.SIGTERM)
    wait_all(live, grace)
    for t in members:
        if t.proc.poll() is None:
            group_signal(t.proc, signal.SIGKILL)
        t.proc.wait()
        t.pump.join(timeout=5)


class LocalEngine(Engine):
    """Members as processes of this host, each placed where its formation says (a
    ``Placement``: its simulated host, cgroups and cores), on ``hosts`` (the
    simulated hosts, ``machine.network.SimulatedHosts``, or ``None``: loopback)."""

    def __init__(self, config: LaunchConfig, hosts=None):
        self.config, self.hosts = config, hosts
        self.link: dict | None = None  # the measured link, under --link-rate
        self.env: dict[str, str] = {}
        self.scratch: str | None = None
        self.formation: Formation | None = None

    def open(self, log) -> int | None:
        config = self.config
        plan, launch_dir = config.plan, config.launch_dir
        if self.hosts is not None:
            link = self.hosts.build(plan, config.link_rate, log)
            if link is False:
                return Exit.FAILED
            self.link = link
        command = member_command(config, Formation(plan.tf_configs, config.member))
        try:
            files.save_launch_files(launch_dir, plan, command)
        except OSError as err:
            log(f"[launch] error: could not write the launch files into {launch_dir!r} "
                f"({err.strerror or err}: {err.filename}); nothing was started. Free space or "
                "make the directory writable, then run the same command again")
            return Exit.STORAGE
        log(f"[launch] {config.kind.name}: {', '.join(plan.names)}; TF_CONFIGs in "
            f"{launch_dir}/")
        self.env = dict(os.environ)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        # Every member's temporary files (a multiworker worker's private
        # checkpoints, the preemption counter) go under one directory of this
        # job's, removed when the job ends: a member killed mid-run cannot clean
        # up after itself.
        self.scratch = tempfile.mkdtemp(prefix="tfdist-job-")
        self.env["TMPDIR"] = self.scratch
        return None

    def new_attempt(self, attempt: int, formation: Formation) -> None:
        self.formation = formation

    def start(self, name: str) -> MemberProcess:
        formation = self.formation
        return start_member(name, formation.tf_configs[name],
                            member_command(self.config, formation), self.env,
                            member_env=formation.member_env(name), place=formation.place(name))

    def signal(self, member: MemberProcess, sig: int, group: bool = True) -> None:
        if group:
            signal_group(member.proc, sig)
        else:
            member.proc.send_signal(sig)

    def poll(self, member: MemberProcess) -> int | None:
        return member.proc.poll()

    def wait(self, members: list[MemberProcess], timeout: float) -> None:
        wait_all(members, timeout)

    def stop(self, members: list[MemberProcess], grace: float) -> None:
        stop_members(members, grace)

    def membership(self, plan, event_paths: list[str], record_path: str | None, log):
        config = self.config
        return HostMembership(plan, config.names, dict(config.plan.host_of), event_paths,
                              log, record_path=record_path, live=config.kind.asynchronous)

    def reads_memory(self) -> bool:
        return True

    def close(self) -> None:
        if self.hosts is not None:
            self.hosts.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
