"""``dense-chain``: a compute-heavy chain of wide Dense layers, for ``--strategy pipeline``.

Synthetic and deterministic (no download): ``features`` = 256 Gaussian
inputs, labelled by a planted teacher (a random two-layer ReLU network,
the arg-max of its 10 outputs), so a student can learn it but not at once.
The model: 4 x Dense(2048, relu) over the 256 features and a 10-way head,
about 13 M parameters (53 MB of weights): one step at batch 256 is about
20 GFLOP of matrix products, against which an activation at a cut (batch
x 2048 floats) is small. Its four wide layers are 0.5 M, 4.2 M, 4.2 M and
4.2 M parameters: at S = 2 the balanced cut is layers 0-1 | 2-4, 4.7 M
against 8.4 M (three equal layers do not halve), and at S = 4 each big
layer has a stage.
"""

from __future__ import annotations

import numpy as np

DEFAULTS = {"features": 256, "width": 2048, "layers": 4, "classes": 10,
            "train_size": 60_000, "test_size": 10_000, "seed": 0}


class DenseChainTask:
    def __init__(self):
        self.options = dict(DEFAULTS)
        self._cache = {}

    def configure(self, **options) -> None:
        """``--task-option KEY=VALUE``: any of DEFAULTS, positive integers."""
        unknown = sorted(set(options) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"dense-chain has no option {unknown[0]!r}; options: "
                             f"{', '.join(sorted(DEFAULTS))}")
        for key, value in options.items():
            try:
                number = int(str(value).replace("_", ""))
            except ValueError:
                number = 0
            if number < (0 if key == "seed" else 1):
                raise ValueError(f"dense-chain option {key}={value!r} must be a positive "
                                 f"integer; e.g. {key}={DEFAULTS[key]}")
            self.options[key] = number
        self._cache = {}

    def _examples(self, split: str):
        if split not in self._cache:
            o = self.options
            teacher = np.random.default_rng(o["seed"])
            w1 = teacher.normal(size=(o["features"], 64)) / np.sqrt(o["features"])
            w2 = teacher.normal(size=(64, o["classes"])) / 8.0
            rng = np.random.default_rng(o["seed"] + (1 if split == "train" else 2))
            n = o["train_size"] if split == "train" else o["test_size"]
            x = rng.normal(size=(n, o["features"])).astype("float32")
            y = np.argmax(np.maximum(x @ w1, 0) @ w2, axis=1).astype("int64")
            self._cache[split] = (x, y)
        return self._cache[split]

    def build_model(self):
        import keras

        o = self.options
        model = keras.Sequential(
            [keras.Input((o["features"],), name="features")]
            + [keras.layers.Dense(o["width"], activation="relu") for _ in range(o["layers"])]
            + [keras.layers.Dense(o["classes"])], name="dense_chain")
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    def dataset(self, split: str):
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(self._examples(split))


TASK = DenseChainTask()
configure = TASK.configure
