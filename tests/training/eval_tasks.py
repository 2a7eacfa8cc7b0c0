"""Small tasks whose evaluation the members share (not collected as tests).

Every test split holds 7,777 examples: not a multiple of the evaluation's
batch (1,000), so a short last batch is always someone's. The data: 8 float
features, the class the argmax of a fixed linear map, a binary label (class 0
or not) and a regression target.
"""

import keras
import numpy as np
import tensorflow as tf

SIZES = {"train": 4_000, "test": 7_777, "validation": 2_222}
FEATURES, CLASSES = 8, 3


def arrays(split):
    rng = np.random.default_rng({"train": 1, "test": 2, "validation": 3}[split])
    w = np.random.default_rng(0).normal(size=(FEATURES, CLASSES)).astype("float32")
    x = rng.normal(size=(SIZES[split], FEATURES)).astype("float32")
    y = np.argmax(x @ w, axis=1).astype("int32")
    r = (x @ w[:, 0]).astype("float32")
    return x, y, r


class Binary:
    """Logits, cross-entropy, accuracy and AUC (from its confusion counts)."""

    splits = ("train", "test")

    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        h = keras.layers.Dense(16, activation="relu")(x)
        model = keras.Model(x, keras.layers.Dense(1)(h))
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy"),
                               keras.metrics.AUC(from_logits=True, name="auc")])
        return model

    def dataset(self, split):
        if split not in self.splits:
            raise KeyError(split)  # no validation split
        x, y, _ = arrays(split)
        return tf.data.Dataset.from_tensor_slices((x, (y == 0).astype("float32")[:, None]))


class TwoOutputs(Binary):
    """Named outputs, a loss each, loss weights, metrics and weighted metrics per output."""

    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        h = keras.layers.Dense(16, activation="relu")(x)
        cls = keras.layers.Dense(CLASSES, activation="softmax", name="cls")(h)
        reg = keras.layers.Dense(1, name="reg")(h)
        model = keras.Model(x, {"cls": cls, "reg": reg})
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                      loss_weights={"cls": 1.0, "reg": 0.5},
                      metrics={"cls": ["accuracy"], "reg": ["mae"]},
                      weighted_metrics={"cls": ["accuracy"]})
        return model

    def dataset(self, split):
        x, y, r = arrays(split)
        return tf.data.Dataset.from_tensor_slices((x, {"cls": y, "reg": r[:, None]}))


class SampleWeighted(Binary):
    """(x, y, sample_weight) triples: class 2 weighs ten times more; a weighted metric."""

    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        h = keras.layers.Dense(16, activation="relu")(x)
        model = keras.Model(x, keras.layers.Dense(CLASSES, activation="softmax")(h))
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], weighted_metrics=["accuracy"])
        return model

    def dataset(self, split):
        x, y, _ = arrays(split)
        w = np.where(y == 2, 10.0, 1.0).astype("float32")
        return tf.data.Dataset.from_tensor_slices((x, y, w))


class LargestLogit(keras.metrics.Metric):
    """A user's metric whose state is a maximum, not a sum over examples."""

    def __init__(self, name="largest_logit", **kwargs):
        super().__init__(name=name, **kwargs)
        self.largest = self.add_variable(shape=(), initializer="zeros", name="largest")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.largest.assign(keras.ops.maximum(self.largest, keras.ops.max(y_pred)))

    def result(self):
        return self.largest


class OwnMetric(Binary):
    """A compiled metric of the user's own that cannot be summed: the chief evaluates."""

    def build_model(self):
        model = super().build_model()
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy"),
                               LargestLogit()])
        return model


class TrackerModel(keras.Model):
    """A test_step of its own, as Keras's guide writes one: trackers' results."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.error_tracker = keras.metrics.MeanAbsoluteError(name="mae")

    @property
    def metrics(self):
        return [self.loss_tracker, self.error_tracker]

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.loss_tracker.update_state(keras.ops.mean(keras.ops.square(y - y_pred), axis=-1))
        self.error_tracker.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class OwnTestStep(Binary):
    """A model's own test_step whose logs are its Keras metrics: their states merge."""

    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        model = TrackerModel(x, keras.layers.Dense(1)(keras.layers.Dense(16, activation="relu")(x)))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        return model

    def dataset(self, split):
        x, _, r = arrays(split)
        return tf.data.Dataset.from_tensor_slices((x, r[:, None]))


class NumberModel(keras.Model):
    """A test_step of its own returning a number of its own beside the loss."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=False)
        return {"loss": loss, "own_number": keras.ops.convert_to_tensor(42.0)}


class OwnNumbers(Binary):
    """A test_step's logs that are not its metrics' results: the chief evaluates."""

    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        model = NumberModel(x, keras.layers.Dense(1)(keras.layers.Dense(16, activation="relu")(x)))
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.BinaryCrossentropy(from_logits=True))
        return model


class Validated(Binary):
    """Binary with a validation split (2,222 examples) evaluated at every epoch end."""

    splits = ("train", "test", "validation")


BINARY = Binary()
TWO_OUTPUTS = TwoOutputs()
SAMPLE_WEIGHTED = SampleWeighted()
OWN_METRIC = OwnMetric()
OWN_TEST_STEP = OwnTestStep()
OWN_NUMBERS = OwnNumbers()
VALIDATED = Validated()
