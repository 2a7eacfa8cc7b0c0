"""--gradient-dtype: gradients cross the network in 16 bits, updates stay float32.

Pure and in-process parts first (the flag's checks, the casts, Keras's update
casting back); then, marked ``multiprocess``: the collective a multiworker
step traces carries bfloat16 (a child process with two logical CPUs), and a
real 2-worker multiworker job on bfloat16 gradients trains logreg to within
a small margin of float32.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import train
from conftest import REPO, child_env, descendants_alive, launch_cmd, read_results
from protocol import ConfigError
from training.config import GRADIENT_DTYPES, TrainConfig


# --- the flag -------------------------------------------------------------------------------------

def test_flag_reaches_the_config_and_float32_is_the_default():
    assert train.config_from_args(train.parse_args([])).gradient_dtype == "float32"
    cfg = train.config_from_args(train.parse_args(["--gradient-dtype", "bfloat16"]))
    assert cfg.gradient_dtype == "bfloat16"
    cfg.validate()
    assert GRADIENT_DTYPES == ("float32", "bfloat16", "float16")


@pytest.mark.parametrize("dtype,words", [
    ("float16", ["--gradient-dtype float16", "loss scaling", "use bfloat16"]),
    ("int8", ["unknown --gradient-dtype 'int8'", "float32, bfloat16, float16"]),
])
def test_refused_dtypes_are_one_line_exit_2_nothing_written(dtype, words, tmp_path, capsys,
                                                           monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ConfigError) as err:
        TrainConfig(gradient_dtype=dtype).validate()
    for w in words:
        assert w in str(err.value)
    target = tmp_path / "m"
    assert train.main(["--gradient-dtype", dtype, "--model-dir", str(target), "--dry-run"]) == 2
    errors = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and words[0] in errors[0]
    assert not target.exists()


# --- the casts --------------------------------------------------------------------------------------

def test_to_wire_casts_and_keeps_none_float32_untouched():
    import tensorflow as tf
    from training.step import from_wire, to_wire

    g = [tf.constant([1.0, 1 / 3, 1e-30, -2.5e5]), None]
    same = to_wire(g, "float32")
    assert same[0] is g[0] and same[1] is None
    wire = to_wire(g, "bfloat16")
    assert wire[0].dtype == tf.bfloat16 and wire[1] is None
    back = from_wire(wire)[0]
    assert back.dtype == tf.float32
    # bfloat16: 8 bits of mantissa (relative error <= 2^-8), float32's range (1e-30 survives).
    np.testing.assert_allclose(back.numpy(), g[0].numpy(), rtol=2**-8)
    assert back.numpy()[2] > 0
    assert to_wire(g, "float16")[0].dtype == tf.float16


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_keras_applies_a_16_bit_gradient_in_float32(optimizer):
    """The update casts the gradient back to the variable's dtype: the same
    update as a float32 gradient holding the same (rounded) values."""
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(5, 3)).astype("float32")
    g = tf.constant(rng.normal(size=(5, 3)).astype("float32"))
    g16 = tf.cast(g, tf.bfloat16)
    results = []
    for grad in (g16, tf.cast(g16, tf.float32)):
        v = keras.Variable(w0)
        opt = keras.optimizers.get(optimizer)
        opt.apply_gradients([(grad, v)])
        opt.apply_gradients([(grad, v)])
        results.append(v)
    assert results[0].dtype == "float32"
    np.testing.assert_array_equal(np.asarray(results[0]), np.asarray(results[1]))
    assert not np.array_equal(np.asarray(results[0]), w0)


# --- the collective carries 16 bits (a child process: it needs 2 logical CPUs) -------------------------

COLLECTIVE_DTYPES = r"""
import json, sys, types
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from training.step import make_step_fn, TrainMetrics

strategy = tf.distribute.MultiWorkerMirroredStrategy(
    tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec({}),
                                                         num_accelerators={"CPU": 2}))
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    opt = model.optimizer
    opt.build(model.trainable_variables)
state = types.SimpleNamespace(model=model, optimizer=opt)  # what a step reads of a TrainState
step = make_step_fn(state, TrainMetrics(model), sys.argv[1])

@tf.function
def run(x, y):
    return strategy.run(step, args=(x, y))

x, y = tf.ones([8, 4]), tf.zeros([8, 3])
graph = run.get_concrete_function(x, y).graph
found = []
def walk(g):
    for op in g.get_operations():
        if op.type.startswith("Collective"):
            found.append([op.type, op.get_attr("T").name])
    for f in g._functions.values():
        walk(f.graph)
walk(graph)
print(json.dumps(found))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_multiworker_all_reduce_carries_the_wire_dtype(dtype):
    proc = subprocess.run([sys.executable, "-c", COLLECTIVE_DTYPES, dtype], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    reduces = [t for op, t in found if "Reduce" in op]
    assert reduces, found
    assert set(reduces) == {dtype}, found


# --- a real job ---------------------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_multiworker_bfloat16_trains_logreg_as_well_as_float32(tmp_path, spawn):
    accuracy = {}
    for dtype in ("float32", "bfloat16"):
        model_dir = str(tmp_path / dtype)
        p = spawn(launch_cmd("multiworker", "--workers", "2", "--timeout", "180",
                             train_args=["--model", "logreg", "--steps", "300",
                                         "--steps-per-execution", "10", "--log-every", "100",
                                         "--gradient-dtype", dtype, "--model-dir", model_dir]))
        assert p.wait(190) == 0, p.output
        r = read_results(model_dir)
        assert r["global_steps"] == 300
        accuracy[dtype] = r["test_accuracy"]
        assert descendants_alive(model_dir) == []
    # Both learn (chance is 0.10), and 16-bit gradients cost at most half a point.
    assert accuracy["float32"] > 0.85, accuracy
    assert abs(accuracy["bfloat16"] - accuracy["float32"]) <= 0.005, accuracy
