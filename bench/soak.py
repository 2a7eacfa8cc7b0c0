"""Soak test: back-to-back training jobs with random faults; not part of CI.

    python -m bench.soak --runs 3                 # 3 ps jobs, then 3 multi-worker jobs
    python -m bench.soak --runs 20 --steps 2000 --seed 7 --out runs/soak

Each job runs under ``launch.py`` with one or two random faults (``--kill``
or ``--preempt`` of a random task at a random step) and every recovery
mechanism on (``--restart-tasks`` under ps, ``--max-restarts``). A job
counts as finished when it exits 0 with every requested step done and no
process left behind; the faults it had injected count as survived. Any
other outcome is a crash: its command and the tail of its log are printed.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

import protocol
from bench.common import LAUNCH, ROOT
from launcher import policy
from launcher.processes import running_with
from strategies import ConfigError, kinds
from strategies.kinds import StrategyKind


@dataclass
class Run:
    strategy: str
    faults: list[str]
    command: list[str]
    log: str
    code: int | None = None
    seconds: float = 0.0
    injected: int = 0
    relaunches: int = 0
    task_restarts: int = 0
    problems: list[str] = field(default_factory=list)


def pick_faults(rng: random.Random, kind: StrategyKind, steps: int) -> list[str]:
    # The (action, task) faults the strategy kind survives with recovery on.
    pool = list(policy.survivable_faults(kind))
    chosen = rng.sample(pool, min(len(pool), rng.choice((1, 2))))
    return [f"--{action}={task}@step={rng.randrange(100, steps - 100)}" for action, task in chosen]


def job_command(kind: StrategyKind, faults: list[str], steps: int, model_dir: str) -> list[str]:
    recovery = ["--max-restarts", "3", "--restart-delay", "1"]
    layout = ["--workers", "2", "--ps", str(kind.min_ps)]
    if kind.restartable_roles:
        recovery.append("--restart-tasks")
    return [sys.executable, LAUNCH, "--strategy", kind.name, *layout,
            "--grace", "5", "--timeout", "600", *recovery, *faults, "--",
            "--model", "logreg", "--steps", str(steps), "--log-every", "100",
            "--checkpoint-every", "200", "--steps-per-execution", "5", "--model-dir", model_dir]


def check(run: Run, steps: int, model_dir: str) -> None:
    try:
        outcome = protocol.LaunchOutcome.load(os.path.join(model_dir, "launch", "outcome.json"))
        run.injected = len(outcome.faults_fired)
        run.task_restarts, run.relaunches = outcome.task_restarts, outcome.job_relaunches
    except (OSError, ValueError, TypeError):
        run.problems.append("no launch/outcome.json")
    if run.code != 0:
        run.problems.append(f"exit code {run.code}")
    try:
        results = protocol.Results.load(os.path.join(model_dir, "results.json"))
    except (OSError, ValueError, TypeError) as err:
        run.problems.append(f"no readable results.json ({err})")
        results = None
    if results is not None:
        if results.completed_steps != steps:
            run.problems.append(f"completed {results.completed_steps} steps of {steps}")
        if results.applied_steps is not None:
            # Asynchronous: a lost worker's closure may apply steps twice, never fewer.
            if results.applied_steps < results.scheduled_steps:
                run.problems.append(f"applied {results.applied_steps} < scheduled "
                                    f"{results.scheduled_steps}: a step is missing")
        elif results.global_steps != steps:
            run.problems.append(f"global step {results.global_steps} != {steps}")
    time.sleep(1)  # servers that saw the chief go have a moment to exit
    if left := running_with(model_dir):
        run.problems.append(f"{len(left)} process(es) left behind: {left[0][:200]}")


def soak(kind: StrategyKind, index: int, rng: random.Random, steps: int, out: str) -> Run:
    model_dir = os.path.join(out, f"{kind.name}-{index}")
    faults = pick_faults(rng, kind, steps)
    log_path = f"{model_dir}.log"
    run = Run(kind.name, faults, job_command(kind, faults, steps, model_dir), log_path)
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(run.command, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=ROOT)
        try:
            run.code = proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            run.code = proc.wait()
            run.problems.append("launcher still running after 900 s")
    run.seconds = time.monotonic() - started
    check(run, steps, model_dir)
    return run


@dataclass(frozen=True)
class SoakConfig:
    kinds: tuple[StrategyKind, ...]
    runs: int
    steps: int
    seed: int
    out: str


def parse_args(argv=None) -> SoakConfig:
    """The flags, checked, as one frozen config; ConfigError (one line) otherwise."""
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="jobs per strategy")
    p.add_argument("--steps", type=int, default=1200, help="steps per job")
    p.add_argument("--seed", type=int, default=None, help="seed for the fault choice")
    p.add_argument("--out", default=None, help="run directories and logs (default runs/soak-TIME)")
    p.add_argument("--strategies", default="ps,multiworker")
    args = p.parse_args(argv)
    if args.runs < 1 or args.steps < 300:
        raise ConfigError(f"--runs={args.runs} --steps={args.steps}; need --runs >= 1 and "
                          "--steps >= 300 (faults land between step 100 and steps-100)")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    out = args.out or os.path.join("runs", time.strftime("soak-%Y%m%d-%H%M%S"))
    if os.path.exists(out) and os.listdir(out):
        raise ConfigError(f"--out {out!r} is not empty; pass a new directory")
    chosen = tuple(kinds.get(name) for name in args.strategies.split(","))
    for kind in chosen:
        if not policy.survivable_faults(kind):
            raise ConfigError(f"--strategies names {kind.name!r}, which has no faults to soak")
    return SoakConfig(chosen, args.runs, args.steps, seed, out)


def main(argv=None) -> int:
    try:
        config = parse_args(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return run(config)


def run(config: SoakConfig) -> int:
    """Every job, one line each, then the summary and each crash's log tail; the exit code."""
    os.makedirs(config.out, exist_ok=True)
    rng = random.Random(config.seed)
    print(f"soak: seed {config.seed}, {config.runs} job(s) per strategy, {config.steps} steps "
          f"each, in {config.out}", flush=True)
    runs: list[Run] = []
    for kind in config.kinds:
        for i in range(config.runs):
            job = soak(kind, i, rng, config.steps, config.out)
            runs.append(job)
            verdict = "ok" if not job.problems else "CRASH: " + "; ".join(job.problems)
            print(f"  {kind.name}-{i}: {' '.join(job.faults)} -> exit {job.code} in "
                  f"{job.seconds:.0f}s, injected {job.injected}, task restarts "
                  f"{job.task_restarts}, relaunches {job.relaunches}: {verdict}", flush=True)
    return summarize(config, runs)


def summarize(config: SoakConfig, runs: list[Run]) -> int:
    print("soak summary:")
    for kind in config.kinds:
        mine = [r for r in runs if r.strategy == kind.name]
        ok = [r for r in mine if not r.problems]
        print(f"  {kind.name}: {len(ok)}/{len(mine)} jobs finished correctly; faults injected "
              f"{sum(r.injected for r in mine)}, survived {sum(r.injected for r in ok)}; "
              f"task restarts {sum(r.task_restarts for r in mine)}, "
              f"job relaunches {sum(r.relaunches for r in mine)}")
    crashes = [r for r in runs if r.problems]
    for r in crashes:
        print(f"\ncrash: {r.strategy} {' '.join(r.faults)}: {'; '.join(r.problems)}")
        print(f"  command: {' '.join(r.command)}")
        print(f"  log: {r.log}; last lines:")
        with open(r.log, errors="replace") as f:
            for line in f.read().splitlines()[-25:]:
                print(f"    {line[:240]}")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
