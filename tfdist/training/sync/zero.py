"""multiworker, ``--shard-state optimizer|gradients``: the training state split over the workers.

ZeRO's stages 1 and 2 (DeepSpeed, arXiv 1910.02054) on Keras 3 and TensorFlow,
built from what runs here on CPU (``/work/shared/design/verified-facts.md``):

- each worker's gradients are laid end to end (``shard_layout``) and
  reduce-scattered: an all-to-all of each bucket's ``[N, chunk]`` rows and a
  local sum (TensorFlow's reduce-scatter has no CPU kernel); worker ``r`` gets
  the summed gradient of its 1/N of the weights;
- a Keras optimizer of the task's class and settings (the *shard optimizer*),
  made outside the strategy's scope on one plain flat variable, this worker's
  1/N of the weights, updates it: its slots are 1/N of the whole optimizer's;
- the updated shards are all-gathered, bucket by bucket, into the model's own
  (mirrored) variables, so every worker's full weights are the same bytes.

``optimizer`` holds every gradient until the backward pass ends (one barrier, as
the plain all-reduce does), ``gradients`` lets each bucket's reduce-scatter start
as soon as its gradients exist, so a bucket's gradients are released then.

The update is the plain step's: Keras clips each replica's own gradient before
the all-reduce (``clipnorm``, ``clipvalue``, ``global_clipnorm``), so the
sharded step clips the same local gradient, before its reduce-scatter, with the
model's optimizer's own ``_clip_gradients``; weight decay is elementwise and is
the shard optimizer's; its iterations are copied to the model optimizer's each
step (a schedule, Adam's bias correction and the checkpoint read that one).

Checkpoints hold the whole, unsharded state in the model optimizer's own
layout, so a sharded run resumes plain, at another worker count, and a plain
run resumes sharded: the model's optimizer is built with ``SlotView``s in place
of its slots (no memory of their own). A save first all-gathers the shard
optimizer's slots (``gathered``), and each view hands its variable's slice to
the checkpoint; a restore hands each view its variable's whole slot, and the
view writes the part this worker owns into the shard optimizer's slot. The
chosen cost: a save holds the gathered slots for its duration.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import collective_ops
from tensorflow.python.trackable import base as trackable

from tfdist.protocol import ConfigError
from tfdist.training.loop import step as steplib
from tfdist.training.sync.shard_layout import ShardLayout

# The hand-made collectives' own group, apart from the strategy's (its keys count from 1).
GROUP_KEY = 900
# Buckets of the sharded step: fewer, larger collectives than the all-reduce's
# (each all-to-all and all-gather has a fixed cost); --all-reduce-bucket sets them.
BUCKET_BYTES = 4 << 20
_VALUE = trackable.VARIABLE_VALUE_KEY


class Collectives:
    """This process's collectives over every worker, in their own group."""

    def __init__(self, workers: int, device: str):
        self.workers, self.device = workers, device
        self._instance = 0

    def _key(self) -> int:
        # Every worker makes the same collectives in the same order (the same program),
        # so the keys agree; a traced one keeps its key for every run of its function.
        self._instance += 1
        return self._instance

    def all_to_all(self, rows):
        return collective_ops.all_to_all_v2(rows, self.workers, GROUP_KEY, self._key())

    def all_gather(self, chunk):
        return collective_ops.all_gather_v2(chunk, self.workers, GROUP_KEY, self._key())

    def rank(self, member: int) -> int:
        """This worker's place in the group (its chunk), from every worker's ``member``
        index: the group orders its devices itself."""
        with tf.device(self.device):
            order = [int(x) for x in self.all_gather(tf.constant([member], tf.int64)).numpy()]
        return order.index(member)


class SlotView(trackable.Trackable):
    """One slot of one model variable where the model's optimizer keeps it: its values
    are the shard optimizers' (each worker's part), read and written by checkpoints."""

    def __init__(self, owner: "ShardedState", kind: str, var: int, reference):
        self._owner, self.kind, self.var = owner, kind, var
        self.shape, self.dtype = tuple(reference.shape), reference.dtype
        self.name = f"{reference.path.replace('/', '_')}_{kind}"
        self.path = self.name

    def _serialize_to_tensors(self):
        return {_VALUE: self._owner.full_slot(self.kind, self.var, self.shape)}

    def _restore_from_tensors(self, restored_tensors):
        return self._owner.restore_slot(self.kind, self.var, restored_tensors[_VALUE])


def refusal(optimizer, variables) -> str | None:
    """Why this optimizer cannot be sharded (one line's reason), else None."""
    if getattr(optimizer, "inner_optimizer", None) is not None:
        return "it is a LossScaleOptimizer, whose scale is not sharded"
    if getattr(optimizer, "use_ema", False):
        return "use_ema keeps a moving average of the whole model"
    if getattr(optimizer, "_exclude_from_weight_decay", None) or getattr(
            optimizer, "_exclude_from_weight_decay_pattern", None):
        return "exclude_from_weight_decay names variables, and a shard mixes them"
    for v in variables:
        if getattr(v, "overwrite_with_gradient", False):
            return f"variable {v.path} is overwritten with its gradient"
        if tf.as_dtype(v.dtype) != tf.float32:
            return f"variable {v.path} is {v.dtype}, and a shard is one float32 vector"
    return None


class ShardedState:
    """This worker's shard: its flat weights, the shard optimizer and its slots, the
    layout, the collectives; the sharded step (``make_train_fn``) and what checkpoints
    ask of it (``gathered``, ``full_slot``, ``restore_slot``)."""

    def __init__(self, level: str, strategy, optimizer, variables, member: int,
                 bucket_bytes: int | None):
        why = refusal(optimizer, variables)
        if why:
            raise ConfigError(f"--shard-state {level} cannot shard the optimizer "
                              f"{type(optimizer).__name__}: {why}; drop --shard-state")
        self.level, self.strategy, self.optimizer = level, strategy, optimizer
        self.variables = list(variables)
        self.device = strategy.extended.worker_devices[0]
        workers = strategy.num_replicas_in_sync
        self.coll = Collectives(workers, self.device)
        self.rank = self.coll.rank(member)
        self.layout = self._plan(workers, (bucket_bytes or BUCKET_BYTES) // 4)
        self.pieces = self.layout.pieces(self.rank)
        self._cache: dict[tuple[str, int], tf.Tensor] = {}  # (slot, bucket): gathered
        with tf.device(self.device):
            self.flat = keras.Variable(np.zeros([self.layout.shard_size], np.float32),
                                       trainable=False, name="weights_shard")
            self.shard_optimizer, self.slots = _shard_optimizer(optimizer, self.flat, level)
        self._build_views(optimizer)

    def _plan(self, workers: int, bucket_elements: int) -> ShardLayout:
        """The variables laid end to end in buckets (``shard_layout``)."""
        sizes = [int(np.prod(v.shape)) for v in self.variables]
        rows = [int(np.prod(v.shape[1:])) if len(v.shape) > 1 else 1 for v in self.variables]
        return ShardLayout.plan(sizes, workers, bucket_elements, rows)

    def _build_views(self, optimizer) -> None:
        """The model's optimizer built with a ``SlotView`` for each slot it would make."""
        index = {id(v): i for i, v in enumerate(self.variables)}
        made = []

        def view_of(reference, name=None, initializer="zeros"):
            if name not in self.slots:
                raise ConfigError(
                    f"--shard-state {self.level}: the optimizer {type(optimizer).__name__} "
                    f"makes a slot {name!r} the shard's optimizer does not; drop --shard-state")
            view = SlotView(self, name, index[id(reference)], reference)
            optimizer._track_variable(view)
            made.append(view)
            return view

        optimizer.add_variable_from_reference = view_of  # this instance, while it builds
        try:
            optimizer.build(self.variables)
        finally:
            del optimizer.add_variable_from_reference
        own = [v for v in optimizer.variables if not isinstance(v, SlotView)]
        if len(own) > 2:  # iterations and the learning rate are its own
            raise ConfigError(
                f"--shard-state {self.level}: the optimizer {type(optimizer).__name__} keeps "
                f"state not shaped like the weights ({own[2].path}); drop --shard-state")

    # --- after a restore, and at every step -------------------------------------------

    def start(self) -> None:
        """This worker's weights shard from the model's (restored) weights; the shard
        optimizer's step count and rate from the model's optimizer."""
        shard = np.zeros([self.layout.shard_size], np.float32)
        by_var = {}
        for p in self.pieces:
            by_var.setdefault(p.var, []).append(p)
        for var, pieces in by_var.items():
            flat = np.reshape(self.variables[var].numpy(), [-1])
            for p in pieces:
                shard[p.at:p.at + p.length] = flat[p.start:p.stop]
        self.flat.assign(shard)
        self.shard_optimizer.iterations.assign(self.optimizer.iterations)
        self._copy_rate()

    def _copy_rate(self):
        """A constant rate is a variable a callback may set on the model's optimizer."""
        mine, theirs = self.shard_optimizer._learning_rate, self.optimizer._learning_rate
        if isinstance(mine, keras.Variable) and isinstance(theirs, keras.Variable):
            mine.assign(theirs.value)

    def make_train_fn(self, state, metrics, gradient_dtype: str, accumulation: int):
        """``train_fn(iterator, num_steps)`` as ``loop.step.make_train_fn``'s, sharded."""
        strategy, global_step = self.strategy, state.global_step
        replica_step = self._replica_step(state, metrics, gradient_dtype, accumulation)
        num_metrics = len(metrics.names)

        @tf.function
        def train_fn(iterator, num_steps):
            with tf.control_dependencies(self._call_start()):
                steps = tf.identity(num_steps)
            loss_sum = tf.constant(0.0)
            metric_sum = tf.zeros([num_metrics], tf.float32)
            staleness = tf.TensorArray(tf.int64, size=steps)
            for i in tf.range(steps):
                args = steplib.step_args(iterator, accumulation)
                loss, values, update = strategy.run(replica_step, args=args)
                with tf.control_dependencies(self._step_update(update, accumulation)):
                    global_step.assign_add(1)
                loss_sum, metric_sum = steplib.add_step(strategy, loss_sum, metric_sum, loss,
                                                        values)
                staleness = staleness.write(i, tf.constant(0, tf.int64))
            with tf.control_dependencies([loss_sum, metric_sum]):
                ended = self._call_end()
            with tf.control_dependencies(ended):
                loss_sum, metric_sum = tf.identity(loss_sum), tf.identity(metric_sum)
            return steplib.call_outputs(num_steps, loss_sum, metric_sum, staleness)

        return train_fn

    # The hooks of a call that ``weights`` (``zero3``) overrides.

    def _call_start(self) -> list:
        """What the call's steps wait on (nothing here)."""
        return []

    def _call_end(self) -> list:
        """What the call's outputs wait on, after its steps (nothing here)."""
        return []

    def _step_update(self, rows, accumulation: int) -> list:
        """A step's update from its replica's bucket rows; what the global step waits on."""
        self._update([self.strategy.experimental_local_results(r)[0] for r in rows],
                     accumulation)
        return steplib.after_updates(self.variables)

    def _replica_step(self, state, metrics, gradient_dtype: str, accumulation: int):
        """One replica's gradients, clipped as Keras clips them before an all-reduce, as
        each bucket's ``[N, chunk]`` rows in ``gradient_dtype``."""
        one_batch = steplib.make_one_batch(state, metrics)
        if getattr(state.model, "jit_compile", False) is True:
            # The forward and backward pass; the bucketed collectives stay outside XLA.
            one_batch = steplib.xla_gradients(one_batch)
        optimizer, layout = self.optimizer, self.layout

        def replica_step(*batches):
            grads, loss, values = steplib.gradients_of(one_batch, batches, accumulation)
            grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                     for g, v in zip(grads, self.variables)]
            grads = optimizer._clip_gradients(steplib.to_wire(grads, gradient_dtype))
            if self.level == "optimizer":
                # Stage 1 holds the whole gradient: nothing leaves before the last is made.
                grads = tf.identity_n(grads)
            rows = []
            for b in layout.buckets:
                parts = [tf.reshape(self._block(grads[s.var], s), [-1]) for s in b.segments]
                if b.padded > b.size:
                    parts.append(tf.zeros([b.padded - b.size], parts[0].dtype))
                flat = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
                rows.append(tf.reshape(flat, [layout.workers, b.chunk]))
            return loss, values, rows

        return replica_step

    def _block(self, tensor, segment):
        """A segment's rows of a variable-shaped tensor (a first-axis slice: TensorFlow
        aliases it, no copy), or the whole tensor."""
        if segment.length == self.layout.sizes[segment.var]:
            return tensor
        row = self.layout.sizes[segment.var] // int(tensor.shape[0])
        return tensor[segment.start // row:segment.stop // row]

    def _update(self, rows, accumulation: int) -> None:
        """Reduce-scatter each bucket's rows, update this worker's shard, all-gather the
        shards into the model's variables (cross-replica context, in the traced call)."""
        with tf.device(self.device):
            summed, previous = [], []
            for r in rows:
                with tf.control_dependencies(previous):  # one collective after another
                    got = self.coll.all_to_all(r)
                previous = [got]
                summed.append(tf.reduce_sum(tf.cast(got, tf.float32), 0))
            grad = summed[0] if len(summed) == 1 else tf.concat(summed, 0)
            self._copy_rate()
            with steplib.schedule_in_batches(self.shard_optimizer, accumulation):
                self.shard_optimizer.apply([grad], [self.flat])
            self.optimizer.iterations.assign(self.shard_optimizer.iterations)
            updated, previous = self.flat.value, []
            for b in self.layout.buckets:
                # One bucket after another, each written before the next is gathered, so
                # one gathered bucket is alive at a time, not every bucket's at once.
                with tf.control_dependencies(previous):
                    whole = self.coll.all_gather(updated[b.column:b.column + b.chunk])
                previous = self._assign(b, whole)
            self._constrain()

    def _assign(self, bucket, whole) -> list:
        """A gathered bucket (``[N x chunk]``) into its variables, on this worker's one
        copy of each (a cut variable's block into its rows); returns the writes."""
        start, writes = 0, []
        for seg in bucket.segments:
            v = self.variables[seg.var]
            value, local = whole[start:start + seg.length], _local_copy(v)
            if seg.length == self.layout.sizes[seg.var]:
                writes.append(local.assign(tf.reshape(value, v.shape), read_value=False))
            else:
                rows = int(v.shape[0]) * seg.length // self.layout.sizes[seg.var]
                first = int(v.shape[0]) * seg.start // self.layout.sizes[seg.var]
                writes.append(tf.raw_ops.ResourceStridedSliceAssign(
                    ref=local.handle, begin=[first], end=[first + rows], strides=[1],
                    value=tf.reshape(value, [rows, *v.shape[1:]])))
            start += seg.length
        return writes

    def _constrain(self) -> None:
        """Weight constraints, as Keras's apply applies them, once every bucket is in."""
        for v in self.variables:
            if v.constraint is not None:
                v.assign(v.constraint(v))

    # --- checkpoints --------------------------------------------------------------------

    @contextlib.contextmanager
    def gathered(self):
        """While a checkpoint is written: every slot gathered whole (each worker saves),
        bucket by bucket, so a bucket of one variable is that variable's slot as gathered
        (reshaped, not copied)."""
        with tf.device(self.device):
            for kind, slot in self.slots.items():
                for i, b in enumerate(self.layout.buckets):
                    self._cache[kind, i] = self.coll.all_gather(
                        slot.value[b.column:b.column + b.chunk])
        try:
            yield
        finally:
            self._cache.clear()

    def full_slot(self, kind: str, var: int, shape) -> tf.Tensor:
        """Variable ``var``'s whole slot ``kind`` from the gathered slots; outside a save
        (a restore asks for the tensors' specs) zeros of its shape."""
        parts = []
        for bucket, offset, seg in self.layout.placements(var):
            whole = self._cache.get((kind, bucket))
            if whole is None:
                return tf.zeros(shape, tf.float32)
            parts.append(whole[offset:offset + seg.length])
        return tf.reshape(parts[0] if len(parts) == 1 else tf.concat(parts, 0), shape)

    def restore_slot(self, kind: str, var: int, value):
        """The part of variable ``var``'s restored slot that this worker owns, into its
        shard optimizer's slot."""
        flat, slot = tf.reshape(value, [-1]), self.slots[kind].value
        ops = [slot[p.at:p.at + p.length].assign(flat[p.start:p.stop])
               for p in self.pieces if p.var == var]
        return tf.group(ops)

    def state_bytes(self, gradient_dtype: str) -> dict[str, int]:
        """Bytes of training state this worker holds at once: the model's weights and its
        weights shard, the gradients (stage 1: all of them; stage 2: the summed shard and
        the largest variable's or bucket's), the shard optimizer's slots."""
        wire = tf.as_dtype(gradient_dtype).size
        total, shard = self.layout.total, self.layout.shard_size
        # The backward pass makes each variable's gradient whole; a bucket is a block of it.
        largest = max(max(b.padded for b in self.layout.buckets), max(self.layout.sizes))
        grads = wire * total if self.level == "optimizer" else wire * largest
        return {"weights": 4 * (total + shard), "gradients": grads + 4 * shard,
                "slots": 4 * shard * len(self.slots)}


def _local_copy(variable):
    """This worker's one copy of a model variable (the sharded update runs one replica
    per worker), written directly: a mirrored variable's own assign takes only the
    whole value, and its writes are needed as ops to order the buckets' gathers."""
    value = getattr(variable, "value", variable)
    if hasattr(value, "_get_on_device_or_primary"):
        return value._get_on_device_or_primary()
    return value


def _shard_optimizer(optimizer, flat, level: str):
    """The task's optimizer class and settings on this worker's flat shard, made outside
    the strategy's scope (Keras's update in a strategy expects distributed variables);
    its clipping is the replicas' own (done before the reduce-scatter) and Keras's own
    accumulation stays off (the step accumulates). Returns it and its slots by name."""
    config = optimizer.get_config()
    config.update(clipnorm=None, clipvalue=None, global_clipnorm=None,
                  gradient_accumulation_steps=None, name=f"{optimizer.name}_shard")
    shard = type(optimizer).from_config(config)
    slots = {}
    make = shard.add_variable_from_reference

    def recorded(reference, name=None, initializer="zeros"):
        slots[name] = make(reference, name=name, initializer=initializer)
        return slots[name]

    shard.add_variable_from_reference = recorded
    try:
        shard.build([flat])
    finally:
        del shard.add_variable_from_reference
    if len(shard.variables) - len(slots) > 2:  # iterations, and a constant rate
        raise ConfigError(f"--shard-state {level}: the optimizer {type(optimizer).__name__} "
                          "keeps state not shaped like the weights; drop --shard-state")
    return shard, slots
