"""BatchNormalization's moving statistics: one value for every replica after a drain.

Keras 3 creates them without an aggregation, so under MirroredStrategy (and
MultiWorkerMirroredStrategy) each replica updates its own copy. Run in a
child process: two logical CPUs must be configured before TensorFlow starts.
"""

import subprocess
import sys

from conftest import REPO

SCRIPT = r"""
import tensorflow as tf
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np
from tfdist.training.sync.sync_trainer import make_statistics_sync
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    x = keras.Input((4,))
    model = keras.Model(x, keras.layers.BatchNormalization()(x))
data = np.arange(64 * 4, dtype="float32").reshape(64, 4)
ds = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(data).batch(16))
step = tf.function(lambda b: strategy.run(lambda t: model(t, training=True), args=(b,)))
step(next(iter(ds)))
copies = lambda: [c.numpy() for c in model.non_trainable_variables[0].value.values]
before = copies()
assert not np.allclose(before[0], before[1]), before
make_statistics_sync(strategy, model.non_trainable_variables)()
after = copies()
np.testing.assert_allclose(after[0], after[1])
np.testing.assert_allclose(after[0], (before[0] + before[1]) / 2, rtol=1e-6)
print("OK")
"""


def test_drain_averages_each_replicas_moving_statistics():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-2000:]
