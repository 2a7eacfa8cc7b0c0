"""multiworker, ``--shard-state weights``: ZeRO stage 3 (FSDP's ``FULL_SHARD``), layer by layer.

Built on ``zero.ShardedState`` (the shard optimizer, its 1/N of the slots, the
checkpoints' ``SlotView``s), with the weights themselves sharded while the steps
of one call run:

- the layout is planned layer by layer: each layer's variables have their own
  buckets, so a layer's part of this worker's shard is one contiguous range;
- at the start of a call (``--log-every`` steps) the model's own variables are
  released: each is given an empty value (its buffer freed; a resource
  variable's value may change shape when assigned without shape validation),
  so between the steps of the call a worker holds only its shard of the weights;
- each layer with weights runs inside a ``tf.custom_gradient`` function whose
  forward pass all-gathers the layer's shard and calls the layer on those
  tensors (Keras 3 ``stateless_call``), and whose backward pass gathers them
  AGAIN (nothing gathered is kept from the forward pass, so TensorFlow frees a
  layer's weights once its forward matmul has run), recomputes the layer under
  an inner tape, and reduce-scatters its weight gradients (an all-to-all and a
  sum per bucket, as ``zero``): only this worker's 1/N of each gradient leaves
  the backward pass. The price is the layer's forward computed twice.
- the shard optimizer updates the shard, as at the other levels;
- at the end of the call the shards are all-gathered into the model's
  variables, layer by layer, so callbacks, progress lines, ``weights_sha256``,
  evaluation, checkpoints, ``model.keras`` and ``--export`` see the whole model.

What it refuses, each in one line (``refusal``): a model that is not a
``keras.Sequential`` (the layers must run as a chain, one after another), a
layer with weights that also keeps state (non-trainable variables: the layer is
recomputed in the backward pass) or has a regularizer, ``jit_compile=True``
(the collectives sit between the layers), ``global_clipnorm`` (the norm needs
every gradient at once) and, with gradient accumulation, ``clipnorm`` and
``clipvalue`` (each micro-batch's gradient is reduce-scattered as soon as it is
made, so the mean is never held whole to clip).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfdist.protocol import ConfigError
from tfdist.training.loop import step as steplib
from tfdist.training.sync import zero
from tfdist.training.sync.shard_layout import Bucket, Segment, ShardLayout
from tfdist.training.workload import contract


class Group:
    """One layer with weights: its variables' indices, its buckets' indices in the whole
    layout, and its columns ``[first, last)`` in each worker's shard."""

    def __init__(self, layer, variables: list[int]):
        self.layer, self.variables = layer, variables
        self.buckets: list[int] = []
        self.first = self.last = 0


def refusal(model, optimizer, variables, accumulation: int) -> str | None:
    """Why ``--shard-state weights`` cannot run this model (one line's reason), else None."""
    if not isinstance(model, keras.Sequential):
        return (f"the model is a {type(model).__name__}, and the weights level runs its "
                "layers one after another, as a keras.Sequential")
    if getattr(model, "jit_compile", False) is True:
        return "the model is compiled with jit_compile=True, and collectives run between its layers"
    for layer in model.layers:
        if not layer.trainable_variables:
            continue
        if layer.non_trainable_variables:
            return (f"layer {layer.name} keeps state (non-trainable variables), and each layer "
                    "with weights is recomputed in the backward pass")
        if any(getattr(layer, a, None) is not None for a in
               ("kernel_regularizer", "bias_regularizer", "activity_regularizer")):
            return f"layer {layer.name} has a regularizer, whose loss would read released weights"
    if getattr(optimizer, "global_clipnorm", None):
        return "global_clipnorm needs every gradient at once, and each layer's leaves as it is made"
    if accumulation > 1 and (getattr(optimizer, "clipnorm", None) or
                             getattr(optimizer, "clipvalue", None)):
        return ("with gradient accumulation each batch's gradient leaves as it is made, so "
                "their mean is never held whole to clip")
    owned = sorted(id(v) for layer in model.layers for v in layer.trainable_variables)
    if owned != sorted(id(v) for v in variables):
        return "some trainable variables belong to no top-level layer"
    return None


class WeightShardedState(zero.ShardedState):
    """``zero.ShardedState`` with the weights sharded too (see the module)."""

    def __init__(self, strategy, optimizer, variables, member: int, bucket_bytes: int | None,
                 model, accumulation: int):
        why = refusal(model, optimizer, variables, accumulation)
        if why:
            raise ConfigError(f"--shard-state weights cannot be honoured: {why}; use "
                              "--shard-state gradients")
        self.model = model
        index = {id(v): i for i, v in enumerate(variables)}
        self.groups = [Group(layer, [index[id(v)] for v in layer.trainable_variables])
                       for layer in model.layers if layer.trainable_variables]
        super().__init__("weights", strategy, optimizer, variables, member, bucket_bytes)

    def _plan(self, workers: int, bucket_elements: int) -> ShardLayout:
        """Each layer's variables planned on their own (``ShardLayout.plan``) and the
        layers' buckets laid one after another, so a layer's shard is contiguous."""
        sizes = [int(np.prod(v.shape)) for v in self.variables]
        buckets, column = [], 0
        for g in self.groups:
            vs = [self.variables[i] for i in g.variables]
            rows = [int(np.prod(v.shape[1:])) if len(v.shape) > 1 else 1 for v in vs]
            own = ShardLayout.plan([sizes[i] for i in g.variables], workers, bucket_elements,
                                   rows)
            g.first = column
            for b in own.buckets:
                g.buckets.append(len(buckets))
                segments = tuple(Segment(g.variables[s.var], s.start, s.stop)
                                 for s in b.segments)
                buckets.append(Bucket(segments, b.size, b.chunk, column, b.padded))
                column += b.chunk
            g.last = column
        return ShardLayout(tuple(sizes), workers, tuple(buckets))

    # --- the layer's weights, gathered; its gradients, reduce-scattered ------------------

    def _gather_layer(self, g: Group, shard, after) -> list:
        """Layer ``g``'s variables, whole, all-gathered from its part of the shard, one
        bucket after another, the first once ``after`` exists."""
        wholes, previous = [], [after]
        for i in g.buckets:
            b = self.layout.buckets[i]
            at = b.column - g.first
            with tf.control_dependencies(previous):
                whole = self.coll.all_gather(shard[at:at + b.chunk])
            previous = [whole]
            wholes.append(whole)
        out = []
        for var in g.variables:
            parts = []
            for bucket, offset, seg in self.layout.placements(var):
                parts.append(wholes[g.buckets.index(bucket)][offset:offset + seg.length])
            flat = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
            out.append(tf.reshape(flat, self.variables[var].shape))
        return out

    def _scatter_layer(self, g: Group, grads) -> tf.Tensor:
        """Layer ``g``'s gradients (variable-shaped, in the wire dtype) reduce-scattered:
        the summed float32 gradient of this worker's part of the layer's shard."""
        by_var = dict(zip(g.variables, grads))
        summed, previous = [], []
        for i in g.buckets:
            b = self.layout.buckets[i]
            parts = [tf.reshape(self._block(by_var[s.var], s), [-1]) for s in b.segments]
            if b.padded > b.size:
                parts.append(tf.zeros([b.padded - b.size], parts[0].dtype))
            flat = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
            with tf.control_dependencies(previous):
                got = self.coll.all_to_all(tf.reshape(flat, [self.layout.workers, b.chunk]))
            previous = [got]
            summed.append(tf.reduce_sum(tf.cast(got, tf.float32), 0))
        return summed[0] if len(summed) == 1 else tf.concat(summed, 0)

    def _layer_call(self, g: Group, x, shard, gradient_dtype: str):
        """Layer ``g`` on ``x`` with its weights gathered from ``shard`` (its part of this
        worker's shard), as a function whose gradient is the reduce-scattered shard's."""
        layer, optimizer = g.layer, self.optimizer

        @tf.custom_gradient
        def run(x, shard):
            weights = self._gather_layer(g, shard, x)
            y, _ = layer.stateless_call(weights, [], x, training=True)

            def grad(dy):
                # Gathered again: keeping the forward's would hold every layer's at once.
                again = self._gather_layer(g, shard, dy)
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    tape.watch(again)
                    y2, _ = layer.stateless_call(again, [], x, training=True)
                dx, *dws = tape.gradient(y2, [x, *again], output_gradients=dy)
                dws = [tf.zeros_like(w) if d is None else tf.convert_to_tensor(d)
                       for d, w in zip(dws, again)]
                dws = optimizer._clip_gradients(steplib.to_wire(dws, gradient_dtype))
                return (tf.zeros_like(x) if dx is None else dx), self._scatter_layer(g, dws)

            return y, grad

        return run(x, shard)

    def _one_batch(self, metrics, gradient_dtype: str):
        """``one_batch(features, labels, sample_weight=None) -> ([shard gradient], loss,
        metric values)``: the model's layers one after another, each layer with weights
        through ``_layer_call``; the loss as the plain step computes it."""
        model, groups = self.model, {id(g.layer): g for g in self.groups}

        def one_batch(features, labels, sample_weight=None):
            flat = self.flat.value
            shards = [flat[g.first:g.last] for g in self.groups]
            with tf.GradientTape() as tape:
                tape.watch(shards)
                x, k = features, 0
                for layer in model.layers:
                    g = groups.get(id(layer))
                    if g is None:
                        x = layer(x, training=True)
                    else:
                        x = self._layer_call(g, x, shards[k], gradient_dtype)
                        k += 1
                loss = contract.compute_loss(model, features, labels, x, sample_weight,
                                             training=True)
            grads = tape.gradient(loss, shards)
            grad = grads[0] if len(grads) == 1 else tf.concat(grads, 0)
            return [grad], loss, metrics.batch_values(labels, x, sample_weight)

        return one_batch

    # --- the call of n steps ---------------------------------------------------------------

    def _replica_step(self, state, metrics, gradient_dtype: str, accumulation: int):
        """One replica's step: its shard gradient (already reduce-scattered, layer by
        layer, in the backward pass), loss and metric values."""
        one_batch = self._one_batch(metrics, gradient_dtype)

        def replica_step(*batches):
            grads, loss, values = steplib.gradients_of(one_batch, batches, accumulation)
            return loss, values, grads[0]

        return replica_step

    # The call (``zero.ShardedState.make_train_fn``): the model's variables released
    # before its steps, the shards gathered back into them after (the call ends with the
    # model whole), the summed shard gradient applied at each step.

    def _call_start(self) -> list:
        return self._release()

    def _call_end(self) -> list:
        return self._gather_into_model()

    def _step_update(self, grad, accumulation: int) -> list:
        return [self._apply(self.strategy.experimental_local_results(grad)[0], accumulation)]

    def _apply(self, grad, accumulation: int):
        """The summed shard gradient applied to the shard; returns the updated shard."""
        with tf.device(self.device):
            self._copy_rate()
            with steplib.schedule_in_batches(self.shard_optimizer, accumulation):
                self.shard_optimizer.apply([grad], [self.flat])
            self.optimizer.iterations.assign(self.shard_optimizer.iterations)
            return tf.identity(self.flat.value)

    def _release(self) -> list:
        """Every model variable given an empty value of its rank: its buffer is freed."""
        writes = []
        with tf.device(self.device):
            for v in self.variables:
                local = zero._local_copy(v)
                # Of unknown shape to the graph: its shape inference holds a variable's
                # value to the variable's shape; the kernel, told not to, does not.
                empty = tf.raw_ops.PlaceholderWithDefault(
                    input=tf.zeros([0] * len(v.shape), v.dtype), shape=None)
                writes.append(tf.raw_ops.AssignVariableOp(resource=local.handle, value=empty,
                                                          validate_shape=False))
        return writes

    def _gather_into_model(self) -> list:
        """The shards all-gathered into the model's variables, one layer after another
        (each layer written before the next is gathered); weight constraints after."""
        writes = []
        with tf.device(self.device):
            flat = self.flat.value
            for g in self.groups:
                after = writes[-1] if writes else flat
                whole = self._gather_layer(g, flat[g.first:g.last], after)
                for var, value in zip(g.variables, whole):
                    local = zero._local_copy(self.variables[var])
                    writes.append(tf.raw_ops.AssignVariableOp(
                        resource=local.handle, value=value, validate_shape=False))
            with tf.control_dependencies(writes):
                for v in self.variables:
                    if v.constraint is not None:
                        writes.append(v.assign(v.constraint(v)))
        return writes

    def state_bytes(self, gradient_dtype: str) -> dict[str, int]:
        """Bytes of training state held at once while the steps run: the weights shard and
        the largest layer gathered; the largest layer's gradient, as its backward pass
        makes it, and the summed shard; the shard optimizer's slots."""
        wire = tf.as_dtype(gradient_dtype).size
        shard = self.layout.shard_size
        largest = max(sum(self.layout.sizes[i] for i in g.variables) for g in self.groups)
        return {"weights": 4 * (shard + largest), "gradients": wire * largest + 4 * shard,
                "slots": 4 * shard * len(self.slots)}
