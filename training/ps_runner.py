"""The parameter-server runner: the chief schedules, workers compute, ps hold.

Closures of ``--steps-per-execution`` steps are scheduled on whichever worker
is free; the chief keeps a bounded window of them in flight, reads their
results as they complete (for progress and staleness), and joins only at
epoch ends, where it checkpoints.
"""

from __future__ import annotations

import collections
import os
import time

import keras
import numpy as np
import tensorflow as tf

from training import data
from training.config import TrainConfig
from training.loop import Throughput, build_state, make_step_fn, make_train_fn
from training.runners import _Reporter, _base_results, _finish, _restore, _steps_this_call


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


def run_ps(config: TrainConfig, bundle, replicas: int, started_ok=lambda: None) -> dict:
    cfg, strategy, coordinator = config.cluster, bundle.strategy, bundle.coordinator
    workers = [f"{role}:{i}" for role, i, _ in cfg.tasks() if role == "worker"]
    started = time.perf_counter()
    keras.utils.set_random_seed(config.seed)
    state = build_state(config, strategy)
    with strategy.scope():
        # One copy per worker, so each worker counts the steps it ran
        # (the classic example's local_step).
        local_step = tf.Variable(0, dtype=tf.int64, trainable=False, per_worker_variable=True)
    ckpt_dir = os.path.join(config.model_dir, "checkpoints")
    step = start_step = _restore(state, ckpt_dir, config.model)
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
    if step < total:
        n = _steps_this_call(step, total, config)
        first = coordinator.schedule(train_fn, args=(per_worker_iter, tf.constant(n)))
        out = first.fetch()
        staleness.append(out["staleness"])
        step += n
    # The first step ran: every peer is connected, so stop the startup watchdog.
    started_ok()
    startup_seconds = time.perf_counter() - started
    reporter.throughput = Throughput(config.global_batch_size, step)
    steady_from = step

    # Enough closures in flight to keep every worker busy while we read results.
    max_in_flight = 4 * max(1, len(workers))
    pending: collections.deque = collections.deque()
    done = step
    last = {"loss": float(out["loss"]), "accuracy": float(out["accuracy"])} if step > start_step else {}

    def collect_one():
        nonlocal done, last
        remote, n = pending.popleft()
        result = remote.fetch()
        staleness.append(result["staleness"])
        last = {"loss": float(result["loss"]), "accuracy": float(result["accuracy"])}
        done += n

    def report():
        counts = local_step.read_all()
        recent = np.concatenate(staleness[-max_in_flight:]) if staleness else []
        stats = staleness_stats(recent)
        extra = (
            f" | global_step {int(state.global_step.numpy())} local_steps "
            + " ".join(f"{w}={int(c)}" for w, c in zip(workers, counts))
            + f" | staleness mean {stats['mean']:.2f} max {stats['max']}"
        )
        reporter.report(done, last, extra)

    def boundary(at: int) -> bool:
        # Points where the chief drains every closure before scheduling more:
        # epoch ends (checkpoint) and evaluations (a consistent model).
        return at % config.steps_per_epoch == 0 or at >= total or reporter.eval_due(at)

    at_boundary = boundary(step)
    while done < total:
        while not at_boundary and len(pending) < max_in_flight:
            n = _steps_this_call(step, total, config)
            pending.append(
                (coordinator.schedule(train_fn, args=(per_worker_iter, tf.constant(n))), n)
            )
            step += n
            at_boundary = boundary(step)
        if pending:
            collect_one()
            if reporter.due(done) and pending:
                report()
        if not pending:
            # Everything scheduled has been applied: done == step.
            coordinator.join()
            report()
            if reporter.eval_due(step):
                reporter.evaluate(step, state.model)
            if step % config.steps_per_epoch == 0 or step >= total:
                manager.save(checkpoint_number=int(state.global_step.numpy()))
            at_boundary = False
    train_seconds, examples_per_sec = reporter.throughput.overall(done)

    results = _base_results(config, bundle.name, replicas)
    all_staleness = np.concatenate(staleness) if staleness else np.zeros(0)
    results.update(
        global_steps=int(state.global_step.numpy()),
        scheduled_steps=done - start_step,
        steps_this_run=done - start_step,
        resumed_from_step=start_step,
        steps_per_worker={w: int(c) for w, c in zip(workers, local_step.read_all())},
        staleness=staleness_stats(all_staleness),
        variables_per_ps=variables_per_ps(state.model),
        startup_seconds=round(startup_seconds, 3),
        train_seconds=round(train_seconds, 3),
        steady_steps=done - steady_from,
        examples_per_sec=examples_per_sec,
        wall_seconds=round(time.perf_counter() - started, 3),
    )
    return _finish(config, state, reporter, results)
