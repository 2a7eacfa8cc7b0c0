"""The training step shared by every strategy, and the call that runs K of them.

Keras 3 ``model.fit`` cannot drive the multi-worker strategies
(keras-team/keras#20585, #18624), so this is a custom loop. Keras layers and
optimizers are used as they are.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfdist.training.loop.state import TrainState
from tfdist.training.workload import contract


class TrainMetrics:
    """The task's compiled metrics, as values of one batch, inside a traced step.

    Stateless: the metric variables of a local model (built outside any
    strategy, never written) are replaced by their initial values for each
    batch, so a step on a worker, a replica or a ps closure reads nothing
    remote and updates nothing shared. Progress lines show the mean of these
    per-batch values; the test split is measured exactly, at evaluation.

    ``names`` are Keras's own (``CompileMetrics.result()``'s keys): with
    several outputs ``cls_accuracy``, ``reg_mae``, ``cls_weighted_accuracy``.
    A model with its own ``train_step`` gives its own names (``own_names``:
    the keys its step returned when the task was checked, flattened as
    Keras flattens them, "loss" aside); ``has_loss``: whether it logs a
    "loss" at all (a GAN logs ``d_loss`` and ``g_loss``).
    """

    def __init__(self, local_model: keras.Model, own_names: tuple[str, ...] | None = None):
        self.compiled = getattr(local_model, "_compile_metrics", None)
        self.names: tuple[str, ...] = ()
        self.own_step = own_names is not None
        self.has_loss = not self.own_step or "loss" in own_names
        self._initial: list = []
        if self.own_step:
            self.names = tuple(n for n in own_names if n != "loss")
        elif self.compiled is not None and self.compiled.built:
            self.compiled.reset_state()
            self.names = tuple(self.compiled.result())
            self._initial = [tf.constant(v.numpy()) for v in self.compiled.variables]

    def batch_values(self, labels, y_pred, sample_weight=None) -> tf.Tensor:
        """Each metric on this batch, as a float32 vector in ``names`` order."""
        if not self.names:
            return tf.zeros([0], tf.float32)
        state = self.compiled.stateless_update_state(self._initial, labels, y_pred,
                                                     sample_weight=sample_weight)
        result = self.compiled.stateless_result(state)
        return tf.stack([tf.cast(tf.reshape(result[n], []), tf.float32) for n in self.names])

    def logged_values(self, logs: dict) -> tf.Tensor:
        """A model's own train_step's logs (flattened: ``contract.flat_logs``;
        tensors or Python numbers), as a float32 vector in ``names`` order."""
        if not self.names:
            return tf.zeros([0], tf.float32)
        return tf.stack([tf.reshape(tf.cast(logs[n], tf.float32), []) for n in self.names])

    def logs(self, loss, values) -> dict[str, float]:
        """A call's output as the progress line's logs: ``metric_dict``, without the
        "loss" of a model's own step that logs none."""
        out = metric_dict(loss, self.names, values)
        if not self.has_loss:
            del out["loss"]
        return out


def forward(model: keras.Model, features, labels, sample_weight=None):
    """One replica's forward pass: predictions and the compiled loss.

    Keras scales the loss by the replicas in sync (``sum_over_batch_size``
    over this replica's batch, then divided by the replicas), so the sum the
    optimizer's all-reduce makes is the gradient of the *global* batch mean.
    ``compute_loss`` adds the model's own losses (regularizers, ``add_loss``)
    as ``fit`` does.
    """
    y_pred = model(features, training=True)
    loss = contract.compute_loss(model, features, labels, y_pred, sample_weight, training=True)
    return y_pred, loss


def to_wire(grads, dtype: str = "float32") -> list:
    """Gradients as they should cross the network: cast to ``dtype`` (None stays None).

    float32 returns them untouched (no cast op in the graph).
    """
    if dtype == "float32":
        return list(grads)
    wire = tf.as_dtype(dtype)
    return [None if g is None else tf.cast(g, wire) for g in grads]


def step_args(iterator, accumulation: int):
    """A step's arguments from ``iterator``: its batch, or a tuple of the
    ``accumulation`` batches one update averages."""
    if accumulation == 1:
        return next(iterator)
    return tuple(next(iterator) for _ in range(accumulation))


def gradients_of(one_batch, batches, accumulation: int):
    """``one_batch`` on the step's one batch, or ``accumulate``d over its batches."""
    if accumulation == 1:
        return one_batch(*batches)
    return accumulate(one_batch, batches)


def accumulate(one_batch, batches):
    """``one_batch(*batch) -> (gradients, loss, metric values)`` over each of
    ``batches``, as their means: Keras's accumulation ((sum of N gradients) / N,
    then one update), local to the replica, so one update communicates once.

    Each batch starts after the previous one's gradients are added, so at most
    one batch's activations are alive at a time (the memory one batch needs,
    which is what accumulation is for); N is small, so the loop is unrolled:
    no control flow for tf.distribute to trace through.
    """
    total, loss_sum, value_sum = None, 0.0, 0.0
    for batch in batches:
        with tf.control_dependencies([getattr(g, "values", g) for g in total or ()
                                      if g is not None]):
            grads, loss, values = one_batch(*batch)
        if total is None:
            total = list(grads)
        else:
            total = [_add(t, g) for t, g in zip(total, grads)]
        loss_sum, value_sum = loss_sum + loss, value_sum + values
    n = len(batches)
    return [_scale(g, 1.0 / n) for g in total], loss_sum / n, value_sum / n


class _BatchSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A schedule read at the batch count: update k (from 0) of N batches is
    batch k*N + N - 1, where Keras's accumulating optimizer reads its schedule."""

    def __init__(self, inner, batches: int):
        self.inner, self.batches = inner, batches

    def __call__(self, step):
        return self.inner(step * self.batches + (self.batches - 1))

    def get_config(self):
        return self.inner.get_config()


@contextlib.contextmanager
def schedule_in_batches(optimizer, batches: int):
    """While an update is traced, the optimizer's learning-rate schedule counts
    batches, as Keras's does with ``gradient_accumulation_steps`` (its schedule
    reads the batch counter; Adam's bias correction the update counter, which
    the optimizer's own ``iterations`` stay). The saved optimizer keeps its own
    schedule: only the traced update reads the shifted one."""
    swapped = []
    if batches > 1:
        for o in contract.with_inner(optimizer):
            rate = getattr(o, "_learning_rate", None)
            if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
                swapped.append((o, rate))
                o._learning_rate = _BatchSchedule(rate, batches)
    try:
        yield
    finally:
        for o, rate in swapped:
            o._learning_rate = rate


def _add(a, b):
    """Two gradients of one variable added; row-sparse ones stay row-sparse."""
    if a is None:
        return None
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0),
                                tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def _scale(g, factor: float):
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype), g.indices,
                                g.dense_shape)
    return g * tf.cast(factor, g.dtype)


def make_step_fn(state: TrainState, metrics: TrainMetrics, gradient_dtype: str = "float32",
                 accumulation: int = 1, jit: str | None = None):
    """One replica's step: forward, loss, gradients, update, metric values.

    ``accumulation`` N > 1: the step takes N batches, sums their gradients
    locally and applies the mean once (``accumulate``), Keras's
    ``gradient_accumulation_steps`` without its ``tf.cond``; the optimizer's
    own accumulation is off (``loop.state``), so its ``iterations`` count
    updates, as Keras's do then (Adam's bias correction, a schedule's step).

    With a 16-bit ``gradient_dtype`` the gradients reach ``apply_gradients``
    in 16 bits. Keras's optimizer all-reduces what it is given (under
    multiworker the collective then carries 16-bit tensors), and its
    ``update_step`` casts each gradient to its variable's dtype inside the
    strategy's update of that variable, which runs on the variable's device:
    under ps the cast back happens on the ps, after the 16-bit gradient has
    crossed the network. The update itself is float32 arithmetic.

    ``jit`` (``xla_part``: the strategy's ``jit_compiles`` for a model compiled
    with ``jit_compile=True``, else None): "step" compiles the whole replica step
    with XLA, as fit does; "gradients" only the forward, loss and backward pass
    (``xla_gradients``), the all-reduce and the update run outside XLA. A model's
    own ``train_step`` is compiled whole ("step") or, for the other parts, each call
    of its model (``workload.xla_calls``), its applies outside XLA.
    """
    model, optimizer = state.model, state.optimizer
    if metrics.own_step:
        own = _own_step_fn(model, metrics, lambda: DirectApply(gradient_dtype, accumulation),
                           xla=jit not in (None, "step"))
        if jit != "step":
            return own
        # As fit compiles a model's train_step under jit_compile=True.
        compiled = tf.function(own, jit_compile=True, reduce_retracing=True)
        compiled.takes_batch = True
        return compiled
    one_batch = make_one_batch(state, metrics)
    if jit == "gradients":
        one_batch = xla_gradients(one_batch)
    step_fn = make_update(one_batch, optimizer, model.trainable_variables,
                          gradient_dtype, accumulation)
    if jit == "step":
        # As fit compiles its step under jit_compile=True: the replica's
        # step with XLA, called inside strategy.run.
        return tf.function(step_fn, jit_compile=True, reduce_retracing=True)
    return step_fn


def xla_part(model: keras.Model, kind) -> str | None:
    """What of the step XLA compiles (``kind.jit_compiles``: "step", "gradients",
    "values", "stages") for a model compiled with ``jit_compile=True``; None
    without. ``model``: the trained one, compiled in the strategy's scope, where
    Keras resolves ``jit_compile="auto"`` to False as ``fit`` does."""
    return kind.jit_compiles if getattr(model, "jit_compile", False) is True else None


def xla_gradients(one_batch):
    """``one_batch`` (forward, loss, gradients, metric values of one batch) as one
    XLA-compiled function, called inside the replica's step: what it returns is
    unapplied, so the all-reduce and the update that follow are outside XLA (a
    cross-worker collective inside it fails: UnimplementedError on CPU)."""
    return tf.function(one_batch, jit_compile=True, reduce_retracing=True)


def make_one_batch(state: TrainState, metrics: TrainMetrics):
    """``one_batch(features, labels, sample_weight=None) -> (gradients, loss, metric
    values)``: one replica's forward and backward pass on one batch, unapplied."""
    model, optimizer = state.model, state.optimizer

    def one_batch(features, labels, sample_weight=None):
        with tf.GradientTape() as tape:
            y_pred, loss = forward(model, features, labels, sample_weight)
            scaled = optimizer.scale_loss(loss)  # a LossScaleOptimizer's scaling; else loss
        grads = tape.gradient(scaled, model.trainable_variables)
        return grads, loss, metrics.batch_values(labels, y_pred, sample_weight)

    return one_batch


def make_update(one_batch, optimizer, variables, gradient_dtype: str = "float32",
                accumulation: int = 1):
    """``step_fn(*batches)``: ``one_batch``'s gradients (the mean of N batches'
    with ``accumulation`` N > 1) sent as ``gradient_dtype`` and applied to
    ``variables`` once; returns the loss and metric values."""

    def step_fn(*batches):
        if accumulation == 1:
            grads, loss, values = one_batch(*batches)
        else:
            grads, loss, values = accumulate(one_batch, batches)
        grads = to_wire(grads, gradient_dtype)
        with schedule_in_batches(optimizer, accumulation), updates_as_ready(optimizer):
            optimizer.apply_gradients(zip(grads, variables))
        return loss, values

    return step_fn


@contextlib.contextmanager
def updates_as_ready(optimizer):
    """While an update is traced, each variable's update is free to start as soon
    as its own gradient exists.

    Keras's TensorFlow optimizer first sums the gradients over the replicas in
    sync (``ReplicaContext.all_reduce``), and that all-reduce's
    ``tf.custom_gradient`` passes every gradient through one IdentityN: no
    update can start before the last gradient of the backward pass is made.
    Under ``ps`` that holds every push to the ps until the backward pass ends
    (a profile showed the dense kernel's gradient ready 26 ms before its
    push). With one replica in sync the sum is the gradient itself, so the
    sum is left out; with more (mirrored, multiworker) the all-reduce is the
    point and stays.
    """
    ctx = tf.distribute.get_replica_context()
    with summed_already(optimizer, ctx is not None and ctx.num_replicas_in_sync == 1):
        yield


@contextlib.contextmanager
def summed_already(optimizer, really: bool = True):
    """While an update is traced, Keras's optimizer applies the gradients it is
    given as the replicas' sum, without summing them itself (``really``)."""
    # LossScaleOptimizer: the sum runs in its inner optimizer's update.
    hooked = [o for o in contract.with_inner(optimizer)
              if hasattr(o, "_all_reduce_sum_gradients")] if really else []
    for o in hooked:
        o._all_reduce_sum_gradients = list  # the pairs as given (an instance attribute)
    try:
        yield
    finally:
        for o in hooked:
            del o._all_reduce_sum_gradients


class DirectApply:
    """Where a model's own ``train_step`` applies its gradients under ``none``,
    ``mirrored``, ``multiworker`` and ``ps`` (the handler of
    ``workload.apply_route.ApplyRoute``): through the library's gradient path, then
    Keras's own ``apply``, which all-reduces them over the replicas in sync.

    - ``gradient_dtype`` 16 bits: the gradients reach Keras's ``apply`` cast, as the
      library's step hands them (``make_step_fn``): the all-reduce carries 16 bits,
      each variable's update casts back and computes in float32.
    - ``accumulation`` N > 1: the step calls the model's ``train_step`` on each of
      its N batches (``batch`` is the one being traced); each apply's gradients
      (by slot: the GAN's first and second) are summed over the first N - 1 calls
      and their mean applied at the N-th, once: Keras's accumulation (the weights
      do not move until the N-th batch; a schedule read at the batch count), with
      no ``tf.cond`` around the all-reduce (which tf.distribute cannot trace).
    """

    def __init__(self, gradient_dtype: str = "float32", accumulation: int = 1):
        self.dtype, self.n = gradient_dtype, accumulation
        self.batch = 0
        self._sums: dict[int, list] = {}

    def mean(self, slot: int, grads) -> list | None:
        """The mean of this slot's gradients over the step's batches at its last batch;
        None before (the sum is kept)."""
        if self.n == 1:
            return list(grads)
        before = self._sums.pop(slot, None)
        total = list(grads) if before is None else [_add(a, b) for a, b in zip(before, grads)]
        if self.batch < self.n - 1:
            self._sums[slot] = total
            return None
        return [_scale(g, 1.0 / self.n) for g in total]

    def pending(self) -> list:
        """The sums kept so far: the next batch starts after them (one batch's
        activations alive at a time, as ``accumulate``)."""
        return [getattr(g, "values", g) for grads in self._sums.values() for g in grads
                if g is not None]

    def close(self) -> None:
        """A train_step call returned (nothing is left open here)."""
        return None

    def __call__(self, slot, optimizer, grads, variables) -> None:
        from tfdist.training.workload.apply_route import original_apply

        grads = self.mean(slot, grads)
        if grads is None:
            return
        grads = to_wire(grads, self.dtype)
        with schedule_in_batches(optimizer, self.n), updates_as_ready(optimizer):
            original_apply(optimizer, grads, variables)


def own_train_steps(model, handler, batches, xla: bool = False):
    """The model's own ``train_step`` on each of ``batches`` (as the dataset yields
    them), its applies routed to ``handler`` (``DirectApply``, or ps-sync's worker);
    returns the last call's logs, flattened as Keras flattens them. ``xla``: each
    call of its model compiled with XLA, on values (``workload.xla_calls``)."""
    from tfdist.training.workload.apply_route import ApplyRoute, optimizer_attrs
    from tfdist.training.workload.xla_calls import compiled_calls

    route = ApplyRoute(model, optimizer_attrs(model),
                       assigns=getattr(handler, "routes_assigns", False))
    logs = None
    with route.routed(handler), (compiled_calls(model) if xla else contextlib.nullcontext()):
        for i, batch in enumerate(batches):
            handler.batch = i
            route.new_call()
            with tf.control_dependencies(handler.pending()):
                try:
                    logs = contract.flat_logs(model.train_step(batch))
                finally:
                    handler.close()  # before the enclosing control dependencies end
    return logs


def _own_step_fn(model: keras.Model, metrics: TrainMetrics, make_handler, xla: bool = False):
    """The model's own ``train_step``, called in replica context as ``fit`` calls it
    under MirroredStrategy (``strategy.run(train_step, (data,))``), on each of the
    step's batches, its applies routed to a handler of each replica's own
    (``make_handler()``: tf.distribute may trace the replicas in turns, each
    keeping its sums).

    Its logs are the model's stateful metrics (running means), flattened as
    Keras flattens them (``compile_metrics`` -> ``mae``); the loss is divided
    by the replicas in sync, so ``make_train_fn``'s sum over the replicas
    gives their mean, as for the library's own step's scaled loss (0 when
    the step logs no "loss": ``TrainMetrics.logs`` leaves it out).
    """

    def step_fn(*batches):  # each batch as the dataset yields it
        logs = own_train_steps(model, make_handler(), batches, xla)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        loss = tf.constant(0.0)
        if metrics.has_loss:
            loss = tf.reshape(tf.cast(logs["loss"], tf.float32), []) / replicas
        return loss, metrics.logged_values(logs)

    step_fn.takes_batch = True  # one batch: called with it whole (make_train_fn)
    return step_fn


def local_sum(strategy, per_replica):
    """This worker's replicas' values, added. Local results only: a
    cross-worker reduce would add a collective per step just to print a number."""
    return tf.add_n(strategy.experimental_local_results(per_replica))


def add_step(strategy, loss_sum, metric_sum, loss, values):
    """The running sums a call returns the means of (``call_outputs``), one step on:
    this worker's replicas' loss counted as their share of the global batch's (each
    replica's loss is already divided by every replica in sync), their metric values
    averaged."""
    replicas = local_replicas(strategy)
    local_fraction = replicas / strategy.num_replicas_in_sync
    return (loss_sum + tf.cast(local_sum(strategy, loss), tf.float32) / local_fraction,
            metric_sum + local_sum(strategy, values) / replicas)


def make_replica_sum(strategy, first_only: bool = False, once_per_task: bool = False):
    """``total(values)``: ``values`` summed over every replica of the job by one small
    all-reduce (each worker's local replicas count once each), as this task's first
    replica holds the sum. ``first_only``: every replica but the job's first adds
    zeros, so every task gets the chief's values and the tasks agree on them.
    ``once_per_task``: only each task's first local replica adds its values (a
    task's own figures, such as its share of an evaluation, counted once)."""
    local = local_replicas(strategy)

    @tf.function
    def total(values):
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            # The identity gives the argument the replica's device: a collective needs one.
            mine = tf.identity(values)
            if first_only or once_per_task:
                # Replicas are numbered by task (chief first), then by local device.
                first = (tf.equal(ctx.replica_id_in_sync_group, 0) if first_only else
                         tf.equal(tf.math.floormod(ctx.replica_id_in_sync_group, local), 0))
                mine = tf.where(first, mine, tf.zeros_like(mine))
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, mine)

        return strategy.experimental_local_results(strategy.run(replica_fn))[0]

    return total


def local_replicas(strategy) -> int:
    try:
        return len(strategy.extended.worker_devices)
    except RuntimeError:  # the default (no-op) strategy: one replica, no device list
        return 1


def after_updates(variables) -> list[tf.Tensor]:
    """One read per variable, each ordered after that variable's pending update.

    Raw reads stay on the variable's device (a ps task): only a control edge
    crosses to the caller, never the values.
    """
    reads = []
    for v in variables:
        var = getattr(v, "_value", v)  # the tf.Variable behind a Keras variable
        with tf.device(var.device):
            reads.append(tf.raw_ops.ReadVariableOp(resource=var.handle, dtype=var.dtype))
    return reads


def make_train_fn(strategy, step_fn, state: TrainState, num_metrics: int,
                  steps_by_worker: tf.Variable | None = None, batches_per_step: int = 1):
    """``train_fn(iterator, num_steps)``: ``num_steps`` steps in one call.

    Packing several steps into one ``tf.function`` call (``--steps-per-execution``)
    saves a host round trip per step, which is what dominates small models.
    Returns the mean loss and metric values (this worker's replicas) and, per
    step, the staleness: updates other workers applied between this step
    reading ``global_step`` and applying its own update (always 0 when
    synchronous). ``steps_by_worker`` (ps only): one count per worker, added
    to by the worker that ran the call once its steps are done.
    ``batches_per_step``: batches one step takes (gradient accumulation).
    """
    global_step, variables = state.global_step, state.model.trainable_variables

    @tf.function
    def train_fn(iterator, num_steps):
        loss_sum = tf.constant(0.0)
        metric_sum = tf.zeros([num_metrics], tf.float32)
        staleness = tf.TensorArray(tf.int64, size=num_steps)
        for i in tf.range(num_steps):
            read_at = global_step.read_value()
            # The step's parameter reads must come after this read for the
            # staleness figure to mean what it says.
            with tf.control_dependencies([read_at]):
                if batches_per_step == 1:
                    batch = next(iterator)
                    # A model's own step takes the batch as the dataset yields it:
                    # a tuple, or features alone.
                    args = (batch,) if getattr(step_fn, "takes_batch", False) else batch
                else:  # the library's own step, accumulating N batches
                    args = tuple(next(iterator) for _ in range(batches_per_step))
                loss, values = strategy.run(step_fn, args=args)
            # Without this, only same-variable ordering holds: the counter's
            # increment could run before the update it counts and the
            # staleness figure would read ~0 whatever the overlap
            # (docs/performance.md).
            with tf.control_dependencies(after_updates(variables)):
                applied_at = global_step.assign_add(1)
            loss_sum, metric_sum = add_step(strategy, loss_sum, metric_sum, loss, values)
            staleness = staleness.write(i, applied_at - 1 - read_at)
        return call_outputs(num_steps, loss_sum, metric_sum, staleness, steps_by_worker)

    return train_fn


def call_outputs(num_steps, loss_sum, metric_sum, staleness, steps_by_worker=None, after=()):
    """A call's outputs: its mean loss and metric values and each step's staleness;
    with ``steps_by_worker`` (ps), the worker that ran the call adds its steps there
    once they and ``after`` are done."""
    steps = tf.cast(num_steps, tf.float32)
    out = {"loss": loss_sum / steps, "metrics": metric_sum / steps,
           "staleness": staleness.stack()}
    if steps_by_worker is not None:
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        ran = tf.one_hot(worker, steps_by_worker.shape[0], dtype=tf.int64) * tf.cast(
            num_steps, tf.int64)
        with tf.control_dependencies([out["loss"], out["staleness"], *after]):
            steps_by_worker.assign_add(ran, read_value=False)
    return out


def metric_dict(loss, names, values) -> dict[str, float]:
    """{"loss": ..., metric name: ...} for progress lines, from a call's output."""
    out = {"loss": float(loss)}
    out.update({name: float(v) for name, v in zip(names, list(values))})
    return out
