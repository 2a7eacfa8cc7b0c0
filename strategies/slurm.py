"""The cluster of a Slurm job step, as the same frozen ``ClusterConfig``.

``from_slurm`` is the only reader of Slurm's environment in this project.
Every task of an ``srun`` step derives the same cluster from the same
variables, in Slurm's own node order, and then the checks ``parse_tf_config``
applies to ``TF_CONFIG`` run on it. (TensorFlow's ``SlurmClusterResolver``
is not used: it sorts node names as text, so on ``node[9-10]`` it puts rank
0 on node10 while Slurm runs it on node9.)

Roles come from the task's rank (``SLURM_PROCID``) in blocks: with
``--slurm-ps N`` rank 0 is the chief, ranks 1..N the ps tasks, the rest
workers; without, every task is a worker (worker:0 is the chief). Tasks on
one node take consecutive ports from ``--slurm-port``.
"""

from __future__ import annotations

import json
import re
from typing import Mapping

from tfdist.strategies.tf_config import ConfigError, parse_tf_config, require_source

DEFAULT_PORT = 2222
# What srun sets for every task of a step. SLURMD_NODENAME, set by slurmd
# per task, is only checked; no `scontrol` is run.
STEP_VARS = (
    "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE",
)
HOW_TO_RUN = (
    "run train.py through srun inside an allocation (see slurm/*.sbatch), "
    "or use --cluster-resolver=tf_config"
)


def slurm_jobs(num_tasks: int, num_ps: int) -> dict[str, int]:
    """How many tasks of each role a step of ``num_tasks`` tasks holds (pure)."""
    if num_ps < 0:
        raise ConfigError(f"--slurm-ps={num_ps} is not allowed; use 0 (all workers) or more")
    if num_ps == 0:
        return {"worker": num_tasks}
    workers = num_tasks - 1 - num_ps
    if workers < 1:
        raise ConfigError(
            f"--slurm-ps={num_ps} leaves no worker in a Slurm step of {num_tasks} task(s) "
            f"(1 chief + {num_ps} ps); ask srun for at least {num_ps + 2} tasks or lower --slurm-ps"
        )
    return {"chief": 1, "ps": num_ps, "worker": workers}


def _int_var(environ: Mapping[str, str], name: str, minimum: int) -> int:
    text = environ[name]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(
            f"{name} is {text!r}; expected an integer >= {minimum} as srun sets it; {HOW_TO_RUN}"
        )
    return value


def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError(f"unbalanced brackets in {text!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth or not cur:
        raise ValueError(f"unbalanced brackets or empty entry in {text!r}")
    return [*parts, cur]


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list, expanded in Slurm's order (pure).

    ``node[9-10]`` is node9, node10: ranges count numerically and keep their
    zero padding (``gpu[01-03]``), and the order given is kept, never sorted
    as text (TensorFlow's resolver sorts, which puts node10 before node9).
    Every bracket group multiplies out (``r[1-2]n[1-2]``: r1n1, r1n2, r2n1, r2n2).
    """
    hosts: list[str] = []
    for part in _split_outside_brackets(hostlist.strip()):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            values = [literal]
            if ranges:
                values = [literal + v for v in _expand_ranges(ranges, hostlist)]
            expanded = [e + v for e in expanded for v in values]
        hosts += expanded
    if not all(hosts):
        raise ValueError(f"empty host name in {hostlist!r}")
    return hosts


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    values = []
    for item in ranges.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"bad range {item!r} in {hostlist!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        values += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return values


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) as one count per node (pure)."""
    counts = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise ValueError(f"bad tasks-per-node entry {item!r} in {text!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _node_order(environ: Mapping[str, str]) -> list[tuple[str, int]]:
    """(node, tasks on it) in the order Slurm hands out ranks."""
    hosts = expand_hostlist(environ["SLURM_STEP_NODELIST"])
    counts = expand_tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"])
    if len(hosts) != len(counts) or len(set(hosts)) != len(hosts):
        raise ValueError(f"{len(hosts)} node(s) but {len(counts)} task count(s)")
    per_node = dict(zip(hosts, counts))
    # A heterogeneous step (train_ps.sbatch) ranks the tasks of component 0
    # first, on component 0's nodes, whatever their names; its combined node
    # list is sorted. The job's per-component lists give the rank order.
    het = [environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{i}")
           for i in range(int(environ.get("SLURM_HET_SIZE") or 0))]
    if het and all(het):
        ordered = [h for group in het for h in expand_hostlist(group)]
        if sorted(ordered) == sorted(hosts):  # the step spans every component
            hosts = ordered
    return [(h, per_node[h]) for h in hosts]


def slurm_cluster(environ: Mapping[str, str], num_ps: int, port: int) -> tuple[dict, str, int]:
    """(cluster, task type, task index) of this task (pure; reads ``environ`` only).

    Ranks go to nodes in blocks in Slurm's node order (``--distribution=block``),
    a node's tasks take consecutive ports from ``port``, and roles go to ranks
    in blocks: chief, ps, worker.
    """
    num_tasks = int(environ["SLURM_STEP_NUM_TASKS"])
    addresses = [f"{host}:{port + i}" for host, count in _node_order(environ) for i in range(count)]
    if len(addresses) != num_tasks:
        raise ValueError(f"the nodes' task counts add up to {len(addresses)}, not {num_tasks}")
    rank = int(environ["SLURM_PROCID"])
    cluster, first = {}, 0
    for role, count in slurm_jobs(num_tasks, num_ps).items():
        cluster[role] = addresses[first:first + count]
        if first <= rank < first + count:
            task = (role, rank - first)
        first += count
    return cluster, task[0], task[1]


def from_slurm(environ: Mapping[str, str], *, num_ps: int = 0, port: int = DEFAULT_PORT):
    """This task's ``ClusterConfig``, from the variables srun sets for each task."""
    require_source(environ, "slurm", "Slurm job step", STEP_VARS, HOW_TO_RUN)
    if not 0 < port < 65536:
        raise ConfigError(f"--slurm-port={port} is not allowed; use a port from 1 to 65535")
    num_tasks = _int_var(environ, "SLURM_STEP_NUM_TASKS", 1)
    rank = _int_var(environ, "SLURM_PROCID", 0)
    if rank >= num_tasks:
        raise ConfigError(
            f"SLURM_PROCID is {rank}, but SLURM_STEP_NUM_TASKS is {num_tasks}; {HOW_TO_RUN}"
        )
    slurm_jobs(num_tasks, num_ps)  # its error names the flag; raise it before parsing
    try:
        spec, task_type, task_index = slurm_cluster(environ, num_ps, port)
    except ValueError as err:
        raise ConfigError(
            f"Slurm step not understood (SLURM_STEP_NODELIST="
            f"{environ['SLURM_STEP_NODELIST']!r}, SLURM_STEP_TASKS_PER_NODE="
            f"{environ['SLURM_STEP_TASKS_PER_NODE']!r}, SLURM_STEP_NUM_TASKS={num_tasks}): "
            f"{err}; {HOW_TO_RUN}"
        ) from None
    top = max(int(a.rpartition(":")[2]) for addrs in spec.values() for a in addrs)
    if top > 65535:
        raise ConfigError(
            f"--slurm-port={port} is too high: this step's busiest node needs ports up to "
            f"{top}; use --slurm-port={port - (top - 65535)} or lower"
        )
    # One validation path for every source: the same checks as a TF_CONFIG.
    cluster = parse_tf_config(json.dumps(
        {"cluster": spec, "task": {"type": task_type, "index": task_index}}
    ))
    node = environ.get("SLURMD_NODENAME")
    host = cluster.address.rpartition(":")[0]
    if node and node != host:
        # Ranks are assumed to fill nodes in blocks; a cyclic or arbitrary
        # distribution would make tasks bind on another node's address.
        raise ConfigError(
            f"Slurm runs SLURM_PROCID={rank} on node {node!r}, but the cluster puts "
            f"{cluster.member_name} at {cluster.address}; start the step with "
            "`srun --distribution=block`"
        )
    return cluster
