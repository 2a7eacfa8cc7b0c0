"""Synchronous parameter servers: TF1's SyncReplicasOptimizer mode on TF2.

Same cluster as ``ps`` (the chief coordinates, workers compute, ps tasks
hold the variables), but every applied update averages exactly K
(``--replicas-to-aggregate``) gradients computed on the weights of the
current global step; a gradient computed on older weights is dropped.

Where things live and who does what (docs/ps-sync.md has the measurements):

- ps:0 holds, next to its share of the variables, one **token queue per
  worker** and one **gradient queue**, and counters of what happened to
  every gradient, per worker.
- A worker closure takes the newest token from its own queue (the token
  is the global step it may compute on), reads the weights, computes one
  gradient on global/K examples and queues ``(token, worker, gradient)`` on
  ps:0. A token that is already stale when taken is skipped (no work).
- The chief calls ``aggregate`` on ps:0, which dequeues gradients until K
  carry the current step (older ones are dropped and counted), averages
  them, applies the average with the Keras optimizer, increments the
  global step and gives every worker its token for the new step. The
  gradients move from the workers to ps:0 only, never through the chief.

Why queues and not TF1's ConditionalAccumulators: the kernels
(``ResourceAccumulatorApplyGradient``/``TakeGradient``) release their lock
between counting an applied gradient and firing the pending take, so with
backup workers a (K+1)-th gradient of the same step can slip into the
average; and with one accumulator per variable each variable decides on
its own which K gradients it averages, so one update can mix different
workers' gradients. One FIFO queue read by one consumer decides once, for
the whole gradient, in arrival order.

Exactness: tokens for step g+1 exist only once update g+1 is applied, so
while the aggregator collects step g no gradient is newer than g; a
gradient accepted for step g was queued before update g+1, and its weight
reads came after its token, i.e. after update g: it was computed on the
weights of step g. The worker also reads the global step once its gradient
is computed and sends it along; an accepted gradient whose step moved
would be counted in ``stale_gradients_applied`` (measured, 0 by the
argument above).

One token per worker per step means a worker contributes at most one
gradient per update, so the N - K slowest workers are backups, and with
fewer than K live workers no update can complete: the StallWatchdog ends
the chief with one line naming the lost or stuck task (exit 75) after
``--stuck-timeout``, and a relaunch resumes from the checkpoint.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.training.workload import data
from tfdist.training.workload.apply_route import original_apply
from tfdist.training.ps import own_step
from tfdist.training.ps.read_ahead import batch_on_weights, read_once, read_weights
from tfdist.training.ps.coordinated import CoordinatedTrainer, variables_per_ps
from tfdist.training.loop.step import (
    after_updates, forward, local_replicas, local_sum,
    schedule_in_batches, xla_part,
)

# Closures kept in flight per worker: one running, one queued at the
# coordinator, so a worker never waits on the chief for its next closure.
CLOSURES_PER_WORKER = 2
# A token telling a waiting closure that training is over.
STOP = -1
# Seconds an update may take before the chief re-counts finished closures.
TOP_UP_AFTER = 0.1
# Seconds without an update before the chief gives the current step's
# token again to every worker whose token queue is empty, and again after
# as long. Why: a worker killed while its closure waited for a token
# leaves that dequeue pending on ps:0 (nothing cancels it), and it takes
# the next token meant for the worker's restarted process; with K = N no
# update could then complete. Far above an update's time on the slowest
# link measured (docs/ps-sync.md), so a healthy run never re-issues.
REISSUE_AFTER = 10.0
# Before this process's first update: that one also waits for the workers'
# first run of the traced closure, seconds longer on a loaded host. (Counted
# from a call's start, not the last update, a healthy run on a loaded 2-core
# host re-issued once and dropped a gradient.)
FIRST_REISSUE_AFTER = 60.0
PS0 = "/job:ps/replica:0/task:0/device:CPU:0"


def tokens_due(step: int, seen: int, restored: int, since_start: float) -> bool:
    """Whether to give the current step's tokens again, REISSUE_AFTER seconds after
    the global step was last seen at ``seen``: no update since then, and either this
    process has applied one (``step`` is past the ``restored`` step) or its first has
    been awaited for FIRST_REISSUE_AFTER seconds."""
    return step == seen and (step != restored or since_start >= FIRST_REISSUE_AFTER)


def interval_stats(seconds) -> dict:
    """Mean, median, p99 and max of the intervals between applied updates."""
    arr = np.asarray(seconds, dtype=np.float64)
    if arr.size == 0:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    return {
        "count": int(arr.size),
        "mean": round(float(arr.mean()), 6),
        "p50": round(float(np.percentile(arr, 50)), 6),
        "p99": round(float(np.percentile(arr, 99)), 6),
        "max": round(float(arr.max()), 6),
    }


def per_worker(workers, accepted, dropped, skipped, computed) -> dict:
    """{worker: counts}; ``pending`` were computed but not yet looked at by the ps."""
    return {
        name: {"accepted": int(a), "dropped": int(d), "skipped": int(s),
               "computed": int(c), "pending": int(c - a - d)}
        for name, a, d, s, c in zip(workers, accepted, dropped, skipped, computed)
    }


class _Caller:
    """Runs the blocking ``aggregate`` calls on a daemon thread.

    The chief's main thread then keeps asking the coordinator for closure
    errors while it waits: a closure failing on a worker (a bug, a lost
    input) would otherwise leave it waiting on ps:0 for gradients that
    never come. Daemon, so a call stuck on a lost ps never holds the exit.
    """

    def __init__(self, fn):
        self._fn = fn
        self._requests: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="ps-sync-aggregate", daemon=True).start()

    def _run(self):
        while True:
            args = self._requests.get()
            try:
                self._results.put((True, self._fn(*args)))
            except Exception as err:  # pylint: disable=broad-except
                self._results.put((False, err))

    def __call__(self, *args, check=lambda: None, poll: float = 0.05):
        self._requests.put(args)
        while True:
            try:
                ok, value = self._results.get(timeout=poll)
            except queue.Empty:
                check()
                continue
            if not ok:
                raise value
            return value


@dataclass(frozen=True)
class SyncQueues:
    """What lives on ps:0 beside its share of the variables: the token
    queues, the gradient queue and the counts of what became of every gradient."""

    tokens: list  # one FIFOQueue of apply indices per worker
    # One FIFOQueue per apply of an update (the library's step: one; a model's own
    # train_step: one per optimizer.apply it makes, a GAN's two), each of
    # (token, worker, apply index after computing, gradient, loss, metric values).
    gradients: list
    # Applies made: the global step times the applies of an update (a token is the
    # apply index a gradient is for; with one apply an update, the global step).
    applies: Any
    accepted: Any
    dropped: Any
    skipped: Any
    computed: Any
    stale_applied: Any
    finished: Any  # closures that ended
    stopping: Any


def make_queues(workers: int, gradient_sizes: list[int], num_metrics: int,
                gradient_dtype: str = "float32") -> SyncQueues:
    """Created eagerly outside the strategy's scope, so exactly where we say (ps:0).

    A gradient queue (one per apply of an update, of ``gradient_sizes``) holds the
    flat gradient as ``gradient_dtype``: what a worker enqueues is what crosses the
    network to ps:0.
    """
    with tf.device(PS0):
        counter = lambda name: tf.Variable(tf.zeros([workers], tf.int64),  # noqa: E731
                                           trainable=False, name=name)
        return SyncQueues(
            tokens=[tf.queue.FIFOQueue(1 << 20, [tf.int64], shapes=[[]], name=f"sync_tokens_{i}")
                    for i in range(workers)],
            gradients=[tf.queue.FIFOQueue(
                1 << 16, [tf.int64, tf.int64, tf.int64, tf.as_dtype(gradient_dtype),
                          tf.float32, tf.float32],
                shapes=[[], [], [], [size], [], [num_metrics]], name=f"sync_gradients_{i}")
                for i, size in enumerate(gradient_sizes)],
            applies=tf.Variable(0, dtype=tf.int64, trainable=False, name="sync_applies"),
            accepted=counter("sync_accepted"), dropped=counter("sync_dropped"),
            skipped=counter("sync_skipped"), computed=counter("sync_computed"),
            stale_applied=tf.Variable(0, dtype=tf.int64, trainable=False),
            finished=tf.Variable(0, dtype=tf.int64, trainable=False),
            stopping=tf.Variable(False, trainable=False),
        )


def replica_gradient_fn(model, optimizer, train_metrics, accumulation: int, jit: bool = False):
    """``replica_gradient(step, *batches)``, run per replica: the flat gradient of
    ``accumulation`` batches (summed), their loss and metric values, with every weight
    read after ``step``. ``jit``: the forward and backward pass compiled with XLA, on
    the weights' values read from the ps outside it (``read_ahead.xla_batch_on_weights``).

    A ``LossScaleOptimizer``: the loss is multiplied by its scale, read (like the
    weights) after ``step``, so the K gradients of an update carry the same scale, the
    one of that update; ps:0's ``apply`` of the same optimizer divides their average
    by it, skips an update that is not finite and moves the scale, as Keras's."""
    variables = model.trainable_variables

    def one_batch(features, labels, sample_weight=None):
        with tf.GradientTape() as tape:
            # Keras scales each replica's mean by the replicas in sync, so the
            # local replicas' gradients added below are the gradient batch's mean.
            y_pred, loss = forward(model, features, labels, sample_weight)
            scaled = optimizer.scale_loss(loss)  # the loss itself without loss scaling
        grads = tape.gradient(scaled, variables)
        return grads, loss, train_metrics.batch_values(labels, y_pred, sample_weight)

    # N batches on one read of the weights: each batch's own forward pass would
    # read them from the ps again.
    on_values = batch_on_weights(model, train_metrics, optimizer.scale_loss, jit=jit)
    on_weights = read_once(on_values, variables, accumulation)

    def replica_gradient(step, *batches):
        # The weights are read after the step (so after its token): the
        # reads are created under this control dependency.
        with tf.control_dependencies([step]):
            if accumulation == 1 and jit:
                grads, loss, values = on_values(read_weights(variables), *batches)
            elif accumulation == 1:
                grads, loss, values = one_batch(*batches)
            else:
                grads, loss, values = on_weights(*batches)
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads], 0)
        return flat, loss, values

    return replica_gradient


def newest_token(queue):
    """A branch taking everything ``queue`` holds and returning its newest token (STOP
    if any is STOP).

    Only this worker takes from its queue, so all it holds can be taken at once:
    the newest token wins, the older ones are steps it was too slow for. Blocks
    while the queue is empty. The newest is the largest, not the last: the chief
    may re-issue the current step's token (see PsSyncTrainer._reissue_tokens) just
    after the aggregator queued the next one. A STOP taken with a step's token puts
    that token back: the worker did not compute on it, and after a pause (an
    evaluation, ``PsSyncTrainer.workers_free``) its next closure takes it.
    """
    def take():
        tokens = queue.dequeue_many(tf.maximum(queue.size(), 1))
        stop = tf.reduce_any(tf.equal(tokens, STOP))
        newest = tf.reduce_max(tokens)

        def put_back():
            with tf.control_dependencies([queue.enqueue(newest)]):
                return tf.constant(STOP, tf.int64)

        return tf.cond(tf.logical_and(stop, newest > STOP), put_back,
                       lambda: tf.where(stop, tf.constant(STOP, tf.int64), newest))
    return take


def drop_stops(queue) -> None:
    """Empty ``queue`` (a worker's tokens, none of its closures running), then give back
    the newest step token it held, if any: the STOPs of a pause go, a token the
    worker has not computed on stays."""
    held = queue.dequeue_many(queue.size()).numpy()
    if (held != STOP).any():
        queue.enqueue(tf.constant(int(held.max()), tf.int64))


def take_token(q: SyncQueues, worker):
    """The newest token in ``worker``'s queue (blocks while it is empty)."""
    return tf.switch_case(tf.cast(worker, tf.int32), [newest_token(t) for t in q.tokens])


def make_work_fn(strategy, model, optimizer, train_metrics, q: SyncQueues, global_step,
                 workers: int, accumulation: int = 1, jit: bool = False):
    """The worker closure: take the newest token, compute one gradient, queue it on ps:0.

    ``accumulation`` N > 1: the gradient is the mean of N batches' (each
    global/K examples), summed on the worker, so one push carries N batches.
    ``jit``: the gradient computed by XLA on the weights' values.
    """
    replicas = local_replicas(strategy)
    replica_gradient = replica_gradient_fn(model, optimizer, train_metrics, accumulation, jit)

    @tf.function
    def work(iterator, num_tokens):
        worker = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(),
                         tf.int64)
        hot = tf.one_hot(worker, workers, dtype=tf.int64)
        taken = tf.constant(0, tf.int64)  # tokens used, carried through the loop
        for _ in tf.range(num_tokens):
            if q.stopping.read_value():
                break
            token = take_token(q, worker)
            if token == STOP:
                break
            with tf.control_dependencies([token]):
                step = global_step.read_value()
            if token < step:
                with tf.control_dependencies([q.skipped.assign_add(hot)]):
                    taken += 1
            else:
                if accumulation == 1:
                    args = (step, *next(iterator))
                else:
                    args = (step, *(next(iterator) for _ in range(accumulation)))
                flat, loss, values = strategy.run(replica_gradient, args=args)
                flat = local_sum(strategy, flat)
                with tf.control_dependencies([flat]):
                    after = global_step.read_value()
                # Cast on the worker, after adding its replicas' gradients
                # in float32: the queue on ps:0 takes the wire dtype.
                wire = tf.cast(flat, q.gradients[0].dtypes[3])
                enqueued = q.gradients[0].enqueue(
                    [token, worker, after, wire, local_sum(strategy, loss),
                     local_sum(strategy, values) / replicas])
                with tf.control_dependencies([enqueued, q.computed.assign_add(hot)]):
                    taken += 1
        # Automatic control dependencies only order ops on the same
        # resource: without this edge the count could run before the
        # loop and the chief would think the closure done (measured
        # in-flight counts decide when it schedules more).
        with tf.control_dependencies([taken]):
            q.finished.assign_add(1)
        return taken

    return work


def _take_fresh(q: SyncQueues, slot: int, total: int, k: int, workers: int, num_metrics: int):
    """``take_fresh(index)``: dequeue slot ``slot``'s gradients until K carry apply
    ``index``; older ones are dropped and counted."""

    def fresh_needed(fresh, *_):
        return fresh < k

    def take_fresh(index):
        def take(fresh, seen, acc, loss_acc, metrics_acc):
            token, worker, after, flat, loss, values = q.gradients[slot].dequeue()
            flat = tf.cast(flat, tf.float32)  # on ps:0: averaged and applied in float32
            hot = tf.one_hot(worker, workers, dtype=tf.int64)
            # At most one gradient per worker per update: a re-issued token
            # can make a worker compute twice on the same step.
            ok = tf.logical_and(tf.equal(token, index), tf.equal(tf.reduce_sum(seen * hot), 0))
            ok64 = tf.cast(ok, tf.int64)
            counted = [
                q.accepted.assign_add(hot * ok64),
                q.dropped.assign_add(hot * (1 - ok64)),
                q.stale_applied.assign_add(ok64 * tf.cast(tf.not_equal(after, token), tf.int64)),
            ]
            okf = tf.cast(ok, tf.float32)
            with tf.control_dependencies(counted):
                return (fresh + tf.cast(ok, tf.int32), seen + hot * ok64, acc + okf * flat,
                        loss_acc + okf * loss, metrics_acc + okf * values)

        return tf.while_loop(fresh_needed, take, [
            tf.constant(0), tf.zeros([workers], tf.int64), tf.zeros([total]), tf.constant(0.0),
            tf.zeros([num_metrics])])

    return take_fresh


def make_aggregate_fn(q: SyncQueues, slots, global_step, k: int, workers: int,
                      num_metrics: int, accumulation: int = 1):
    """The chief's call on ps:0: for each update, K fresh gradients averaged and applied.

    ``slots``: the applies of one update, in order, as ``[(optimizer, variables)]``
    (the library's step: one; a model's own train_step: one per ``optimizer.apply``
    it makes). Each is its own K-of-N average, and the workers' tokens for the next
    one exist only once it is applied (a GAN's generator gradient is computed on
    the discriminator its update left); the last one's gradients carry the loss and
    metric values, and the global step moves after it. Keras's own ``apply`` of the
    class (never a routed one: ``workload.apply_route``) applies each average."""
    layouts = []
    for _, variables in slots:
        shapes = [v.shape for v in variables]
        sizes = [int(np.prod(s)) for s in shapes]
        layouts.append((shapes, sizes, _take_fresh(q, len(layouts), sum(sizes), k, workers,
                                                   num_metrics)))
    k_float = float(k)

    def apply_one(slot):
        """Slot ``slot``'s K gradients for the current apply, averaged and applied;
        returns the new apply index, its loss and metric sums."""
        (optimizer, variables), (shapes, sizes, take_fresh) = slots[slot], layouts[slot]
        _, _, acc, loss_k, metrics_k = take_fresh(q.applies.read_value())
        grads = [tf.reshape(part, shape)
                 for part, shape in zip(tf.split(acc / k_float, sizes), shapes)]
        with schedule_in_batches(optimizer, accumulation):
            original_apply(optimizer, grads, variables)
        # The index moves only once every variable has its update, and the
        # tokens for the next apply exist only after that.
        with tf.control_dependencies(after_updates(variables)):
            return q.applies.assign_add(1), loss_k, metrics_k

    @tf.function
    def aggregate(num_updates):
        # Everything on ps:0; the optimizer's updates run where each
        # variable lives (ops on a resource are placed with it).
        with tf.device(PS0):
            times = tf.TensorArray(tf.float64, size=num_updates)
            loss_sum = tf.constant(0.0)
            metrics_sum = tf.zeros([num_metrics])
            for i in tf.range(num_updates):
                for slot in range(len(slots)):
                    index, loss_k, metrics_k = apply_one(slot)
                    moved = [index]
                    if slot == len(slots) - 1:
                        with tf.control_dependencies([index]):
                            moved.append(global_step.assign_add(1))
                    with tf.control_dependencies(moved):
                        for token_queue in q.tokens:
                            token_queue.enqueue(index)
                with tf.control_dependencies(moved):
                    times = times.write(i, tf.timestamp())
                loss_sum += loss_k
                metrics_sum += metrics_k
            updates = tf.cast(num_updates, tf.float32)
            return {
                "loss": loss_sum / (updates * k_float),
                "metrics": metrics_sum / (updates * k_float),
                "times": times.stack(),
                "finished": q.finished.read_value(),
            }

    return aggregate


class PsSyncTrainer(CoordinatedTrainer):
    """``ps-sync`` on the chief: owns the token and gradient queues on ps:0, the worker and
    aggregate closures built over them, the K-gradient updates and every gradient's count
    (accepted, dropped, skipped), and the reissue of a step's tokens when an update stalls.
    What it shares with ``ps`` (the workers, SIGTERM, the stall watchdog, guarded saves)
    is ``CoordinatedTrainer``'s."""

    def __init__(self, *, plan, bundle, task, state, checkpointer, start_step, train_metrics):
        super().__init__(plan=plan, bundle=bundle, task=task, state=state,
                         checkpointer=checkpointer, start_step=start_step,
                         train_metrics=train_metrics)
        strategy = bundle.strategy
        self.k = plan.gradients_per_update
        num_metrics = len(train_metrics.names)
        # The library's step makes one apply an update; a model's own train_step the
        # applies it makes, as its workers announce them (training.ps.own_step).
        self._q = make_queues(len(self.workers),
                              [] if train_metrics.own_step else
                              [sum(int(np.prod(v.shape)) for v in state.model.trainable_variables)],
                              num_metrics, self.config.gradient_dtype)
        self._own = None
        if train_metrics.own_step:
            self._own = own_step.make_own_queues(self._q, len(self.workers), num_metrics, PS0,
                                                 self.config.gradient_dtype)
        else:
            self._q.applies.assign(self.applied_before)
        dataset_fn = data.make_dataset_fn(task.task, plan.examples_per_gradient, seed=None,
                                          synthetic=self.config.synthetic_data,
                                          in_memory=plan.in_memory)
        self._iterator = iter(self.coordinator.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(dataset_fn)))
        if train_metrics.own_step:
            self._work = own_step.make_own_work_fn(
                strategy, state.model, train_metrics, self._own, len(self.workers),
                plan.accumulation_steps, take_token=take_token, stop=STOP,
                xla=xla_part(state.model, bundle.kind) == "values")
            # Made at the first train(): the keys are known once the closure is traced.
            self._aggregate, self._own_keys = None, -1
            self._make_aggregate = lambda: _Caller(own_step.make_own_aggregate_fn(
                self._own, state.global_step, self.k, len(self.workers), num_metrics, PS0,
                plan.accumulation_steps))
        else:
            self._work = make_work_fn(strategy, state.model, state.optimizer, train_metrics,
                                      self._q, state.global_step, len(self.workers),
                                      plan.accumulation_steps,
                                      xla_part(state.model, bundle.kind) == "values")
            self._aggregate = _Caller(make_aggregate_fn(
                self._q, [(state.optimizer, state.model.trainable_variables)],
                state.global_step, self.k, len(self.workers), num_metrics,
                plan.accumulation_steps))
        self._scheduled = 0
        self._finished_seen = 0
        self._stuck_workers: list[dict] = []
        self._reissued = 0
        # When the global step was last seen, and its value then: "quiet" is no
        # update for REISSUE_AFTER seconds, not a long call (many updates) or a
        # pause between calls (evaluation, a checkpoint).
        self._started = self._quiet_since = time.monotonic()
        self._quiet_step = self.applied_before
        self._last_time: float | None = None
        self._intervals: list[float] = []
        # The first tokens: every worker may compute on the restored step.
        first = (self.applied_before if self._own is None
                 else int(self._own.current.numpy()))
        for token_queue in self._q.tokens:
            token_queue.enqueue(tf.constant(first, tf.int64))
        self.listen_for_sigterm()

    # --- the controller's interface ------------------------------------------

    def train(self, num_steps: int) -> dict[str, float]:
        """Apply ``num_steps`` updates; returns once they are applied."""
        n = tf.constant(num_steps)
        self._top_up(n)
        if self._own is not None and self._own_keys != len(self._own.keys.applies):
            # The closure's trace met its applies (again, if it was traced again).
            self._own_keys = len(self._own.keys.applies)
            self._aggregate = self._make_aggregate()
        waiting_since = self._quiet_since = time.monotonic()

        def check():
            # coordinator.done() raises the error of any failed closure.
            self.coordinator.done()
            now = time.monotonic()
            if now - waiting_since > TOP_UP_AFTER:
                # The count returned by the last call lags closures that ended
                # just after it: a worker could be left with no closure.
                self._finished_seen = int(self._q.finished.numpy())
                self._top_up(n)
            if now - self._quiet_since > REISSUE_AFTER:
                step = int(self.state.global_step.read_value())
                if tokens_due(step, self._quiet_step, self.applied_before, now - self._started):
                    self._reissue_tokens(step)
                self._quiet_since, self._quiet_step = now, step

        out = self._aggregate(n, check=check)
        if self._stall is not None:
            self._stall.progress()
        self._finished_seen = max(self._finished_seen, int(out["finished"]))
        times = out["times"].numpy().tolist()
        if self._last_time is not None:
            times = [self._last_time, *times]
        self._intervals.extend(np.diff(times).tolist())
        self._last_time = times[-1]
        self._last = self.train_metrics.logs(out["loss"], out["metrics"])
        self.completed += num_steps
        return self._metrics()

    def _top_up(self, n) -> None:
        """Keep CLOSURES_PER_WORKER closures per worker scheduled.

        The coordinator gives a closure to whichever worker is free and a
        closure waits on its own worker's tokens, so closures must be queued
        whenever a worker may be free, or that worker's gradient never comes.
        """
        target = CLOSURES_PER_WORKER * len(self.workers)
        while self._scheduled - self._finished_seen < target:
            self.coordinator.schedule(self._work, args=(self._iterator, n))
            self._scheduled += 1

    def _reissue_tokens(self, step: int) -> None:
        """Give the current token (the library's step: the global step; a model's own
        train_step: the newest apply's, ``own_step.token_of``) to every worker that has
        none queued.

        Safe at any time: a worker takes the largest token it holds, and the
        aggregator accepts one gradient per worker per update, so a token
        for a step already over is skipped and a second gradient for the
        same step is dropped.
        """
        index = int(self._q.applies.numpy() if self._own is None
                    else self._own.current.numpy())
        for token_queue in self._q.tokens:
            if int(token_queue.size().numpy()) == 0:
                token_queue.enqueue(tf.constant(index, tf.int64))
                self._reissued += 1

    def drain(self) -> dict[str, float]:
        """Updates are applied inside ``train``; nothing is pending.

        The controller drains before evaluating or checkpointing: the next
        interval would include that pause, so it is not measured.
        """
        self._last_time = None
        return self._metrics()

    def _counts(self) -> dict:
        q = self._q
        return per_worker(self.workers, q.accepted.numpy(), q.dropped.numpy(),
                          q.skipped.numpy(), q.computed.numpy())

    def progress_fields(self) -> tuple[str, dict]:
        counts = self._counts()
        aggregated = sum(c["accepted"] for c in counts.values())
        dropped = sum(c["dropped"] for c in counts.values())
        recent = interval_stats(self._intervals[-100:])
        text = (
            f" | global_step {int(self.state.global_step.numpy())} aggregated {aggregated} "
            f"dropped {dropped} | accepted/dropped "
            + " ".join(f"{w}={c['accepted']}/{c['dropped']}" for w, c in counts.items())
            + f" | update p50 {1000 * recent['p50']:.1f}ms p99 {1000 * recent['p99']:.1f}ms"
        )
        fields = {"aggregated_gradients": aggregated, "stale_gradients_dropped": dropped,
                  "gradients_per_worker": counts, "update_p50": recent["p50"],
                  "update_p99": recent["p99"]}
        return text, fields

    def sharded_evaluation_refusal(self) -> str | None:
        """A model's own train_step (training.ps.own_step): after each apply a worker's
        step waits on ps:0 for that apply's token, and between two updates every
        worker has already queued its next step's first gradient and waits there for
        the next update; ending its closure there would drop that queued gradient."""
        if self._own is not None:
            return ("the model's own train_step under ps-sync: between two updates each "
                    "worker's step waits mid-way on ps:0 for the next update's token")
        return None

    @contextlib.contextmanager
    def workers_free(self):
        """No step closure on any worker while the body runs (the sharded evaluation's
        closures find the workers free), and training resumes after it with every
        worker's token where it was: none lost, none given twice.

        Why: between two ``train`` calls each worker's step closure waits on ps:0 for
        the next update's token, which only the next ``aggregate`` call gives, so it
        never ends while the chief evaluates: the coordinator's ``join()`` waited for it
        forever, and a worker's thread runs one closure at a time, so a shard handed to
        a thread behind it waits with it.
        """
        self._pause_closures()
        try:
            yield
        finally:
            self._resume_closures()

    def _pause_closures(self, poll: float = 0.02) -> None:
        """``stopping`` set, then one STOP in each worker's token queue: a closure waiting
        for a token wakes and ends (a step's token taken with the STOP is put back), one
        computing ends once its gradient is queued, one not started ends at once. Waits
        for them while they keep ending, up to --stuck-timeout after the last: a stuck
        worker's closure is left running (the shards go to the other workers)."""
        q = self._q
        q.stopping.assign(True)
        for token_queue in q.tokens:
            token_queue.enqueue(tf.constant(STOP, tf.int64))
        last, since = -1, time.monotonic()
        while (finished := int(q.finished.numpy())) < self._scheduled:
            if finished != last:
                last, since = finished, time.monotonic()
            elif time.monotonic() - since > self.patience:
                print(f"warning: {self.cluster.member_name}: {self._scheduled - finished} step "
                      f"closure(s) still running {self.patience:g}s (--stuck-timeout) after the "
                      "evaluation asked them to end; the other workers evaluate its shards",
                      flush=True)
                break
            time.sleep(poll)
        self._finished_seen = finished

    def _resume_closures(self) -> None:
        """The STOPs the pause left taken out of the token queues (a step's token in them
        kept: its worker has not computed it), then ``stopping`` cleared; the next
        ``train`` schedules closures again."""
        for token_queue in self._q.tokens:
            drop_stops(token_queue)
        self._q.stopping.assign(False)
        self._finished_seen = int(self._q.finished.numpy())

    def result_fields(self, ran: int) -> dict:
        global_steps = int(self.state.global_step.numpy())
        counts = self._counts()
        return {
            "global_steps": global_steps,
            "scheduled_steps": ran,
            "applied_steps": global_steps - self.applied_before,
            # Gradients each worker computed in this run.
            "steps_per_worker": {w: c["computed"] for w, c in counts.items()},
            "variables_per_ps": variables_per_ps(self.state.model),
            "ps_variable_bytes": self.ps_variable_bytes(),
            "replicas_to_aggregate": self.k,
            "aggregated_gradients": sum(c["accepted"] for c in counts.values()),
            "stale_gradients_dropped": sum(c["dropped"] for c in counts.values()),
            "stale_gradients_applied": int(self._q.stale_applied.numpy()),
            "tokens_reissued": self._reissued,
            "gradients_per_worker": counts,
            "update_interval": interval_stats(self._intervals),
            "stuck_workers": self._stuck_workers,
        }

    def close(self, finished: bool) -> None:
        try:
            if finished:
                self._stop_closures()
            else:
                # After a preemption or a lost task: wake what can be woken,
                # but never wait (a lost ps would hold join() forever, and
                # the coordinator's threads are daemons that die with us).
                try:
                    self._stop_closures(wait=False)
                except Exception:  # pylint: disable=broad-except
                    pass
        finally:
            super().close(finished)

    def _stop_closures(self, wait: bool = True) -> None:
        """Wake every closure still waiting for a token, and wait for them.

        A closure that wakes on STOP ends; one that starts later sees
        ``stopping`` first. Only after this do the counters hold every
        gradient that was computed.
        """
        self._q.stopping.assign(True)
        waiting = max(0, self._scheduled - int(self._q.finished.numpy()))
        for token_queue in self._q.tokens:
            token_queue.enqueue_many([tf.fill([max(1, waiting)], tf.constant(STOP, tf.int64))])
        if wait and self._wait_for_closures():
            self.coordinator.join()

    def _wait_for_closures(self, poll: float = 0.1) -> bool:
        """Whether every closure ended; False once none has for --stuck-timeout.

        A stuck worker (a backup, K < N: the others made every update
        without it) holds its closure, and join() would wait for it forever.
        It is left out; ``stuck_workers`` in the results says which.
        """
        last, since = -1, time.monotonic()
        if self._stall is not None:
            # This wait ends itself after --stuck-timeout, then probes the
            # peers (up to 3 s): the watchdog stays the fallback.
            self._stall.grace = 5.0
        while True:
            finished = int(self._q.finished.numpy())
            if finished >= self._scheduled:
                return True
            if finished != last:
                last, since = finished, time.monotonic()
                if self._stall is not None:
                    self._stall.progress()
            elif time.monotonic() - since > self.patience:
                break
            time.sleep(poll)
        _, stuck = self.stuck_peers()
        names = [name.split(" ")[0] for name in stuck]
        computed = self._counts()
        for name in names:
            self._stuck_workers.append({
                "worker": name, "at_step": self.completed,
                "waited_seconds": round(time.monotonic() - since, 1), "rerouted_steps": 0,
                "came_back": False, "steps_after": None, "outcome": "left out"})
        print(f"warning: {self.cluster.member_name}: {self._scheduled - last} closure(s) had not "
              f"ended {self.patience:g}s (--stuck-timeout) after the last update; stuck: "
              f"{', '.join(stuck) or 'none found'}; the run ends without waiting for them "
              f"(gradients they computed: "
              + ", ".join(f"{w}={computed[w]['computed']}" for w in names) + ")", flush=True)
        return False
