"""Soak: back-to-back training jobs with random faults, checked and counted.

    python -m tfdist.cli.tools.soak --jobs 3                      # one job each of multiworker, ps, ps-sync
    python -m tfdist.cli.tools.soak --jobs 60 --seed 7 --out runs/soak-60

Jobs go round-robin over ``--strategies`` (default multiworker, ps, ps-sync,
mirrored). Each runs under ``launch.py`` with 1-3 faults drawn from the
ones ``launcher/policy.py: survivable_faults`` says its strategy kind
survives (kill, preempt, a bounded hang, a short partition of a worker's
host under ``--hosts``, the loss of a ps task), each at a random step, and
every recovery mechanism on (``--restart-tasks`` where workers may rejoin,
``--max-restarts``). After each job the soak checks, from typed records
only (``outcome.json``, ``results.json``, the progress events):

- **correct**: exit 0, every requested step done exactly (under
  asynchronous ps: applied >= scheduled), test accuracy over the floor,
  and every relaunch resumed from the newest checkpoint its earlier
  attempts saved (after a preemption: exactly the step it saved at);
- **steps lost beyond the promise**: per relaunch, the steps the lead task
  had reached but the relaunch redid, over what docs/reliability.md
  promises: 0 after a preemption, ``--checkpoint-every`` after anything
  else;
- **hung**: the job did not end within ``--job-timeout``;
- **left behind**: processes, network namespaces and cgroups of the job
  still there after it ended.

It prints one line per job and a table per strategy and fault kind, writes
``soak.md`` and ``soak.json`` to ``--out``, and exits 1 if any job was not
correct, hung, lost steps beyond the promise or left anything behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from tfdist import protocol
from tfdist.bench.common import LAUNCH, ROOT
from tfdist.launcher import policy
from tfdist.launcher.machine import cgroups
from tfdist.launcher.plan import place_members
from tfdist.linux import live_processes
from tfdist.strategies import ConfigError, kinds
from tfdist.strategies.kinds import StrategyKind
from tfdist.strategies.tf_config import TRAINING_ROLES

DEFAULT_STRATEGIES = "multiworker,ps,ps-sync,mirrored"
# The fault kinds, in the table's order; "ps loss" is a kill of a ps task.
FAULT_KINDS = ("kill", "preempt", "hang", "partition", "ps loss")
CHECKPOINT_EVERY = 200
LOG_EVERY = 50
FAULT_FLAGS = ("--kill", "--preempt", "--hang", "--partition")
# Set in each job's launcher and inherited by every process it starts (tasks,
# the namespace holders): what the leftover scan looks for.
MARKER_ENV = "SHOWCASE_SOAK_JOB"
# The tasks whose events say where the run is: the one that writes results.json.
LEAD_TASKS = ("chief:0", "worker:0", "local:0")


# --- the faults -------------------------------------------------------------------

@dataclass(frozen=True)
class DrawnFault:
    kind: str  # one of FAULT_KINDS
    action: str  # the launcher flag: kill, preempt, hang, partition
    target: str  # a task; for a partition, the worker whose host is cut off
    step: int
    seconds: int | None = None  # a hang's or partition's duration

    def flag(self, host_of: dict[str, int] | None = None) -> str:
        target = self.target
        if self.action == "partition":
            target = f"host{(host_of or {})[self.target]}"
        lasting = f"+{self.seconds}" if self.seconds is not None else ""
        return f"--{self.action}={target}@step={self.step}{lasting}"


def fault_kind(action: str, member: str) -> str:
    """The table's fault kind: a kill of a task that trains on no role
    (a ps task, holding variables) is a "ps loss"."""
    role = member.partition(":")[0]
    return "ps loss" if action == "kill" and role not in (*TRAINING_ROLES, "local") else action


def pick_faults(rng: random.Random, kind: StrategyKind, steps: int,
                most: int = 3) -> list[DrawnFault]:
    """1..``most`` distinct faults the kind survives, each at a step in
    [100, steps - 100); a hang or partition lasts a drawn, bounded time."""
    pool = list(policy.survivable_faults(kind, hosts=not kind.single_process))
    chosen = rng.sample(pool, min(len(pool), rng.randint(1, most)))
    faults = []
    for action, member in chosen:
        span = policy.LASTING_SECONDS.get(action)
        faults.append(DrawnFault(fault_kind(action, member), action, member,
                                 rng.randrange(100, steps - 100),
                                 rng.randint(*span) if span else None))
    return sorted(faults, key=lambda f: f.step)


def hosts_for(kind: StrategyKind, faults: list[DrawnFault]) -> tuple[int | None, dict | None]:
    """``--hosts`` for a job with a partition (each cut-off worker alone on
    its host; the fewest hosts that do it) and where each task runs;
    ``(None, None)`` without one."""
    cut = {f.target for f in faults if f.action == "partition"}
    if not cut:
        return None, None
    names = policy.soak_tasks(kind)
    for hosts in range(2, len(names) + 1):
        host_of = place_members(kind, names, hosts)
        if all(sum(1 for h in host_of.values() if h == host_of[t]) == 1 for t in cut):
            return hosts, host_of
    raise ConfigError(f"no --hosts puts {sorted(cut)} alone on a host under {kind.name}")


def job_command(kind: StrategyKind, faults: list[DrawnFault], steps: int, model_dir: str,
                timeout: float) -> list[str]:
    recovery = ["--max-restarts", "3", "--restart-delay", "1"]
    layout = ["--workers", "1" if kind.single_process else "2", "--ps", str(kind.min_ps)]
    if kind.restartable_roles:
        recovery.append("--restart-tasks")
    hosts, host_of = hosts_for(kind, faults)
    if hosts is not None:
        layout += ["--hosts", str(hosts)]
    return [sys.executable, LAUNCH, "--strategy", kind.name, *layout,
            "--grace", "5", "--timeout", f"{timeout:g}", *recovery,
            *(f.flag(host_of) for f in faults), "--",
            "--model", "logreg", "--steps", str(steps), "--log-every", str(LOG_EVERY),
            "--checkpoint-every", str(CHECKPOINT_EVERY), "--steps-per-execution", "5",
            "--model-dir", model_dir]


# --- the checks (pure: records in, findings out) --------------------------------------

@dataclass(frozen=True)
class Attempt:
    """One run of the lead task that got past its first call (a STARTED event)."""

    resumed_from: int
    reached: int  # the furthest step its events name
    preempted_at: int | None  # its PREEMPTED event's step (the checkpoint it saved)
    checkpoints: tuple[int, ...]


def attempts_from_events(events: list[protocol.Event]) -> list[Attempt]:
    """The lead task's events, one attempt per process: from each STARTED
    (its first call done), plus a process preempted before its STARTED
    (its PREEMPTED names another pid)."""
    out: list[dict] = []

    def begin(e: protocol.Event) -> None:
        start = e.data.get("resumed_from")
        out.append({"pid": e.data.get("pid"), "reached": e.step or 0, "preempted_at": None,
                    "resumed_from": int(start) if start is not None else -1, "checkpoints": []})

    for e in events:
        if e.kind == protocol.STARTED:
            begin(e)
        elif e.kind == protocol.PREEMPTED and (not out or e.data.get("pid") != out[-1]["pid"]):
            begin(e)
            out[-1]["preempted_at"] = e.step
        elif out and isinstance(e.step, int):
            cur = out[-1]
            cur["reached"] = max(cur["reached"], e.step)
            if e.kind == protocol.CHECKPOINT:
                cur["checkpoints"].append(e.step)
            elif e.kind == protocol.PREEMPTED:
                cur["preempted_at"] = e.step
    return [Attempt(a["resumed_from"], a["reached"], a["preempted_at"], tuple(a["checkpoints"]))
            for a in out]


@dataclass(frozen=True)
class Relaunch:
    resumed_from: int
    expected: int  # the newest checkpoint the earlier attempts saved (0: none)
    redone: int  # steps reached before that this attempt ran again
    allowed: int  # what docs/reliability.md promises: 0 after a preemption
    reached: int = 0  # the furthest step the attempts before it reached (from their events)

    @property
    def beyond(self) -> int:
        return max(0, self.redone - self.allowed)


def relaunches(attempts: list[Attempt], checkpoint_every: int) -> list[Relaunch]:
    """Each later attempt against the one before it.

    A relaunch resumes from the newest checkpoint saved before it and redoes
    the steps between there and the furthest step the attempt before it
    reached. The promise (docs/reliability.md): none after a preemption (the
    attempt saved where it stopped), at most ``checkpoint_every`` after
    anything else. ``reached`` comes from the progress events (every
    ``--log-every`` steps), so ``redone`` may be under the truth by less
    than that, never over it.
    """
    out = []
    for i in range(1, len(attempts)):
        before, a = attempts[i - 1], attempts[i]
        newest = max((c for b in attempts[:i] for c in b.checkpoints), default=0)
        out.append(Relaunch(a.resumed_from, newest, max(0, before.reached - a.resumed_from),
                            0 if before.preempted_at is not None else checkpoint_every,
                            max(b.reached for b in attempts[:i])))
    return out


@dataclass
class Left:
    processes: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.processes) + len(self.namespaces) + len(self.cgroups)


@dataclass
class Job:
    index: int
    strategy: str
    faults: list[DrawnFault]
    flags: list[str]  # the faults as the launcher got them
    command: list[str]
    log: str
    code: int | None = None
    seconds: float = 0.0
    hung: bool = False
    injected: list[dict] = field(default_factory=list)  # outcome.json's fault records
    task_restarts: int = 0
    job_relaunches: int = 0
    relaunches: list[Relaunch] = field(default_factory=list)
    test_accuracy: float | None = None
    left: Left = field(default_factory=Left)
    problems: list[str] = field(default_factory=list)  # what makes the job not correct

    @property
    def kinds(self) -> list[str]:
        return sorted({f.kind for f in self.faults}, key=FAULT_KINDS.index)

    @property
    def steps_beyond(self) -> int:
        return sum(r.beyond for r in self.relaunches)

    @property
    def correct(self) -> bool:
        return not self.problems and not self.hung

    @property
    def ok(self) -> bool:
        return self.correct and self.steps_beyond == 0 and self.left.count == 0

    def injected_of(self, kind: str) -> int:
        return sum(1 for r in self.injected
                   if fault_kind(r.get("kind", ""), r.get("target", "")) == kind)


def check_records(job: Job, steps: int, floor: float, outcome: protocol.LaunchOutcome | None,
                  results: protocol.Results | None, events: list[protocol.Event]) -> None:
    """Fill ``job``'s findings from its records (pure)."""
    if outcome is None:
        job.problems.append("no readable launch/outcome.json")
    else:
        job.injected = list(outcome.faults or [])
        job.task_restarts, job.job_relaunches = outcome.task_restarts, outcome.job_relaunches
    if job.code != 0 and not job.hung:
        job.problems.append(f"exit code {job.code}")
    if results is None:
        job.problems.append("no readable results.json")
    else:
        if results.completed_steps != steps:
            job.problems.append(f"completed {results.completed_steps} steps of {steps}")
        if results.applied_steps is not None and results.scheduled_steps is not None:
            # Asynchronous: a lost worker's closure may apply steps twice, never fewer.
            if results.applied_steps < results.scheduled_steps:
                job.problems.append(f"applied {results.applied_steps} < scheduled "
                                    f"{results.scheduled_steps}: a step is missing")
        elif results.global_steps != steps:
            job.problems.append(f"global step {results.global_steps} != {steps}")
        job.test_accuracy = results.test_accuracy
        if results.test_accuracy is None or results.test_accuracy < floor:
            job.problems.append(f"test accuracy {results.test_accuracy} under the floor {floor}")
    attempts = attempts_from_events(events)
    if not attempts and results is not None:
        job.problems.append("the lead task's events have no STARTED")
    job.relaunches = relaunches(attempts, CHECKPOINT_EVERY)
    for r in job.relaunches:
        # Newer than the newest CHECKPOINT event is right when a save completed
        # as a task was lost, before its event: seen when ps:0 was killed during
        # the save (under ps, a ps's share is written by the ps itself). Older
        # loses a checkpoint; past what the attempts before reached (their events
        # come every LOG_EVERY steps) cannot have been saved by them.
        if r.resumed_from < r.expected:
            job.problems.append(f"a relaunch resumed from step {r.resumed_from}, the newest "
                                f"checkpoint was at {r.expected}")
        elif r.resumed_from > r.reached + LOG_EVERY:
            job.problems.append(f"a relaunch resumed from step {r.resumed_from}, past step "
                                f"{r.reached}, the furthest the attempts before it reached")
    if results is not None and attempts and results.resumed_from_step != attempts[-1].resumed_from:
        job.problems.append(f"results.json resumed from {results.resumed_from_step}, its "
                            f"STARTED event from {attempts[-1].resumed_from}")


# --- what a job leaves behind -----------------------------------------------------

def _marked(marker: str, model_dir: str) -> list[tuple[int, str]]:
    """Live processes carrying the job's marker in their environment or its
    model dir in their command line (this process left out)."""
    tag = f"{MARKER_ENV}={marker}".encode()
    return [(pid, cmd) for pid, cmd, env in live_processes(environ=True)
            if tag in env or model_dir in cmd]


def _netns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _cgroup_dirs() -> set[str]:
    found = set()
    for controller in ("cpu", "memory"):
        root = cgroups.cgroup_root(controller)
        if root and os.path.isdir(root):
            found |= {os.path.join(root, d) for d in os.listdir(root)
                      if d.startswith(cgroups.CGROUP_PREFIX)}
    return found


def _named_netns() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except OSError:
        return set()


@dataclass(frozen=True)
class Before:
    cgroups: frozenset
    named_netns: frozenset


def snapshot() -> Before:
    return Before(frozenset(_cgroup_dirs()), frozenset(_named_netns()))


def left_behind(marker: str, model_dir: str, before: Before, settle: float = 10.0) -> Left:
    """What the ended job still holds, after up to ``settle`` s for it to go:
    its processes; the network namespaces only they hold (a namespace
    without a process is gone, unless named in /run/netns); the launcher's
    ``showcase-*`` cgroups that appeared during the job and whose launcher
    is gone."""
    deadline = time.monotonic() + settle
    while (procs := _marked(marker, model_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    mine = _netns("self")
    spaces = sorted({ns for pid, _ in procs if (ns := _netns(pid)) and ns != mine})
    spaces += sorted(f"/run/netns/{n}" for n in _named_netns() - before.named_netns)

    def launcher_gone(path: str) -> bool:
        pid = os.path.basename(path)[len(cgroups.CGROUP_PREFIX):].split("-", 1)[0]
        return not (pid.isdigit() and os.path.exists(f"/proc/{pid}"))

    groups = sorted(p for p in _cgroup_dirs() - before.cgroups if launcher_gone(p))
    return Left([f"{pid}: {cmd[:200]}" for pid, cmd in procs], spaces, groups)


# --- one job ----------------------------------------------------------------------

def lead_events(launch_dir: str) -> list[protocol.Event]:
    for member in LEAD_TASKS:
        path = protocol.events_path(launch_dir, member)
        if os.path.exists(path):
            return protocol.read_all_events(path)
    return []


def _load(loader, path):
    try:
        return loader(path)
    except (OSError, ValueError, TypeError):
        return None


def run_job(index: int, kind: StrategyKind, rng: random.Random, config: "SoakConfig") -> Job:
    model_dir = os.path.abspath(os.path.join(config.out, f"{index:03d}-{kind.name}"))
    faults = pick_faults(rng, kind, config.steps, config.max_faults)
    command = job_command(kind, faults, config.steps, model_dir, config.job_timeout)
    job = Job(index, kind.name, faults, [a for a in command if a.startswith(FAULT_FLAGS)],
              command, f"{model_dir}.log")
    marker = f"{os.getpid()}-{index}"
    before = snapshot()
    started = time.monotonic()
    with open(job.log, "w") as log:
        proc = subprocess.Popen(job.command, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True,
                                env={**os.environ, MARKER_ENV: marker})
        try:
            # The launcher's own --timeout bounds each attempt; this bounds the job.
            job.code = proc.wait(timeout=config.job_timeout)
        except subprocess.TimeoutExpired:
            job.hung = True
            proc.send_signal(signal.SIGTERM)  # the launcher stops its tasks
            try:
                job.code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                job.code = proc.wait()
    job.seconds = time.monotonic() - started
    if job.code == protocol.Exit.TIMEOUT:
        job.hung = True
    launch_dir = os.path.join(model_dir, "launch")
    check_records(job, config.steps, config.accuracy_floor,
                  _load(protocol.LaunchOutcome.load, os.path.join(launch_dir, "outcome.json")),
                  _load(protocol.Results.load, os.path.join(model_dir, "results.json")),
                  lead_events(launch_dir))
    job.left = left_behind(marker, model_dir, before)
    return job


# --- the report -------------------------------------------------------------------

COLUMNS = ("strategy", "fault", "jobs", "correct", "drawn", "injected", "survived",
           "steps lost beyond promise", "hung", "left: processes", "left: namespaces",
           "left: cgroups")


def table_rows(jobs: list[Job], strategies: list[str]) -> list[dict]:
    """Per strategy, one row per fault kind its jobs had (a job with several
    kinds counts in each of them) and an ``all`` row counting each job once."""
    rows = []
    for name in strategies:
        mine = [j for j in jobs if j.strategy == name]
        for kind in [*FAULT_KINDS, "all"]:
            these = mine if kind == "all" else [j for j in mine if kind in j.kinds]
            if not these:
                continue

            def faults(j: Job, injected: bool) -> int:
                if kind == "all":
                    return len(j.injected) if injected else len(j.faults)
                return j.injected_of(kind) if injected else sum(f.kind == kind for f in j.faults)

            rows.append({
                "strategy": name, "fault": kind, "jobs": len(these),
                "correct": sum(j.correct for j in these),
                "drawn": sum(faults(j, False) for j in these),
                "injected": sum(faults(j, True) for j in these),
                "survived": sum(faults(j, True) for j in these if j.correct),
                "steps lost beyond promise": sum(j.steps_beyond for j in these),
                "hung": sum(j.hung for j in these),
                "left: processes": sum(len(j.left.processes) for j in these),
                "left: namespaces": sum(len(j.left.namespaces) for j in these),
                "left: cgroups": sum(len(j.left.cgroups) for j in these),
            })
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def job_line(job: Job) -> str:
    hosts = job.command[job.command.index("--hosts") + 1] if "--hosts" in job.command else None
    flags = " ".join(job.flags) + (f" --hosts {hosts}" if hosts else "")
    verdict = "ok" if job.ok else "FAILED: " + "; ".join(
        job.problems + (["hung"] if job.hung else [])
        + ([f"{job.steps_beyond} step(s) lost beyond the promise"] if job.steps_beyond else [])
        + ([f"left behind {job.left.count}"] if job.left.count else []))
    redone = ",".join(str(r.redone) for r in job.relaunches) or "-"
    return (f"  {job.index:03d} {job.strategy}: {flags} -> exit {job.code} in {job.seconds:.0f}s, "
            f"injected {len(job.injected)}/{len(job.faults)}, task restarts {job.task_restarts}, "
            f"relaunches {job.job_relaunches} (steps redone {redone}), accuracy "
            f"{job.test_accuracy if job.test_accuracy is None else round(job.test_accuracy, 4)}: "
            f"{verdict}")


def report(config: "SoakConfig", jobs: list[Job]) -> dict:
    rows = table_rows(jobs, [k.name for k in config.kinds])
    return {
        "command": config.command, "seed": config.seed, "steps": config.steps,
        "accuracy_floor": config.accuracy_floor, "checkpoint_every": CHECKPOINT_EVERY,
        "job_timeout": config.job_timeout,
        "jobs": len(jobs), "correct": sum(j.correct for j in jobs),
        "hung": sum(j.hung for j in jobs),
        "steps_lost_beyond_promise": sum(j.steps_beyond for j in jobs),
        "left_behind": sum(j.left.count for j in jobs),
        "failed": sum(not j.ok for j in jobs),
        "table": rows,
        "per_job": [{**asdict(j),
                     "relaunches": [{**asdict(r), "beyond": r.beyond} for r in j.relaunches],
                     "correct": j.correct, "ok": j.ok} for j in jobs],
    }


# --- the configuration (its flags: tfdist/cli/tools/soak.py) ---------------------------------

@dataclass(frozen=True)
class SoakConfig:
    kinds: tuple[StrategyKind, ...]
    jobs: int
    steps: int
    seed: int
    out: str
    max_faults: int = 3
    accuracy_floor: float = 0.85
    job_timeout: float = 300.0
    command: str = ""


def run(config: SoakConfig) -> int:
    """Every job, one line each, then the table and each failed job's log tail; the exit code."""
    os.makedirs(config.out, exist_ok=True)
    rng = random.Random(config.seed)
    print(f"soak: seed {config.seed}, {config.jobs} job(s) over "
          f"{','.join(k.name for k in config.kinds)}, {config.steps} steps each, in {config.out}",
          flush=True)
    jobs: list[Job] = []
    for i in range(config.jobs):
        job = run_job(i, config.kinds[i % len(config.kinds)], rng, config)
        jobs.append(job)
        print(job_line(job), flush=True)
    return summarize(config, jobs)


def summarize(config: SoakConfig, jobs: list[Job]) -> int:
    record = report(config, jobs)
    table = markdown(record["table"])
    totals = (f"{record['correct']}/{record['jobs']} correct, {record['hung']} hung, "
              f"{record['steps_lost_beyond_promise']} step(s) lost beyond the promise, "
              f"{record['left_behind']} left behind")
    print(f"\nsoak: {totals}\n{table}")
    with open(os.path.join(config.out, "soak.json"), "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(config.out, "soak.md"), "w") as f:
        f.write(f"`{config.command}` (seed {config.seed}, {config.steps} steps per job): "
                f"{totals}.\n\n{table}\n")
    for job in jobs:
        if job.ok:
            continue
        print(f"\nfailed: {job_line(job).strip()}")
        for what in ("processes", "namespaces", "cgroups"):
            for item in getattr(job.left, what):
                print(f"  left behind ({what}): {item}")
        print(f"  command: {' '.join(job.command)}")
        print(f"  log: {job.log}; last lines:")
        with open(job.log, errors="replace") as f:
            for line in f.read().splitlines()[-25:]:
                print(f"    {line[:240]}")
    return 0 if record["failed"] == 0 else 1

