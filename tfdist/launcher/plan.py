"""The cluster as data (pure): tasks, their hosts, addresses and ports.

Everything here comes from the strategy kind (``computing_roles``) and the
launcher's policy on it (``policy.layout``);
nothing compares strategy names, opens a socket or touches a file.
"""

from __future__ import annotations

import math
import shlex
import socket
from dataclasses import dataclass, field
from typing import Mapping

from tfdist.launcher import policy
from tfdist.protocol import ConfigError
from tfdist.strategies.kinds import StrategyKind


class LaunchError(ConfigError):
    """Bad launcher input: one ``error:`` line, exit 2, nothing written."""


def role_counts(kind: StrategyKind, workers: int, ps: int = 0,
                chief: bool = False) -> dict[str, int]:
    """Tasks per role (``{}``: one process without TF_CONFIG), from the kind."""
    try:
        counts = policy.layout(kind, workers, ps, bool(chief))
    except ConfigError as err:
        raise LaunchError(str(err)) from None
    return {role: n for role, n in counts.items() if n}


def member_names(kind: StrategyKind, workers: int, ps: int = 0, chief: bool = False) -> list[str]:
    counts = role_counts(kind, workers, ps, chief)
    if not counts:
        return ["local:0"]
    return [f"{role}:{i}" for role, n in counts.items() for i in range(n)]


def member_count(kind: StrategyKind, workers: int, ps: int, chief: bool) -> int:
    return len(member_names(kind, workers, ps, chief))


def _tf_configs(cluster: dict[str, list[str]]) -> dict[str, dict]:
    return {
        f"{role}:{i}": {"cluster": cluster, "task": {"type": role, "index": i}}
        for role, addrs in cluster.items()
        for i in range(len(addrs))
    }


def tf_configs_at(addresses: dict[str, str]) -> dict[str, dict]:
    """Every task's TF_CONFIG from its ``host:port``, keyed ``role:index`` in task
    order: the same records ``build_cluster`` writes, for addresses found at run
    time (``launcher.engine.ray_engine``: each actor binds its own port)."""
    cluster: dict[str, list[str]] = {}
    for name, address in addresses.items():
        cluster.setdefault(name.partition(":")[0], []).append(address)
    return _tf_configs(cluster)


def build_cluster(kind: StrategyKind, workers: int, ps: int = 0, ports: list[int] | None = None,
                  host: str = "localhost", chief: bool | None = None) -> dict[str, dict | None]:
    """TF_CONFIG for every task on one host, keyed ``role:index`` (``None``: no TF_CONFIG)."""
    counts = role_counts(kind, workers, ps, bool(chief))
    if not counts:
        return {"local:0": None}
    needed = sum(counts.values())
    if ports is None or len(ports) < needed:
        raise LaunchError(f"{needed} ports are needed, received {ports!r}")
    it = iter(ports)
    return _tf_configs({role: [f"{host}:{next(it)}" for _ in range(n)]
                        for role, n in counts.items()})


# --- simulated hosts ------------------------------------------------------------

# A private range, used only inside the launcher's own network namespace.
SUBNET = "10.77.0"
PREFIX = 24
BRIDGE_ADDRESS = f"{SUBNET}.1"
FIRST_HOST = 11  # host i is 10.77.0.(11 + i): host0 .11, host1 .12, ...
MAX_HOSTS = 64
# The port TensorFlow's examples use; the k-th task on a host takes 2222 + k.
BASE_PORT = 2222


def host_address(index: int) -> str:
    if not 0 <= index < MAX_HOSTS:
        raise LaunchError(f"host {index} is outside 0..{MAX_HOSTS - 1}")
    return f"{SUBNET}.{FIRST_HOST + index}"


def place_members(kind: StrategyKind, names: list[str], hosts: int) -> dict[str, int]:
    """Which host (index) each task runs on (pure).

    The tasks that compute (the kind's ``computing_roles``) are spread one per
    host, round-robin. Tasks that only coordinate or serve (the ps chief, ps
    tasks) go round-robin over the hosts the computing tasks leave free, or
    all on host 0 when they leave none; the computing tasks then take hosts
    1..N-1. So ``ps --workers 2 --ps 1 --hosts 3`` is chief and ps on host 0,
    worker:0 on host 1, worker:1 on host 2; ``multiworker --workers 2
    --hosts 2`` is one worker per host.
    """
    if hosts < 1:
        raise LaunchError(f"--hosts={hosts}; use 1 or more")
    if hosts > len(names):
        raise LaunchError(
            f"--hosts={hosts}, but this cluster has {len(names)} task(s) ({', '.join(names)}); "
            "a host without a task adds nothing: use at most one host per task"
        )
    if hosts > MAX_HOSTS:
        raise LaunchError(f"--hosts={hosts}; at most {MAX_HOSTS}")
    computing = kind.computing_roles
    busy = [n for n in names if n.partition(":")[0] in computing]
    quiet = [n for n in names if n not in busy]
    if not quiet or hosts == 1:
        return {n: i % hosts for i, n in enumerate(names)}
    free = hosts - len(busy)
    if free >= 1:
        quiet_hosts, busy_hosts = list(range(free)), list(range(free, hosts))
    else:
        quiet_hosts, busy_hosts = [0], list(range(1, hosts))
    placed = {n: quiet_hosts[i % len(quiet_hosts)] for i, n in enumerate(quiet)}
    placed.update({n: busy_hosts[i % len(busy_hosts)] for i, n in enumerate(busy)})
    return {n: placed[n] for n in names}


@dataclass(frozen=True)
class ClusterPlan:
    """The whole simulated cluster: one TF_CONFIG per task and, with hosts, where it runs."""

    tf_configs: dict[str, dict | None]
    hosts: int = 0  # 0: every task on this host's loopback (no simulated hosts)
    host_of: dict[str, int] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return list(self.tf_configs)

    def where(self, member: str) -> str | None:
        """``host1 (10.77.0.12)`` for a task on a simulated host, else ``None``."""
        if member not in self.host_of:
            return None
        i = self.host_of[member]
        return f"host{i} ({host_address(i)})"


def build_host_cluster(kind: StrategyKind, workers: int, ps: int = 0, chief: bool = False,
                       hosts: int = 2, base_port: int = BASE_PORT) -> ClusterPlan:
    """TF_CONFIGs naming host addresses, as on a real cluster (pure).

    Each task listens on its host's address; the k-th task on a host uses
    ``base_port + k``, so tasks on different hosts share port 2222.
    """
    if kind.single_process:
        raise LaunchError(
            f"--hosts places the tasks of a multi-process strategy on simulated hosts; "
            f"--strategy {kind.name} is one process: drop --hosts"
        )
    names = member_names(kind, workers, ps, chief)
    host_of = place_members(kind, names, hosts)
    used: dict[int, int] = {}
    addresses: dict[str, str] = {}
    for name in names:
        h = host_of[name]
        addresses[name] = f"{host_address(h)}:{base_port + used.get(h, 0)}"
        used[h] = used.get(h, 0) + 1
    cluster: dict[str, list[str]] = {}
    for name in names:
        cluster.setdefault(name.partition(":")[0], []).append(addresses[name])
    return ClusterPlan(_tf_configs(cluster), hosts, host_of)


def with_evaluator(plan: ClusterPlan, port: int | None = None,
                   host: str = "localhost") -> ClusterPlan:
    """``plan`` and one sidecar evaluator (``--evaluator``), ``evaluator:0`` (pure).

    Its TF_CONFIG is the training cluster's plus its own address under
    ``evaluator`` (as TensorFlow's parameter-server tutorial writes it); the
    training members' TF_CONFIGs do not name it, so it stays outside their
    cluster. With simulated hosts it runs on host 0, beside the members that
    only coordinate or serve, on that host's next port; else on ``host:port``.
    """
    first = next((c for c in plan.tf_configs.values() if c is not None), None)
    if first is None:
        raise LaunchError("--evaluator follows a cluster's checkpoints; this job is one "
                          "process: drop --evaluator")
    name = f"{policy.EVALUATOR}:0"
    host_of = dict(plan.host_of)
    if plan.hosts:
        host_of[name] = 0
        address = f"{host_address(0)}:{BASE_PORT + sum(1 for h in plan.host_of.values() if not h)}"
    else:
        address = f"{host}:{port}"
    cluster = {**first["cluster"], policy.EVALUATOR: [address]}
    tf_configs = {**plan.tf_configs,
                  name: {"cluster": cluster, "task": {"type": policy.EVALUATOR, "index": 0}}}
    return ClusterPlan(tf_configs, plan.hosts, host_of)


def loopback_plan(kind: StrategyKind, workers: int, ps: int, chief: bool,
                  ports: list[int] | None, host: str = "localhost") -> ClusterPlan:
    return ClusterPlan(build_cluster(kind, workers, ps, ports, host, chief))


# --- the saved plan ----------------------------------------------------------------

def tf_config_file(member: str) -> str:
    return f"{member.replace(':', '-')}.tf_config.json"


def commands_script(plan: ClusterPlan, command: list[str], launch_dir: str) -> str:
    """``commands.sh``: the line that replays each task, and where it ran (pure)."""
    lines = ["#!/usr/bin/env bash", "# Replay any task by hand: run its line in its own terminal"
             + (", on the host named after it." if plan.hosts else ".")]
    if plan.hosts:
        lines.append(f"# Simulated hosts: {', '.join(f'host{i} {host_address(i)}' for i in range(plan.hosts))} "
                     f"(a private bridge inside the launcher's network namespace)")
    for name, tf_config in plan.tf_configs.items():
        if tf_config is None:
            lines.append(shlex.join(command))
            continue
        path = f"{launch_dir.rstrip('/')}/{tf_config_file(name)}"
        where = plan.where(name)
        lines.append(f"TF_CONFIG=\"$(cat {shlex.quote(path)})\" {shlex.join(command)}  # {name}"
                     + (f" on {where}" if where else ""))
    return "\n".join(lines) + "\n"


# --- each member's share of the cores, and free ports -------------------------------

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
