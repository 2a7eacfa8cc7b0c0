"""The training step shared by every strategy, and the call that runs K of them.

Keras 3 ``model.fit`` cannot drive the multi-worker strategies
(keras-team/keras#20585, #18624), so this is a custom loop. Keras layers and
optimizers are used as they are.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from training.state import TrainState


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


def after_updates(variables) -> list[tf.Tensor]:
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
                  steps_by_worker: tf.Variable | None = None):
    """``train_fn(iterator, num_steps)``: ``num_steps`` steps in one call.

    Packing several steps into one ``tf.function`` call (``--steps-per-execution``)
    saves a host round trip per step, which is what dominates small models.
    Returns the mean loss and accuracy (this worker's replicas) and, per step,
    the staleness: updates other workers applied between this step reading
    ``global_step`` and applying its own update (always 0 when synchronous).
    ``steps_by_worker`` (ps only): one count per worker, added to by the worker
    that ran the call once its steps are done.
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
            # staleness figure would read ~0 whatever the overlap
            # (docs/performance.md).
            with tf.control_dependencies(after_updates(variables)):
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
        if steps_by_worker is not None:
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            ran = tf.one_hot(worker, steps_by_worker.shape[0], dtype=tf.int64) * tf.cast(
                num_steps, tf.int64)
            with tf.control_dependencies([out["loss"], out["staleness"]]):
                steps_by_worker.assign_add(ran, read_value=False)
        return out

    return train_fn
