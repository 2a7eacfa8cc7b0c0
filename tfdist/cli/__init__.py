"""The commands: flags -> one frozen config -> the library call (``main(argv=None)``).

``tfdist-train`` (``train.py``), ``tfdist-launch`` (``launch.py``) and
``tfdist-bench`` (``bench.py``); nothing below this package sees argparse.
"""
