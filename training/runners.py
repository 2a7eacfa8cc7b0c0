"""One runner per strategy. Strategy-specific control flow lives here only."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import keras
import tensorflow as tf

from strategies import ConfigError
from training import data
from training.config import TrainConfig
from training.loop import (
    DEFAULT_LEARNING_RATE, PeriodicEval, Throughput, build_state, evaluate, local_copy, make_step_fn,
    make_train_fn,
    summary_line, weights_sha256, write_json_atomic,
)


def _restore(state, ckpt_dir: str, model_name: str) -> int:
    """Resume from the newest checkpoint in ``ckpt_dir``; return its step."""
    latest = tf.train.latest_checkpoint(ckpt_dir)
    if not latest:
        return 0
    try:
        state.checkpoint.restore(latest).assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as err:
        first = str(err).strip().splitlines()[0][:160]
        raise ConfigError(
            f"checkpoint {latest!r} does not match --model={model_name} ({first}); "
            "use a fresh --model-dir or the model that wrote it"
        ) from None
    step = int(state.global_step.numpy())
    print(f"resumed from {latest} at global step {step}", flush=True)
    return step


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
    """Up to ``steps_per_execution`` steps, never across an epoch end."""
    to_epoch_end = config.steps_per_epoch - step % config.steps_per_epoch
    return min(config.steps_per_execution, total - step, to_epoch_end)


def run_sync(config: TrainConfig, bundle, replicas: int, started_ok=lambda: None) -> dict | None:
    """Mirrored and multi-worker mirrored: every task runs every step.

    Every worker saves checkpoints (the save may need collectives), but only
    the chief's copy lands in ``--model-dir``; the others go to a private
    temporary directory that is removed at the end.
    """
    cfg, strategy = config.cluster, bundle.strategy
    is_chief = cfg.is_chief
    started = time.perf_counter()
    keras.utils.set_random_seed(config.seed)
    state = build_state(config, strategy)
    chief_ckpt_dir = os.path.join(config.model_dir, "checkpoints")
    # Every worker resumes from the chief's checkpoints: on a real cluster
    # --model-dir is shared storage.
    step = start_step = _restore(state, chief_ckpt_dir, config.model)
    ckpt_dir = chief_ckpt_dir if is_chief else tempfile.mkdtemp(
        prefix=f"ckpt-{cfg.task_type}-{cfg.task_index}-"
    )
    manager = tf.train.CheckpointManager(state.checkpoint, ckpt_dir, max_to_keep=3)
    dataset_fn = data.make_dataset_fn(
        config.global_batch_size, seed=config.seed + start_step,
        data_dir=config.data_dir, synthetic=config.synthetic_data,
    )
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    train_fn = make_train_fn(
        strategy, make_step_fn(state, config.global_batch_size), state,
        config.global_batch_size,
    )
    total = config.total_steps
    reporter = _Reporter(config, is_chief, start_step, started)
    if step < total:
        # The first call traces and runs the first collective: the last
        # point where a missing peer can leave us waiting.
        n = _steps_this_call(step, total, config)
        out = train_fn(iterator, tf.constant(n))
        step += n
    # The first step ran: every peer is connected, so stop the startup watchdog.
    started_ok()
    startup_seconds = time.perf_counter() - started
    reporter.throughput = Throughput(config.global_batch_size, step)
    steady_from = step
    try:
        while True:
            if reporter.due(step) and step > start_step:
                reporter.report(step, {"loss": float(out["loss"]), "accuracy": float(out["accuracy"])})
            if reporter.eval_due(step):
                reporter.evaluate(step, state.model)
            if step > start_step and (step % config.steps_per_epoch == 0 or step >= total):
                manager.save(checkpoint_number=step)
            if step >= total:
                break
            n = _steps_this_call(step, total, config)
            out = train_fn(iterator, tf.constant(n))
            step += n
        train_seconds, examples_per_sec = reporter.throughput.overall(step)
    finally:
        if not is_chief:
            shutil.rmtree(ckpt_dir, ignore_errors=True)

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
