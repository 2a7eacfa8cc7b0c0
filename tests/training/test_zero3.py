"""--shard-state weights (training.sync.zero3) in one process: what it refuses, and, with
one worker (collectives of a group of one), that its layer-by-layer step gives the plain
gradient in the shard's layout and that the model's variables are released and gathered
back. The cluster cases (two and three workers) are tests/integration/test_sharded_state.py."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.protocol import ConfigError
from tfdist.training.loop.step import TrainMetrics
from tfdist.training.sync import zero3


def chain(width=24, **dense):
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(width, activation="relu",
                                                                   **dense),
                             keras.layers.Dense(3)])


def compiled(model, **opt):
    model.compile(optimizer=keras.optimizers.Adam(1e-2, **opt),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def functional():
    x = keras.Input((6,))
    return keras.Model(x, keras.layers.Dense(3)(x))


@pytest.mark.parametrize("make, accumulation, words", [
    (lambda: compiled(functional()), 1, "keras.Sequential"),
    (lambda: compiled(keras.Sequential([keras.Input((6,)), keras.layers.BatchNormalization()])),
     1, "keeps state"),
    (lambda: compiled(chain(kernel_regularizer="l2")), 1, "regularizer"),
    (lambda: compiled(chain(), global_clipnorm=1.0), 1, "global_clipnorm"),
    (lambda: compiled(chain(), clipnorm=1.0), 2, "accumulation"),
])
def test_what_it_cannot_run_is_refused_with_the_reason(make, accumulation, words):
    model = make()
    why = zero3.refusal(model, model.optimizer, model.trainable_variables, accumulation)
    assert why is not None and words in why


def test_a_chain_with_clipnorm_and_accumulation_one_is_accepted():
    model = compiled(chain(), clipnorm=1.0)
    assert zero3.refusal(model, model.optimizer, model.trainable_variables, 1) is None


def one_worker_state():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = compiled(chain())
    # 24-element buckets: the 6 x 24 kernel is cut into blocks of rows.
    state = zero3.WeightShardedState(strategy, model.optimizer, model.trainable_variables, 0,
                                     96, model, 1)
    return strategy, model, state


def test_one_worker_step_gives_the_plain_gradient_in_the_shards_layout():
    strategy, model, state = one_worker_state()
    state.start()
    metrics = TrainMetrics(model)
    one_batch = state._one_batch(metrics, "float32")
    x = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
    y = np.arange(8) % 3

    @tf.function
    def both():
        def replica():
            (grad,), loss, _ = one_batch(tf.constant(x), tf.constant(y))
            with tf.GradientTape() as tape:
                plain_loss = model.compute_loss(x, y, model(x, training=True))
            return grad, loss, plain_loss, tape.gradient(plain_loss, model.trainable_variables)
        return strategy.run(replica)

    grad, loss, plain_loss, plain = both()
    assert len(state.layout.buckets) > len(state.groups)  # the kernel was cut
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
    expected = np.zeros(state.layout.shard_size, np.float32)
    for p in state.layout.pieces(0):
        expected[p.at:p.at + p.length] = np.reshape(plain[p.var], [-1])[p.start:p.stop]
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


def test_the_model_variables_are_released_and_gathered_back_whole():
    strategy, model, state = one_worker_state()
    state.start()
    before = [v.numpy() for v in model.trainable_variables]

    @tf.function
    def release():
        state._release()

    @tf.function
    def gather():
        state._gather_into_model()

    release()
    sizes = [int(tf.size(tf.raw_ops.ReadVariableOp(resource=zero3.zero._local_copy(v).handle,
                                                    dtype=tf.float32)))
             for v in model.trainable_variables]
    assert sizes == [0] * len(before)
    gather()
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
