"""The controller driven with a fake trainer: the outer loop and its cadences, through the
narrow Trainer contract only (train(n) and drain() return the latest metrics)."""

from __future__ import annotations

import math
import types

import pytest

from tfdist.training.config import TrainConfig
from tfdist.training.loop.controller import Controller
from tfdist.training.plan import resolve
from tfdist.training.loop.survival.recovery import Diverged, Preempted
from tfdist.training.loop.trainer import Trainer


class FakeTrainer(Trainer):
    """Counts steps; its loss is 1/(step+1), or NaN from ``nan_at`` on; asks to stop at
    ``stop_at`` (a preemption); records every call the controller makes."""

    def __init__(self, *, start_step=0, nan_at=None, stop_at=None, settled_at=0, **parts):
        super().__init__(start_step=start_step, **parts)
        self.calls: list[tuple] = []
        self.nan_at, self.stop_at, self.settled_at = nan_at, stop_at, settled_at
        self.is_chief = False  # a worker: the run ends without the chief's evaluation

    def _metrics(self):
        if self.completed == 0:
            return {}
        loss = math.nan if self.nan_at is not None and self.completed >= self.nan_at \
            else 1.0 / (self.completed + 1)
        return {"loss": loss, "accuracy": 0.5}

    def train(self, num_steps):
        self.calls.append(("train", num_steps))
        self.completed += num_steps
        return self._metrics()

    def drain(self):
        self.calls.append(("drain", self.completed))
        return self._metrics()

    @property
    def settling(self):
        return self.completed < self.settled_at

    def stop_requested(self):
        return self.stop_at is not None and self.completed >= self.stop_at

    def result_fields(self, ran):
        return {"global_steps": self.completed}

    def finish_worker(self):
        self.calls.append(("finish_worker",))

    def end_of_job(self):
        self.calls.append(("end_of_job",))

    def close(self, finished):
        self.calls.append(("close", finished))


def _plan(**flags):
    config = TrainConfig(strategy="none", task="mnist-logreg", **flags)
    return resolve(config, [], train_examples=6000, test_examples=1000)


def _run(plan, **trainer_options):
    saved, progress, rates = [], [], []
    checkpointer = types.SimpleNamespace(save=saved.append, saved_at=lambda: None,
                                         resume_step=None, on_saved=None)
    reporter = types.SimpleNamespace(
        hparams=lambda h: None, checkpoint=lambda *a, **k: None, steady_from=rates.append,
        rates_from=rates.append,
        progress=lambda step, metrics, *a, **k: progress.append((step, dict(metrics))),
        evaluate=lambda *a: pytest.fail("a worker never evaluates"), evaluates=False,
        prepare_evaluation=lambda: None,  # the real one prepares nothing: evaluates=False
        throughput=types.SimpleNamespace(overall=lambda n: (1.0, 2.0)),
        events=types.SimpleNamespace(emit=lambda *a, **k: None))
    # A task without callbacks or a validation split; no model: the fake computes nothing.
    task = types.SimpleNamespace(task=types.SimpleNamespace(), has_validation=False)
    trainer = FakeTrainer(plan=plan, bundle=types.SimpleNamespace(strategy=None), task=task,
                          state=types.SimpleNamespace(model=None, optimizer=None),
                          checkpointer=checkpointer, train_metrics=None, **trainer_options)
    controller = Controller(plan, trainer, checkpointer, reporter, started=0.0)
    controller.rates = rates
    return controller, trainer, saved, progress


def test_the_controller_runs_the_schedule_through_the_contract():
    plan = _plan(steps=20, log_every=5, checkpoint_every=10, steps_per_execution=5)
    controller, trainer, saved, progress = _run(plan)
    assert controller.run() is None  # a worker returns no record
    trains = [c[1] for c in trainer.calls if c[0] == "train"]
    assert trains == [5, 5, 5, 5] and trainer.completed == 20
    # Every progress line shows what train()/drain() returned at that step.
    assert [s for s, _ in progress] == [5, 10, 15, 20]
    assert progress[1][1] == {"loss": 1 / 11, "accuracy": 0.5}
    # A checkpoint at every due step, each after a drain.
    assert saved == [10, 20]
    for step in saved:
        at = trainer.calls.index(("drain", step))
        assert ("train", 5) in trainer.calls[:at]
    assert trainer.calls[-3:] == [("close", True), ("finish_worker",), ("end_of_job",)]


def test_a_nan_loss_from_train_ends_the_run_as_diverged():
    plan = _plan(steps=20, log_every=5, steps_per_execution=5)
    controller, trainer, saved, _ = _run(plan, nan_at=10)
    with pytest.raises(Diverged):
        controller.run()
    assert trainer.completed == 10 and ("close", False) in trainer.calls


def test_a_stop_request_drains_saves_and_raises_preempted():
    plan = _plan(steps=20, log_every=5, steps_per_execution=5)
    controller, trainer, saved, _ = _run(plan, stop_at=15)
    with pytest.raises(Preempted) as stopped:
        controller.run()
    assert stopped.value.step == 15 and saved == [15] and trainer.completed == 15


@pytest.mark.parametrize("settled_at, rates_from", [(0, [5]), (12, [5, 15]), (99, [5])])
def test_the_rates_count_from_the_first_call_or_from_where_the_trainer_settles(
        settled_at, rates_from):
    """Rates leave out the first call, and a trainer's settling calls after it (auto's
    trial); one that never settles keeps the first call's start."""
    plan = _plan(steps=20, log_every=5, steps_per_execution=5)
    controller, trainer, _, _ = _run(plan, settled_at=settled_at)
    controller.run()
    assert controller.rates == rates_from and controller.steady_from == rates_from[-1]
