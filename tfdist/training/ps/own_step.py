"""A model's own ``train_step`` under ``ps-sync``: the gradients it hands to
``optimizer.apply`` are what the worker queues on ps:0 for the K-of-N average.

The worker closure calls the model's ``train_step`` on its batch with every
optimizer's ``apply`` routed (``workload.apply_route``) to ``QueuedApply``:

- An update is the step's applies in order (``CheckedTask.own_applies``, seen
  when the task was checked: the model's optimizer once; a GAN's
  ``d_optimizer`` then ``g_optimizer``), each one K-of-N average on ps:0
  (``ps_sync_trainer.make_aggregate_fn``). Tokens are apply indices (the
  global step times the applies of an update, plus the apply), so with one
  apply an update a token is the global step, as for the library's step.
- An apply that is not the step's last queues its flat gradient (as
  ``--gradient-dtype``) on its own queue and waits for the token of the next
  apply: the code after it in ``train_step`` reads the weights that update
  left (a GAN's generator step sees the discriminator just trained, as under
  ``fit``). Everything the step traces after the wait depends on it.
- The last apply's gradient is queued once ``train_step`` returns, with its
  logs (the loss and metric values of the progress lines).
- ``gradient_accumulation_steps`` N: ``train_step`` runs on each of N batches;
  each apply's gradients are summed over them and the mean queued at the
  N-th (``loop.step.DirectApply.mean``): Keras's accumulation, one gradient
  on ps:0's queue per N batches.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.protocol import ConfigError
from tfdist.training.loop.step import DirectApply, own_train_steps


def slots_of(model, own_applies) -> list:
    """``[(optimizer, variables)]`` of the trained ``model``, in the order its own
    ``train_step`` applies them (``own_applies``: ``((attribute, positions), ...)``)."""
    variables = model.trainable_variables
    slots = [(getattr(model, attr), [variables[p] for p in positions])
             for attr, positions in own_applies]
    if not slots:
        raise ConfigError("the model's own train_step applied no optimizer when it was "
                          "checked: ps-sync has no gradient to average")
    return slots


def flat_gradient(grads, variables) -> tf.Tensor:
    """One float vector of ``grads`` in ``variables``' order (a variable the loss does
    not reach: zeros, as Keras's apply would leave it)."""
    return tf.concat([tf.reshape(tf.zeros(v.shape, v.dtype) if g is None
                                 else tf.convert_to_tensor(g), [-1])
                      for g, v in zip(grads, variables)], 0)


class QueuedApply:
    """The handler of a ps-sync worker's routed applies (module docstring)."""

    def __init__(self, q, slots, accumulation: int, num_metrics: int, take_token, stop: int):
        self.q, self.slots, self.num_metrics = q, slots, num_metrics
        self.sums = DirectApply(accumulation=accumulation)  # its mean() only
        self.take_token, self.stop = take_token, stop
        self.batch = 0
        self.token = self.worker = None
        self.last = None  # the last apply's flat gradient, queued with the logs
        self._entered: list = []

    def begin(self, token, worker) -> None:
        """A step on ``token`` (the apply index of its first apply) by ``worker``."""
        self.token, self.worker, self.last = token, worker, None

    def pending(self) -> list:
        return self.sums.pending()

    def __call__(self, slot, optimizer, grads, variables) -> None:
        if slot >= len(self.slots) or self.slots[slot][0] is not optimizer or [
                id(v) for v in self.slots[slot][1]] != [id(v) for v in variables]:
            raise ConfigError(
                f"the model's own train_step applied {optimizer.name} as apply {slot} of the "
                "step to other variables, or in another order, than when the task was "
                "checked; ps-sync averages each apply of a step on ps:0, so a train_step "
                "must make the same applies, in the same order, on every call")
        self.sums.batch = self.batch
        grads = self.sums.mean(slot, grads)
        if grads is None:
            return
        wire = tf.cast(flat_gradient(grads, variables), self.q.gradients[slot].dtypes[3])
        if slot == len(self.slots) - 1:
            self.last = wire
            return
        index = self.token + slot
        enqueued = self.enqueue(slot, index, wire, tf.constant(0.0),
                                tf.zeros([self.num_metrics]))
        with tf.control_dependencies([enqueued]):
            token = self.wait_for(index + 1)
        # What train_step traces from here on reads the weights the apply left.
        entered = tf.control_dependencies([token])
        entered.__enter__()
        self._entered.append(entered)

    def enqueue(self, slot, index, wire, loss, values):
        with tf.control_dependencies([wire]):
            after = self.q.applies.read_value()
        return self.q.gradients[slot].enqueue([index, self.worker, after, wire, loss, values])

    def wait_for(self, index):
        """The newest token of this worker once it reaches ``index`` (or STOP)."""

        def waiting(token):
            return tf.logical_and(tf.not_equal(token, self.stop), token < index)

        return tf.while_loop(waiting, lambda _: self.take_token(self.q, self.worker),
                             [self.take_token(self.q, self.worker)])[0]

    def close(self) -> None:
        """The train_step call returned: leave the waits' control dependencies."""
        while self._entered:
            self._entered.pop().__exit__(None, None, None)


def make_own_work_fn(strategy, model, train_metrics, q, slots, workers: int,
                     accumulation: int, *, take_token, stop: int, xla: bool = False):
    """The worker closure for a model's own train_step: take the newest token that
    starts an update, run the step on it (``QueuedApply``), queue its gradients.
    ``xla``: each call of the model compiled with XLA on values (jit_compile=True)."""
    n_slots = len(slots)

    def replica_step(token, worker, *batches):
        handler = QueuedApply(q, slots, accumulation, len(train_metrics.names), take_token,
                              stop)
        handler.begin(token, worker)
        # The step's weight reads come after the token (so after its update).
        with tf.control_dependencies([token]):
            logs = own_train_steps(model, handler, batches, xla)
        if handler.last is None:
            raise ConfigError("the model's own train_step made no apply; ps-sync has no "
                              "gradient to queue")
        loss = (tf.reshape(tf.cast(logs["loss"], tf.float32), []) if train_metrics.has_loss
                else tf.constant(0.0))
        return handler.enqueue(n_slots - 1, token + n_slots - 1, handler.last, loss,
                               train_metrics.logged_values(logs))

    @tf.function
    def work(iterator, num_tokens):
        worker = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(),
                         tf.int64)
        hot = tf.one_hot(worker, workers, dtype=tf.int64)
        taken = tf.constant(0, tf.int64)
        for _ in tf.range(num_tokens):
            if q.stopping.read_value():
                break
            token = take_token(q, worker)
            if token == stop:
                break
            with tf.control_dependencies([token]):
                index = q.applies.read_value()
            # Stale, or an apply in the middle of an update: not a step's start.
            if tf.logical_or(token < index, tf.math.floormod(token, n_slots) != 0):
                with tf.control_dependencies([q.skipped.assign_add(hot)]):
                    taken += 1
            else:
                batches = tuple(next(iterator) for _ in range(accumulation))
                enqueued = strategy.run(replica_step, args=(token, worker, *batches))
                with tf.control_dependencies([enqueued, q.computed.assign_add(hot)]):
                    taken += 1
        # As make_work_fn: the count must wait for the loop.
        with tf.control_dependencies([taken]):
            q.finished.assign_add(1)
        return taken

    return work

