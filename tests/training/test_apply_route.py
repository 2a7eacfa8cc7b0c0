"""One route for ``optimizer.apply`` (``workload.apply_route``): a model's own
``train_step`` applies its gradients through the library's gradient path.

Run in a child process where it needs two replicas: two logical CPUs (a
MirroredStrategy of two replicas, whose all-reduce is real) must be configured
before TensorFlow starts.
"""

import subprocess
import sys

import pytest

from conftest import REPO, launch_cmd, read_results

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


# --- the applies a step makes, seen when the task is checked ---------------------------


def test_the_applies_of_one_step_are_recorded_in_order_and_the_optimizers_restored():
    """The GAN's train_step applies d_optimizer to the discriminator, then g_optimizer to
    the generator: ps-sync makes one K-of-N average of each, in that order. The guide's
    first example applies the model's optimizer to every variable, once."""
    from tfdist.training.workload import tasks

    def checked(name):
        spec = tasks.parse_spec(str(REPO / "tests" / "training" / "guide_tasks.py") + ":" + name)
        return tasks.inspect(spec, tasks.load(spec), steps_given=False)

    gan = checked("GAN")
    model, variables = gan.local_model, gan.local_model.trainable_variables
    assert [attr for attr, _ in gan.own_applies] == ["d_optimizer", "g_optimizer"]
    ids = [[id(variables[p]) for p in positions] for _, positions in gan.own_applies]
    assert ids == [[id(v) for v in model.discriminator.trainable_variables],
                   [id(v) for v in model.generator.trainable_variables]]
    # The route is closed: the optimizers apply as Keras's own again.
    assert all("apply" not in vars(o) for o in (model.d_optimizer, model.g_optimizer))
    first = checked("FIRST")
    assert first.own_applies == (("optimizer", tuple(range(4))),)
    assert checked("DISTILLATION").own_applies == ()  # Keras's train_step: the library's


# --- a LossScaleOptimizer under ps-sync -------------------------------------------------


def test_ps_sync_scales_the_workers_gradients_by_the_steps_scale_and_unscales_their_mean():
    """A worker's gradient is the loss scaled by the LossScaleOptimizer's current scale
    (read after the step's token, so the K gradients of an update share it); ps:0's
    apply of the same optimizer (Keras's own) divides their mean by it, and skips an
    update that is not finite, halving the scale, as fit's does."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tests.training import fit_tasks
    from tfdist.training.loop.step import TrainMetrics, forward
    from tfdist.training.ps.ps_sync_trainer import replica_gradient_fn
    from tfdist.training.workload.apply_route import original_apply

    keras.utils.set_random_seed(0)
    model = fit_tasks.LOSS_SCALED.build_model()
    opt = model.optimizer
    opt.build(model.trainable_variables)
    variables = model.trainable_variables
    x, y, _ = fit_tasks.arrays("train")
    gradient = tf.function(replica_gradient_fn(model, opt, TrainMetrics(model), 1))
    flats = [gradient(tf.constant(0, tf.int64), x[i:i + 32], y[i:i + 32])[0]
             for i in (0, 32)]
    with tf.GradientTape() as tape:
        _, loss = forward(model, x[:32], y[:32])
    plain = tf.concat([tf.reshape(g, [-1]) for g in tape.gradient(loss, variables)], 0)
    scale = float(opt.dynamic_scale.numpy())
    assert scale == 2.0 ** 15
    np.testing.assert_allclose(flats[0].numpy() / scale, plain.numpy(), rtol=2e-2, atol=1e-6)

    def unflat(flat):
        sizes = [int(np.prod(v.shape)) for v in variables]
        return [tf.reshape(p, v.shape) for p, v in zip(tf.split(flat, sizes), variables)]

    # ps:0: the mean of the two, applied with the LossScaleOptimizer.
    before = [v.numpy().copy() for v in variables]
    mean = (flats[0] + flats[1]) / 2
    inner = keras.optimizers.Adam(1e-2)  # what the update must be: Adam on the unscaled mean
    twins = [tf.Variable(b) for b in before]
    inner.build(twins)
    inner.apply(unflat(mean / scale), twins)
    original_apply(opt, unflat(mean), variables)
    for v, t in zip(variables, twins):
        np.testing.assert_allclose(v.numpy(), t.numpy(), rtol=1e-5, atol=1e-6)
    assert int(opt.inner_optimizer.iterations.numpy()) == 1
    # A mean that is not finite: no update, the scale halved.
    after_one = [v.numpy().copy() for v in variables]
    original_apply(opt, unflat(mean * np.float32("inf")), variables)
    assert all(np.array_equal(v.numpy(), a) for v, a in zip(variables, after_one))
    assert float(opt.dynamic_scale.numpy()) == scale / 2
    assert int(opt.inner_optimizer.iterations.numpy()) == 1


# --- under ps-sync, in 16 bits ---------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.long
def test_a_models_own_step_under_ps_sync_queues_16_bit_gradients(tmp_path, spawn):
    """The flipped-labels train_step under ps-sync with --gradient-dtype bfloat16: each
    worker queues its apply's gradient on ps:0 in 16 bits, ps:0 averages K = 2 of them
    in float32: the labels it learns are the flipped ones, as fit's (test accuracy
    within the tolerance of fit's 0.339; the library's own step would give 0.97)."""
    from tests.training import fit_tasks

    p = spawn(launch_cmd("ps-sync", "--workers", "2", "--ps", "1", train_args=[
        "--task", str(REPO / "tests" / "training" / "fit_tasks.py") + ":FLIPPED_TRAIN_STEP",
        "--epochs", "2", "--global-batch-size", "64", "--gradient-dtype", "bfloat16",
        "--log-every", "60", "--model-dir", str(tmp_path)]))
    assert p.wait(timeout=300) == 0, p.output
    results = read_results(tmp_path)
    want = fit_tasks.plain_fit(fit_tasks.FLIPPED_TRAIN_STEP, epochs=2, batch_size=64)
    assert abs(results["test_metrics"]["accuracy"] - want["accuracy"]) <= 0.04, (results, want)
    # One apply a step: K = 2 gradients (one per worker) averaged per update.
    assert results["aggregated_gradients"] == 2 * results["applied_steps"] == 248
