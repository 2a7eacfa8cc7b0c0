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
