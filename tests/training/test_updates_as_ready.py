"""Each variable's update may start once its own gradient exists (``loop.step.updates_as_ready``).

Keras's optimizer sums gradients over the replicas in sync through an all-reduce whose
``tf.custom_gradient`` groups every gradient in one IdentityN; with one replica in sync
the library leaves that sum out: the update must not wait on the whole backward pass,
and must be the same update, bit for bit.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from tests.training import fit_tasks


def _model(seed, loss_scale=False):
    import keras

    keras.utils.set_random_seed(seed)
    x = keras.Input((fit_tasks.FEATURES,))
    h = keras.layers.Dense(16, activation="relu")(x)
    model = keras.Model(x, keras.layers.Dense(fit_tasks.CLASSES, activation="softmax")(h))
    optimizer = keras.optimizers.Adam(1e-2)
    if loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.optimizer.build(model.trainable_variables)
    return model


def _batches(n=3, batch=32):
    import tensorflow as tf

    x, y, _ = fit_tasks.arrays("train")
    return [(tf.constant(x[i * batch:(i + 1) * batch]), tf.constant(y[i * batch:(i + 1) * batch]))
            for i in range(n)]


def _step(model):
    import tensorflow as tf

    from tfdist.training.loop.step import TrainMetrics, make_step_fn

    state = SimpleNamespace(model=model, optimizer=model.optimizer)
    return tf.function(make_step_fn(state, TrainMetrics(model)))


def test_no_update_waits_on_every_gradient():
    model = _model(0)
    features, labels = _batches(1)[0]
    graph = _step(model).get_concrete_function(features, labels).graph
    ops = [op.type for op in graph.get_operations()]
    assert "ResourceApplyAdam" in ops or "AssignVariableOp" in ops or "AssignSubVariableOp" in ops
    assert "IdentityN" not in ops, [op.name for op in graph.get_operations()
                                    if op.type == "IdentityN"]
    # The hook is put back: Keras's own sum is there for the next caller.
    assert "_all_reduce_sum_gradients" not in vars(model.optimizer)


@pytest.mark.parametrize("loss_scale", [False, True])
def test_the_same_update_as_kerass_apply_gradients(loss_scale):
    import tensorflow as tf

    ours, theirs = _model(1, loss_scale), _model(1, loss_scale)
    step = _step(ours)

    @tf.function
    def keras_step(features, labels):
        with tf.GradientTape() as tape:
            loss = theirs.compute_loss(x=features, y=labels, y_pred=theirs(features, training=True))
            scaled = theirs.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, theirs.trainable_variables)
        theirs.optimizer.apply_gradients(zip(grads, theirs.trainable_variables))

    for features, labels in _batches():
        step(features, labels)
        keras_step(features, labels)
    assert int(ours.optimizer.iterations) == int(theirs.optimizer.iterations) == 3
    for got, want in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_array_equal(got, want)
