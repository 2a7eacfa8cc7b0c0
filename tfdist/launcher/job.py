"""A launch request run as a job: checked, planned, every task's own check, then run.

The library behind ``tfdist-launch`` (``tfdist.cli.launch`` reads the
flags) and ``tfdist.launch``/``tfdist.fit(workers=N)``: a typed
:class:`LaunchRequest` becomes one frozen ``LaunchConfig`` (``build_config``),
every task checks its own flags (``preflight``), and the job runs in a
private network namespace (the same command re-run inside it) or on the host
network (``run_inside``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys

from tfdist.options import TrainOptions
from tfdist.protocol import default_model_dir
from tfdist.launcher import attempts, files
from tfdist.launcher.recovery import elastic
from tfdist.launcher.machine import hostcpus
from tfdist.launcher.machine import memory
from tfdist.launcher.machine import network
from tfdist.launcher import plan as plans
from tfdist.launcher.checks import check_members, preflight
from tfdist.launcher.engine import ray_engine
from tfdist.launcher.engine.api import Engine, Formation
from tfdist.launcher.engine.local import LocalEngine, member_command
from tfdist.launcher.config import Cluster, LaunchConfig, LaunchRequest, Limits, MemberArgs
from tfdist.launcher.recovery.faults import plan_recovery
from tfdist.launcher.plan import LaunchError
from tfdist.strategies import kinds
from tfdist.strategies.kinds import StrategyKind
from tfdist.strategies.tf_config import ClusterConfig


def run_request(request: LaunchRequest) -> int:
    """Run the whole job; its exit code. Raises LaunchError (one line) for bad input,
    before anything is written or started."""
    config = build_config(request)
    if not request.netns_inside:
        config = pin_elastic_batch(config)
    if request.strategy == kinds.AUTO and not request.netns_inside:
        print(f"[launch] {kinds.auto_note(config.kind, auto_cluster(request.cluster))}",
              flush=True)
    if request.cluster.engine == "ray":
        ray = ray_engine.import_ray()  # missing: one line saying how to get it, before the checks
        code = preflight(config)
        if code is not None:
            return code
        config = ray_engine.with_shared_model_dir(config)
        return run_on(ray_engine.RayEngine(ray, config, request.cluster.address,
                                           request.cluster.ray_placement))
    use_netns, warning = decide_network(config)
    if not config.netns_inside and config.program is None:
        # The inner launcher in the namespace was checked by the outer one.
        code = preflight(config)
        if code is not None:
            return code
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if use_netns:
        code = network.prepare_data(config.options.data_dir, dict(os.environ))
        if code != 0:
            return code
        print("[launch] private network namespace: only the cluster's own tasks can reach "
              "its ports", flush=True)
        return network.run_in_netns(
            network.netns_command(list(config.launch_argv), config.member.argv()),
            config.grace)
    return run_local(config)


def check_times(limits: Limits) -> None:
    """--timeout (unset: no limit) and --grace: finite seconds (nan compares false and would
    never fire)."""
    if limits.timeout is not None and not 0 < limits.timeout < math.inf:
        raise LaunchError(f"--timeout={limits.timeout:g} is not allowed; use a positive, finite "
                          "number of seconds, or leave it out for no limit")
    if not 0 <= limits.grace < math.inf:
        raise LaunchError(f"--grace={limits.grace:g} is not allowed; use 0 or more (finite) "
                          "seconds")


def plan_cluster(asked: Cluster, kind: StrategyKind) -> plans.ClusterPlan:
    if asked.hosts and asked.host != "localhost":
        raise LaunchError(f"--host {asked.host} names the one address of a loopback cluster; "
                          "--hosts gives each simulated host its own: use one of the two")
    if asked.hosts:
        plan = plans.build_host_cluster(kind, asked.workers, asked.ps, asked.chief, asked.hosts)
        return plans.with_evaluator(plan) if asked.evaluator else plan
    n = plans.member_count(kind, asked.workers, asked.ps, asked.chief)
    ports = plans.free_ports(n + int(asked.evaluator))
    plan = plans.loopback_plan(kind, asked.workers, asked.ps, asked.chief, ports[:n], asked.host)
    return plans.with_evaluator(plan, ports[n], asked.host) if asked.evaluator else plan


def check_evaluator(request: LaunchRequest, kind: StrategyKind) -> None:
    """``--evaluator`` where a sidecar can follow the job, else one line (pure)."""
    if not request.cluster.evaluator:
        return
    if kind.single_process:
        raise LaunchError(f"--evaluator evaluates a cluster's checkpoints beside it; --strategy "
                          f"{kind.name} is one process, which evaluates its own run after "
                          "training: drop --evaluator, or use a multi-process strategy")
    if request.program is not None:
        raise LaunchError("--evaluator runs train.py as the evaluator; --program runs another "
                          "program on every member: drop one of the two")
    if request.recovery.min_workers is not None:
        raise LaunchError("--evaluator is not combined with --min-workers (a re-formed cluster "
                          "starts only its workers): drop one of the two")


def auto_cluster(asked: Cluster) -> ClusterConfig:
    """The cluster ``--strategy auto`` is chosen for: the roles asked for, by count."""
    roles = {"worker": asked.workers, "ps": asked.ps, "chief": int(asked.chief)}
    return ClusterConfig(roles={role: tuple(f"{role}-{i}:0" for i in range(n))
                                for role, n in roles.items() if n},
                         task_type="worker")


def choose_kind(request: LaunchRequest) -> StrategyKind:
    """The strategy's kind (``auto``: what train.py's ``--strategy auto`` picks for the
    cluster asked for); LaunchError for an unknown name."""
    if request.strategy == kinds.AUTO:
        return kinds.auto_choice(auto_cluster(request.cluster))
    if request.strategy not in kinds.names(include_auto=False):
        raise LaunchError(f"unknown --strategy {request.strategy!r}; allowed: "
                          f"{', '.join(kinds.names())}")
    return kinds.get(request.strategy)


def resolve_member(kind: StrategyKind, member: MemberArgs) -> MemberArgs:
    """Every member's flags as they run: ``--model-dir`` set (default:
    ``protocol.default_model_dir``, the rule train.py and the Python API follow too),
    and ``--task path/to/task.py[:NAME]`` made absolute from here: every member starts
    in the project's directory, and the user's relative path means the file beside
    them, the same one on every member."""
    options, task = member.options, member.task
    if options.model_dir is None:
        options = dataclasses.replace(options, model_dir=default_model_dir(kind.name))
    if task is not None:
        path, colon, name = task.partition(":")
        if path.endswith(".py") or os.sep in path:
            task = os.path.abspath(path) + colon + name
    return dataclasses.replace(member, task=task, options=options)


def build_config(request: LaunchRequest) -> LaunchConfig:
    """The request, checked, as one frozen config (LaunchError: one line, nothing written)."""
    program = os.path.abspath(request.program) if request.program is not None else None
    kind = choose_kind(request)
    member = resolve_member(kind, request.member)
    check_times(request.limits)
    ray_engine.check_request(request)
    check_evaluator(request, kind)
    if program is not None and request.dry_run:
        raise LaunchError("--dry-run shows train.py's own plan for each task; it does not "
                          "apply with --program: drop one of the two")
    if program is not None and not os.path.isfile(program):
        raise LaunchError(f"--program {program!r} is not a file; pass the path of "
                          "a Python program that takes train.py's arguments")
    cluster = plan_cluster(request.cluster, kind)
    asked, again = request.faults, request.recovery
    recovery = plan_recovery(kind, cluster.tf_configs, asked, again, request.cluster.hosts)
    elastic_plan = elastic.plan_elastic(kind, request.cluster.workers, again.min_workers,
                                        again.rejoin_timeout, request.cluster.engine,
                                        request.cluster.hosts, again.max_restarts,
                                        again.shrink_at_once)
    if elastic_plan is not None:
        check_elastic_batch(kind, cluster, elastic_plan, member.options)
    link_rate = request.cluster.link_rate
    rate = network.parse_rate(link_rate) if link_rate is not None else None
    roles: dict[str, list[str]] = {}
    for name in cluster.names:
        roles.setdefault(name.partition(":")[0], []).append(name)
    try:
        limits = memory.parse_limits(list(asked.memory_limit) or None, roles)
    except memory.MemoryLimitError as err:
        raise LaunchError(str(err)) from None
    problem = memory.limits_problem() if limits else None
    if problem is not None:
        raise LaunchError(f"--memory-limit needs a memory cgroup: {problem}; run as root on "
                          "Linux with cgroup v1, or drop the flag")
    host_cpus = hostcpus.plan_host_cpus(
        request.cluster.host_cpus, request.cluster.hosts, os.cpu_count() or 1,
        slowed=bool(asked.slow), problem=hostcpus.cgroups_problem()
        if request.cluster.host_cpus is not None else None)
    return LaunchConfig(
        kind=kind, plan=cluster, recovery=recovery,
        cores=plans.share_cores(kind, cluster.names, os.cpu_count() or 1, host_cpus),
        member=member, program=program,
        limits=request.limits, dry_run=request.dry_run, netns=request.cluster.netns,
        netns_inside=request.netns_inside, link_rate=link_rate, rate_bits=rate,
        link_trace=request.cluster.link_trace,
        launch_argv=tuple(dataclasses.replace(request, strategy=kind.name).to_argv()),
        memory_limits=limits, elastic=elastic_plan, host_cpus=host_cpus)


def elastic_divisors(config: LaunchConfig) -> dict[int, int]:
    """What the global batch must divide by at each size the elastic job may take."""
    return _divisors(config.kind, config.plan, config.elastic, config.options)


def _divisors(kind: StrategyKind, cluster: plans.ClusterPlan, plan: elastic.ElasticPlan,
              options: TrainOptions) -> dict[int, int]:
    roles: dict[str, int] = {}
    for name in cluster.names:
        roles[name.partition(":")[0]] = roles.get(name.partition(":")[0], 0) + 1
    return elastic.batch_divisors(kind, roles, range(plan.min_workers, roles.get(
        elastic.ROLE, 0) + 1), options.replicas_to_aggregate)


def check_elastic_batch(kind: StrategyKind, cluster: plans.ClusterPlan,
                        plan: elastic.ElasticPlan, options: TrainOptions) -> None:
    """A given --global-batch-size that some size of the elastic job cannot divide:
    one line, before anything starts."""
    if options.global_batch_size is not None:
        elastic.check_batch(options.global_batch_size, _divisors(kind, cluster, plan, options))


def pin_elastic_batch(config: LaunchConfig) -> LaunchConfig:
    """An elastic job's global batch, decided once: the one given, else the
    multiple of every size's divisor nearest the full cluster's own choice
    (asked of the chief's check), stated in one line and passed to every
    formation, so a re-formed cluster never chooses its own."""
    if config.elastic is None or config.program is not None or \
            config.options.global_batch_size is not None:
        return config
    cluster = config.plan
    first = next((n for n in cluster.names if cluster.tf_configs[n] is not None), None)
    checks = check_members({first: cluster.tf_configs[first]}, member_command(
        config, Formation(cluster.tf_configs, config.member)), dict(os.environ))
    plan = checks[0].plan if checks and checks[0].code == 0 else None
    if plan is None or not isinstance(plan.get("global_batch_size"), int):
        return config  # the tasks' own check (preflight) says why
    divisors = elastic_divisors(config)
    batch = elastic.choose_batch(plan["global_batch_size"], divisors)
    print(elastic.batch_line(batch, divisors), flush=True)
    options = dataclasses.replace(config.options, global_batch_size=batch)
    return dataclasses.replace(config, member=dataclasses.replace(config.member, options=options))


def decide_network(config: LaunchConfig) -> tuple[bool, str | None]:
    """Whether the cluster runs in a private namespace, and the warning if it cannot."""
    if config.netns_inside:
        return False, None
    network.check_hosts_mode(config.plan.hosts, config.netns, config.link_rate,
                             network.hosts_problem, link_trace=config.link_trace)
    use_netns, warning = (True, None) if config.plan.hosts else network.decide_netns(
        config.netns, config.kind, network.netns_problem)
    files.check_launch_dir(config.launch_dir)
    return use_netns, warning


def run_local(config: LaunchConfig) -> int:
    """The launcher in its namespace (or on the host network): the local engine on the
    simulated hosts (``--hosts``) or on loopback."""
    if config.netns_inside:
        network.loopback_up()
    hosts = network.SimulatedHosts(config.plan.hosts, config.rate_bits) \
        if config.plan.hosts else None
    return run_on(LocalEngine(config, hosts))


def run_on(engine: Engine) -> int:
    """The job on ``engine``, whichever it is: opened, its attempts run, closed; a SIGTERM
    to the launcher stops every member (the exit code a shell reports for it)."""
    config = engine.config
    log = lambda m: print(m, flush=True)  # noqa: E731
    received: list[int] = []
    run = attempts.RunContext(config, engine, log)

    def on_signal(signum, _frame):
        received.append(signum)
        raise KeyboardInterrupt(signum)

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        code = engine.open(log)
        if code is not None:
            return code
        code = attempts.run_job(run)
    except KeyboardInterrupt:
        log("[launch] interrupted; stopping every task")
        return attempts.interrupted(run, received)
    finally:
        engine.close()
        signal.signal(signal.SIGTERM, previous)
    log(f"[launch] done: exit code {code}")
    return code
