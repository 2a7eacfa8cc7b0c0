"""The contract between the controller and a trainer (Orbit's ``AbstractTrainer``).

The controller (``training.loop.controller``) owns the outer loop and every
cadence; a trainer owns how ``n`` steps run. Each strategy kind names its
loop (``StrategyKind.trainer``: "sync", "ps" or "ps-sync"); the controller
maps that to a class implementing this contract.

Trainers are handed ready-made objects: the plan, the strategy bundle, the
checked task (``training.workload.tasks.CheckedTask``) and its stateless train
metrics, the state (model, optimizer, counters) and its checkpointer,
already restored to ``start_step``.
"""

from __future__ import annotations

import abc
import contextlib


class Trainer(abc.ABC):
    """What every trainer provides; see ``training.loop.controller.Controller``."""

    # Errors that mean a peer task went away (the controller turns them into TaskLost).
    lost_member_errors: tuple[type[BaseException], ...] = ()

    def __init__(self, *, plan, bundle, task, state, checkpointer, start_step: int,
                 train_metrics):
        self.plan, self.bundle, self.task = plan, bundle, task
        self.train_metrics = train_metrics  # training.loop.step.TrainMetrics
        self.config, self.cluster = plan.config, plan.cluster
        self.state, self.checkpointer = state, checkpointer
        self.start_step = self.completed = start_step  # requested steps applied so far
        self.is_chief = self.cluster.is_chief

    @staticmethod
    def build_state(plan, task, strategy, example=None, own_optimizers=None):
        """The model, optimizer and step counters this trainer trains, built before the
        trainer (the checkpointer restores them first). The default: the task's model
        whole, in ``strategy``'s scope (``training.loop.state.build_state``); a trainer that
        places the model itself (the pipeline's stages) builds its own."""
        from tfdist.training.loop.state import build_state  # TensorFlow: only when a run builds

        return build_state(plan, task, strategy, example, own_optimizers)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The task's compiled metrics, in the order a call's output carries them."""
        return self.train_metrics.names

    @abc.abstractmethod
    def train(self, num_steps: int) -> dict[str, float]:
        """Run (or schedule) ``num_steps`` steps; ``completed`` counts the applied ones.

        Returns the training loss and metric values of the latest steps whose
        results are in (empty before any), as Orbit's ``train`` returns its logs."""

    @abc.abstractmethod
    def drain(self) -> dict[str, float]:
        """Return once every scheduled step is applied (before checkpoints, evaluations, the
        end); the latest loss and metric values then, as ``train`` returns them."""

    def on_started(self) -> None:
        """The first call returned: every peer is connected."""

    @property
    def settling(self) -> bool:
        """Whether the calls still differ from the run's steady ones (a trial of
        two steps, a call's first run): the controller's rates count from the
        first call after which this is False, as they leave out the first call."""
        return False

    @property
    def leaves_update_pending(self) -> bool:
        """Whether a call may return with its last update still to apply: the
        controller then drains before anything reads the weights, not only
        before checkpoints and evaluations (``drain()`` applies it)."""
        return False

    def paused(self):
        """A context around the chief's own work (an evaluation): time spent
        in it does not count towards ``--stuck-timeout``."""
        return contextlib.nullcontext()

    def saving(self, step: int):
        """A context around every checkpoint save (``step``: the one saved): a
        trainer whose save can block on a stuck peer bounds that wait here."""
        return contextlib.nullcontext()

    def stop_requested(self) -> bool:
        """Whether a preemption asks the controller to drain, save and stop."""
        return False

    def local_model(self):
        """The model a Keras callback's ``self.model`` is (``training.loop.callbacks``), holding
        the trained weights as of now; called on the chief before each callback call that
        may read them.

        A trainer whose ``state.model`` is trained in this process (the synchronous
        ones) returns it itself; one whose variables live on the ps tasks returns a
        chief-side copy (plain variables), refreshed from the ps on every call. A
        learning rate the callbacks set on the copy's optimizer is given to the trained
        optimizer by ``training.loop.callbacks``."""
        return self.state.model

    def trained_optimizer(self):
        """The optimizer whose learning rate the steps read, which a rate the callbacks
        set reaches (``training.loop.callbacks``): ``state.optimizer``; the pipeline's
        is every stage's at once."""
        return self.state.optimizer

    def set_weights(self, weights: list) -> None:
        """Weights the callbacks set on ``local_model()`` (the unsplit model's, in its
        order), into the trained model."""
        from tfdist.training.sharding import set_full_weights

        set_full_weights(self.state.model, weights)

    def finish_training(self) -> None:
        """What ``fit`` does to the weights once training ends (``contract.finish_training``:
        ``use_ema``'s averages written into them)."""
        from tfdist.training.workload import contract

        contract.finish_training(self.state.model, self.state.optimizer)

    def in_lockstep(self) -> bool:
        """Whether other tasks run this same loop, step for step (multiworker's
        workers): the chief's callbacks' stop and learning rate must then reach them
        (``training.loop.callbacks``, one all-reduce at each call boundary)."""
        return False

    def evaluation_members(self):
        """The members that share each evaluation (``training.loop.evaluation.EvalMembers``:
        each evaluates its own batches and the metrics' states are summed), or None: the
        chief evaluates alone. Every member of the group then evaluates at the same
        steps, since the sum is a collective."""
        return None

    def progress_fields(self) -> tuple[str, dict]:
        """Extra text for the progress line, and the same as event fields."""
        return "", {}

    @abc.abstractmethod
    def result_fields(self, ran: int) -> dict:
        """Strategy-specific fields of the results record (``global_steps`` at least)."""

    def finish_worker(self) -> None:
        """A non-chief task's last words (its weights' fingerprint)."""

    def end_of_job(self) -> None:
        """The end-of-job rendezvous, after the chief's results."""

    @abc.abstractmethod
    def close(self, finished: bool) -> None:
        """Release what the trainer holds (handlers, threads, the checkpointer)."""
