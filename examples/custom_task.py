"""An example task: your own Keras 3 model and data, trained under any strategy.

    python train.py --task examples/custom_task.py --epochs 1
    python launch.py --strategy ps --workers 2 --ps 1 -- --task examples/custom_task.py --epochs 1

A functional model with two inputs, a float vector and an integer category
(through an ``Embedding``), on data generated here from a planted rule, so it
needs no download. It reaches a test accuracy of at least 0.90 after one
epoch under every strategy (the planted rule itself scores about 0.95).

A task provides ``build_model()`` (compiled, exactly as for ``model.fit``)
and ``dataset(split)`` (unbatched ``(features, label)`` examples). It does
not batch, shard or repeat its data and does not create a strategy: the
library does all of that.
"""

import keras
import numpy as np
import tensorflow as tf

FEATURES, CATEGORIES, CLASSES = 8, 50, 3
SIZES = {"train": 60_000, "test": 4_000}  # 4,000 does not divide a batch of 64: exact anyway
STATED_ACCURACY = 0.90


def _planted(seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(FEATURES, CLASSES)), rng.normal(size=(CATEGORIES, CLASSES)) * 1.5


def _examples(split: str):
    weights, by_category = _planted()
    rng = np.random.default_rng({"train": 1, "test": 2}[split])
    n = SIZES[split]
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    category = rng.integers(0, CATEGORIES, size=n).astype("int32")
    logits = x @ weights + by_category[category] + rng.normal(scale=0.3, size=(n, CLASSES))
    return {"x": x, "category": category}, logits.argmax(axis=1).astype("int32")


def build_model() -> keras.Model:
    x = keras.Input((FEATURES,), name="x")
    category = keras.Input((), dtype="int32", name="category")
    h = keras.layers.Concatenate()([
        keras.layers.BatchNormalization()(keras.layers.Dense(32, activation="relu")(x)),
        keras.layers.Embedding(CATEGORIES, 8)(category),
    ])
    h = keras.layers.Dropout(0.1)(keras.layers.Dense(32, activation="relu")(h))
    model = keras.Model({"x": x, "category": category}, keras.layers.Dense(CLASSES)(h))
    model.compile(optimizer=keras.optimizers.Adam(5e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def dataset(split: str) -> tf.data.Dataset:
    features, labels = _examples(split)
    return tf.data.Dataset.from_tensor_slices((features, labels))
