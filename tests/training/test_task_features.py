"""Model features a task may use, under every strategy (the example task and a regression).

The example task (``examples/custom_task.py``) has a dict of two inputs
(float and integer), ``BatchNormalization``, ``Dropout``, an ``Embedding``
and a ``from_logits`` loss, and a test split that does not divide the batch;
``sample_tasks.REGRESSION`` has an MSE loss and an MAE metric.
"""

import json
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, launch_cmd, read_results, tensorboard_tags

EXAMPLE = str(REPO / "examples" / "custom_task.py")
REGRESSION = str(REPO / "tests" / "training" / "sample_tasks.py") + ":REGRESSION"
STATED = 0.90  # examples/custom_task.py's STATED_ACCURACY
# The regression's noise has an MAE of 0.08; an untrained model's is about 1.4.
MAE_BOUND = 0.3


def _load_example():
    from tfdist.training.workload import tasks

    spec = tasks.parse_spec(EXAMPLE)
    return tasks.load(spec), spec


def test_the_example_states_what_the_tests_check():
    task, _ = _load_example()
    assert task.STATED_ACCURACY == STATED
    assert task.SIZES["test"] % 64  # a last partial batch


def test_embedding_gradients_stay_sparse_and_dropout_is_training_only():
    from tfdist.training.loop.step import forward

    task, _ = _load_example()
    model = task.build_model()
    features, labels = next(iter(task.dataset("train").batch(32)))
    with tf.GradientTape() as tape:
        _, loss = forward(model, features, labels)
    grads = dict(zip([v.path for v in model.trainable_variables],
                     tape.gradient(loss, model.trainable_variables)))
    embedding = [p for p in grads if "embedding" in p]
    assert embedding and all(isinstance(grads[p], tf.IndexedSlices) for p in embedding)
    assert not any(isinstance(g, tf.IndexedSlices) for p, g in grads.items() if p not in embedding)
    a, b = (model(features, training=True).numpy() for _ in range(2))
    assert not np.allclose(a, b)  # dropout draws a new mask
    c, d = (model(features, training=False).numpy() for _ in range(2))
    np.testing.assert_array_equal(c, d)


def _check_example(results, model_dir):
    assert results["task"] == EXAMPLE and results["test_examples"] == 4000
    assert results["test_metrics"]["accuracy"] >= STATED
    assert results["test_accuracy"] == results["test_metrics"]["accuracy"]
    # BatchNormalization's moving statistics were updated in training and saved.
    model = keras.saving.load_model(f"{model_dir}/model.keras")
    bn = next(l for l in model.layers if isinstance(l, keras.layers.BatchNormalization))
    assert np.abs(bn.moving_mean.numpy()).max() > 0.01
    assert not np.allclose(bn.moving_variance.numpy(), 1.0)
    # The test split measured exactly once: Keras's own evaluate of the saved
    # model on it gives the recorded figures (dropout off, BN in inference).
    from tfdist.training.workload import tasks

    task = tasks.load(tasks.parse_spec(EXAMPLE))
    again = model.evaluate(task.dataset("test").batch(999), verbose=0, return_dict=True)
    assert again["accuracy"] == pytest.approx(results["test_metrics"]["accuracy"], abs=1e-6)
    assert again["loss"] == pytest.approx(results["test_loss"], rel=1e-4)


def _check_regression(results):
    assert set(results["test_metrics"]) == {"mae"} and results["test_accuracy"] is None
    assert results["test_metrics"]["mae"] < MAE_BOUND
    assert results["test_examples"] == 1001


@pytest.mark.parametrize("strategy", ["none", "mirrored"])
def test_one_process_strategies_train_the_example_and_the_regression(tmp_path, strategy):
    from tfdist.cli import train

    r = train.run(_config(strategy, EXAMPLE, tmp_path / "example", epochs=1))
    _check_example(r, tmp_path / "example")
    r = train.run(_config(strategy, REGRESSION, tmp_path / "regression", steps=300))
    _check_regression(r)


def _config(strategy, task, model_dir, **kw):
    from tfdist.training.config import TrainConfig

    return TrainConfig(strategy=strategy, task=task, model_dir=str(model_dir),
                       **{"log_every": 100, **kw})


def test_fit_runs_a_task_object_in_process(tmp_path):
    import tfdist
    from tests.training.sample_tasks import Regression

    r = tfdist.fit(Regression(), strategy="none",
                   options=tfdist.TrainOptions(steps=300, model_dir=str(tmp_path / "r")))
    _check_regression(r.record)
    assert r.record["task"] == "Regression" and r.global_step == 300
    with pytest.raises(tfdist.TfdistError, match="needs a cluster") as refused:
        tfdist.fit(Regression(), strategy="multiworker", options=tfdist.TrainOptions(steps=1))
    assert refused.value.exit_code == 2


CLUSTERS = {
    "multiworker": ["--workers", "2"],
    "ps": ["--workers", "2", "--ps", "1"],
    "ps-sync": ["--workers", "2", "--ps", "1"],
}


@pytest.mark.multiprocess
# All under the long tier (`make test-long`): in `make test`, a user's task under
# multiworker is the fit conformance's and the callbacks' cluster test.
@pytest.mark.parametrize("strategy", [pytest.param(s, marks=pytest.mark.long)
                                      for s in ("multiworker", "ps", "ps-sync")])
def test_cluster_strategies_train_the_example(tmp_path, spawn, strategy):
    example = tmp_path / "example"
    p = spawn(launch_cmd(strategy, *CLUSTERS[strategy],
                         train_args=["--task", EXAMPLE, "--epochs", "1", "--model-dir", str(example)]))
    assert p.wait(timeout=240) == 0, p.output
    r = read_results(example)
    _check_example(r, example)
    if strategy == "multiworker":
        # Identical weights on both workers, BatchNormalization's statistics included.
        hashes = set(re.findall(r"weights_sha256=([0-9a-f]{64})", p.output))
        assert hashes == {r["weights_sha256"]}


# The long tier: make test trains the regression task in one process
# (test_one_process_strategies_train_the_example_and_the_regression) and a
# user's task on a cluster (the example, above) (CI time).
@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.parametrize("strategy", list(CLUSTERS))
def test_cluster_strategies_train_the_regression(tmp_path, spawn, strategy):
    regression = tmp_path / "regression"
    p = spawn(launch_cmd(strategy, *CLUSTERS[strategy],
                         train_args=["--task", REGRESSION, "--steps", "300",
                                     "--model-dir", str(regression)]))
    assert p.wait(timeout=240) == 0, p.output
    _check_regression(read_results(regression))


def test_a_users_optimizer_is_kept_unless_a_flag_overrides_it_with_a_line(tmp_path, capsys):
    """And every compiled metric reaches the progress lines, events and TensorBoard."""
    from tfdist.cli import train

    own = train.run(_config("none", REGRESSION, tmp_path / "own", steps=120, eval_every=60,
                            log_every=60))
    out = capsys.readouterr().out
    assert "instead of the optimizer it compiled" not in out
    assert own["optimizer"] == "adam" and own["learning_rate"] == pytest.approx(1e-2)
    assert own["lr_schedule"] == "task's own"
    progress = [l for l in out.splitlines() if l.startswith("step 60/120")]
    assert progress and " mae " in progress[0] and " loss " in progress[0]
    assert re.search(r"eval step 60 test_mae [0-9.]+ test_loss", out)
    assert [p["step"] for p in own["eval_curve"]] == [60, 120]
    assert "mae" in own["eval_curve"][0]["test_metrics"]
    tags = tensorboard_tags(str(tmp_path / "own" / "logs"))["scalars"]
    assert {"train/loss", "train/mae", "test/mae", "test/loss"} <= tags, tags

    flagged = train.run(_config("none", REGRESSION, tmp_path / "sgd", steps=120,
                                optimizer="sgd", learning_rate=0.05))
    out = capsys.readouterr().out
    line = [l for l in out.splitlines() if "instead of the optimizer it compiled" in l]
    assert len(line) == 1 and "--optimizer sgd at 0.05 (cosine)" in line[0]
    assert flagged["optimizer"] == "sgd" and flagged["learning_rate"] == 0.05
    assert flagged["lr_schedule"] == "cosine"
