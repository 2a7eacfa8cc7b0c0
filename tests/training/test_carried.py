"""The all-reduce carried over the step boundary (``training.sync.carried``).

The plan is pure; the carried call must give the plain call's weights, loss and
metric values step for step (the same sums, the same update, every forward on
every update before it). Run in a child process: two logical CPUs (a
MirroredStrategy of two replicas) must be configured before TensorFlow starts.
"""

import subprocess
import sys

import pytest

from conftest import REPO, refused_line
from tfdist.training.sync.carried import Split, plan_split


@pytest.mark.parametrize("argv,says", [
    (["--carry-all-reduce", "maybe"], "--carry-all-reduce"),
    (["--carry-all-reduce", "on", "--strategy", "none"],
     "--carry-all-reduce applies to --strategy multiworker only"),
    (["--carry-all-reduce", "off", "--strategy", "mirrored"],
     "--carry-all-reduce applies to --strategy multiworker only"),
])
def test_a_bad_carry_flag_is_one_line_and_exit_2(tmp_path, capsys, argv, says):
    assert says in refused_line(argv, tmp_path, capsys)


@pytest.mark.parametrize("elements, bucket, expected", [
    # A CNN: two small convolutions, a large dense kernel, a small head.
    ([288, 32, 9216, 64, 100000, 128, 1280, 10], 65536, Split(first=4, early=65536)),
    # The first layer holds most of the bytes (an MLP): nothing goes first.
    ([100000, 128, 1280, 10], 65536, None),
    # The last layers fit in one bucket: nothing is left to carry.
    ([3000, 10, 5000, 10], 65536, None),
    ([3000, 10, 5000, 10], 1000, Split(first=2, early=1000)),
    ([10], 4, None),
])
def test_plan_split(elements, bucket, expected):
    assert plan_split(elements, bucket) == expected


SCRIPT = r"""
import tensorflow as tf
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np
from types import SimpleNamespace
from tfdist.training.loop.step import TrainMetrics, make_step_fn, make_train_fn
from tfdist.training.sync import carried

GRADIENT_DTYPE, ACCUMULATION = {dtype!r}, {accumulation}
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

class Unused(keras.layers.Layer):
    def build(self, shape):
        self.unused = self.add_weight(shape=(3,), initializer="ones")

    def call(self, h):
        return h


def state():
    keras.utils.set_random_seed(3)
    with strategy.scope():
        x = keras.Input((8, 8, 1))
        h = keras.layers.Conv2D(4, 3, activation="relu")(x)
        h = keras.layers.Conv2D(4, 3, activation="relu")(h)
        h = keras.layers.Flatten()(h)
        h = keras.layers.Dense(64, activation="relu")(h)
        h = Unused()(h)
        model = keras.Model(x, keras.layers.Dense(5, activation="softmax")(h))
        # AdamW: a zero gradient would still decay a weight; Keras leaves out the
        # variables no gradient reaches, and so must the carried update.
        model.compile(optimizer=keras.optimizers.AdamW(1e-2, weight_decay=0.1),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        model.optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False)
    return SimpleNamespace(model=model, optimizer=model.optimizer, global_step=step)

rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8, 8, 1)).astype("float32")
y = rng.integers(0, 5, size=512)
def batches():
    return iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(32)))

runs = {{}}
for name in ("plain", "carried"):
    s = state()
    metrics = TrainMetrics(s.model)
    split = carried.split_for(s, strategy, metrics, GRADIENT_DTYPE, 4096)
    assert isinstance(split, carried.Split) and split.first == 4, split
    if name == "plain":
        fn = make_train_fn(strategy, make_step_fn(s, metrics, GRADIENT_DTYPE, ACCUMULATION), s,
                           len(metrics.names), batches_per_step=ACCUMULATION)
        flush = lambda: None
    else:
        calls = carried.CarriedCalls(strategy, s, metrics, split, GRADIENT_DTYPE, ACCUMULATION)
        fn, flush = calls.train_fn, calls.flush
    it = batches()
    outs = []
    # Calls resumed with a pending step, and started afresh after a flush.
    for n in (3, 1, None, 2, None):
        if n is None:
            flush()
        else:
            outs.append(fn(it, tf.constant(n)))
    runs[name] = (s, outs)

(a, outs_a), (b, outs_b) = runs["plain"], runs["carried"]
assert int(b.global_step.numpy()) == 6 == int(a.global_step.numpy())
for oa, ob in zip(outs_a, outs_b):
    np.testing.assert_allclose(oa["loss"].numpy(), ob["loss"].numpy(), rtol=1e-6)
    np.testing.assert_allclose(oa["metrics"].numpy(), ob["metrics"].numpy(), rtol=1e-6)
    assert not ob["staleness"].numpy().any(), ob["staleness"]
moved = 0
for va, vb in zip(a.model.weights, b.model.weights):
    np.testing.assert_allclose(va.numpy(), vb.numpy(), rtol=1e-6, atol=1e-7, err_msg=va.path)
first = state()
for v0, vb in zip(first.model.trainable_variables, b.model.trainable_variables):
    moved += not np.allclose(v0.numpy(), vb.numpy())
assert moved == len(b.model.trainable_variables) - 1, moved  # all but Unused's
print("OK")
"""


@pytest.mark.parametrize("dtype, accumulation", [
    ("float32", 1),
    # 16-bit gradients and accumulation carried: the long tier (35 s of make test).
    pytest.param("bfloat16", 1, marks=pytest.mark.long),
    pytest.param("float32", 2, marks=pytest.mark.long)])
def test_carried_call_gives_the_plain_calls_weights(dtype, accumulation):
    script = SCRIPT.format(dtype=dtype, accumulation=accumulation)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


def _train(spawn, model_dir, *args, code=0, steps=12):
    from conftest import launch_cmd

    p = spawn(launch_cmd("multiworker", "--workers", "2", train_args=[
        "--task", "mnist-cnn", "--steps", str(steps), "--global-batch-size", "64",
        "--eval-every", "0", "--log-every", str(steps), "--model-dir", str(model_dir), *args]))
    assert p.wait(timeout=300) == code, p.output[-3000:]
    return p


@pytest.mark.multiprocess
@pytest.mark.parametrize("long_tier", [
    # Both in the long tier (CI time): every multiworker job of make test runs the
    # default (auto), and the in-process test above holds a carried call's weights
    # equal to the plain call's. Here: auto against the plain step on a cluster, and
    # --carry-all-reduce on against off bit for bit, with the refusals.
    pytest.param(False, marks=pytest.mark.long),
    pytest.param(True, marks=pytest.mark.long)])
def test_two_workers_carried_or_not_end_with_the_same_weights(tmp_path, spawn, long_tier):
    """Two workers: each element's sum is a + b however the gradients are cut, so the
    carried step and the plain one give the same weights, bit for bit, on every worker.
    The default (auto) runs both in turn (20 timed steps of each, and the switches)
    before it keeps one, the same on both workers: the same update, though an update
    applied by a flush is compiled in another graph and may round differently."""
    import re

    from conftest import read_results

    hashes = {}
    for carry in ("on", "off", "auto"):
        if carry == "on" and not long_tier:
            continue
        p = _train(spawn, tmp_path / carry, *(["--carry-all-reduce", carry] if carry != "auto"
                                              else []), steps=56)
        found = set(re.findall(r"weights_sha256=([0-9a-f]{64})", p.output))
        assert len(found) == 1, p.output[-3000:]  # both workers agree
        results = read_results(tmp_path / carry)
        hashes[carry] = results["weights_sha256"]
        trial = results["carry_trial"]
        if carry == "auto":
            assert trial["steps_each"] == 20 and trial["plain_ms"] > 0 and trial["carried_ms"] > 0
            assert results["all_reduce_carried"] is trial["carried"]
            assert p.output.count("(--carry-all-reduce auto: carried") == 1  # the chief's line
        else:
            assert trial is None and results["all_reduce_carried"] is (carry == "on")
    assert read_results(tmp_path / "auto")["test_loss"] == pytest.approx(
        read_results(tmp_path / "off")["test_loss"], abs=1e-3)
    if not long_tier:
        # make test: the default (auto) against the plain step; the carried call's
        # weights against the plain call's are checked in one process above.
        return
    assert hashes["on"] == hashes["off"]
    # A model whose first layer holds most of the bytes (one Dense) cannot be cut: asked
    # for, that is one line and exit 2 on every worker, before any step; by default it
    # trains with the plain step.
    p = _train(spawn, tmp_path / "logreg", "--task", "mnist-logreg", "--carry-all-reduce", "on",
               code=2)
    assert "--carry-all-reduce on cannot be honoured: its first layers hold" in p.output
    assert not (tmp_path / "logreg" / "results.json").exists()
    _train(spawn, tmp_path / "logreg-auto", "--task", "mnist-logreg")
    results = read_results(tmp_path / "logreg-auto")
    assert results["all_reduce_carried"] is False and results["carry_trial"] is None
    # 16-bit gradients: the carried step's kept copy is created (and broadcast) as
    # every worker starts, which MultiWorkerMirroredStrategy cannot do in bfloat16.
    _train(spawn, tmp_path / "bf16", "--gradient-dtype", "bfloat16")
    assert read_results(tmp_path / "bf16")["global_steps"] == 12
