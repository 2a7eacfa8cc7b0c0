"""``python -m tfdist.cli.tools.xla``: the XLA study's flags -> one frozen ``XlaConfig`` ->
``bench/xla.py: run``."""

from __future__ import annotations

import argparse
import sys

from tfdist.bench import xla


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tfdist.cli.tools.xla",
                                description=xla.__doc__.splitlines()[0])
    p.add_argument("--strategies", nargs="+", default=list(xla.CLUSTER), choices=list(xla.CLUSTER),
                   help="the rows to run")
    p.add_argument("--steps", type=int, default=300, help="steps of every run")
    p.add_argument("--global-batch-size", type=int, default=256, help="every run's global batch")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of every row without and with XLA, each round the other order")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--out", help="also write every run's figures here (JSON)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return xla.run(xla.XlaConfig(tuple(args.strategies), args.steps, args.global_batch_size,
                                 args.rounds, args.timeout, args.out))


if __name__ == "__main__":
    sys.exit(main())
