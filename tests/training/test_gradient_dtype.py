"""--gradient-dtype: gradients cross the network in 16 bits, updates stay float32.

Pure and in-process parts first (the flag's checks, the casts, Keras's update
casting back); then, marked ``multiprocess``: a real 2-worker multiworker job
on bfloat16 gradients trains logreg to within a small margin of float32, and
on simulated hosts its links carry fewer bytes per step.
"""

import json
import os

import numpy as np
import pytest

from tfdist.cli import train
from conftest import descendants_alive, launch_cmd, read_results
from tfdist.protocol import ConfigError
from tfdist.training.config import GRADIENT_DTYPES, TrainConfig


# --- the flag -------------------------------------------------------------------------------------

def test_flag_reaches_the_config_and_float32_is_the_default():
    assert train.config_from_args(train.parse_args([])).gradient_dtype == "float32"
    config = train.config_from_args(train.parse_args(["--gradient-dtype", "bfloat16"]))
    assert config.gradient_dtype == "bfloat16"
    config.validate()
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
    from tfdist.training.loop.step import to_wire

    g = [tf.constant([1.0, 1 / 3, 1e-30, -2.5e5]), None]
    same = to_wire(g, "float32")
    assert same[0] is g[0] and same[1] is None
    wire = to_wire(g, "bfloat16")
    assert wire[0].dtype == tf.bfloat16 and wire[1] is None
    back = tf.cast(wire[0], tf.float32)
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


# --- a real job ---------------------------------------------------------------------------------------

@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_multiworker_bfloat16_trains_logreg_as_well_as_float32_on_half_the_bytes(tmp_path, spawn):
    """Two workers on two simulated hosts where this machine can make them:
    the launcher's byte counters then show the all-reduce carrying 16 bits
    (and not a second, float32 one)."""
    from tfdist.launcher.machine import network

    hosts = ["--hosts", "2"] if network.hosts_problem() is None else []
    accuracy, sent = {}, {}
    for dtype in ("float32", "bfloat16"):
        model_dir = str(tmp_path / dtype)
        p = spawn(launch_cmd("multiworker", "--workers", "2", *hosts, "--timeout", "180",
                             train_args=["--model", "logreg", "--steps", "300",
                                         "--steps-per-execution", "10", "--log-every", "100",
                                         "--gradient-dtype", dtype, "--model-dir", model_dir]))
        assert p.wait(190) == 0, p.output
        r = read_results(model_dir)
        assert r["global_steps"] == 300
        accuracy[dtype] = r["test_accuracy"]
        if hosts:
            with open(os.path.join(model_dir, "launch", "outcome.json")) as f:
                record = json.load(f)["traffic"]
            sent[dtype] = sum(h["tx_bytes_per_step"] for h in record["hosts"].values())
        assert descendants_alive(model_dir) == []
    # Both learn (chance is 0.10), and 16-bit gradients cost at most half a point.
    assert accuracy["float32"] > 0.85, accuracy
    assert abs(accuracy["bfloat16"] - accuracy["float32"]) <= 0.005, accuracy
    if hosts:
        # The gradients are ~31 KB a step in float32; control traffic adds a
        # few KB either way, so half the gradient bytes shows as < 0.75.
        assert sent["bfloat16"] < 0.75 * sent["float32"], sent
