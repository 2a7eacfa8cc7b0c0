"""Benchmark every strategy on the same work, against a single process, in one run.

    python bench.py                      # cnn, 3 epochs, 2 workers, 2 repeats: ~10 min on 2 CPU cores
    python bench.py --workers 1,2,4      # adds a scaling curve for multiworker and ps
    python bench.py --steps 40 --eval-every 20 --out /tmp/bench   # a smoke run
    python bench.py --suite scenarios    # which strategy when: slow worker, slow links,
                                         # more workers, tutorial peers (bench/scenarios.py)

The command only; the benchmark is the ``bench`` package (``bench/cli.py``:
flags → one ``BenchConfig`` → the suite it names). Installed, the same
command is ``tfdist-bench``.
"""

import sys

from bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
