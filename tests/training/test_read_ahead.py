"""--read-ahead (ps): each step computes on weights read during the step before it."""

import numpy as np
import pytest

from conftest import REPO, launch_cmd, read_results, refused_line

SPEC = str(REPO / "tests" / "training" / "fit_tasks.py") + ":"


def _model(seed):
    """Every kind of state the plain step touches: trainable weights, batch-norm
    statistics (non-trainable, assigned in the forward pass), a dropout's seed and
    a regularization loss."""
    import keras

    keras.utils.set_random_seed(seed)
    x = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu",
                           kernel_regularizer=keras.regularizers.L2(1e-2))(x)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.3, seed=seed)(h)
    model = keras.Model(x, keras.layers.Dense(3, activation="softmax")(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("accumulation", [1, 3])
def test_a_step_on_weights_read_now_is_the_plain_step(accumulation):
    """Handed the weights as they are, the read-ahead step makes the plain step's
    update: the same weights, batch-norm statistics and optimizer state after it; so
    does ps's step of N batches on one read of the weights."""
    import tensorflow as tf

    from tfdist.training.loop.step import TrainMetrics, make_step_fn
    from tfdist.training.ps.read_ahead import (make_read_ahead_step_fn, make_read_once_step_fn,
                                               read_weights)

    rng = np.random.default_rng(0)
    batches = [(tf.constant(rng.normal(size=(16, 8)).astype("float32")),
                tf.constant(rng.integers(0, 3, size=16))) for _ in range(3 * accumulation)]
    models = []
    makers = [make_step_fn, make_read_ahead_step_fn]
    if accumulation > 1:  # ps's step of N batches on one read of the weights
        makers.append(make_read_once_step_fn)
    for make in makers:
        model = _model(0)
        model.optimizer.build(model.trainable_variables)

        class State:
            pass

        State.model, State.optimizer = model, model.optimizer
        step = make(State, TrainMetrics(model), accumulation=accumulation)
        if make is make_read_ahead_step_fn:
            fn = tf.function(lambda *b, step=step, m=model: step(
                read_weights(m.trainable_variables), *b))
        else:
            fn = tf.function(step)
        for i in range(3):
            if accumulation == 1:  # a step takes the batch's elements
                fn(*batches[i])
            else:  # a step takes N batches
                fn(*batches[i * accumulation:(i + 1) * accumulation])
        models.append(model)
    plain, *others = models
    assert plain.get_weights()[0].tolist() != _model(0).get_weights()[0].tolist()  # trained
    for ahead in others:
        assert int(plain.optimizer.iterations) == int(ahead.optimizer.iterations) == 3
        for got, want in zip(ahead.weights, plain.weights):  # moving mean/var and seeds too
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=got.path)
        for got, want in zip(ahead.optimizer.variables, plain.optimizer.variables):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("argv,says", [
    (["--read-ahead", "on", "--strategy", "multiworker"],
     "--read-ahead on applies to --strategy ps only"),
    (["--read-ahead", "off", "--strategy", "ps-sync"],
     "--read-ahead off applies to --strategy ps only"),
    (["--read-ahead", "on", "--strategy", "ps", "--steps-per-execution", "4",
      "--task", SPEC + "FLIPPED_TRAIN_STEP"], "the model overrides train_step"),
    (["--read-ahead", "maybe", "--strategy", "ps"], "unknown --read-ahead 'maybe'; allowed: on, off"),
])
def test_read_ahead_where_it_cannot_be_honoured_is_one_line_and_exit_2(tmp_path, capsys, argv,
                                                                         says, monkeypatch):
    import json

    if "multiworker" not in argv:  # the chief of a ps cluster plans the run
        monkeypatch.setenv("TF_CONFIG", json.dumps({
            "cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"],
                        "ps": ["localhost:3"]}, "task": {"type": "chief", "index": 0}}))
    assert says in refused_line(argv, tmp_path, capsys)


@pytest.mark.multiprocess
@pytest.mark.long
def test_one_worker_reads_ahead_so_each_step_is_one_update_stale(tmp_path, spawn):
    """One worker, 2 calls of 10 steps: the first step computes on the weights read
    as the call starts (0 stale); every other step on weights read before this
    worker's previous update (exactly 1), the second call's first step on those the
    first call's last step read ahead and left on the worker. Without read-ahead
    every step would be 0 stale, so the histogram says whether the weights were read
    ahead, within a call and across calls."""
    model_dir = tmp_path / "run"
    p = spawn(launch_cmd("ps", "--workers", "1", "--ps", "1", train_args=[
        "--task", "mnist-logreg", "--steps", "20", "--steps-per-execution", "10",
        "--read-ahead", "on", "--log-every", "10", "--model-dir", str(model_dir)]))
    assert p.wait(timeout=300) == 0, p.output[-3000:]
    results = read_results(model_dir)
    assert results["read_ahead"] is True
    assert results["staleness"]["histogram"] == {"0": 1, "1": 19}, results["staleness"]
    assert results["global_steps"] == 20 and results["test_accuracy"] > 0.5  # chance: 0.1


@pytest.mark.multiprocess
@pytest.mark.long
def test_a_restarted_worker_starts_from_the_ps_not_from_an_empty_copy(tmp_path, spawn):
    """A worker killed and restarted has new, empty copies of the weights it read
    ahead: its first call reads from the ps (a second 0-stale step) instead of
    computing on zeros, and the run ends as accurate as without the fault."""
    model_dir = tmp_path / "run"
    p = spawn(launch_cmd("ps", "--workers", "1", "--ps", "1", "--kill", "worker:0@step=100",
                         "--restart-tasks", "--restart-delay", "1", train_args=[
                             "--task", "mnist-cnn", "--steps", "300", "--global-batch-size",
                             "128", "--steps-per-execution", "10", "--read-ahead", "on",
                             "--log-every", "50", "--model-dir", str(model_dir)]))
    assert p.wait(timeout=400) == 0, p.output[-3000:]
    assert "restarted worker:0" in p.output
    results = read_results(model_dir)
    histogram = results["staleness"]["histogram"]
    assert histogram["0"] == 2 and set(histogram) == {"0", "1"}, results["staleness"]
    assert results["test_accuracy"] > 0.95
