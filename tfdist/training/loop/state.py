"""Model, optimizer and step counters, created under one strategy scope.

The step counter is our own variable because Keras 3's
``optimizer.iterations`` loses increments under asynchronous
parameter-server updates.
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import tensorflow as tf

from tfdist.protocol import ConfigError
from tfdist.training import sharding
from tfdist.training.workload import contract


def make_optimizer(name: str, learning_rate: float, schedule: str = "constant",
                   total_steps: int = 1) -> keras.optimizers.Optimizer:
    lr = learning_rate
    if schedule == "cosine":
        # Decaying to zero over the run helps the last steps settle (see the
        # benchmark notes), for a few scalar ops per step.
        lr = keras.optimizers.schedules.CosineDecay(lr, decay_steps=max(1, total_steps))
    if name == "adam":
        return keras.optimizers.Adam(lr)
    return keras.optimizers.SGD(lr)


def without_accumulation(optimizer) -> None:
    """Keras's own gradient accumulation off (the library's step accumulates)."""
    for o in contract.with_inner(optimizer):
        if getattr(o, "gradient_accumulation_steps", None):
            o.gradient_accumulation_steps = None


@dataclass
class TrainState:
    """Model, optimizer and counters, created under one strategy scope."""

    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    global_step: tf.Variable
    # Requested steps done: the run's (and the data's) position. Equal to
    # global_step under sync strategies; under ps global_step also counts the
    # updates of closures that ran twice after a worker was lost.
    completed_steps: tf.Variable
    checkpoint: tf.train.Checkpoint
    # --shard-state: this worker's shard of the training state (training.sync.zero's
    # ShardedState; its ``gathered()`` wraps every checkpoint save); None: not sharded.
    sharded: object = None


def build_model(task, example=None):
    """The task's model with its variables made: one not built yet (subclassed: its
    layers make their variables on the first call) is called on ``example``'s
    features, as ``fit`` builds it on the first batch; a model without a ``call``
    of its own (a GAN's, whose ``train_step`` calls its sub-models) is not called."""
    model = task.build_model()
    if example is not None and (not model.built or not model.trainable_variables) and (
            contract.overrides(model, "call") or not model.trainable_variables):
        model(contract.features_of(example), training=False)
    return model


def build_state(plan, task, strategy, example=None, own_optimizers=None,
                shard=None) -> TrainState:
    """The task's model, the plan's optimizer and the step counters, in ``strategy``'s scope.

    ``example``: a batch of one training element (``CheckedTask.example``), on
    which a model not built yet is called (``build_model``) before the optimizer
    is built; otherwise the optimizer would know none of its variables.

    ``own_optimizers`` (``CheckedTask.own_optimizers``): the other optimizers
    the model's own ``train_step`` applies (a GAN's ``d_optimizer``,
    ``g_optimizer``), each built here with the variables it updates: their
    slots are made where the strategy puts variables (replicated, or on the
    ps), before a checkpoint restore fills them, and the checkpoint holds
    them (the model tracks its attributes). ``shard(optimizer, model)`` (``--shard-state``)
    builds the optimizer outside the scope and returns this worker's shard of the state.
    """
    policy = sharding.ShardingPolicy(plan.sharding.partitioner, plan.sharding.num_shards,
                                     plan.sharding.min_bytes)
    with strategy.scope():
        # The task compiles its model with its own optimizer; the library's
        # replaces it where the plan says so (built-in tasks, or a flag).
        # Large Embedding tables and Dense kernels are split over the ps tasks
        # as they are built (training.sharding: Keras 3 cannot train
        # TensorFlow's own partitioned variables).
        try:
            with sharding.sharding_scope(policy):
                model = build_model(task, example)
        except sharding.ShardingError as err:
            raise ConfigError(f"task {plan.task.name}: {err}") from None
        opt = model.optimizer
        if plan.optimizer.library:
            o = plan.optimizer
            # A schedule counts batches (loop.step.schedule_in_batches), as Keras's
            # does with gradient accumulation: N of them per step.
            opt = make_optimizer(o.name, o.learning_rate, o.schedule,
                                 plan.total_steps * plan.accumulation_steps)
            model.optimizer = opt
        if plan.accumulation_steps > 1 or plan.config.gradient_accumulation_steps is not None:
            # The library's step sums the gradients of the step's batches and
            # applies their mean once (loop.step): Keras's own accumulation
            # would all-reduce inside a tf.cond that tf.distribute cannot trace.
            # Its iterations then count updates, as Keras's do with accumulation;
            # every optimizer a model's own train_step applies (loop.step.DirectApply).
            for o in (opt, *(getattr(model, attr) for attr in own_optimizers or {})):
                without_accumulation(o)
        if shard is None:  # slots must exist before a checkpoint restore can fill them
            opt.build(model.trainable_variables)
        for attr, positions in (own_optimizers or {}).items():
            getattr(model, attr).build([model.trainable_variables[i] for i in positions])
        if plan.kind.min_ps:  # on the ps, row-sparse gradients update only their rows
            sharding.sparse_updates(opt)  # (Adagrad; SGD already does)
        # Updated in cross-replica context only (see make_train_fn), so no
        # cross-replica aggregation is ever needed; ONLY_FIRST_REPLICA still
        # makes replica-context reads well defined.
        global_step = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="global_step",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        completed_steps = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="completed_steps",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
    sharded = None if shard is None else shard(opt, model)
    # Split variables are saved whole, so a run resumes on another number of ps.
    # A keras.random.SeedGenerator's state (a GAN's noise) is not reached through
    # the model's checkpoint dependencies; saved beside it, a resumed run draws
    # the noise an uninterrupted one would have.
    seeds = {"seed_states": seed_states} if (seed_states := [
        v for v in model.non_trainable_variables
        if v.path.endswith("seed_generator_state")]) else {}
    checkpoint = tf.train.Checkpoint(**sharding.checkpoint_objects(model, opt),
                                     global_step=global_step, completed_steps=completed_steps,
                                     **seeds)
    return TrainState(model, opt, global_step, completed_steps, checkpoint, sharded)
