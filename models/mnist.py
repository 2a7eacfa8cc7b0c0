"""MNIST as built-in tasks: ``mnist-cnn``, ``mnist-logreg`` and ``mnist-mlp``.

Written against the public task contract (``training.workload.tasks``), as a user's
task is. Images stay uint8 in the data and are scaled by the model's first
layer: the input pipeline then holds 47 MB for the training split instead
of 188 MB of float32, and the cast costs the step what it cost the pipeline.
"""

from __future__ import annotations

import keras

INPUT_SHAPE = (28, 28, 1)
NUM_CLASSES = 10
# Peak rate of the compiled optimizer; the library replaces it with the
# configured one (--optimizer, --learning-rate, --lr-schedule) for built-ins.
LEARNING_RATE = 5e-3


def cnn_layers() -> list:
    """Two conv blocks and a dense head: ~99 % test accuracy in 2-3 epochs."""
    return [
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(NUM_CLASSES),
    ]


def logreg_layers() -> list:
    """784 -> 10 softmax regression, the classic parameter-server example."""
    return [keras.layers.Flatten(), keras.layers.Dense(NUM_CLASSES)]


def mlp_layers() -> list:
    """A deep MLP of four ~200k-parameter Dense layers (and a small head): a
    chain that ``--strategy pipeline`` cuts into 2 or 4 stages of nearly equal
    weight (each within 3 % of 1/S of the model)."""
    return [
        keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(768, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(768, activation="relu"),
        keras.layers.Dense(NUM_CLASSES),
    ]


class MnistTask:
    """An MNIST classifier: uint8 images in, logits out."""

    def __init__(self, name: str, layers, data_dir: str | None = None):
        self.name, self._layers, self.data_dir = name, layers, data_dir

    def configure(self, data_dir: str | None = None) -> None:
        """``--data-dir``: a tfds data directory holding mnist/3.0.1."""
        self.data_dir = data_dir

    def build_model(self) -> keras.Model:
        model = keras.Sequential(
            [keras.Input(INPUT_SHAPE, dtype="uint8", name="image"),
             keras.layers.Rescaling(1.0 / 255), *self._layers()],
            name=self.name.replace("-", "_"),
        )
        model.compile(
            optimizer=keras.optimizers.Adam(LEARNING_RATE),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    def dataset(self, split: str):
        """MNIST ``split`` as unbatched (uint8 image, int64 label) pairs."""
        from tfdist.models import tfds_data

        return tfds_data.load("mnist", split, self.data_dir)

    def check_data(self) -> None:
        """Both splits present and undamaged, read without starting TensorFlow."""
        from tfdist.models import tfds_data

        tfds_data.ensure_available("mnist", self.data_dir)


# The library passes --data-dir through configure(); tfds itself falls back
# to TFDS_DATA_DIR when it is None.
CNN = MnistTask("mnist-cnn", cnn_layers)
LOGREG = MnistTask("mnist-logreg", logreg_layers)
MLP = MnistTask("mnist-mlp", mlp_layers)
