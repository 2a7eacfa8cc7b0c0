"""A job's attempts, on any engine: start, supervise, relaunch, re-form, and the outcome.

``run_job`` is the job between its engine's ``open`` and ``close``: it builds
the machine's objects the members are placed with (slow-downs, memory limits,
host CPU budgets), the hooks (fault injection, member restarts, peak memory,
the engine's membership view under ``--min-workers``), then runs attempts
(``attempts``): a ``Supervisor`` per attempt, a relaunch under
``--max-restarts`` (every TF_CONFIG and the ``--model-dir`` kept, like a
Kubernetes pod restarted under the same service names, so the members resume
from the latest checkpoint), or under ``--min-workers`` a re-formed cluster
(``reform``), which is not a relaunch. Everything the attempts share is one
``RunContext``; ``launcher.outcome`` writes what the job did.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from tfdist import protocol
from tfdist.launcher import outcome
from tfdist.launcher.recovery import elastic
from tfdist.launcher.recovery import faults as faultlib
from tfdist.launcher.config import LaunchConfig
from tfdist.launcher.engine.api import Engine, Formation, Placement
from tfdist.launcher.machine.hostcpus import HostCpus
from tfdist.launcher.recovery.injector import FaultInjector
from tfdist.launcher.machine.memory import MemoryLimits, PeakMemory
from tfdist.launcher.plan import share_cores
from tfdist.launcher.recovery.restarter import MemberRestarter
from tfdist.launcher.machine.slowdown import Slowdown
from tfdist.launcher.state import JobState, SetLink
from tfdist.launcher.supervisor import Supervisor
from tfdist.protocol import Exit


@dataclass
class RunContext:
    """One job's run as its attempts share it: the config, the engine and the log;
    the machine's objects and the hooks (``run_job`` sets them); the live
    attempt's supervisor (stopped on an interrupt), what each member starts with
    (``formation``: a re-formation replaces it), the hosts cut off for good
    (kept between elastic attempts), and the relaunches and re-formations so far."""

    config: LaunchConfig
    engine: Engine
    log: Callable[[str], None] = print
    cores: dict = field(default_factory=dict)  # each member's CoreShare (plan.share_cores)
    slowdown: Slowdown | None = None
    limits: MemoryLimits | None = None
    budgets: HostCpus | None = None
    injector: FaultInjector | None = None
    restarter: MemberRestarter | None = None
    membership: object = None  # launcher.membership.Membership under --min-workers
    hooks: list = field(default_factory=list)
    formation: Formation | None = None
    supervisor: Supervisor | None = None
    links: set[int] = field(default_factory=set)
    relaunches: int = 0
    reforms: int = 0

    def place(self, name: str) -> Placement:
        """Where member ``name`` runs on this machine: its host's namespace, its cgroups, its
        cores (asked at every start: a slow-down may begin mid-run)."""
        hosts, slowdown, budgets = self.engine.hosts, self.slowdown, self.budgets
        return Placement(
            netns=hosts.netns(self.config.plan.host_of[name]) if hosts is not None else None,
            cgroup=slowdown.cgroup_for(name) if slowdown is not None else None,
            memory_cgroup=self.limits.cgroup_for(name) if self.limits is not None else None,
            cpus=self.cores[name].cpus if name in self.cores else (),
            host_cgroups=budgets.cgroups_for(name) if budgets is not None else ())


def member_envs(config: LaunchConfig):
    """Each member's cores, its extra environment (thread pools; its events file when
    there is a launch directory) and its events file's path."""
    names, launch_dir = config.names, config.launch_dir
    cores = config.cores or share_cores(config.kind, names, os.cpu_count() or 1)
    envs = {n: dict(cores[n].env) for n in names}
    paths: dict[str, str] = {}
    for name in names:
        paths[name] = protocol.events_path(launch_dir, name)
        envs[name][protocol.EVENTS_ENV] = paths[name]
    return cores, envs, paths


def _machine(run: RunContext, cores) -> None:
    """The machine's objects members are placed with: slow-downs (``--slow``), memory
    limits (``--memory-limit``), each host's CPU budget (``--host-cpus``)."""
    config, log = run.config, run.log
    if config.recovery.slow:
        total = os.cpu_count() or 1
        run.slowdown = Slowdown({n: cores[n].cores(total) for n in config.names}, log=log)
    run.limits = MemoryLimits(dict(config.memory_limits), log=log)
    if config.host_cpus is not None:
        run.budgets = HostCpus(config.host_cpus, dict(config.plan.host_of), log=log)


def _hooks(run: RunContext, event_paths: list[str]) -> None:
    """The fault injector (slow-downs from the start are applied here), the member
    restarter and the membership view (``--min-workers``: the engine's)."""
    config, log, slowdown = run.config, run.log, run.slowdown
    recovery = config.recovery
    for slow in recovery.slow:
        if slow.from_start:
            slowdown.activate(slow.member, slow.fraction)
            log(f"[launch] slow: {slowdown.describe(slow.member)}")
    run.injector = FaultInjector(
        [*recovery.faults, *(s for s in recovery.slow if not s.from_start)],
        log=log, grace=config.grace, event_paths=event_paths)
    run.restarter = MemberRestarter(
        recovery.restart_delay, log=log, roles=config.kind.restartable_roles,
        event_paths=event_paths,
    ) if recovery.restart_tasks else None
    if config.elastic is not None:
        record = os.path.join(config.launch_dir, "membership.json")
        run.membership = run.engine.membership(config.elastic, event_paths, record, log)


def run_job(run: RunContext) -> int:
    """Start, supervise and, under ``--max-restarts``, relaunch the job; write its
    outcome. The engine is open (``Engine.open``) and is closed by the caller."""
    config, engine, log = run.config, run.engine, run.log
    started = time.time()
    run.cores, envs, paths = member_envs(config)
    try:
        _machine(run, run.cores)
        _hooks(run, list(paths.values()))
        peaks = PeakMemory() if engine.reads_memory() else PeakMemory(read=lambda pid: None)
        run.hooks = [run.injector, *filter(None, [run.restarter]), peaks]
        membership = run.membership
        run.formation = Formation(config.plan.tf_configs, config.member, envs, run.place,
                                  membership.env() if membership is not None else {})
        # After the link probe (the engine's open), so only the job's bytes count.
        before = outcome.counters(engine.hosts, log)
        tracer = outcome.start_link_trace(config, engine.hosts)
        code = attempts(run)
        after = outcome.counters(engine.hosts, log) if before is not None else None
        events = outcome.job_events(paths)
        outcome.finish_link_trace(tracer, config, config.launch_dir, events, log)
        oom, limited = run.limits.oom_killed(), run.limits.record()
        host_cpus = run.budgets.finish() if run.budgets is not None else None
    finally:
        for held in (run.slowdown, run.limits, run.budgets):  # their cgroups removed whatever happened
            if held is not None:
                held.close()
    traffic = outcome.traffic_record(config, before, after, log)
    outcome.finish(run, code, outcome.JobFigures(
        events=events, started=started, peaks=peaks, limited=limited, oom=oom,
        traffic=traffic, host_cpus=host_cpus))
    return code


def attempts(run: RunContext) -> int:
    """Run the job, relaunching it under ``--max-restarts``: its last code
    (``run.relaunches``: how many relaunches it took).

    Under ``--min-workers`` (``run.membership``) an attempt may end in a
    re-formed cluster instead (``reform``), which is not a relaunch.
    """
    config, log, membership = run.config, run.log, run.membership
    recovery = config.recovery
    while True:
        code = _attempt(run)
        if membership is not None:
            code = reform(run, code)
            if code is None:
                run.reforms += 1
                run.links = set(run.supervisor.links_down)
                continue
            run.supervisor.keep_links = False
            run.supervisor.lift_all()
            run.links = set()
            run.injector.end_attempt()
        if not faultlib.should_relaunch(code, run.relaunches, recovery.max_restarts):
            return code
        run.relaunches += 1
        log(f"[launch] relaunching the job ({run.relaunches} of --max-restarts="
            f"{recovery.max_restarts}) after exit {code}, in {recovery.restart_delay:g}s; "
            "it resumes from its checkpoint")
        time.sleep(recovery.restart_delay)


def _attempt(run: RunContext) -> int:
    """One attempt: its supervisor started on the formation, run to the job's outcome."""
    config, membership = run.config, run.membership
    if run.restarter is not None:
        run.restarter.new_attempt()
    number = run.relaunches + run.reforms
    sup = Supervisor(config.kind, run.engine, log=run.log, grace=config.grace,
                     slowdown=run.slowdown, attempt=number, network=run.engine.hosts,
                     relaunches=run.relaunches < config.recovery.max_restarts)
    sup.links_down = set(run.links)
    run.supervisor = sup
    run.engine.new_attempt(number, run.formation)
    names, hooks = config.names, run.hooks
    if membership is not None:
        sup.keep_links = True
        membership.new_attempt(lambda: sup.links_down)
        names, hooks = membership.names, [*run.hooks, membership]
    sup.start(names)
    try:
        return sup.run(config.timeout, hooks)
    finally:
        # sup.run's stop() lifted what was still on (a partition for
        # good stays under --min-workers: the job re-forms without it).
        run.injector.end_attempt(keep_partitions=membership is not None)


def reform(run: RunContext, code: int) -> int | None:
    """After an elastic attempt: ``None`` when the cluster is re-formed (the
    next attempt starts the new members), else the code to go on with."""
    config, log, membership, sup = run.config, run.log, run.membership, run.supervisor

    def wait_links(seconds: float) -> None:
        # The fault schedule goes on while a lost host may come back.
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for action in run.injector(JobState((), sup.attempt)):
                if isinstance(action, SetLink):
                    sup.apply(action)
            if not any(membership.host_of.get(w) in sup.links_down for w in membership.lost):
                return
            time.sleep(sup.poll)

    before = list(membership.members)
    code = membership.after_attempt(code, wait_links)
    if code is not None:
        return code
    # Decided at launch (job.pin_elastic_batch) and in every formation's flags;
    # under --program, the one its run recorded.
    batch = elastic.global_batch(config.model_dir, config.options)
    n = len(membership.members)
    if batch is not None and batch % n:
        log(f"[launch] the run's global batch {batch} does not divide over {n} workers: "
            f"cannot keep it at this size; stopping (exit {int(Exit.TASK_LOST)}); run the "
            "same command with all workers to resume, or give --global-batch-size a "
            f"multiple of every size down to --min-workers")
        membership.members = before
        return Exit.TASK_LOST
    options = config.options
    if batch is not None and options.global_batch_size is None:
        options = dataclasses.replace(options, global_batch_size=batch)
    options, k_line = elastic.aggregate(options, n)
    if k_line:
        log(f"[launch] {k_line}")
    if batch is None:
        log("[launch] the run recorded no global batch yet (no run.json): the re-formed "
            "cluster chooses its own (--global-batch-size keeps it fixed)")
    else:
        log(f"[launch] global batch {batch} kept: {batch // n} per worker x {n}")
    run.formation = dataclasses.replace(
        run.formation, tf_configs=membership.configs(config.plan.tf_configs),
        member=dataclasses.replace(config.member, options=options), env=membership.env())
    return None


def interrupted(run: RunContext, received: list) -> int:
    """Stop every member after a signal to the launcher; the exit code a shell would report."""
    if run.supervisor is not None:
        run.supervisor.keep_links = False  # the launcher ends: every link up again
        run.supervisor.stop()
    # As a shell reports a process ended by that signal: 143 for SIGTERM.
    return 128 + received[0] if received else Exit.INTERRUPTED
