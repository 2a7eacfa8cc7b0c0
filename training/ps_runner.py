"""The parameter-server runner: the chief schedules, workers compute, ps hold.

Closures of ``--steps-per-execution`` steps are scheduled on whichever worker
is free; the chief keeps a bounded window of them in flight, reads their
results as they complete (for progress and staleness), and joins only at
checkpoints (epoch ends, ``--checkpoint-every``).

Faults: a lost worker's closures are rerun by the coordinator on the others
(a closure may run twice: ``reexecuted_steps``); a lost ps task, or all
workers gone for ``--startup-timeout``, ends the chief with one line; a
SIGTERM finishes what was scheduled, checkpoints and ends with Preempted.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

import keras
import numpy as np
import tensorflow as tf
# Not exported by tf.distribute, but what the coordinator raises for a lost task.
from tensorflow.python.distribute.coordinator.cluster_coordinator import (
    ClosureAbortedError, ClosureInputError,
)

from training import data
from training.config import TrainConfig
from training.loop import Throughput, build_state, make_step_fn, make_train_fn
from training.recovery import (
    Preempted, StallWatchdog, condense_tf_logs, fetch, restore_latest, task_lost,
)
from training.runners import (
    PEER_ERRORS, _Reporter, _base_results, _finish, _steps_this_call, checkpoint_due,
    save_checkpoint,
)

# Besides gRPC errors, the coordinator wraps a lost task's errors in these.
PS_PEER_ERRORS = PEER_ERRORS + (ClosureInputError, ClosureAbortedError)


def staleness_stats(values) -> dict:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0, "histogram": {}}
    return {
        "count": int(arr.size),
        "mean": round(float(arr.mean()), 4),
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
        "max": int(arr.max()),
        # {staleness: how many updates}, for the benchmark's histogram.
        "histogram": {str(int(v)): int(c) for v, c in zip(*np.unique(arr, return_counts=True))},
    }


def variables_per_ps(model: keras.Model) -> dict[str, int]:
    """How many variable pieces (shards count separately) each ps task holds."""
    counts: collections.Counter = collections.Counter()
    for weight in model.weights:
        var = getattr(weight, "_value", weight)  # the tf.Variable behind a Keras variable
        for piece in getattr(var, "variables", [var]):  # a ShardedVariable's shards
            spec = tf.DeviceSpec.from_string(piece.device)
            counts[f"{spec.job}:{spec.task}"] += 1
    return dict(sorted(counts.items()))


def _read_counts(local_step, timeout: float = 2.0) -> list[int] | None:
    """Each worker's local step count, or None while a worker is down.

    Reading a per-worker variable of a lost worker raises, or waits until the
    worker is back; a daemon thread with a timeout keeps progress lines and
    the final results from waiting on it.
    """
    box: list = []

    def read():
        try:
            box.append([int(c) for c in local_step.read_all()])
        except Exception:  # pylint: disable=broad-except
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else None


class _StopOnSigterm:
    """SIGTERM (a polite preemption) asks the chief to stop at the next join.

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


def run_ps(config: TrainConfig, bundle, replicas: int, started_ok=lambda: None) -> dict:
    cfg, strategy, coordinator = config.cluster, bundle.strategy, bundle.coordinator
    workers = [f"{role}:{i}" for role, i, _ in cfg.tasks() if role == "worker"]
    started = time.perf_counter()
    keras.utils.set_random_seed(config.seed)
    condense_tf_logs()
    state = build_state(config, strategy)
    with strategy.scope():
        # One copy per worker, so each worker counts the steps it ran
        # (the classic example's local_step). A restarted worker's copy is
        # created again, from 0.
        local_step = tf.Variable(0, dtype=tf.int64, trainable=False, per_worker_variable=True)
    ckpt_dir = os.path.join(config.model_dir, "checkpoints")
    step = start_step = restore_latest(state, ckpt_dir, config.model)
    applied_before = int(state.global_step.numpy())
    manager = tf.train.CheckpointManager(state.checkpoint, ckpt_dir, max_to_keep=3)
    dataset_fn = data.make_dataset_fn(
        config.global_batch_size, seed=None, data_dir=config.data_dir,
        synthetic=config.synthetic_data,
    )
    per_worker_iter = iter(coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(dataset_fn)
    ))
    train_fn = make_train_fn(
        strategy, make_step_fn(state, config.global_batch_size), state,
        config.global_batch_size, local_step=local_step,
    )
    total = config.total_steps
    reporter = _Reporter(config, True, start_step, started)
    staleness: list[np.ndarray] = []
    # How long a fetch may wait for a lost worker's closure to be rerun.
    patience = config.startup_timeout
    saved_at = start_step
    done = step
    # From here on a SIGTERM is a request to stop at the next checkpoint,
    # even one that arrives while the first closure runs.
    sigterm = _StopOnSigterm()
    try:
        if step < total:
            n = _steps_this_call(step, total, config)
            first = coordinator.schedule(train_fn, args=(per_worker_iter, tf.constant(n)))
            out = fetch(first, time.monotonic() + patience)
            staleness.append(out["staleness"])
            step += n
            done = step
        # The first step ran: every peer is connected, so stop the startup watchdog.
        started_ok()
    except PS_PEER_ERRORS as err:
        sigterm.restore()
        raise task_lost(err, cfg, "starting", done, saved_at) from None
    startup_seconds = time.perf_counter() - started
    reporter.throughput = Throughput(config.global_batch_size, step)
    steady_from = step

    # Enough closures in flight to keep every worker busy while we read results.
    max_in_flight = 4 * max(1, len(workers))
    pending: collections.deque = collections.deque()
    last = {"loss": float(out["loss"]), "accuracy": float(out["accuracy"])} if step > start_step else {}
    stall = StallWatchdog(cfg, patience)

    def collect_one():
        nonlocal done, last
        remote, n = pending.popleft()
        result = fetch(remote, time.monotonic() + patience)
        stall.progress()
        staleness.append(result["staleness"])
        last = {"loss": float(result["loss"]), "accuracy": float(result["accuracy"])}
        done += n

    def report():
        counts = _read_counts(local_step)
        recent = np.concatenate(staleness[-max_in_flight:]) if staleness else []
        stats = staleness_stats(recent)
        extra = (
            f" | global_step {int(state.global_step.numpy())} local_steps "
            + (" ".join(f"{w}={c}" for w, c in zip(workers, counts))
               if counts else "unavailable (a worker is down)")
            + f" | staleness mean {stats['mean']:.2f} max {stats['max']}"
        )
        reporter.report(done, last, extra)

    try:
        while done < total:
            # Up to a checkpoint and no further: it must hold exactly the
            # steps scheduled before it, all applied.
            # Evaluations drain too: a consistent model, and no closures run
            # during the time the evaluation is left out of.
            while (not sigterm.requested and step < total and len(pending) < max_in_flight
                   and not (step > done and (checkpoint_due(step, total, config)
                                             or reporter.eval_due(step)))):
                n = _steps_this_call(step, total, config)
                pending.append(
                    (coordinator.schedule(train_fn, args=(per_worker_iter, tf.constant(n))), n)
                )
                step += n
            if pending:
                collect_one()
                if reporter.due(done) and pending:
                    report()
            if not pending:
                # A checkpoint (or the end): everything scheduled has been applied.
                coordinator.join()
                if reporter.eval_due(done):
                    reporter.evaluate(done, state.model)
                if saved_at != done and (checkpoint_due(done, total, config) or sigterm.requested):
                    report()
                    save_checkpoint(state, manager, done, announce=True)
                    saved_at = done
                if sigterm.requested:
                    raise Preempted(done)
    except PS_PEER_ERRORS as err:
        raise task_lost(err, cfg, "training", done, saved_at) from None
    finally:
        stall.stop()
        sigterm.restore()
    train_seconds, examples_per_sec = reporter.throughput.overall(done)

    results = _base_results(config, bundle.name, replicas)
    all_staleness = np.concatenate(staleness) if staleness else np.zeros(0)
    applied = int(state.global_step.numpy()) - applied_before
    scheduled = done - start_step
    counts = _read_counts(local_step)
    results.update(
        global_steps=int(state.global_step.numpy()),
        completed_steps=done,
        scheduled_steps=scheduled,
        # Updates the ps applied in this run; more than scheduled when a lost
        # worker's closure had applied some of its steps before it was rerun.
        applied_steps=applied,
        reexecuted_steps=applied - scheduled,
        steps_this_run=scheduled,
        resumed_from_step=start_step,
        # Steps each worker process ran since it (re)started; None if one is down.
        steps_per_worker=dict(zip(workers, counts)) if counts else None,
        staleness=staleness_stats(all_staleness),
        variables_per_ps=variables_per_ps(state.model),
        startup_seconds=round(startup_seconds, 3),
        train_seconds=round(train_seconds, 3),
        steady_steps=done - steady_from,
        examples_per_sec=examples_per_sec,
        wall_seconds=round(time.perf_counter() - started, 3),
    )
    return _finish(config, state, reporter, results)
