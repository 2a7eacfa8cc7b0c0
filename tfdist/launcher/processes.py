"""Task processes: start, stop, output, pinning, and where each one runs.

A task is one ``train.py`` process. Between fork and exec it is tied to the
launcher's life (``PR_SET_PDEATHSIG``), moved into its simulated host's
network namespace, into its slow-down cgroup, and onto its cores, so all
of that holds from its first instruction and for every thread it starts.
"""

from __future__ import annotations

import ctypes
import glob
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping

from tfdist import protocol
from tfdist.launcher import cgroups
from tfdist.launcher import plan as plans
from tfdist.strategies.kinds import StrategyKind

# Every task runs the installed package's command, from the launcher's own
# directory: relative paths (--model-dir, --data-dir) mean the same on every
# task, and the user's own packages beside them stay importable.
TRAIN = ("-m", "tfdist.cli.train")
CLONE_NEWNET = 0x40000000

_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL("libc.so.6", use_errno=True)
    return _libc


def die_with_parent() -> None:  # runs in the child between fork and exec
    # Linux: if the launcher is killed outright, the kernel kills the task too.
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


@dataclass(frozen=True)
class Placement:
    """Where a task runs: its host's network namespace, its cgroup, its cores."""

    netns: str | None = None  # /proc/<pid>/ns/net of the host's holder process
    cgroup: str | None = None  # a cgroup directory to join before exec (a slowed task)
    memory_cgroup: str | None = None  # ... and one that limits its memory (--memory-limit)
    host_cgroups: tuple[str, ...] = ()  # its host's CPU budget and account (--host-cpus)
    cpus: tuple[int, ...] = ()  # a CPU set of its own (empty: every core)


def child_setup(place: Placement):
    """What runs in a task between fork and exec."""

    def setup():
        die_with_parent()
        if place.netns:
            enter_netns(place.netns)
        if place.cgroup:
            cgroups.join(place.cgroup, os.getpid())
        if place.memory_cgroup:
            cgroups.join(place.memory_cgroup, os.getpid())
        for path in place.host_cgroups:
            cgroups.join(path, os.getpid())
        if place.cpus:
            try:
                os.sched_setaffinity(0, set(place.cpus))
            except OSError:  # a container that forbids it: run unpinned
                pass

    return setup


@dataclass
class MemberProcess:
    name: str
    proc: subprocess.Popen
    pump: threading.Thread
    lines: list[str] = field(default_factory=list)


def _pump(member_name: str, stream, sink, keep: list[str], lock: threading.Lock, on_line=None):
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        keep.append(line)
        with lock:
            sink.write(f"[{member_name}] {line}\n")
            sink.flush()
        if on_line is not None:
            on_line(member_name, line)
    stream.close()


_SINK_LOCK = threading.Lock()  # one for every pump, restarted tasks' too


def start_member(name: str, tf_config: dict | None, command: list[str], env: dict[str, str],
               sink=None, on_line=None, task_env: dict[str, str] | None = None,
               place: Placement | None = None) -> MemberProcess:
    """Start one task; ``task_env`` adds variables under ``env`` (the caller's wins)."""
    sink = sink or sys.stdout
    full_env = {**(task_env or {}), **env}
    full_env.pop("TF_CONFIG", None)
    place = place or Placement()
    if tf_config is not None:
        full_env["TF_CONFIG"] = json.dumps(tf_config)
    proc = subprocess.Popen(
        command, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=child_setup(place),
    )
    keep: list[str] = []
    pump = threading.Thread(target=_pump, args=(name, proc.stdout, sink, keep, _SINK_LOCK, on_line),
                            daemon=True)
    pump.start()
    return MemberProcess(name, proc, pump, keep)


def start_members(members: dict[str, dict | None], command: list[str], env: dict[str, str],
                sink=None, on_line=None, task_envs: dict[str, dict[str, str]] | None = None,
                places: dict[str, Placement] | None = None) -> list[MemberProcess]:
    """One process per task; ``on_line(task, line)`` sees every output line."""
    return [start_member(name, tf_config, command, env, sink, on_line,
                       (task_envs or {}).get(name), (places or {}).get(name))
            for name, tf_config in members.items()]


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    if hasattr(proc, "signal_group"):  # a task on another engine (ray_engine.RayProc)
        proc.signal_group(sig)
        return
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


def stop_members(members: list[MemberProcess], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace``: TF's own SIGTERM handler may ignore the first."""
    live = [t for t in members if t.proc.poll() is None]
    for t in live:
        signal_group(t.proc, signal.SIGTERM)
    wait_all(live, grace)
    for t in members:
        if t.proc.poll() is None:
            signal_group(t.proc, signal.SIGKILL)
        t.proc.wait()
        t.pump.join(timeout=5)


# --- pinning -------------------------------------------------------------------------

@dataclass(frozen=True)
class CoreShare:
    """A task's share of this machine's cores: TensorFlow's thread-pool sizes
    (``env``, set in its environment) and, when it has one, its own CPU set."""

    env: Mapping[str, str]
    cpus: tuple[int, ...] = ()

    def cores(self, total: int) -> int:
        """How many cores the task may use at full speed: its CPU set, else all of them."""
        return len(self.cpus) or max(1, total)


# The environment share_cores sets (TensorFlow's pool sizes).
THREAD_POOL_ENV = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


def share_cores(kind: StrategyKind, members, cpus: int,
                host_cpus: float | None = None) -> dict[str, CoreShare]:
    """Each task's share of this machine's ``cpus`` cores (pure).

    The simulated hosts share one machine: left alone, every task sizes its
    intra-op pool to all the cores, and N workers oversubscribe them N times
    over. Tasks that only serve or dispatch (ps, and the ps chief) get one
    thread and no fixed cores. When the busy tasks fit, each is also pinned
    to cores of its own, as if on a host of its own, which was faster in
    every run (docs/performance.md), unless the kind says its tasks run
    faster unpinned (``pins_busy_tasks``: pipeline stages).

    ``host_cpus`` (``--host-cpus C``): each host's budget is its own quota, so
    a busy task sizes its pool to C cores (at least one thread) and is not
    pinned: the quota, not a core, is its host.
    """
    busy = [n for n in members if n.partition(":")[0] in kind.computing_roles]
    share = max(1, cpus // max(1, len(busy)))
    if host_cpus is not None:
        return {n: CoreShare({"TF_NUM_INTRAOP_THREADS": str(
            max(1, math.ceil(host_cpus)) if n in busy else 1)}) for n in members}
    envs = {n: {"TF_NUM_INTRAOP_THREADS": str(share if n in busy else 1)} for n in members}
    pinned: dict[str, tuple[int, ...]] = {}
    if kind.pins_busy_tasks and 1 < len(busy) <= cpus:
        for i, n in enumerate(busy):
            pinned[n] = tuple(range(i * share, (i + 1) * share))
            # TensorFlow sizes its inter-op pool by the cores a process may
            # use; with one, a ps worker's function waiting on a ps read
            # holds the only thread and the job can deadlock (docs/performance.md).
            envs[n]["TF_NUM_INTEROP_THREADS"] = str(cpus)
    return {n: CoreShare(envs[n], pinned.get(n, ())) for n in members}


# --- commands and saved files -----------------------------------------------------

def task_command(kind: StrategyKind, member, python: str = sys.executable,
                 program: str | None = None) -> list[str]:
    """What every member runs: ``train.py``, or ``program`` (``--program``) with
    the same arguments, so another trainer (the benchmark's tutorial peers)
    runs on the same simulated cluster, TF_CONFIGs, pinning and slow-downs.
    ``member`` (``config.MemberArgs``): its flags, typed; its command line is made here."""
    return [python, *((program,) if program else TRAIN), f"--strategy={kind.name}",
            *member.argv()]


# --- every task's own check, before anything is written ---------------------------------

@dataclass(frozen=True)
class MemberCheck:
    """One task's ``train.py --dry-run``: its exit code, plan, or error line."""

    member: str
    code: int
    plan: dict | None = None
    error: str = ""


def check_tasks(tf_configs: dict[str, dict | None], command: list[str], env: dict[str, str],
                timeout: float = 120.0, full: bool = False) -> list[MemberCheck]:
    """Run every task's own check with its TF_CONFIG, all at once.

    ``--check-only`` checks flags, cluster and run directory without
    TensorFlow, so a bad flag ends the launch before it writes ``launch/``
    or starts anything, with the task's own error line. ``full``: the
    task's ``--dry-run``, which imports TensorFlow to list the GPUs.
    """
    procs = {}
    for name, tf_config in tf_configs.items():
        task_env = {k: v for k, v in env.items() if k != "TF_CONFIG"}
        if tf_config is not None:
            task_env["TF_CONFIG"] = json.dumps(tf_config)
        procs[name] = subprocess.Popen(
            [*command, "--dry-run" if full else "--check-only"], env=task_env, text=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    checks = []
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            checks.append(MemberCheck(name, protocol.Exit.FAILED,
                                    error=f"error: {name}: its check did not answer in "
                                          f"{timeout:g}s"))
            continue
        lines = [line for line in err.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        try:
            plan = json.loads(out) if proc.returncode == 0 else None
        except ValueError:
            plan = None  # e.g. --help: not a plan
        checks.append(MemberCheck(name, proc.returncode, plan if isinstance(plan, dict) else None,
                                (errors or lines or [""])[-1]))
    return checks


def check_launch_dir(launch_dir: str) -> None:
    """Refuse a ``launch/`` (or its ``events/``) that is a symlink: we never write through one."""
    for path in (launch_dir, os.path.join(launch_dir, "events")):
        if os.path.islink(path):
            raise plans.LaunchError(
                f"{path} is a symbolic link; the launcher writes its files there and does not "
                "follow links: remove it, or pass another --model-dir")


def _write_file(path: str, text: str) -> None:
    # Written beside and renamed over: a symlink planted at ``path`` is
    # replaced, never followed.
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as f:
        f.write(text)
    os.replace(tmp, path)


def save_launch_files(launch_dir: str, plan, command: list[str]) -> None:
    """One TF_CONFIG file per task, ``commands.sh`` replaying each task (and
    naming its host), ``hosts.json`` under simulated hosts, and an empty
    progress-event file per task (this launch's events only)."""
    if not isinstance(plan, plans.ClusterPlan):
        plan = plans.ClusterPlan(plan)
    check_launch_dir(launch_dir)
    os.makedirs(os.path.join(launch_dir, "events"), exist_ok=True)
    for name in plan.tf_configs:
        _write_file(protocol.events_path(launch_dir, name), "")
    for name, tf_config in plan.tf_configs.items():
        if tf_config is None:
            continue
        _write_file(os.path.join(launch_dir, plans.tf_config_file(name)),
                    json.dumps(tf_config) + "\n")
    if plan.hosts:
        hosts = {f"host{i}": {"address": plans.host_address(i),
                              "tasks": [n for n, h in plan.host_of.items() if h == i]}
                 for i in range(plan.hosts)}
        protocol.write_json_atomic(os.path.join(launch_dir, "hosts.json"), hosts)
    _write_file(os.path.join(launch_dir, "commands.sh"),
                plans.commands_script(plan, command, launch_dir))


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


# --- data, before entering a namespace without network -----------------------------

def mnist_prepared(data_dir: str) -> bool:
    return bool(glob.glob(os.path.join(os.path.expanduser(data_dir), "mnist", "*",
                                       "dataset_info.json")))


def prepare_data_command(data_dir: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", "tfdist.training.prepare_data", *(["--data-dir", data_dir] if data_dir else [])]


def prepare_data(data_dir: str | None, env: dict[str, str]) -> int:
    """Download MNIST first if tfds would: the namespace has no network.
    ``data_dir``: the members' ``--data-dir`` (None: ``TFDS_DATA_DIR``, else tfds's own)."""
    data_dir = data_dir or env.get("TFDS_DATA_DIR") or ""
    where = data_dir or os.path.join("~", "tensorflow_datasets")
    if mnist_prepared(where):
        return 0
    print(f"[launch] no MNIST in {where}; checking or downloading it before entering the "
          "network namespace, which has no network", flush=True)
    return subprocess.run(prepare_data_command(data_dir), env=env,
                          stdin=subprocess.DEVNULL).returncode


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


def running_with(marker: str) -> list[str]:
    """Live processes (zombies left out) whose command line contains ``marker``
    (e.g. a model dir), as ``"pid: command"``: what a finished job left behind.
    The soak and the tests ask it; this process is never counted."""
    return [f"{pid}: {cmd}" for pid, cmd, _ in live_processes() if marker in cmd]


def quote(command: list[str]) -> str:
    return shlex.join(command)
