"""The chief's stall watchdog: no training step for ``--stuck-timeout`` ends it with one
line naming the stuck and unreachable tasks (a hard exit: the main thread is blocked
inside TensorFlow)."""

from __future__ import annotations

import contextlib
import threading
import time

from tfdist.protocol import Exit
from tfdist.strategies.server import exit_now, stuck_text

class StallWatchdog:
    """Ends the chief with one line if no step completes for ``timeout`` s
    (``--stuck-timeout``), naming the stuck and the unreachable tasks.

    With every worker gone, or a worker or ps task alive but stopped, the
    coordinator and ps:0 wait inside calls that have no timeout of their
    own. ``grace`` more seconds leave a trainer that handles a stall itself
    (ps: rerunning a stuck worker's steps elsewhere) the first move.
    Paused while the chief does work of its own (``paused()``: evaluating).
    """

    def __init__(self, cluster, timeout: float, exit_code: int = Exit.TASK_LOST,
                 grace: float = 0.0):
        self.cluster, self.timeout, self.exit_code = cluster, timeout, exit_code
        self.grace = grace
        self._last = time.monotonic()
        self._paused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="StallWatchdog", daemon=True)
        self._thread.start()

    def progress(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.progress()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            if not self._paused and time.monotonic() - self._last > self.timeout + self.grace:
                # The main thread is blocked inside TensorFlow: only a hard exit ends it.
                exit_now(self.exit_code, (
                    f"error: {self.cluster.member_name}: no training step completed for "
                    f"{self.timeout:g}s (--stuck-timeout); {stuck_text(self.cluster)}. "
                    "Restart or replace the stuck or lost tasks, or relaunch the job to "
                    "resume from its checkpoint"
                ))
