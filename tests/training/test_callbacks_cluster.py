"""Keras's built-in callbacks (and a custom one) run on the chief of a cluster as ``fit`` runs them.

``fit_tasks.ALL_CALLBACKS`` gives ModelCheckpoint, CSVLogger, TensorBoard,
LearningRateScheduler, ReduceLROnPlateau, EarlyStopping and a custom callback,
writing into ``$FIT_CALLBACKS_DIR``. The rates are chosen so that their effect on
training can be seen in the files: ReduceLROnPlateau halves the rate at the end of the
second epoch, the scheduler sets it to 0 for the third, and EarlyStopping ends the run
after the third (step 186 of 310). So the third epoch must leave the weights exactly
as the second left them, on every task: a rate that did not reach the trained optimizer
(the ps-held one, or another worker's) would change them.

``multiworker`` in the default tier; ``ps`` and ``ps-sync`` (the model on the ps, the
callbacks' ``self.model`` a chief-side copy) in the long tier. The copy's refresh and
the rate's way back to the trained optimizer are also checked in one process below.
"""

import csv
import json
import re
import types

import numpy as np
import pytest

from conftest import REPO, child_env, launch_cmd, read_results

SPEC = str(REPO / "tests" / "training" / "fit_tasks.py") + ":"
CLUSTERS = {"multiworker": ["--workers", "2"], "ps": ["--workers", "2", "--ps", "1"],
            "ps-sync": ["--workers", "2", "--ps", "1"],
            # Two stages; callbacks see the model assembled from them.
            "pipeline": ["--workers", "2"]}
TRAIN_ARGS = {"pipeline": ["--micro-batches", "2"]}
STEPS_PER_EPOCH, STOP_STEP = 62, 186  # 4,000 examples at a batch of 64; 3 epochs of 5


def _scalars(logdir):
    """{tag: {step: value}} of the event files in ``logdir``."""
    import tensorflow as tf

    out = {}
    for path in sorted(p for p in logdir.iterdir() if ".tfevents." in p.name):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                number = (tf.make_ndarray(value.tensor) if value.HasField("tensor")
                          else np.float32(value.simple_value))
                if number.dtype.kind == "f":  # not the model's summary (a JSON string)
                    out.setdefault(value.tag, {})[event.step] = float(number)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", [
    "multiworker",
    pytest.param("ps", marks=pytest.mark.long),
    pytest.param("ps-sync", marks=pytest.mark.long),
    pytest.param("pipeline", marks=pytest.mark.long),
])
def test_every_named_callback_runs_on_the_chief_and_reaches_training(tmp_path, spawn, strategy):
    import keras

    from tfdist.training.loop.evaluation import weights_sha256

    out, run = tmp_path / "callbacks", tmp_path / "run"
    out.mkdir()
    p = spawn(launch_cmd(strategy, *CLUSTERS[strategy], train_args=[
        "--task", SPEC + "ALL_CALLBACKS", "--epochs", "5", "--global-batch-size", "64",
        "--log-every", "60", "--model-dir", str(run), *TRAIN_ARGS.get(strategy, ())]),
        env=child_env(FIT_CALLBACKS_DIR=str(out)))
    assert p.wait(timeout=300) == 0, p.output[-3000:]
    results = read_results(run)

    # EarlyStopping: the run ends after the third epoch, exit 0, the reason recorded.
    assert results["stopped_by"] == "EarlyStopping" and results["completed_steps"] == STOP_STEP
    assert re.search(rf"stopped by EarlyStopping at step {STOP_STEP} of 310", p.output)
    if strategy == "multiworker":
        # The other worker stops at the same step, with the same weights (it trained
        # at the chief's rates: 0 in the third epoch).
        assert re.search(rf"worker:1.*stopped by the chief's callbacks at step {STOP_STEP} "
                         "of 310", p.output), p.output[-3000:]
        hashes = set(re.findall(r"weights_sha256=([0-9a-f]{64})", p.output))
        assert hashes == {results["weights_sha256"]}, hashes

    # LearningRateScheduler: the trained optimizer's rate at the end (read from it:
    # the ps-held one under ps) is the scheduler's 0.
    assert results["learning_rate"] == 0.0, results["learning_rate"]

    # The custom callback: every hook, val_* in the epoch logs; the rate each epoch
    # began with, as the trained optimizer held it (ReduceLROnPlateau's half included).
    calls = json.loads((out / "calls.json").read_text())
    assert calls[0] == ["train_begin", None] and calls[-1][0] == "train_end"
    assert calls[-1][1] > 0  # self.model: the model, with its parameters
    begins = [c for c in calls if c[0] == "epoch_begin"]
    assert [c[1] for c in begins] == [0, 1, 2]
    assert np.allclose([c[2] for c in begins], [1e-2, 1e-2, 5e-3]), begins
    ends = [c for c in calls if c[0] == "epoch_end"]
    assert [c[1] for c in ends] == [0, 1, 2]
    for end in ends:
        assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(end[2]), end
    batch_ends = [c for c in calls if c[0] == "batch_end"]
    assert len(batch_ends) == 3 and all("loss" in c[1] for c in batch_ends), batch_ends

    # ModelCheckpoint: a loadable model each epoch, the trained weights of that step: the
    # third epoch (rate 0) left the second's unchanged, and they are the final weights.
    saved = [keras.saving.load_model(out / f"ckpt-{e}.keras") for e in (1, 2, 3)]
    first, second, third = (m.get_weights() for m in saved)
    assert not all(np.array_equal(a, b) for a, b in zip(first, second))
    assert all(np.array_equal(a, b) for a, b in zip(second, third))
    assert weights_sha256(saved[2]) == results["weights_sha256"]
    from tests.training import fit_tasks

    x, y, _ = fit_tasks.arrays("test")
    accuracy = saved[2].evaluate(x, y, verbose=0, return_dict=True)["accuracy"]
    assert abs(accuracy - results["test_accuracy"]) < 1e-6 and accuracy > 0.9

    # CSVLogger: one row per epoch, training and validation metrics.
    with open(out / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert {"loss", "accuracy", "val_loss", "val_accuracy", "learning_rate"} <= set(rows[0])
    # The third epoch trained nothing: its validation loss is the second's.
    assert rows[2]["val_loss"] == rows[1]["val_loss"] and float(rows[2]["learning_rate"]) == 0

    # TensorBoard: the epoch scalars, training and validation, the rate as it was set.
    train, val = _scalars(out / "tb" / "train"), _scalars(out / "tb" / "validation")
    assert set(train["epoch_loss"]) == {0, 1, 2} and set(val["epoch_accuracy"]) == {0, 1, 2}
    rates = train["epoch_learning_rate"]
    assert np.allclose([rates[e] for e in (0, 1, 2)], [1e-2, 5e-3, 0.0]), rates
    assert val["epoch_loss"][2] == pytest.approx(float(rows[2]["val_loss"]), rel=1e-6)


# --- in one process: the copy and the rate, through the Trainer contract --------------


class _CopyTrainer:
    """A trainer whose model lives elsewhere: ``local_model()`` hands out a copy of the
    "trained" model's weights and counts the refreshes (as the ps trainers do)."""

    is_chief = True

    def __init__(self, task):
        import keras

        self.trained = task.build_model()
        self.copy = task.build_model()
        self.refreshes = 0
        self.state = types.SimpleNamespace(model=self.trained, optimizer=self.trained.optimizer)
        self.task = types.SimpleNamespace(task=task)
        self.bundle = types.SimpleNamespace(strategy=None)
        self.config = types.SimpleNamespace(callbacks_file=None)  # the task's own callbacks()
        self._keras = keras

    def local_model(self):
        self.refreshes += 1
        self.copy.set_weights(self.trained.get_weights())
        return self.copy

    def in_lockstep(self):
        return False

    # The Trainer contract's own: the rate to state.optimizer, weights to state.model.
    def trained_optimizer(self):
        from tfdist.training.loop.trainer import Trainer

        return Trainer.trained_optimizer(self)

    def set_weights(self, weights):
        from tfdist.training.loop.trainer import Trainer

        Trainer.set_weights(self, weights)

    def paused(self):
        import contextlib

        return contextlib.nullcontext()


class _Scheduled:
    def __init__(self, callbacks):
        self._callbacks = callbacks

    def build_model(self):
        from tests.training import fit_tasks

        return fit_tasks.BLOBS.build_model()

    def callbacks(self):
        return self._callbacks


def test_a_copys_rate_reaches_the_trained_optimizer_and_its_stop_the_run():
    import keras

    from tfdist.training.loop.callbacks import Callbacks
    from tfdist.training.loop.schedule import Schedule

    seen = []

    class Sees(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(self.model.get_weights()[0].copy())
            if epoch == 1:
                self.model.stop_training = True

        def on_train_end(self, logs=None):
            # As EarlyStopping(restore_best_weights=True): the first epoch's end.
            self.model.set_weights(self.best)

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 0:
                self.best = self.model.get_weights()

    task = _Scheduled([keras.callbacks.LearningRateScheduler(lambda e, lr: [0.5, 0.0][e]),
                       Sees()])
    trainer = _CopyTrainer(task)
    callbacks = Callbacks(trainer, Schedule(total_steps=30, steps_per_epoch=10))
    assert callbacks.model is trainer.copy  # never the trained model itself
    trained = trainer.trained.optimizer
    callbacks.train_begin()
    callbacks.epoch_begin(0)
    assert float(trained.learning_rate) == 0.5  # the scheduler's rate, on the trained one
    kernel = trainer.trained.weights[0]
    kernel.assign(kernel + 1.0)  # "training" moved the trained weights
    callbacks.epoch_end(0, {"loss": 1.0})
    np.testing.assert_array_equal(seen[-1], kernel.numpy())  # the copy was refreshed first
    callbacks.epoch_begin(1)
    assert float(trained.learning_rate) == 0.0  # a rate of 0 is handed on too
    assert not callbacks.stop_requested()
    callbacks.epoch_end(1, {"loss": 1.0})
    assert callbacks.stop_requested() and callbacks.stopped_by == "a callback (model.stop_training)"
    # Someone else changed the trained rate: the copy takes it before the next call.
    trained.learning_rate = 0.25
    kernel.assign(kernel + 1.0)
    callbacks.train_end({})
    assert float(trainer.copy.optimizer.learning_rate) == 0.25
    # Weights a callback set on the copy are the trained model's now.
    for got, want in zip(trainer.trained.get_weights(), trainer.copy.get_weights()):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(trainer.trained.weights[0].numpy(), seen[-1])


def test_every_strategy_takes_a_task_with_callbacks():
    from tfdist.strategies import kinds
    from tfdist.training.workload import contract
    from tfdist.training.workload import tasks

    spec = tasks.parse_spec(SPEC + "WITH_CALLBACKS")
    checked = tasks.inspect(spec, tasks.load(spec), steps_given=False)
    for name in kinds.names(include_auto=False):
        contract.check(kinds.get(name), checked)  # ps, ps-sync and pipeline included


@pytest.mark.multiprocess
@pytest.mark.long
def test_weights_a_callback_restores_on_the_chiefs_copy_reach_the_ps(tmp_path, spawn):
    """Under ps the callbacks' self.model is a copy: EarlyStopping's restored weights (epoch
    1's) must still be what is evaluated, hashed and saved."""
    import keras

    from tfdist.training.loop.evaluation import weights_sha256

    out, run = tmp_path / "callbacks", tmp_path / "run"
    out.mkdir()
    p = spawn(launch_cmd("ps", *CLUSTERS["ps"], train_args=[
        "--task", SPEC + "RESTORE_BEST", "--epochs", "5", "--global-batch-size", "64",
        "--log-every", "60", "--model-dir", str(run)]),
        env=child_env(FIT_CALLBACKS_DIR=str(out)))
    assert p.wait(timeout=300) == 0, p.output[-3000:]
    results = read_results(run)
    assert results["stopped_by"] == "EarlyStopping" and results["completed_steps"] == 124
    first, second = (weights_sha256(keras.saving.load_model(out / f"ckpt-{e}.keras"))
                     for e in (1, 2))
    assert first != second
    assert results["weights_sha256"] == first
    assert weights_sha256(keras.saving.load_model(run / "model.keras")) == first
