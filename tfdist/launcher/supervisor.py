"""Supervision: the job's typed state, the poll loop, relaunches, and the outcome.

The ``Supervisor`` owns the task processes. Each poll it reaps exits, shows
the hooks (fault injection, task restarts) a ``JobState`` snapshot, applies
the actions they return, and asks the strategy kind whether the job's
outcome is known (``decide``). ``run_job`` relaunches a failed job under
``--max-restarts`` and writes ``launch/outcome.json`` with each worker's
rate, read from the tasks' progress events.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import signal
import time
from typing import Callable

from tfdist import protocol
from tfdist.launcher import faults as faultlib
from tfdist.launcher.injector import FaultInjector
from tfdist.launcher.restarter import TaskRestarter
from tfdist.launcher.slowdown import Slowdown
from tfdist.launcher import elastic, policy, processes
from tfdist.launcher import linktrace
from tfdist.launcher import traffic as trafficlib
from tfdist.launcher.config import LaunchConfig
from tfdist.launcher.hostcpus import HostCpus
from tfdist.launcher.memory import MemoryLimits, PeakMemory
from tfdist.launcher.processes import Placement, MemberProcess
from tfdist.launcher.state import JobState, RestartMember, SetLink, SignalMember, SlowMember, MemberView
from tfdist.protocol import Exit
from tfdist.strategies.kinds import StrategyKind


def decide(kind: StrategyKind, exits: dict[str, int | None]) -> int | None:
    """The job's exit code once it is known, else ``None`` (pure).

    Only the tasks whose exits the strategy kind says decide count (every
    task of a sync job; the chief under ps, whose servers stop when it is
    gone): the first failure among them decides, else their success.
    """
    # A deciding task ended by a signal (a kill, the OOM killer, its own
    # watchdog giving up on a peer) is, to the job, a lost task: the code
    # its survivors report, and a relaunch resumes from the checkpoint.
    deciding = [Exit.TASK_LOST if code is not None and code < 0 else code
                for name, code in exits.items() if policy.decides(kind, name)]
    failed = [code for code in deciding if code not in (None, 0)]
    if failed:
        return failed[0]
    if deciding and all(code == 0 for code in deciding):
        return 0
    return None


def storage_line(name: str, lines: list[str], relaunches: bool = False) -> str:
    """The launcher's one line for a task that ended with ``Exit.STORAGE`` (pure).

    The cause is read from the task's own ``error:`` line (``protocol``'s
    words); ``relaunches``: whether ``--max-restarts`` would have relaunched
    another failure.
    """
    said = next((line for line in reversed(lines) if line.startswith("error:")), "")
    cause = next((c for c in protocol.STORAGE_CAUSES if c in said),
                 "the disk is full or read-only")
    why = ("not relaunched under --max-restarts" if relaunches else "not relaunched") + \
        ": it would fail again until that is fixed"
    return (f"[launch] {name} exited with code {int(Exit.STORAGE)}: a write into --model-dir "
            f"failed, {cause} (its error line above names the file); {why}. Free space or make "
            "the directory writable, then run the same launch.py command to resume from the "
            "previous checkpoint")


class Supervisor:
    """One attempt of the job: its processes, their exits, the hooks' actions."""

    def __init__(self, kind: StrategyKind, starter: Callable[[str], MemberProcess], log=print,
                 grace: float = 5.0, poll: float = 0.1, slowdown=None, attempt: int = 0,
                 network=None, relaunches: bool = False, links_down=()):
        self.kind, self.starter, self.log = kind, starter, log
        self.relaunches = relaunches  # --max-restarts has relaunches left
        self.grace, self.poll, self.slowdown, self.attempt = grace, poll, slowdown, attempt
        self.network = network  # SimulatedHosts, for --partition
        self.members: dict[str, MemberProcess] = {}
        self.exits: dict[str, int | None] = {}
        self.starts: dict[str, int] = {}
        # What stop() must undo whatever happens: tasks hung by SIGSTOP (their
        # pid), hosts whose link is down.
        self.hung: dict[str, int] = {}
        self.links_down: set[int] = set(links_down)
        # --min-workers: a host cut off for good stays cut off between
        # attempts (the job re-forms without it); lifted when the job ends.
        self.keep_links = False

    # --- processes ---------------------------------------------------------------

    def start(self, names) -> None:
        for name in names:
            self._start(name)

    def _start(self, name: str) -> MemberProcess:
        member = self.starter(name)
        self.members[name] = member
        self.exits[name] = None
        self.starts[name] = self.starts.get(name, 0) + 1
        if self.slowdown is not None:
            self.slowdown.attach(name, member.proc.pid)
        return member

    def state(self) -> JobState:
        return JobState(tuple(MemberView(n, t.proc.pid, self.exits[n], self.starts[n])
                              for n, t in self.members.items()), self.attempt)

    def reap(self) -> None:
        for name, t in self.members.items():
            if self.exits[name] is None and (code := t.proc.poll()) is not None:
                self.exits[name] = code
                self.hung.pop(name, None)
                if code == Exit.STORAGE:
                    t.pump.join(timeout=2)  # its last lines (the error) may still be in the pipe
                    self.log(storage_line(name, t.lines, self.relaunches))
                    continue
                how = f" (killed by {signal.Signals(-code).name})" if code < 0 else ""
                self.log(f"[launch] {name} exited with code {code}{how}")

    def apply(self, action) -> None:
        if isinstance(action, SetLink):
            if self.network is None:
                raise RuntimeError(f"{action} without simulated hosts")
            self.network.set_link(action.host, action.up)
            (self.links_down.discard if action.up else self.links_down.add)(action.host)
            return
        member = self.members.get(action.member)
        if member is None:
            return
        if isinstance(action, SignalMember):
            if member.proc.poll() is not None or (action.pid is not None and action.pid != member.proc.pid):
                return  # gone, or already replaced by a restart
            if action.sig == signal.SIGSTOP:
                self.hung[action.member] = member.proc.pid
                if self.slowdown is not None:
                    self.slowdown.hold(action.member, member.proc.pid, held=True)
            if action.group:
                processes.signal_group(member.proc, action.sig)
            else:
                member.proc.send_signal(action.sig)
            if action.sig == signal.SIGCONT and self.hung.pop(action.member, None) is not None \
                    and self.slowdown is not None:
                self.slowdown.hold(action.member, member.proc.pid, held=False)
        elif isinstance(action, RestartMember):
            member.pump.join(timeout=5)
            new = self._start(action.member)
            ended = new.proc.poll()
            if ended is not None:
                # The engine could not start it again (a Ray task whose node is
                # gone): already ended, so no pid to name.
                self.log(f"[launch] could not restart {action.member}: it ended at once "
                         f"(code {ended})")
            else:
                self.log(f"[launch] restarted {action.member} (pid {new.proc.pid}), same TF_CONFIG"
                         + (f"; {action.note}" if action.note else ""))
        elif isinstance(action, SlowMember):
            if self.slowdown is None:
                raise RuntimeError(f"{action} without a Slowdown")
            self.slowdown.activate(action.member, action.fraction)
            if member.proc.poll() is None:
                self.slowdown.attach(action.member, member.proc.pid)
        else:
            raise TypeError(f"unknown action {action!r}")

    def stop(self) -> None:
        """Every task stopped: SIGTERM, then SIGKILL after ``grace``; before
        that, every hung task continued and every downed link brought up."""
        self.lift_all()
        if self.slowdown is not None:
            self.slowdown.resume()  # a stopped process cannot act on SIGTERM
        processes.stop_members(list(self.members.values()), grace=self.grace)

    def lift_all(self) -> None:
        """Undo every hang and partition still on: a stopped process cannot
        act on SIGTERM, and a relaunch needs its links."""
        for name, pid in list(self.hung.items()):
            self.log(f"[launch] {name} (pid {pid}) is still hung: SIGCONT before stopping it")
            member = self.members.get(name)
            if member is not None and member.proc.pid == pid:
                processes.signal_group(member.proc, signal.SIGCONT)  # its engine's way (Ray: the actor)
            else:
                try:
                    os.killpg(pid, signal.SIGCONT)
                except (ProcessLookupError, PermissionError):
                    pass
            del self.hung[name]
        if self.keep_links:
            return
        for host in sorted(self.links_down):
            self.log(f"[launch] host{host}'s link is still down: bringing it up")
            try:
                self.network.set_link(host, True)
            except (OSError, RuntimeError, ValueError) as err:  # the namespaces go with the holders
                self.log(f"[launch] warning: could not bring host{host}'s link up: {err}")
        self.links_down.clear()

    # --- the poll loop -------------------------------------------------------------

    def run(self, timeout: float | None, hooks=()) -> int:
        """Wait for the job's outcome (``timeout`` None: however long it takes); stop
        every task whatever it is."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        try:
            while True:
                self.reap()
                for hook in hooks:
                    for action in hook(self.state()):
                        self.apply(action)
                code = decide(self.kind, self.exits)
                if code is not None:
                    # The outcome is known: a task still hung or cut off
                    # could not checkpoint or see its chief gone.
                    self.lift_all()
                    if code == Exit.PREEMPTED:
                        # Every worker saves at the agreed step and exits by
                        # itself; a SIGTERM now would be read as another notice.
                        self.log("[launch] job preempted: waiting for every task to checkpoint "
                                 "and exit")
                        processes.wait_all(list(self.members.values()), self.grace)
                        self.reap()
                    elif code != 0:
                        self.log(f"[launch] job failed (exit {code}); stopping the other tasks")
                    else:
                        # Servers notice the chief is gone and exit on their own.
                        processes.wait_all(list(self.members.values()), self.grace)
                    return code
                if time.monotonic() > deadline:
                    self.log(f"[launch] error: job still running after --timeout={timeout:g}s; "
                             "stopping it")
                    return Exit.TIMEOUT
                time.sleep(self.poll)
        finally:
            self.stop()


# --- each worker's rate, from the progress events -------------------------------------------

def job_events(event_paths: dict[str, str]) -> dict[str, list[protocol.Event]]:
    """Every task's events file, read once at the job's end (the per-worker rates and
    the link trace's training span both come from them)."""
    return {n: protocol.read_all_events(p) for n, p in event_paths.items()}


def worker_rates(kind: StrategyKind, job: dict[str, list[protocol.Event]]) -> dict[str, dict]:
    """Each computing task's steps, share and steps/s, from its progress events
    (``job``: each task's events, ``job_events``).

    A task whose progress events carry ``steps_per_worker`` (the ps chief)
    speaks for every worker: local steps, their share of all steps, and a
    rate over the reports since that worker last (re)started. Otherwise
    each computing task reports its own steps and steps/s (synchronous
    workers all run every step: no share).
    """
    events = {n: [e for e in evs if e.kind in (protocol.STARTED, protocol.PROGRESS)]
              for n, evs in job.items()}
    reports = sorted((e.time, e.data["steps_per_worker"]) for evs in events.values() for e in evs
                     if e.kind == protocol.PROGRESS
                     and isinstance(e.data.get("steps_per_worker"), dict))
    rates: dict[str, dict] = {}
    if reports:
        t_last, last = reports[-1]
        total = sum(v for v in last.values() if isinstance(v, int))
        for worker, steps in last.items():
            first = len(reports) - 1
            while first > 0 and reports[first - 1][1].get(worker, -1) <= reports[first][1].get(worker, -1):
                first -= 1
            t0, n0 = reports[first][0], reports[first][1].get(worker, 0)
            rates[worker] = {"steps": steps, "share": round(steps / total, 4) if total else None,
                             "steps_per_sec": round((steps - n0) / (t_last - t0), 2)
                             if t_last > t0 else None}
        return rates
    for name, evs in events.items():
        if name.partition(":")[0] not in kind.computing_roles and not kind.single_process:
            continue
        # This process's last start (a relaunch appends to the same file):
        # from its first step on, start-up left out.
        starts = [i for i, e in enumerate(evs) if e.kind == protocol.STARTED]
        evs = evs[starts[-1]:] if starts else evs
        if not evs or evs[-1].kind != protocol.PROGRESS:
            continue
        first, last = evs[0], evs[-1]
        if last.time > first.time and last.step > first.step:
            rate = (last.step - first.step) / (last.time - first.time)
        else:
            rate = last.data.get("steps_per_sec")
        rates[name] = {"steps": last.step, "share": None,
                       "steps_per_sec": round(rate, 2) if isinstance(rate, (int, float)) else None}
    return rates


def describe_rates(rates: dict[str, dict]) -> str:
    parts, unknown = [], False
    for name, r in rates.items():
        known = r.get("steps_per_sec") is not None
        unknown = unknown or not known
        rate = f", {r['steps_per_sec']:.1f} steps/s" if known else ""
        if r.get("share") is not None:
            parts.append(f"{name} {r['steps']} local steps ({r['share']:.0%}){rate}")
        else:
            parts.append(f"{name} step {r['steps']}{rate}")
    if unknown:
        # A rate needs two progress reports of that worker since its last start.
        parts[-1] += " (steps/s needs two progress reports; a smaller --log-every gives them)"
    return "; ".join(parts)


# --- the job, with recovery ----------------------------------------------------------------

def run_job(config: LaunchConfig, command: list[str], env: dict[str, str], holder: list,
            log=print, launch_dir: str | None = None, network=None, link=None,
            engine=None) -> int:
    """Start, supervise and, under ``--max-restarts``, relaunch the job.

    ``holder`` gets the live Supervisor so the caller can stop it on an
    interrupt. A relaunch reuses every TF_CONFIG (same addresses, like a
    Kubernetes pod restarted under the same service names) and the same
    ``--model-dir``, so the tasks resume from the latest checkpoint.
    ``network`` (``SimulatedHosts``) puts each task in its host's namespace.
    ``engine`` (``ray_engine.RayEngine``) starts the tasks elsewhere instead: it
    places them (and builds their TF_CONFIGs) anew for each attempt.
    """
    names, recovery, started = config.names, config.recovery, time.time()
    cores, task_envs, paths = _member_envs(config, launch_dir)
    slowdown, limits, budgets = None, None, None
    if recovery.slow:
        total = os.cpu_count() or 1
        slowdown = Slowdown({n: cores[n].cores(total) for n in names}, log=log)
    try:
        limits = MemoryLimits(dict(config.memory_limits), log=log)
        if config.host_cpus is not None and engine is None:
            budgets = HostCpus(config.host_cpus, dict(config.cluster.host_of), log=log)
        injector, restarter = _hooks(config, slowdown, list(paths.values()), log)
        # VmHWM is read from this host's /proc: not for tasks on other nodes.
        peaks = PeakMemory() if engine is None else PeakMemory(read=lambda pid: None)

        membership = _membership(config, list(paths.values()), launch_dir, log, engine)
        # What each member starts with; --min-workers re-forms change it (_reform).
        formation = {"tf_configs": config.cluster.tf_configs, "command": command,
                     "env": membership.env() if membership is not None else {}}

        def starter(name: str) -> MemberProcess:
            cmd, task_env = formation["command"], {**task_envs[name], **formation["env"]}
            if engine is not None:
                return engine.start(name, cmd, env, task_env)
            place = Placement(
                netns=network.netns(config.cluster.host_of[name]) if network is not None else None,
                cgroup=slowdown.cgroup_for(name) if slowdown is not None else None,
                memory_cgroup=limits.cgroup_for(name), cpus=cores[name].cpus,
                host_cgroups=budgets.cgroups_for(name) if budgets is not None else ())
            return processes.start_member(name, formation["tf_configs"][name], cmd, env,
                                          task_env=task_env, place=place)

        # After the link probe (build_hosts), so only the job's bytes count.
        before = _counters(network, log)
        tracer = _start_link_trace(config, network)
        code, attempt = _attempts(config, starter, [injector, *filter(None, [restarter]), peaks],
                                  restarter, slowdown, holder, log, network=network,
                                  injector=injector, engine=engine, membership=membership,
                                  formation=formation, command=command)
        after = _counters(network, log) if before is not None else None
        events = job_events(paths)
        _finish_link_trace(tracer, config, launch_dir, events, log)
        oom, limited = limits.oom_killed(), limits.record()
        host_cpus = budgets.finish() if budgets is not None else None
    finally:
        for held in (slowdown, limits, budgets):  # their cgroups removed whatever happened
            if held is not None:
                held.close()
    restarts = sum(restarter.restarts.values()) if restarter is not None else 0
    _log_recovery(membership, injector, restarts, attempt, log)
    _log_memory(config, peaks, limited, oom, log)
    rates, scale = _rates(config, events, log), _scale(events, started, log)
    traffic = _traffic(config, before, after, log)
    if launch_dir is not None and os.path.isdir(launch_dir):
        plan, slowed = config.cluster, [str(s) for s in recovery.slow]
        _write_outcome(os.path.join(launch_dir, "outcome.json"), protocol.LaunchOutcome(
            int(code), list(injector.fired), restarts, attempt, per_task=rates or None,
            hosts={n: plan.where(n) for n in names} if plan.hosts else None,
            link=link, slowed=slowed or None, faults=list(injector.records) or None,
            traffic=traffic, peak_rss_bytes=peaks.peaks or None,
            memory_limits=limited or None, oom_killed=oom or None,
            restarts_per_task=dict(restarter.restarts) if restarter is not None and
            restarter.restarts else None,
            membership=membership.history if membership is not None else None,
            host_cpus=host_cpus, **scale), log)
    return code


def _rates(config: LaunchConfig, events: dict, log) -> dict:
    rates = worker_rates(config.kind, events) if events else {}
    if rates:
        log(f"[launch] per worker: {describe_rates(rates)}")
    return rates


def _scale(events: dict[str, list[protocol.Event]], started: float, log) -> dict:
    """What a job's size costs before and around its steps: the seconds from the
    launcher starting the members to the first member's first step (its
    ``started`` event: after its first call, start-up and tracing included), and
    the launcher's own CPU time (its polling, pumps and hooks; the members' not)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    firsts = [e.time for evs in events.values() for e in evs if e.kind == protocol.STARTED]
    first = round(min(firsts) - started, 1) if firsts else None
    cpu = round(usage.ru_utime + usage.ru_stime, 2)
    log(f"[launch] launcher CPU {cpu:g} s" + (f"; first step {first:g} s after the members "
                                              "were started" if first is not None else ""))
    return {"first_step_seconds": first, "launcher_cpu_seconds": cpu}


def _member_envs(config: LaunchConfig, launch_dir: str | None):
    """Each member's cores, its extra environment (thread pools; its events file when
    there is a launch directory) and its events file's path."""
    names = config.names
    cores = config.cores or processes.share_cores(config.kind, names, os.cpu_count() or 1)
    task_envs = {n: dict(cores[n].env) for n in names}
    paths: dict[str, str] = {}
    if launch_dir is not None:
        for name in names:
            paths[name] = protocol.events_path(launch_dir, name)
            task_envs[name][protocol.EVENTS_ENV] = paths[name]
    return cores, task_envs, paths


def _log_recovery(membership, injector, restarts: int, attempt: int, log) -> None:
    """The launcher's lines on recovery: membership changes, faults, restarts, relaunches."""
    if membership is not None and len(membership.history) > 1:
        log("[launch] membership: " + " -> ".join(
            f"{h['workers']} from step {h['step']}" for h in membership.history))
    log(f"[launch] recovery: faults injected {len(injector.fired)}, task restarts {restarts}, "
        f"job relaunches {attempt}")
    if injector.waiting:
        log("[launch] never due (the job ended first): "
            + ", ".join(str(f) for f in injector.waiting))


def _log_memory(config: LaunchConfig, peaks, limited: dict, oom: dict, log) -> None:
    """The launcher's lines on memory: each member's peak, its limit's use, its OOM kills."""
    if peaks.peaks:
        log(f"[launch] peak memory (resident): {peaks.describe()}")
    if limited:
        log("[launch] most memory charged, of its --memory-limit: " + ", ".join(
            f"{n} {r['max_usage_bytes'] / 2**20:.0f} of {r['limit_bytes'] / 2**20:.0f} MiB"
            for n, r in limited.items() if r["max_usage_bytes"] is not None))
    for name, count in oom.items():
        log(f"[launch] {name} was ended by the kernel's OOM killer {count} time(s): its "
            f"--memory-limit of {config.memory_limits[name] / 2**20:.0f} MiB is too small "
            "for what it holds (more ps tasks split the variables further)")


def _write_outcome(path: str, outcome: protocol.LaunchOutcome, log) -> None:
    try:
        outcome.write(path)
    except OSError as err:
        # The run directory full or read-only (often why the job ended):
        # the job's exit code says what happened all the same.
        log(f"[launch] warning: could not write {path} ({err.strerror or err}); the "
            f"job's exit code is {outcome.exit_code} all the same")


def _counters(network, log) -> dict | None:
    """Every simulated host's byte counters, or ``None`` (no hosts, or unreadable:
    the job's outcome is written all the same, without ``traffic``)."""
    if network is None:
        return None
    try:
        return network.counters()
    except (OSError, KeyError, ValueError) as err:
        log(f"[launch] warning: could not read the hosts' byte counters ({err!r}); "
            "outcome.json will have no traffic")
        return None


def _start_link_trace(config: LaunchConfig, network) -> linktrace.LinkTrace | None:
    """``--link-trace``: sampling every host's link from here to the job's end."""
    if not config.link_trace or network is None:
        return None
    return linktrace.LinkTrace(config.cluster.hosts).start()


def _traffic(config: LaunchConfig, before, after, log) -> dict | None:
    """The job's bytes per step on each host's link, from the counters read before and
    after it (None without ``--hosts``, or when they could not be read)."""
    if after is None:
        return None
    steps, shares = _chief_steps(config.model_dir)
    traffic = trafficlib.measured_record(before, after, steps, dict(config.cluster.host_of),
                                         config.kind.trainer, shares)
    log(trafficlib.describe(traffic))
    return traffic


def _finish_link_trace(tracer, config: LaunchConfig, launch_dir: str | None,
                       job: dict[str, list[protocol.Event]], log) -> None:
    """``launch/link_trace.json`` and the launcher's one line on it (``--link-trace``)."""
    if tracer is None:
        return
    trace = tracer.stop()
    plan = config.cluster
    host_tasks = {f"host{i}": [n for n, h in plan.host_of.items() if h == i]
                  for i in range(plan.hosts)}
    events = [(e.kind, e.time) for evs in job.values() for e in evs]
    trace = {**trace, "rate_bits_per_sec": config.rate_bits, "host_tasks": host_tasks,
             "training_seconds": linktrace.training_span(events, trace["wall_start"])}
    if launch_dir is None or not os.path.isdir(launch_dir):
        return
    path = os.path.join(launch_dir, "link_trace.json")
    try:
        with open(path, "w") as f:
            json.dump(trace, f, separators=(",", ":"))
    except OSError as err:
        log(f"[launch] warning: could not write {path} ({err.strerror or err})")
        return
    if trace.get("truncated"):
        log(f"[launch] link trace: sampled the first {linktrace.MAX_SECONDS:.0f} s only")
    seconds = trace["seconds"][-1] if trace["seconds"] else 0.0
    log(linktrace.describe(linktrace.summary(trace, config.rate_bits), seconds, host_tasks))


def _chief_steps(model_dir: str) -> tuple[int | None, dict | None]:
    """The steps the chief's final run made and, under ps, each worker's share
    of them (``results.json``); ``None`` for what it does not say."""
    try:
        with open(os.path.join(model_dir, "results.json")) as f:
            results = json.load(f)
    except (OSError, ValueError):
        return None, None
    steps, per_worker = results.get("steps_this_run"), results.get("steps_per_worker")
    steps = steps if isinstance(steps, int) and steps > 0 else None
    shares = None
    if isinstance(per_worker, dict) and per_worker:
        total = sum(v for v in per_worker.values() if isinstance(v, int))
        if total > 0:
            shares = {w: round(v / total, 4) for w, v in per_worker.items() if isinstance(v, int)}
    return steps, shares


def _hooks(config: LaunchConfig, slowdown, event_paths: list[str], log):
    """The fault injector (slow-downs from the start are applied here) and the task restarter."""
    recovery = config.recovery
    for slow in recovery.slow:
        if slow.from_start:
            slowdown.activate(slow.member, slow.fraction)
            log(f"[launch] slow: {slowdown.describe(slow.member)}")
    injector = FaultInjector(
        [*recovery.faults, *(s for s in recovery.slow if not s.from_start)],
        log=log, grace=config.grace, event_paths=event_paths)
    restarter = TaskRestarter(
        recovery.restart_delay, log=log, roles=config.kind.restartable_roles,
        event_paths=event_paths,
    ) if recovery.restart_tasks else None
    return injector, restarter


def _attempts(config: LaunchConfig, starter, hooks, restarter, slowdown, holder,
              log, network=None, injector=None, engine=None, membership=None,
              formation=None, command=None) -> tuple[int, int]:
    """Run the job, relaunching it under ``--max-restarts``: its last code and the relaunches.

    Under ``--min-workers`` (``membership``) an attempt may end in a re-formed
    cluster instead (``_reform``), which is not a relaunch.
    """
    recovery, attempt, reforms, links = config.recovery, 0, 0, set()
    while True:
        if restarter is not None:
            restarter.new_attempt()
        sup = Supervisor(config.kind, starter, log=log, grace=config.grace,
                         slowdown=slowdown, attempt=attempt + reforms, network=network,
                         relaunches=attempt < recovery.max_restarts, links_down=links)
        holder[:] = [sup]
        if engine is not None:
            engine.new_attempt(attempt + reforms)
        names, attempt_hooks = config.names, hooks
        if membership is not None:
            sup.keep_links = True
            membership.new_attempt(lambda: sup.links_down)
            names, attempt_hooks = membership.names, [*hooks, membership]
        sup.start(names)
        try:
            code = sup.run(config.timeout, attempt_hooks)
        finally:
            if injector is not None:
                # sup.run's stop() lifted what was still on (a partition for
                # good stays under --min-workers: the job re-forms without it).
                injector.end_attempt(keep_partitions=membership is not None)
        if membership is not None:
            code = _reform(config, membership, code, sup, injector, formation, command, log)
            if code is None:
                reforms += 1
                links = set(sup.links_down)
                continue
            sup.keep_links = False
            sup.lift_all()
            links = set()
            if injector is not None:
                injector.end_attempt()
        if not faultlib.should_relaunch(code, attempt, recovery.max_restarts):
            return code, attempt
        attempt += 1
        log(f"[launch] relaunching the job ({attempt} of --max-restarts="
            f"{recovery.max_restarts}) after exit {code}, in {recovery.restart_delay:g}s; "
            "it resumes from its checkpoint")
        time.sleep(recovery.restart_delay)


def _membership(config: LaunchConfig, event_paths: list[str], launch_dir: str | None, log,
                engine=None):
    """--min-workers: the membership hook, or ``None``."""
    if config.elastic is None:
        return None
    record = os.path.join(launch_dir, "membership.json") if launch_dir else None
    if engine is not None:  # the engine's nodes, not simulated hosts, come and go
        return engine.elastic_membership(config.elastic, event_paths, record, log)
    return elastic.Membership(
        config.elastic, config.names, dict(config.cluster.host_of), config.cluster.tf_configs,
        event_paths, log, record_path=record, live=config.kind.asynchronous)


def _reform(config: LaunchConfig, membership, code: int, sup: Supervisor, injector,
            formation: dict, command: list[str], log) -> int | None:
    """After an elastic attempt: ``None`` when the cluster is re-formed (the
    next attempt starts the new members), else the code to go on with."""
    def wait_links(seconds: float) -> None:
        # The fault schedule goes on while a lost host may come back.
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if injector is not None:
                for action in injector(JobState((), sup.attempt)):
                    if isinstance(action, SetLink):
                        sup.apply(action)
            if not any(membership.host_of.get(w) in sup.links_down for w in membership.lost):
                return
            time.sleep(sup.poll)

    before = list(membership.members)
    code = membership.after_attempt(code, wait_links)
    if code is not None:
        return code
    # Decided at launch (job.pin_elastic_batch) and in every formation's command;
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
    member = dataclasses.replace(config.member, options=options)
    formation.update(tf_configs=membership.configs(),
                     command=processes.task_command(config.kind, member, program=config.program),
                     env=membership.env())
    return None


def interrupted(holder: list, received: list) -> int:
    """Stop every task after a signal to the launcher; the exit code a shell would report."""
    for sup in holder:
        sup.keep_links = False  # the launcher ends: every link up again
        sup.stop()
    # As a shell reports a process ended by that signal: 143 for SIGTERM.
    return 128 + received[0] if received else Exit.INTERRUPTED

