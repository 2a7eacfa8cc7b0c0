"""One route for ``optimizer.apply`` (``workload.apply_route``): a model's own
``train_step`` applies its gradients through the library's gradient path.

Run in a child process where it needs two replicas: two logical CPUs (a
MirroredStrategy of two replicas, whose all-reduce is real) must be configured
before TensorFlow starts.
"""

import subprocess
import sys

from conftest import REPO

SCRIPT = r"""
import tensorflow as tf
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np
from types import SimpleNamespace
from tfdist.training.loop.step import TrainMetrics, make_step_fn, make_train_fn

rng = np.random.default_rng(0)
X = rng.normal(size=(192, 8)).astype("float32")
Y = rng.integers(0, 3, size=192)


class Own(keras.Model):
    # The guide's first example: its own step, Keras's apply.
    def train_step(self, data):
        x, y = data[:2]  # train_on_batch hands (x, y, None)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        for m in self.metrics:
            m.update_state(loss) if m.name == "loss" else m.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def model(accumulation):
    accumulation = accumulation if accumulation > 1 else None  # Keras takes 2 or more
    keras.utils.set_random_seed(3)
    x = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(x)
    m = Own(x, keras.layers.Dense(3, activation="softmax")(h))
    m.compile(optimizer=keras.optimizers.Adam(1e-2, gradient_accumulation_steps=accumulation),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


def keras_alone(accumulation):
    # Keras's own train_step loop on one device: its accumulation (tf.cond) included.
    m = model(accumulation)
    for i in range(0, 192, 32):
        m.train_on_batch(X[i:i + 32], Y[i:i + 32])
    return [v.numpy() for v in m.trainable_variables]


# One strategy for every run: its collectives' keys are unique within it.
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def library(accumulation, dtype):
    with strategy.scope():
        m = model(accumulation)
        m.optimizer.gradient_accumulation_steps = None  # as loop.state: the library's
        m.optimizer.build(m.trainable_variables)
        # The metrics' variables made now, not inside the traced step.
        m.compute_metrics(X[:2], Y[:2], m(X[:2]))
        m.compute_loss(y=Y[:2], y_pred=m(X[:2]))
        m.reset_metrics()
        step = tf.Variable(0, dtype=tf.int64, trainable=False)
    state = SimpleNamespace(model=m, optimizer=m.optimizer, global_step=step)
    metrics = TrainMetrics(m, ("accuracy", "loss"))
    fn = make_train_fn(strategy, make_step_fn(state, metrics, dtype, accumulation), state,
                       len(metrics.names), batches_per_step=accumulation)
    it = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((X, Y)).batch(32)))
    out = fn(it, tf.constant(6 // accumulation))
    assert strategy.num_replicas_in_sync == 2
    assert int(m.optimizer.iterations.numpy()) == 6 // accumulation  # updates, as Keras counts
    return [v.numpy() for v in m.trainable_variables], float(out["loss"])


def gap(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


want = keras_alone(2)
got, loss = library(2, "float32")
assert np.isfinite(loss) and loss > 0, loss
# Keras's accumulation (2 batches, one update) by the library's, on two replicas.
assert gap(got, want) < 1e-5, gap(got, want)
assert gap(got, keras_alone(1)) > 1e-3  # accumulating is not the same as not
plain, _ = library(1, "float32")
assert gap(plain, keras_alone(1)) < 1e-5, gap(plain, keras_alone(1))
half, _ = library(1, "bfloat16")
# bfloat16 gradients in the all-reduce: close to float32's update, and not the same.
assert 0 < gap(half, plain) < 0.05, gap(half, plain)
print("OK", gap(got, want), gap(half, plain))
"""


def test_a_models_own_step_accumulates_and_all_reduces_16_bits_through_the_route():
    """Two replicas (MirroredStrategy on two logical CPUs): the guide's own train_step
    with gradient_accumulation_steps=2 ends 3 updates with the weights Keras's own
    accumulating optimizer gives on one device (1e-5), and with --gradient-dtype
    bfloat16 close to (not equal to) float32's."""
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
