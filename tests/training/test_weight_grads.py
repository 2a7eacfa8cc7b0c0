"""training.pipeline.weight_grads: a stage's matrix products differentiated
with the transposed weight made once and the weight gradient made once from
every micro-batch's rows give TensorFlow's own gradients; anything else keeps
TensorFlow's; the registry is left as it was."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tensorflow.python.framework import ops as tf_ops  # the registry the module swaps

from tfdist.training.pipeline import weight_grads as wg


def _model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(3)])


def _gradients(model, micro, defer=None, extra=None, transpose=True):
    """The model's summed gradients over ``micro`` micro-batches, by the tape
    alone (defer None) or through ``recording``; and the products it kept."""
    x = tf.constant(np.random.default_rng(0).normal(size=(16, 6)), tf.float32)
    y = tf.constant(np.random.default_rng(1).normal(size=(16, 3)), tf.float32)
    seen = {}

    @tf.function
    def run():
        variables = model.trainable_variables
        products = None if defer is None else wg.WeightGrads(variables, defer, transpose)
        acc = [None] * len(variables)
        inputs = []
        for xs, ys in zip(tf.split(x, micro), tf.split(y, micro)):
            with tf.GradientTape() as tape:
                tape.watch(xs)
                out = model(xs)
                if extra is not None:
                    out = extra(out, variables)
                loss = tf.reduce_sum((out - ys) ** 2)
            if products is None:
                grads = tape.gradient(loss, [xs] + variables)
            else:
                with wg.recording(products):
                    grads = tape.gradient(loss, [xs] + variables)
            inputs.append(grads[0])
            acc = [a if b is None else b if a is None else a + b for a, b in zip(acc, grads[1:])]
        if products is not None:
            seen["untouched"] = [a is None for a in acc]
            acc = products.weight_gradients(acc)
        return acc, tf.concat(inputs, 0)

    grads, inputs = run()
    return [g.numpy() for g in grads], inputs.numpy(), seen


@pytest.mark.parametrize("defer, transpose", [(True, True), (False, True), (True, False)])
def test_the_products_gradients_are_tensorflows_own(defer, transpose):
    model = _model()
    want, want_in, _ = _gradients(model, 4)
    got, got_in, seen = _gradients(model, 4, defer=defer, transpose=transpose)
    # Deferred, the kernels' gradients came from the products, not the tape (the biases'
    # from the tape); otherwise every gradient is in the tape's answer.
    assert seen["untouched"] == ([True, False, True, False] if defer else [False] * 4)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_in, want_in, rtol=1e-5, atol=1e-6)


def test_a_weight_used_another_way_too_adds_both_gradients():
    """A kernel that also enters the loss through something else (here a product
    with it transposed, which keeps TensorFlow's own gradient) gets both."""
    def extra(out, variables):
        kernel = variables[2]
        return out + tf.reduce_sum(tf.matmul(out, kernel, transpose_b=True)) * 1e-2

    model = _model()
    want, _, _ = _gradients(model, 2, extra=extra)
    got, _, seen = _gradients(model, 2, defer=True, extra=extra)
    assert seen["untouched"][2] is False  # the tape had a part of its gradient
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_registry_is_restored_even_when_the_body_raises():
    entry = tf_ops._gradient_registry._registry["MatMul"]  # pylint: disable=protected-access
    before = entry["type"]

    @tf.function
    def trace():
        with pytest.raises(RuntimeError):
            with wg.recording(wg.WeightGrads([], defer=True)):
                assert entry["type"] is not before
                raise RuntimeError("inside")
        return tf.constant(0)

    trace()
    assert entry["type"] is before
