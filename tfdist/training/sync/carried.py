"""All-reduce carried over the step boundary (``multiworker``, ``--carry-all-reduce``).

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
step, with the same sums and the same update. A call leaves its last step's
update pending and the next call starts with it; the controller drains it
before anything reads the weights (``CarriedCalls``).

The first layers: the longest run of variables, in the model's order, with at
most half the gradient bytes (for a CNN its convolutions, which hold few
bytes and most of the compute). A model where that run is empty or everything,
or whose update cannot be split this way (a loss-scale optimizer, row-sparse
gradients, a step compiled with XLA, the model's own ``train_step``) is not
carried: ``on`` refuses it in one line (``split_for`` says why), ``auto`` keeps
the plain step.

On a slow link it hides the first layers' forward pass; where the link is fast
the step is slower (its all-reduce's CPU work runs beside the convolutions), so
``multiworker`` times both steps early in the run and keeps the faster
(``--carry-all-reduce auto``, ``sync.carry_trial``); ``on`` and ``off`` force
one (docs/performance.md has the figures).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import keras
import tensorflow as tf

from tfdist.training.loop.state import TrainState
from tfdist.training.loop.step import (TrainMetrics, accumulate, add_step, after_updates,
                                       call_outputs, make_one_batch,
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
    """The split for this model and optimizer, or why it cannot be cut."""
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


class CarriedCalls:
    """The calls of ``n`` steps with each step's all-reduce cut by ``split``.

    ``train_fn(iterator, num_steps)`` returns what ``loop.step.make_train_fn``'s
    does. A call leaves its last step's update pending (kept on each replica), so
    the next call starts with it, its all-reduce under that call's first layers,
    as between the steps of one call; ``flush()`` applies it. The controller
    drains (``flush``) before anything reads the weights, on every worker at the
    same steps: the flush is a collective.
    """

    def __init__(self, strategy, state: TrainState, metrics: TrainMetrics, split: Split,
                 gradient_dtype: str = "float32", accumulation: int = 1):
        self.strategy, self.state, self.split = strategy, state, split
        self.metrics, self.accumulation = metrics, accumulation
        variables = state.model.trainable_variables
        self.shapes = [v.shape for v in variables]
        self.late = list(range(len(variables) - 1, split.first - 1, -1))  # backward order
        self.one_batch = make_one_batch(state, metrics)
        self.gradient_dtype = gradient_dtype
        wire = tf.as_dtype(gradient_dtype) if gradient_dtype != "float32" else variables[0].dtype
        done = split.early + sum(self.shapes[i].num_elements() for i in range(split.first))
        rest = sum(self.shapes[i].num_elements() for i in self.late) - split.early
        self.wire = wire
        # Each replica's own copy (read and written in replica context only),
        # outside the model: never checkpointed, never all-reduced. Held in float32
        # when the wire is bfloat16 (exactly): MultiWorkerMirroredStrategy
        # broadcasts a new variable's initial value, and its broadcast takes no
        # bfloat16.
        store = tf.float32 if wire == tf.bfloat16 else wire
        with strategy.scope():
            self.kept = [tf.Variable(tf.zeros([n], store), trainable=False,
                                     synchronization=tf.VariableSynchronization.ON_READ,
                                     aggregation=tf.VariableAggregation.NONE)
                         for n in (done, rest)]
        # Variables the loss does not reach (known once traced): zeros cross the
        # network in their place, and the update leaves them out, as Keras's does.
        self.absent: set[int] = set()
        self.pending = False
        self._calls = {resume: self._make_call(resume) for resume in (False, True)}
        self._flush = tf.function(self._flush_pending)

    def train_fn(self, iterator, num_steps):
        out = self._calls[self.pending](iterator, num_steps)
        self.pending = True
        return out

    def trace(self, iterator) -> None:
        """Trace both calls and trace and instantiate the flush now, before the
        first step: the flush would otherwise cost its first use most of a second
        inside the timed steady state (``--carry-all-reduce auto`` switches
        between steps there); run with a count of 0 it applies nothing. The calls
        cannot run without a step: each is instantiated by its first use."""
        # The call that starts afresh first: its trace finds ``absent``.
        for call in (self._calls[False], self._calls[True]):
            call.get_concrete_function(iterator, tf.TensorSpec([], tf.int32))
        self._flush(tf.constant(0))

    def flush(self) -> None:
        """Apply the pending update, if any."""
        if self.pending:
            self._flush(tf.constant(1))
            self.pending = False

    # --- one replica's halves of a step ---------------------------------------------

    def _compute(self, *batches):
        """Forward, backward, and the all-reduce of parts 1 and 2; part 3 returned as is."""
        if self.accumulation == 1:
            grads, loss, values = self.one_batch(*batches)
        else:
            grads, loss, values = accumulate(self.one_batch, batches)
        variables = self.state.model.trainable_variables
        self.absent.update(i for i, g in enumerate(grads) if g is None)
        grads = to_wire([g if g is not None else tf.zeros(s, v.dtype)
                         for g, s, v in zip(grads, self.shapes, variables)], self.gradient_dtype)
        ctx, total = tf.distribute.get_replica_context(), tf.distribute.ReduceOp.SUM
        flat = tf.concat([tf.reshape(grads[i], [-1]) for i in self.late], 0)
        early = ctx.all_reduce(total, flat[:self.split.early])
        first = ctx.all_reduce(total, grads[:self.split.first])
        done = tf.concat([early] + [tf.reshape(g, [-1]) for g in first], 0)
        return done, flat[self.split.early:], loss, values

    def _apply(self, done, rest):
        """Part 3's all-reduce, then the step's whole update."""
        ctx, total = tf.distribute.get_replica_context(), tf.distribute.ReduceOp.SUM
        # A loop-carried tensor has no device, and an all-reduce needs one: the
        # identity takes the replica's.
        rest = ctx.all_reduce(total, tf.identity(rest))
        first_sizes = [self.shapes[i].num_elements() for i in range(self.split.first)]
        early, *first = tf.split(done, [self.split.early] + first_sizes)
        late = tf.split(tf.concat([early, rest], 0),
                        [self.shapes[i].num_elements() for i in self.late])
        grads = [tf.reshape(g, self.shapes[i]) for i, g in enumerate(first)]
        grads += [None] * len(self.late)
        for i, piece in zip(self.late, late):
            grads[i] = tf.reshape(piece, self.shapes[i])
        grads = [None if i in self.absent else g for i, g in enumerate(grads)]
        self.state.optimizer.apply_gradients(zip(grads, self.state.model.trainable_variables))

    def _keep(self, done, rest):
        for var, value in zip(self.kept, (done, rest)):
            var.assign(tf.cast(value, var.dtype))

    def _read_kept(self):
        return [tf.identity(tf.cast(var.read_value(), self.wire)) for var in self.kept]

    # --- the traced calls -----------------------------------------------------------

    def _sums(self, size):
        return (tf.constant(0.0), tf.zeros([len(self.metrics.names)], tf.float32),
                tf.TensorArray(tf.int64, size=size, element_shape=[]))

    def _start(self, iterator, sums):
        """Step i: its forward and backward pass, parts 1 and 2 sent; part 3 pending."""
        args = (next(iterator) if self.accumulation == 1
                else tuple(next(iterator) for _ in range(self.accumulation)))
        # Not a control input of the step, as in the plain call: the count is
        # written after every update, and the first layers must not wait for the
        # last layers' update to compute.
        read_at = self.state.global_step.read_value()
        done, rest, loss, values = self.strategy.run(self._compute, args=args)
        loss_sum, metric_sum, staleness = sums
        loss_sum, metric_sum = add_step(self.strategy, loss_sum, metric_sum, loss, values)
        return (read_at, done, rest), (loss_sum, metric_sum, staleness)

    def _finish(self, pending, i, sums):
        """A pending step's part 3 and update; its staleness written at ``i``."""
        read_at, done, rest = pending
        optimizer, variables = self.state.optimizer, self.state.model.trainable_variables
        # Set around the replicas' calls, not in them: a MirroredStrategy runs
        # each replica's in a thread of its own.
        with schedule_in_batches(optimizer, self.accumulation), summed_already(optimizer):
            self.strategy.run(self._apply, args=(done, rest))
        with tf.control_dependencies(after_updates(variables)):
            applied_at = self.state.global_step.assign_add(1)
        loss_sum, metric_sum, staleness = sums
        return loss_sum, metric_sum, staleness.write(i, applied_at - 1 - read_at)

    # Between the steps of one call too, the pending step waits in ``kept``, not
    # in the loop's variables: it would put the pooling gradient on a cycle
    # (``_make_call`` says what that costs).
    def _start_kept(self, iterator, sums):
        (read_at, done, rest), sums = self._start(iterator, sums)
        self.strategy.run(self._keep, args=(done, rest))
        return read_at, sums

    def _pending_at(self, read_at):
        done, rest = self.strategy.run(self._read_kept)
        return read_at, done, rest

    def _flush_pending(self, count):
        # ``count`` 1 applies the pending step, 0 nothing (``trace``). Its
        # staleness is not counted: the step it was read at is not kept.
        for _ in tf.range(count):
            self._finish(self._pending_at(self.state.global_step.read_value()), 0, self._sums(1))

    def _make_call(self, resume: bool):
        @tf.function
        def call(iterator, num_steps):
            # Staleness of the steps this call applies: the pending one first
            # (``resume``), then all of its own but the last, which it leaves pending.
            read_at = self.state.global_step.read_value()
            if resume:
                sums = self._finish(self._pending_at(read_at), 0, self._sums(num_steps))
            else:
                sums = self._sums(num_steps - 1)
            # The call's first step outside the loop, the only one at the default
            # --steps-per-execution 1. In a loop the pooling gradient lies on a cycle
            # (through the loop's back edge: the step's writes come before the next
            # step's reads), and oneDNN's graph rewrite, whose walk then meets it
            # before its forward op in some processes (the walk's order follows
            # pointer values), leaves it to TensorFlow's plain kernel, ten times
            # slower. Straight-line, it always comes after its forward op.
            read_at, sums = self._start_kept(iterator, sums)
            for i in tf.range(num_steps - 1):
                # The update of step i is created before step i + 1: its all-reduce
                # goes first on the link, and its writes come before the reads of
                # the same variables (each variable's own program order).
                sums = self._finish(self._pending_at(read_at), i + int(resume), sums)
                read_at, sums = self._start_kept(iterator, sums)
            loss_sum, metric_sum, staleness = sums
            return call_outputs(num_steps, loss_sum, metric_sum, staleness)

        return call
