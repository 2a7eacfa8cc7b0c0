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

import logging
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


# The start of any absl record, whatever its severity.
RECORD = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\] ")
# Lines that are never a record's continuation: a crash report, a traceback,
# our own one-line messages.
NEVER_CONTINUATION = re.compile(
    r"^(?:Fatal Python error|Traceback|Segmentation fault|Current thread|Thread 0x"
    r"|error:|warning:|note:)"
)


def is_noise(line: str) -> bool:
    return bool(NOISE.match(line))


class NoiseFilter:
    """Decides line by line what reaches stderr.

    An absl record can span lines ("Example stragglers:" and then one task
    name per line, from the coordination service): the lines after a
    dropped record that start no record of their own go with it.
    """

    def __init__(self):
        self._in_dropped = False

    def keep(self, line: str) -> bool:
        if is_noise(line):
            self._in_dropped = True
            return False
        if RECORD.match(line) or NEVER_CONTINUATION.match(line):
            self._in_dropped = False
            return True
        return not self._in_dropped


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
        lines = NoiseFilter()
        with os.fdopen(read_end, "rb") as pipe:
            for raw in pipe:
                if lines.keep(raw.decode(errors="replace")):
                    os.write(original, raw)

    threading.Thread(target=forward, name="stderr-filter", daemon=True).start()
    return original


# --- TensorFlow's Python log records ------------------------------------------------

from tfdist.training.loop.survival.recovery import first_line  # noqa: E402 (TensorFlow-free too)


class _OneLine(logging.Filter):
    """Clips TensorFlow's multi-screen gRPC log records to their first line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "tf_function_save" in message:
            # Saving ps-held variables retraces TF's internal save function
            # every time; the retracing warning is about TF, not this program.
            return False
        if "\n" in message or len(message) > 300:
            record.msg, record.args = first_line(Exception(message), 300), None
        return True


def condense_tf_logs() -> None:
    import tensorflow as tf

    logger = tf.get_logger()
    if not any(isinstance(f, _OneLine) for f in logger.filters):
        logger.addFilter(_OneLine())
    if logger.handlers:
        logger.propagate = False  # else the root logger prints every record again
