"""All-reduce carried over the step boundary (``multiworker``, ``mirrored``).

On a slow link a step's all-reduce takes longer than its compute, and the
buckets that start during the backward pass (``--all-reduce-bucket``) hide only
the backward pass: the next forward pass waits for the last bucket, so the
link idles while it runs. It need not wait for all of it. The forward pass
needs the first layers' weights first, and the backward pass makes their
gradients last; the last layers' gradients (made first) are needed last. So a
step's gradients go in three parts:

1. the first ``bucket_bytes`` of the last layers' gradients, as soon as they exist;
2. the first layers' gradients, as soon as the backward pass makes them;
3. the rest of the last layers', at the start of the next step, under its
   first layers' forward pass.

The update is applied whole, at the start of the next step, once per step.
TensorFlow orders the reads and writes of one variable in program order and
leaves reads of other variables free, so the first layers compute on their
updated weights while part 3 crosses the network, and the last layers wait
for theirs: every forward pass sees every update before it, as in the plain
step, with the same sums and the same update. The call's last step finishes
inside the call, so checkpoints, evaluations and other workers never see a
step half applied.

The first layers: the longest run of variables, in the model's order, with at
most half the gradient bytes (for a CNN its convolutions, which hold few
bytes and most of the compute). A model where that run is empty or everything,
or whose update cannot be split this way (a loss-scale optimizer, row-sparse
gradients, a step compiled with XLA, the model's own ``train_step``) trains
with the plain step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import keras
import tensorflow as tf

from tfdist.training.loop.state import TrainState
from tfdist.training.loop.step import (TrainMetrics, accumulate, after_updates, call_outputs,
                                       local_replicas, local_sum, make_one_batch,
                                       schedule_in_batches, summed_already, to_wire)
from tfdist.training.workload import contract


@dataclass(frozen=True)
class Split:
    """Where a step's gradients are cut: variables ``[0, first)`` are the first
    layers; ``early`` elements of the last layers' gradients (in the order the
    backward pass makes them) are all-reduced at once, the rest carried over."""

    first: int
    early: int


def plan_split(elements: Sequence[int], bucket_elements: int) -> Split | None:
    """The split of variables of ``elements`` each (the model's order), or None
    where nothing would be carried (pure)."""
    total = sum(elements)
    first, head = 0, 0
    while first < len(elements) and 2 * (head + elements[first]) <= total:
        head += elements[first]
        first += 1
    late = total - head
    early = min(max(1, bucket_elements), late)
    if first == 0 or first == len(elements) or early >= late:
        return None
    return Split(first, early)


def split_for(state: TrainState, strategy, metrics: TrainMetrics, gradient_dtype: str,
              bucket_bytes: int) -> Split | str:
    """The split for this model and optimizer, or why the plain step trains it."""
    model, optimizer = state.model, state.optimizer
    variables = model.trainable_variables
    layers = model._flatten_layers(include_self=False)  # pylint: disable=protected-access
    why = (
        "one replica in sync has nothing to all-reduce" if strategy.num_replicas_in_sync < 2
        else "the model's own train_step makes its update itself" if metrics.own_step
        else "the model has no trainable variables" if not variables
        else "a step compiled with XLA (jit_compile) cannot be cut" if getattr(
            model, "jit_compile", False)
        else "a LossScaleOptimizer checks every gradient before any update"
        if len(contract.with_inner(optimizer)) > 1
        else "its variables have more than one dtype" if len({v.dtype for v in variables}) > 1
        else "an Embedding's gradients are row-sparse"
        if any(isinstance(layer, keras.layers.Embedding) for layer in layers)
        else "")
    if why:
        return why
    size = tf.as_dtype(gradient_dtype if gradient_dtype != "float32" else variables[0].dtype).size
    split = plan_split([int(v.shape.num_elements()) for v in variables], bucket_bytes // size)
    return split or ("its first layers hold more than half the gradient bytes, or its last "
                     "layers fit in one bucket (--all-reduce-bucket)")


def make_carried_train_fn(strategy, state: TrainState, metrics: TrainMetrics, split: Split,
                          gradient_dtype: str = "float32", accumulation: int = 1):
    """``train_fn(iterator, num_steps)`` as ``loop.step.make_train_fn``'s (the same
    outputs, staleness 0 by measurement), with each step's all-reduce cut by ``split``."""
    model, optimizer, global_step = state.model, state.optimizer, state.global_step
    variables = model.trainable_variables
    shapes = [v.shape for v in variables]
    late = list(range(len(variables) - 1, split.first - 1, -1))  # backward order
    one_batch = make_one_batch(state, metrics)
    replicas = local_replicas(strategy)
    local_fraction = replicas / strategy.num_replicas_in_sync
    total = tf.distribute.ReduceOp.SUM

    # Variables the loss does not reach (known once traced): zeros cross the
    # network in their place, and the update leaves them out, as Keras's does.
    absent: set[int] = set()

    def compute(*batches):
        if accumulation == 1:
            grads, loss, values = one_batch(*batches)
        else:
            grads, loss, values = accumulate(one_batch, batches)
        absent.update(i for i, g in enumerate(grads) if g is None)
        grads = to_wire([g if g is not None else tf.zeros(s, v.dtype)
                         for g, s, v in zip(grads, shapes, variables)], gradient_dtype)
        ctx = tf.distribute.get_replica_context()
        flat = tf.concat([tf.reshape(grads[i], [-1]) for i in late], 0)
        early = ctx.all_reduce(total, flat[:split.early])
        first = ctx.all_reduce(total, grads[:split.first])
        return early, flat[split.early:], first, loss, values

    def apply(early, rest, first):
        ctx = tf.distribute.get_replica_context()
        # A loop-carried tensor has no device, and an all-reduce needs one: the
        # identity takes the replica's.
        flat = tf.concat([early, ctx.all_reduce(total, tf.identity(rest))], 0)
        pieces = tf.split(flat, [shapes[i].num_elements() for i in late])
        grads = list(first) + [None] * len(late)
        for i, piece in zip(late, pieces):
            grads[i] = tf.reshape(piece, shapes[i])
        grads = [None if i in absent else g for i, g in enumerate(grads)]
        optimizer.apply_gradients(zip(grads, variables))

    def next_args(iterator):
        if accumulation == 1:
            return next(iterator)
        return tuple(next(iterator) for _ in range(accumulation))

    def start(iterator):
        # Not a control input of the step, as in the plain call: the count is
        # written after every update, and the first layers must not wait for the
        # last layers' update to compute.
        read_at = global_step.read_value()
        return (read_at,) + tuple(strategy.run(compute, args=next_args(iterator)))

    def finish(pending, i, sums):
        read_at, early, rest, first, loss, values = pending
        # Set around the replicas' calls, not in them: a MirroredStrategy runs
        # each replica's in a thread of its own.
        with schedule_in_batches(optimizer, accumulation), summed_already(optimizer):
            strategy.run(apply, args=(early, rest, first))
        with tf.control_dependencies(after_updates(variables)):
            applied_at = global_step.assign_add(1)
        loss_sum, metric_sum, staleness = sums
        return (loss_sum + tf.cast(local_sum(strategy, loss), tf.float32) / local_fraction,
                metric_sum + local_sum(strategy, values) / replicas,
                staleness.write(i, applied_at - 1 - read_at))

    @tf.function
    def train_fn(iterator, num_steps):
        sums = (tf.constant(0.0), tf.zeros([len(metrics.names)], tf.float32),
                tf.TensorArray(tf.int64, size=num_steps))
        pending = start(iterator)
        for i in tf.range(num_steps - 1):
            # The update of step i is created before step i + 1: its all-reduce
            # goes first on the link, and its writes come before the reads of
            # the same variables (each variable's own program order).
            sums = finish(pending, tf.cast(i, tf.int32), sums)
            pending = start(iterator)
        loss_sum, metric_sum, staleness = finish(pending, num_steps - 1, sums)
        return call_outputs(num_steps, loss_sum, metric_sum, staleness)

    return train_fn
