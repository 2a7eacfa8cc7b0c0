"""The benchmark: the two suites (``suites``), the link studies (``links``), what
they share (``config``, ``common``, ``link_limit``), and the soak (``soak``).
``bench/peers/`` holds the competitor programs written after TensorFlow's
tutorials, run by ``launch.py --program``; they are not part of this package.
"""
