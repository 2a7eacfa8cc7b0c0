"""Benchmark every strategy on the same work, against a single process, in one run.

    python bench.py                      # cnn, 3 epochs, 2 workers, 2 repeats: ~10 min on 2 CPU cores
    python bench.py --workers 1,2,4      # adds a scaling curve for multiworker and ps
    python bench.py --steps 40 --eval-every 20 --out /tmp/bench   # a smoke run
    python bench.py --suite scenarios    # which strategy when: slow worker, slow links,
                                         # more workers, tutorial peers (bench/suites/scenarios.py)
    python bench.py --suite evaluation   # the shared final evaluation against the chief alone
                                         # (bench/suites/evaluation.py)

The flags become one frozen ``BenchConfig``, run by the suite it names:
``bench/suites/default.py`` (every strategy on a uniform cluster; what it measures
and writes is told there), ``bench/suites/scenarios.py`` or ``bench/suites/evaluation.py``. Nothing else reads the
command line.
"""

from __future__ import annotations

import argparse
import sys

from tfdist import flags
from tfdist.bench import predict, scale
from tfdist.bench.suites import default as suite, evaluation, scenarios
from tfdist.bench.config import BenchConfig


def parser() -> argparse.ArgumentParser:
    """bench.py's flags: one per ``BenchConfig`` field (``tfdist.flags``)."""
    p = argparse.ArgumentParser(description=flags.description(__doc__), allow_abbrev=False,
                                formatter_class=flags.HelpFormatter,
                                epilog="exit codes:\n    0 every run finished\n"
                                       "    1 a run failed (its log says why)\n"
                                       "    2 bad input: one error line")
    flags.add_options(p, BenchConfig, "runs (both suites)")
    return p


def parse_args(argv=None) -> BenchConfig:
    return flags.from_args(BenchConfig, parser().parse_args(argv))


def main(argv=None) -> int:
    """Flags → one frozen config → the suite it names; the exit code."""
    config = parse_args(argv)
    if config.steps is not None and config.steps < 1 or config.epochs < 1:
        print("error: --steps and --epochs must be positive", file=sys.stderr)
        return 2
    if config.predict is not None:
        return predict.report(config)
    if config.predict_check is not None:
        return scale.run(config.predict_check)
    if config.suite == "scenarios":
        return scenarios.run(config)
    if config.suite == "evaluation":
        return evaluation.run(config)
    return suite.run(config)


if __name__ == "__main__":
    sys.exit(main())
