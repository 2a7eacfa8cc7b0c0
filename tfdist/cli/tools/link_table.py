"""``python -m tfdist.cli.tools.link_table``: the link study's flags -> one frozen
``LinkTableConfig`` -> ``bench/links/table.py: run``."""

from __future__ import annotations

import argparse
import sys

from tfdist.bench.links import table


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tfdist.cli.tools.link_table",
                                description=table.__doc__.splitlines()[0])
    p.add_argument("--out", default="results/links/link_table",
                   help="directory for runs/, link_table.json and link_table.md")
    p.add_argument("--rows", default=None,
                   help="comma-separated row keys (default: all; e.g. multiworker-w2-f32-acc1)")
    p.add_argument("--steps", type=int, default=200, help="steps per run")
    p.add_argument("--global-batch-size", type=int, default=128)
    p.add_argument("--link-rate", default=table.LINK_RATE)
    p.add_argument("--run-timeout", type=float, default=600.0)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    keys = [r.key for r in table.all_rows()]
    wanted = tuple(args.rows.split(",")) if args.rows else ()
    unknown = sorted(set(wanted) - set(keys))
    if unknown:
        print(f"error: --rows {unknown[0]!r} is not a row; rows: {', '.join(keys)}", file=sys.stderr)
        return 2
    if args.steps < 1 or args.global_batch_size < 1:
        print("error: --steps and --global-batch-size must be at least 1", file=sys.stderr)
        return 2
    return table.run(table.LinkTableConfig(args.out, wanted, args.steps, args.global_batch_size,
                                           args.link_rate, args.run_timeout))


if __name__ == "__main__":
    sys.exit(main())
