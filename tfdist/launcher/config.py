"""A launch: what is asked (``LaunchRequest``) and what it resolves to (``LaunchConfig``).

The command's flags and the Python API's arguments both become one typed
:class:`LaunchRequest`; ``launcher.job.build_config`` checks it and builds
a :class:`LaunchConfig` once: the
strategy kind (the object, not its name), the cluster plan (every task's
TF_CONFIG and host), each task's share of the cores, the recovery plan
(faults, slow-downs, restarts), every member's flags (typed: ``MemberArgs``)
and the job's limits. Everything below it (the engine, the machine, the
attempts) takes this object or its parts, never the command line.

**Adding a launcher option** (``--min-workers`` was added so): one field in the group it
belongs to (``Cluster``, ``Faults``, ``Recovery``, ``Limits``), declared with
``tfdist.flags.option(default, help, ...)``. That field is the ``launch.py`` flag
(built by ``tfdist.cli.launch``, nothing to write there), its ``--help`` line
and default, and the Python API's argument (``tfdist.Recovery(min_workers=...)``);
read it as ``request.recovery.min_workers`` in ``launcher.job.build_config``.
Never repeat its default elsewhere: ``tests/test_options.py`` checks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from tfdist.flags import option, to_argv
from tfdist.options import TrainOptions
from tfdist.launcher import plan as plans
from tfdist.launcher.recovery.elastic import DEFAULT_REJOIN_TIMEOUT, ElasticPlan
from tfdist.launcher.recovery.faults import FAULT_SPEC, MAX_MEMBER_RESTARTS, RESTART_DELAY, RecoveryPlan
from tfdist.launcher.machine.network import INSIDE_FLAG, NETNS_MODES
from tfdist.launcher.plan import ClusterPlan
from tfdist.launcher.plan import CoreShare
from tfdist.strategies import kinds
from tfdist.strategies.kinds import StrategyKind


ENGINES = ("local", "ray")
NETWORK = "simulated hosts and network"
RAY_PLACEMENTS = ("spread", "strict-spread", "pack", "spread-workers")


@dataclass(frozen=True)
class Cluster:
    """The simulated cluster: its tasks, where they run and how they are linked."""

    workers: int = option(2, "worker tasks (each trains)", metavar="N")
    ps: int = option(0, "parameter-server tasks (ps, ps-sync; a chief is added to coordinate)",
                     metavar="N")
    chief: bool = option(False, "multiworker: add a separate chief task (it trains too)")
    evaluator: bool = option(
        False, "add a sidecar evaluator, evaluator:0: train.py with TF_CONFIG task type "
        "evaluator, outside the training cluster, evaluating each new checkpoint of "
        "--model-dir (val_* to logs/eval, its history to results.json); training never waits "
        "for it and its exit never decides the job's (outcome.json records it); not with "
        "--strategy none or mirrored (one process), --engine ray or --min-workers")
    host: str = option("localhost", "address written into TF_CONFIG (without --hosts)",
                       group=NETWORK)
    hosts: int = option(
        0, lambda: "place the tasks on N simulated hosts, each a network namespace with its own "
        f"address ({plans.host_address(0)}, {plans.host_address(1)}, ...) on a private bridge; "
        "coordinating tasks (ps chief, ps) on host 0, workers spread over the others "
        "(0: every task on this host's loopback)", metavar="N", group=NETWORK)
    host_cpus: float | None = option(
        None, "with --hosts: give every simulated host a CPU budget of C cores (one CFS "
        "quota for all its members; hosts x C at most this machine's cores), so N hosts "
        "compute like N small machines; root on Linux (cgroup v1)", metavar="C",
        group=NETWORK, unset="the hosts share every core")
    link_rate: str | None = option(
        None, "with --hosts: shape every host's link to RATE each way (tc tbf; e.g. 1gbit, "
        "100mbit; no latency emulation), measured once at start", metavar="RATE",
        group=NETWORK, unset="links not shaped")
    link_trace: bool = option(
        False, "with --link-rate: sample every host's link each 10 ms for the whole job into "
        "<model-dir>/launch/link_trace.json, to see when each link idled (python -m "
        "tfdist.cli.tools.trace_study RUN_DIR prints and draws it)", group=NETWORK)
    netns: str = option("auto", "run the cluster in a private network namespace, unreachable "
                        "from outside: auto (when the OS allows it; else a warning), on (or "
                        "fail), off", choices=NETNS_MODES, group=NETWORK)
    engine: str = option("local", "local: the tasks as processes of this host; ray: each task "
                         "a Ray actor on a Ray cluster (pip install "
                         "'tf-distribute-showcase[ray]')", choices=ENGINES, group="engine")
    address: str | None = option(
        None, "with --engine ray: the running Ray cluster to join (auto: the one on this node)",
        metavar="auto|HOST:PORT", group="engine",
        unset="a local Ray instance, started for the job and stopped after")
    ray_placement: str = option(
        "spread", "with --engine ray: how the placement group (one bundle per task) spreads "
        "the tasks over the nodes (spread-workers: spread, with ps and a coordinating chief on "
        "the head node)", choices=RAY_PLACEMENTS, group="engine")


_WHEN = "repeatable; WHEN as for --kill"


@dataclass(frozen=True)
class Faults:
    """Faults injected into the running job, each ``ROLE:INDEX@WHEN`` (or as its flag says)."""

    kill: tuple[str, ...] = option(
        (), f"SIGKILL a task (repeatable; several of one task fire in order, one per process "
        f"of it, e.g. after each restart); {FAULT_SPEC}", metavar="ROLE:INDEX@WHEN")
    preempt: tuple[str, ...] = option((), f"SIGTERM a task, a polite preemption; {_WHEN}",
                                      metavar="ROLE:INDEX@WHEN")
    hang: tuple[str, ...] = option(
        (), "SIGSTOP a task's process group, alive but stuck (a frozen host or VM); SIGCONT "
        f"after SECONDS if given, always before the launcher stops it; {_WHEN}",
        metavar="ROLE:INDEX@WHEN[+SECONDS]")
    partition: tuple[str, ...] = option(
        (), "with --hosts: take a simulated host's link down (ip link set ... down), up again "
        f"after SECONDS if given, always when the launcher ends; {_WHEN}",
        metavar="hostN@WHEN[+SECONDS]")
    slow: tuple[str, ...] = option(
        (), "run a task at FRACTION of its speed, from outside the process (a CFS CPU quota, "
        "else a SIGSTOP/SIGCONT duty cycle); repeatable, restarts included; without @WHEN "
        "from its start", metavar="ROLE:INDEX=FRACTION[@WHEN]")
    memory_limit: tuple[str, ...] = option(
        (), "run each task of ROLE in a memory cgroup of SIZE (e.g. ps=1200M, 1.5G): past it "
        "the kernel ends the task, as a container's limit would; repeatable; root on Linux "
        "(cgroup v1)", metavar="ROLE=SIZE")


@dataclass(frozen=True)
class Recovery:
    """How the launcher brings a job back: restart a task, relaunch the job."""

    restart_tasks: bool = option(
        False, f"ps, ps-sync: restart a dead worker with its TF_CONFIG (at most "
        f"{MAX_MEMBER_RESTARTS} times each), and kill and restart one the chief reports stuck, "
        "as a cluster manager's liveness check would")
    restart_delay: float = option(RESTART_DELAY, "seconds before a task or job is restarted",
                                  metavar="SECONDS")
    max_restarts: int = option(0, "relaunch a failed or preempted job up to N times with the "
                               "same --model-dir (it resumes from its checkpoint)", metavar="N")
    # Elastic: the fewest workers the job goes on with, and how long a lost
    # worker's host may stay unreachable before it does (launcher.recovery.elastic).
    min_workers: int | None = option(
        None, "multiworker: when a worker's host stays unreachable for --rejoin-timeout, "
        "or its process fails more than --max-restarts times, re-form the job with the "
        "survivors (at least M; one global batch, decided at launch, from the newest "
        "checkpoint), and with a lost host's worker again when the host is back; below M, "
        "exit 75", metavar="M", unset="a lost worker ends the job")
    shrink_at_once: bool = option(
        False, "with --min-workers: a worker whose process fails while its host is "
        "reachable leaves the job at once, instead of after --max-restarts relaunches with it")
    rejoin_timeout: float | None = option(
        None, "with --min-workers: how long a lost worker's host may stay unreachable before "
        "the job goes on without it", metavar="SECONDS",
        unset=f"{DEFAULT_REJOIN_TIMEOUT:g}")


@dataclass(frozen=True)
class Limits:
    """How long the job may run, and how it is stopped."""

    timeout: float | None = option(
        None, "stop the job after SECONDS (exit 124); a stuck task is found without it, by "
        "train.py's --stuck-timeout", metavar="SECONDS", unset="no limit")
    grace: float = option(10.0, "seconds between SIGTERM and SIGKILL when a task is stopped",
                          metavar="SECONDS")


@dataclass(frozen=True)
class MemberArgs:
    """What every member's command is given, typed: ``tfdist-train``'s flags after
    ``launch.py``'s ``--``, or ``tfdist.launch``'s ``task``/``options``.

    The launcher reads a member's option as a field of ``options`` and changes it with
    ``dataclasses.replace``; a member's command line is made from it once, by the
    engine that starts the member (``argv``)."""

    task: str | None = None  # --task as given (None: the member's own default)
    model: str | None = None  # train.py's --model alias, as given (the member resolves it)
    options: TrainOptions = TrainOptions()
    verbose: bool = False  # train.py's --verbose
    # --program: the flags train.py does not know, the program's own, passed as given.
    extra: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        """The member's flags (after ``--strategy``): each option that differs from its
        default once (``flags.to_argv``)."""
        return [*(("--task", self.task) if self.task is not None else ()),
                *(("--model", self.model) if self.model is not None else ()),
                *to_argv(self.options), *(("--verbose",) if self.verbose else ()), *self.extra]


@dataclass(frozen=True)
class LaunchRequest:
    """What a user asks of the launcher, typed: ``tfdist-launch``'s flags or ``tfdist.launch``'s
    arguments, unchecked. ``member``: what every member's ``tfdist-train`` is given."""

    strategy: str = option(
        "auto", "the strategy every task runs (see train.py --help); auto: ps with --ps, "
        "multiworker with several workers, else mirrored, as train.py's auto picks (the "
        "launcher's first line says which)", choices=kinds.names, group="cluster")
    cluster: Cluster = Cluster()
    faults: Faults = Faults()
    recovery: Recovery = Recovery()
    limits: Limits = Limits()
    dry_run: bool = option(False, "print every task's plan (its own train.py --dry-run) and "
                           "exit; nothing is started or written", group="cluster")
    program: str | None = option(
        None, "run this Python program on every task instead of train.py, with the same "
        "arguments (--strategy=... and everything after --) and TF_CONFIG; it must honour "
        "--model-dir (e.g. the benchmark's tfdist/bench/peers/); the tasks' own pre-flight "
        "check is skipped", metavar="FILE.py", group="job control", unset="train.py")
    # This is the launcher re-run inside its namespace (network.INSIDE_FLAG).
    netns_inside: bool = option(False, "", flag=INSIDE_FLAG, hidden=True)
    member: MemberArgs = MemberArgs()

    # The typed groups, each a section of --help, in order.
    GROUPS = (("cluster", "cluster"), ("faults", "faults"), ("recovery", "recovery"),
              ("limits", "job control"))

    def to_argv(self) -> list[str]:
        """The launcher's own flags for this request (the part before ``--``): the
        namespace re-runs the same command inside it from these."""
        argv = ["--strategy", self.strategy]
        for name, _ in self.GROUPS:
            argv += to_argv(getattr(self, name))
        return argv + to_argv(self, exclude=("strategy", "netns_inside"))


@dataclass(frozen=True)
class LaunchConfig:
    kind: StrategyKind
    plan: ClusterPlan  # every member, its host, address and TF_CONFIG (the launch's plan)
    recovery: RecoveryPlan = RecoveryPlan()
    # Each task's thread pools and CPU set (``plan.share_cores``).
    cores: Mapping[str, CoreShare] = field(default_factory=dict)
    # Every member's flags, typed (--model-dir always set: ``model_dir``).
    member: MemberArgs = MemberArgs()
    program: str | None = None  # --program: an absolute path run instead of train.py
    limits: Limits = Limits()
    dry_run: bool = False
    netns: str = "auto"  # --netns
    netns_inside: bool = False  # this is the launcher re-run inside its namespace
    link_rate: str | None = None  # --link-rate as given, e.g. "1gbit"
    rate_bits: int | None = None  # ... in bits per second
    link_trace: bool = False  # --link-trace: sample every link each 10 ms (launcher.machine.linktrace)
    launch_argv: tuple[str, ...] = ()  # launch.py's own flags, to re-run it in the namespace
    # --memory-limit: each limited task's bytes (launcher.machine.memory.parse_limits).
    memory_limits: Mapping[str, int] = field(default_factory=dict)
    elastic: ElasticPlan | None = None  # --min-workers (launcher.recovery.elastic)
    host_cpus: float | None = None  # --host-cpus: each host's cores (launcher.machine.hostcpus)

    @property
    def timeout(self) -> float | None:
        return self.limits.timeout

    @property
    def grace(self) -> float:
        return self.limits.grace

    @property
    def options(self) -> TrainOptions:
        return self.member.options

    @property
    def model_dir(self) -> str:
        return self.member.options.model_dir or ""

    @property
    def launch_dir(self) -> str:
        return os.path.join(self.model_dir, "launch")

    @property
    def names(self) -> list[str]:
        return self.plan.names
