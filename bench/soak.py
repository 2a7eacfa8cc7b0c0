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


def pick_faults(rng: random.Random, strategy: str, steps: int) -> list[str]:
    # The (action, task) faults the strategy kind survives with recovery on.
    pool = list(policy.survivable_faults(kinds.get(strategy)))
    chosen = rng.sample(pool, min(len(pool), rng.choice((1, 2))))
    return [f"--{action}={task}@step={rng.randrange(100, steps - 100)}" for action, task in chosen]


def job_command(strategy: str, faults: list[str], steps: int, model_dir: str) -> list[str]:
    kind = kinds.get(strategy)
    recovery = ["--max-restarts", "3", "--restart-delay", "1"]
    layout = ["--workers", "2", "--ps", str(kind.min_ps)]
    if kind.restartable_roles:
        recovery.append("--restart-tasks")
    return [sys.executable, LAUNCH, "--strategy", strategy, *layout,
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


def soak(strategy: str, index: int, rng: random.Random, steps: int, out: str) -> Run:
    model_dir = os.path.join(out, f"{strategy}-{index}")
    faults = pick_faults(rng, strategy, steps)
    log_path = f"{model_dir}.log"
    run = Run(strategy, faults, job_command(strategy, faults, steps, model_dir), log_path)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="jobs per strategy")
    p.add_argument("--steps", type=int, default=1200, help="steps per job")
    p.add_argument("--seed", type=int, default=None, help="seed for the fault choice")
    p.add_argument("--out", default=None, help="run directories and logs (default runs/soak-TIME)")
    p.add_argument("--strategies", default="ps,multiworker")
    args = p.parse_args(argv)
    if args.runs < 1 or args.steps < 300:
        print(f"error: --runs={args.runs} --steps={args.steps}; need --runs >= 1 and "
              "--steps >= 300 (faults land between step 100 and steps-100)", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    out = args.out or os.path.join("runs", time.strftime("soak-%Y%m%d-%H%M%S"))
    if os.path.exists(out) and os.listdir(out):
        print(f"error: --out {out!r} is not empty; pass a new directory", file=sys.stderr)
        return 2
    try:
        for strategy in args.strategies.split(","):
            if not policy.survivable_faults(kinds.get(strategy)):
                raise ConfigError(f"--strategies names {strategy!r}, which has no faults to soak")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    rng = random.Random(seed)
    print(f"soak: seed {seed}, {args.runs} job(s) per strategy, {args.steps} steps each, in {out}",
          flush=True)
    runs: list[Run] = []
    for strategy in args.strategies.split(","):
        for i in range(args.runs):
            run = soak(strategy, i, rng, args.steps, out)
            runs.append(run)
            verdict = "ok" if not run.problems else "CRASH: " + "; ".join(run.problems)
            print(f"  {strategy}-{i}: {' '.join(run.faults)} -> exit {run.code} in "
                  f"{run.seconds:.0f}s, injected {run.injected}, task restarts "
                  f"{run.task_restarts}, relaunches {run.relaunches}: {verdict}", flush=True)
    print("soak summary:")
    for strategy in args.strategies.split(","):
        mine = [r for r in runs if r.strategy == strategy]
        ok = [r for r in mine if not r.problems]
        print(f"  {strategy}: {len(ok)}/{len(mine)} jobs finished correctly; faults injected "
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
