"""A model the pipeline's cut cannot carry, trained placed (``--strategy pipeline``).

The cut (``training.pipeline.stages``) splits the model into per-stage models and
runs its own step over them, so it cannot carry what needs the whole model in one
Python function: a model's own ``train_step``, a ``compute_loss`` that calls the
model itself or counts the model's own losses otherwise than in proportion, a
``call`` the trace cannot follow or one calling a layer with weights twice
(``why_placed``). Such a model trains **placed** instead: the chief (a client of
the cluster, ``make_master_device_default=False``) builds the task's model once,
each variable created on a worker (``placement``: runs of variables in creation
order, balanced by parameter count), each leaf layer's ``call`` run under its
weights' worker's ``tf.device`` (``place_computation``) and each optimizer's
per-variable update under its variable's (its slots are made there by Keras's
own colocation); then the ``none`` strategy's loop (``training.sync.sync_trainer``,
joined in ``training.assemble``) trains it exactly as under ``none``: its own
``train_step``, callbacks, evaluation, checkpoints, everything. One batch, one forward, one apply per step: the workers
hold the weights and run their layers in turn, with no micro-batches to overlap.
"""

from __future__ import annotations

import functools
import math
import signal

import keras
import tensorflow as tf

from tfdist.protocol import ConfigError
from tfdist.training.loop.state import build_model, build_state
from tfdist.training.pipeline import stages as stage_cut
from tfdist.training.pipeline.pipeline_trainer import stage_device
from tfdist.training.workload import apply_route, contract

CANNOT_CARRY = "which the cut into stages cannot carry"


def why_placed(kind, checked, config) -> str | None:
    """Why the task's model trains placed under ``kind`` (the notice's reason, starting
    "its model ..."), or None: the kind cuts it. Probes the model's own
    ``compute_loss`` on the first example and cuts a fresh build of the model as the
    run would (``stages.local_stages``); a cut that fails for another reason (more
    stages than layers) raises its own one line."""
    if not getattr(kind, "trains_uncut_placed", False):
        return None
    model = checked.local_model
    if contract.overrides(model, "train_step"):
        return f"its model overrides train_step, {CANNOT_CARRY}"
    why = _why_not_carried(checked, config)
    if why and getattr(model, "jit_compile", False) is True:
        raise ConfigError(
            f"task {checked.spec.name!r}: {why}, so it would train placed, with its variables "
            "on the workers, where the library's step cannot compile it with XLA (only a "
            "model's own train_step's calls of its model are compiled there); compile it "
            "without jit_compile=True for pipeline, or train it under another strategy")
    return why


def _why_not_carried(checked, config) -> str | None:
    model = checked.local_model
    if contract.overrides(model, "compute_loss") and checked.example is not None:
        calls, own_losses = contract.probe_compute_loss(model, checked.example)
        if calls:
            return f"its model's compute_loss calls the model itself, {CANNOT_CARRY}"
        if own_losses:
            try:
                contract.own_losses_weight(model, checked.example)
            except ConfigError as err:
                return "its " + str(err).removeprefix("the ")
    return _why_not_cut(checked, config)


def _why_not_cut(checked, config) -> str | None:
    workers, pipelines = config.cluster.num_members("worker"), max(1, config.pipelines)
    boundaries = stage_cut.parse_boundaries(config.stages)
    if workers < pipelines or workers % pipelines or (
            boundaries is not None and len(boundaries) + 1 != workers // pipelines):
        return None  # make_plan refuses the flags in its own line
    plan = stage_cut.PipelinePlan(workers // pipelines, 1, pipelines, boundaries)
    name = checked.spec.name
    try:
        stage_cut.local_stages(checked.task, checked.task.build_model(), plan, name,
                               checked.example)
    except stage_cut.CannotCut as err:
        line = str(err).split("; provide stages:")[0]
        line = line.removeprefix(f"task {name}: ").removeprefix(f"task {name!r}: ")
        return f"{line}, {CANNOT_CARRY}"
    return None


def placement(sizes: list[int], workers: int) -> list[int]:
    """The worker of each layer (``sizes``: their trainable parameter counts in the
    order their variables are created): consecutive runs whose largest parameter count
    is smallest (``stages.balance``), so each worker holds layers next to each other;
    with no more layers than workers, one each."""
    if len(sizes) <= workers:
        return list(range(len(sizes)))
    bounds = stage_cut.balance(sizes, workers)
    return [sum(i >= b for b in bounds) for i in range(len(sizes))]


def creation_devices(created: list[tuple[bool, int, int]], workers: int) -> list[str | None]:
    """The device of each variable a build creates (``created``: (trainable, size, owner)
    in creation order, ``owner`` the leaf layer holding it): a layer's trainable
    variables together on their worker (``placement``); any other variable (a
    normalization's statistics, a metric's state, an optimizer's counter) its last
    trainable predecessor's, or None (the chief) before the first."""
    units = []  # consecutive trainable variables of one layer: one unit
    for trainable, size, owner in created:
        if trainable and units and units[-1][0] == owner:
            units[-1][1] += size
        elif trainable:
            units.append([owner, size])
    order = iter(placement([size for _, size in units], workers))
    devices, last, owner_now = [], None, object()
    for trainable, _, owner in created:
        if trainable and (last is None or owner != owner_now):
            last, owner_now = stage_device(next(order)), owner
        devices.append(last)
    return devices


def created_by(build) -> list[tuple[bool, int, int]]:
    """(trainable, size, owner) of every variable ``build()`` creates, in creation order;
    ``owner``: the index of the leaf layer of the built model holding it (-1: none)."""
    created = []

    def record(next_creator, **kwargs):
        var = next_creator(**kwargs)
        created.append((var, bool(kwargs.get("trainable", True)), int(math.prod(var.shape))))
        return var

    with tf.variable_creator_scope(record):
        model = build()
    owners = {}
    for i, layer in enumerate(model._flatten_layers(include_self=False)):  # pylint: disable=protected-access
        for w in layer.weights:
            owners.setdefault(id(getattr(w, "value", w)), i)
    return [(trainable, size, owners.get(id(var), -1)) for var, trainable, size in created]


def placing(devices: list[str | None]):
    """A variable creator scope putting the i-th variable created under ``devices[i]``
    (None, or past the list: where TensorFlow puts it, so an optimizer's slots follow
    Keras's colocation with their variable)."""
    count = [0]

    def creator(next_creator, **kwargs):
        i = count[0]
        count[0] += 1
        device = devices[i] if i < len(devices) else None
        if device is None:
            return next_creator(**kwargs)
        with tf.device(device):
            return next_creator(**kwargs)

    return tf.variable_creator_scope(creator)


def device_of(variable) -> str:
    """A Keras or TensorFlow variable's device."""
    return variable.device if isinstance(variable, tf.Variable) else variable.value.device


def _run_on(owner, method: str, device_for) -> None:
    """``owner.method`` replaced on the instance by one running under ``device_for(*args)``'s
    device; set past Keras's tracking ``__setattr__``, the signature kept (``functools.wraps``:
    Keras reads a call's ``training`` argument from it)."""
    own = getattr(owner, method)

    @functools.wraps(own)
    def placed(*args, **kwargs):
        with tf.device(device_for(*args, **kwargs)):
            return own(*args, **kwargs)

    object.__setattr__(owner, method, placed)


def place_computation(model) -> dict:
    """Each leaf layer's ``call`` under the device of its largest weight; a leaf without
    weights (an activation, a dropout) under the previous weighted layer's, in the
    model's layer order; {layer: device} of the placed ones."""
    placed, last = {}, None
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        if layer._layers:  # pylint: disable=protected-access  # not a leaf: its leaves are placed
            continue
        if layer.weights:
            last = device_of(max(layer.weights, key=lambda w: math.prod(w.shape)))
        if last is None:
            continue
        _run_on(layer, "call", lambda *_, d=last, **__: d)
        placed[layer] = last
    return placed


def place_updates(optimizers) -> None:
    """Each optimizer's per-variable update (``update_step``) under its variable's device,
    so the update reads and writes the weight and its slots where they live."""
    for optimizer in optimizers:
        for o in contract.with_inner(optimizer):
            _run_on(o, "update_step", lambda _grad, variable, *_: device_of(variable))


def build_placed_state(plan, task, strategy, example=None, own_optimizers=None):
    """``loop.state.build_state``'s state, its model's variables on the workers.

    A first build (thrown away) counts the variables in creation order; the kept one,
    from the same seed (so its initial weights are those ``none`` builds), creates
    each on its worker (``creation_devices``)."""
    created = created_by(lambda: build_model(task, example))
    keras.utils.set_random_seed(plan.config.seed)  # the throw-away build drew from it
    with placing(creation_devices(created, plan.pipeline.stages)):
        state = build_state(plan, task, strategy, example, own_optimizers)
    # Read by PlacedTrainer for the results record: {layer name: worker}.
    state.placement = {layer.name: worker_name(device)
                       for layer, device in place_computation(state.model).items()}
    place_updates(apply_route.optimizers_of(state.model, own_optimizers or {}))
    return state


def worker_name(device: str) -> str:
    """``/job:worker/replica:0/task:1/device:CPU:0`` -> ``worker:1``."""
    parts = dict(p.split(":", 1) for p in device.strip("/").split("/") if ":" in p)
    return f"{parts.get('job', '?')}:{parts.get('task', '0')}"


class Placed:
    """``pipeline`` on the chief for a model the cut cannot carry: the ``none`` loop over
    the model whose weights and layers' computation are on the workers. The chief alone
    runs the steps; a SIGTERM stops the run at a call boundary (saved, exit 42), as the
    cut's trainer does. Joined to the ``none`` loop's trainer class by
    ``training.assemble`` (``PlacedTrainer``), so this package imports no other
    strategy's."""

    @staticmethod
    def build_state(plan, task, strategy, example=None, own_optimizers=None):
        return build_placed_state(plan, task, strategy, example, own_optimizers)

    _preempted = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.placement = getattr(self.state, "placement", {})
        if self.is_chief:
            print(self.notice(), flush=True)

    def parameters_per_worker(self) -> dict[str, int]:
        counts = {}
        for v in self.state.model.trainable_variables:
            name = worker_name(device_of(v))
            counts[name] = counts.get(name, 0) + int(math.prod(v.shape))
        return counts

    def notice(self) -> str:
        pp = self.plan.pipeline
        held = ", ".join(f"{n} {c}" for n, c in sorted(self.parameters_per_worker().items()))
        unused = f"; {pp.unused} has no effect" if pp.unused else ""
        return (f"pipeline: task {self.plan.task.name!r}: {pp.placed}; training it placed: its "
                f"layers' weights and computation on the {pp.stages} workers in order "
                f"(parameters: {held}), one batch at a time (no micro-batches){unused}")

    def _xla_part(self, model) -> str | None:
        # XLA cannot read the workers' variables inside a compiled function (as under ps:
        # "Trying to access resource ... located in device"), so, as under ps, each call
        # of the model is one XLA function of the variables' values, read before it.
        return "values" if getattr(model, "jit_compile", False) is True else None

    def training_members(self) -> list[str]:
        return [self.cluster.member_name]  # the workers only serve

    def _preemption_handler(self, strategy):
        try:  # TensorFlow's handler is for a strategy's workers; here the chief stops alone
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: no handler
            pass
        return None

    def _on_sigterm(self, *_):
        self._preempted = True

    def stop_requested(self) -> bool:
        return self._preempted

    def result_fields(self, ran: int) -> dict:
        return {**super().result_fields(ran),
                "pipeline": {**self.plan.pipeline.describe(), "placement": self.placement,
                             "parameters_per_worker": self.parameters_per_worker()}}

    def close(self, finished: bool) -> None:
        try:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        except (ValueError, TypeError):
            pass
        super().close(finished)

