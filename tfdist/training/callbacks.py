"""A task's Keras callbacks, run as ``fit`` runs them, at the controller's cadences.

A task may provide ``callbacks()`` returning Keras callbacks. The controller
calls them on the chief: ``on_train_begin``/``on_train_end``,
``on_epoch_begin``/``on_epoch_end`` (logs: the last progress line's training
metrics and, with a validation split, the epoch's ``val_*``), and
``on_train_batch_end`` at every progress line (``--log-every``). Their
``self.model`` is the trained model itself. ``model.stop_training = True``
(EarlyStopping) ends the run at the next call boundary, with a checkpoint,
the final evaluation and ``results.json`` saying which callback stopped it.

Under a strategy of several training tasks (``multiworker``) the chief's
decisions reach every worker: at every progress line and epoch end, every
task takes part in one all-reduce in which only the chief's first replica
contributes its stop flag and learning rate; every worker then stops at the
same step and trains at the chief's rate. Strategies whose model lives on the
ps refuse a task with callbacks in one line (``StrategyKind.callbacks_refusal``,
checked by ``training.contract``).
"""

from __future__ import annotations


class Callbacks:
    """The task's callbacks, or none (every method then does nothing)."""

    def __init__(self, task, model, schedule, active: bool, strategy=None, optimizer=None,
                 shared: bool = False):
        self.model = model
        self.list = None
        self.stopped_by: str | None = None
        self._agreed_stop = False
        given = getattr(task, "callbacks", None)
        # Every training task agrees with the chief (several tasks train in step).
        self._agree = (make_agreement(strategy) if shared and callable(given) else None)
        self._optimizer = optimizer
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

    def agree(self) -> None:
        """Every task: take the chief's stop flag and learning rate (a no-op alone).

        Called at the same steps on every task (progress lines, epoch ends).
        """
        if self._agree is None:
            return
        import tensorflow as tf

        stop = 1.0 if self and getattr(self.model, "stop_training", False) else 0.0
        rate = _rate(self._optimizer) if self else 0.0
        stop_all, rate_all = (float(v) for v in self._agree(tf.constant([stop, rate or 0.0])))
        self._agreed_stop = stop_all > 0
        if rate_all > 0 and not self and _rate(self._optimizer) not in (None, rate_all):
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


def _rate(optimizer) -> float | None:
    """The optimizer's learning rate when it is a number (not a schedule)."""
    import keras

    if optimizer is None or isinstance(getattr(optimizer, "_learning_rate", None),
                                       keras.optimizers.schedules.LearningRateSchedule):
        return None
    try:
        return float(optimizer.learning_rate)
    except Exception:  # pylint: disable=broad-except
        return None


def make_agreement(strategy):
    """``agree(values)``: the chief's first replica's ``values`` on every task, by one
    all-reduce (every other replica contributes zeros)."""
    import tensorflow as tf

    @tf.function
    def agree(values):
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            mine = tf.where(tf.equal(ctx.replica_id_in_sync_group, 0), values,
                            tf.zeros_like(values))
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, mine)

        return strategy.experimental_local_results(strategy.run(replica_fn))[0]

    return agree
