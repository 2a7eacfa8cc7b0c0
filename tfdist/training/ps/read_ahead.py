"""``ps`` read-ahead: a worker reads its next weights while it computes this step.

Without it a worker's step is serial on the network: read every weight from
the ps, compute, push the gradients, and only then read again; the ps host's
outgoing link idles while gradients come in, and its incoming one while
weights go out. With read-ahead each step starts reading the weights for
the *next* step as it begins: that read crosses the network while the
forward and backward pass run and while the gradients are pushed (the ps
applies them once the read is done), and the step computes on the weights
read during the previous one, handed to the model through a
``keras.StatelessScope``. The last step of a call reads ahead too, and the
worker keeps what it read for its next call (``WeightCache``), so a call of
one step reads ahead as well as a call of many.

The price is staleness: the weights a step computes on were read before this
worker's own previous update was applied, so every step is at least 1 stale
on top of what other workers add (a worker's first call starts from the ps).
The staleness figures count it: a step's ``read_at`` is the global step read
just before *its* weights were read.

Only trainable weights are read ahead. Non-trainable state (batch-norm
statistics, a dropout's seed) is read and written as the plain step does:
its updates, caught by the scope, are assigned after the step.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist.training.loop.state import TrainState
from tfdist.training.loop.step import (TrainMetrics, accumulate, add_step, after_updates,
                                       call_outputs, forward, make_update)


def sparse_layers(model: keras.Model) -> list[str]:
    """Embedding layers: read ahead, their whole tables travel every step, where the
    plain step reads only the rows a batch touches."""
    return [layer.name for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
            if isinstance(layer, keras.layers.Embedding)]


def read_weights(variables) -> list[tf.Tensor]:
    """Every variable's value, read where it lives (its ps) and handed to this
    worker at once, so the transfer runs while the step computes, not when the
    next step first needs it."""
    values = []
    for v in variables:
        var = getattr(v, "_value", v)
        with tf.device(var.device):
            read = tf.raw_ops.ReadVariableOp(resource=var.handle, dtype=var.dtype)
        with tf.device("/device:CPU:0"):  # the worker running the call
            values.append(tf.identity(read))
    return values


def batch_on_weights(model: keras.Model, metrics: TrainMetrics, scale_loss=None, jit=False):
    """``one_batch(weights, features, labels, sample_weight=None) -> (gradients, loss,
    metric values)``: the plain step's forward and backward pass on given values of the
    model's trainable weights (a ``keras.StatelessScope`` hands them to the model), the
    gradients taken with respect to them. ``scale_loss``: a LossScaleOptimizer's.
    ``jit``: that pass compiled with XLA (``xla_batch_on_weights``)."""
    if jit:
        return xla_batch_on_weights(model, metrics, scale_loss)
    trainable = model.trainable_variables
    trainable_ids = {id(v) for v in trainable}
    others = [v for v in model.variables if id(v) not in trainable_ids]

    def one_batch(weights, features, labels, sample_weight=None):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            with keras.StatelessScope(list(zip(trainable, weights)),
                                      collect_losses=True) as scope:
                y_pred, loss = forward(model, features, labels, sample_weight)
                scaled = scale_loss(loss) if scale_loss else loss
        grads = tape.gradient(scaled, weights)
        # Batch-norm statistics, seeds: what the plain step would have assigned.
        for v in others:
            new = scope.get_current_value(v)
            if new is not None:
                v.assign(new)
        return grads, loss, metrics.batch_values(labels, y_pred, sample_weight)

    return one_batch


def xla_batch_on_weights(model: keras.Model, metrics: TrainMetrics, scale_loss=None):
    """``batch_on_weights``'s pass as one XLA-compiled function of values only.

    XLA cannot read a variable that lives on a ps task ("Trying to access resource
    ... located in device /job:ps"), so everything the pass reads is handed in as
    a value: the trainable weights given, every other variable of the model
    (batch-norm statistics, seeds, metric state) and the loss scale read here,
    outside XLA. What the pass assigns (found when it is traced) comes back as
    values and is assigned here, after it: the ps reads and writes stay outside.
    """
    trainable = model.trainable_variables
    trainable_ids = {id(v) for v in trainable}
    others = [v for v in model.variables if id(v) not in trainable_ids]
    assigned: list[int] = []  # positions in ``others`` the traced pass assigns

    @tf.function(jit_compile=True, reduce_retracing=True)
    def compiled(weights, other_values, scale, features, labels, sample_weight=None):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            with keras.StatelessScope(list(zip(trainable, weights)) + list(
                    zip(others, other_values)), collect_losses=True) as scope:
                given = dict(scope.state_mapping)
                y_pred, loss = forward(model, features, labels, sample_weight)
                scaled = loss * tf.cast(scale, loss.dtype)
        grads = tape.gradient(scaled, weights)
        now = [scope.state_mapping[id(v)] for v in others]
        assigned[:] = [i for i, v in enumerate(others) if now[i] is not given[id(v)]]
        return (grads, loss, metrics.batch_values(labels, y_pred, sample_weight),
                [now[i] for i in assigned])

    def one_batch(weights, features, labels, sample_weight=None):
        # Keras's loss scaling multiplies the loss (LossScaleOptimizer: by its
        # dynamic scale, a variable on the ps): the factor read here.
        scale = scale_loss(tf.constant(1.0)) if scale_loss else tf.constant(1.0)
        grads, loss, values, new = compiled(list(weights), read_weights(others), scale,
                                            features, labels, sample_weight)
        for i, value in zip(assigned, new):
            others[i].assign(value)
        return grads, loss, values

    return one_batch


def read_once(one_batch, variables, accumulation: int):
    """``(gradients, loss, values) = f(*batches)``: the ``accumulation`` batches of one
    step computed on one read of ``variables``. Each batch's forward pass would read
    every weight from the ps again: N reads a step where one is needed."""

    def run(*batches):
        weights = read_weights(variables)
        return accumulate(lambda *b: one_batch(weights, *b), batches)

    return run


def make_read_ahead_step_fn(state: TrainState, metrics: TrainMetrics,
                            gradient_dtype: str = "float32", accumulation: int = 1,
                            jit: bool = False):
    """One replica's step on given weights: ``step_fn(weights, *batches)``.

    The same update as ``loop.step.make_step_fn`` (the library's own step; a
    model's own ``train_step`` reads its variables itself and is not offered
    read-ahead), with the gradient taken with respect to the weights handed in
    and applied to the variables on the ps. ``jit``: the forward and backward
    pass compiled with XLA (``xla_batch_on_weights``); the update stays outside.
    """
    model, optimizer = state.model, state.optimizer
    trainable = model.trainable_variables
    one_batch = batch_on_weights(model, metrics, optimizer.scale_loss, jit)

    def step_fn(weights, *batches):
        return make_update(lambda *b: one_batch(weights, *b), optimizer, trainable,
                           gradient_dtype, accumulation)(*batches)

    return step_fn


def make_read_once_step_fn(state: TrainState, metrics: TrainMetrics,
                           gradient_dtype: str = "float32", accumulation: int = 2,
                           jit: bool = False):
    """``step_fn(*batches)``: the plain step of N accumulated batches (``make_step_fn``'s
    update), its weights read from the ps once, as the step starts, instead of once per
    batch (``read_once``): one read and one push per N batches. With ``jit`` also the
    step of one batch: XLA computes on the values read."""
    step = make_read_ahead_step_fn(state, metrics, gradient_dtype, accumulation, jit)
    variables = state.model.trainable_variables

    def step_fn(*batches):
        return step(read_weights(variables), *batches)

    return step_fn


class WeightCache:
    """The weights a worker read ahead at the end of its last call, kept on that worker
    (``per_worker_variable``: one copy per worker, none on the ps) with the global
    step read just before them, so the next call starts computing at once. A read
    step of -1 means empty (a worker's first call, or a restarted worker's, whose
    copies are made anew): that call reads the weights from the ps first."""

    def __init__(self, strategy, variables):
        with strategy.scope():
            self.weights = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                        per_worker_variable=True) for v in variables]
            self.read_at = tf.Variable(tf.constant(-1, tf.int64), trainable=False,
                                       per_worker_variable=True)


def make_read_ahead_train_fn(strategy, step_fn, state: TrainState, num_metrics: int,
                             steps_by_worker: tf.Variable, batches_per_step: int = 1):
    """``train_fn(iterator, num_steps)`` as ``loop.step.make_train_fn``'s (the same
    outputs), each step computing on weights read during the step before it, the
    last step's read kept for the worker's next call (``WeightCache``)."""
    global_step, variables = state.global_step, state.model.trainable_variables
    cache = WeightCache(strategy, variables)

    def read_from_ps():
        at = global_step.read_value()
        with tf.control_dependencies([at]):
            return [at] + read_weights(variables)

    def first_weights():
        # A worker's cached copies are not ordered by automatic control
        # dependencies (TensorFlow's PerWorkerVariable): every use is explicit.
        # Read outside the cond: a branch cannot see their call-time handles.
        at = cache.read_at.read_value()
        with tf.control_dependencies([at]):
            cached = [c.read_value() for c in cache.weights]
        out = tf.cond(at >= 0, lambda: [at] + cached, read_from_ps)
        return out[1:], out[0]

    @tf.function
    def train_fn(iterator, num_steps):
        loss_sum = tf.constant(0.0)
        metric_sum = tf.zeros([num_metrics], tf.float32)
        staleness = tf.TensorArray(tf.int64, size=num_steps)
        weights, read_at = first_weights()
        for i in tf.range(num_steps):
            # Created before the update below, so automatic control dependencies
            # order these reads before it: they cross the network during the
            # step's compute and its push.
            ahead = read_from_ps()
            next_weights, next_read_at = ahead[1:], ahead[0]
            if batches_per_step == 1:
                batch = tuple(next(iterator))
            else:
                batch = tuple(next(iterator) for _ in range(batches_per_step))
            loss, values = strategy.run(step_fn, args=(weights,) + batch)
            with tf.control_dependencies(after_updates(variables)):
                applied_at = global_step.assign_add(1)
            loss_sum, metric_sum = add_step(strategy, loss_sum, metric_sum, loss, values)
            staleness = staleness.write(i, applied_at - 1 - read_at)
            weights, read_at = next_weights, next_read_at
        stored = [c.assign(w, read_value=False) for c, w in zip(cache.weights, weights)]
        with tf.control_dependencies(stored):
            stored = cache.read_at.assign(read_at, read_value=False)
        return call_outputs(num_steps, loss_sum, metric_sum, staleness, steps_by_worker,
                            after=[stored])

    return train_fn
