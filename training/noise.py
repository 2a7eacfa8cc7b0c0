"""Hide TensorFlow's start-up lines on stderr unless ``--verbose``.

TensorFlow 2.21 writes them from C++ through absl before any logging set-up
(``TF_CPP_MIN_LOG_LEVEL`` no longer reaches them): the oneDNN notice, CPU
feature hints, "Could not find cuda drivers", a failed ``cuInit`` on a
machine without a GPU, and more, twice per process. The only place to drop
them is the file descriptor itself: fd 2 becomes a pipe that a thread
forwards, line by line, minus those lines. Python's own ``sys.stderr`` (every
``error:`` line of ours) bypasses the pipe, so nothing of ours can be lost.
Importing this module imports no TensorFlow.
"""

from __future__ import annotations

import os
import re
import sys
import threading

NOISE = re.compile(
    r"^(?:WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|[IW]\d{4} [\d:.]+ +\d+ \S+:\d+\] "  # absl INFO and WARNING records
    r"|E\d{4} [^\]]*\] failed call to cuInit"  # no GPU on this machine: not an error here
    r"|To enable the following instructions: .* rebuild TensorFlow)"
)


def is_noise(line: str) -> bool:
    return bool(NOISE.match(line))


def filter_stderr() -> int | None:
    """Route fd 2 through the filter; returns the original stderr's fd (None if
    fd 2 cannot be redirected here)."""
    try:
        original = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
    except OSError:
        return None
    sys.stderr.flush()
    sys.stderr = os.fdopen(original, "w", buffering=1, closefd=False)

    def forward():
        with os.fdopen(read_end, "rb") as pipe:
            for raw in pipe:
                if not is_noise(raw.decode(errors="replace")):
                    os.write(original, raw)

    threading.Thread(target=forward, name="stderr-filter", daemon=True).start()
    return original
