"""Tasks whose model the pipeline's cut cannot carry, besides a model's own train_step
(``fit_tasks.FLIPPED_TRAIN_STEP``, the guides' tasks): under ``pipeline`` each trains
placed (``training.pipeline.placed``). ``fit_tasks``' data and metric (accuracy);
``fit_tasks.plain_fit`` trains each with Keras's ``fit``."""

import keras
import numpy as np
import tensorflow as tf

from tests.training.fit_tasks import CLASSES, FEATURES, Blobs, Net


def _compiled(model, optimizer, loss="sparse_categorical_crossentropy"):
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
    return model


class EagerCall(keras.Model):
    """A call applying a TensorFlow op to its input: the trace on symbolic inputs fails."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.out = keras.layers.Dense(CLASSES, activation="softmax")

    def call(self, x):
        return self.out(self.hidden(tf.math.cumsum(x, axis=1)))


class SharedLayer(keras.Model):
    """One layer with weights called twice in a forward: the cut puts a layer on one stage."""

    def __init__(self):
        super().__init__()
        self.mix = keras.layers.Dense(FEATURES, activation="tanh")
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.out = keras.layers.Dense(CLASSES, activation="softmax")

    def call(self, x):
        return self.out(self.hidden(self.mix(self.mix(x))))


class CallsItself(Net):
    """A compute_loss that calls the model itself (its y_pred left aside)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        again = self(x, training=training)
        return keras.losses.SparseCategoricalCrossentropy()(y, again)


class SquaredOwnLosses(keras.Model):
    """A compute_loss counting the model's own losses (an L2 penalty) squared, not in
    proportion: no weight on each stage's own losses gives its loss."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(32, activation="relu",
                                         kernel_regularizer=keras.regularizers.L2(1e-3))
        self.out = keras.layers.Dense(CLASSES, activation="softmax")

    def call(self, x, training=False):
        return self.out(self.hidden(x))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        base = keras.losses.SparseCategoricalCrossentropy()(y, y_pred)
        return base + keras.ops.square(keras.ops.sum(self.losses))


class _Task(Blobs):
    model_class = None
    loss = "sparse_categorical_crossentropy"

    def build_model(self):
        return _compiled(self.model_class(), self.optimizer(), self.loss)


class EagerCallTask(_Task):
    model_class = EagerCall


class SharedLayerTask(_Task):
    model_class = SharedLayer


class CallsItselfTask(_Task):
    model_class = CallsItself
    loss = None  # its compute_loss is the loss, as fit takes it


class SquaredOwnLossesTask(_Task):
    model_class = SquaredOwnLosses
    loss = None


EAGER_CALL = EagerCallTask()
SHARED_LAYER = SharedLayerTask()
CALLS_ITSELF = CallsItselfTask()
SQUARED_OWN_LOSSES = SquaredOwnLossesTask()


class Chain(Blobs):
    """A compute-heavy chain both ways can train (docs/pipeline.md's placed against cut):
    64 features, four 1024-wide layers, the cut's model; ``CHAIN_OWN_STEP`` is the same
    model with a ``train_step`` of its own (Keras's, through ``super()``), which trains
    placed."""

    width, features = 1024, 64

    def build_model(self):
        model = self.model_class()(
            [keras.Input((self.features,))]
            + [keras.layers.Dense(self.width, activation="relu") for _ in range(4)]
            + [keras.layers.Dense(CLASSES, activation="softmax")])
        return _compiled(model, self.optimizer())

    def model_class(self):
        return keras.Sequential

    def dataset(self, split):
        n = {"train": 8192, "test": 1024}[split]
        rng = np.random.default_rng({"train": 1, "test": 2}[split])
        x = rng.normal(size=(n, self.features)).astype("float32")
        return tf.data.Dataset.from_tensor_slices((x, (x[:, 0] > 0).astype("int32")))


class OwnStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


class ChainOwnStep(Chain):
    def model_class(self):
        return OwnStep


CHAIN = Chain()
CHAIN_OWN_STEP = ChainOwnStep()
