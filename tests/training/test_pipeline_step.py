"""The pipeline step (training.pipeline.pipeline_trainer.make_pipeline_step) over
real ``tf.distribute.Server`` tasks: GPipe and 1F1B make the same update, P
copies averaged among themselves make the update of one copy of all their
micro-batches, and what crosses between tasks in a step is the fewest messages
it needs.

Connecting to a cluster changes the process's eager context, so the step
runs in a child process of its own.
"""

import json
import subprocess
import sys

import pytest

from conftest import REPO

CHILD = r'''
import json, os, socket, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf, keras
from tfdist.training.pipeline import pipeline_trainer as pt, stages as st

S, M, STEPS = 2, 4, 3
def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
spec = tf.train.ClusterSpec({"chief": [f"127.0.0.1:{port()}"],
                             "worker": [f"127.0.0.1:{port()}" for _ in range(2 * S)]})
servers = [tf.distribute.Server(spec, job_name="worker", task_index=i) for i in range(2 * S)]
tf.config.experimental_connect_to_cluster(spec, job_name="chief", protocol="grpc",
                                          make_master_device_default=False)
keras.utils.set_random_seed(3)
model = keras.Sequential([keras.Input((12,))] + [keras.layers.Dense(16, activation="relu")
                                                 for _ in range(3)] + [keras.layers.Dense(5)])
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
initial = model.get_weights()
x = np.random.default_rng(0).normal(size=(32, 12)).astype("float32")
y = np.random.default_rng(1).integers(0, 5, size=32)
from tfdist.training.loop.step import TrainMetrics
model(x[:1]); model.compute_metrics(x[:1], y[:1], model(x[:1]))
metrics = TrainMetrics(model)

class Task: pass
out = {"initial": [w.tolist() for w in initial]}
# (name, schedule, stages, copies, micro-batches per copy): two copies of M
# micro-batches (or four of M / 2) see the same 2M micro-batches, in order, as one
# copy of 2M. One stage of 837 weights does not split evenly into four chunks.
CASES = [("gpipe", "gpipe", S, 1, M), ("1f1b", "1f1b", S, 1, M), ("dataflow", "dataflow", S, 1, M),
         ("one-copy-2m", "gpipe", S, 1, 2 * M), ("two-copies", "gpipe", S, 2, M),
         ("four-copies", "gpipe", 1, 4, M // 2), ("dataflow-one-call", "dataflow", S, 1, M),
         ("1f1b-one-call", "1f1b", S, 1, M)]
for name, schedule, stages, P, micro in CASES:
    plan = st.PipelinePlan(stages, micro, P, schedule=schedule)
    local, cut = st.local_stages(Task(), model, plan)
    copies, optimizers, devices = [], [], []
    for p in range(P):
        row, opts, devs = [], [], []
        for s in range(stages):
            device = pt.stage_device(p * stages + s)
            with tf.device(device):
                stage = keras.models.clone_model(local[s])
                opt = keras.optimizers.Adam(0.01)
                opt.build(stage.trainable_variables)
            row.append(stage); opts.append(opt); devs.append((f"worker:{p * stages + s}", device))
        copies.append(row); optimizers.append(opts); devices.append(devs)
    state = pt.PipelineState(copies, optimizers, devices, cut)
    for v, w in zip(state.model.weights, initial):
        v.assign(w)
    state.sync_copies()
    step = pt.make_pipeline_step(state, model._compile_loss, metrics, plan)
    data = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    if name.endswith("one-call"):  # the trainer's way: STEPS steps in one traced call
        global_step = tf.Variable(0, dtype=tf.int64)
        fn = pt.make_call(step, global_step, STEPS)
        called = fn(data)
        loss, values = called["loss"] / STEPS, called["metrics"] / STEPS
        stamps = list(called["stamps"][-1])
        out.setdefault("calls", {})[schedule] = {
            "stamps": called["stamps"].numpy().tolist(),
            "global_step": int(global_step.numpy()), "mean_loss": float(loss)}
    else:
        fn = tf.function(lambda it: step(*next(it))[:3])
        losses = []
        for _ in range(STEPS):
            loss, values, stamps = fn(data)
            losses.append(float(loss))
        out.setdefault("mean_loss", {})[name] = sum(losses) / STEPS
    out[name] = {
        "weights": [w.tolist() for w in state.model.get_weights()],
        "copies": [[w.numpy().tolist() for m in row for w in m.weights] for row in copies],
        "loss": float(loss), "metrics": values.numpy().tolist(),
        "stamps": [s.numpy().tolist() for s in stamps],
        "transfers": pt.count_transfers(fn.get_concrete_function(data)),
        "peak_rss": state.peak_rss_per_task(),
    }
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def stepped():
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True,
                          text=True, timeout=240)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[0][len("RESULT "):])


def test_1f1b_makes_the_same_update_as_gpipe(stepped):
    import numpy as np

    gpipe, ofob = stepped["gpipe"], stepped["1f1b"]
    for a, b in zip(gpipe["weights"], ofob["weights"]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    assert abs(gpipe["loss"] - ofob["loss"]) < 1e-5
    # It trained: three steps moved the weights away from where both started.
    moved = [np.abs(np.array(a) - np.array(w)).max()
             for a, w in zip(gpipe["weights"], stepped["initial"])]
    assert min(moved) > 1e-3, moved


def test_dataflow_makes_gpipes_update_to_the_bit(stepped):
    """Traced in GPipe's order, it sums the same gradients in the same order; only
    when each slot may run differs."""
    gpipe, flow = stepped["gpipe"], stepped["dataflow"]
    assert flow["weights"] == gpipe["weights"]
    assert flow["loss"] == gpipe["loss"]


@pytest.mark.parametrize("schedule", ["dataflow", "1f1b"])
def test_steps_in_one_call_make_the_updates_of_one_call_per_step(stepped, schedule):
    """The trainer runs a call's steps as one traced function, where a stage may
    start its next step while a later stage still updates: the same updates."""
    one, per_step = stepped[f"{schedule}-one-call"], stepped[schedule]
    assert one["weights"] == per_step["weights"]
    call = stepped["calls"][schedule]
    assert abs(call["mean_loss"] - stepped["mean_loss"][schedule]) < 1e-6
    assert call["global_step"] == 3


@pytest.mark.parametrize("schedule", ["dataflow", "1f1b"])
def test_in_one_call_a_stage_starts_its_next_step_after_its_own_update(stepped, schedule):
    """Its variables order it: the next step's first slot on a stage starts after
    that stage's update ends, but need not wait for the other stages'."""
    steps = stepped["calls"][schedule]["stamps"]  # [step, stage, slot (update last), start/end]
    assert len(steps) == 3
    for before, after in zip(steps, steps[1:]):
        for s, (done, nxt) in enumerate(zip(before, after)):
            update_end = done[-1][1]
            assert min(a for a, _ in nxt) >= update_end, (s, nxt, update_end)


def test_a_call_of_several_steps_sends_each_steps_messages_once_per_step(stepped):
    S, M, STEPS = 2, 4, 3
    t = stepped["dataflow-one-call"]["transfers"]
    assert t["between_stages"] == STEPS * 2 * (S - 1) * M, t
    assert t["from_client"] == STEPS * 2 and t["control"] == 0, t
    # Each step's loss and metric means and its slot times per stage, as one step does.
    assert t["to_client"] == STEPS * (1 + S), t


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "dataflow"])
def test_a_step_sends_the_fewest_messages_it_needs(stepped, schedule):
    S, M = 2, 4
    t = stepped[schedule]["transfers"]
    # Activations forward and their gradients backward at each cut, per micro-batch.
    assert t["between_stages"] == 2 * (S - 1) * M, t
    # Once per step: the features to the first stage, the labels to the last...
    assert t["from_client"] == 2, t
    # ... and back: the loss and metric means, and each stage's slot times.
    assert t["to_client"] == 1 + S and t["control"] == 0, t


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_stage_runs_its_slots_in_its_schedules_order(stepped, schedule):
    from tfdist.training.pipeline.stages import schedule_slots

    S, M = 2, 4
    for s, stamps in enumerate(stepped[schedule]["stamps"]):
        assert len(stamps) == len(schedule_slots(schedule, S, M, s)) + 1  # and the update
        # Stamped on the stage's task: each slot starts after the one before ends.
        assert all(a <= b for a, b in stamps)
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(stamps, stamps[1:]))
    # The last stage's first backward comes after the first stage's first forward.
    first, last = stepped[schedule]["stamps"]
    assert last[schedule_slots(schedule, S, M, 1).index(("B", 0))][0] >= first[0][1]


def test_under_dataflow_each_backward_follows_its_forward_and_the_update_every_slot(stepped):
    from tfdist.training.pipeline.stages import schedule_slots

    S, M = 2, 4
    stamps = stepped["dataflow"]["stamps"]
    for s, stage in enumerate(stamps):
        slots = schedule_slots("dataflow", S, M, s)
        assert len(stage) == len(slots) + 1 and all(a <= b for a, b in stage)
        for m in range(M):
            assert stage[slots.index(("F", m))][1] <= stage[slots.index(("B", m))][0]
        assert max(b for _, b in stage[:-1]) <= stage[-1][0]
    first, last = stamps
    slots = [schedule_slots("dataflow", S, M, s) for s in range(S)]
    # The data between the stages orders their slots: a slot starts after the slot
    # whose output it takes has started (not necessarily ended: a slot's end also
    # waits for its other work, such as its sums, while its output may already
    # have arrived at the other stage).
    for m in range(M):
        assert first[slots[0].index(("F", m))][0] <= last[slots[1].index(("F", m))][0]
        assert last[slots[1].index(("B", m))][0] <= first[slots[0].index(("B", m))][0]


def test_busy_time_is_the_time_a_stages_slots_cover():
    import numpy as np
    import tensorflow as tf

    from tfdist.training.pipeline.pipeline_trainer import covered

    stamps = tf.constant([[[0.0, 2.0], [1.0, 3.0], [5.0, 6.0]],  # overlapping: 3 + 1
                          [[4.0, 5.0], [0.0, 1.0], [2.0, 3.0]],  # apart, out of order
                          [[0.0, 10.0], [1.0, 2.0], [3.0, 4.0]]], tf.float64)  # nested
    np.testing.assert_array_equal(covered(stamps).numpy(), [4.0, 3.0, 10.0])
    rng = np.random.default_rng(0)
    starts = rng.uniform(0, 10, size=(5, 7))
    spans = np.stack([starts, starts + rng.uniform(0, 2, size=(5, 7))], -1)
    grid = np.linspace(0, 12, 120001)
    for row, got in zip(spans, covered(tf.constant(spans)).numpy()):
        inside = np.zeros_like(grid, dtype=bool)
        for a, b in row:
            inside |= (grid >= a) & (grid < b)
        assert abs(got - inside.mean() * 12) < 1e-3


def test_two_copies_average_their_gradients_as_one_copy_of_all_their_micro_batches(stepped):
    """Two copies of M micro-batches (their gradients averaged by the placed
    reduce-scatter and all-gather) make the update of one copy of 2M: the same
    micro-batches, the same mean; and the copies end identical, to the bit."""
    import numpy as np

    two, one = stepped["two-copies"], stepped["one-copy-2m"]
    for a, b in zip(two["weights"], one["weights"]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    assert abs(two["loss"] - one["loss"]) < 1e-5
    first, second = two["copies"]
    assert first == second
    moved = [np.abs(np.array(a) - np.array(w)).max()
             for a, w in zip(two["weights"], stepped["initial"])]
    assert min(moved) > 1e-3, moved


def test_four_copies_of_one_stage_average_uneven_chunks_as_one_copy(stepped):
    import numpy as np

    four, one = stepped["four-copies"], stepped["one-copy-2m"]
    assert sum(len(np.array(w).ravel()) for w in four["weights"]) % 4 != 0
    for a, b in zip(four["weights"], one["weights"]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    assert all(copy == four["copies"][0] for copy in four["copies"][1:])


def test_chunk_sizes_cover_the_vector_in_nearly_equal_parts():
    from tfdist.training.pipeline.pipeline_trainer import chunk_sizes

    assert chunk_sizes(837, 4) == [210, 209, 209, 209]
    assert chunk_sizes(480, 2) == [240, 240]
    assert chunk_sizes(2, 3) == [1, 1, 0]


def test_two_copies_exchange_one_message_per_gradient_chunk(stepped):
    S, M, P = 2, 4, 2
    t = stepped["two-copies"]["transfers"]
    # Each copy's activations and their gradients, and per stage a reduce-scatter
    # and an all-gather: P - 1 chunks in and P - 1 out on each copy's task (not a
    # message per variable). The metric's zero state (accuracy's total and count)
    # is captured once, on the first copy's last stage, and read by the other.
    metric_state = 2
    assert t["between_stages"] == 2 * (S - 1) * M * P + 2 * P * (P - 1) * S + metric_state, t
    assert t["from_client"] == 2 * P and t["control"] == 0, t


def test_each_stage_tasks_peak_memory_is_read_on_the_task(stepped):
    peaks = stepped["two-copies"]["peak_rss"]
    assert sorted(peaks) == [f"worker:{i}" for i in range(4)], peaks
    # A process with TensorFlow loaded holds hundreds of MB resident.
    assert all(100 << 20 < v < 64 << 30 for v in peaks.values()), peaks


def test_the_average_over_copies_is_each_gradients_mean_whatever_its_dtype():
    """The placed reduce-scatter and all-gather on one process's CPU: gradients of two
    dtypes (a vector each) and a stage whose size does not split evenly."""
    import numpy as np
    import tensorflow as tf

    from tfdist.training.pipeline.pipeline_trainer import average_over_copies

    P = 3
    rng = np.random.default_rng(0)
    values = [[rng.normal(size=(3, 5)), rng.normal(size=(5,)), rng.normal(size=(2,))]
              for _ in range(P)]
    dtypes = [tf.float32, tf.float32, tf.float64]

    grads = [[tf.constant(g, dtype=d) for g, d in zip(v, dtypes)] for v in values]
    devices = [[("cpu", "/device:CPU:0")] for _ in range(P)]
    means = average_over_copies(0, grads, devices)
    assert len(means) == P
    for copy in means:
        for i, got in enumerate(copy):
            assert got.dtype == dtypes[i] and got.shape == values[0][i].shape
            tight = dtypes[i] == tf.float64
            np.testing.assert_allclose(got.numpy(), np.mean([v[i] for v in values], axis=0),
                                       rtol=1e-12 if tight else 1e-5, atol=0 if tight else 1e-6)
