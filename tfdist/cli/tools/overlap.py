"""``python -m tfdist.cli.tools.overlap PROFILE_DIR ...``: the overlap study's flags -> one frozen
``OverlapConfig`` -> ``bench/links/overlap.py: run``."""

from __future__ import annotations

import argparse
import sys

from tfdist.bench.links import overlap


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tfdist.cli.tools.overlap",
                                description=overlap.__doc__.splitlines()[0])
    p.add_argument("profile_dir", nargs="+",
                   help="a task's <model-dir>/logs/profile-<task> directory (several: one panel each)")
    p.add_argument("--png", help="draw each trace's median step (by transfer overlapped) here")
    p.add_argument("--label", action="append", default=[],
                   help="a panel's title, one per profile directory")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return overlap.run(overlap.OverlapConfig(tuple(args.profile_dir), args.png, tuple(args.label)))


if __name__ == "__main__":
    sys.exit(main())
