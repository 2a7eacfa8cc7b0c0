"""One runner per strategy. Strategy-specific control flow lives here only."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

import keras
import tensorflow as tf

from training import data
from training.config import TrainConfig
from training.loop import (
    DEFAULT_LEARNING_RATE, PeriodicEval, Throughput, build_state, evaluate, local_copy, make_step_fn,
    make_train_fn,
    summary_line, weights_sha256, write_json_atomic,
)
from training.recovery import preemption_handler, restore_latest, task_lost

# Errors that mean a peer went away rather than a bug in this program.
PEER_ERRORS = (
    tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError,
    tf.errors.DeadlineExceededError,
)


class _Reporter:
    """Progress lines on every task; TensorBoard scalars on the chief only."""

    def __init__(self, config: TrainConfig, is_chief: bool, start_step: int,
                 started: float | None = None):
        self.config = config
        self.is_chief = is_chief
        self.total = config.total_steps
        self.throughput = Throughput(config.global_batch_size, start_step)
        self.next_log = start_step + config.log_every
        self.writer = (
            tf.summary.create_file_writer(os.path.join(config.model_dir, "logs"))
            if is_chief else None
        )
        # The eval curve's clock starts with the process's work, startup included.
        self.started = time.perf_counter() if started is None else started
        self.eval_seconds = 0.0
        self.next_eval = (start_step // config.eval_every + 1) * config.eval_every \
            if config.eval_every else None
        self.curve: list[dict] = []  # test accuracy against training time
        self._eval = None

    def eval_due(self, step: int) -> bool:
        return self.is_chief and self.next_eval is not None and step >= self.next_eval \
            and step < self.total  # the final evaluation is _finish's

    def evaluate(self, step: int, model) -> None:
        """Test accuracy now; its time is left out of every rate and clock."""
        t0, seconds = time.perf_counter(), self.clock()
        if self._eval is None:
            self._eval = PeriodicEval(self.config.model, data.eval_dataset(self.config.data_dir))
        accuracy, loss = self._eval(model)
        self.add_point(step, accuracy, seconds)
        print(f"eval step {step} test_accuracy {accuracy:.4f} test_loss {loss:.4f} "
              f"at {self.curve[-1]['seconds']:.1f}s", flush=True)
        if self.writer is not None:
            with self.writer.as_default(step=step):
                tf.summary.scalar("test/accuracy", accuracy)
        self.next_eval = (step // self.config.eval_every + 1) * self.config.eval_every
        spent = time.perf_counter() - t0
        self.eval_seconds += spent
        if self.throughput is not None:
            self.throughput.pause(spent)

    def clock(self) -> float:
        """Seconds of this task's work so far, evaluations left out."""
        return time.perf_counter() - self.started - self.eval_seconds

    def add_point(self, step: int, accuracy: float, seconds: float | None = None) -> None:
        seconds = self.clock() if seconds is None else seconds
        self.curve.append({"step": step, "seconds": round(seconds, 3),
                           "test_accuracy": round(accuracy, 5)})

    def due(self, step: int) -> bool:
        return step >= self.next_log or step >= self.total

    def report(self, step: int, scalars: dict, extra: str = "") -> None:
        self.next_log = (step // self.config.log_every + 1) * self.config.log_every
        steps_per_sec, examples_per_sec = self.throughput.tick(step)
        epoch = (step - 1) // self.config.steps_per_epoch + 1
        fields = " ".join(f"{k} {v:.4f}" for k, v in scalars.items())
        print(
            f"step {step}/{self.total} epoch {epoch} {fields} "
            f"steps/s {steps_per_sec:.1f} examples/s {examples_per_sec:.0f}{extra}",
            flush=True,
        )
        if self.writer is not None:
            with self.writer.as_default(step=step):
                for key, value in scalars.items():
                    tf.summary.scalar(f"train/{key}", value)
                tf.summary.scalar("train/examples_per_sec", examples_per_sec)

    def final(self, results: dict) -> None:
        if self.writer is not None:
            with self.writer.as_default(step=results["global_steps"]):
                tf.summary.scalar("test/accuracy", results["test_accuracy"])
                tf.summary.scalar("test/loss", results["test_loss"])
            self.writer.close()


def _finish(config: TrainConfig, state, reporter: _Reporter, results: dict) -> dict:
    """Evaluate a local copy of the weights; write the chief's outputs."""
    seconds = reporter.clock()
    model = local_copy(state.model, config.model)
    accuracy, loss = evaluate(model, data.eval_dataset(config.data_dir))
    reporter.add_point(results["global_steps"], accuracy, seconds)
    results.update(
        eval_curve=reporter.curve,
        eval_seconds=round(reporter.eval_seconds, 3),
        test_accuracy=accuracy,
        test_loss=loss,
        weights_sha256=weights_sha256(model),
        tf_version=tf.__version__,
        keras_version=keras.__version__,
    )
    model.save(os.path.join(config.model_dir, "model.keras"))
    write_json_atomic(os.path.join(config.model_dir, "results.json"), results)
    reporter.final(results)
    print(summary_line(results), flush=True)
    return results


def _base_results(config: TrainConfig, strategy_name: str, replicas: int) -> dict:
    cfg = config.cluster
    return {
        "strategy": strategy_name,
        "model": config.model,
        "optimizer": config.optimizer,
        "learning_rate": config.learning_rate or DEFAULT_LEARNING_RATE[config.optimizer],
        "lr_schedule": config.lr_schedule,
        # Under ps the chief coordinates and does not train.
        "num_workers": cfg.num_tasks("worker") if strategy_name == "ps" else cfg.num_workers,
        "num_ps": cfg.num_ps,
        "replicas_in_sync": replicas,
        "global_batch_size": config.global_batch_size,
        "steps_per_execution": config.steps_per_execution,
        "seed": config.seed,
    }


def _steps_this_call(step: int, total: int, config: TrainConfig) -> int:
    """Up to ``steps_per_execution`` steps, never across an epoch end or checkpoint."""
    to_epoch_end = config.steps_per_epoch - step % config.steps_per_epoch
    n = min(config.steps_per_execution, total - step, to_epoch_end)
    if config.checkpoint_every:
        n = min(n, config.checkpoint_every - step % config.checkpoint_every)
    return n


def checkpoint_due(step: int, total: int, config: TrainConfig) -> bool:
    """Epoch ends, every ``--checkpoint-every`` steps, and the end."""
    return (
        step >= total
        or step % config.steps_per_epoch == 0
        or bool(config.checkpoint_every and step % config.checkpoint_every == 0)
    )


def save_checkpoint(state, manager, step: int, announce: bool) -> str:
    """Save at ``step`` requested steps done; the chief says so in one line.

    The line is what ``launch.py --kill ...@step=N`` and the tests wait for.
    """
    state.completed_steps.assign(step)
    path = manager.save(checkpoint_number=step)
    if announce:
        print(f"checkpoint saved at step {step}: {path}", flush=True)
    return path


def run_sync(config: TrainConfig, bundle, replicas: int, started_ok=lambda: None) -> dict | None:
    """Mirrored and multi-worker mirrored: every task runs every step.

    Every worker saves checkpoints (the save may need collectives), but only
    the chief's copy lands in ``--model-dir``; the others go to a private
    temporary directory that is removed at the end. A SIGTERM to any worker
    makes every worker save at one agreed step and stop (``Preempted``); a
    lost peer ends the run with ``TaskLost``.
    """
    cfg, strategy = config.cluster, bundle.strategy
    is_chief = cfg.is_chief
    started = time.perf_counter()
    keras.utils.set_random_seed(config.seed)
    state = build_state(config, strategy)
    chief_ckpt_dir = os.path.join(config.model_dir, "checkpoints")
    # Every worker resumes from the chief's checkpoints: on a real cluster
    # --model-dir is shared storage.
    step = start_step = restore_latest(state, chief_ckpt_dir, config.model)
    ckpt_dir = chief_ckpt_dir if is_chief else tempfile.mkdtemp(
        prefix=f"ckpt-{cfg.task_type}-{cfg.task_index}-"
    )
    manager = tf.train.CheckpointManager(state.checkpoint, ckpt_dir, max_to_keep=3)
    saved_at = start_step

    def save(current: int) -> None:
        nonlocal saved_at
        save_checkpoint(state, manager, current, announce=is_chief)
        saved_at = current

    dataset_fn = data.make_dataset_fn(
        config.global_batch_size, seed=config.seed, start_step=start_step,
        data_dir=config.data_dir, synthetic=config.synthetic_data,
    )
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    train_fn = make_train_fn(
        strategy, make_step_fn(state, config.global_batch_size), state,
        config.global_batch_size,
    )
    total = config.total_steps
    reporter = _Reporter(config, is_chief, start_step, started)
    # As early as the coordination service allows (the strategy is up, so
    # every peer is): until the handler takes SIGTERM over, TensorFlow's own
    # notifier swallows it and the preemption would go unnoticed.
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    handler = preemption_handler(strategy, lambda: save(step), lambda: step)

    def run_call(n: int):
        # The handler checks for a preemption notice (any worker's) before
        # the call; at the agreed call it saves and raises Preempted.
        if handler is None:
            return train_fn(iterator, tf.constant(n))
        return handler.run(train_fn, iterator, tf.constant(n))

    try:
        if step < total:
            # The first call traces and runs the first collective: the last
            # point where a missing peer can leave us waiting.
            n = _steps_this_call(step, total, config)
            out = run_call(n)
            step += n
        # The first step ran: every peer is connected, so stop the startup watchdog.
        started_ok()
        startup_seconds = time.perf_counter() - started
        reporter.throughput = Throughput(config.global_batch_size, step)
        steady_from = step
        while True:
            if reporter.due(step) and step > start_step:
                reporter.report(step, {"loss": float(out["loss"]), "accuracy": float(out["accuracy"])})
            if reporter.eval_due(step):
                reporter.evaluate(step, state.model)
            if step > start_step and checkpoint_due(step, total, config) and saved_at != step:
                save(step)
            if step >= total:
                break
            n = _steps_this_call(step, total, config)
            out = run_call(n)
            step += n
        train_seconds, examples_per_sec = reporter.throughput.overall(step)
        if handler is not None:
            handler.close()
    except PEER_ERRORS as err:
        if cfg.is_local:
            raise
        raise task_lost(err, cfg, "training", step, saved_at) from None
    finally:
        if not is_chief:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        if handler is not None:
            shutil.rmtree(handler.counter_dir, ignore_errors=True)
            # The handler took over SIGTERM; a caller (a test, a notebook)
            # gets its own back.
            signal.signal(signal.SIGTERM, previous_sigterm)

    results = _base_results(config, bundle.name, replicas)
    ran = step - start_step
    results.update(
        global_steps=int(state.global_step.numpy()),
        steps_this_run=ran,
        resumed_from_step=start_step,
        steps_per_worker={
            f"{role}:{i}": ran for role, i, _ in cfg.tasks() if role in ("chief", "worker")
        } or {cfg.task_name: ran},
        startup_seconds=round(startup_seconds, 3),
        train_seconds=round(train_seconds, 3),
        steady_steps=step - steady_from,
        examples_per_sec=examples_per_sec,
        wall_seconds=round(time.perf_counter() - started, 3),
    )
    if not is_chief:
        digest = weights_sha256(local_copy(state.model, config.model))
        print(
            f"{cfg.task_name} done: global_steps={results['global_steps']} "
            f"weights_sha256={digest}", flush=True,
        )
        return None
    return _finish(config, state, reporter, results)
