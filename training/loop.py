"""The training step shared by every strategy, and what surrounds it.

Keras 3 ``model.fit`` cannot drive the multi-worker strategies
(keras-team/keras#20585, #18624), so this is a custom loop. Keras layers and
optimizers are used as they are; the step counter is our own variable
because Keras 3's ``optimizer.iterations`` loses increments under
asynchronous parameter-server updates.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from models import build_model

# Peak rates for the default cosine schedule; the CNN reaches 0.9878 after one
# epoch at adam 5e-3 vs 0.9775 at 1e-3 (measured, mirrored, seed 42).
DEFAULT_LEARNING_RATE = {"adam": 5e-3, "sgd": 0.1}


def make_optimizer(name: str, learning_rate: float | None, schedule: str = "constant",
                   total_steps: int = 1) -> keras.optimizers.Optimizer:
    lr = DEFAULT_LEARNING_RATE[name] if learning_rate is None else learning_rate
    if schedule == "cosine":
        # Decaying to zero over the run is worth ~0.4 points of test accuracy
        # after one CNN epoch (measured), and it is a few scalar ops per step.
        lr = keras.optimizers.schedules.CosineDecay(lr, decay_steps=max(1, total_steps))
    if name == "adam":
        return keras.optimizers.Adam(lr)
    return keras.optimizers.SGD(lr)


@dataclass
class TrainState:
    """Model, optimizer and counters, created under one strategy scope."""

    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    global_step: tf.Variable
    # Requested steps done: the run's (and the data's) position. Equal to
    # global_step under sync strategies; under ps global_step also counts the
    # updates of closures that ran twice after a worker was lost.
    completed_steps: tf.Variable
    checkpoint: tf.train.Checkpoint


def build_state(config, strategy) -> TrainState:
    """Model, optimizer and step counter for ``config`` (a TrainConfig)."""
    with strategy.scope():
        model = build_model(config.model)
        opt = make_optimizer(config.optimizer, config.learning_rate, config.lr_schedule,
                             config.total_steps)
        # Optimizer slots must exist before a checkpoint restore can fill them.
        opt.build(model.trainable_variables)
        # Updated in cross-replica context only (see make_train_fn), so no
        # cross-replica aggregation is ever needed; ONLY_FIRST_REPLICA still
        # makes replica-context reads well defined.
        global_step = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="global_step",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        completed_steps = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="completed_steps",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt, global_step=global_step,
                                     completed_steps=completed_steps)
    return TrainState(model, opt, global_step, completed_steps, checkpoint)


def make_step_fn(state: TrainState, global_batch_size: int):
    """One replica's step: forward, loss, gradients, update, metrics."""
    model, optimizer = state.model, state.optimizer

    def step_fn(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(
                labels, logits, from_logits=True
            )
            # Divide by the *global* batch: the optimizer sums gradients over
            # replicas, so the sum is the gradient of the global mean loss.
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        correct = tf.reduce_sum(
            tf.cast(tf.equal(tf.argmax(logits, axis=-1), labels), tf.float32)
        )
        return loss, correct

    return step_fn


def _after_updates(variables) -> list[tf.Tensor]:
    """One read per variable, each ordered after that variable's pending update.

    Raw reads stay on the variable's device (a ps task): only a control edge
    crosses to the caller, never the values.
    """
    reads = []
    for v in variables:
        var = getattr(v, "_value", v)  # the tf.Variable behind a Keras variable
        with tf.device(var.device):
            reads.append(tf.raw_ops.ReadVariableOp(resource=var.handle, dtype=var.dtype))
    return reads


def make_train_fn(strategy, step_fn, state: TrainState, examples_per_step: int,
                  local_step: tf.Variable | None = None):
    """``train_fn(iterator, num_steps)``: ``num_steps`` steps in one call.

    Packing several steps into one ``tf.function`` call (``--steps-per-execution``)
    saves a host round trip per step, which is what dominates small models.
    Returns the mean loss and accuracy (this worker's replicas) and, per step,
    the staleness: updates other workers applied between this step reading
    ``global_step`` and applying its own update (always 0 when synchronous).
    """

    def local_sum(per_replica):
        # Local results only: a cross-worker reduce would add a collective
        # per step just to print a number.
        return tf.add_n(strategy.experimental_local_results(per_replica))

    global_step, variables = state.global_step, state.model.trainable_variables
    try:
        local_replicas = len(strategy.extended.worker_devices)
    except RuntimeError:  # the default (no-op) strategy: one replica, no device list
        local_replicas = 1
    # This worker's share of the global batch, to turn local sums into means.
    local_fraction = local_replicas / strategy.num_replicas_in_sync

    @tf.function
    def train_fn(iterator, num_steps):
        loss_sum = tf.constant(0.0)
        correct_sum = tf.constant(0.0)
        staleness = tf.TensorArray(tf.int64, size=num_steps)
        for i in tf.range(num_steps):
            read_at = global_step.read_value()
            # The step's parameter reads must come after this read for the
            # staleness figure to mean what it says.
            with tf.control_dependencies([read_at]):
                loss, correct = strategy.run(step_fn, args=next(iterator))
            # Without this, only same-variable ordering holds: the counter's
            # increment could run before the update it counts and the
            # staleness figure would read ~0 whatever the overlap (measured).
            with tf.control_dependencies(_after_updates(variables)):
                applied_at = global_step.assign_add(1)
            loss_sum += local_sum(loss) / local_fraction
            correct_sum += local_sum(correct)
            staleness = staleness.write(i, applied_at - 1 - read_at)
        steps = tf.cast(num_steps, tf.float32)
        out = {
            "loss": loss_sum / steps,
            "accuracy": correct_sum / (steps * examples_per_step * local_fraction),
            "staleness": staleness.stack(),
        }
        if local_step is not None:
            # Per-worker variables get no automatic control dependencies.
            # Count only once the steps are done (after the loop's outputs).
            with tf.control_dependencies([out["loss"], out["staleness"]]):
                update = local_step.assign_add(tf.cast(num_steps, tf.int64), read_value=False)
            with tf.control_dependencies([update]):
                out["local_step"] = local_step.read_value()
        return out

    return train_fn


def local_copy(model: keras.Model, model_name: str) -> keras.Model:
    """A non-distributed copy of ``model``'s current weights.

    Evaluation, hashing and saving use this copy: it reads distributed or
    ps-hosted variables once, and Keras 3 cannot predict or save through a
    ParameterServerStrategy-scoped model.
    """
    copy = build_model(model_name)
    copy.set_weights([np.asarray(w) for w in model.get_weights()])
    return copy


def evaluate(model: keras.Model, dataset: tf.data.Dataset) -> tuple[float, float]:
    """(accuracy, mean loss) of a local model over ``dataset``."""
    return _evaluator(model)(dataset)


def _evaluator(model: keras.Model):
    @tf.function
    def batch_stats(images, labels):
        logits = model(images, training=False)
        loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        correct = tf.cast(tf.equal(tf.argmax(logits, axis=-1), labels), tf.float64)
        return tf.reduce_sum(tf.cast(loss, tf.float64)), tf.reduce_sum(correct)

    def run(dataset) -> tuple[float, float]:
        total_loss = total_correct = count = 0.0
        for images, labels in dataset:
            loss, correct = batch_stats(images, labels)
            total_loss += float(loss)
            total_correct += float(correct)
            count += int(labels.shape[0])
        return total_correct / count, total_loss / count

    return run


class PeriodicEval:
    """Test accuracy of the training weights, during training, on the chief.

    One local model and one traced function are reused, so each evaluation
    costs a weight copy and a pass over the test split, no retracing.
    """

    def __init__(self, model_name: str, dataset: tf.data.Dataset):
        self.local = build_model(model_name)
        self.dataset = dataset.cache()
        self.run = _evaluator(self.local)

    def __call__(self, model: keras.Model) -> tuple[float, float]:
        self.local.set_weights([np.asarray(w) for w in model.get_weights()])
        return self.run(self.dataset)


def weights_sha256(model: keras.Model) -> str:
    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(np.ascontiguousarray(w).tobytes())
    return digest.hexdigest()


def write_json_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


SUMMARY_KEYS = (
    "strategy", "model", "num_workers", "num_ps", "replicas_in_sync", "global_steps",
    "test_accuracy", "test_loss", "examples_per_sec", "wall_seconds", "weights_sha256",
)


def summary_line(results: dict) -> str:
    parts = []
    for key in SUMMARY_KEYS:
        value = results.get(key)
        if isinstance(value, float):
            value = f"{value:.4f}" if key.startswith("test_") else f"{value:.1f}"
        parts.append(f"{key}={value}")
    return "SUMMARY " + " ".join(parts)


class Throughput:
    """Steps/s and examples/s since the last report, and overall."""

    def __init__(self, examples_per_step: int, start_step: int):
        self.examples_per_step = examples_per_step
        self.start_time = self.last_time = time.perf_counter()
        self.start_step = self.last_step = start_step

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` spent on something else (evaluation) out of the rates."""
        self.start_time += seconds
        self.last_time += seconds

    def tick(self, step: int) -> tuple[float, float]:
        now = time.perf_counter()
        rate = (step - self.last_step) / max(now - self.last_time, 1e-9)
        self.last_time, self.last_step = now, step
        return rate, rate * self.examples_per_step

    def overall(self, step: int) -> tuple[float, float]:
        elapsed = max(time.perf_counter() - self.start_time, 1e-9)
        return elapsed, (step - self.start_step) * self.examples_per_step / elapsed
