"""A model's own ``train_step`` under ``jit_compile=True`` where its step cannot be
compiled whole (``multiworker``: the all-reduce in its ``optimizer.apply``; ``ps``,
``ps-sync``: the variables live on the ps tasks, which XLA cannot read).

The ``train_step`` itself stays outside XLA; each call of the model, and of every
Keras layer or model it holds as a public attribute (a GAN's ``generator`` and
``discriminator``), runs as one ``tf.function(jit_compile=True)`` of values: the
call's variables are read outside XLA (from the ps under ``ps``), handed in, and
the layer's ``call`` runs in a ``keras.StatelessScope`` on them; what the call
assigns (a batch-norm layer's statistics, a seed) comes back as values and is
assigned after it, and the losses it adds are added again outside. The step's
``GradientTape`` sees the reads, so its gradients reach the variables through
them, and XLA compiles the call's backward pass too (the gradient of an
XLA-compiled function is compiled as well); ``optimizer.apply`` (routed:
``workload.apply_route``) all-reduces or pushes them outside XLA.

A call made inside another compiled call (a model's ``call`` calling its layers)
runs as it is, inside the outer one's function.
"""

from __future__ import annotations

import contextlib
import threading

_inside = threading.local()


def layers_of(model) -> list:
    """``model`` and the Keras layers and models it holds as public attributes."""
    import keras

    found = [model]
    for attr, value in vars(model).items():
        if isinstance(value, keras.layers.Layer) and not attr.startswith("_") and \
                all(value is not f for f in found):
            found.append(value)
    return found


def read(variables) -> list:
    """Each variable's value as a tensor read here (for a ps-held variable, on its ps),
    never the resource, which an XLA function cannot read across tasks."""
    import tensorflow as tf

    values = []
    for v in variables:
        var = getattr(v, "_value", v)  # a Keras variable's tf.Variable
        values.append(tf.identity(var.read_value() if hasattr(var, "read_value") else var))
    return values


def compiled_call(layer):
    """``layer.call`` as one XLA-compiled function of the layer's variables' values."""
    import keras
    import tensorflow as tf

    original = layer.call
    trainable = list(layer.trainable_variables)
    ids = {id(v) for v in trainable}
    others = [v for v in layer.variables if id(v) not in ids]

    @tf.function(jit_compile=True, reduce_retracing=True)
    def xla(weights, other_values, args, kwargs):
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            with keras.StatelessScope(list(zip(trainable, weights)) + list(
                    zip(others, other_values)), collect_losses=True) as scope:
                given = dict(scope.state_mapping)
                out = original(*args, **kwargs)
            # What the call assigned, by position in ``others``: keys, so that each
            # trace (training or not) says which of its outputs go where.
            now = {i: scope.state_mapping[id(v)] for i, v in enumerate(others)}
            return out, {i: value for i, value in now.items()
                         if value is not given[id(others[i])]}, list(scope.losses)
        finally:
            _inside.depth -= 1

    def call(*args, **kwargs):
        if getattr(_inside, "depth", 0):
            return original(*args, **kwargs)  # already inside a compiled call
        out, new, losses = xla(read(trainable), read(others), args, kwargs)
        for i, value in new.items():
            others[i].assign(value)
        for loss in losses:
            layer.add_loss(loss)
        return out

    return call


# How many open ``compiled_calls`` patched each layer (tf.distribute traces each
# replica of a MirroredStrategy in a thread of its own): the first patches, the last
# to close restores.
_lock = threading.Lock()
_patched: dict[int, int] = {}


@contextlib.contextmanager
def compiled_calls(model):
    """While open (a model's own ``train_step`` being traced): every call of ``model``
    and of its attribute layers compiled as ``compiled_call`` makes it; then their own
    ``call`` again."""
    layers = layers_of(model)
    with _lock:
        for layer in layers:
            count = _patched.get(id(layer), 0)
            if not count:
                # An instance attribute over the class's method; object's own setattr,
                # so Keras's attribute tracking does not see a function.
                object.__setattr__(layer, "call", compiled_call(layer))
            _patched[id(layer)] = count + 1
    try:
        yield
    finally:
        with _lock:
            for layer in layers:
                _patched[id(layer)] -= 1
                if not _patched[id(layer)]:
                    del _patched[id(layer)]
                    object.__delattr__(layer, "call")
