"""The checkout's ``bench.py``: the same command as the installed ``tfdist-bench`` (see ``--help``)."""

import sys

from tfdist.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
