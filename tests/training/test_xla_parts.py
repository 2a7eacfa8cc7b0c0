"""``jit_compile=True`` where the step cannot be compiled whole: XLA compiles the
replica's forward and backward pass, the collectives and the ps reads and
writes stay outside it (``loop.step.xla_gradients``, ``ps.read_ahead.
xla_batch_on_weights``; which part a strategy compiles is its kind's
``jit_compiles``).

Each case trains one model from the same weights three ways for a few steps:
with the strategy's XLA part, without XLA, and by Keras's own
``train_on_batch`` (the step ``fit`` runs) in one process without a strategy;
the weights must agree to float rounding. The functions the traced call marks
``_XlaMustCompile`` are read from its graph, as the pipeline's test reads them:
they must hold the forward and backward pass and nothing that reads or writes a
variable (``values``) or updates one (``gradients``).

- ``gradients`` (multiworker's part): a ``MirroredStrategy`` over two logical
  CPUs, so the update all-reduces two replicas' gradients.
- ``values`` (ps, ps-sync): the model's variables on a ``tf.distribute.Server``
  ps task; XLA cannot read them there, so the step reads their values first. A
  batch-normalization layer's statistics, assigned by the forward pass, come
  back from XLA as values and are assigned on the ps after it. The whole step
  compiled with XLA (``none``'s part) is tried too: it must fail, as measured.

Connecting to a cluster or splitting the CPU changes the process's eager
context, so each case runs in a child process of its own.
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
from tfdist.training.loop import step as steplib
from tfdist.training.ps import read_ahead

MODE, BATCH, STEPS = sys.argv[1], 32, 3
# "own-gradients", "own-values": the same part for a model with its own train_step.
OWN, MODE = MODE.startswith("own-"), MODE.removeprefix("own-")

class Own(keras.Sequential):
    """The guide's first train_step (its apply routed, its calls compiled on values)."""

    def train_step(self, data):
        x, y = data[:2]  # train_on_batch hands (x, y, None)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        return {"loss": loss}
rng = np.random.default_rng(0)
X = rng.normal(size=(BATCH * STEPS, 12)).astype("float32")
Y = rng.integers(0, 5, size=BATCH * STEPS)
device = None
if MODE == "gradients":
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
else:
    def port():
        s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
    spec = tf.train.ClusterSpec({"chief": [f"127.0.0.1:{port()}"], "ps": [f"127.0.0.1:{port()}"]})
    server = tf.distribute.Server(spec, job_name="ps", task_index=0)
    tf.config.experimental_connect_to_cluster(spec, job_name="chief", protocol="grpc",
                                              make_master_device_default=False)
    strategy, device = tf.distribute.get_strategy(), "/job:ps/replica:0/task:0/device:CPU:0"

def build(jit):
    keras.utils.set_random_seed(3)
    layers = [keras.Input((12,)), keras.layers.Dense(16, activation="relu")]
    if MODE == "values":
        layers.append(keras.layers.BatchNormalization())
    model = (Own if OWN else keras.Sequential)(layers + [keras.layers.Dense(5)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit)
    model.compute_metrics(X[:1], Y[:1], model(X[:1]))
    model.optimizer.build(model.trainable_variables)
    return model

def trained(part):
    scope = strategy.scope() if MODE == "gradients" else tf.device(device)
    with scope:
        model = build(part is not None)
        state = types.SimpleNamespace(model=model, optimizer=model.optimizer,
                                      global_step=tf.Variable(0, dtype=tf.int64))
    metrics = steplib.TrainMetrics(model, ("loss",) if OWN else None)
    if MODE == "gradients" or OWN:
        step_fn = steplib.make_step_fn(state, metrics, jit=part)
    elif part == "values":
        step_fn = read_ahead.make_read_once_step_fn(state, metrics, accumulation=1, jit=True)
    else:
        step_fn = steplib.make_step_fn(state, metrics, jit=part)
    train_fn = steplib.make_train_fn(strategy, step_fn, state, len(metrics.names))
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    it = iter(strategy.experimental_distribute_dataset(ds) if MODE == "gradients" else ds)
    train_fn(it, tf.constant(STEPS))
    library = train_fn.get_concrete_function(it, tf.constant(STEPS)).graph.as_graph_def().library
    xla = {f.signature.name: sorted({n.op for n in f.node_def})
           for f in library.function if f.attr["_XlaMustCompile"].b}
    return model, xla

out = {}
ref = build(False)
for i in range(STEPS):
    ref.train_on_batch(X[i * BATCH:(i + 1) * BATCH], Y[i * BATCH:(i + 1) * BATCH])
plain, _ = trained(None)
part, xla = trained(MODE)
initial = build(False).get_weights()
out["xla"] = xla
out["devices"] = sorted({v.value.device for v in part.variables})
out["diff_keras"] = max(float(np.abs(a - b).max()) for a, b in zip(part.get_weights(), ref.get_weights()))
out["diff_plain"] = max(float(np.abs(a - b).max()) for a, b in zip(part.get_weights(), plain.get_weights()))
out["moved"] = min(float(np.abs(a - b).max()) for a, b in zip(ref.get_weights(), initial))
out["iterations"] = int(part.optimizer.iterations.numpy())
if MODE == "values" and not OWN:
    try:  # the whole step compiled: XLA reading the variables on the ps
        trained("step")
        out["whole_step"] = "ran"
    except Exception as err:  # pylint: disable=broad-except
        said = [l for l in str(err).splitlines() if "/job:ps" in l] or [str(err)[:300]]
        out["whole_step"] = f"{type(err).__name__}: {said[0].strip()[:300]}"
print("RESULT " + json.dumps(out))
'''


def _run(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=REPO, capture_output=True,
                          text=True, timeout=400)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[0][len("RESULT "):])


# Ops that write a variable, or move values between replicas or tasks.
UPDATES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
READS = ("ReadVariableOp", "VarHandleOp", "ResourceGather")


def _compiled_forward_and_backward(xla: dict) -> set:
    ops = set().union(*xla.values()) if xla else set()
    assert xla and {"MatMul", "BiasAddGrad", "ReluGrad"} <= ops, xla
    assert not [o for o in ops if o in UPDATES or "Collective" in o or "Nccl" in o
                or o.startswith(("Send", "Recv"))], xla
    return ops


def _keras_update(got: dict) -> None:
    assert got["moved"] > 1e-3, got  # it trained: every weight moved
    assert got["diff_keras"] < 1e-5 and got["diff_plain"] < 1e-5, got
    assert got["iterations"] == 3, got


@pytest.mark.long
def test_multiworkers_part_compiles_the_gradients_and_leaves_the_all_reduce_and_update_out():
    got = _run("gradients")
    _compiled_forward_and_backward(got["xla"])
    _keras_update(got)


def test_the_ps_part_compiles_the_gradients_on_values_read_outside_xla():
    got = _run("values")
    assert got["devices"] == ["/job:ps/replica:0/task:0/device:CPU:0"], got["devices"]
    ops = _compiled_forward_and_backward(got["xla"])
    assert not [o for o in ops if o in READS], got["xla"]  # every value handed in
    # The batch-norm statistics it updated reached the ps: the weights compared above
    # include the moving mean and variance.
    _keras_update(got)
    # What the refusal measured: XLA cannot compile reads of variables on the ps.
    assert got["whole_step"] != "ran" and "/job:ps" in got["whole_step"], got["whole_step"]


@pytest.mark.parametrize("part", [pytest.param("gradients", marks=pytest.mark.long), "values"])
def test_a_models_own_train_step_has_each_call_of_its_model_compiled_on_values(part):
    """Under multiworker, ps and ps-sync (``workload.xla_calls``): the train_step stays
    outside XLA, each call of its model is one XLA function of the weights' values (its
    backward too), its routed apply all-reduces (two replicas) or updates the ps outside."""
    got = _run("own-" + part)
    ops = _compiled_forward_and_backward(got["xla"])
    assert not [o for o in ops if o in READS], got["xla"]  # every value handed in
    _keras_update(got)
    if part == "values":
        assert got["devices"] == ["/job:ps/replica:0/task:0/device:CPU:0"], got["devices"]


def test_a_model_left_at_auto_is_not_compiled_with_xla_as_fit_leaves_it_under_a_strategy(
        monkeypatch):
    """Keras resolves ``jit_compile="auto"`` to True on a GPU host for a model compiled
    outside any strategy's scope, and to False inside one; the library's checked model
    (built outside a scope) reads it as under a strategy. A GPU is faked in the listing
    Keras reads (``tf.config.list_physical_devices``)."""
    import tensorflow as tf

    from tests.training import fit_tasks
    from tfdist.training.workload import tasks

    real = tf.config.list_physical_devices
    gpu = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda device_type=None: real(
        device_type) + ([gpu] if device_type in (None, "GPU") else []))
    assert fit_tasks.BLOBS.build_model().jit_compile is True  # Keras sees the GPU
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        assert fit_tasks.BLOBS.build_model().jit_compile is False  # as fit under a strategy

    def checked(name):
        spec = tasks.parse_spec(str(REPO / "tests" / "training" / "fit_tasks.py") + ":" + name)
        return tasks.inspect(spec, tasks.load(spec), steps_given=False).local_model

    assert checked("BLOBS").jit_compile is False
    assert checked("JIT").jit_compile is True  # an explicit True stays True
    assert fit_tasks.BLOBS.build_model().jit_compile is True  # Keras's own resolution is back


def test_a_models_own_train_step_is_compiled_whole_where_the_step_is(tmp_path):
    """Under none and mirrored (``jit_compiles`` "step") a model's own ``train_step`` with
    ``jit_compile=True`` is one XLA function, its update inside, as ``fit`` compiles it."""
    import types

    import tensorflow as tf

    from tests.training import fit_tasks
    from tfdist.strategies import kinds
    from tfdist.training.loop import step as steplib
    from tfdist.training.workload import tasks

    spec = tasks.parse_spec(str(REPO / "tests" / "training" / "fit_tasks.py") + ":OWN_STEP_JIT")
    checked = tasks.inspect(spec, tasks.load(spec), steps_given=False)
    model = checked.local_model
    model.optimizer.build(model.trainable_variables)
    state = types.SimpleNamespace(model=model, optimizer=model.optimizer,
                                  global_step=tf.Variable(0, dtype=tf.int64))
    metrics = steplib.TrainMetrics(model, checked.own_step_names)
    part = steplib.xla_part(model, kinds.get("none"))
    assert part == "step" and steplib.xla_part(fit_tasks.BLOBS.build_model(),
                                               kinds.get("none")) is None
    train_fn = steplib.make_train_fn(tf.distribute.get_strategy(),
                                     steplib.make_step_fn(state, metrics, jit=part), state,
                                     len(metrics.names))
    it = iter(fit_tasks.OWN_STEP_JIT.dataset("train").batch(64))
    before = [v.numpy().copy() for v in model.trainable_variables]
    train_fn(it, tf.constant(2))
    assert all((b != v.numpy()).any() for b, v in zip(before, model.trainable_variables))
    library = train_fn.get_concrete_function(it, tf.constant(2)).graph.as_graph_def().library
    ops = set().union(*[{n.op for n in f.node_def} for f in library.function
                        if f.attr["_XlaMustCompile"].b])
    # The forward, the backward and the optimizer's update, all in XLA.
    assert {"MatMul", "BiasAddGrad", "AssignVariableOp"} <= ops, sorted(ops)
