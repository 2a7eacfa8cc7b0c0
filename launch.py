"""The checkout's ``launch.py``: the same command as the installed ``tfdist-launch`` (see ``--help``)."""

import sys

from tfdist.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
