"""The checkout's ``train.py``: the same command as the installed ``tfdist-train`` (see ``--help``)."""

import sys

from tfdist.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
