"""Serving tasks (ps, and workers under ps) and the startup watchdog.

TensorFlow waits for missing peers forever, and its servers cannot be
stopped from Python, so both ends here are bounded and explicit: the
watchdog ends a task that is still waiting after ``--startup-timeout``, and
a serving task exits once the chief it served has gone away.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from contextlib import contextmanager

from strategies.tf_config import ClusterConfig


def reachable(address: str, timeout: float = 0.5) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def missing_tasks(cfg: ClusterConfig) -> list[str]:
    """Peers (not this task) that accept no connection on their address."""
    return [
        f"{role}:{i} ({addr})"
        for role, i, addr in cfg.tasks()
        if (role, i) != (cfg.task_type, cfg.task_index)
        and role != "evaluator"
        and not reachable(addr)
    ]


def _exit_now(code: int, message: str) -> None:
    # A blocked TensorFlow call holds the main thread; only _exit ends it.
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


@contextmanager
def startup_watchdog(cfg: ClusterConfig, timeout: float, what: str):
    """End the process with one line if the body has not finished in time."""
    if cfg.is_local:
        yield
        return
    done = threading.Event()

    def watch():
        if not done.wait(timeout):
            missing = missing_tasks(cfg)
            names = ", ".join(missing) if missing else "none unreachable (a peer is up but stuck)"
            _exit_now(
                3,
                f"error: {cfg.task_name} gave up after --startup-timeout={timeout:g}s "
                f"waiting to {what}; missing tasks: {names}. Start every task in "
                "TF_CONFIG, or raise --startup-timeout",
            )

    thread = threading.Thread(target=watch, name="startup-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def serve(cfg: ClusterConfig, *, startup_timeout: float, poll: float = 0.5,
          chief_grace: float = 5.0) -> int:
    """Run this task's ``tf.distribute.Server`` until the chief is gone.

    A ps or worker server under ParameterServerStrategy only executes what the
    coordinator (chief) sends; once the chief has been up and then stays
    unreachable for ``chief_grace`` seconds, the job is over.
    """
    import tensorflow as tf

    jobs = {r: list(a) for r, a in cfg.cluster.items() if r != "evaluator"}
    server = tf.distribute.Server(
        tf.train.ClusterSpec(jobs), job_name=cfg.task_type,
        task_index=cfg.task_index, protocol="grpc", start=True,
    )
    print(f"{cfg.task_name} serving at {cfg.address} (target {server.target})", flush=True)
    chief = cfg.cluster["chief"][0]
    started = time.monotonic()
    seen_at = None
    while True:
        now = time.monotonic()
        if reachable(chief):
            seen_at = now
        elif seen_at is None and now - started > startup_timeout:
            _exit_now(
                3,
                f"error: {cfg.task_name} gave up after --startup-timeout={startup_timeout:g}s: "
                f"the chief at {chief} never came up; start the chief task, or raise --startup-timeout",
            )
        elif seen_at is not None and now - seen_at > chief_grace:
            print(f"{cfg.task_name}: chief at {chief} is gone; stopping", flush=True)
            _exit_now(0, f"{cfg.task_name} stopped")
        time.sleep(poll)
