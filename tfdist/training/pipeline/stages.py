"""How a model is cut into pipeline stages (``--strategy pipeline``).

A task's Sequential model, or a functional model that is a chain of layers
(one input, each layer fed by the one before), or a model whose ``call`` runs one
such sub-model (``forward_chain``: the guide's distiller), is cut into ``S`` consecutive
stages balanced by parameter count; ``--stages 3,5`` names the layers where
stages 1, 2, ... begin instead. Any other model is cut as a graph of layer calls
(``graph_stages``: a functional model's, or a subclassed model's ``call`` traced on
symbolic inputs), each cut carrying every tensor later calls read. A task may
provide ``stages()`` instead, a list of Keras models applied one after the other.
What cannot be traced is refused in one line saying how to provide stages.

The cutting itself (``PipelinePlan``, ``parse_boundaries``, ``balance``,
``check_boundaries``) is pure Python: the plan and its tests need no
TensorFlow. ``local_stages`` builds the stages as local Keras models (on
the client); ``training.pipeline.pipeline_trainer`` places copies of them on the
workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tfdist.protocol import ConfigError

HOW = ("provide stages: a Keras model whose forward is a graph of layer calls (functional, "
       "or a call tracing into one) is cut automatically; otherwise give the task a stages() "
       "method returning a list of Keras models applied one after the other")


class CannotCut(ConfigError):
    """A model the cut cannot see as layer calls (its ``call`` cannot be traced, or it
    calls a layer with weights twice): under ``pipeline`` such a model trains placed
    (``training.pipeline.placed``) unless the task gives ``stages()``."""


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline of a run: S stages, M micro-batches per step, P copies."""

    stages: int  # S: workers per copy, one stage each
    micro_batches: int  # M
    pipelines: int  # P: data-parallel copies of the S-stage pipeline
    boundaries: tuple[int, ...] | None = None  # --stages: the first layer of stages 1..S-1
    schedule: str = "dataflow"  # --schedule: dataflow | gpipe | 1f1b
    # Why the model trains placed (training.pipeline.placed) rather than cut: the one
    # line's reason; None: cut into stages.
    placed: str | None = None
    # What the flags asked of the cut that a placed run leaves aside (said at start).
    unused: str = ""

    def slots(self, stage: int) -> list[tuple[str, int]]:
        """Stage ``stage``'s order of work in a step: ("F", m) forwards and ("B", m)
        backwards of micro-batch m (``schedule_slots``)."""
        return schedule_slots(self.schedule, self.stages, self.micro_batches, stage)

    @property
    def chained(self) -> bool:
        """Whether each stage runs its slots one after the other in the schedule's
        order (``gpipe``, ``1f1b``), or as their inputs arrive (``dataflow``)."""
        return self.schedule != "dataflow"

    @property
    def defers_weight_gradients(self) -> bool:
        """Whether each stage's weight gradients wait for every micro-batch's rows
        (``training.pipeline.weight_grads``), which keeps their layer inputs and
        output gradients to the step's end: not under 1F1B, whose point is to
        hold fewer of them, and pointless with one micro-batch."""
        return self.schedule != "1f1b" and self.micro_batches > 1

    @property
    def transposes_weights(self) -> bool:
        """Whether each stage makes a transposed copy of its products' weights once
        per step for the input gradients: measured on a 2048 x 2048 weight, a copy
        costs 4.4 ms and saves 1.9 ms a 32-row product, so it pays from three
        micro-batches on (and costs a weight-sized buffer)."""
        return self.micro_batches >= 3

    def worker(self, copy: int, stage: int) -> int:
        """The worker task index holding ``stage`` of ``copy``: copy p takes workers p*S..p*S+S-1."""
        return copy * self.stages + stage

    def bubble(self) -> float:
        """GPipe's idle fraction (S - 1) / (M + S - 1): each stage waits S - 1 micro-batch slots."""
        return (self.stages - 1) / (self.micro_batches + self.stages - 1)

    def describe(self) -> dict:
        if self.placed:
            return {"mode": "placed", "workers": self.stages, "placed_because": self.placed,
                    "micro_batches": 1, "pipelines": 1}
        return {"mode": "cut", "stages": self.stages, "micro_batches": self.micro_batches,
                "pipelines": self.pipelines,
                "boundaries": list(self.boundaries) if self.boundaries else None,
                "schedule": self.schedule,
                "predicted_bubble": round(self.bubble(), 4)}


def schedule_slots(schedule: str, stages: int, micro_batches: int,
                   stage: int) -> list[tuple[str, int]]:
    """One stage's slots, in the order it runs them (pure).

    ``gpipe``: every forward, then every backward in reverse, so a stage holds
    the activations of all M micro-batches at once. ``dataflow`` is traced in
    GPipe's order (so it sums the same gradients in the same order) but runs
    each slot as soon as its input is there, several at once where the task
    has free threads: at most GPipe's M in flight. ``1f1b`` (PipeDream's
    one-forward-one-backward, flushed each step): stage s runs S - 1 - s
    forwards to fill the pipeline, then alternates one forward with one
    backward, then drains its backwards; it never holds more than S - s
    micro-batches' activations.
    """
    m_all = range(micro_batches)
    if schedule in ("gpipe", "dataflow"):
        return [("F", m) for m in m_all] + [("B", m) for m in reversed(m_all)]
    warm = min(stages - 1 - stage, micro_batches)
    out = [("F", m) for m in range(warm)]
    for m in range(warm, micro_batches):
        out += [("F", m), ("B", m - warm)]
    return out + [("B", m) for m in range(micro_batches - warm, micro_batches)]


def parse_boundaries(text: str | None) -> tuple[int, ...] | None:
    """``--stages 3,5`` -> (3, 5); one line for anything but increasing positive integers."""
    if text is None or text == "":
        return None
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
        raise ConfigError(
            f"--stages {text!r} is not a list of layer indices; pass the index of the first "
            "layer of each stage after the first, increasing and comma-separated (e.g. "
            "--stages 2,4 cuts layers 0-1 | 2-3 | 4-...), or leave it out to balance by "
            "parameter count")
    return values


def make_plan(workers: int, micro_batches: int, pipelines: int, stages_text: str | None,
              global_batch: int, schedule: str | None = None,
              placed: str | None = None) -> PipelinePlan:
    """The pipeline for ``workers`` worker tasks; ConfigError (one line) for what cannot run.
    ``placed``: why the model trains placed (``placed_plan``), None to cut it."""
    if placed:
        return placed_plan(workers, micro_batches, pipelines, stages_text, schedule, placed)
    if pipelines < 1 or micro_batches < 1:
        raise ConfigError(f"--pipelines={pipelines} --micro-batches={micro_batches}: both "
                          "must be at least 1")
    if workers < pipelines or workers % pipelines:
        raise ConfigError(
            f"--pipelines {pipelines} needs P x S workers (S stages per copy), received "
            f"{workers} worker(s); use --workers {pipelines * max(1, workers // pipelines)} "
            f"or --pipelines dividing {workers}")
    stages = workers // pipelines
    boundaries = parse_boundaries(stages_text)
    if boundaries is not None and len(boundaries) + 1 != stages:
        raise ConfigError(
            f"--stages {stages_text} makes {len(boundaries) + 1} stages, but {workers} "
            f"worker(s) over --pipelines {pipelines} make {stages}; give {stages - 1} "
            f"boundaries, or use --workers {(len(boundaries) + 1) * pipelines}")
    per_copy, rest = divmod(global_batch, pipelines)
    if rest or per_copy % micro_batches:
        raise ConfigError(
            f"--global-batch-size={global_batch} does not split into {pipelines} pipeline "
            f"copies x {micro_batches} micro-batches of equal size; use a multiple of "
            f"{pipelines * micro_batches}")
    schedule = schedule or "dataflow"
    if schedule == "1f1b" and micro_batches < stages:
        raise ConfigError(
            f"--schedule 1f1b with --micro-batches {micro_batches} under {stages} stages has no "
            f"steady one-forward-one-backward phase (it needs M >= S); use --micro-batches "
            f"{stages} or more, or --schedule dataflow")
    return PipelinePlan(stages, micro_batches, pipelines, boundaries, schedule)


def placed_plan(workers: int, micro_batches: int, pipelines: int, stages_text: str | None,
                schedule: str | None, why: str) -> PipelinePlan:
    """A placed run's plan: every worker holds a part of one model, one batch at a time.
    What only a cut defines (copies, stage boundaries) is refused in one line; the
    micro-batches and schedule, which only order a cut's work, are left aside and said."""
    if pipelines != 1:
        raise ConfigError(f"--pipelines {pipelines}: the task's model trains placed, not cut "
                          f"({why}), and a placed model has one copy; drop --pipelines")
    if stages_text:
        raise ConfigError(f"--stages {stages_text}: the task's model trains placed, not cut "
                          f"({why}), so there are no stage boundaries to set; drop --stages")
    unused = [f"--micro-batches {micro_batches}" if micro_batches > 1 else "",
              f"--schedule {schedule}" if schedule and schedule != "dataflow" else ""]
    return PipelinePlan(workers, 1, 1, None, "dataflow", why,
                        ", ".join(u for u in unused if u))


def balance(params: list[int], stages: int) -> tuple[int, ...]:
    """Boundaries cutting ``params`` (one count per layer) into ``stages``
    contiguous non-empty runs whose largest parameter count is smallest (ties:
    the earliest cut). Pure; ConfigError when there are fewer layers than stages.
    """
    n = len(params)
    if stages > n:
        raise ConfigError(
            f"cannot cut a chain of {n} layer(s) into {stages} stages; use at most {n} workers "
            "per pipeline copy")
    prefix = [0]
    for p in params:
        prefix.append(prefix[-1] + p)
    inf = float("inf")
    # best[k][i]: the smallest max over cuts of the first i layers into k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(stages, 1, -1):
        i = cut[k][i]
        bounds.append(i)
    return tuple(reversed(bounds))


def _cut_bounds(counts: list[int], plan, name: str, what: str) -> tuple[int, ...]:
    """Where the stages begin among ``counts`` (each part's parameters): the plan's
    ``--stage-boundaries``, else balanced by parameters; too few parts is one line."""
    if plan.stages > len(counts):
        raise ConfigError(
            f"task {name}: cannot cut its {len(counts)} {what} into {plan.stages} stages "
            f"(workers per pipeline copy); use at most {len(counts)} workers per copy")
    if plan.boundaries is not None:
        check_boundaries(plan.boundaries, len(counts))
        return plan.boundaries
    return balance(counts, plan.stages)


def check_boundaries(boundaries: tuple[int, ...], layers: int) -> None:
    if boundaries[-1] >= layers:
        raise ConfigError(
            f"--stages {','.join(map(str, boundaries))} cuts at layer {boundaries[-1]}, but the "
            f"model's chain has {layers} layers (0-{layers - 1}); every stage needs at least one")


def ranges(boundaries: tuple[int, ...], layers: int) -> list[tuple[int, int]]:
    """[(first, end), ...] of each stage's layers."""
    edges = [0, *boundaries, layers]
    return list(zip(edges[:-1], edges[1:]))


# --- Keras -------------------------------------------------------------------------


def chain_layers(model) -> list | None:
    """The model's layers in order when it is a chain (None otherwise).

    A Sequential model is one; a functional model is one when it has one
    input and one output and each layer is called once, on the output of
    the layer before it.
    """
    import keras

    if isinstance(model, keras.Sequential):
        return list(model.layers)
    if len(getattr(model, "inputs", None) or []) != 1 or len(model.outputs) != 1:
        return None
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    previous = model.inputs[0]
    for layer in layers:
        nodes = getattr(layer, "_inbound_nodes", [])
        if len(nodes) != 1 or len(nodes[0].input_tensors) != 1:
            return None
        if nodes[0].input_tensors[0] is not previous:
            return None
        previous = layer.output
    return layers if previous is model.outputs[0] else None


def forward_chain(model):
    """The sub-model that is the whole forward of ``model``, when ``model`` is no
    chain itself but its ``call`` runs one sub-model that is (the guide's
    distiller: ``call(x) = self.student(x)``, with a teacher only its
    ``compute_loss`` calls); None otherwise. Found by calling ``model.call`` once
    on a symbolic input shaped as each chain sub-model's."""
    import keras

    for sub in [layer for layer in getattr(model, "layers", [])
                if isinstance(layer, keras.Model) and _single_input(layer) is not None
                and chain_layers(layer) is not None]:
        inp = keras.Input(shape=tuple(sub.inputs[0].shape[1:]), dtype=sub.inputs[0].dtype)
        try:
            out = model.call(inp)
        except Exception:  # pylint: disable=broad-except  # another sub-model's input shape
            continue
        history = getattr(out, "_keras_history", None)
        if history is None or history.operation is not sub:
            continue
        node = sub._inbound_nodes[history.node_index]  # pylint: disable=protected-access
        if len(node.input_tensors) == 1 and node.input_tensors[0] is inp:
            return sub
    return None


def _single_input(model):
    """A built model's single input (None without one)."""
    inputs = getattr(model, "inputs", None) or []
    return inputs[0] if len(inputs) == 1 else None


def _params(layer) -> int:
    import math

    return int(sum(math.prod(w.shape) for w in layer.weights))


# Below this ratio of the lightest stage's parameters to the heaviest's, the start line
# says so: at dense-chain's 4.7 M | 8.4 M (0.56) stage 0 idled 0.20-0.21 of a step more
# than stage 1; at 8.9 M | 8.4 M (0.94) within 0.05 of it (docs/pipeline.md).
BALANCED = 0.8


def imbalance(params: Sequence[int]) -> str:
    """A one-line note when the stages hold unequal work, parameters as its measure (as
    the cut's own), or "" (pure). The lightest stage waits for the heaviest beyond the
    bubble, whatever the schedule: no schedule removes that wait, a cut that balances
    does."""
    if len(params) < 2 or max(params) == 0 or min(params) / max(params) >= BALANCED:
        return ""
    light, heavy = params.index(min(params)), params.index(max(params))
    total = sum(params)
    return (f"stage {light} holds {params[light] / total:.0%} of the parameters against "
            f"stage {heavy}'s {params[heavy] / total:.0%}, so it will wait for it beyond the "
            "bubble; a cut with stages of equal work (--stages) avoids that (docs/pipeline.md)")


def local_stages(task, model, plan: PipelinePlan, name: str = "task",
                 example=None) -> tuple[list, str]:
    """The stages as local Keras models sharing ``model``'s layers (and so its
    initial weights), and a one-line description of the cut.

    ``task.stages()`` when the task has it (its models' weights must line
    up with ``model``'s, so evaluation and checkpoints see one model);
    otherwise ``model`` cut as a chain, or as a graph of layer calls
    (``graph_stages``: a functional model that is no chain, a subclassed model
    whose ``call`` traces into one). ConfigError (one line) otherwise.
    ``example``: a batch of the features' structure (the first training element),
    which a subclassed model's trace takes its input shapes from (read from the
    task's data when not given and needed).
    """
    import keras

    provider = getattr(task, "stages", None)
    if callable(provider):
        given = provider()
        if (not isinstance(given, (list, tuple)) or not given
                or not all(isinstance(m, keras.Model) for m in given)):
            raise ConfigError(f"task {name}: stages() must return a non-empty list of Keras "
                              f"models, received {type(given).__name__}; {HOW}")
        if len(given) != plan.stages:
            raise ConfigError(
                f"task {name}: stages() returned {len(given)} models, but the cluster has "
                f"{plan.stages} stages per pipeline copy; use --workers "
                f"{len(given) * plan.pipelines}")
        if plan.boundaries is not None:
            raise ConfigError(f"task {name} provides its own stages(); drop --stages")
        want = [tuple(w.shape) for w in model.weights]
        got = [tuple(w.shape) for m in given for w in m.weights]
        if want != got:
            raise ConfigError(
                f"task {name}: the weights of its stages() ({len(got)} arrays) do not line up "
                f"with build_model()'s ({len(want)}); make stages() the same layers as "
                "build_model(), in order")
        for var, value in zip([w for m in given for w in m.weights], model.get_weights()):
            var.assign(value)  # the stages start from build_model()'s (seeded) weights
        return list(given), f"{len(given)} stages from the task's stages()"
    layers, chain = chain_layers(model), model
    if layers is None and (chain := forward_chain(model)) is not None:
        layers = chain_layers(chain)  # the forward's chain; what else the model holds stays whole
    if layers is None:
        return graph_stages(traced_graph(model, task, example, name), plan, name)
    counts = [_params(layer) for layer in layers]
    bounds = _cut_bounds(counts, plan, name, "layer(s)")
    first_input = chain.inputs[0]
    stages, parts = [], []
    for s, (a, b) in enumerate(ranges(bounds, len(layers))):
        source = first_input if a == 0 else layers[a - 1].output
        inp = keras.Input(shape=tuple(source.shape[1:]), dtype=source.dtype,
                          name=f"stage{s}_in")
        out = inp
        for layer in layers[a:b]:
            out = layer(out)
        stages.append(keras.Model(inp, out, name=f"stage{s}"))
        parts.append(f"stage {s}: layers {a}-{b - 1} ({sum(counts[a:b])} params)")
    return stages, "; ".join(parts)


def check_cut(plan, task) -> str:
    """Cut the task's model as the run will (a local build, no cluster): the
    cut's description, or ConfigError before anything starts."""
    local, cut = local_stages(task, task.build_model(), plan.pipeline, plan.task.name)
    del local
    return cut


def _first_element(task):
    """The first training element of ``task`` as a batch of one (None when its data
    cannot be read here): the input shapes a subclassed model is traced with."""
    from tfdist.training.workload import contract

    try:
        dataset = contract.as_dataset(task.dataset("train"), "dataset('train')")
        return next(iter(dataset.batch(1).take(1)))
    except Exception:  # pylint: disable=broad-except  # the task's own checks say why
        return None


# --- a graph of layer calls ---------------------------------------------------------


@dataclass
class LayerGraph:
    """A model's forward as Keras nodes: ``inputs`` (symbolic, the features'
    structure), ``nodes`` (each one call of a layer or a Keras op, in an order
    where every node follows the nodes it reads), ``outputs`` (the model's output
    structure of symbolic tensors)."""

    inputs: object
    nodes: list
    outputs: object


def _symbolic_inputs(model, example):
    """Fresh ``keras.Input``s in the structure of the model's inputs (a functional
    model's own), or of ``example``'s features (a batch); None without either."""
    import keras
    import tensorflow as tf

    from tfdist.training.workload import contract

    given = getattr(model, "_inputs_struct", None)
    if given is None and example is not None:
        given = contract.features_of(example)
    if given is None:
        return None

    def fresh(t):
        return keras.Input(shape=tuple(t.shape[1:]), dtype=getattr(t.dtype, "name", t.dtype),
                           name=getattr(t, "name", None) if hasattr(t, "_keras_history") else None)

    return tf.nest.map_structure(fresh, given)


def traced_graph(model, task, example, name: str) -> LayerGraph:
    """``model.call`` run once on symbolic inputs (in training mode, as the stages
    run): every layer and Keras op it calls records a node, so a functional model's
    graph and a subclassed model's ``call`` (as long as it calls Keras layers and
    ops on its inputs) give the same kind of graph. ConfigError (one line) when the
    call cannot be traced, or when a layer with weights is called twice (its
    weights would have to live on two stages)."""
    import inspect as pyinspect

    if example is None and getattr(model, "_inputs_struct", None) is None:
        example = _first_element(task)  # only a subclassed model's trace needs it
    inputs = _symbolic_inputs(model, example)
    what = f"task {name}: its model {type(model).__name__} {getattr(model, 'name', '')!r}"
    if inputs is None:
        raise CannotCut(f"{what} has no input shape to trace its call with; {HOW}")
    kwargs = {"training": True} if "training" in pyinspect.signature(model.call).parameters \
        else {}
    try:
        outputs = model.call(inputs, **kwargs)
    except Exception as err:  # pylint: disable=broad-except  # Python Keras cannot trace
        first = (str(err).strip().splitlines() or [""])[0][:160]
        raise CannotCut(f"{what} is not a chain of layers, and its call could not be traced "
                          f"on symbolic inputs ({type(err).__name__}: {first}); {HOW}") from None
    nodes = _nodes_back_to(outputs, inputs)
    if nodes is None:
        raise CannotCut(f"{what} is not a chain of layers, and its call computes its output "
                          f"from something other than Keras layers and ops on its inputs; {HOW}")
    seen = {}
    for node in nodes:
        op = node.operation
        if getattr(op, "weights", None) and seen.setdefault(id(op), node) is not node:
            raise CannotCut(f"{what}: its layer {op.name!r} is called more than once in a "
                              f"forward, and the cut places a layer's weights on one stage; {HOW}")
    return LayerGraph(inputs, nodes, outputs)


def _nodes_back_to(outputs, inputs) -> list | None:
    """The nodes that make ``outputs`` from ``inputs``, every node after the nodes it
    reads (a depth-first walk from the outputs, in their order); None when a tensor
    on the way has no node (it was not made by a Keras layer or op)."""
    import tensorflow as tf

    known = {id(t) for t in tf.nest.flatten(inputs)}
    order, done = [], set()

    def visit(tensor) -> bool:
        if id(tensor) in known:
            return True
        history = getattr(tensor, "_keras_history", None)
        if history is None:
            return False
        node = history.operation._inbound_nodes[history.node_index]  # pylint: disable=protected-access
        if id(node) in done:
            return True
        if not all(visit(t) for t in node.input_tensors):
            return False
        done.add(id(node))
        order.append(node)
        return True

    return order if all(visit(t) for t in tf.nest.flatten(outputs)) else None


def _node_params(node) -> int:
    import math

    return int(sum(math.prod(w.shape) for w in getattr(node.operation, "weights", [])))


def carried(graph: LayerGraph, end: int) -> list:
    """The symbolic tensors that cross the cut before node ``end``: those made before
    it (or the model's inputs) that a later node reads or that are outputs, in a
    fixed order (the order they were made, outputs produced early among them)."""
    import tensorflow as tf

    made = list(tf.nest.flatten(graph.inputs))
    for node in graph.nodes[:end]:
        made += list(tf.nest.flatten(node.outputs))
    needed = {id(t) for node in graph.nodes[end:] for t in node.input_tensors}
    needed |= {id(t) for t in tf.nest.flatten(graph.outputs)}
    out, seen = [], set()
    for t in made:
        if id(t) in needed and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def graph_stages(graph: LayerGraph, plan: PipelinePlan, name: str) -> tuple[list, str]:
    """The graph's nodes cut into ``plan.stages`` stages at node boundaries
    (balanced by parameter count, or ``--stages`` as node indices), each a Keras
    model over the model's own layers: stage 0 takes the model's inputs, every
    later stage the tensors carried across its cut (one tensor, or a list), and
    the last gives the model's outputs, in their structure."""
    import keras
    import tensorflow as tf

    counts = [_node_params(node) for node in graph.nodes]
    bounds = _cut_bounds(counts, plan, name, "layer call(s)")
    stages, parts = [], []
    spans = ranges(bounds, len(counts))
    for s, (a, b) in enumerate(spans):
        sources = carried(graph, a)
        if a == 0:  # the model's inputs, in their structure (the features')
            stage_in = graph.inputs
            values = {id(t): t for t in tf.nest.flatten(graph.inputs)}
        else:
            fresh = [keras.Input(shape=tuple(t.shape[1:]), dtype=t.dtype,
                                 name=f"stage{s}_in{i}") for i, t in enumerate(sources)]
            stage_in = fresh[0] if len(fresh) == 1 else fresh
            values = {id(t): f for t, f in zip(sources, fresh)}
        for node in graph.nodes[a:b]:
            args, kwargs = node.arguments.fill_in(values)
            made = node.operation(*args, **kwargs)
            values.update(zip([id(t) for t in tf.nest.flatten(node.outputs)],
                              tf.nest.flatten(made)))
        if s == len(spans) - 1:
            stage_out = tf.nest.map_structure(lambda t: values[id(t)], graph.outputs)
        else:
            after = [values[id(t)] for t in carried(graph, b)]
            stage_out = after[0] if len(after) == 1 else after
        stages.append(keras.Model(stage_in, stage_out, name=f"stage{s}"))
        width = "" if s == len(spans) - 1 else f", {len(carried(graph, b))} tensor(s) on"
        parts.append(f"stage {s}: layer calls {a}-{b - 1} ({sum(counts[a:b])} params{width})")
    return stages, "; ".join(parts)
