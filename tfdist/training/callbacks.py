"""A task's Keras callbacks, run as ``fit`` runs them, at the controller's cadences.

A task may provide ``callbacks()`` returning Keras callbacks. The controller
calls them on the chief: ``on_train_begin``/``on_train_end``,
``on_epoch_begin``/``on_epoch_end`` (logs: the last progress line's training
metrics and, with a validation split, the epoch's ``val_*``), and
``on_train_batch_end`` at every progress line (``--log-every``). Their
``self.model`` is the trained model itself. ``model.stop_training = True``
(EarlyStopping) ends the run at the next call boundary, with a checkpoint,
the final evaluation and ``results.json`` saying which callback stopped it.

Strategies whose other tasks would not hear of a stop (or whose model lives on
the ps) refuse a task with callbacks in one line
(``StrategyKind.callbacks_refusal``, checked by ``training.contract``).
"""

from __future__ import annotations


class Callbacks:
    """The task's callbacks, or none (every method then does nothing)."""

    def __init__(self, task, model, schedule, active: bool):
        self.model = model
        self.list = None
        self.stopped_by: str | None = None
        given = getattr(task, "callbacks", None)
        if not active or not callable(given):
            return
        import keras

        callbacks = list(given() or [])
        self.list = keras.callbacks.CallbackList(
            callbacks, add_history=False, add_progbar=False, model=model, verbose=0,
            epochs=-(-schedule.total_steps // schedule.steps_per_epoch),
            steps=schedule.steps_per_epoch)
        model.stop_training = False

    def __bool__(self) -> bool:
        return self.list is not None

    def train_begin(self) -> None:
        if self:
            self.list.on_train_begin()

    def epoch_begin(self, epoch: int) -> None:
        """``epoch``: 0-based, as fit counts."""
        if self:
            self.list.on_epoch_begin(epoch)

    def batch_end(self, step: int, logs: dict) -> None:
        if self:
            self.list.on_train_batch_end(step - 1, dict(logs))

    def epoch_end(self, epoch: int, logs: dict) -> None:
        if self:
            self.list.on_epoch_end(epoch, dict(logs))

    def train_end(self, logs: dict) -> None:
        if self:
            self.list.on_train_end(dict(logs))

    def stop_requested(self) -> bool:
        """Whether a callback set ``model.stop_training`` (and which, for results.json)."""
        if not self or not getattr(self.model, "stop_training", False):
            return False
        if self.stopped_by is None:
            names = [type(c).__name__ for c in self.list.callbacks
                     if getattr(c, "stopped_epoch", 0) or type(c).__name__ == "EarlyStopping"]
            self.stopped_by = names[0] if names else "a callback (model.stop_training)"
        return True
