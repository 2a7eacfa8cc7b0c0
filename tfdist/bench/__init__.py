"""The benchmark: its flags (``cli``), the default suite (``suite``), the
scenarios (``scenarios``), what both share (``common``), and the soak
(``soak``). ``bench/peers/`` holds programs written after TensorFlow's
tutorials, run by ``launch.py --program``; they are not part of this package.
"""
