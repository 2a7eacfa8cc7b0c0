"""A launch: what is asked (``LaunchRequest``) and what it resolves to (``LaunchConfig``).

The command's flags and the Python API's arguments both become one typed
:class:`LaunchRequest`; ``launcher.job.build_config`` checks it and builds
a :class:`LaunchConfig` once: the
strategy kind (the object, not its name), the cluster plan (every task's
TF_CONFIG and host), each task's share of the cores, the recovery plan
(faults, slow-downs, restarts) and the job's limits. Everything below it
(network, processes, supervisor) takes this object or its parts, never the
command line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Mapping

from tfdist.launcher.elastic import ElasticPlan
from tfdist.launcher.faults import RecoveryPlan
from tfdist.launcher.plan import ClusterPlan
from tfdist.launcher.processes import CoreShare
from tfdist.strategies.kinds import StrategyKind


@dataclass(frozen=True)
class LaunchRequest:
    """What a user asks of the launcher, typed: ``tfdist-launch``'s flags or ``tfdist.launch``'s
    arguments, unchecked. ``train_args`` go to every task's ``tfdist-train``."""

    strategy: str
    workers: int = 2
    ps: int = 0
    chief: bool = False
    dry_run: bool = False
    host: str = "localhost"
    hosts: int = 0
    link_rate: str | None = None
    netns: str = "auto"
    netns_inside: bool = False  # this is the launcher re-run inside its namespace
    timeout: float = 3600.0
    grace: float = 10.0
    program: str | None = None
    kill: tuple[str, ...] = ()
    preempt: tuple[str, ...] = ()
    hang: tuple[str, ...] = ()
    partition: tuple[str, ...] = ()
    slow: tuple[str, ...] = ()
    memory_limit: tuple[str, ...] = ()
    restart_tasks: bool = False
    restart_delay: float = 2.0
    max_restarts: int = 0
    # Elastic: the fewest workers the job goes on with, and how long a lost
    # worker's host may stay unreachable before it does (launcher.elastic).
    min_workers: int | None = None
    rejoin_timeout: float | None = None
    engine: str = "local"  # "ray": every task a Ray actor (launcher.ray_engine)
    address: str | None = None  # --address: a running Ray cluster (None: a local instance)
    ray_placement: str = "spread"
    train_args: tuple[str, ...] = ()

    # Fields given once per occurrence (``--kill A --kill B``).
    REPEATED = ("kill", "preempt", "hang", "partition", "slow", "memory_limit")

    def to_argv(self) -> list[str]:
        """The launcher's own flags for this request (the part before ``--``): the
        namespace re-runs the same command inside it from these."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if f.name in ("train_args", "netns_inside") or value is None:
                continue
            if f.name in self.REPEATED:
                for item in value:
                    argv += [flag, item]
            elif isinstance(value, bool):
                argv += [flag] if value else []
            else:
                argv += [flag, str(value)]
        return argv


@dataclass(frozen=True)
class LaunchConfig:
    kind: StrategyKind
    cluster: ClusterPlan
    recovery: RecoveryPlan = RecoveryPlan()
    # Each task's thread pools and CPU set (``processes.share_cores``).
    cores: Mapping[str, CoreShare] = field(default_factory=dict)
    train_args: tuple[str, ...] = ()  # every task's train.py arguments (--model-dir included)
    model_dir: str = ""
    program: str | None = None  # --program: an absolute path run instead of train.py
    timeout: float = 3600.0
    grace: float = 10.0
    dry_run: bool = False
    netns: str = "auto"  # --netns
    netns_inside: bool = False  # this is the launcher re-run inside its namespace
    link_rate: str | None = None  # --link-rate as given, e.g. "1gbit"
    rate_bits: int | None = None  # ... in bits per second
    launch_argv: tuple[str, ...] = ()  # launch.py's own flags, to re-run it in the namespace
    # --memory-limit: each limited task's bytes (launcher.memory.parse_limits).
    memory_limits: Mapping[str, int] = field(default_factory=dict)
    elastic: ElasticPlan | None = None  # --min-workers (launcher.elastic)

    @property
    def launch_dir(self) -> str:
        return os.path.join(self.model_dir, "launch")

    @property
    def names(self) -> list[str]:
        return self.cluster.names
