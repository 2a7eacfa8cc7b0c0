"""Small tasks in the styles Keras users write for ``model.fit`` (not collected as tests).

Each trains in seconds on synthetic data; ``plain_fit`` trains the same task
with Keras's own ``model.fit`` in this process, the reference every
conformance test compares the library's result with.

The data: 8 float features, 3 classes, the class the argmax of a fixed
linear map (a linear model learns it to ~0.97), and a regression target
``x . w`` for the multi-output tasks.
"""

import keras
import numpy as np
import tensorflow as tf

SIZES = {"train": 4_000, "test": 1_000, "validation": 500}
FEATURES, CLASSES = 8, 3


def arrays(split, splits=("train", "test")):
    """(x, class label, regression target) of a split, the same on every call.

    KeyError for a split not in ``splits``: as a task without a validation split says so.
    """
    if split not in splits:
        raise KeyError(split)
    rng = np.random.default_rng({"train": 1, "test": 2, "validation": 3}[split])
    w = np.random.default_rng(0).normal(size=(FEATURES, CLASSES)).astype("float32")
    x = rng.normal(size=(SIZES[split], FEATURES)).astype("float32")
    y = np.argmax(x @ w, axis=1).astype("int32")
    r = (x @ w[:, 0]).astype("float32")
    return x, y, r


def _head(x, name=None, dtype=None):
    h = keras.layers.Dense(32, activation="relu", dtype=dtype)(x)
    return keras.layers.Dense(CLASSES, activation="softmax", name=name, dtype=dtype)(h)


class Blobs:
    """A functional model, sparse categorical cross-entropy and accuracy."""

    splits = ("train", "test")

    def optimizer(self):
        return keras.optimizers.Adam(1e-2)

    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        model = keras.Model(x, _head(x))
        model.compile(optimizer=self.optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model

    def dataset(self, split):
        x, y, _ = arrays(split, self.splits)
        return tf.data.Dataset.from_tensor_slices((x, y))


class Net(keras.Model):
    """Layers made in ``__init__``, ``call()``: variables exist only after the first call."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.out = keras.layers.Dense(CLASSES, activation="softmax")

    def call(self, x, training=False):
        return self.out(self.hidden(x))


class Subclassed(Blobs):
    def build_model(self):
        model = Net()
        model.compile(optimizer=self.optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model


class TwoOutputs(Blobs):
    """Named outputs, a loss each, loss_weights, metrics and weighted_metrics per output."""

    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        h = keras.layers.Dense(32, activation="relu")(x)
        cls = keras.layers.Dense(CLASSES, activation="softmax", name="cls")(h)
        reg = keras.layers.Dense(1, name="reg")(h)
        model = keras.Model(x, {"cls": cls, "reg": reg})
        model.compile(optimizer=self.optimizer(),
                      loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                      loss_weights={"cls": 1.0, "reg": 0.5},
                      metrics={"cls": ["accuracy"], "reg": ["mae"]},
                      weighted_metrics={"cls": ["accuracy"]})
        return model

    def dataset(self, split):
        x, y, r = arrays(split)
        return tf.data.Dataset.from_tensor_slices((x, {"cls": y, "reg": r[:, None]}))


class ListOutputs(Blobs):
    """The same as a list of two outputs."""

    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        h = keras.layers.Dense(32, activation="relu")(x)
        cls = keras.layers.Dense(CLASSES, activation="softmax", name="cls")(h)
        reg = keras.layers.Dense(1, name="reg")(h)
        model = keras.Model(x, [cls, reg])
        model.compile(optimizer=self.optimizer(),
                      loss=["sparse_categorical_crossentropy", "mse"], loss_weights=[1.0, 0.5],
                      metrics=[["accuracy"], ["mae"]])
        return model

    def dataset(self, split):
        x, y, r = arrays(split)
        return tf.data.Dataset.from_tensor_slices((x, (y, r[:, None])))


def _weights(y):
    # Class 2 counts ten times as much: a weighted model favours it.
    return np.where(y == 2, 10.0, 1.0).astype("float32")


class SampleWeighted(Blobs):
    """(x, y, sample_weight) triples, and a weighted metric."""

    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        model = keras.Model(x, _head(x))
        model.compile(optimizer=self.optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], weighted_metrics=["accuracy"])
        return model

    def dataset(self, split):
        x, y, _ = arrays(split)
        return tf.data.Dataset.from_tensor_slices((x, y, _weights(y)))


def class_2_share(y_true, y_pred):
    """The fraction of examples predicted as class 2."""
    return keras.ops.cast(keras.ops.argmax(y_pred, axis=-1) == 2, "float32")


class ClassWeighted(Blobs):
    """``class_weight`` as a task attribute, applied to the training split as fit applies it."""

    class_weight = {0: 1.0, 1: 1.0, 2: 10.0}

    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        model = keras.Model(x, _head(x))
        # How often class 2 is predicted: the weights at work (about 0.33 unweighted).
        model.compile(optimizer=self.optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy", class_2_share])
        return model


class Penalty(keras.layers.Layer):
    """An ``add_loss`` of its own, besides the Dense layers' kernel regularizers."""

    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


class Regularized(Blobs):
    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        h = keras.layers.Dense(32, activation="relu",
                               kernel_regularizer=keras.regularizers.L2(1e-2))(x)
        h = Penalty()(h)
        out = keras.layers.Dense(CLASSES, activation="softmax",
                                 kernel_regularizer=keras.regularizers.L2(1e-2))(h)
        model = keras.Model(x, out)
        model.compile(optimizer=self.optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model


class FlippedModel(keras.Model):
    """A train_step of its own: it trains on the labels reversed (2 - y)."""

    def train_step(self, data):
        x, y = data
        y = (CLASSES - 1) - y
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        for metric in self.metrics:  # as Keras's guide writes it: the loss is tracked here
            if metric.name == "loss":
                metric.update_state(loss)
        return self.compute_metrics(x, y, y_pred)


class FlippedTrainStep(Blobs):
    """Honoured, the model learns the reversed labels: its test accuracy is far below chance."""

    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        model = FlippedModel(x, _head(x))
        model.compile(optimizer=self.optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model


class OwnTestModel(keras.Model):
    """A test_step of its own: it reports a number of its own beside the loss."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=False)
        return {"loss": loss, "own_number": keras.ops.convert_to_tensor(42.0)}


class OwnTestStep(Blobs):
    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        model = OwnTestModel(x, _head(x))
        model.compile(optimizer=self.optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model


class BoolFeatures(Blobs):
    """Features given as bool (the signs) for an int32 input: Keras casts them."""

    def build_model(self):
        x = keras.Input((FEATURES,), name="x", dtype="int32")
        h = keras.layers.Lambda(lambda t: keras.ops.cast(t, "float32") * 2.0 - 1.0)(x)
        model = keras.Model(x, _head(h))
        model.compile(optimizer=self.optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model

    def dataset(self, split):
        x, y, _ = arrays(split)
        return tf.data.Dataset.from_tensor_slices((x > 0, y))


class StringFeatures(Blobs):
    """A string for a float input: refused in one line."""

    def dataset(self, split):
        x, y, _ = arrays(split)
        return tf.data.Dataset.from_tensor_slices((x.astype(str), y))


class _OptimizerOption(Blobs):
    options: dict = {}

    def optimizer(self):
        return keras.optimizers.Adam(1e-2, **self.options)


class GradientAccumulation(_OptimizerOption):
    options = {"gradient_accumulation_steps": 4}


class OwnStepAccumulation(GradientAccumulation, FlippedTrainStep):
    """A model's own train_step (FlippedTrainStep's model) and an optimizer that
    accumulates (GradientAccumulation's): Keras's own accumulation (a tf.cond around
    the all-reduce) runs inside the model's step."""


class ClipNorm(_OptimizerOption):
    options = {"clipnorm": 0.5}


class GlobalClipNorm(_OptimizerOption):
    options = {"global_clipnorm": 0.5}


class Ema(_OptimizerOption):
    options = {"use_ema": True, "ema_momentum": 0.9}


class LossScaled(Blobs):
    """mixed_float16 layers and Keras's LossScaleOptimizer."""

    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        h = keras.layers.Dense(32, activation="relu", dtype="mixed_float16")(x)
        out = keras.layers.Dense(CLASSES, activation="softmax", dtype="float32")(h)
        model = keras.Model(x, out)
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


class Jit(Blobs):
    """compile(jit_compile=True): the step is compiled with XLA, as fit compiles it."""

    def build_model(self):
        model = super().build_model()
        model.compile(optimizer=self.optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], jit_compile=True)
        return model


class OwnStepJit(FlippedTrainStep):
    """A model's own train_step compiled with jit_compile=True: its step applies its own
    update, which XLA compiles with it as fit does (none, mirrored) or cannot (the
    all-reduce, the ps writes)."""

    def build_model(self):
        model = super().build_model()
        model.compile(optimizer=self.optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], jit_compile=True)
        return model


class StepsPerExecution(Blobs):
    """compile(steps_per_execution=10): ten steps per call, as --steps-per-execution 10."""

    def build_model(self):
        model = super().build_model()
        model.compile(optimizer=self.optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], steps_per_execution=10)
        return model


class NumpyData(Blobs):
    """``dataset(split)`` returns NumPy arrays, ``(x, y)``."""

    def dataset(self, split):
        x, y, _ = arrays(split)
        return x, y


class Validated(Blobs):
    """A "validation" split (NumPy arrays), evaluated every epoch; the others have none."""

    splits = ("train", "test", "validation")

    def dataset(self, split):
        x, y, _ = arrays(split, self.splits)
        return (x, y) if split == "validation" else tf.data.Dataset.from_tensor_slices((x, y))


# Instances, for task specs such as tests/training/fit_tasks.py:SUBCLASSED.
BLOBS = Blobs()
SUBCLASSED = Subclassed()
TWO_OUTPUTS = TwoOutputs()
LIST_OUTPUTS = ListOutputs()
SAMPLE_WEIGHTED = SampleWeighted()
CLASS_WEIGHTED = ClassWeighted()
REGULARIZED = Regularized()
FLIPPED_TRAIN_STEP = FlippedTrainStep()
BOOL_FEATURES = BoolFeatures()
OWN_TEST_STEP = OwnTestStep()
STRING_FEATURES = StringFeatures()
GRADIENT_ACCUMULATION = GradientAccumulation()
OWN_STEP_ACCUMULATION = OwnStepAccumulation()
CLIP_NORM = ClipNorm()
GLOBAL_CLIP_NORM = GlobalClipNorm()
EMA = Ema()
LOSS_SCALED = LossScaled()
NUMPY_DATA = NumpyData()
STEPS_PER_EXECUTION = StepsPerExecution()
JIT = Jit()
OWN_STEP_JIT = OwnStepJit()
VALIDATED = Validated()


class Recorder(keras.callbacks.Callback):
    """A custom callback: what it was called with, and the model it saw."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_begin(self, logs=None):
        self.calls.append(("train_begin", None))

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch_begin", epoch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch_end", sorted(logs)))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch, sorted(logs)))

    def on_train_end(self, logs=None):
        self.calls.append(("train_end", self.model.count_params()))


class WithCallbacks(Validated):
    """EarlyStopping (patience 0 on a val_loss that cannot improve by 1.0: stops after
    epoch 2 of 5), CSVLogger and a custom callback."""

    csv_path = None  # set by the test

    def __init__(self):
        self.recorder = None

    def callbacks(self):
        self.recorder = Recorder()
        out = [keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=1.0),
               self.recorder]
        if self.csv_path:
            out.append(keras.callbacks.CSVLogger(self.csv_path))
        return out


WITH_CALLBACKS = WithCallbacks()


class LoggingRecorder(Recorder):
    """The custom callback in a launched task: also the learning rate its model's optimizer
    has at each epoch begin, written to ``calls.json`` in ``out_dir`` at the end."""

    def __init__(self, out_dir):
        super().__init__()
        self.out_dir = out_dir

    def on_epoch_begin(self, epoch, logs=None):
        rate = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        self.calls.append(("epoch_begin", epoch, rate))

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        import json
        import os

        with open(os.path.join(self.out_dir, "calls.json"), "w") as f:
            json.dump(self.calls, f)


class AllCallbacks(Validated):
    """Keras's built-in callbacks and a custom one, writing files into ``$FIT_CALLBACKS_DIR`` (5 epochs asked):

    - LearningRateScheduler: the rate 0 from the third epoch (index 2) on, so the weights
      stop changing there;
    - ReduceLROnPlateau (val_loss, min_delta 1.0, factor 0.5, patience 0): halves the
      rate at the end of the second epoch (index 1);
    - EarlyStopping (val_loss, min_delta 1.0, patience 2): stops after the third epoch,
      step 186 of 310 (62 steps an epoch at a batch of 64);
    - ModelCheckpoint (``ckpt-{epoch}.keras``, every epoch), CSVLogger (``log.csv``),
      TensorBoard (``tb/``) and the custom ``LoggingRecorder`` (``calls.json``).
    The callbacks are in this order: the recorder sees the rate each epoch begins with
    before the scheduler sets its own.
    """

    def callbacks(self):
        import os

        out = os.environ["FIT_CALLBACKS_DIR"]
        return [
            LoggingRecorder(out),
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.0 if epoch >= 2 else lr),
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0,
                                              min_delta=1.0),
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=1.0),
            keras.callbacks.ModelCheckpoint(os.path.join(out, "ckpt-{epoch}.keras")),
            keras.callbacks.CSVLogger(os.path.join(out, "log.csv")),
            keras.callbacks.TensorBoard(os.path.join(out, "tb")),
        ]


ALL_CALLBACKS = AllCallbacks()


def plain_fit(task, epochs=2, batch_size=64, seed=0):
    """Keras's own ``model.fit`` on ``task`` in this process: {metric: value} on the test split."""
    keras.utils.set_random_seed(seed)
    model = task.build_model()
    train, test = task.dataset("train"), task.dataset("test")
    if not isinstance(train, tf.data.Dataset):
        train = tf.data.Dataset.from_tensor_slices(train)
        test = tf.data.Dataset.from_tensor_slices(test)
    validation = None
    if "validation" in getattr(task, "splits", ()):
        validation = tf.data.Dataset.from_tensor_slices(task.dataset("validation")).batch(1000)
    history = model.fit(train.shuffle(SIZES["train"], seed=seed).batch(batch_size),
                        epochs=epochs, class_weight=getattr(task, "class_weight", None),
                        validation_data=validation, verbose=0)
    out = model.evaluate(test.batch(1000), verbose=0, return_dict=True)
    # The last epoch's val_* logs, when the task has a validation split.
    out.update({k: v[-1] for k, v in history.history.items() if k.startswith("val_")})
    return out


class RestoreBest(Validated):
    """EarlyStopping(restore_best_weights=True) stops after epoch 2 of 5 and restores
    epoch 1's weights (the only "improvement" by 1.0); ModelCheckpoint saves each epoch's
    into ``$FIT_CALLBACKS_DIR``."""

    def callbacks(self):
        import os

        out = os.environ["FIT_CALLBACKS_DIR"]
        return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=1.0,
                                              restore_best_weights=True),
                keras.callbacks.ModelCheckpoint(os.path.join(out, "ckpt-{epoch}.keras"))]


RESTORE_BEST = RestoreBest()
