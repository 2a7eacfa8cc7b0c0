"""The one outer loop: every cadence of a run, for every strategy.

Orbit's split: the controller owns the loop and decides, through the pure
``Schedule``, when to log, evaluate, checkpoint, stop for a preemption and
end; a trainer (``training.loop.trainer.Trainer``: ``SyncTrainer``, ``PsTrainer``,
``PsSyncTrainer``) owns how ``n`` steps run (``train(n)``) and how
everything scheduled gets applied (``drain()``).

``training.assemble.train_and_evaluate`` builds the ready-made objects (state,
checkpointer, trainer, reporter) and hands them to the ``Controller``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

from tfdist import protocol
from tfdist.training.loop.callbacks import Callbacks
from tfdist.training.loop.survival.checkpoints import Checkpointer, save_model
from tfdist.training.loop.evaluation import local_copy, split_metrics
from tfdist.training.loop import profiling
from tfdist.training.loop.export import ExportFailed, Exporter
from tfdist.training.loop.survival.recovery import Diverged, Preempted, storage_fault, task_lost
from tfdist.training.loop.reporting import Reporter, RunTimes, results_record, run_hparams
from tfdist.training.loop.trainer import Trainer


class Controller:
    """The one outer loop of a run, for every strategy (Orbit's ``Controller``).

    Owns every cadence through the plan's ``Schedule`` (call sizes, progress lines,
    evaluations, checkpoints, the end), the run's clock (start-up, steady state), the
    finite-loss check, preemption and early stops, and the chief's final outputs
    (``_finish``). Owns no step: the ``Trainer`` it is handed runs them; the
    checkpointer, reporter, callbacks and exporter are its tools.
    """

    def __init__(self, plan, trainer: Trainer, checkpointer: Checkpointer, reporter: Reporter,
                 started: float, started_ok=lambda: None):
        self.plan, self.config, self.trainer = plan, plan.config, trainer
        self.kind, self.replicas, self.cluster = plan.kind, plan.replicas, plan.cluster
        self.checkpointer, self.reporter = checkpointer, reporter
        self.started = started
        self.started_ok = started_ok
        self.schedule = plan.schedule(trainer.start_step)
        checkpointer.on_saved = reporter.checkpoint
        reporter.hparams(run_hparams(plan))
        self.startup_seconds = 0.0
        self.steady_from = trainer.start_step
        self._settling = False  # the trainer's, after the first call (Trainer.settling)
        self.metrics: dict[str, float] = {}  # what the trainer's latest train/drain returned
        # --export: the chief's SavedModels (training.loop.export); a failed final
        # export is raised after the end-of-job rendezvous, results written.
        self.exporter = (Exporter(self.config.export, reporter.evaluator, reporter.checked.task)
                         if self.config.export and trainer.is_chief else None)
        self.export_failed: ExportFailed | None = None
        # The task's Keras callbacks, on the chief (training.loop.callbacks); their
        # self.model is trainer.local_model().
        self.callbacks = Callbacks(trainer, self.schedule)
        # --profile-steps: None when off (training.loop.profiling).
        self.profiler = profiling.make(self.config, self.cluster, self.kind)

    def run(self) -> dict | None:
        """Train to the end; the chief returns the results record's dict.

        A write into the run directory that fails for want of space or of
        write access (TensorBoard logs, progress events, the results) ends
        the run with one line (``StorageFault``); the checkpointer says the
        same of its own saves.
        """
        try:
            return self._run()
        except Exception as err:  # pylint: disable=broad-except
            fault = storage_fault(err, member=self.cluster.member_name,
                                  checkpoint_step=self.checkpointer.resume_step)
            if fault is None:
                raise
            raise fault from None

    def _run(self) -> dict | None:
        trainer, finished, begun = self.trainer, False, False
        try:
            try:
                self.callbacks.train_begin()
                begun = self._first_call()
                self._loop()
                trainer.finish_training()
                self.callbacks.train_end(self.metrics)
                finished = True
            except Preempted as err:
                # One typed record of the saved step, however the preemption
                # ended the run (the ps chief's drain below, the sync
                # strategies' handler inside a call).
                self.reporter.events.emit(protocol.PREEMPTED, err.step, pid=os.getpid(),
                                          resumed_from=trainer.start_step)
                raise
            except trainer.lost_member_errors as err:
                if self.cluster.is_local:
                    raise
                raise task_lost(err, self.cluster, "training" if begun else "starting",
                                trainer.completed, self.checkpointer.saved_at) from None
        finally:
            if self.profiler is not None:
                # A run shorter than B, or one that failed; the serving tasks'
                # traces are waited for here, as the chief's own work.
                with trainer.paused():
                    self.profiler.close()
            trainer.close(finished)
        train_seconds, examples_per_sec = self.reporter.throughput.overall(trainer.completed)
        if not trainer.is_chief:
            if self.reporter.evaluates and trainer.task.not_evaluated is None:
                # Its share of the final evaluation, at the point the chief's _finish makes it.
                self._final_evaluation()
            trainer.finish_worker()
            trainer.end_of_job()
            return None
        results = self._finish(train_seconds, examples_per_sec)
        trainer.end_of_job()
        if self.export_failed is not None:
            raise self.export_failed
        return results

    def _first_call(self) -> bool:
        """The first call traces and connects: the last point where a missing
        peer can leave us waiting, and startup time rather than throughput."""
        step = self.trainer.completed
        if step < self.schedule.total_steps:
            self._call(step)
            self.metrics = self.trainer.drain()
        self.started_ok()
        self.trainer.on_started()
        with self.trainer.paused():  # the chief's own work, as an evaluation
            # Every evaluating member is here: its evaluation is prepared (traced) now, in
            # the startup, where a collective it needs meets the other members'.
            self.reporter.prepare_evaluation()
        self.startup_seconds = time.perf_counter() - self.started
        self.steady_from = self.trainer.completed
        self.reporter.steady_from(self.steady_from)
        self._settling = self.trainer.settling
        if step < self.schedule.total_steps:
            self._after_call(step, step + self.schedule.call_size(step))
        return True

    def _loop(self) -> None:
        trainer, schedule = self.trainer, self.schedule
        step = trainer.completed
        while step < schedule.total_steps:
            if trainer.stop_requested():
                self._preempt()
            if self.callbacks.stop_requested():
                self._stop_early()
                break
            before = step
            step = self._call(step)
            if self._settling and not trainer.settling:
                # The steady state begins here (auto's trial is over): the rates,
                # and steady_steps, count from this call on.
                self._settling = False
                self.steady_from = step
                self.reporter.rates_from(step)
            if self._drain_due(before, step):
                self.metrics = trainer.drain()
            self._after_call(before, step)
        self.metrics = trainer.drain()

    def _drain_due(self, before: int, after: int) -> bool:
        """Drain after this call? Before checkpoints, evaluations and the end; and
        where a call may leave an update pending, before anything else that reads
        the weights too (callbacks at progress lines, periodic exports). Decided
        from the schedule and the flags alone, the same on every worker: a drain
        may be a collective."""
        schedule, trainer = self.schedule, self.trainer
        if schedule.drain_due(before, after) or trainer.stop_requested():
            return True
        return trainer.leaves_update_pending and schedule.weights_read_due(before, after)

    def _call(self, step: int) -> int:
        n = self.schedule.call_size(step)
        if step % self.schedule.steps_per_epoch == 0:
            if getattr(self.trainer.train_metrics, "own_step", False):
                # As fit: a model's own step logs its metrics' running means over the epoch.
                self.trainer.state.model.reset_metrics()
            self.callbacks.epoch_begin(step // self.schedule.steps_per_epoch)
        if self.profiler is None:
            self.metrics = self.trainer.train(n)
            return step + n
        with self.trainer.paused():  # starting the profiler takes a while
            self.profiler.before_call(step, n)
        with self.profiler.step_marker(step):
            self.metrics = self.trainer.train(n)
        with self.trainer.paused():
            self.profiler.after_call(step + n, self._drain)
        return step + n

    def _drain(self) -> None:
        self.metrics = self.trainer.drain()

    def _after_call(self, before: int, after: int) -> None:
        schedule, trainer = self.schedule, self.trainer
        if schedule.log_due(before, after):
            text, fields = trainer.progress_fields()
            metrics = self.metrics
            self.reporter.progress(trainer.completed, metrics, text, fields,
                                   learning_rate=self.plan.learning_rate_at(trainer.completed))
            self._check_finite(metrics)
            self.callbacks.batch_end(trainer.completed, metrics)
        if self.reporter.evaluates and schedule.eval_due(before, after):
            with trainer.paused():  # the chief's own work, not a stuck peer
                self.reporter.evaluate(after, trainer.state.model)
        if self.exporter is not None and schedule.export_due(before, after):
            with trainer.paused():  # the chief's own work, as an evaluation
                self.exporter.periodic(trainer.state.model,
                                       int(trainer.state.global_step.numpy()))
        validation = {}
        if self.reporter.evaluates and trainer.task.has_validation and (
                schedule.epoch_ends(before, after) or schedule.eval_due(before, after)):
            with trainer.paused():  # fit's validation_data, at every epoch end
                validation = self.reporter.validate(after, trainer.state.model)
        if self.callbacks and schedule.epoch_ends(before, after):
            self.callbacks.epoch_end(schedule.epoch(after) - 1, {**self.metrics,
                                                                 **validation})
        if schedule.log_due(before, after) or schedule.epoch_ends(before, after):
            self.callbacks.agree()  # every worker hears the chief's stop and rate
        if schedule.checkpoint_due(after):
            with trainer.saving(after):
                self.checkpointer.save(after)
        if trainer.stop_requested():
            self._preempt()

    def _check_finite(self, metrics: dict) -> None:
        """Stop on a NaN or infinite loss: the one the progress line just read.

        Free (the value is already on the host), so checked at every progress
        line; the checkpointer checks the weights themselves before each save.
        """
        loss = metrics.get("loss")
        if loss is not None and not math.isfinite(loss):
            step = self.trainer.completed
            self.reporter.events.emit(protocol.DIVERGED, step, loss=loss)
            raise Diverged(f"the loss is {loss}", step, self.checkpointer.saved_at,
                           self.config.model_dir)

    def _stop_early(self) -> None:
        """A callback set ``model.stop_training``: checkpoint here, then evaluate as at the end."""
        self.trainer.drain()
        done = self.trainer.completed
        if self.checkpointer.saved_at != done:
            with self.trainer.saving(done):
                self.checkpointer.save(done)
        print(f"stopped by {self.callbacks.stopped_by} at step {done} of "
              f"{self.schedule.total_steps} (epoch {self.schedule.epoch(done)})", flush=True)

    def _preempt(self) -> None:
        self.trainer.drain()
        done = self.trainer.completed
        with self.trainer.saving(done):
            self.checkpointer.save(done)
        raise Preempted(done)

    def _finish(self, train_seconds: float, examples_per_sec: float) -> dict:
        """Evaluate a local copy of the weights; write the chief's outputs, in order:
        the results record (``reporting.results_record``), ``model.keras`` (saved whole
        or not at all, ``checkpoints.save_model``), the export, ``results.json``."""
        trainer, reporter, model_dir = self.trainer, self.reporter, self.config.model_dir
        seconds = reporter.clock()
        not_evaluated = trainer.task.not_evaluated
        if not_evaluated is None:
            values = self._final_evaluation()
        else:  # Keras's evaluate cannot run on it: the weights only, said in one line
            values = {}
            local_copy(trainer.state.model, reporter.evaluator().local)
            print(f"not evaluated: {not_evaluated}", flush=True)
        model = reporter.evaluator().local
        specific = trainer.result_fields(trainer.completed - trainer.start_step)
        reporter.add_point(specific["global_steps"], split_metrics(values)[1], seconds)
        times = RunTimes(startup=self.startup_seconds, train=train_seconds,
                         wall=time.perf_counter() - self.started,
                         steady_steps=trainer.completed - self.steady_from,
                         examples_per_sec=examples_per_sec)
        results = results_record(self.plan, trainer, reporter, model, values, specific, times,
                                 self.callbacks.stopped_by, self.metrics, not_evaluated)
        unsaved = save_model(model, model_dir)
        if unsaved is not None:
            print(f"warning: model.keras not saved: Keras cannot serialize the model "
                  f"({unsaved}); its weights are in checkpoints/", flush=True)
            results = dataclasses.replace(results, extra={
                **results.extra, "model_keras_not_saved": unsaved})
        results = self._export(model, specific["global_steps"], results)
        results.write(os.path.join(model_dir, "results.json"))
        reporter.final(results.to_dict())
        return results.to_dict()

    def _final_evaluation(self) -> dict[str, float]:
        """The final evaluation (shared with the other members where they share it:
        a member lost meanwhile fails it as it would fail a step)."""
        trainer = self.trainer
        try:
            return self.reporter.evaluator()(trainer.state.model)
        except trainer.lost_member_errors as err:
            if self.cluster.is_local:
                raise
            raise task_lost(err, self.cluster, "evaluating", trainer.completed,
                            self.checkpointer.saved_at) from None

    def _export(self, model, step: int, results: protocol.Results) -> protocol.Results:
        """``--export``: the SavedModel of ``model`` at ``step``, its record in ``results``;
        a failure is kept and raised once every task is done."""
        if self.exporter is None:
            return results
        try:
            return dataclasses.replace(results, export=self.exporter.export_local(model, step))
        except ExportFailed as err:
            self.export_failed = err
            return results
