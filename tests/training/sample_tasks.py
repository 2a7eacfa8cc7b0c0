"""Small tasks the tests train under every strategy (not collected as tests)."""

import keras
import numpy as np
import tensorflow as tf


class Regression:
    """y = x . w + 0.5 + noise: MSE loss, MAE metric, one float input, 1,001 test examples."""

    sizes = {"train": 8_000, "test": 1_001}
    noise = 0.1

    def build_model(self):
        x = keras.Input((6,), name="x")
        model = keras.Model(x, keras.layers.Dense(1)(keras.layers.Dense(16, activation="relu")(x)))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
        return model

    def dataset(self, split):
        rng = np.random.default_rng({"train": 1, "test": 2}[split])
        w = np.linspace(-1, 1, 6).astype("float32")
        x = rng.normal(size=(self.sizes[split], 6)).astype("float32")
        y = x @ w + 0.5 + rng.normal(scale=self.noise, size=self.sizes[split]).astype("float32")
        return tf.data.Dataset.from_tensor_slices((x, y[:, None]))


REGRESSION = Regression()


class BigEmbedding:
    """A user's model with a keras.layers.Embedding of 300,000 x 8 floats (9.6 MB):
    above the 1 MiB default, so split over the ps tasks. Label: whether the
    id is even (a table lookup learns it)."""

    rows = 300_000
    sizes = {"train": 20_000, "test": 2_000}

    def build_model(self):
        ids = keras.Input((), dtype="int32", name="id")
        h = keras.layers.Embedding(self.rows, 8, name="table")(ids)
        model = keras.Model(ids, keras.layers.Dense(1)(h))
        model.compile(optimizer=keras.optimizers.Adagrad(0.5),
                      loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy")])
        return model

    def dataset(self, split):
        rng = np.random.default_rng({"train": 1, "test": 1}[split])
        ids = rng.integers(0, 500, size=self.sizes[split]).astype("int32")  # rows seen often
        return tf.data.Dataset.from_tensor_slices((ids, (ids % 2 == 0).astype("float32")[:, None]))


BIG_EMBEDDING = BigEmbedding()
