"""Tasks the export tests train (not collected as tests)."""

import keras
import numpy as np
import tensorflow as tf


class DictInputs:
    """Two named inputs of two dtypes: ``x`` (4 floats) and ``cat`` (an int32 id);
    y = x . w + a per-category offset."""

    sizes = {"train": 4_000, "test": 500}

    def build_model(self):
        x = keras.Input((4,), name="x")
        cat = keras.Input((), dtype="int32", name="cat")
        h = keras.layers.Concatenate()([x, keras.layers.Embedding(8, 3, name="cat_table")(cat)])
        model = keras.Model({"x": x, "cat": cat}, keras.layers.Dense(1)(h))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
        return model

    def dataset(self, split):
        rng = np.random.default_rng({"train": 1, "test": 2}[split])
        n = self.sizes[split]
        x = rng.normal(size=(n, 4)).astype("float32")
        cat = rng.integers(0, 8, size=n).astype("int32")
        y = x @ np.array([1, -1, 0.5, 2], "float32") + np.linspace(-1, 1, 8)[cat].astype("float32")
        return tf.data.Dataset.from_tensor_slices(({"x": x, "cat": cat}, y[:, None]))


DICT_INPUTS = DictInputs()


class Doubler(keras.layers.Layer):
    """Doubles its input in Python: trains and predicts in the process that traced
    it, but a SavedModel cannot carry the Python callback to another process."""

    def call(self, x):
        y = tf.py_function(lambda t: t * 2.0, [x], tf.float32)
        y.set_shape(x.shape)
        return y


class PythonLayer:
    """A regression whose model holds a tf.py_function layer."""

    def build_model(self):
        x = keras.Input((3,), name="x")
        model = keras.Model(x, keras.layers.Dense(1)(Doubler()(x)))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        return model

    def dataset(self, split):
        rng = np.random.default_rng({"train": 1, "test": 2}[split])
        x = rng.normal(size=(512, 3)).astype("float32")
        return tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1, keepdims=True)))


PYTHON_LAYER = PythonLayer()
