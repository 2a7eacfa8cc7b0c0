"""A task's Keras callbacks, run as ``fit`` runs them, at the controller's cadences.

A task may provide ``callbacks()`` returning Keras callbacks. The controller
calls them on the chief: ``on_train_begin``/``on_train_end``,
``on_epoch_begin``/``on_epoch_end`` (logs: the last progress line's training
metrics and, with a validation split, the epoch's ``val_*``), and
``on_train_batch_end`` at every progress line (``--log-every``).
``model.stop_training = True`` (EarlyStopping) ends the run at the next call
boundary, with a checkpoint, the final evaluation and ``results.json`` saying
which callback stopped it.

Their ``self.model`` is the trainer's ``local_model()``
(``training.loop.trainer.Trainer``): the trained model itself under the
synchronous strategies; under ``ps`` and ``ps-sync``, whose variables live on
the ps tasks, the chief's copy of the model (plain variables, the one
evaluation uses), refreshed from the ps before every call that may read it
(train and epoch begins and ends, and batch ends when a callback has a
batch hook). Only the chief runs the loop there, so nothing is broadcast:
before each call the copy's optimizer takes the trained optimizer's learning
rate, and a rate the callbacks set on it (``LearningRateScheduler``,
``ReduceLROnPlateau``) is assigned to the trained optimizer (on the ps) right
after, before the next step is scheduled; weights they set on it
(``EarlyStopping(restore_best_weights=True)``) are assigned to the trained
model the same way.

Under a strategy of several training tasks in lockstep (``multiworker``) the
chief's decisions reach every worker: at every epoch begin, progress line and
epoch end, every task takes part in one all-reduce in which only the chief's
first replica contributes its stop flag and learning rate; every worker then
stops at the same step and trains at the chief's rate. Under ``pipeline`` the
model is the task's assembled from the stages (copy 0's weights), refreshed as
under ``ps``; a rate set on its optimizer reaches every stage's optimizer.
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import pickle
import sys

import numpy as np

from tfdist.protocol import ConfigError


class Callbacks:
    """The task's callbacks, or none (every method then does nothing)."""

    def __init__(self, trainer, schedule):
        self._trainer = trainer
        self.model = None
        self.list = None
        self.stopped_by: str | None = None
        self._agreed_stop = False
        self._batch_hooks = False
        self._given_rate: float | None = None
        self._given_weights: list | None = None  # what a refreshed copy was given
        given = getattr(trainer.task.task, "callbacks", None)
        if trainer.config.callbacks_file:  # tfdist.fit(callbacks=[...], workers=N)'s, shipped
            given = functools.partial(receive, trainer.config.callbacks_file)
        # The trained optimizer: the one whose learning rate the steps read.
        self._optimizer = trainer.trained_optimizer()
        # Every training task agrees with the chief (several tasks train in step).
        self._agree = None
        if callable(given) and trainer.in_lockstep():
            from tfdist.training.loop.step import make_replica_sum

            self._agree = make_replica_sum(trainer.bundle.strategy, first_only=True)
        if not trainer.is_chief or not callable(given):
            return
        import keras

        callbacks = list(given() or [])
        self.model = trainer.local_model()
        # Batch ends refresh a ps-held model only for a callback that reads them.
        self._batch_hooks = any(_overrides(c, "on_train_batch_end") or _overrides(c, "on_batch_end")
                                for c in callbacks)
        self.list = keras.callbacks.CallbackList(
            callbacks, add_history=False, add_progbar=False, model=self.model, verbose=0,
            epochs=-(-schedule.total_steps // schedule.steps_per_epoch),
            steps=schedule.steps_per_epoch)
        self.model.stop_training = False

    def __bool__(self) -> bool:
        return self.list is not None

    def train_begin(self) -> None:
        if self:
            with self._call():
                self.list.on_train_begin()

    def epoch_begin(self, epoch: int) -> None:
        """``epoch``: 0-based, as fit counts. Every task: a rate set here
        (LearningRateScheduler) trains this epoch on every worker."""
        if self:
            with self._call():
                self.list.on_epoch_begin(epoch)
        self.agree()

    def batch_end(self, step: int, logs: dict) -> None:
        if self:
            with self._call(weights=self._batch_hooks):
                self.list.on_train_batch_end(step - 1, dict(logs))

    def epoch_end(self, epoch: int, logs: dict) -> None:
        if self:
            with self._call():
                self.list.on_epoch_end(epoch, dict(logs))

    def train_end(self, logs: dict) -> None:
        if self:
            with self._call():
                self.list.on_train_end(dict(logs))

    def _call(self, weights: bool = True):
        return _CallbackCall(self, weights)

    def _before(self, weights: bool) -> None:
        """The callbacks' model takes the trained weights (``weights``) and learning rate."""
        self._given_weights = None
        if weights:
            self.model = self._trainer.local_model()  # the same object, refreshed
            if self.model is not self._trainer.state.model:
                self._given_weights = self.model.get_weights()
        copy = getattr(self.model, "optimizer", None)
        if copy is None or copy is self._optimizer:
            return
        rate = _rate(self._optimizer)
        if rate is not None and _rate(copy) is not None:
            copy.learning_rate = rate
        self._given_rate = _rate(copy)

    def _after(self) -> None:
        """What the callbacks set on a copy (weights, the optimizer's rate): to the
        trained model and optimizer."""
        if self._given_weights is not None:
            now = self.model.get_weights()
            if any(not np.array_equal(a, b) for a, b in zip(now, self._given_weights)):
                # EarlyStopping(restore_best_weights=True), or any set_weights.
                self._trainer.set_weights(now)
        copy = getattr(self.model, "optimizer", None)
        if copy is None or copy is self._optimizer:
            return
        rate = _rate(copy)
        if rate is None or rate == self._given_rate:
            return
        if _rate(self._optimizer) is None:
            raise ConfigError(
                f"a callback set the learning rate to {rate:g}, but the trained optimizer's "
                "learning rate is a LearningRateSchedule, which cannot be set (as under fit); "
                "compile with a number as the learning rate, or drop the callback")
        self._optimizer.learning_rate = rate
        self._given_rate = rate

    def agree(self) -> None:
        """Every task: take the chief's stop flag and learning rate (a no-op alone).

        Called at the same steps on every task (epoch begins, progress lines,
        epoch ends).
        """
        if self._agree is None:
            return
        import tensorflow as tf

        stop = 1.0 if self and getattr(self.model, "stop_training", False) else 0.0
        rate = _rate(self._optimizer) if self else None
        stop_all, known, rate_all = (float(v) for v in self._agree(
            tf.constant([stop, 0.0 if rate is None else 1.0, rate or 0.0])))
        self._agreed_stop = stop_all > 0
        # A rate of 0 is a rate too (a schedule that stops training).
        if known > 0 and not self and _rate(self._optimizer) not in (None, rate_all):
            self._optimizer.learning_rate = rate_all

    def stop_requested(self) -> bool:
        """Whether a callback set ``model.stop_training`` (and which, for results.json)."""
        if self._agreed_stop and not self:
            self.stopped_by = self.stopped_by or "the chief's callbacks"
            return True
        if not self or not getattr(self.model, "stop_training", False):
            return False
        if self.stopped_by is None:
            names = [type(c).__name__ for c in self.list.callbacks
                     if getattr(c, "stopped_epoch", 0) or type(c).__name__ == "EarlyStopping"]
            self.stopped_by = names[0] if names else "a callback (model.stop_training)"
        return True


class _CallbackCall:
    """Around one callback call: the model refreshed before, the rate handed on after;
    the chief's own work, not a stuck peer (``Trainer.paused``)."""

    def __init__(self, callbacks: Callbacks, weights: bool):
        self._callbacks, self._weights = callbacks, weights
        self._paused = callbacks._trainer.paused()

    def __enter__(self):
        self._paused.__enter__()
        try:
            self._callbacks._before(self._weights)  # pylint: disable=protected-access
        except BaseException as err:
            self._paused.__exit__(type(err), err, err.__traceback__)
            raise
        return self

    def __exit__(self, *exc):
        try:
            if exc[0] is None:
                self._callbacks._after()  # pylint: disable=protected-access
        finally:
            self._paused.__exit__(*exc)
        return False


def _overrides(callback, hook: str) -> bool:
    import keras

    return getattr(type(callback), hook, None) is not getattr(keras.callbacks.Callback, hook)


def _rate(optimizer) -> float | None:
    """The optimizer's learning rate when it is a number (not a schedule)."""
    import keras

    if optimizer is None:
        return None
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    if isinstance(getattr(inner, "_learning_rate", None),
                  keras.optimizers.schedules.LearningRateSchedule):
        return None
    try:
        # Through NumPy: float() refuses a MirroredVariable (multiworker's rate).
        return float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    except Exception:  # pylint: disable=broad-except
        return None


# --- callbacks shipped to a cluster's chief (tfdist.fit(callbacks=[...], workers=N)) -----

SHIPPED_NAME = "callbacks.pkl"


class _Shipping(pickle.Pickler):
    """A pickler that refuses a class or function another process could not import
    (``__main__``'s, a function's local, a module off its path), which plain pickle
    would write and the chief then fail to read."""

    def persistent_id(self, obj):
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__"):
            module = getattr(obj, "__module__", None) or ""
            name = f"{module}.{getattr(obj, '__qualname__', '?')}"
            top = module.partition(".")[0]
            if module == "__main__" or "<locals>" in name:
                raise pickle.PicklingError(f"{name} exists only in this process")
            if top and top not in sys.builtin_module_names and \
                    importlib.machinery.PathFinder.find_spec(top) is None:
                raise pickle.PicklingError(f"{name}: module {top!r} is not importable from "
                                           f"{os.getcwd()}")
        return None


def ship(callbacks: list, directory: str) -> str:
    """``callbacks`` pickled into ``directory`` (the path), for ``--callbacks-file``;
    ConfigError naming the first one that cannot reach another process."""
    import io

    for i, callback in enumerate(callbacks):
        try:
            _Shipping(io.BytesIO()).dump(callback)
        except Exception as err:  # pickle raises PicklingError, TypeError, AttributeError
            raise ConfigError(
                f"callbacks[{i}] ({type(callback).__name__}) cannot be sent to the cluster's "
                f"chief, another process: {str(err).splitlines()[0]}; define its class and "
                "what it holds at the top level of an importable module (not a lambda, not in "
                "__main__), or give the task a callbacks() method") from None
    path = os.path.join(directory, SHIPPED_NAME)
    with open(path, "wb") as f:
        pickle.dump(list(callbacks), f)
    return path


def receive(path: str) -> list:
    """The callbacks ``ship`` wrote (on the chief); one line if they cannot be read."""
    try:
        with open(path, "rb") as f:
            callbacks = pickle.load(f)
    except Exception as err:  # a missing file, a class that no longer imports
        raise ConfigError(f"--callbacks-file {path}: cannot read the callbacks "
                          f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                          "pass a file tfdist.fit(callbacks=[...]) wrote, from the same "
                          "directory and code") from None
    return list(callbacks)
