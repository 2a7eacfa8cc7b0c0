"""Gradient accumulation done by the library: a step takes N batches, each replica sums
their gradients locally and applies the mean once; the same update as Keras's own
``gradient_accumulation_steps`` in one process. (Under every strategy against plain
``fit``: tests/training/test_fit_conformance.py, GRADIENT_ACCUMULATION.)"""

import numpy as np
import pytest

from conftest import REPO, refused_line
from tests.training import fit_tasks

SPEC = str(REPO / "tests" / "training" / "fit_tasks.py") + ":"


def _model(seed, accumulation=None):
    import keras

    keras.utils.set_random_seed(seed)
    x = keras.Input((fit_tasks.FEATURES,))
    h = keras.layers.Dense(16, activation="relu")(x)
    model = keras.Model(x, keras.layers.Dense(fit_tasks.CLASSES, activation="softmax")(h))
    model.compile(optimizer=keras.optimizers.Adam(
        keras.optimizers.schedules.CosineDecay(1e-2, decay_steps=10),
        gradient_accumulation_steps=accumulation, global_clipnorm=1.0),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_one_step_of_n_batches_is_kerass_accumulated_update():
    """Keras, one process: N train_on_batch calls, one update of the mean gradient.
    The library: one step over the same N batches. Same weights, same optimizer state
    (Adam's moments and bias correction, a schedule's step, clipping of the mean)."""
    import tensorflow as tf

    from tfdist.training.loop.state import without_accumulation
    from tfdist.training.loop.step import TrainMetrics, make_step_fn

    n, batch = 4, 32
    x, y, _ = fit_tasks.arrays("train")
    batches = [(tf.constant(x[i * batch:(i + 1) * batch]), tf.constant(y[i * batch:(i + 1) * batch]))
               for i in range(2 * n)]

    keras_model = _model(0, accumulation=n)
    for features, labels in batches:
        keras_model.train_on_batch(features, labels)

    ours = _model(0, accumulation=n)
    assert [w.tolist() for w in ours.get_weights()] != [
        w.tolist() for w in keras_model.get_weights()]  # trained above, not yet here
    without_accumulation(ours.optimizer)
    ours.optimizer.build(ours.trainable_variables)

    class State:
        model, optimizer = ours, ours.optimizer

    step = tf.function(make_step_fn(State, TrainMetrics(ours), accumulation=n))
    for i in range(2):
        step(*batches[i * n:(i + 1) * n])
    assert int(ours.optimizer.iterations) == int(keras_model.optimizer.iterations) == 2
    for got, want in zip(ours.get_weights(), keras_model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _plan(argv, task="mnist-cnn", **kw):
    from tfdist.cli.train import config_from_args, parse_args
    from tfdist.training.plan import resolve

    return resolve(config_from_args(parse_args(["--task", task, *argv])), [], **kw)


def test_a_step_is_n_batches_and_the_flag_wins():
    mnist = dict(train_examples=60_000, test_examples=10_000)
    one = _plan(["--global-batch-size", "100"], **mnist)
    four = _plan(["--global-batch-size", "100", "--gradient-accumulation-steps", "4"], **mnist)
    assert one.accumulation_steps == 1 and four.accumulation_steps == 4
    assert four.steps_per_epoch == 60_000 // 400 and one.steps_per_epoch == 600
    assert four.describe()["gradient_accumulation_steps"] == 4
    assert four.defining_flags()["gradient_accumulation_steps"] == 4
    # A user task's optimizer gives N unless the flag says otherwise.
    task = SPEC + "GRADIENT_ACCUMULATION"
    kw = dict(train_examples=4000, test_examples=1000)
    assert _plan(["--global-batch-size", "64"], task, task_accumulation=4,
                 **kw).steps_per_epoch == 15
    assert _plan(["--global-batch-size", "64", "--gradient-accumulation-steps", "1"], task,
                 task_accumulation=4, **kw).accumulation_steps == 1
    # A model's own train_step too: its applies are routed to the library's accumulation.
    assert _plan(["--global-batch-size", "64"], task, task_accumulation=4,
                 own_train_step=True, **kw).accumulation_steps == 4


@pytest.mark.parametrize("argv,says", [
    (["--gradient-accumulation-steps", "0"],
     "--gradient-accumulation-steps=0 is not allowed; use a whole number of batches, at least 1"),
    (["--gradient-accumulation-steps", "-3"], "--gradient-accumulation-steps=-3 is not allowed"),
])
def test_bad_accumulation_is_one_line_and_exit_2(tmp_path, capsys, argv, says):
    assert says in refused_line(argv, tmp_path, capsys)


def test_pipeline_takes_the_flag_as_n_batches_a_step(monkeypatch):
    """Under pipeline a step of N batches runs them as N x M micro-batches
    (training.pipeline.updates): the plan counts steps of N batches, as elsewhere."""
    import json

    from tfdist.cli.train import config_from_args, parse_args
    from tfdist.strategies import kinds
    from tfdist.training.plan import RunRequest, request, resolve

    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"]},
        "task": {"type": "chief", "index": 0}}))
    config = config_from_args(parse_args(["--gradient-accumulation-steps", "2",
                                          "--micro-batches", "2", "--global-batch-size", "64"]))
    run = RunRequest(config, kinds.get("pipeline"), request(config).task)
    plan = resolve(run, [], train_examples=60_000, test_examples=10_000)
    assert plan.accumulation_steps == 2 and plan.pipeline.micro_batches == 2
    assert plan.steps_per_epoch == 60_000 // (64 * 2)


def test_the_flag_trains_a_built_in_style_run_under_mirrored(tmp_path):
    """Steps count updates of N batches: examples/s and the step counts say so."""
    from tfdist.training import run
    from tfdist.training.config import TrainConfig

    results = run.run(TrainConfig(strategy="mirrored", task=SPEC + "BLOBS",
                                  model_dir=str(tmp_path), epochs=1, global_batch_size=50,
                                  gradient_accumulation_steps=2, log_every=100))
    assert results["completed_steps"] == 4000 // 100
    assert results["gradient_accumulation_steps"] == 2
    assert results["test_accuracy"] > 0.8


def test_row_sparse_gradients_stay_row_sparse_when_summed():
    """An Embedding's gradient (IndexedSlices): the mean of N keeps only the rows touched."""
    import tensorflow as tf

    from tfdist.training.loop.step import accumulate

    def one_batch(rows):
        g = tf.IndexedSlices(tf.ones([2, 3]), rows, tf.constant([10, 3], tf.int64))
        return [g, tf.ones([3])], tf.constant(1.0), tf.zeros([0])

    grads, loss, _ = tf.function(lambda: accumulate(
        one_batch, [(tf.constant([1, 2]),), (tf.constant([2, 5]),)]))()
    assert isinstance(grads[0], tf.IndexedSlices)
    dense = tf.convert_to_tensor(grads[0]).numpy()
    assert dense[2].tolist() == [1.0] * 3 and dense[1].tolist() == [0.5] * 3
    assert dense[0].tolist() == [0.0] * 3 and float(loss) == 1.0
    assert grads[1].numpy().tolist() == [1.0] * 3
