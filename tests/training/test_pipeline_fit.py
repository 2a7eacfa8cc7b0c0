"""The pipeline step makes Keras's own update for what ``fit`` takes: sample weights,
``global_clipnorm`` (the whole model's norm), ``gradient_accumulation_steps``,
``use_ema`` and a ``LossScaleOptimizer`` (training.pipeline.updates).

Each case trains the same model from the same weights two ways: cut into two
stages on two real ``tf.distribute.Server`` tasks, stepped by
``make_pipeline_step`` over M micro-batches, and whole in this process by
Keras's ``train_on_batch`` (the step ``fit`` runs). The weights must agree to
float rounding after every case's steps. Connecting to a cluster changes the
process's eager context, so the cases run in a child process of their own.
"""

import json
import subprocess
import sys

import pytest

from conftest import REPO

CHILD = r'''
import json, os, socket, sys, types
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf, keras
from tfdist.training.pipeline import pipeline_trainer as pt, stages as st
from tfdist.training.loop.step import TrainMetrics

S, M, BATCH = 2, 4, 32
def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
spec = tf.train.ClusterSpec({"chief": [f"127.0.0.1:{port()}"],
                             "worker": [f"127.0.0.1:{port()}" for _ in range(S)]})
servers = [tf.distribute.Server(spec, job_name="worker", task_index=i) for i in range(S)]
tf.config.experimental_connect_to_cluster(spec, job_name="chief", protocol="grpc",
                                          make_master_device_default=False)
rng = np.random.default_rng(0)
DATA = [(rng.normal(size=(BATCH, 12)).astype("float32"), rng.integers(0, 5, size=BATCH),
         rng.uniform(0.1, 3.0, size=BATCH).astype("float32")) for _ in range(8)]
# The loss-scaled cases' second batch has an infinite feature: its loss and every
# stage's gradients are not finite, so the step is skipped and the scale halved.
POISONED = [tuple(a.copy() for a in b) for b in DATA]
POISONED[1][0][5, 3] = np.inf

class Distiller(keras.Model):
    """The guide's knowledge distillation: its own compute_loss calls a (frozen) teacher
    on x and mixes its softened output with the student's, without a compiled loss."""
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher, self.student = teacher, student
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, y_pred)
        soft = keras.losses.KLDivergence()(keras.ops.softmax(teacher_pred / 10.0, axis=1),
                                           keras.ops.softmax(y_pred / 10.0, axis=1))
        return 0.1 * student_loss + 0.9 * soft * 100.0
    def call(self, x):
        return self.student(x)

class Graph(keras.Model):
    """A subclassed model whose call is Keras layers and ops on its input, not a chain
    (a skip connection): traced into a graph and cut at its layer calls."""
    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(16, activation="relu",
                                    kernel_regularizer=keras.regularizers.L2(1e-3))
        self.b = keras.layers.Dense(16, activation="relu")
        self.c = keras.layers.Dense(5)
    def call(self, x, training=False):
        h = self.a(x)
        return self.c(self.b(h) + h)

class OwnLosses(keras.Sequential):
    """A chain with regularizers whose own compute_loss adds them (super()) or not."""
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if ADDS_OWN:
            return super().compute_loss(x, y, y_pred, sample_weight, training=training) \
                + 0.01 * keras.ops.mean(keras.ops.square(y_pred))
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, y_pred)

OWN_LOSS = False  # set per case below: build() makes the distiller
MODEL = "chain"  # or "two_outputs", "subclassed", "own_losses" (set per case below)
ADDS_OWN = True
BOUNDARIES = None  # --stages of the case (the two-output graph's cut)

def two_outputs(optimizer):
    """A functional DAG: a skip connection, two named outputs, "aux" made early (in
    stage 0 under BOUNDARIES) and carried forward with two other tensors."""
    x = keras.Input((12,), name="x")
    a = keras.layers.Dense(16, activation="relu", name="a",
                           kernel_regularizer=keras.regularizers.L2(1e-3))(x)
    aux = keras.layers.Dense(1, name="aux")(a)
    b = keras.layers.Dense(16, activation="relu", name="b")(a)
    c = keras.layers.Dense(16, activation="relu", name="c")(keras.layers.Add(name="add")([a, b]))
    cls = keras.layers.Dense(5, name="cls")(keras.layers.Concatenate(name="cat")([c, b]))
    model = keras.Model(x, {"cls": cls, "aux": aux})
    model.compile(optimizer=optimizer(),
                  loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        "aux": "mse"}, loss_weights={"cls": 1.0, "aux": 0.5},
                  metrics={"cls": ["accuracy"], "aux": ["mae"]})
    return model

def build(optimizer, dtype=None, jit=False):
    keras.utils.set_random_seed(3)
    if MODEL == "two_outputs":
        return two_outputs(optimizer)
    if MODEL in ("subclassed", "own_losses"):
        if MODEL == "subclassed":
            model = Graph()
        else:
            model = OwnLosses([keras.Input((12,))] + [keras.layers.Dense(
                16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-2))
                for _ in range(3)] + [keras.layers.Dense(5)])
        model.compile(optimizer=optimizer(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model
    # The distiller's student has no regularizers: its compute_loss adds no model losses.
    model = keras.Sequential(
        [keras.Input((12,))]
        + [keras.layers.Dense(16, activation="relu", dtype=dtype,
                              kernel_regularizer=None if OWN_LOSS else keras.regularizers.L2(1e-3))
           for _ in range(3)]
        + [keras.layers.Dense(5, dtype="float32")])
    if OWN_LOSS:
        teacher = keras.Sequential([keras.Input((12,)), keras.layers.Dense(
            5, use_bias=False, kernel_initializer=keras.initializers.Constant(
                np.random.default_rng(1).normal(size=(12, 5))))], name="teacher")
        teacher.trainable = False
        model = Distiller(model, teacher)
        model.compile(optimizer=optimizer(), metrics=["accuracy"], jit_compile=jit)
        return model
    model.compile(optimizer=optimizer(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], weighted_metrics=["accuracy"], jit_compile=jit)
    return model

class Task:
    def __init__(self, optimizer, dtype, jit):
        self.optimizer, self.dtype, self.jit = optimizer, dtype, jit
    def build_model(self): return build(self.optimizer, self.dtype, self.jit)

def pipelined(optimizer, weighted, n, dtype, steps, jit, data):
    task = Task(optimizer, dtype, jit)
    model = task.build_model()
    first = tuple(tf.nest.map_structure(lambda a: a[:1], data[0][:2]))
    model(first[0]); model.compute_metrics(first[0], first[1], model(first[0]))
    plan = types.SimpleNamespace(
        pipeline=st.PipelinePlan(S, M, 1, BOUNDARIES, schedule="dataflow"), total_steps=steps,
        accumulation_steps=n, task=types.SimpleNamespace(name="t"),
        optimizer=types.SimpleNamespace(library=False))
    task.local_model = model  # what a distiller's compute_loss calls: the chief's model
    state = pt.build_pipeline_state(plan, task, None, example=first)
    step_plan = st.PipelinePlan(S, M * n, 1, schedule="dataflow")
    own_loss = pt.own_loss_of(model, first)
    state.own_losses_weight = getattr(own_loss, "own_losses_weight", None)
    step = pt.make_pipeline_step(state, model._compile_loss, TrainMetrics(model), step_plan, n,
                                 jit_compile=jit, own_loss=own_loss)
    global_step = tf.Variable(0, dtype=tf.int64)
    call = pt.make_call(step, global_step, steps, n)
    batches = [b if weighted else b[:2] for b in data[:steps * n]]
    it = iter(tf.data.Dataset.from_tensor_slices(
        tf.nest.map_structure(lambda *a: np.stack(a), *batches)))
    call(it)
    pt.PipelineTrainer.finish_training(types.SimpleNamespace(state=state))
    # The functions the traced call runs that XLA must compile.
    library = call.get_concrete_function(it).graph.as_graph_def().library.function
    state.xla = sorted({f.signature.name for f in library
                        if f.attr["_XlaMustCompile"].b})
    return state

def keras_fit(optimizer, weighted, n, dtype, steps, jit, data):
    model = build(optimizer, dtype, jit)
    for b in data[:steps * n]:
        model.train_on_batch(b[0], b[1], sample_weight=b[2] if weighted else None)
    if model.optimizer.use_ema if not hasattr(model.optimizer, "inner_optimizer") else \
            model.optimizer.inner_optimizer.use_ema:
        model.optimizer.finalize_variable_values(model.trainable_variables)
    return model

# (optimizer, sample weights?, gradient_accumulation_steps, layers' dtype policy, steps[,
# jit_compile])
CASES = {
    "sample_weight": (lambda: keras.optimizers.Adam(1e-2), True, 1, None, 3),
    "global_clipnorm": (lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.05),
                        False, 1, None, 3),
    "accumulation": (lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2),
                     False, 2, None, 3),
    "ema": (lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.5),
            False, 1, None, 3),
    # float32 layers: mixed_float16's rounding differs between a batch and its
    # micro-batches (the conformance tests compare that at fit's tolerance).
    "loss_scale": (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2)),
                   False, 1, None, 4),
    "loss_scale_clipped": (lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2, global_clipnorm=0.05)), True, 1, None, 4),
    # Each stage's forward and backward one XLA cluster on its task (Keras: the step's).
    "jit": (lambda: keras.optimizers.Adam(1e-2), True, 1, None, 3, True),
    # A model's own compute_loss (build() makes the distiller for this case),
    # on the last stage's output, its teacher held on the chief (stages.forward_chain).
    "own_compute_loss": (lambda: keras.optimizers.Adam(1e-2), False, 1, None, 3),
    # A functional model that is no chain: cut at its layer calls, several tensors
    # carried across the cut, two outputs from the last stage (stages.graph_stages).
    "two_outputs": (lambda: keras.optimizers.Adam(1e-2), True, 1, None, 3),
    # A subclassed model, its call traced into a graph of layer calls and cut there.
    "subclassed": (lambda: keras.optimizers.Adam(1e-2), False, 1, None, 3),
    # A model's own compute_loss over a model with regularizers: super().compute_loss
    # adds them (each stage adds its own), or the override leaves them out (none added).
    "own_losses_added": (lambda: keras.optimizers.Adam(1e-2), False, 1, None, 3),
    "own_losses_left_out": (lambda: keras.optimizers.Adam(1e-2), False, 1, None, 3),
}
# The two-output model's labels: a dict, as its outputs.
GRAPH_DATA = [(x, {"cls": y, "aux": x[:, :1]}, w) for x, y, w in DATA]
out = {}
for name in sys.argv[1:]:
    OWN_LOSS = name == "own_compute_loss"
    MODEL = {"two_outputs": "two_outputs", "subclassed": "subclassed",
             "own_losses_added": "own_losses", "own_losses_left_out": "own_losses"}.get(name,
                                                                                      "chain")
    ADDS_OWN = name == "own_losses_added"
    # The two-output graph cut after its fourth call ("aux" is made in stage 0).
    BOUNDARIES = (4,) if name == "two_outputs" else None
    args = (CASES[name] + (False,))[:6] + (
        POISONED if name.startswith("loss_scale") else GRAPH_DATA if MODEL == "two_outputs"
        else DATA,)
    state = pipelined(*args)
    ref = keras_fit(*args)
    got = state.model.get_weights()
    fresh = build(args[0], args[3])
    fresh(DATA[0][0][:1])  # a subclassed model's variables exist after its first call
    initial = [w.numpy() for w in fresh.trainable_weights]
    scales = [float(o.dynamic_scale.numpy()) for o in state.optimizers[0]
              if hasattr(o, "dynamic_scale")]
    out[name] = {
        "diff": max(float(np.abs(a - b).max()) for a, b in zip(got, ref.get_weights())),
        "moved": min(float(np.abs(a.numpy() - b).max())
                     for a, b in zip(ref.trainable_weights, initial)),
        "weights": len(got),
        "scales": scales,
        "keras_scale": float(ref.optimizer.dynamic_scale.numpy())
            if hasattr(ref.optimizer, "dynamic_scale") else None,
        "iterations": [int(o.iterations.numpy()) for o in state.optimizers[0]],
        "keras_iterations": int(ref.optimizer.iterations.numpy()),
        "steps": args[4],
        "xla": state.xla,
        "cut": state.cut,
        "own_losses_weight": state.own_losses_weight,
        "keras_loss_parts": len(ref.losses),
    }
print("RESULT " + json.dumps(out))
'''

# In the default tier (one child process, about a minute): the cases whose update
# crosses the stages; the others in the long tier.
FAST = ("global_clipnorm", "loss_scale", "jit", "own_compute_loss", "two_outputs")
SLOW = ("sample_weight", "accumulation", "ema", "loss_scale_clipped")
# A model cut as a graph, and a model's own compute_loss over its own losses (long tier).
GRAPHS = ("subclassed", "own_losses_added", "own_losses_left_out")


def _run(cases) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, *cases], cwd=REPO, capture_output=True,
                          text=True, timeout=400)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[0][len("RESULT "):])


@pytest.fixture(scope="module")
def stepped():
    return _run(FAST)


def _same_update(got):
    assert got["diff"] < 1e-5, got
    assert got["moved"] > 1e-3, got  # it trained: every weight moved
    # One update per step on every stage (Keras's own count under accumulation).
    assert got["iterations"] == [got["keras_iterations"]] * 2, got


@pytest.mark.parametrize("case", FAST)
def test_the_pipeline_makes_kerass_update(stepped, case):
    _same_update(stepped[case])


@pytest.mark.long
def test_accumulation_ema_and_a_clipped_loss_scale_make_kerass_update():
    stepped = _run(SLOW)
    for case in SLOW:
        _same_update(stepped[case])
    # Keras's iterations count updates: 3 steps of 2 batches each.
    assert stepped["accumulation"]["iterations"] == [3, 3]
    assert stepped["loss_scale_clipped"]["scales"] == [stepped["loss_scale_clipped"][
        "keras_scale"]] * 2


def test_under_jit_compile_each_stages_forward_and_backward_is_compiled_by_xla(stepped):
    """One forward (as the tape records it) and one backward per stage, each a
    function XLA must compile; without jit_compile, none."""
    compiled = stepped["jit"]["xla"]
    assert len([f for f in compiled if f.startswith("__forward_call")]) == 2, compiled
    assert len([f for f in compiled if "backward" in f]) == 2, compiled
    assert stepped["global_clipnorm"]["xla"] == []


def test_every_stage_keeps_kerass_loss_scale(stepped):
    """A step whose gradients are not finite is skipped on every stage at once:
    each stage's scale is the one Keras's own LossScaleOptimizer ends with, the
    default 2**15 halved once."""
    got = stepped["loss_scale"]
    assert got["scales"] == [got["keras_scale"]] * 2 == [2.0 ** 14] * 2, got
    assert got["iterations"] == [got["steps"] - 1] * 2, got  # the poisoned step skipped


def _stage_grads():
    import numpy as np

    rng = np.random.default_rng(4)
    return [[rng.normal(size=(3, 4)).astype("float32"), rng.normal(size=(4,)).astype("float32")],
            [rng.normal(size=(4, 2)).astype("float32")]]


def test_the_global_norm_is_the_whole_models_across_stages():
    """Two stages' gradients scaled by Keras's clip_by_global_norm factor over all of them."""
    import numpy as np
    import tensorflow as tf
    from keras.src.optimizers.base_optimizer import clip_by_global_norm

    from tfdist.training.pipeline import updates

    grads = _stage_grads()
    devices = [[("a", "/device:CPU:0"), ("b", "/device:CPU:0")]]
    optimizers = [[object(), object()]]
    means = [[[tf.constant(g) for g in stage]] for stage in grads]  # [stage][copy]
    got = updates.agree_and_clip(means, optimizers, devices, clipnorm=0.5)
    want = clip_by_global_norm([tf.constant(g) for stage in grads for g in stage], 0.5)
    flat = [g.numpy() for stage in got for g in stage[0]]
    for a, b in zip(flat, want):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-6)
    assert np.sqrt(sum((g ** 2).sum() for g in flat)) == pytest.approx(0.5, rel=1e-5)
    # Under the norm: untouched.
    same = updates.agree_and_clip(means, optimizers, devices, clipnorm=1e3)
    for a, b in zip([g.numpy() for stage in same for g in stage[0]],
                    [g for stage in grads for g in stage]):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_one_stages_non_finite_gradient_makes_every_stage_skip():
    """Under loss scaling, a stage whose gradients are finite still gets NaN when
    another stage's are not: every stage's LossScaleOptimizer then skips the step."""
    import numpy as np
    import keras
    import tensorflow as tf

    from tfdist.training.pipeline import updates

    grads = _stage_grads()
    grads[1][0][1, 1] = np.inf
    devices = [[("a", "/device:CPU:0"), ("b", "/device:CPU:0")]]
    optimizers = [[]]
    for stage in grads:
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
        opt.build([keras.Variable(np.zeros_like(g)) for g in stage])
        optimizers[0].append(opt)
    means = [[[tf.constant(g) for g in stage]] for stage in grads]
    got = updates.agree_and_clip(means, optimizers, devices, clipnorm=None)
    assert all(np.isnan(g.numpy()).all() for stage in got for g in stage[0])
    grads[1][0][1, 1] = 0.0
    means = [[[tf.constant(g) for g in stage]] for stage in grads]
    got = updates.agree_and_clip(means, optimizers, devices, clipnorm=None)
    for a, b in zip([g.numpy() for stage in got for g in stage[0]],
                    [g for stage in grads for g in stage]):
        np.testing.assert_array_equal(a, b)


def test_a_models_own_compute_loss_makes_kerass_update(stepped):
    """The guide's distiller: its call runs the student, which is cut into the stages
    (``stages.forward_chain``); its own ``compute_loss`` runs on the last stage's output
    with the teacher the chief holds, and the backward starts from its gradient. The
    student's weights are Keras's own after three steps; the teacher's stay the
    chief's, in the model's order."""
    got = stepped["own_compute_loss"]
    _same_update(got)
    assert got["weights"] == 1 + 8  # the teacher's kernel, then the student's four layers


def test_a_functional_graph_with_two_outputs_makes_kerass_update(stepped):
    """Not a chain: cut at its layer calls (``stages.graph_stages``), three tensors
    carried across the cut (an output made in stage 0 among them), the two outputs'
    losses, loss weights and sample weights on the last stage; the weights of
    Keras's ``train_on_batch`` after three steps, in the model's order."""
    got = stepped["two_outputs"]
    _same_update(got)
    assert "3 tensor(s) on" in got["cut"], got["cut"]
    assert got["weights"] == 10


@pytest.mark.long
def test_a_subclassed_model_and_a_compute_loss_over_the_models_own_losses_make_kerass_update():
    """A subclassed model traced into its layer calls and cut; a model's own
    ``compute_loss`` whose model has regularizers: calling ``super().compute_loss``
    (each stage adds its own, weight 1) or leaving them out (weight 0), as Keras
    counts them."""
    stepped = _run(GRAPHS)
    for case in GRAPHS:
        _same_update(stepped[case])
    assert stepped["subclassed"]["cut"].startswith("stage 0: layer calls")
    assert stepped["own_losses_added"]["own_losses_weight"] == 1.0
    assert stepped["own_losses_left_out"]["own_losses_weight"] == 0.0
    # Keras's model has its own losses to count (the 4 layers' regularizers).
    assert stepped["own_losses_added"]["keras_loss_parts"] > 0
