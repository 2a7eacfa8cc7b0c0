"""``python -m tfdist.cli.tools.soak``: the soak's flags -> one frozen ``SoakConfig`` ->
``bench/soak.py: run`` (back-to-back jobs with random faults, checked and counted).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from tfdist.bench import soak
from tfdist.launcher import policy
from tfdist.strategies import ConfigError, kinds


def parse_args(argv=None) -> soak.SoakConfig:
    """The flags, checked, as one frozen config; ConfigError (one line) otherwise."""
    p = argparse.ArgumentParser(prog="python -m tfdist.cli.tools.soak", description=soak.__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=4, help="jobs in all, round-robin over --strategies")
    p.add_argument("--steps", type=int, default=1200, help="steps per job")
    p.add_argument("--max-faults", type=int, default=3, help="faults per job: 1 to this, drawn")
    p.add_argument("--accuracy-floor", type=float, default=0.85,
                   help="test accuracy every job must reach (logreg, fault-free: ~0.92)")
    p.add_argument("--job-timeout", type=float, default=300.0,
                   help="seconds a job may take, relaunches included; past it, the job is hung")
    p.add_argument("--seed", type=int, default=None, help="seed for the fault choice")
    p.add_argument("--out", default=None, help="run directories, logs, soak.md and soak.json "
                   "(default runs/soak-TIME)")
    p.add_argument("--strategies", default=soak.DEFAULT_STRATEGIES)
    args = p.parse_args(argv)
    if args.jobs < 1 or args.steps < 300 or not 1 <= args.max_faults <= 3:
        raise ConfigError(f"--jobs={args.jobs} --steps={args.steps} --max-faults="
                          f"{args.max_faults}; need --jobs >= 1, --steps >= 300 (faults land "
                          "between step 100 and steps-100) and --max-faults 1 to 3")
    if not 0 <= args.accuracy_floor <= 1 or not args.job_timeout > 0:
        raise ConfigError(f"--accuracy-floor={args.accuracy_floor} --job-timeout="
                          f"{args.job_timeout}; need a floor in [0, 1] and a positive timeout")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    out = args.out or os.path.join("runs", time.strftime("soak-%Y%m%d-%H%M%S"))
    if os.path.exists(out) and os.listdir(out):
        raise ConfigError(f"--out {out!r} is not empty; pass a new directory")
    chosen = tuple(kinds.get(name) for name in args.strategies.split(","))
    for kind in chosen:
        if not policy.survivable_faults(kind):
            raise ConfigError(f"--strategies names {kind.name!r}, which has no faults to soak")
    command = " ".join(["python -m tfdist.cli.tools.soak", *(argv if argv is not None else sys.argv[1:])])
    return soak.SoakConfig(chosen, args.jobs, args.steps, seed, out, args.max_faults,
                           args.accuracy_floor, args.job_timeout, command)


def main(argv=None) -> int:
    try:
        config = parse_args(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return soak.run(config)


if __name__ == "__main__":
    sys.exit(main())
