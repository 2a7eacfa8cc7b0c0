"""A model the pipeline's cut cannot carry trains placed (``training.pipeline.placed``):
its variables created on the workers in runs balanced by parameter count, each leaf
layer's call and each variable's update under its worker's device, trained by the
``none`` loop; the same update as ``fit``."""

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO, launch_cmd, read_results
from tests.training import fit_tasks, placed_tasks

FIT_SPEC = str(REPO / "tests" / "training" / "fit_tasks.py") + ":"
SPEC = str(REPO / "tests" / "training" / "placed_tasks.py") + ":"
EPOCHS, BATCH, TOLERANCE = 2, 64, 0.04  # docs/fit-conformance.md's, for pipeline


# --- pure: the placement -------------------------------------------------------------


def test_layers_go_to_the_workers_in_runs_balanced_by_parameters():
    from tfdist.training.pipeline import placed

    assert placed.placement([100, 10, 100, 10], 2) == [0, 0, 1, 1]
    # The largest run is as small as it can be: 300 | 20 + 200 + 100.
    assert placed.placement([300, 20, 200, 100], 2) == [0, 1, 1, 1]
    assert placed.placement([5], 2) == [0]  # fewer layers than workers: one each
    assert placed.placement([], 3) == []


def test_a_layers_variables_stay_together_and_the_others_follow_the_weights_before_them():
    from tfdist.training.pipeline import placed

    worker = placed.stage_device
    # (trainable, size, owner layer): an optimizer counter before any weight stays on
    # the chief; layer 1's kernel and bias go together (110 | 100, not 100 | 10 + 100);
    # its normalization's statistics (not trainable) follow its weights.
    created = [(False, 1, -1), (True, 100, 1), (True, 10, 1), (False, 10, 1), (True, 100, 2),
               (False, 1, -1)]
    assert placed.creation_devices(created, 2) == [
        None, worker(0), worker(0), worker(0), worker(1), worker(1)]


@pytest.mark.parametrize("name,says", [
    ("EAGER_CALL", "is not a chain of layers, and its call could not be traced on symbolic "
                   "inputs"),
    ("SHARED_LAYER", "is called more than once in a forward"),
    ("CALLS_ITSELF", "its model's compute_loss calls the model itself"),
    ("SQUARED_OWN_LOSSES", "its model overrides compute_loss and its loss does not change in "
                           "proportion to the model's own losses"),
])
def test_what_the_cut_cannot_carry_is_said_in_the_notices_words(name, says):
    import types

    from tfdist.strategies import kinds
    from tfdist.training.pipeline import placed
    from tfdist.training.workload import contract, tasks

    spec = tasks.parse_spec(SPEC + name)
    checked = tasks.inspect(spec, tasks.load(spec), steps_given=False)
    config = types.SimpleNamespace(cluster=types.SimpleNamespace(num_members=lambda role: 2),
                                   pipelines=1, stages=None)
    for kind in kinds.all_kinds().values():
        contract.check(kind, checked)  # no strategy refuses it
    why = placed.why_placed(kinds.get("pipeline"), checked, config)
    assert why.startswith("its ") and says in why, why
    assert "which the cut into stages cannot carry" in why, why
    assert "\n" not in why and "provide stages" not in why


def test_a_placed_plan_refuses_what_only_a_cut_means_and_leaves_the_rest_aside():
    from tfdist.protocol import ConfigError
    from tfdist.training.pipeline import stages

    why = "its model overrides train_step, which the cut into stages cannot carry"
    plan = stages.make_plan(2, 4, 1, None, 64, "gpipe", placed=why)
    assert plan.describe() == {"mode": "placed", "workers": 2, "placed_because": why,
                               "micro_batches": 1, "pipelines": 1}
    assert plan.unused == "--micro-batches 4, --schedule gpipe"
    for args, says in (((4, 1, 2, None), "--pipelines 2: the task's model trains placed"),
                       ((2, 1, 1, "1"), "--stages 1: the task's model trains placed")):
        with pytest.raises(ConfigError, match=says) as err:
            stages.make_plan(*args, 64, None, placed=why)
        assert "\n" not in str(err.value)


# --- on a cluster of two in-process servers (a child process: connecting changes
# --- the process's eager context) -------------------------------------------------

CHILD = r'''
import json, os, socket, types
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf, keras
from tfdist.training.pipeline import placed

def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
spec = tf.train.ClusterSpec({"chief": [f"127.0.0.1:{port()}"],
                             "worker": [f"127.0.0.1:{port()}" for _ in range(2)]})
servers = [tf.distribute.Server(spec, job_name="worker", task_index=i) for i in range(2)]
tf.config.experimental_connect_to_cluster(spec, job_name="chief", protocol="grpc",
                                          make_master_device_default=False)

class Task:
    def build_model(self):
        model = keras.Sequential([
            keras.Input((12,)), keras.layers.Dense(64), keras.layers.BatchNormalization(),
            keras.layers.ReLU(), keras.layers.Dropout(0.5), keras.layers.Dense(64),
            keras.layers.ReLU(), keras.layers.Dense(5)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

plan = types.SimpleNamespace(
    config=types.SimpleNamespace(seed=3, gradient_accumulation_steps=None),
    pipeline=types.SimpleNamespace(stages=2),
    sharding=types.SimpleNamespace(partitioner="none", num_shards=1, min_bytes=1),
    optimizer=types.SimpleNamespace(library=False), accumulation_steps=1,
    kind=types.SimpleNamespace(min_ps=0))
keras.utils.set_random_seed(3)
state = placed.build_placed_state(plan, Task(), tf.distribute.get_strategy())
model, opt = state.model, state.optimizer
keras.utils.set_random_seed(3)
plain = Task().build_model()  # as none builds it
plain.optimizer.build(plain.trainable_variables)
out = {"same_init": all(np.array_equal(a, b) for a, b in
                        zip(model.get_weights(), plain.get_weights()))}
worker = lambda w: placed.worker_name(placed.device_of(w))
# Per layer (Dense, BN, ReLU, Dropout, Dense, ReLU, Dense): its weights' workers, its call's.
out["weights"] = [sorted({worker(w) for w in layer.weights}) for layer in model.layers]
by_var = {id(v.value): worker(v) for v in model.trainable_variables}
out["slots_with_their_variable"] = all(
    worker(s) == by_var[id(v.value)] for v in model.trainable_variables
    for s in (opt._momentums[opt._get_variable_index(v)], opt._velocities[opt._get_variable_index(v)]))
out["calls"] = [state.placement.get(layer.name) for layer in model.layers]
x = np.random.default_rng(0).normal(size=(32, 12)).astype("float32")
y = np.random.default_rng(1).integers(0, 5, size=32)
# The same steps as the whole model in one process (Keras's own train_on_batch).
for model_, n in ((model, 0), (plain, 1)):
    keras.utils.set_random_seed(5)
    for _ in range(3):
        model_.train_on_batch(x, y)
out["same_after_steps"] = max(float(np.max(np.abs(a - b))) for a, b in
                              zip(model.get_weights(), plain.get_weights()))
# The wrapper keeps Keras's training argument: Dropout drops only when training.
out["training_kept"] = bool(np.allclose(model(x, training=False), model(x, training=False)) and
                            not np.allclose(model(x, training=True), model(x, training=False)))

@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x, y, model(x, training=True))
    opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return loss
graph = step.get_concrete_function(x, y).graph
devices = {}
for op in graph.get_operations():
    if op.type in ("MatMul", "Relu", "FusedBatchNormV3") and "gradient_tape" not in op.name:
        devices.setdefault(op.type, set()).add(placed.worker_name(op.device) if op.device else "")
    if op.type == "AssignSubVariableOp":  # an update of a weight (Adam's last write)
        devices.setdefault("update", set()).add(placed.worker_name(op.device) if op.device else "")
out["op_workers"] = {k: sorted(v) for k, v in devices.items()}
print("RESULT " + json.dumps(out))
'''


def test_a_placed_model_lives_and_computes_on_the_workers_and_steps_as_one_process():
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True,
                       timeout=240)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout + p.stderr
    out = json.loads(lines[0][len("RESULT "):])
    assert out["same_init"]  # the kept build is the one none makes, from the same seed
    # Balanced in creation order: the first Dense (and its normalization) on worker 0,
    # the two later Dense layers on worker 1; weightless layers hold nothing.
    assert out["weights"] == [["worker:0"], ["worker:0"], [], [], ["worker:1"], [],
                              ["worker:1"]], out["weights"]
    assert out["slots_with_their_variable"]
    # Weightless layers compute where the weighted layer before them does.
    assert out["calls"] == ["worker:0"] * 4 + ["worker:1"] * 3, out["calls"]
    assert out["training_kept"]
    # The forward's ops run on the workers, each weight's update on its worker.
    assert out["op_workers"]["MatMul"] == ["worker:0", "worker:1"], out["op_workers"]
    assert out["op_workers"]["Relu"] == ["worker:0", "worker:1"], out["op_workers"]
    assert out["op_workers"]["update"] == ["worker:0", "worker:1"], out["op_workers"]
    assert out["same_after_steps"] <= 1e-5, out["same_after_steps"]


# --- launched ------------------------------------------------------------------------


def _launch(tmp_path, spawn, task: str):
    p = spawn(launch_cmd("pipeline", "--workers", "2", train_args=[
        "--task", task, "--epochs", str(EPOCHS), "--global-batch-size", str(BATCH),
        "--log-every", "60", "--model-dir", str(tmp_path), "--micro-batches", "2"]))
    assert p.wait(timeout=300) == 0, p.output
    return p.output, read_results(tmp_path)


def _compare(task, results):
    want = fit_tasks.plain_fit(task, epochs=EPOCHS, batch_size=BATCH)["accuracy"]
    got = results["test_metrics"]["accuracy"]
    assert abs(got - want) <= TOLERANCE, (got, want)


@pytest.mark.multiprocess
def test_a_models_own_train_step_trains_placed_under_pipeline_as_fit(tmp_path, spawn):
    """The default tier's launch: the flipped-label train_step (0.34 if honoured, 0.97 if
    the library's own step ran) on two workers, one notice line, the placement in
    results.json."""
    output, results = _launch(tmp_path, spawn, FIT_SPEC + "FLIPPED_TRAIN_STEP")
    _compare(fit_tasks.FLIPPED_TRAIN_STEP, results)
    notices = [l for l in output.splitlines() if "training it placed" in l]
    assert len(notices) == 1, output
    assert re.search(r"pipeline: task '.*FLIPPED_TRAIN_STEP': its model overrides train_step, "
                     r"which the cut into stages cannot carry; training it placed: .* on the 2 "
                     r"workers .* one batch at a time \(no micro-batches\); --micro-batches 2 "
                     r"has no effect$", notices[0]), notices[0]
    pp = results["pipeline"]
    assert pp["mode"] == "placed" and set(pp["placement"].values()) == {"worker:0", "worker:1"}
    assert sum(pp["parameters_per_worker"].values()) == 8 * 32 + 32 + 32 * 3 + 3


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["EAGER_CALL", "SHARED_LAYER", "CALLS_ITSELF",
                                  "SQUARED_OWN_LOSSES"])
def test_what_the_cut_cannot_carry_trains_placed_as_fit(tmp_path, spawn, name):
    output, results = _launch(tmp_path, spawn, SPEC + name)
    assert results["pipeline"]["mode"] == "placed", results["pipeline"]
    assert "training it placed" in output
    _compare(getattr(placed_tasks, name), results)
