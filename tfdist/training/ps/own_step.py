"""A model's own ``train_step`` under ``ps-sync``: the gradients it hands to
``optimizer.apply`` are what the worker queues on ps:0 for the K-of-N average.

The worker closure calls the model's ``train_step`` on its batch with every
optimizer's ``apply`` routed (``workload.apply_route``) to ``QueuedApply``.
What the step applies may change from call to call (a GAN that trains its
generator every other step, a ``tf.cond`` that applies in another order):
every worker runs the same Python on the same weights, so at a step every
worker makes the same applies, and ps:0 follows them as the workers announce
them.

- **Keys.** Each distinct apply (an optimizer and the variables it is given)
  is a key, met as the worker's closure is traced (every ``apply`` call in
  every branch): its own gradient queue on ps:0 and its own K-of-N average
  (``Keys``).
- **Apply indices.** ps:0 counts applies (``applies``); a token is
  ``2 * index + start`` (``start`` 1 for the first apply index of a step), so
  a worker knows whether a token begins a step. Each worker's current index
  is ``cursor[worker]`` on ps:0 (a variable, because an apply inside a
  ``tf.cond`` branch moves it and a branch cannot hand a value out).
- **An apply** (``QueuedApply.__call__``): the worker queues its flat
  gradient (as ``--gradient-dtype``) on the key's queue, then announces
  ``(index, worker, key)`` on the announcement queue, and waits for the token
  of the next index: what ``train_step`` traces after it reads the weights
  that apply left (a GAN's generator step sees the discriminator just
  trained, as under ``fit``). A token further on means this worker's step
  was left behind (a backup, K < N): its cursor is poisoned and its later
  announcements are dropped.
- **The end of a step**: once ``train_step`` returns, the worker announces
  ``END`` at its index, with the step's loss and metric values.
- **ps:0** (``make_own_aggregate_fn``) takes K fresh announcements (of the
  current index, one per worker) and does what they say: a key's apply
  (K fresh gradients of that key's queue, averaged, applied by Keras's own
  ``apply``), or the step's end (the global step moves). Workers that
  announce different things at one index (a branch on their own data) fail
  the call in one line: a synchronous average needs the same apply from each.
- **A change of a trained variable** the step makes itself (``var.assign_sub``,
  with no optimizer) is routed as an apply of ``apply_route.DIRECT``: its delta is
  queued, and ps:0 subtracts the mean of the K workers' deltas (on each worker it
  would be one more update of the ps variable per worker).
- **Several local replicas** (GPUs): each runs ``train_step``; at each apply their
  gradients are summed by the replicas' all-reduce (as Keras's own ``apply`` sums
  them), the first replica queues the sum and takes the token, and hands it to the
  others through the same all-reduce.
- ``gradient_accumulation_steps`` N: ``train_step`` runs on each of N batches;
  each apply's gradients are summed over them and the mean queued at the
  N-th (``loop.step.DirectApply.mean``): Keras's accumulation, one gradient
  on ps:0's queue per N batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.protocol import ConfigError
from tfdist.training.loop.step import DirectApply, after_updates, own_train_steps
from tfdist.training.loop.step import schedule_in_batches
from tfdist.training.workload.apply_route import original_apply

END = -1  # the key of a step's end announcement
POISON = -2  # a left-behind worker's cursor: its announcements are dropped


def token_of(index, start):
    """The token of apply ``index``: ``2 * index + 1`` when a step starts there."""
    return 2 * index + start


def flat_gradient(grads, variables) -> tf.Tensor:
    """One float vector of ``grads`` in ``variables``' order (a variable the loss does
    not reach: zeros, as Keras's apply would leave it)."""
    return tf.concat([tf.reshape(tf.zeros(v.shape, v.dtype) if g is None
                                 else tf.convert_to_tensor(g), [-1])
                      for g, v in zip(grads, variables)], 0)


class Keys:
    """The distinct applies a model's own ``train_step`` makes, each its own gradient
    queue on ps:0, made as the worker's closure is traced (``key_of``): the trace
    meets every ``apply`` call, those in a branch not taken at run time included."""

    def __init__(self, device: str, gradient_dtype: str):
        self.device, self.dtype = device, tf.as_dtype(gradient_dtype)
        self.applies: list = []  # [(optimizer, variables)] by key
        self.queues: list = []
        self._known: dict = {}

    def key_of(self, optimizer, variables) -> int:
        ident = (id(optimizer), tuple(id(v) for v in variables))
        if ident not in self._known:
            size = sum(int(np.prod(v.shape)) for v in variables)
            # Out of the trace: the queue is a resource of ps:0, as make_queues' are.
            with tf.init_scope(), tf.device(self.device):
                self.queues.append(tf.queue.FIFOQueue(
                    1 << 16, [tf.int64, tf.int64, tf.int64, self.dtype],
                    shapes=[[], [], [], [size]], name=f"sync_apply_{len(self.queues)}"))
            self._known[ident] = len(self.applies)
            self.applies.append((optimizer, list(variables)))
        return self._known[ident]


@dataclass(frozen=True)
class OwnQueues:
    """What a model's own step adds on ps:0 to ``SyncQueues`` (``base``)."""

    base: Any
    keys: Keys
    announce: Any  # (index, worker, key, loss, metric values)
    cursor: Any  # each worker's apply index, POISON once left behind
    current: Any  # the newest token given (what the chief gives again after a stall)


def make_own_queues(base, workers: int, num_metrics: int, device: str,
                    gradient_dtype: str) -> OwnQueues:
    with tf.device(device):
        return OwnQueues(
            base=base, keys=Keys(device, gradient_dtype),
            announce=tf.queue.FIFOQueue(1 << 16, [tf.int64, tf.int64, tf.int64, tf.float32,
                                                  tf.float32],
                                        shapes=[[], [], [], [], [num_metrics]],
                                        name="sync_announce"),
            cursor=tf.Variable(tf.fill([workers], tf.constant(POISON, tf.int64)),
                               trainable=False, name="sync_cursor"),
            current=tf.Variable(token_of(0, 1), dtype=tf.int64, trainable=False,
                                name="sync_current"))


def _set_cursor(q: OwnQueues, worker, index):
    """The op setting ``cursor[worker]`` to ``index``."""
    return tf.raw_ops.ResourceScatterUpdate(resource=q.cursor.handle,
                                            indices=tf.reshape(worker, [1]),
                                            updates=tf.reshape(index, [1]))


def _cursor(q: OwnQueues, worker):
    return tf.gather(q.cursor.read_value(), worker)


class QueuedApply:
    """The handler of a ps-sync worker's routed applies (module docstring), and of its
    train_step's own changes of trained variables (``apply_route.DIRECT``)."""

    routes_assigns = True

    def __init__(self, q: OwnQueues, accumulation: int, num_metrics: int, take_token,
                 stop: int):
        self.q, self.num_metrics = q, num_metrics
        self.sums = DirectApply(accumulation=accumulation)  # its mean() only
        self.take_token, self.stop = take_token, stop
        self.batch = 0
        self.worker = None
        # The graph train_step is traced in: an apply traced in another one is in a
        # branch (tf.cond) of the step.
        self.graph = tf.compat.v1.get_default_graph()
        self._entered: list = []
        # Several local replicas (GPUs): each runs train_step, their gradients are
        # summed, and the first one queues the sum and takes the tokens for them all.
        context = tf.distribute.get_replica_context()
        self.replicas = context.num_replicas_in_sync if context is not None else 1
        self.first = self.replicas == 1 or tf.get_static_value(
            context.replica_id_in_sync_group) == 0

    def local_sum(self, value, op=tf.distribute.ReduceOp.SUM):
        """``value`` summed (``op``) over the worker's local replicas."""
        if self.replicas == 1:
            return value
        return tf.distribute.get_replica_context().all_reduce(op, value)

    def on_first(self, fn):
        """``fn()`` on the first local replica; every replica gets its result (a token)."""
        if self.replicas == 1:
            return fn()
        mine = fn() if self.first else tf.constant(0, tf.int64)
        return self.local_sum(mine)

    def pending(self) -> list:
        return self.sums.pending()

    def __call__(self, slot, optimizer, grads, variables) -> None:
        self.sums.batch = self.batch
        in_branch = tf.compat.v1.get_default_graph() is not self.graph
        if in_branch and (self.sums.n > 1 or self.replicas > 1):
            raise ConfigError(
                f"the model's own train_step applies {optimizer.name} inside a branch "
                "(tf.cond) on a worker with several local replicas or with "
                "gradient_accumulation_steps; ps-sync sums such a branch's gradients over "
                "the replicas or batches outside it (as fit's all-reduce cannot run in a "
                "branch either): apply outside the branch")
        grads = self.sums.mean(slot, grads)
        if grads is None:
            return
        key = self.q.keys.key_of(optimizer, variables)
        # Summed in float32 over the worker's local replicas (Keras's apply sums them
        # too), then cast to the wire dtype.
        flat = self.local_sum(flat_gradient(grads, variables))
        moved = self.on_first(lambda: self.push(key, tf.cast(flat, self.q.keys.dtype)))
        # What train_step traces from here on reads the weights the apply left.
        entered = tf.control_dependencies([moved])
        entered.__enter__()
        self._entered.append(entered)

    def push(self, key: int, wire):
        """Queue ``wire`` on the key's queue, announce it, wait for the next index."""
        q, worker = self.q, self.worker
        with tf.control_dependencies([wire]):
            index = _cursor(q, worker)
        with tf.control_dependencies([index]):
            after = q.base.applies.read_value()
        queued = q.keys.queues[key].enqueue([index, worker, after, wire])
        with tf.control_dependencies([queued]):
            said = q.announce.enqueue([index, worker, tf.constant(key, tf.int64),
                                       tf.constant(0.0), tf.zeros([self.num_metrics])])
        with tf.control_dependencies([said]):
            token = tf.cond(index < 0, lambda: tf.constant(self.stop, tf.int64),
                            lambda: self.wait_for(index))
        on = tf.logical_and(token >= 0, tf.equal(token // 2, index + 1))
        moved = _set_cursor(q, worker, tf.where(on, index + 1, tf.constant(POISON, tf.int64)))
        with tf.control_dependencies([moved]):
            return tf.identity(token)

    def end(self, loss, values):
        """The step's end, announced at the worker's index once its applies are made."""
        index = _cursor(self.q, self.worker)
        return self.q.announce.enqueue([index, self.worker, tf.constant(END, tf.int64),
                                        loss, values])

    def wait_for(self, index):
        """The newest token of this worker once it is past ``index`` (or STOP)."""

        def waiting(token):
            return tf.logical_and(tf.not_equal(token, self.stop), token // 2 <= index)

        return tf.while_loop(waiting, lambda _: self.take_token(self.q.base, self.worker),
                             [self.take_token(self.q.base, self.worker)])[0]

    def close(self) -> None:
        """The train_step call returned: leave the waits' control dependencies (one
        entered in a branch's graph leaves that graph's stack)."""
        while self._entered:
            self._entered.pop().__exit__(None, None, None)


def _unordered(next_creator, **kwargs):
    """A variable the step makes on its first trace (a compiled metric's state), its
    initial value free of the waits' control dependencies: tf.function lifts it out of
    the trace, which it cannot do for a value that waits on a token."""
    with tf.control_dependencies(None):
        return next_creator(**kwargs)


def make_own_work_fn(strategy, model, train_metrics, q: OwnQueues, workers: int,
                     accumulation: int, *, take_token, stop: int, xla: bool = False):
    """The worker closure for a model's own train_step: take the newest token that
    starts a step, run the step (``QueuedApply``), announce its end with its logs.
    ``xla``: each call of the model compiled with XLA on values (jit_compile=True)."""

    def replica_step(started, worker, *batches):
        handler = QueuedApply(q, accumulation, len(train_metrics.names), take_token, stop)
        handler.worker = worker
        # The step's weight reads come after its token (so after its update).
        with tf.control_dependencies([started]), tf.variable_creator_scope(_unordered):
            logs = own_train_steps(model, handler, batches, xla)
        loss = (tf.reshape(tf.cast(logs["loss"], tf.float32), []) if train_metrics.has_loss
                else tf.constant(0.0))
        mean = tf.distribute.ReduceOp.MEAN
        loss = handler.local_sum(loss, mean)
        values = handler.local_sum(train_metrics.logged_values(logs), mean)
        # After every apply (the cursor is their resource) and the logs.
        with tf.control_dependencies([loss, values]):
            if handler.first:
                return handler.end(loss, values)
            return tf.no_op()

    @tf.function
    def work(iterator, num_tokens):
        base = q.base
        worker = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(),
                         tf.int64)
        hot = tf.one_hot(worker, workers, dtype=tf.int64)
        taken = tf.constant(0, tf.int64)
        for _ in tf.range(num_tokens):
            if base.stopping.read_value():
                break
            token = take_token(base, worker)
            if token == stop:
                break
            with tf.control_dependencies([token]):
                index = base.applies.read_value()
            # Stale, or an apply in the middle of a step: not a step's start.
            if tf.logical_or(token // 2 < index, tf.math.floormod(token, 2) != 1):
                with tf.control_dependencies([base.skipped.assign_add(hot)]):
                    taken += 1
            else:
                with tf.control_dependencies([_set_cursor(q, worker, token // 2)]):
                    started = tf.identity(token)
                batches = tuple(next(iterator) for _ in range(accumulation))
                ended = strategy.experimental_local_results(
                    strategy.run(replica_step, args=(started, worker, *batches)))
                with tf.control_dependencies([*ended, base.computed.assign_add(hot)]):
                    taken += 1
        # As make_work_fn: the count must wait for the loop.
        with tf.control_dependencies([taken]):
            base.finished.assign_add(1)
        return taken

    return work


def _take_announcements(q: OwnQueues, k: int, workers: int, num_metrics: int):
    """``take(index)``: K fresh announcements of apply ``index`` (one per worker):
    what they say (a key, or END), their loss and metric sums, and whether a fresh
    one said something else."""

    def take(index):
        def body(fresh, seen, said, differ, loss_acc, metrics_acc):
            token, worker, key, loss, values = q.announce.dequeue()
            hot = tf.one_hot(worker, workers, dtype=tf.int64)
            ok = tf.logical_and(tf.equal(token, index), tf.equal(tf.reduce_sum(seen * hot), 0))
            differ = tf.logical_or(differ, tf.logical_and(ok, tf.logical_and(
                fresh > 0, tf.not_equal(key, said))))
            said = tf.where(tf.logical_and(ok, tf.equal(fresh, 0)), key, said)
            okf = tf.cast(ok, tf.float32)
            return (fresh + tf.cast(ok, tf.int32), seen + hot * tf.cast(ok, tf.int64), said,
                    differ, loss_acc + okf * loss, metrics_acc + okf * values)

        out = tf.while_loop(lambda fresh, *_: fresh < k, body, [
            tf.constant(0), tf.zeros([workers], tf.int64), tf.constant(END, tf.int64),
            tf.constant(False), tf.constant(0.0), tf.zeros([num_metrics])])
        return out[2], out[3], out[4], out[5]

    return take


def _apply_key(q: OwnQueues, key: int, k: int, workers: int, accumulation: int):
    """A branch: key ``key``'s K fresh gradients of apply ``index`` averaged and applied
    by Keras's own ``apply`` (never a routed one); older ones dropped and counted."""
    optimizer, variables = q.keys.applies[key]
    shapes = [v.shape for v in variables]
    sizes = [int(np.prod(s)) for s in shapes]
    base, queue = q.base, q.keys.queues[key]

    def branch(index):
        def body(fresh, seen, acc):
            token, worker, after, flat = queue.dequeue()
            hot = tf.one_hot(worker, workers, dtype=tf.int64)
            ok = tf.logical_and(tf.equal(token, index), tf.equal(tf.reduce_sum(seen * hot), 0))
            ok64 = tf.cast(ok, tf.int64)
            counted = [
                base.accepted.assign_add(hot * ok64),
                base.dropped.assign_add(hot * (1 - ok64)),
                base.stale_applied.assign_add(ok64 * tf.cast(tf.not_equal(after, token),
                                                             tf.int64)),
            ]
            with tf.control_dependencies(counted):
                return (fresh + tf.cast(ok, tf.int32), seen + hot * ok64,
                        acc + tf.cast(ok, tf.float32) * tf.cast(flat, tf.float32))

        _, _, acc = tf.while_loop(lambda fresh, *_: fresh < k, body, [
            tf.constant(0), tf.zeros([workers], tf.int64), tf.zeros([sum(sizes)])])
        grads = [tf.reshape(part, shape)
                 for part, shape in zip(tf.split(acc / float(k), sizes), shapes)]
        with schedule_in_batches(optimizer, accumulation):
            original_apply(optimizer, grads, variables)
        with tf.control_dependencies(after_updates(variables)):
            return tf.constant(0, tf.int64)

    return branch


def make_own_aggregate_fn(q: OwnQueues, global_step, k: int, workers: int, num_metrics: int,
                          device: str, accumulation: int = 1):
    """The chief's call on ps:0: ``num_updates`` steps, each the applies its K fresh
    workers announce, one after the other, until they announce its end. Made once the
    worker's closure is traced (its keys are known then)."""
    if not q.keys.applies:
        raise ConfigError("the model's own train_step made no optimizer.apply and changed "
                          "no trained variable; ps-sync has no update to average")
    take = _take_announcements(q, k, workers, num_metrics)
    branches = [_apply_key(q, key, k, workers, accumulation)
                for key in range(len(q.keys.applies))]
    base = q.base

    def one_apply(index):
        """The apply (or the step's end) of ``index``; returns whether the step ended,
        and the loss and metric sums its end carried."""
        said, differ, loss_k, metrics_k = take(index)
        checked = tf.debugging.Assert(tf.logical_not(differ), [
            "ps-sync: the workers' train_step calls made different applies at apply",
            index, "(a branch on each worker's own data?); a synchronous average needs the "
            "same apply from every worker at a step"])
        with tf.control_dependencies([checked]):
            ended = tf.equal(said, END)
        applied = tf.cond(ended, lambda: tf.constant(0, tf.int64), lambda: tf.switch_case(
            tf.cast(tf.maximum(said, 0), tf.int32),
            [lambda b=b: b(index) for b in branches]))
        with tf.control_dependencies([applied]):
            moved = base.applies.assign_add(1)
        with tf.control_dependencies([moved]):
            stepped = global_step.assign_add(tf.cast(ended, global_step.dtype))
        token = token_of(tf.identity(moved), tf.cast(ended, tf.int64))
        with tf.control_dependencies([stepped, q.current.assign(token)]):
            given = [token_queue.enqueue(token) for token_queue in base.tokens]
        with tf.control_dependencies(given):
            return tf.identity(ended), loss_k, metrics_k

    @tf.function
    def aggregate(num_updates):
        with tf.device(device):
            times = tf.TensorArray(tf.float64, size=num_updates)
            loss_sum = tf.constant(0.0)
            metrics_sum = tf.zeros([num_metrics])
            for i in tf.range(num_updates):
                ended = tf.constant(False)
                loss_k, metrics_k = tf.constant(0.0), tf.zeros([num_metrics])
                while not ended:
                    ended, loss_k, metrics_k = one_apply(base.applies.read_value())
                with tf.control_dependencies([ended]):
                    times = times.write(i, tf.timestamp())
                loss_sum += loss_k
                metrics_sum += metrics_k
            updates = tf.cast(num_updates, tf.float32)
            return {
                "loss": loss_sum / (updates * float(k)),
                "metrics": metrics_sum / (updates * float(k)),
                "times": times.stack(),
                "finished": base.finished.read_value(),
            }

    return aggregate
