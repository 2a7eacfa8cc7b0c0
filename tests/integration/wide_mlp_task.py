"""A task for the memory-limit case of ``--strategy pipeline`` (not collected as tests).

MNIST through a wide MLP: 784 -> 64 -> WIDTH -> 64 -> 10. Its two wide
layers hold 64 x WIDTH weights each, so with Adam (two slots per weight)
the model's training state is about 2 x 3 x 4 x 64 x WIDTH bytes, cut by
``pipeline`` at S = 2 into two nearly equal halves.
"""

import keras

from tfdist.models.mnist import MnistTask


class WideMlp(MnistTask):
    def __init__(self):
        super().__init__("wide-mlp", self._layers_of)
        self.width = 800_000

    def configure(self, width: str = "800000", data_dir=None):
        self.width, self.data_dir = int(width), data_dir

    def _layers_of(self):
        return [keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(self.width, activation="relu"),
                keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]


TASK = WideMlp()
