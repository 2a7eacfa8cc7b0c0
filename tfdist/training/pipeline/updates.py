"""What the pipeline's update takes of Keras's optimizer options, across stages.

Each stage has its own optimizer (``training.pipeline.pipeline_trainer``), a
copy of the task's compiled one. Most of Keras's options act per variable
and so hold per stage as they are: ``clipnorm``, ``clipvalue``,
``weight_decay``, ``use_ema`` (each stage keeps the moving averages of its
own variables; ``finish_training`` writes them into every stage at the end,
as ``fit`` does). Three act on the model as a whole, and are done here:

- ``global_clipnorm``: the norm is the whole model's. Each stage's optimizer
  has it switched off; each stage sums its gradients' squares on its own
  task, the S sums are added on the copy's last stage (one scalar in and one
  out per stage), and every stage scales its gradients by Keras's factor
  (``clip_by_global_norm``: ``clip * min(1 / norm, 1 / clip)``, NaN for a
  non-finite norm).
- ``LossScaleOptimizer``: every stage's optimizer is one (rebuilt from the
  compiled one's config), each with its own dynamic scale. The last stage's
  scale multiplies the loss, and every stage's regularization losses are
  scaled by its own; the scales stay equal because every stage takes the
  same decision each step: a stage's gradients are multiplied by NaN when
  any stage's are not finite (a flag per stage, added on the last stage),
  so each stage's optimizer skips the update and halves its scale exactly
  when the others do, and doubles it at the same count.
- ``gradient_accumulation_steps``: the optimizer's own accumulation is
  switched off; the pipeline step takes N batches as N x M micro-batches and
  applies their mean once (``PipelineTrainer``), Keras's update.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.training.loop.state import make_optimizer, without_accumulation
from tfdist.training.workload import contract


def global_clipnorm(optimizer) -> float | None:
    """The task's optimizer's ``global_clipnorm`` (its inner one's for a LossScaleOptimizer)."""
    for o in contract.with_inner(optimizer):
        if getattr(o, "global_clipnorm", None):
            return float(o.global_clipnorm)
    return None


def stage_optimizer(plan, task_model):
    """One stage's optimizer: the plan's, or a copy of the task's compiled one with
    its own accumulation and global clipping off (the pipeline step does both)."""
    o = plan.optimizer
    if o.library:
        # A schedule counts batches (loop.step.schedule_in_batches): N per update.
        return make_optimizer(o.name, o.learning_rate, o.schedule,
                              plan.total_steps * plan.accumulation_steps)
    own = task_model.optimizer
    opt = type(own).from_config(own.get_config())
    without_accumulation(opt)
    for inner in contract.with_inner(opt):
        inner.global_clipnorm = None
    return opt


def loss_scaled(optimizer) -> bool:
    return getattr(optimizer, "inner_optimizer", None) is not None


def agree_and_clip(means, optimizers, devices, clipnorm: float | None) -> list:
    """``means[s][p]`` (stage s's gradients on copy p) with the whole model's
    decisions applied: the global norm's clipping and, under loss scaling, NaN
    everywhere when any stage's gradients are not finite. Per copy, on its tasks;
    the copies hold the same means, so they decide the same."""
    S, P = len(means), len(means[0])
    scaled = loss_scaled(optimizers[0][0])
    if clipnorm is None and not scaled:
        return means
    out = [[None] * P for _ in range(S)]
    for p in range(P):
        last = devices[p][S - 1][1]
        squares, finite = [], []
        for s in range(S):
            with tf.device(devices[p][s][1]):
                grads = [tf.cast(g, tf.float32) for g in means[s][p]]
                if clipnorm is not None:
                    total = tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])
                    if scaled:  # the norm of the unscaled gradients, as Keras clips them
                        total = total / tf.square(
                            tf.cast(optimizers[p][s].dynamic_scale, tf.float32))
                    squares.append(total)
                if scaled:
                    finite.append(tf.reduce_all([tf.reduce_all(tf.math.is_finite(g))
                                                 for g in grads]))
        with tf.device(last):
            factor = tf.constant(1.0)
            if clipnorm is not None:
                norm = tf.sqrt(tf.add_n(squares))
                # keras.src.optimizers.base_optimizer.clip_by_global_norm's factor.
                factor = clipnorm * tf.minimum(1.0 / norm, 1.0 / clipnorm) + (norm - norm)
            if scaled:
                factor = tf.where(tf.reduce_all(finite), factor, float("nan"))
        for s in range(S):
            with tf.device(devices[p][s][1]):
                out[s][p] = [g * tf.cast(factor, g.dtype) for g in means[s][p]]
    return out


def finish_training(copies, optimizers) -> None:
    """``fit``'s end for every stage of every copy: ``use_ema``'s averages written
    into the weights (``contract.finish_training``, per stage optimizer)."""
    for row, opts in zip(copies, optimizers):
        for stage, opt in zip(row, opts):
            contract.finish_training(stage, opt)


class StageOptimizers:
    """Every stage's optimizer, of every copy, as the one optimizer whose learning
    rate a Keras callback reads and sets (``training.loop.callbacks``)."""

    def __init__(self, optimizers):
        self.all = [o for row in optimizers for o in row]

    @property
    def _learning_rate(self):
        first = self.all[0]
        return getattr(first, "inner_optimizer", first)._learning_rate

    @property
    def learning_rate(self):
        return self.all[0].learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        for o in self.all:
            o.learning_rate = value
