"""A model's own ``train_step`` under ps-sync (``training.ps.own_step``): what a
worker queues on ps:0 and what ps:0 applies, in one process.

A ps-sync worker has several local replicas only with several GPUs
(``ParameterServerStrategy`` counts a worker's GPUs, never its logical CPUs), so
the worker's handler is run here under a ``MirroredStrategy`` of two logical CPUs
(its replica all-reduce is real) with the queues on this CPU: the two replicas'
gradients must be queued once, summed, as Keras's own ``apply`` sums them. The
train_step moves its one variable itself (``var.assign_sub``): the change is
queued as a delta, left undone on the worker, and ps:0 applies it. Two logical
CPUs must be configured before TensorFlow starts: a child process.
"""

import subprocess
import sys

from conftest import REPO

SCRIPT = r"""
import tensorflow as tf
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np
from tfdist.training.loop.step import own_train_steps
from tfdist.training.ps import own_step, ps_sync_trainer as pst
from tfdist.training.workload.apply_route import DIRECT

DEV = "/cpu:0"
pst.PS0 = DEV  # the queues on this CPU (a real ps task's under ps-sync)
rng = np.random.default_rng(0)
X = rng.normal(size=(16, 3)).astype("float32")
Y = rng.normal(size=(16, 1)).astype("float32")
RATE = 0.1


class Direct(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x) - y))
        for var, grad in zip(self.trainable_variables,
                             tape.gradient(loss, self.trainable_variables)):
            var.assign_sub(RATE * grad)
        return {"loss": loss}


strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    x = keras.Input((3,))
    model = Direct(x, keras.layers.Dense(1, use_bias=False)(x))
    model.compile(optimizer="sgd")
global_step = tf.Variable(0, dtype=tf.int64)  # ps:0's, as the trainer's
kernel = model.trainable_variables[0]
before = kernel.numpy()


def grad(xs, ys):
    w = tf.Variable(before)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(xs @ w - ys))
    return tape.gradient(loss, w), loss


with tf.device(DEV):
    base = pst.make_queues(1, [], 1)
q = own_step.make_own_queues(base, 1, 1, DEV, "float32")
q.cursor.assign([0])
base.tokens[0].enqueue(own_step.token_of(1, 0))  # apply 0 done: index 1, mid-step
halves = [(X[:8], Y[:8]), (X[8:], Y[8:])]
data = strategy.experimental_distribute_values_from_function(
    lambda ctx: halves[ctx.replica_id_in_sync_group])


@tf.function
def worker_step(batch):
    def replica(batch):
        handler = own_step.QueuedApply(q, 1, 1, pst.take_token, pst.STOP)
        handler.worker = tf.constant(0, tf.int64)
        logs = own_train_steps(model, handler, [batch])
        loss = handler.local_sum(tf.cast(logs["loss"], tf.float32), tf.distribute.ReduceOp.MEAN)
        if handler.first:
            with tf.control_dependencies([loss]):
                handler.end(loss, tf.zeros([1]))
    strategy.run(replica, args=(batch,))


worker_step(data)
# The worker queued one delta, the two replicas' summed; its own variable is unchanged.
assert np.array_equal(kernel.numpy(), before)
assert len(q.keys.applies) == 1 and q.keys.applies[0][0] is DIRECT
assert q.keys.applies[0][1][0] is kernel
assert int(q.keys.queues[0].size()) == 1, int(q.keys.queues[0].size())
index, worker, after, delta = [t.numpy() for t in q.keys.queues[0].dequeue()]
(g0, l0), (g1, l1) = grad(*halves[0]), grad(*halves[1])
want = RATE * (g0.numpy() + g1.numpy()).reshape(-1)
assert (index, worker, after) == (0, 0, 0), (index, worker, after)
assert np.allclose(delta, want, atol=1e-6), (delta, want)
q.keys.queues[0].enqueue([index, worker, after, delta])  # back, for ps:0 below
# Announced: the apply at index 0, then the step's end at index 1 with the mean loss.
assert int(q.announce.size()) == 2
said = [[t.numpy() for t in q.announce.dequeue()] for _ in range(2)]
assert [tuple(s[:3]) for s in said] == [(0, 0, 0), (1, 0, own_step.END)], said
assert abs(said[1][3] - (l0.numpy() + l1.numpy()) / 2) < 1e-5, said
assert int(q.cursor.numpy()[0]) == 1
for s in said:
    q.announce.enqueue(s)

# ps:0 (K = 1): the apply subtracts the delta, then the step's end moves the global step.
# On a plain variable (a ps task's; a mirrored one has no handle outside its replicas).
on_ps = tf.Variable(before)
q.keys.applies[0] = (DIRECT, [on_ps])
aggregate = own_step.make_own_aggregate_fn(q, global_step, 1, 1, 1, DEV)
out = aggregate(tf.constant(1))
assert np.allclose(on_ps.numpy().reshape(-1), before.reshape(-1) - want, atol=1e-6)
assert int(global_step.numpy()) == 1 and int(base.applies.numpy()) == 2
assert abs(float(out["loss"]) - (l0.numpy() + l1.numpy()) / 2) < 1e-5, out
assert int(base.accepted.numpy()[0]) == 1 and int(base.dropped.numpy()[0]) == 0
print("OK")
"""


def test_a_workers_replicas_queue_one_summed_delta_that_ps0_applies():
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr[-4000:]
