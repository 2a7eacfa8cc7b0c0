"""What both parameter-server trainers share, on the chief (``ps`` and ``ps-sync``).

``CoordinatedTrainer``: the workers' names, SIGTERM as a request to stop at
the next drain (``StopOnSigterm``), the stall watchdog, the errors that mean
a lost peer under a ``ClusterCoordinator``, the variables each ps holds, and
the end: the servers stop on their own once the chief is gone
(``strategies/server.py``).
"""

from __future__ import annotations

import collections
import contextlib
import signal
import time

import keras
import tensorflow as tf
# Not exported by tf.distribute, but what the coordinator raises for a lost task.
from tensorflow.python.distribute.coordinator.cluster_coordinator import (
    ClosureAbortedError, ClosureInputError,
)

from tfdist import protocol
from tfdist.protocol import Exit
from tfdist.strategies.server import CallGuard, exit_now, peer_states, states_text
from tfdist.training.noise import condense_tf_logs
from tfdist.training.ps.watchdog import StallWatchdog
from tfdist.training.sharding import ps_variable_bytes
from tfdist.training.loop.survival.lost import LOST_MEMBER_ERRORS
from tfdist.training.loop.trainer import Trainer

# Besides gRPC errors, the coordinator wraps a lost task's errors in these.
PS_LOST_MEMBER_ERRORS = LOST_MEMBER_ERRORS + (ClosureInputError, ClosureAbortedError)


def variables_per_ps(model: keras.Model) -> dict[str, int]:
    """How many variables each ps task holds."""
    counts: collections.Counter = collections.Counter()
    for weight in model.weights:
        var = getattr(weight, "_value", weight)  # the tf.Variable behind a Keras variable
        spec = tf.DeviceSpec.from_string(var.device)
        counts[f"{spec.job}:{spec.task}"] += 1
    return dict(sorted(counts.items()))


class StopOnSigterm:
    """SIGTERM (a polite preemption) asks the chief to stop at the next drain.

    Whatever has been scheduled is finished and checkpointed before the run
    ends with Preempted, so a relaunch loses no step.
    """

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        if not self.requested:
            print("SIGTERM: finishing scheduled steps, then checkpointing and stopping",
                  flush=True)
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


class CoordinatedTrainer(Trainer):
    """What both parameter-server trainers share, on the chief.

    The workers' names, SIGTERM as a request to stop at the next drain, the
    stall watchdog, and the end: the servers stop on their own once the
    chief is gone (strategies.server).
    """

    lost_member_errors = PS_LOST_MEMBER_ERRORS
    # Seconds past --stuck-timeout before the stall watchdog acts: a trainer
    # that handles a stuck worker itself gets there first.
    stall_grace = 0.0

    def __init__(self, *, plan, bundle, task, state, checkpointer, start_step, train_metrics):
        super().__init__(plan=plan, bundle=bundle, task=task, state=state,
                         checkpointer=checkpointer, start_step=start_step,
                         train_metrics=train_metrics)
        self.coordinator = bundle.coordinator
        self.workers = [f"{role}:{i}" for role, i, _ in self.cluster.members() if role == "worker"]
        condense_tf_logs()
        self.applied_before = int(self.state.global_step.numpy())
        # How long a lost or stuck task may hold the run up (--stuck-timeout).
        self.patience = self.config.stuck_timeout
        self._last: dict[str, float] = {}
        self._stall: StallWatchdog | None = None
        self._guard: CallGuard | None = None
        self._events = protocol.EventLog(self.cluster.member_name)
        self._sigterm: StopOnSigterm | None = None

    def listen_for_sigterm(self) -> None:
        """From here on a SIGTERM is a request to stop at the next drain,
        even one that arrives while the first closure runs."""
        self._sigterm = StopOnSigterm()

    def on_started(self) -> None:
        # With too few workers left the coordinator (or ps:0) waits without
        # a timeout of its own: the watchdog ends the chief with one line.
        self._stall = StallWatchdog(self.cluster, self.patience, grace=self.stall_grace)
        self._guard = CallGuard(self.cluster, self.patience)

    def stuck_peers(self) -> tuple[list[str], list[str]]:
        """(stuck or unreachable ps tasks, stuck workers), each "role:i (address)"."""
        states = peer_states(self.cluster)
        ps = [n for n, st in states.items() if n.startswith("ps:") and st != "ok"]
        workers = [n for n, st in states.items() if n.startswith("worker:") and st == "stuck"]
        return ps, workers

    def end_on_stuck_ps(self, ps: list[str], waited: float) -> None:
        """Every step reads and writes the ps tasks: with one stuck nothing
        moves, and any call of ours would wait on it (a hard exit, as the
        watchdog's)."""
        exit_now(Exit.TASK_LOST, (
            f"error: {self.cluster.member_name}: {', '.join(ps)} did not answer for {waited:.0f}s "
            f"(--stuck-timeout={self.patience:g}) while training at step {self.completed}: "
            f"a ps task that is stuck or cut off holds every step; {self._resume_text()}"))

    def saving(self, step: int):
        """Wait up to --stuck-timeout for every stuck peer to answer; then save,
        guarded, or end with one line.

        TensorFlow traces a new function for each save of a checkpoint spread
        over several tasks (``functional_saver.MultiDeviceSaver.save``) and
        registers it with every task of the cluster: a task that is alive but
        stuck never answers, and the chief then blocks inside that call,
        holding the GIL, so not even the stall watchdog's thread could end
        it. So the peers are probed first (a few milliseconds when all
        answer; a dead task refuses the connection and does not hold a save
        up), and a task that stops during the save itself is left to the
        guard, a child process that ends the chief with one line.
        """
        since, reported = time.monotonic(), False
        while True:
            states = peer_states(self.cluster)
            stuck = [name for name, state in states.items() if state == "stuck"]
            if not stuck:
                break
            waited = time.monotonic() - since
            if not reported:
                # A worker restarted meanwhile (launch.py --restart-tasks)
                # refuses connections while it starts: the save goes ahead.
                self.report_stuck([n.split(" ")[0] for n in stuck if n.startswith("worker:")])
                reported = True
            if waited >= self.patience:
                self._end_before_save(step, stuck, states, waited)
            if self._stall is not None:
                self._stall.progress()  # this wait ends itself
            time.sleep(1.0)
        if self._guard is None:
            return contextlib.nullcontext()
        return self._guard.guarded(f"the checkpoint save at step {step}", self._resume_text())

    def report_stuck(self, names: list[str]) -> None:
        """A typed record for whoever manages the cluster (``launch.py
        --restart-tasks`` restarts the task, as a liveness check would):
        TensorFlow's dispatch can stall once a worker is stuck (docs/reliability.md),
        and a restarted worker is one it knows how to recover from."""
        for name in names:
            self._events.emit(protocol.STUCK, self.completed, peer=name)

    def _resume_text(self) -> str:
        return (f"relaunch to resume from the checkpoint at step {self.checkpointer.saved_at}"
                if self.checkpointer.saved_at else "relaunch to start again")

    def _end_before_save(self, step, stuck, states, waited) -> None:
        ps = [name for name in stuck if name.startswith("ps:")]
        if ps:
            self.end_on_stuck_ps(ps, waited)
        exit_now(Exit.TASK_LOST, (
            f"error: {self.cluster.member_name}: the checkpoint at step {step} would wait "
            f"on a stuck task (TensorFlow registers each save with every task), and it did "
            f"not answer within {waited:.0f}s (--stuck-timeout={self.patience:g}); "
            f"{states_text(states)}; {self._resume_text()}"))

    def paused(self):
        return self._stall.paused() if self._stall is not None else super().paused()

    def stop_requested(self) -> bool:
        return self._sigterm is not None and self._sigterm.requested

    def _metrics(self) -> dict[str, float]:
        return dict(self._last)

    def local_model(self):
        """The chief's copy of the model (the one evaluation uses), holding the weights
        the ps tasks hold now: every step counted so far, and any still in flight
        under ``ps`` (at an epoch end or the end nothing is: the controller drained).
        Its optimizer's ``iterations`` is the global step, as ``fit``'s would be."""
        from tfdist.training.loop.evaluation import local_copy

        local = local_copy(self.state.model, self.task.local_model)
        optimizer = getattr(local, "optimizer", None)
        if optimizer is not None:
            optimizer.iterations.assign(int(self.state.global_step.numpy()))
        return local

    def evaluation_members(self):
        """Each evaluation cut into ``--eval-shards`` shards the coordinator schedules on
        the workers (``training.ps.sharded_eval``) while ``workers_free()`` holds;
        ``--evaluate-on chief``: the chief alone."""
        if self.config.evaluate_on == "chief":
            return None
        from tfdist.training.ps.sharded_eval import CoordinatedEvaluation

        evaluation = CoordinatedEvaluation(self.coordinator, self.state.model, self.task.task,
                                           self.workers, quiet=self.workers_free)
        return evaluation.shards(self.plan.eval_shards, self.task.local_model,
                                 self.sharded_evaluation_refusal())

    def workers_free(self):
        """A context in which no step closure holds a worker: under ``ps`` the
        controller's drain before an evaluation ended them all."""
        return contextlib.nullcontext()

    def sharded_evaluation_refusal(self) -> str | None:
        """Why this trainer's workers cannot evaluate shards (the chief then does); None."""
        return None

    def ps_variable_bytes(self) -> dict[str, int]:
        """Bytes of model variables and optimizer slots each ps task holds."""
        state = self.state
        return ps_variable_bytes(state.model.weights, state.optimizer.variables)

    def finish_worker(self) -> None:
        raise AssertionError(f"under {self.bundle.name} only the chief trains")

    def end_of_job(self) -> None:
        """Servers stop on their own once the chief is gone (strategies.server)."""

    def close(self, finished: bool) -> None:
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        if self._stall is not None:
            self._stall.stop()
        if self._sigterm is not None:
            self._sigterm.restore()
        self.checkpointer.close()
