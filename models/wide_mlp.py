"""The ``wide-mlp`` task: MNIST through 784 -> 64 -> WIDTH -> 64 -> 10, a model whose
training state, not its compute, is what a worker must hold.

At the default width of 400,000 its two wide Dense layers hold 64 x WIDTH weights
each: about 51 M parameters, 205 MB of float32 weights and, with Adam, 16 bytes a
parameter of training state (weights, gradients, two slots): 0.8 GB on every worker
of plain data parallelism, which ``--shard-state`` splits over the workers
(docs/sharding.md). Written against the public task contract; no ``tf.distribute``.
"""

from __future__ import annotations

import keras

from tfdist.models.mnist import NUM_CLASSES, MnistTask

DEFAULT_WIDTH = 400_000


class WideMlp(MnistTask):
    """``--task-option width=N`` sets the wide layer (parameters about 128 x N)."""

    def __init__(self):
        super().__init__("wide-mlp", self._layers_of)
        self.width = DEFAULT_WIDTH

    def configure(self, width: str = str(DEFAULT_WIDTH), data_dir: str | None = None) -> None:
        self.width, self.data_dir = int(width), data_dir

    def _layers_of(self) -> list:
        return [keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(self.width, activation="relu"),
                keras.layers.Dense(64, activation="relu"), keras.layers.Dense(NUM_CLASSES)]


TASK = WideMlp()
