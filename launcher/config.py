"""The launch as one frozen, typed object: what ``launch.py`` makes of its flags.

``launch.py`` checks its flags and builds a :class:`LaunchConfig` once: the
strategy kind (the object, not its name), the cluster plan (every task's
TF_CONFIG and host), each task's share of the cores, the recovery plan
(faults, slow-downs, restarts) and the job's limits. Everything below it
(network, processes, supervisor) takes this object or its parts, never the
command line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from launcher.faults import RecoveryPlan
from launcher.plan import ClusterPlan
from launcher.processes import CoreShare
from strategies.kinds import StrategyKind


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

    @property
    def launch_dir(self) -> str:
        return os.path.join(self.model_dir, "launch")

    @property
    def names(self) -> list[str]:
        return self.cluster.names
