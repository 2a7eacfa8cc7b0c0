"""Build a run's ready-made objects and hand them to the one controller.

Flax's ``train_and_evaluate``: the state, the checkpointer, the strategy's
trainer (chosen by ``RunPlan.trainer``: the kind's) and the reporter, then
``Controller.run()``. This is the one module that names every trainer, so the
loop (``training.loop``) never imports a strategy's sub-package.
"""

from __future__ import annotations

import os
import time

import keras

from tfdist import protocol
from tfdist.protocol import ConfigError
from tfdist.training.loop.survival.checkpoints import Checkpointer
from tfdist.training.loop.controller import Controller
from tfdist.training.loop.export import export_finished_run
from tfdist.training.loop.lifetime import keep_alive_until_exit
from tfdist.training.loop.reporting import Reporter
from tfdist.training.loop.step import TrainMetrics
from tfdist.training.loop.trainer import Trainer
from tfdist.training.pipeline.pipeline_trainer import PipelineTrainer
from tfdist.training.pipeline.placed import Placed
from tfdist.training.ps.ps_sync_trainer import PsSyncTrainer
from tfdist.training.ps.ps_trainer import PsTrainer
from tfdist.training.sync.sync_trainer import SyncTrainer



class PlacedTrainer(Placed, SyncTrainer):
    """A pipelined run's model the cut cannot carry: the ``none`` loop's trainer over the
    model placed on the workers (``training.pipeline.placed``)."""


# Each strategy kind names its loop (StrategyKind.trainer); the classes are named here,
# on the training side, so strategies/ never names a training module.
TRAINERS: dict[str, type[Trainer]] = {"sync": SyncTrainer, "ps": PsTrainer,
                                      "ps-sync": PsSyncTrainer, "pipeline": PipelineTrainer,
                                      "placed": PlacedTrainer}



def train_and_evaluate(plan, bundle, checked, started_ok=lambda: None,
                       as_command: bool = False) -> dict | None:
    """Flax's entry point: build the ready-made objects, run the controller.

    ``checked``: the task, inspected (``training.workload.tasks.CheckedTask``).
    ``as_command``: the process ends right after this returns (or raises), so
    the run's TensorFlow objects are never torn down (``training.loop.lifetime``).
    """
    started = time.perf_counter()
    config, cluster = plan.config, plan.cluster
    trainer = None
    try:
        keras.utils.set_random_seed(config.seed)
        trainer_class = TRAINERS[plan.trainer]
        state = trainer_class.build_state(plan, checked.task, bundle.strategy, checked.example,
                                          checked.own_optimizers)
        checkpointer = Checkpointer(state, config.model_dir, cluster.is_chief, cluster.member_name,
                                    run_record=plan.defining_flags())
        try:
            start = checkpointer.restore(plan.task.name, plan.total_steps, plan.optimizer.name)
            trainer = trainer_class(
                plan=plan, bundle=bundle, task=checked, state=state, checkpointer=checkpointer,
                start_step=start,
                train_metrics=TrainMetrics(checked.local_model, checked.own_step_names))
        except ConfigError:
            checkpointer.close()  # a worker's private directory
            raise
        if already_complete(plan, trainer, started_ok):
            results = read_results(config) if trainer.is_chief else None
            failed = None
            if results is not None and config.export:
                results, failed = export_finished_run(config, checked, state, results)
            trainer.end_of_job()
            if failed is not None:
                raise failed
            return results
        reporter = Reporter(plan, checked, cluster.member_name, trainer.is_chief, trainer.start_step,
                            started, members=trainer.evaluation_members())
        return Controller(plan, trainer, checkpointer, reporter, started, started_ok).run()
    finally:
        if as_command:
            keep_alive_until_exit(bundle)
            if trainer is not None:
                keep_alive_until_exit(trainer)


def read_results(config) -> dict | None:
    """The run's results record, read through ``protocol.Results``; ``None`` when there is
    none, or what is there is not a results record this code reads."""
    try:
        return protocol.Results.load(os.path.join(config.model_dir, "results.json")).to_dict()
    except (OSError, ValueError, TypeError):
        return None


def already_complete(plan, trainer, started_ok=lambda: None) -> bool:
    """Whether this task resumed a finished run and stops here, results.json untouched.

    Running the controller would write a second results record for zero
    steps (examples/s 0) over the one that measured the run. Every worker
    resumed at the same step (checked), so every worker stops here; the chief
    without a record (it died after the last checkpoint) runs the controller,
    which evaluates and writes it.
    """
    config = plan.config
    if trainer.start_step < plan.total_steps:
        return False
    if trainer.is_chief and read_results(config) is None:
        return False
    print(f"the run in {config.model_dir!r} is already complete (step {trainer.start_step} of "
          f"{plan.total_steps}); its results are kept as they are. Pass a larger --steps or "
          "--epochs to train on, or a fresh --model-dir to start a new run", flush=True)
    started_ok()
    trainer.close(True)
    protocol.EventLog(config.cluster.member_name).emit(protocol.DONE, trainer.start_step,
                                                     already_complete=True)
    return True
