"""Benchmark every strategy on the same work, against a single process, in one run.

    python bench.py                      # cnn, 3 epochs, 2 workers, 2 repeats: ~10 min on 2 CPU cores
    python bench.py --workers 1,2,4      # adds a scaling curve for multiworker and ps
    python bench.py --steps 40 --eval-every 20 --out /tmp/bench   # a smoke run
    python bench.py --suite scenarios    # which strategy when: slow worker, slow links,
                                         # more workers, tutorial peers (bench/scenarios.py)

The flags become one frozen ``BenchConfig``, run by the suite it names:
``bench/suite.py`` (every strategy on a uniform cluster; what it measures
and writes is told there) or ``bench/scenarios.py``. Nothing else reads the
command line.
"""

from __future__ import annotations

import argparse
import sys

from tfdist.bench import common, scenarios, suite
from tfdist.bench.config import BenchConfig


def parse_args(argv=None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="cnn")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="overrides --epochs")
    p.add_argument("--global-batch-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--steps-per-execution", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=234, help="steps between test evaluations")
    p.add_argument("--log-every", type=int, default=200)
    p.add_argument("--workers", default="2", help="worker counts for multiworker and ps, e.g. 1,2,4")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each configuration, interleaved; a row shows the best")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(common.KINDS)}")
    p.add_argument("--target", type=float, default=0.99, help="test accuracy for time-to-target")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="results")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--suite", choices=("default", "scenarios"), default="default",
                   help="default: every strategy on a uniform cluster; scenarios: which strategy "
                        "when (slow worker, slow links, more workers, tutorial peers, staleness)")
    s = p.add_argument_group("--suite scenarios (the flags above set the uniform accuracy runs)")
    s.add_argument("--scenarios", default=None,
                   help="subset of uniform,slow,links,more and the studies sparse (the ctr task "
                        "under each strategy, bench/sparse.py) and scaling (1-4 workers on "
                        "100 Mbit/s links, bench/scaling.py); default: all")
    s.add_argument("--short-steps", type=int, default=200,
                   help="steps of each throughput run (0: no throughput pass)")
    s.add_argument("--short-scenarios", default="uniform,slow,links,more",
                   help="scenarios whose cells also get a short throughput run (a second "
                        "measurement, interleaved); the others run each cell once ('' for none)")
    s.add_argument("--accuracy-steps", type=int, default=160,
                   help="steps of the accuracy runs of the scenarios other than uniform")
    s.add_argument("--accuracy-eval-every", type=int, default=40)
    s.add_argument("--scenario-target", type=float, default=0.97,
                   help="test accuracy for time-to-target in the scenarios other than uniform")
    s.add_argument("--no-peers", dest="peers", action="store_false",
                   help="leave out the tutorial peers (bench/peers/)")
    s.add_argument("--peer-repeats", type=int, default=2,
                   help="rounds of each peer and the run it is compared with (interleaved; "
                        "each side's best counts)")
    s.add_argument("--staleness-workers", default="1,2,4",
                   help="async ps worker counts of the staleness study ('' to skip it)")
    s.add_argument("--staleness-lrs", default="0.05,0.5,2", help="its SGD learning rates")
    s.add_argument("--staleness-steps", type=int, default=300)
    s.add_argument("--sparse-steps", type=int, default=400, help="steps of each sparse study run")
    s.add_argument("--sparse-global-batch", type=int, default=512,
                   help="global batch of the sparse study (the same under every strategy)")
    s.add_argument("--scaling-workers", default="1,2,3,4",
                   help="worker counts of the scaling study (bench/scaling.py)")
    s.add_argument("--scaling-steps", type=int, default=200,
                   help="steps of each scaling study run")
    s.add_argument("--report-only", action="store_true",
                   help="run nothing: write scenarios.md and the plots again from "
                        "<out>/scenarios.json (a finished suite's figures)")
    return BenchConfig(**vars(p.parse_args(argv)))


def main(argv=None) -> int:
    """Flags → one frozen config → the suite it names; the exit code."""
    config = parse_args(argv)
    if config.steps is not None and config.steps < 1 or config.epochs < 1:
        print("error: --steps and --epochs must be positive", file=sys.stderr)
        return 2
    if config.suite == "scenarios":
        return scenarios.run(config)
    return suite.run(config)


if __name__ == "__main__":
    sys.exit(main())
