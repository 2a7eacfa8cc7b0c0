"""What a job did, at its end: each worker's rate, the traffic, the link trace, memory,
recovery, and ``launch/outcome.json`` (``protocol.LaunchOutcome``).

Read from the members' progress events and records, never their human text.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass

from tfdist import protocol
from tfdist.launcher.machine import linktrace
from tfdist.launcher.machine import traffic as trafficlib
from tfdist.launcher.config import LaunchConfig
from tfdist.strategies.kinds import StrategyKind


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


def rates_of(config: LaunchConfig, events: dict, log) -> dict:
    rates = worker_rates(config.kind, events) if events else {}
    if rates:
        log(f"[launch] per worker: {describe_rates(rates)}")
    return rates


def scale(events: dict[str, list[protocol.Event]], started: float, log) -> dict:
    """What a job's size costs before and around its steps: the seconds from the
    launcher starting the members to the first member's first step (its
    ``started`` event: after its first call, start-up and tracing included), the
    launcher's own CPU time (its polling, pumps and hooks; the members' not), and
    the job's wall time from the members' start to now (its end)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    firsts = [e.time for evs in events.values() for e in evs if e.kind == protocol.STARTED]
    first = round(min(firsts) - started, 1) if firsts else None
    cpu = round(usage.ru_utime + usage.ru_stime, 2)
    wall = round(time.time() - started, 1)
    log(f"[launch] launcher CPU {cpu:g} s over {wall:g} s" + (
        f"; first step {first:g} s after the members were started" if first is not None else ""))
    return {"first_step_seconds": first, "launcher_cpu_seconds": cpu, "job_seconds": wall}


def log_recovery(membership, injector, restarts: int, attempt: int, log) -> None:
    """The launcher's lines on recovery: membership changes, faults, restarts, relaunches."""
    if membership is not None and len(membership.history) > 1:
        log("[launch] membership: " + " -> ".join(
            f"{h['workers']} from step {h['step']}" for h in membership.history))
    log(f"[launch] recovery: faults injected {len(injector.fired)}, task restarts {restarts}, "
        f"job relaunches {attempt}")
    if injector.waiting:
        log("[launch] never due (the job ended first): "
            + ", ".join(str(f) for f in injector.waiting))


def log_memory(config: LaunchConfig, peaks, limited: dict, oom: dict, log) -> None:
    """The launcher's lines on memory: each member's peak (``peaks``: the
    ``memory.PeakMemory`` hook), its limit's use, its OOM kills."""
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


def write_outcome(path: str, outcome: protocol.LaunchOutcome, log) -> None:
    try:
        outcome.write(path)
    except OSError as err:
        # The run directory full or read-only (often why the job ended):
        # the job's exit code says what happened all the same.
        log(f"[launch] warning: could not write {path} ({err.strerror or err}); the "
            f"job's exit code is {outcome.exit_code} all the same")


def counters(network, log) -> dict | None:
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


def start_link_trace(config: LaunchConfig, network) -> linktrace.LinkTrace | None:
    """``--link-trace``: sampling every host's link from here to the job's end."""
    if not config.link_trace or network is None:
        return None
    return linktrace.LinkTrace(config.plan.hosts).start()


def traffic_record(config: LaunchConfig, before, after, log) -> dict | None:
    """The job's bytes per step on each host's link, from the counters read before and
    after it (None without ``--hosts``, or when they could not be read)."""
    if after is None:
        return None
    steps, shares = _chief_steps(config.model_dir)
    traffic = trafficlib.measured_record(before, after, steps, dict(config.plan.host_of),
                                         config.kind.trainer, shares)
    log(trafficlib.describe(traffic))
    return traffic


def finish_link_trace(tracer, config: LaunchConfig, launch_dir: str | None,
                       job: dict[str, list[protocol.Event]], log) -> None:
    """``launch/link_trace.json`` and the launcher's one line on it (``--link-trace``)."""
    if tracer is None:
        return
    trace = tracer.stop()
    plan = config.plan
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


@dataclass(frozen=True)
class JobFigures:
    """What the job's end measured, for its outcome: every member's events, when the
    members were started (wall time), each member's peak memory, each limited
    member's charge and OOM kills, the traffic record, the hosts' CPU budgets."""

    events: dict
    started: float
    peaks: object  # memory.PeakMemory
    limited: dict
    oom: dict
    traffic: dict | None = None
    host_cpus: dict | None = None


def finish(run, code: int, figures: JobFigures) -> None:
    """The launcher's closing lines and ``launch/outcome.json`` (``run``: the attempts'
    ``RunContext``)."""
    config, log = run.config, run.log
    injector, restarter, membership = run.injector, run.restarter, run.membership
    restarts = sum(restarter.restarts.values()) if restarter is not None else 0
    log_recovery(membership, injector, restarts, run.relaunches, log)
    log_memory(config, figures.peaks, figures.limited, figures.oom, log)
    rates = rates_of(config, figures.events, log)
    scale_ = scale(figures.events, figures.started, log)
    launch_dir = config.launch_dir
    if not os.path.isdir(launch_dir):
        return
    plan, slowed = config.plan, [str(s) for s in config.recovery.slow]
    write_outcome(os.path.join(launch_dir, "outcome.json"), protocol.LaunchOutcome(
        int(code), list(injector.fired), restarts, run.relaunches, per_task=rates or None,
        hosts={n: plan.where(n) for n in config.names} if plan.hosts else None,
        link=run.engine.link, slowed=slowed or None, faults=list(injector.records) or None,
        traffic=figures.traffic, peak_rss_bytes=figures.peaks.peaks or None,
        memory_limits=figures.limited or None, oom_killed=figures.oom or None,
        restarts_per_task=dict(restarter.restarts) if restarter is not None and
        restarter.restarts else None,
        membership=membership.history if membership is not None else None,
        host_cpus=figures.host_cpus, evaluators=_evaluators(run, log), **scale_), log)


def _evaluators(run, log) -> dict | None:
    """The sidecar evaluators' fate in the last attempt (``--evaluator``), and one line."""
    found = run.supervisor.evaluators if run.supervisor is not None else {}
    for name, status in found.items():
        log(f"[launch] {name}: {status['status']}"
            + (f" (exit {status['exit_code']})" if status["exit_code"] else "")
            + "; the job's exit code is training's")
    return found or None
