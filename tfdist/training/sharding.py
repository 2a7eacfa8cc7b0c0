"""Large Keras 3 variables split over several parameter servers.

Keras 3 cannot use TensorFlow's own answer (``ParameterServerStrategy``'s
``variable_partitioner``): the partitioner makes a ``ShardedVariable``, which
Keras 3's TensorFlow variable wraps as if it were one ``tf.Variable`` and
fails on at the first gradient (``'ShardedVariable' object has no attribute
'handle'``, ``keras/src/backend/tensorflow/core.py``). This module shards at
the layer instead: under :func:`sharding_scope`, a ``keras.layers.Embedding``
or ``keras.layers.Dense`` whose table or kernel the policy selects is built
as K ordinary Keras variables (K = the number of ps tasks), each a plain
``tf.Variable`` that the strategy places round robin, so K consecutive
shards land on K different ps tasks. Everything downstream sees ordinary
variables: ``model.trainable_variables`` lists the shards, a
``tf.GradientTape`` differentiates them, the model's own Keras optimizer
updates them (its slots are colocated with each shard, and the update runs
on the shard's ps).

- **Embedding**: the table is split by rows ("div": shard i holds a
  contiguous block, the first ``rows % K`` shards one row more) and looked
  up with ``tf.nn.embedding_lookup(shards, ids)``: each shard is read with
  a gather on its own ps (only the touched rows travel), and its gradient is
  an ``IndexedSlices`` of the touched rows only. (Keras 3's own Embedding
  reads the whole table - ``ops.take`` converts it to a tensor first - and
  would move all of it from the ps to the worker on every step.)
- **Dense**: the kernel ``[in, out]`` is split by input rows; the call
  splits the input's last axis the same way and sums the K partial
  products. Each shard is read whole (a dense layer uses every row); the
  bias is not split.
- Not split: layers with a weight constraint (a constraint on the whole
  kernel, e.g. a max-norm over rows, is not one per shard), quantized or
  LoRA layers, subclasses of Embedding/Dense (their own ``build``), and any
  other layer. These keep TensorFlow's round-robin placement.

Checkpoints reshard: :func:`checkpoint_objects` gives ``tf.train.Checkpoint``
one object per split variable (a ``ShardedVariable`` over its shards, and
one per optimizer slot), which saves the full tensor as slices. A run saved
with K shards restores with any other K: each shard reads its own rows.

Optimizers: gradients of embedding shards are ``IndexedSlices``, and the
Keras optimizer applies them where the shard lives. Plain SGD then only
touches the gathered rows. Keras 3's Adam, Adagrad and SGD with momentum do
their slot arithmetic densely (``m += (g - m) * (1 - beta_1)`` over the whole
slot): no more bytes travel (the update runs on the ps), but every step costs
each ps a pass over its share of the table and slots.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

POLICIES = ("none", "min-size", "fixed")
# A variable this large (bytes) or larger is split under "min-size": a table
# of a few MB already costs one ps a noticeable share of its link.
DEFAULT_MIN_BYTES = 1 << 20
# Shards are named "<name>__shard<i>"; checkpoint_objects groups by this.
SHARD_RE = re.compile(r"^(?P<head>.*)__shard(?P<index>\d+)(?P<tail>.*)$")


class ShardingError(ValueError):
    """A sharding request that cannot be met (a one-line message)."""


@dataclass(frozen=True)
class ShardingPolicy:
    """Which variables to split, and into how many shards.

    ``partitioner``: ``none`` (nothing split), ``min-size`` (Embedding
    tables and Dense kernels of ``min_bytes`` or more) or ``fixed`` (every
    Embedding table and Dense kernel). ``num_shards``: the number of ps
    tasks; 1 keeps the split layout (one shard), so a checkpoint moves
    between ps counts in both directions.
    """

    partitioner: str = "min-size"
    num_shards: int = 1
    min_bytes: int = DEFAULT_MIN_BYTES

    def __post_init__(self):
        if self.partitioner not in POLICIES:
            raise ShardingError(
                f"variable partitioner {self.partitioner!r} is not one of "
                f"{', '.join(POLICIES)}")
        if self.num_shards < 1:
            raise ShardingError(
                f"shard count {self.num_shards} must be at least 1 (one shard per ps task)")
        if self.min_bytes < 0:
            raise ShardingError(f"shard minimum {self.min_bytes} bytes must be >= 0")

    def selects(self, shape, dtype_size: int) -> bool:
        if self.partitioner == "none":
            return False
        if self.partitioner == "fixed":
            return True
        size = dtype_size
        for d in shape:
            size *= int(d)
        return size >= self.min_bytes


def split_rows(rows: int, shards: int) -> list[int]:
    """Rows per shard, "div" layout: the first ``rows % shards`` get one more.

    This is the layout ``tf.nn.embedding_lookup`` assumes for a list of
    tables, and the one ``ShardedVariable`` offsets follow.
    """
    base, extra = divmod(rows, shards)
    return [base + (1 if i < extra else 0) for i in range(shards)]


def _shard_initializer(initializer, full_shape, shard_shape, index):
    """The initializer for one shard, with the whole variable's statistics.

    Shape-free initializers (uniform, normal, zeros) apply as they are; a
    variance-scaling one (Glorot, He, LeCun) computes its variance from the
    shape it is given, so its scale is corrected to the full shape's fans.
    A fixed integer seed is offset by the shard index: the same seed would
    give every shard the same values.
    """
    import keras

    init = keras.initializers.get(initializer)
    seed = getattr(init, "_init_seed", None)
    if isinstance(seed, int):
        seed += index
        if not isinstance(init, keras.initializers.VarianceScaling):
            init = type(init).from_config({**init.get_config(), "seed": seed})
    if isinstance(init, keras.initializers.VarianceScaling):
        def fans(shape):
            fan_in, fan_out = (shape[0], shape[1]) if len(shape) == 2 else (shape[-1], shape[-1])
            return {"fan_in": fan_in, "fan_out": fan_out,
                    "fan_avg": (fan_in + fan_out) / 2.0}[init.mode]

        # Built from attributes: Glorot/He configs carry only their seed.
        init = keras.initializers.VarianceScaling(
            scale=init.scale * fans(shard_shape) / fans(full_shape), mode=init.mode,
            distribution=init.distribution, seed=seed)
    return init


def _add_shards(layer, name, full_shape, initializer, regularizer, num_shards):
    rows = int(full_shape[0])
    if rows < num_shards:
        raise ShardingError(
            f"layer {layer.name!r}: {name} has {rows} row(s), fewer than the "
            f"{num_shards} shards asked for; use fewer ps tasks or "
            f"--variable-partitioner min-size")
    shards = []
    for i, r in enumerate(split_rows(rows, num_shards)):
        shape = (r, *full_shape[1:])
        shards.append(layer.add_weight(
            name=f"{name}__shard{i}", shape=shape,
            initializer=_shard_initializer(initializer, full_shape, shape, i),
            regularizer=regularizer, trainable=True))
    return shards


def _shardable(layer) -> bool:
    return (not getattr(layer, "quantization_mode", None)
            and not getattr(layer, "lora_rank", None))


def _sharded_classes():
    """The two layer classes, created on first use (Keras imported lazily)."""
    global _CLASSES  # pylint: disable=global-statement
    if _CLASSES is not None:
        return _CLASSES
    _CLASSES = (_embedding_class(), _dense_class())
    return _CLASSES


def _embedding_class():
    import keras
    import tensorflow as tf
    from keras import ops

    class ShardedEmbedding(keras.layers.Embedding):
        """An Embedding whose table is K row blocks (see the module docstring)."""

        def _build_shards(self, num_shards):
            self._shards = _add_shards(
                self, "embeddings", (self.input_dim, self.output_dim),
                self.embeddings_initializer, self.embeddings_regularizer, num_shards)
            self.built = True

        @property
        def shards(self):
            return list(self._shards)

        @property
        def embeddings(self):
            # The whole table, for inspection (reads every shard).
            return ops.concatenate([s.value for s in self._shards], axis=0)

        def call(self, inputs):
            if inputs.dtype not in ("int32", "int64"):
                inputs = ops.cast(inputs, "int32")
            # One gather per shard, on the shard's ps (resource variables);
            # "div" matches split_rows.
            out = tf.nn.embedding_lookup([s.value for s in self._shards], inputs)
            return ops.cast(out, self.compute_dtype)

        def save_own_variables(self, store):
            store["0"] = self.embeddings

        def load_own_variables(self, store):
            _assign_rows(self._shards, store["0"])

    return ShardedEmbedding


def _dense_class():
    import keras
    from keras import ops

    class ShardedDense(keras.layers.Dense):
        """A Dense whose kernel is K blocks of input rows (see the module docstring)."""

        def _build_shards(self, input_shape, num_shards):
            in_dim = int(input_shape[-1])
            self._kernel_shards = _add_shards(
                self, "kernel", (in_dim, self.units), self.kernel_initializer,
                self.kernel_regularizer, num_shards)
            self._split = split_rows(in_dim, num_shards)
            if self.use_bias:
                self.bias = self.add_weight(
                    name="bias", shape=(self.units,), initializer=self.bias_initializer,
                    regularizer=self.bias_regularizer, constraint=self.bias_constraint)
            else:
                self.bias = None
            self.input_spec = keras.layers.InputSpec(min_ndim=2, axes={-1: in_dim})
            self.built = True

        @property
        def shards(self):
            return list(self._kernel_shards)

        @property
        def kernel(self):
            return ops.concatenate([s.value for s in self._kernel_shards], axis=0)

        def call(self, inputs, training=None):
            parts = ops.split(inputs, list(_offsets(self._split))[1:-1], axis=-1) \
                if len(self._split) > 1 else [inputs]
            x = None
            for part, shard in zip(parts, self._kernel_shards):
                y = ops.matmul(part, shard)
                x = y if x is None else ops.add(x, y)
            if self.bias is not None:
                x = ops.add(x, self.bias)
            if self.activation is not None:
                x = self.activation(x)
            return x

        def save_own_variables(self, store):
            store["0"] = self.kernel
            if self.bias is not None:
                store["1"] = self.bias

        def load_own_variables(self, store):
            _assign_rows(self._kernel_shards, store["0"])
            if self.bias is not None:
                self.bias.assign(store["1"])

    return ShardedDense


_CLASSES = None


def _offsets(sizes):
    total = 0
    yield 0
    for s in sizes:
        total += s
        yield total


def _assign_rows(shards, full):
    import numpy as np

    full = np.asarray(full)
    start = 0
    for s in shards:
        rows = int(s.shape[0])
        s.assign(full[start:start + rows])
        start += rows


@contextlib.contextmanager
def sharding_scope(policy: ShardingPolicy):
    """Layers built inside are split by ``policy``. Enter inside ``strategy.scope()``.

    A ``keras.layers.Embedding`` or ``keras.layers.Dense`` (exactly these
    classes) constructed inside this scope and built while it is open
    becomes a ``ShardedEmbedding``/``ShardedDense`` when the policy selects
    its table or kernel. Keras wraps a layer's ``build`` when the layer is
    constructed, so a layer constructed outside is not affected.
    """
    if policy.partitioner == "none":
        yield
        return
    import keras

    ShardedEmbedding, ShardedDense = _sharded_classes()
    orig_embedding_build = keras.layers.Embedding.build
    orig_dense_build = keras.layers.Dense.build

    def embedding_build(self, input_shape=None):
        if (type(self) is keras.layers.Embedding and not self.built and _shardable(self)
                and self.embeddings_constraint is None
                and policy.selects((self.input_dim, self.output_dim),
                                   _dtype_size(self.variable_dtype))):
            self.__class__ = ShardedEmbedding
            return self._build_shards(policy.num_shards)
        return orig_embedding_build(self, input_shape)

    def dense_build(self, input_shape):
        if (type(self) is keras.layers.Dense and _shardable(self)
                and self.kernel_constraint is None
                and policy.selects((int(input_shape[-1]), self.units),
                                   _dtype_size(self.variable_dtype))):
            self.__class__ = ShardedDense
            return self._build_shards(input_shape, policy.num_shards)
        return orig_dense_build(self, input_shape)

    keras.layers.Embedding.build = embedding_build
    keras.layers.Dense.build = dense_build
    try:
        yield
    finally:
        keras.layers.Embedding.build = orig_embedding_build
        keras.layers.Dense.build = orig_dense_build


def _dtype_size(dtype) -> int:
    import numpy as np

    return np.dtype(str(dtype)).itemsize


def sharded_layers(model) -> list:
    """The model's split layers (ShardedEmbedding/ShardedDense)."""
    classes = _sharded_classes()
    return [layer for layer in model._flatten_layers() if isinstance(layer, classes)]  # pylint: disable=protected-access


def _tf_variable(v):
    inner = getattr(v, "_value", None)  # the tf.Variable behind a Keras variable
    return v if inner is None else inner


def ps_variable_bytes(*variable_groups) -> dict[str, int]:
    """Bytes each ps task holds: ``{"ps:0": bytes, ...}``.

    ``variable_groups``: iterables of Keras or TensorFlow variables (e.g.
    ``model.weights, optimizer.variables``); each variable counts once.
    Variables not on a ps task (a single-process run) count under their
    job (e.g. ``localhost:0``).
    """
    import tensorflow as tf

    seen, out = set(), {}
    for group in variable_groups:
        for v in group:
            var = _tf_variable(v)
            if id(var) in seen:
                continue
            seen.add(id(var))
            spec = tf.DeviceSpec.from_string(var.device or "")
            key = f"{spec.job or 'localhost'}:{spec.task or 0}"
            out[key] = out.get(key, 0) + int(var.shape.num_elements()) * var.dtype.size
    return dict(sorted(out.items()))


def _group_key(path: str):
    m = SHARD_RE.match(path)
    if not m:
        return None, None
    return m.group("head") + m.group("tail"), int(m.group("index"))


def _checkpoint_children(variables, short=lambda name: name) -> dict:
    """``{key: trackable}``: split variables as one ShardedVariable each.

    Keys are the position of each (grouped) variable in ``variables`` and
    the variable's own name, not its path: paths carry Keras's automatic
    layer names ("dense_3"), which depend on what else the process built.
    The order is the model's (or optimizer's) and does not depend on the
    shard count: the shards of one variable are contiguous.
    """
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    order, groups = [], {}
    for v in variables:
        path = getattr(v, "path", None) or v.name
        key, index = _group_key(path)
        if key is None:
            order.append((short(v.name), v))
            continue
        if key not in groups:
            groups[key] = {}
            order.append((short(_group_key(v.name)[0] or v.name), groups[key]))
        groups[key][index] = _tf_variable(v)
    children = {}
    for position, (name, item) in enumerate(order):
        if isinstance(item, dict):
            if sorted(item) != list(range(len(item))):
                raise ShardingError(f"shards of {name} are not numbered 0..{len(item) - 1}")
            item = ShardedVariable([item[i] for i in sorted(item)], name=name)
        children[f"{position}_{name}".replace("/", "_")] = item
    return children


def _view(children: dict):
    import tensorflow as tf

    class _Variables(tf.__internal__.tracking.Trackable):
        """A checkpoint node whose children are variables keyed by position."""

        def _trackable_children(self, save_type="checkpoint", **kwargs):
            return dict(children)

    return _Variables()


def checkpoint_objects(model, optimizer) -> dict:
    """Keyword arguments for ``tf.train.Checkpoint`` holding model and optimizer.

    Without split layers: ``{"model": model, "optimizer": optimizer}``, the
    usual layout. With split layers: ``{"model_variables": ...,
    "optimizer_variables": ...}``, every variable keyed by its position and name, and
    every split variable (and each optimizer slot of it) one
    ``ShardedVariable``, saved as slices of the full tensor so that a restore
    with another shard count reads each new shard's rows. Keys depend on
    layer names, so the model must be built the same way (it is, from the
    same task).
    """
    if not sharded_layers(model):
        return {"model": model, "optimizer": optimizer}
    return {"model_variables": _view(_checkpoint_children(model.weights)),
            # Slot names start with their variable's path ("dense_3_kernel_
            # momentum"): only the slot's kind is kept.
            "optimizer_variables": _view(_checkpoint_children(
                optimizer.variables, short=lambda name: name.rsplit("_", 1)[-1]))}


def sparse_updates(optimizer) -> str:
    """Make the optimizer's row-sparse updates touch only the gradient's rows.

    Keras 3's Adagrad applies an ``IndexedSlices`` gradient through dense
    arithmetic over its whole accumulator (``sqrt(accumulator + epsilon)``
    for every row, every step). Rows without a gradient do not change under
    Adagrad, so the update restricted to the touched rows is the same
    update, exactly: this replaces the optimizer's ``update_step`` (on this
    instance only) for ``IndexedSlices`` gradients. Dense gradients take
    Keras's own path. Returns what it did: "adagrad", "sgd" (plain SGD is
    row-sparse already) or "dense" (any other optimizer, e.g. Adam, whose
    moments decay on every row, so a row-sparse update would be a different
    optimizer).
    """
    import keras
    import tensorflow as tf

    kind = type(optimizer)
    if kind is keras.optimizers.SGD and not optimizer.momentum:
        return "sgd"
    if kind is not keras.optimizers.Adagrad:
        return "dense"
    keras_update = optimizer.update_step

    def update_step(gradient, variable, learning_rate):
        if not isinstance(gradient, tf.IndexedSlices):
            return keras_update(gradient, variable, learning_rate)
        dtype = variable.dtype
        # One row per index: duplicates are summed first, as densifying would.
        rows, position = tf.unique(gradient.indices)
        grad = tf.math.unsorted_segment_sum(tf.cast(gradient.values, dtype), position,
                                            tf.shape(rows)[0])
        accumulator = _tf_variable(
            optimizer._accumulators[optimizer._get_variable_index(variable)])  # pylint: disable=protected-access
        accumulator.scatter_add(tf.IndexedSlices(tf.square(grad), rows))
        # Read after the add (same resource: ordered by automatic control deps).
        acc_rows = accumulator.sparse_read(rows)
        step = tf.cast(learning_rate, dtype) * grad / tf.sqrt(
            acc_rows + tf.cast(optimizer.epsilon, dtype))
        variable.scatter_sub(tf.IndexedSlices(step, rows))

    optimizer.update_step = update_step
    return "adagrad"


def full_weights(model) -> list:
    """``model``'s weights as the unsplit model holds them: the shards of each
    split variable joined along their rows, in the model's weight order.

    A local copy built from the task (outside the strategy, unsplit) takes
    these with ``set_weights``: evaluation, the weights' hash and
    ``model.keras`` do not depend on the number of ps tasks.
    """
    import numpy as np

    out, key, run = [], None, []
    for var in model.weights:
        match = SHARD_RE.match(var.path)
        group = (match.group("head"), match.group("tail")) if match else None
        if run and group != key:
            out.append(np.concatenate(run, axis=0))
            run = []
        key = group
        if group is None:
            out.append(np.asarray(var.numpy()))
        else:
            run.append(np.asarray(var.numpy()))
    if run:
        out.append(np.concatenate(run, axis=0))
    return out


def set_full_weights(model, weights: list) -> None:
    """The inverse of :func:`full_weights`: ``weights`` (the unsplit model's, in its
    order) assigned to ``model``, each split variable's rows to its shards.

    A callback that changes its (local) ``self.model``'s weights under ps
    (``EarlyStopping(restore_best_weights=True)``) has them reach the trained model
    this way (``training.loop.callbacks``).
    """
    index, key, run = 0, None, []
    for var in model.weights:
        match = SHARD_RE.match(var.path)
        group = (match.group("head"), match.group("tail")) if match else None
        if run and group != key:
            _assign_rows(run, weights[index])
            index, run = index + 1, []
        key = group
        if group is None:
            var.assign(weights[index])
            index += 1
        else:
            run.append(var)
    if run:
        _assign_rows(run, weights[index])
