"""``--profile-steps A:B``: a TensorFlow profiler trace of steps A to B, per task.

Every task that runs steps traces its own process (``tf.profiler.experimental``)
into ``<model-dir>/logs/profile-<task>/``, a run of the run's TensorBoard logs:
TensorBoard's Profile tab (the ``tensorboard-plugin-profile`` package) shows each
task's timeline, each call marked as a step. Under ``ps`` the workers only serve:
the chief traces itself and asks each worker's server for its trace over the
same steps (the profiler service of TensorFlow's gRPC server), for as long as
those steps took the workers so far.

Off by default; when off the controller holds no profiler (one ``None`` check
per call, nothing in a traced step).
"""

from __future__ import annotations

import os
import threading
import time

from tfdist.protocol import ConfigError


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """``"A:B"`` -> (A, B), 0 <= A < B; ConfigError (one line) otherwise."""
    if text is None:
        return None
    first, sep, last = str(text).partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        a = b = None
    if not sep or a is None or not 0 <= a < b:
        raise ConfigError(
            f"--profile-steps {text!r} is not a range of steps; give A:B with 0 <= A < B "
            "(e.g. 20:25: the steps after the 20th up to the 25th)")
    return a, b


def log_dir(model_dir: str, member_name: str) -> str:
    return os.path.join(model_dir, "logs", "profile-" + member_name.replace(":", "-"))


class StepProfiler:
    """Starts the trace before the call that runs step A, stops it after step B is done.

    ``remote``: (task name, host:port) of the tasks that serve this one's
    steps in their own process (ps workers and ps tasks), traced through their servers.
    """

    def __init__(self, steps: tuple[int, int], model_dir: str, member_name: str,
                 remote: tuple[tuple[str, str], ...] = ()):
        self.first, self.last = steps
        self.model_dir, self.member_name, self.remote = model_dir, member_name, remote
        self.state = "waiting"  # -> tracing -> done
        self._threads: list[threading.Thread] = []
        self._seen: tuple[float, int] | None = None  # (time, step) of the first call seen

    def before_call(self, step: int, n: int) -> None:
        """Called before a call that runs steps ``step+1 .. step+n``."""
        if self.state != "waiting":
            return
        now = time.perf_counter()
        if self._seen is None or self._seen[1] == step:
            self._seen = (now, step)
        if step + n <= self.first or step >= self.last:
            return
        seconds_per_step = ((now - self._seen[0]) / (step - self._seen[1])
                            if step > self._seen[1] else None)
        import tensorflow as tf

        path = log_dir(self.model_dir, self.member_name)
        os.makedirs(path, exist_ok=True)
        tf.profiler.experimental.start(path)
        self.state = "tracing"
        if self.remote:
            # A worker's trace lasts as long as the steps should take there.
            per_step = seconds_per_step or 0.5
            millis = int(max(1000, (self.last - step) * per_step * 1000 * 1.2))
            for name, address in self.remote:
                t = threading.Thread(target=_trace_remote, daemon=True,
                                     args=(name, address, self.model_dir, millis))
                t.start()
                self._threads.append(t)

    def step_marker(self, step: int):
        """A context around one call: a step on the trace's timeline while tracing."""
        import contextlib

        if self.state != "tracing":
            return contextlib.nullcontext()
        import tensorflow as tf

        return tf.profiler.experimental.Trace("train", step_num=step, _r=1)

    def after_call(self, step: int, drain) -> None:
        """Called after a call whose last step is ``step``; ``drain`` waits for its work."""
        if self.state != "tracing" or step < self.last:
            return
        drain()
        self.stop()

    def stop(self) -> None:
        if self.state != "tracing":
            return
        import tensorflow as tf

        tf.profiler.experimental.stop()
        self.state = "done"
        print(f"{self.member_name}: profile of steps {self.first}:{self.last} written to "
              f"{log_dir(self.model_dir, self.member_name)}", flush=True)


    def close(self) -> None:
        """Wait for the serving tasks' traces (they run for a set time, while the
        steps go on; waiting for them mid-run would stall the chief)."""
        self.stop()
        for t in self._threads:
            t.join(timeout=120)
        self._threads = []


def _trace_remote(name: str, address: str, model_dir: str, millis: int) -> None:
    import tensorflow as tf

    path = log_dir(model_dir, name)
    try:
        os.makedirs(path, exist_ok=True)
        tf.profiler.experimental.client.trace(f"grpc://{address}", path, millis)
    except Exception as err:  # pylint: disable=broad-except
        # The chief's own trace stands; a worker that cannot be traced is said.
        print(f"profile of {name} ({address}) not taken: "
              f"{(str(err).splitlines() or [''])[0][:200]}", flush=True)


def make(config, cluster, kind) -> StepProfiler | None:
    """The task's profiler, or None without ``--profile-steps``. The chief also
    traces the tasks that only serve (they run its steps and updates)."""
    steps = parse_steps(config.profile_steps)
    if steps is None:
        return None
    remote = ()
    if cluster.is_chief and not cluster.is_local:
        remote = tuple((f"{role}:{i}", address) for role, i, address in cluster.members()
                       if role in kind.serving_roles)
    return StepProfiler(steps, config.model_dir, cluster.member_name, remote)
