"""The trainer of ``--strategy pipeline``: model parallelism, and hybrid with ``--pipelines``.

The chief is a client connected to the workers
(``StrategyKind.build``: ``experimental_connect_to_cluster``). It cuts the
task's model into S stages (``training.pipeline.stages``) and builds stage ``s`` of
copy ``p`` under ``tf.device`` of worker ``p*S + s``, with its own optimizer
built in the same scope: the stage's variables and optimizer slots live on
that task, and only activations and their gradients cross the network.

A call runs up to ``MAX_STEPS_PER_CALL`` of ``--steps-per-execution``'s steps
as one ``tf.function`` (``make_call``), so a stage may start its next step
while later stages still update. In a step the global batch is split into P x M
micro-batches; each stage runs its forwards and backwards on its own task,
stamped there (busy time per stage): under ``--schedule`` dataflow (the
default) each as soon as its input is there, several at once where the task
has free threads; under gpipe (every forward then every backward) and 1f1b
chained in that order. Each stage's gradients are summed on its own task, its
matrix products' weight gradients once per step from every micro-batch's rows
(``training.pipeline.weight_grads``). With ``P > 1`` each stage's accumulated
gradients are averaged over its P copies by a reduce-scatter and an all-gather
placed on the copies' tasks (``average_over_copies``) and the same average is
applied by every copy's optimizer (identical weights and slots, so the copies
stay identical). One update per step: the same math as
one process at the same global batch (the mean over P x M equal micro-
batches is the batch mean), up to floating-point summation order.

Checkpoints hold copy 0's stages and optimizers (``stage_i``) and the step
counters; after a restore every other copy is set from copy 0.
"""

from __future__ import annotations

import dataclasses
import math
import re
import signal
import time

import keras
import tensorflow as tf

from tfdist.training.workload import contract, data

from tfdist.training.pipeline import stages as stage_cut
from tfdist.training.pipeline import updates
from tfdist.training.pipeline import weight_grads
from tfdist.training.loop.step import metric_dict, schedule_in_batches
from tfdist.training.loop.survival.lost import LOST_MEMBER_ERRORS
from tfdist.linux import vm_hwm
from tfdist.training.loop.trainer import Trainer


def stage_device(worker: int) -> str:
    return f"/job:worker/replica:0/task:{worker}/device:CPU:0"


class StagedModel:
    """The stages of one copy seen as one model: the weights in the task's
    model's order (stage 0's first), for evaluation, hashing and the
    finite-weights check, which read ``weights`` only. ``held``: {position in
    the task model's weights: variable} of the weights outside the cut (a
    distiller's teacher, which only its ``compute_loss`` calls), the chief's
    own, not trained. ``layout``: for each position of the task model's weights,
    (stage, index in that stage's weights), or None where ``held`` has it; None:
    the stages' weights in stage order (a chain's cut, a task's ``stages()``). A
    graph's stages order their weights as their own graphs do, which need not be
    the model's order."""

    def __init__(self, models, held=None, layout=None):
        self.stages = list(models)
        self.held = dict(held or {})
        self.layout = layout

    @property
    def weights(self):
        if self.layout is not None:
            return [self.held[i] if where is None else self.stages[where[0]].weights[where[1]]
                    for i, where in enumerate(self.layout)]
        staged = iter([w for m in self.stages for w in m.weights])
        n = len(self.held) + sum(len(m.weights) for m in self.stages)
        return [self.held[i] if i in self.held else next(staged) for i in range(n)]

    @property
    def trainable_weights(self):
        return [w for m in self.stages for w in m.trainable_weights]

    trainable_variables = trainable_weights

    @property
    def non_trainable_variables(self):
        return [w for m in self.stages for w in m.non_trainable_weights]

    def get_weights(self):
        return [w.numpy() for w in self.weights]


class PipelineState:
    """``training.loop.state.TrainState``'s fields, plus every copy's stages."""

    sharded = None  # a pipeline's state is cut by stage, never split over the workers

    def __init__(self, copies, optimizers, devices, cut: str, global_clipnorm=None, held=None,
                 layout=None):
        self.copies, self.optimizers, self.devices, self.cut = copies, optimizers, devices, cut
        # The whole model's (training.pipeline.updates); the stages' optimizers clip none.
        self.global_clipnorm = global_clipnorm
        self.model = StagedModel(copies[0], held, layout)
        self.optimizer = optimizers[0][0]
        # On the client (make_master_device_default=False keeps them local).
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        self.completed_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name="completed_steps")
        objects = {f"stage_{s}": tf.train.Checkpoint(model=m, optimizer=o)
                   for s, (m, o) in enumerate(zip(copies[0], optimizers[0]))}
        self.checkpoint = tf.train.Checkpoint(**objects, global_step=self.global_step,
                                              completed_steps=self.completed_steps)

    def sync_copies(self) -> None:
        """Every copy's weights and optimizer variables set from copy 0 (after a restore)."""
        for p in range(1, len(self.copies)):
            for s, (model, opt) in enumerate(zip(self.copies[p], self.optimizers[p])):
                for dst, src in zip(model.weights, self.copies[0][s].weights):
                    dst.assign(src)
                for dst, src in zip(opt.variables, self.optimizers[0][s].variables):
                    dst.assign(src)

    def bytes_per_task(self) -> tuple[dict, dict]:
        """({worker: bytes of its stage's weights}, {worker: weights + optimizer variables})."""
        params, state = {}, {}
        for row, opts, devs in zip(self.copies, self.optimizers, self.devices):
            for model, opt, (name, _) in zip(row, opts, devs):
                weights = sum(_nbytes(w) for w in model.weights)
                params[name] = weights
                state[name] = weights + sum(_nbytes(v) for v in opt.variables)
        return params, state

    def peak_rss_per_task(self) -> dict:
        """{worker: its process's peak resident bytes so far}: the kernel's high-water
        mark (``VmHWM``), read by a ``ReadFile`` of ``/proc/self/status`` placed on
        each stage's task, so the process that reads it is the task's own. Empty
        where it cannot be read (no ``/proc``)."""
        out = {}
        for row in self.devices:
            for name, device in row:
                try:
                    with tf.device(device):
                        text = tf.io.read_file("/proc/self/status")
                    peak = vm_hwm(text.numpy().decode())
                except (tf.errors.OpError, UnicodeDecodeError):
                    return {}
                if peak is None:
                    return {}
                out[name] = peak
        return out


def _nbytes(v) -> int:
    return int(math.prod(v.shape)) * tf.as_dtype(v.dtype).size


def _clone_layer(layer):
    """A layer of a stage made anew from its config, as ``clone_model`` makes it; a
    ``Lambda`` layer (no weights) is the task's own, reused: remade from its config
    its Python function would be deserialized, which Keras's safe mode refuses."""
    if isinstance(layer, keras.layers.Lambda) and not layer.weights:
        return layer
    return type(layer).from_config(layer.get_config())


def build_pipeline_state(plan, task, strategy, example=None) -> PipelineState:
    """The task's model, cut and placed: one stage per worker, per copy. ``example``:
    the first training batch, whose features a subclassed model is traced with."""
    pp = plan.pipeline
    model = task.build_model()  # first after the seed: one process's initial weights
    local, cut = stage_cut.local_stages(task, model, pp, plan.task.name, example)
    copies, optimizers, devices = [], [], []
    for p in range(pp.pipelines):
        row, opts, devs = [], [], []
        for s in range(pp.stages):
            worker = pp.worker(p, s)
            device = stage_device(worker)
            with tf.device(device):
                stage = keras.models.clone_model(local[s], clone_function=_clone_layer)
                opt = updates.stage_optimizer(plan, model)
                # Built here, so the slots land on the stage's task too.
                opt.build(stage.trainable_variables)
            stage.set_weights(local[s].get_weights())
            row.append(stage)
            opts.append(opt)
            devs.append((f"worker:{worker}", device))
        copies.append(row)
        optimizers.append(opts)
        devices.append(devs)
    clip = None if plan.optimizer.library else updates.global_clipnorm(model.optimizer)
    return PipelineState(copies, optimizers, devices, cut, clip, _held(task, model, local),
                         _layout(task, model, local))


def _layout(task, model, local) -> list | None:
    """Where each of ``model``'s weights is among the stages' (``StagedModel``): found
    by identity, since a cut's stages share the model's layers (None for a task's
    own ``stages()``, whose weights line up in order)."""
    if callable(getattr(task, "stages", None)):
        return None
    where = {id(w): (s, j) for s, m in enumerate(local) for j, w in enumerate(m.weights)}
    return [where.get(id(w)) for w in model.weights]


def _held(task, model, local) -> dict:
    """{position: variable} of ``model``'s weights that no stage holds (the cut shares
    the model's layers, so a stage's weights are the model's own variables): the
    chief's model's (``task.local_model``, which its ``compute_loss`` calls) at
    those positions."""
    if callable(getattr(task, "stages", None)):
        return {}  # the task's own stages line up with every weight (stages.local_stages)
    staged = {id(w) for m in local for w in m.weights}
    positions = [i for i, w in enumerate(model.weights) if id(w) not in staged]
    if not positions:
        return {}
    chief = getattr(task, "local_model", model).weights
    return {i: chief[i] for i in positions}


def _split(structure, n: int) -> list:
    """``structure`` (a tensor, or a dict or tuple of them) as ``n`` equal micro-batches."""
    flat = tf.nest.flatten(structure)
    parts = [tf.split(t, n) for t in flat]
    return [tf.nest.pack_sequence_as(structure, [p[i] for p in parts]) for i in range(n)]


def _clock_anchors(devices) -> list[list]:
    # Automatic control dependencies run every stateful op that takes no
    # resource in program order, which would chain the stages' clocks (and so
    # the stages) into one sequence. A clock read through a function that takes
    # a variable of its stage's own (only read) is ordered by nothing but the
    # dependencies given to it.
    anchors = []
    for row in devices:
        anchors.append([])
        for _, device in row:
            with tf.device(device):
                anchors[-1].append(tf.Variable(0.0, trainable=False, name="clock_anchor"))
    return anchors


class _CopyPass:
    """One copy's forward and backward slots in one traced step: what is in flight
    between its stages (activations forward, their gradients backward), each slot's
    tape, each stage's summed gradients, slot times and end stamps. ``ws``: the
    micro-batches' sample weights (or None), beside their labels on the last stage;
    ``optimizers``: the copy's, whose ``scale_loss`` each stage's loss takes;
    ``own_loss``: a model's own ``compute_loss(x, y, y_pred, sample_weight)`` (or
    None: the compiled loss), with ``fs``, the micro-batches' features on the last
    stage, which it is given."""

    def __init__(self, stages, devices, anchors, clock, compile_loss, metrics, xs, ys,
                 plan: stage_cut.PipelinePlan, after=None, optimizers=None, ws=None,
                 calls=None, own_loss=None, fs=None):
        self.stages, self.devices, self.anchors, self.clock = stages, devices, anchors, clock
        self.optimizers, self.ws = optimizers, ws
        self.own_loss, self.fs = own_loss, fs
        # Per stage, the end stamp of its previous update in the same call (or
        # None): every slot's start follows it, so the time a slot's input
        # waits for the stage's new weights is not counted as busy.
        self.after = after or [None] * len(stages)
        self.compile_loss, self.metrics, self.ys = compile_loss, metrics, ys
        M = self.M = plan.micro_batches
        self.chained = plan.chained
        S = self.S = len(stages)
        self.losses, self.values = [], []
        self.acts = {}  # (s, m): stage s's input for micro-batch m
        self.grads_in = {}  # (s, m): the gradient of stage s's output
        self.tapes = {}  # (s, m): (tape, input, output, loss or None)
        for m in range(M):
            self.acts[(0, m)] = xs[m]
        self.ends = [[] for _ in range(S)]  # every slot's end stamp, per stage, in order (the update's last)
        self.forward_end = {}  # (s, m): the end of its forward, which its backward follows
        self.acc = [[None] * len(st.trainable_variables) for st in stages]  # summed over micro-batches
        # Each stage's products' gradients (training.pipeline.weight_grads).
        self.products = [weight_grads.WeightGrads(st.trainable_variables,
                                                  plan.defers_weight_gradients,
                                                  plan.transposes_weights)
                         for st in stages]
        self.times = [[] for _ in range(S)]
        # Each stage's forward (``_stage_call``), one per stage for every step traced.
        self.calls = calls or [_stage_call(stage, False) for stage in stages]

    def build(self, orders, schedule: str) -> None:
        """Every stage's slots, in an order that respects both each stage's schedule
        and the data between stages (the schedules are deadlock-free, so this always
        completes)."""
        S = self.S
        done = [0] * S
        while any(done[s] < len(orders[s]) for s in range(S)):
            moved = False
            for s in range(S):
                while done[s] < len(orders[s]) and self._ready(s, *orders[s][done[s]]):
                    self._run(s, *orders[s][done[s]])
                    done[s] += 1
                    moved = True
            if not moved:
                raise RuntimeError(f"pipeline schedule {schedule!r} is stuck")

    def means(self):
        # Reduced where they were computed: one transfer per copy and step.
        return tf.concat([[tf.cast(tf.add_n(self.losses) / self.M, tf.float32)],
                          tf.add_n(self.values) / self.M], 0)

    def _ready(self, s, kind, m) -> bool:
        return (s, m) in self.acts if kind == "F" else (s == self.S - 1 or (s, m) in self.grads_in)

    def _run(self, s, kind, m) -> None:
        with tf.device(self.devices[s][1]):
            # Chained, a slot follows the stage's previous one (the schedule's order);
            # under dataflow only its input, and a backward its own forward.
            deps = self.ends[s][-1:] if self.chained else []
            deps += [self.after[s]] if self.after[s] is not None else []
            if kind == "B":
                deps.append(self.forward_end.pop((s, m)))
            # The slot starts once its input is here: waiting for it is idle.
            source = self.acts if kind == "F" else self.grads_in
            if (s, m) in source:  # a tensor, or the several a graph's cut carries
                source[(s, m)] = tf.nest.map_structure(tf.identity, source[(s, m)])
                deps += tf.nest.flatten(source[(s, m)])
            with tf.control_dependencies(deps):
                start = self.clock(self.anchors[s])
            with tf.control_dependencies([start]):
                if kind == "F":
                    out = self._forward(s, m)
                else:
                    out = self._backward(s, m)
            with tf.control_dependencies(tf.nest.flatten(out)):
                end = self.clock(self.anchors[s])
            if kind == "F":
                self.forward_end[(s, m)] = end
            self.times[s].append(tf.stack([start, end]))
            self.ends[s].append(end)

    def _forward(self, s, m) -> list:
        S, M = self.S, self.M
        h = self.acts.pop((s, m))
        with tf.GradientTape() as tape:
            if s > 0:
                tape.watch(h)
            out, reg = self.calls[s](h)
            loss = None
            if s == S - 1:
                y = self.ys[m]
                w = None if self.ws is None else self.ws[m]
                # Keras's reduction divides the weighted sum by the micro-batch's
                # size, so the mean of M equal micro-batches is the batch's.
                if self.own_loss is None:
                    loss = self.compile_loss(y, out, sample_weight=w)
                else:  # under this tape, which watches ``out``: dLoss/dy_pred starts the backward
                    loss = self.own_loss(self.fs[m], y, out, w)
                self.losses.append(loss)
                self.values.append(self.metrics.batch_values(y, out, w))
                # The copy's batch mean is the mean of its M micro-batch means.
                loss = loss / M
            if reg is not None:  # a stage's own (regularization) losses, once per step
                loss = reg / M if loss is None else loss + reg / M
            if loss is not None and self.optimizers is not None:
                # A LossScaleOptimizer's scale (every stage's is the same:
                # training.pipeline.updates); the loss itself otherwise.
                loss = self.optimizers[s].scale_loss(loss)
        self.tapes[(s, m)] = (tape, h, out, loss)
        if s < S - 1:
            self.acts[(s + 1, m)] = out
        return [out] if loss is None else [out, loss]

    def _backward(self, s, m) -> list:
        tape, h, out, loss = self.tapes.pop((s, m))
        g = self.grads_in.pop((s, m), None)
        variables = self.stages[s].trainable_variables
        hs = tf.nest.flatten(h) if s > 0 else []  # a graph's cut carries several
        sources = hs + list(variables)
        with weight_grads.recording(self.products[s]):
            if g is None:
                grads = tape.gradient(loss, sources)
            elif loss is None:
                grads = tape.gradient(out, sources, output_gradients=g)
            else:
                grads = tape.gradient([out, loss], sources,
                                      output_gradients=[g, tf.ones_like(loss)])
        if s > 0:
            # A carried tensor no later node differentiates through: its gradient is 0.
            back = [tf.zeros_like(x) if d is None else d for x, d in zip(hs, grads)]
            self.grads_in[(s - 1, m)] = tf.nest.pack_sequence_as(h, back)
            grads = grads[len(hs):]
        # None where the tape had nothing for a variable (its products' weight
        # gradients are made apart, once per step when deferred).
        self.acc[s] = [a if b is None else b if a is None else a + b
                       for a, b in zip(self.acc[s], grads)]
        done = [a for a in self.acc[s] if a is not None] + self.products[s].pending()
        return done + (tf.nest.flatten(self.grads_in[(s - 1, m)]) if s > 0 else [])

    def gradients(self, s) -> list:
        """Stage ``s``'s gradients summed over the micro-batches, one per variable."""
        return self.products[s].weight_gradients(self.acc[s])


def _stage_call(stage, jit: bool, own_losses_weight: float = 1.0):
    """``call(h) -> (output, the stage's own losses summed, or None)``: the stage's
    forward in training mode; with ``jit`` one XLA cluster on the stage's task (the
    tape then differentiates the compiled function, so its backward is one too).
    ``own_losses_weight``: how the loss counts them (a model's own ``compute_loss``
    may leave them out: 0, as Keras then trains without them)."""

    def call(h):
        out = stage(h, training=True)
        extra = stage.losses if own_losses_weight else []
        total = tf.add_n([tf.reduce_sum(x) for x in extra]) if extra else None
        return out, (total if total is None or own_losses_weight == 1.0
                     else own_losses_weight * total)

    return tf.function(call, jit_compile=True, autograph=False) if jit else call


def covered(intervals):
    """The length of the union of ``[start, end]`` intervals ``[..., K, 2]``, per
    row: a stage's busy time when its slots may overlap (``dataflow``), its slots'
    sum when they cannot."""
    starts, ends = intervals[..., 0], intervals[..., 1]
    order = tf.argsort(starts, axis=-1)
    batch = len(intervals.shape) - 2
    starts = tf.gather(starts, order, batch_dims=batch)
    ends = tf.gather(ends, order, batch_dims=batch)
    k = tf.shape(starts)[-1]
    before = tf.range(k)[None, :] < tf.range(k)[:, None]  # [i, j]: j sorted before i
    lowest = tf.fill(tf.shape(ends), tf.constant(-float("inf"), ends.dtype))
    reach = tf.reduce_max(tf.where(before, ends[..., None, :], lowest[..., None]), axis=-1)
    return tf.reduce_sum(tf.maximum(ends - tf.maximum(starts, reach), 0), axis=-1)


def chunk_sizes(n: int, parts: int) -> list[int]:
    """``n`` elements as ``parts`` contiguous chunks, the first ``n % parts`` one longer (pure)."""
    return [n // parts + (1 if c < n % parts else 0) for c in range(parts)]


def average_over_copies(s: int, grads: list[list], devices) -> list[list]:
    """Stage ``s``'s summed gradients averaged over its P copies: for each copy,
    the mean on that copy's task.

    A reduce-scatter then an all-gather, made of ops placed on the copies'
    tasks (not TensorFlow's collective ops): each copy flattens its gradients
    into one vector (one per dtype) cut into P chunks; chunk c is summed over
    the copies and divided by P on copy c's task (it receives P - 1 chunks), then every copy
    receives the other P - 1 averaged chunks and reassembles the mean. Each
    copy's task sends and receives 2 (P - 1) / P of the stage's gradient bytes,
    as a ring all-reduce does, in one message per chunk; each chunk's mean is
    computed once, so every copy applies the same values."""
    P = len(grads)
    grads = [[tf.convert_to_tensor(g) for g in row] for row in grads]
    shapes = [g.shape for g in grads[0]]
    sizes = [int(math.prod(shape)) for shape in shapes]
    groups = {}  # one vector per dtype (a vector has one)
    for i, g in enumerate(grads[0]):
        groups.setdefault(g.dtype, []).append(i)
    means = [[None] * len(shapes) for _ in range(P)]
    for group in groups.values():
        total = sum(sizes[i] for i in group)
        chunks = []  # chunks[p][c]: copy p's part c, on copy p's task
        for p in range(P):
            with tf.device(devices[p][s][1]):
                flat = tf.concat([tf.reshape(grads[p][i], [-1]) for i in group], 0)
                chunks.append(tf.split(flat, chunk_sizes(total, P)))
        reduced = []
        for c in range(P):  # reduce-scatter: chunk c averaged on copy c's task
            with tf.device(devices[c][s][1]):
                reduced.append(tf.add_n([chunks[p][c] for p in range(P)]) / P)
        for p in range(P):  # all-gather: every copy reassembles the mean
            with tf.device(devices[p][s][1]):
                parts = tf.split(tf.concat(reduced, 0), [sizes[i] for i in group])
                for i, part in zip(group, parts):
                    means[p][i] = tf.reshape(part, shapes[i])
    return means


def _stage_means(s: int, passes: list[_CopyPass], devices, anchors, clock):
    """Stage ``s``'s gradients for its update: each copy's deferred weight gradients
    made and the copies' gradients averaged among them (``average_over_copies``),
    after its last slot; (each copy's start stamp, each copy's means)."""
    P = len(passes)
    starts, sums = [], []
    for p in range(P):
        with tf.device(devices[p][s][1]):
            with tf.control_dependencies(passes[p].ends[s]):  # after every slot
                starts.append(clock(anchors[p][s]))
            with tf.control_dependencies([starts[p]]):
                sums.append(passes[p].gradients(s))
    return starts, sums if P == 1 else average_over_copies(s, sums, devices)


def _update_stage(s: int, passes: list[_CopyPass], copies, optimizers, devices, anchors, clock,
                  starts, means, accumulation: int = 1) -> None:
    """Stage ``s``'s one update: ``means`` applied on every copy, between its start
    stamp (``_stage_means``) and a stamp of its clock; a learning-rate schedule read
    at the batch count when a step takes ``accumulation`` batches, as Keras's."""
    for p in range(len(passes)):
        start = starts[p]
        with tf.device(devices[p][s][1]):
            with tf.control_dependencies([start]):
                variables = copies[p][s].trainable_variables
                with schedule_in_batches(optimizers[p][s], accumulation):
                    optimizers[p][s].apply(means[p], variables)
                # Read after the writes (automatic control dependencies
                # order them), so the end stamp follows the update.
                applied = [tf.identity(v.value) for v in variables]
            with tf.control_dependencies(applied):
                end = clock(anchors[p][s])
            passes[p].times[s].append(tf.stack([start, end]))
            passes[p].ends[s].append(end)  # the stage's last stamp: its update's end


def _targets(features, labels, sample_weight, own_loss: bool):
    """What travels to a copy's last stage: its labels, and its sample weights and
    (for a model's own ``compute_loss``, which may read them) its features when
    there are."""
    targets = {"y": labels}
    if sample_weight is not None:
        targets["w"] = sample_weight
    if own_loss:
        targets["x"] = features
    return targets


def make_pipeline_step(state: PipelineState, compile_loss, metrics,
                       plan: stage_cut.PipelinePlan, accumulation: int = 1,
                       jit_compile: bool = False, own_loss=None):
    """``step(features, labels, sample_weight=None)``: one step over every copy of
    ``plan`` (its S, M and schedule; P is ``state``'s copies); returns (mean loss,
    mean metric values, slot times, each copy's update end stamps per stage).
    ``after``: the previous step's end stamps in the same traced call, which each
    stage's slots start after. ``accumulation``: batches the step's micro-batches
    come from (``plan``'s M counts them all), for the learning-rate schedule.
    ``own_loss``: a model's own ``compute_loss(x, y, y_pred, sample_weight)``, run on
    the last stage's task in place of ``compile_loss`` (its features travel there too).

    What crosses between tasks is only what the step needs: each copy's
    features once to its first stage and its labels once to its last (each
    splits them into micro-batches itself), each micro-batch's activations
    forward and their gradient backward at every cut, and once per step each
    stage's slot times and the last stage's loss and metric means.

    Each stage runs its slots (``stages.schedule_slots``: GPipe's or 1F1B's
    order) one after the other, chained by control dependencies, or under
    dataflow (traced in GPipe's order) each once its input is there; each
    between two ``tf.timestamp``s on the stage's own task: slot times ``[P, S,
    slots + 1, 2]`` (start, end; the last slot is the stage's optimizer update,
    after every other), so a stage's busy time (``covered``) is its own
    compute, measured where it runs.
    """
    copies, optimizers, devices = state.copies, state.optimizers, state.devices
    P, S, M = len(copies), len(copies[0]), plan.micro_batches
    orders = [plan.slots(s) for s in range(S)]
    anchors = _clock_anchors(devices)
    # jit_compile: each stage's forward (and so its backward) one XLA cluster on its
    # task; the transfers, the loss and the update stay outside it.
    weight = getattr(own_loss, "own_losses_weight", 1.0)
    calls = [[_stage_call(stage, jit_compile, weight) for stage in row] for row in copies]

    @tf.function(autograph=False)
    def clock(anchor):
        del anchor
        return tf.timestamp()

    def step(features, labels, sample_weight=None, after=None):
        per_copy_x = _split(features, P) if P > 1 else [features]
        # The labels and sample weights travel together, to each copy's last stage.
        targets = _targets(features, labels, sample_weight, own_loss is not None)
        per_copy_t = _split(targets, P) if P > 1 else [targets]
        passes, copy_means = [], []
        for p in range(P):
            with tf.device(devices[p][0][1]):
                xs = _split(per_copy_x[p], M)  # one transfer of the copy's batch
            with tf.device(devices[p][S - 1][1]):
                ts = _split(per_copy_t[p], M)
            ys, ws, fs = ([t.get(k) for t in ts] for k in ("y", "w", "x"))
            copy = _CopyPass(copies[p], devices[p], anchors[p], clock, compile_loss, metrics,
                             xs, ys, plan, after[p] if after else None, optimizers[p],
                             None if sample_weight is None else ws, calls[p], own_loss,
                             None if own_loss is None else fs)
            copy.build(orders, plan.schedule)
            passes.append(copy)
            with tf.device(devices[p][S - 1][1]):
                copy_means.append(copy.means())
        starts, means = zip(*[_stage_means(s, passes, devices, anchors, clock)
                              for s in range(S)])
        # The whole model's decisions: its global norm, a non-finite loss-scaled step.
        means = updates.agree_and_clip(list(means), optimizers, devices, state.global_clipnorm)
        for s in range(S):
            _update_stage(s, passes, copies, optimizers, devices, anchors, clock, starts[s],
                          means[s], accumulation)
        means = copy_means[0] if P == 1 else tf.add_n(copy_means) / P
        loss, value = means[0], means[1:]
        stamps = []
        for p in range(P):
            for s in range(S):
                with tf.device(devices[p][s][1]):
                    stamps.append(tf.stack(passes[p].times[s]))  # one transfer per stage
        return loss, value, stamps, [[ends[-1] for ends in copy.ends] for copy in passes]

    return step


# A call runs at most this many steps as one traced function. Within one,
# a stage starts its next step's forwards once its own update is done (its
# variables' reads follow their writes there), while later stages still
# update; between calls every stage waits for the last. Measured on
# dense-chain, S = 2, M = 8: stage 0 idle 0.27 at one step per call, 0.14-0.17
# at two, 0.07-0.08 at four; each more step adds about a second of tracing.
MAX_STEPS_PER_CALL = 4


def make_call(step, global_step, steps: int, accumulation: int = 1):
    """``call(iterator)``: ``steps`` pipeline steps (``make_pipeline_step``'s) as
    one traced function; returns the sums of their losses and metric values,
    every step's slot times and the busy seconds of each stage over them all.

    The same updates as ``steps`` calls of one step: each stage's next step
    reads its variables after this step wrote them (automatic control
    dependencies order every use of a variable). The steps are unrolled, not
    looped: in a traced loop every stateful op on a stage would become a
    control edge to the loop's state on the client, a message per op and step.
    ``accumulation`` N: each step takes N batches (``step``'s plan splits them into
    N x M micro-batches).
    """
    client = global_step.device  # the chief's own device

    @tf.function
    def call(iterator):
        losses, values, stamps, after = [], [], [], None
        for _ in range(steps):
            batch = next(iterator)
            if accumulation > 1:
                # N batches as one of N x M micro-batches: their mean is Keras's
                # accumulated update (the mean of N batch means).
                more = [next(iterator) for _ in range(accumulation - 1)]
                batch = tf.nest.map_structure(lambda *t: tf.concat(t, 0), batch, *more)
            loss, value, stamp, after = step(*batch, after=after)
            losses.append(loss)
            values.append(value)
            stamps.append(stamp)
        with tf.device(client):
            global_step.assign_add(steps)
            per_step = [tf.stack(s) for s in stamps]  # each [P * S, slots + 1, 2]
            return {"loss": tf.add_n(losses), "metrics": tf.add_n(values),
                    "stamps": tf.stack(per_step),
                    # Over every step's slots at once: a step's may overlap the next's.
                    "busy": covered(tf.concat(per_step, 1))}

    return call


_TASK = re.compile(r"/job:([^/]+)/replica:\d+/task:(\d+)")


def _task(device: str) -> str:
    """``worker:index`` of a stage's device string; "client" for the chief's own
    ops (placed there, or unplaced, which the client then runs)."""
    found = _TASK.search(device or "")
    return f"worker:{found.group(2)}" if found and found.group(1) == "worker" else "client"


def count_transfers(concrete) -> dict:
    """The tensors that cross between tasks in one step, read from the traced
    step function: each (tensor, consuming task) pair whose producer runs on
    another task is one send/receive pair, as TensorFlow's graph partitioner
    makes it; a control edge across tasks is one too. By kind: between
    stages, from the client, to the client."""
    graph = concrete.graph.as_graph_def()
    nodes = list(graph.node)
    resources = {n.name for n in nodes if n.op == "Placeholder"
                 and n.attr["dtype"].type == tf.resource.as_datatype_enum}
    device = {n.name: (_task(n.device) if n.device else None) for n in nodes}
    edges = [(n.name, inp) for n in nodes for inp in n.input]
    # An unplaced op runs where the placer puts it: one that takes a variable's
    # handle beside the variable (whose task its consumers name), any other on
    # the client, the connected client's default device.
    on_resource = {n.name for n in nodes
                   if any(i.split(":")[0] in resources for i in n.input)}
    changed = True
    while changed:
        changed = False
        users = {}
        for dst, inp in edges:
            users.setdefault(inp.lstrip("^").split(":")[0], set()).add(device[dst])
        for name in on_resource:
            known = users.get(name, set()) - {None}
            if device[name] is None and len(known) == 1:
                device[name] = known.pop()
                changed = True
    device = {k: v or "client" for k, v in device.items()}
    pairs, control = set(), set()
    collectors = {n.name for n in nodes if n.op == "NoOp" and not n.device}
    for dst, inp in edges:
        name = inp.lstrip("^").split(":")[0]
        if name in resources:
            continue  # a handle: the op runs beside the variable
        if inp.startswith("^") and dst in collectors:
            # Automatic control dependencies' "run every stateful op" collector:
            # the call's control outputs, which each task keeps for itself.
            continue
        src = device.get(name, "client")  # the loop's other arguments are the client's
        if src != device[dst]:
            (control if inp.startswith("^") else pairs).add((inp.lstrip("^"), device[dst]))
    kinds = {"between_stages": 0, "from_client": 0, "to_client": 0}
    for inp, dst in pairs | control:
        src = device.get(inp.split(":")[0], "client")
        key = ("from_client" if src == "client" else "to_client" if dst == "client"
               else "between_stages")
        kinds[key] += 1
    return {"total": len(pairs) + len(control), "control": len(control), **kinds}


def own_loss_of(model, example=None):
    """A model's own ``compute_loss`` as ``loss(x, y, y_pred, sample_weight)``, or None
    (the compiled loss). It runs on the chief's whole model object, given the last
    stage's output as ``y_pred``: what it calls besides (the guide's frozen teacher)
    is not cut, and one that calls the model itself is refused before the run
    (``contract.check``). The model's own losses (regularizers, ``add_loss``) are
    the stages', each added on its own task: what ``super().compute_loss`` would add
    of them is 0 here, and ``loss.own_losses_weight`` (probed on ``example``, the
    first training batch: 1 when it adds them, 0 when it leaves them out) weighs
    each stage's instead."""
    if not contract.overrides(model, "compute_loss"):
        return None

    def loss(x, y, y_pred, sample_weight):
        with contract.own_losses_as(model, tf.zeros((), tf.float32)):
            return contract.compute_loss(model, x, y, y_pred, sample_weight, training=True)

    loss.own_losses_weight = 1.0
    if example is not None and contract.probe_compute_loss(model, example)[1]:
        loss.own_losses_weight = contract.own_losses_weight(model, example)
    return loss


class PipelineTrainer(Trainer):
    """``pipeline`` on the chief: owns the model's stages placed on the workers (and their
    optimizers, per copy), the step over micro-batches in --schedule's order, keeping the copies
    identical, and the per-worker parameter and optimizer bytes of the results."""

    lost_member_errors = LOST_MEMBER_ERRORS

    @staticmethod
    def build_state(plan, task, strategy, example=None, own_optimizers=None):
        return build_pipeline_state(plan, task, strategy, example)

    def __init__(self, *, plan, bundle, task, state, checkpointer, start_step, train_metrics):
        super().__init__(plan=plan, bundle=bundle, task=task, state=state,
                         checkpointer=checkpointer, start_step=start_step,
                         train_metrics=train_metrics)
        pp = plan.pipeline
        n = plan.accumulation_steps
        # gradient_accumulation_steps N: a step takes N batches, N x M micro-batches,
        # and applies their mean once (training.pipeline.updates).
        self.step_plan = dataclasses.replace(pp, micro_batches=pp.micro_batches * n)
        state.sync_copies()  # the restored copy 0 everywhere
        dataset_fn = data.make_dataset_fn(
            task.task, plan.global_batch_size, seed=self.config.seed,
            start_step=start_step * n,  # a step takes N batches
            synthetic=self.config.synthetic_data, in_memory=plan.in_memory)
        self._iterator = iter(bundle.strategy.distribute_datasets_from_function(dataset_fn))
        compile_loss = task.local_model._compile_loss  # pylint: disable=protected-access
        # compile(jit_compile=True): each stage's forward and backward with XLA.
        jit = getattr(task.local_model, "jit_compile", False) is True
        step = make_pipeline_step(state, compile_loss, train_metrics, self.step_plan, n, jit,
                                  own_loss_of(task.local_model, task.example))
        global_step = state.global_step
        # One traced function per number of steps a call runs (at most
        # MAX_STEPS_PER_CALL, and a cadence's remainder), made when first used.
        self._calls_of = {}
        self._make_call = lambda k: make_call(step, global_step, k, n)
        self._out = None
        self._timed_steps, self._wall = 0, 0.0
        self._busy = None
        self._last_step = None
        self._transfers = None
        # A polite preemption (SIGTERM) of the chief: the controller drains,
        # saves at the step reached and ends with exit 42 (Preempted); the
        # workers hold nothing the checkpoint lacks.
        self._preempted = False
        self._previous_sigterm = None
        try:
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread (a caller's own thread): no handler
            pass
        if self.is_chief:
            per_step = (f"{pp.micro_batches} micro-batches per step" if n == 1 else
                        f"{pp.micro_batches} micro-batches per batch x {n} batches "
                        "(gradient_accumulation_steps) per step")
            print(f"pipeline: {pp.pipelines} cop{'y' if pp.pipelines == 1 else 'ies'} x "
                  f"{pp.stages} stages, {per_step} (predicted bubble "
                  f"{self.step_plan.bubble():.0%}); {state.cut}", flush=True)
            note = stage_cut.imbalance([m.count_params() for m in state.copies[0]])
            if note:
                print(f"pipeline: {note}", flush=True)
            held = sum(int(math.prod(w.shape)) for w in state.model.held.values()
                       if w.trainable)
            if held:  # fit would train them too, through the model's own compute_loss
                print(f"pipeline: {held} trainable parameters outside the cut (what only "
                      "compute_loss calls, e.g. a teacher) stay as built: no stage trains "
                      "them", flush=True)

    def _on_sigterm(self, *_):
        self._preempted = True

    def stop_requested(self) -> bool:
        return self._preempted

    def train(self, num_steps: int) -> dict[str, float]:
        start = time.perf_counter()
        outs, traced = [], None
        for n in chunk_sizes(num_steps, math.ceil(num_steps / MAX_STEPS_PER_CALL)):
            if n not in self._calls_of:
                self._calls_of[n] = self._make_call(n)
                traced = traced or (self._calls_of[n], n)
            outs.append(self._calls_of[n](self._iterator))
        busy = sum(o["busy"] for o in outs).numpy()  # waits for the steps
        wall = time.perf_counter() - start
        self._out = {"loss": tf.add_n([o["loss"] for o in outs]) / num_steps,
                     "metrics": tf.add_n([o["metrics"] for o in outs]) / num_steps}
        if self._transfers is None:
            call, n = traced
            self._transfers = {k: v // n if v % n == 0 else round(v / n, 2) for k, v in
                               count_transfers(call.get_concrete_function(self._iterator)).items()}
        if not traced:  # steady state: a call that traced a function is not timed
            self._busy = busy if self._busy is None else self._busy + busy
            self._timed_steps += num_steps
            self._wall += wall
        self._last_step = outs[-1]["stamps"][-1].numpy()
        self.completed += num_steps
        return self._metrics()

    def stage_timing(self) -> dict:
        """Each stage task's busy seconds per step (the sum of its slots, stamped on
        the task), the measured step time and each stage's idle fraction, over
        the calls that traced nothing; and the last step's slots, relative to its
        earliest start."""
        names = [name for row in self.state.devices for name, _ in row]
        out = {}
        if self._timed_steps:
            step = self._wall / self._timed_steps
            busy = self._busy / self._timed_steps
            out = {"step_seconds": round(step, 6),
                   "busy_seconds_per_step": {n: round(float(b), 6)
                                             for n, b in zip(names, busy)},
                   "measured_idle": {n: round(1 - float(b) / step, 4)
                                     for n, b in zip(names, busy)}}
        if self._last_step is not None:
            t0 = float(self._last_step[:, :, 0].min())
            order = self.step_plan
            out["last_step_slots"] = {
                n: [[kind, m, round(float(a) - t0, 6), round(float(b) - t0, 6)]
                    for (kind, m), (a, b) in zip(
                        [*order.slots(i % order.stages), ("U", -1)], self._last_step[i])]
                for i, n in enumerate(names)}
        if self._transfers is not None:
            out["transfers_per_step"] = self._transfers
        return out

    def drain(self) -> dict[str, float]:
        """Each call returns with its steps applied."""
        return self._metrics()

    def finish_training(self) -> None:
        """``use_ema``'s averages into every stage of every copy (fit's end)."""
        updates.finish_training(self.state.copies, self.state.optimizers)

    def local_model(self):
        """The task's model assembled from the stages (copy 0's weights, in the model's
        order), the chief's copy evaluation uses too; its optimizer's ``iterations``
        is the global step, as ``fit``'s would be."""
        from tfdist.training.loop.evaluation import local_copy

        local = local_copy(self.state.model, self.task.local_model)
        optimizer = getattr(local, "optimizer", None)
        if optimizer is not None:
            optimizer.iterations.assign(int(self.state.global_step.numpy()))
        return local

    def trained_optimizer(self):
        """Every stage's optimizer (of every copy), whose learning rate a callback sets."""
        return updates.StageOptimizers(self.state.optimizers)

    def set_weights(self, weights: list) -> None:
        """Weights a callback set on the assembled model, into copy 0's stages and every
        other copy's."""
        super().set_weights(weights)
        for p in range(1, len(self.state.copies)):
            for dst, src in zip(self.state.copies[p], self.state.copies[0]):
                for a, b in zip(dst.weights, src.weights):
                    a.assign(b)

    def _metrics(self) -> dict[str, float]:
        if self._out is None:
            return {}
        return metric_dict(self._out["loss"], self.metric_names, self._out["metrics"])

    def result_fields(self, ran: int) -> dict:
        params, state_bytes = self.state.bytes_per_task()
        total = sum(b for name, b in params.items()
                    if name in {n for n, _ in self.state.devices[0]})
        return {
            "global_steps": int(self.state.global_step.numpy()),
            "steps_per_worker": {name: ran for name in self.bundle.kind.training_members(self.cluster)},
            "pipeline": {
                **self.plan.pipeline.describe(),
                "cut": self.state.cut,
                "parameter_bytes_per_task": params,
                "state_bytes_per_task": state_bytes,  # weights + optimizer slots
                "model_parameter_bytes": total,
                # Each stage task's process over the whole run (setup included).
                "peak_rss_bytes_per_task": self.state.peak_rss_per_task(),
                **self.stage_timing(),
            },
        }

    def close(self, finished: bool) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        self.checkpointer.close()
