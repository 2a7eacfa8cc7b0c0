"""``python -m tfdist.cli.tools.trace_study RUN_DIR``: the trace study's flags -> one frozen
``TraceStudyConfig`` -> ``bench/links/trace_study.py: run``."""

from __future__ import annotations

import argparse
import sys

from tfdist.bench.links import trace_study


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tfdist.cli.tools.trace_study",
                                description=trace_study.__doc__.splitlines()[0])
    p.add_argument("run_dir", help="a --model-dir of a launch.py run with --link-trace")
    p.add_argument("--png", help="draw every link's use over the chosen window here")
    p.add_argument("--start", type=float, default=2.0,
                   help="seconds into the training steps' window where the picture starts (default 2)")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="seconds the picture spans (default 1)")
    p.add_argument("--title", help="the picture's title")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.start < 0 or args.seconds <= 0:
        print(f"error: --start {args.start:g} --seconds {args.seconds:g}: the start must be 0 or "
              "more and the span more than 0", file=sys.stderr)
        return 2
    return trace_study.run(trace_study.TraceStudyConfig(args.run_dir, args.png, args.start,
                                                        args.seconds, args.title))


if __name__ == "__main__":
    sys.exit(main())
