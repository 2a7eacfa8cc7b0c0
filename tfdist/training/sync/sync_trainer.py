"""The trainer of synchronous strategies (none, mirrored, multiworker).

Every task runs every step; ``train(n)`` is one call of ``n`` steps. A
SIGTERM to any worker makes every worker save at one agreed call and stop
(``Preempted``, through TensorFlow's PreemptionCheckpointHandler).
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import time

import numpy as np
import tensorflow as tf

from tfdist.protocol import ConfigError
from tfdist.training.workload import data
from tfdist.training.loop.evaluation import EvalMembers, local_copy, weights_sha256
from tfdist.training.loop.lifetime import keep_alive_until_exit
from tfdist.strategies.kinds import DEFAULT_BUCKET_BYTES
from tfdist.training.sync import carried, zero, zero3
from tfdist.training.sync.carry_trial import CARRIED, CarryTrial
from tfdist.training.sync.preemption import preemption_handler
from tfdist.training.loop.step import make_replica_sum, make_step_fn, make_train_fn, xla_part
from tfdist.training.loop.survival.lost import LOST_MEMBER_ERRORS
from tfdist.training.loop.reporting import own_peak_rss
from tfdist.training.loop.trainer import Trainer



def agree_on_start_step(strategy, step: int, me: str, tasks: list[str], model_dir: str) -> None:
    """Refuse to train unless every worker resumed from the same step.

    Each worker restores from ``--model-dir`` itself; where that is not
    shared storage, a worker sees no checkpoint (or an old copy) and would
    train on from other weights while the all-reduce hides it. One all-gather
    of the restored step, once at start: every worker gets the same list and
    so reaches the same verdict (ConfigError, exit 2, nothing trained).
    """
    values = strategy.experimental_distribute_values_from_function(
        lambda _: tf.constant([step], tf.int64))
    steps = [int(s) for s in strategy.gather(values, axis=0).numpy()]
    if len(set(steps)) == 1:
        return
    # Replicas are ordered by task (chief first), then by local device.
    per_task = max(1, len(steps) // len(tasks))
    by_task = {tasks[min(i // per_task, len(tasks) - 1)]: s for i, s in enumerate(steps)}
    found = ", ".join(f"{task} at step {s}" for task, s in by_task.items())
    raise ConfigError(
        f"{me}: the workers resumed from different checkpoints ({found}): "
        f"--model-dir {model_dir!r} must be the same shared storage on every task, holding "
        "the chief's checkpoints; put it on a shared file system, or copy the chief's "
        "checkpoints/ to every host before relaunching"
    )


def make_statistics_sync(strategy, variables):
    """A call that sets each variable to its mean over every replica.

    For what layers update outside the gradients (BatchNormalization's moving
    mean and variance): Keras 3 creates them without an aggregation, so under
    an all-reduce strategy each replica keeps its own. Averaged whenever the
    controller drains (before every checkpoint, evaluation and the end), the
    saved, evaluated and hashed weights are the same on every worker, for one
    small collective per drain instead of one per step.
    """

    @tf.function
    def sync():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            means = ctx.all_reduce(tf.distribute.ReduceOp.MEAN,
                                   [tf.identity(v.value) for v in variables])
            for var, mean in zip(variables, means):
                var.assign(mean)

        strategy.run(replica_fn)

    return sync


class SyncTrainer(Trainer):
    """``none``, ``mirrored``, ``multiworker``: every task runs every step in lockstep.
    Owns the distributed dataset and its iterator, the compiled call of ``n`` steps, the
    agreed start step, TensorFlow's preemption handler and the end-of-job barrier."""

    lost_member_errors = LOST_MEMBER_ERRORS

    @staticmethod
    def build_state(plan, task, strategy, example=None, own_optimizers=None):
        """The whole model; with ``--shard-state``, the optimizer's slots as this worker's
        shard (``sync.zero``; the weights too: ``sync.zero3``)."""
        from tfdist.training.loop.state import build_state

        shard = None
        if plan.shard_state != "off":
            members = plan.kind.training_members(plan.cluster)

            def shard(optimizer, model):
                member = members.index(plan.cluster.member_name)
                if plan.shard_state == "weights":
                    return zero3.WeightShardedState(strategy, optimizer, model.trainable_variables,
                                                    member, plan.config.bucket_bytes, model,
                                                    plan.accumulation_steps)
                return zero.ShardedState(plan.shard_state, strategy, optimizer,
                                         model.trainable_variables, member,
                                         plan.config.bucket_bytes)

        return build_state(plan, task, strategy, example, own_optimizers, shard)

    def __init__(self, *, plan, bundle, task, state, checkpointer, start_step, train_metrics):
        super().__init__(plan=plan, bundle=bundle, task=task, state=state,
                         checkpointer=checkpointer, start_step=start_step,
                         train_metrics=train_metrics)
        strategy = bundle.strategy
        tasks = self.training_members()
        if len(tasks) > 1:
            agree_on_start_step(strategy, start_step, self.cluster.member_name, tasks,
                                self.config.model_dir)
        dataset_fn = data.make_dataset_fn(
            task.task, plan.global_batch_size, seed=self.config.seed,
            start_step=start_step * plan.accumulation_steps,  # a step takes N batches
            synthetic=self.config.synthetic_data, in_memory=plan.in_memory,
        )
        self._iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
        # From its creation on, so an error path that drops the trainer is covered too.
        keep_alive_until_exit(self._iterator)
        self._plain_fn = self._make_calls(strategy, plan, state, train_metrics)
        if self._carried is not None:
            self._carried.trace(self._iterator)
        self._out = None
        statistics = [v for v in state.model.non_trainable_variables
                      if tf.as_dtype(v.dtype).is_floating]
        self._sync_statistics = (make_statistics_sync(strategy, statistics)
                                 if statistics and strategy.num_replicas_in_sync > 1 else None)
        # As early as the coordination service allows (the strategy is up, so
        # every peer is): until the handler takes SIGTERM over, TensorFlow's
        # own notifier swallows it and the preemption would go unnoticed.
        self._previous_sigterm = signal.getsignal(signal.SIGTERM)
        self._handler = self._preemption_handler(strategy)

    def training_members(self) -> list[str]:
        """The tasks that run this loop's steps in lockstep (the strategy kind's)."""
        return self.bundle.kind.training_members(self.cluster)

    def _xla_part(self, model) -> str | None:
        """What of the step XLA compiles for a ``jit_compile=True`` model (``xla_part``)."""
        return xla_part(model, self.bundle.kind)

    def _preemption_handler(self, strategy):
        """TensorFlow's preemption handler over the training tasks (``sync.preemption``)."""
        return preemption_handler(strategy, self._save_preempted, lambda: self.completed)

    _carried = None  # sync.carried's calls, where each step's all-reduce is carried over
    _carrying = False  # the calls run the carried step (else the plain one)
    _trial = None  # --carry-all-reduce auto, until it has chosen (sync.carry_trial)
    _trial_result = None
    # Carried calls run so far: the first starts afresh and the second resumes,
    # each the first run of its function (slow: instantiated then).
    _carried_calls = 0

    @property
    def settling(self) -> bool:
        return self._trial is not None or (self._carrying and self._carried_calls < 2)

    @property
    def leaves_update_pending(self) -> bool:
        return self._carried is not None and self._carried.pending

    def _make_calls(self, strategy, plan, state, train_metrics):
        """The plain call of ``n`` steps, returned; and where ``--carry-all-reduce``
        is on or auto (multiworker's default), the carried one (``sync.carried``)
        beside it. Auto keeps the plain step for a model the carried one cannot cut."""
        dtype, n = self.config.gradient_dtype, plan.accumulation_steps
        if state.sharded is not None:  # the sharded step; nothing to carry
            state.sharded.start()
            return state.sharded.make_train_fn(state, train_metrics, dtype, n)
        jit = self._xla_part(state.model)
        plain = make_train_fn(strategy, make_step_fn(state, train_metrics, dtype, n, jit), state,
                              len(train_metrics.names), batches_per_step=n)
        # The plan refuses the flag where gradients are not all-reduced between processes.
        mode = self.config.carry_all_reduce or (
            "auto" if self.bundle.kind.buckets_all_reduce else "off")
        if mode == "off":
            return plain
        split = carried.split_for(state, strategy, train_metrics, dtype,
                                  self.config.bucket_bytes or DEFAULT_BUCKET_BYTES)
        if not isinstance(split, carried.Split):
            if mode == "on":
                raise ConfigError(f"--carry-all-reduce on cannot be honoured: {split}; "
                                  "drop the flag")
            return plain
        self._carried = carried.CarriedCalls(strategy, state, train_metrics, split, dtype, n)
        self._carrying = mode == "on"
        self._trial = CarryTrial() if mode == "auto" else None
        return plain

    def _save_preempted(self) -> None:
        """The preemption handler's save, at the call every worker agreed on."""
        if self._carried is not None:
            self._carried.flush()
        self.checkpointer.save(self.completed)

    def train(self, num_steps: int) -> dict[str, float]:
        trial = self._trial
        carrying = self._carrying if trial is None else trial.next_kind() == CARRIED
        if not carrying and self._carried is not None and self._carried.pending:
            self._carried.flush()  # the plain step reads every weight: apply the pending update
        fn = self._carried.train_fn if carrying else self._plain_fn
        self._carried_calls += carrying
        n, began = tf.constant(num_steps), time.perf_counter()
        # The handler checks for a preemption notice (any worker's) before
        # the call; at the agreed call it saves and raises Preempted.
        if self._handler is None:
            self._out = fn(self._iterator, n)
        else:
            self._out = self._handler.run(fn, self._iterator, n)
        metrics = self._metrics()  # its values read: the call has finished
        self.completed += num_steps
        if trial is not None:
            trial.record(num_steps, time.perf_counter() - began)
            if trial.next_kind() is None:
                self._choose(trial)
        return metrics

    def _choose(self, trial: CarryTrial) -> None:
        """The trial's verdict, from every worker's times summed: the same on all."""
        strategy = self.bundle.strategy
        total = make_replica_sum(strategy)(tf.constant(trial.totals(), tf.float64))
        summed = [float(v) for v in total.numpy()]
        self._trial_result = trial.choose(summed, strategy.num_replicas_in_sync)
        self._carrying, self._trial = self._trial_result.carried, None
        if self.is_chief:
            print(self._trial_result.line(), flush=True)

    def drain(self) -> dict[str, float]:
        """Each call returns with its steps applied; the replicas' statistics are averaged."""
        if self._carried is not None:
            self._carried.flush()
        if self._sync_statistics is not None:
            self._sync_statistics()
        self._peaks = self._gather_peaks()
        return self._metrics()

    _peaks: dict | None = None  # {worker: peak resident bytes} as of the last drain

    def _gather_peaks(self) -> dict[str, int]:
        """Every worker's peak resident memory so far (``VmHWM``), by one small gather
        at each drain, so the chief's results record holds every worker's."""
        own = own_peak_rss()
        tasks = self.training_members()
        if not self.in_lockstep():
            return {self.cluster.member_name: own}
        strategy = self.bundle.strategy
        values = strategy.experimental_distribute_values_from_function(
            lambda _: tf.constant([own], tf.int64))
        peaks = [int(p) for p in strategy.gather(values, axis=0).numpy()]
        per_task = max(1, len(peaks) // len(tasks))  # replicas by task, chief first
        return {tasks[min(i // per_task, len(tasks) - 1)]: p for i, p in enumerate(peaks)}

    def _state_bytes(self) -> dict[str, int]:
        """Bytes of training state each worker holds at once (every worker the same)."""
        if self.state.sharded is not None:
            return self.state.sharded.state_bytes(self.config.gradient_dtype)
        params = sum(int(np.prod(v.shape)) for v in self.state.model.trainable_variables)
        slots = sum(4 * int(np.prod(v.shape)) for v in self.state.optimizer.variables
                    if len(v.shape) > 0)  # iterations and the rate are scalars
        return {"weights": 4 * params,
                "gradients": tf.as_dtype(self.config.gradient_dtype).size * params,
                "slots": slots}

    def stop_requested(self) -> bool:
        return False  # the preemption handler stops the run itself

    def in_lockstep(self) -> bool:
        return len(self.training_members()) > 1

    def evaluation_members(self) -> EvalMembers | None:
        """Every training task, when there are several (multiworker): each evaluates
        its range of the split's batches, one all-reduce sums the metrics' states."""
        names = self.training_members()
        if len(names) < 2 or self.config.evaluate_on == "chief":
            return None
        total = make_replica_sum(self.bundle.strategy, once_per_task=True)
        return EvalMembers(tuple(names), names.index(self.cluster.member_name), self.is_chief,
                           lambda values: total(tf.constant(values, tf.float64)).numpy())

    def _metrics(self) -> dict[str, float]:
        if self._out is None:
            return {}
        return self.train_metrics.logs(self._out["loss"], self._out["metrics"])

    def result_fields(self, ran: int) -> dict:
        return {
            "global_steps": int(self.state.global_step.numpy()),
            "all_reduce_carried": self._carrying,
            "carry_trial": (None if self._trial_result is None
                            else dataclasses.asdict(self._trial_result)),
            "steps_per_worker": {name: ran for name in self.training_members()},
            "shard_state": self.plan.shard_state,
            "state_bytes": {name: self._state_bytes()
                            for name in self.training_members()},
            "peak_rss_bytes_per_worker": self._peaks,
        }

    def finish_worker(self) -> None:
        """A non-chief worker's last line: its step count and weights fingerprint."""
        digest = weights_sha256(local_copy(self.state.model, self.task.local_model))
        print(f"{self.cluster.member_name} done: global_steps={int(self.state.global_step.numpy())} "
              f"weights_sha256={digest}", flush=True)

    def end_of_job(self) -> None:
        """Every worker meets here after the chief has written its results, so
        none leaves while another still needs it; then each exits normally.

        The preemption handler's threads are stopped before (``close``): they
        read the key-value store of the chief's coordination service.
        """
        if len(self.training_members()) < 2:
            return
        from tensorflow.python.eager import context

        try:
            context.context().wait_at_barrier(
                "end_of_job", int(self.config.startup_timeout * 1000))
        except Exception:  # pylint: disable=broad-except
            # A peer already gone: the barrier fails once its heartbeat times
            # out. Nothing is left to do together; leave.
            pass

    def close(self, finished: bool) -> None:
        if self._handler is not None:
            if finished:
                self._handler.close()
            shutil.rmtree(self._handler.counter_dir, ignore_errors=True)
            # The handler took over SIGTERM; a caller (a test, a notebook)
            # gets its own back.
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._handler = None
        self.checkpointer.close()
