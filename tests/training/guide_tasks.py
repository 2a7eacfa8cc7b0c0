"""Keras's guides to custom training, written anew as tasks on small planted data
(not collected as tests).

The patterns of "Customizing what happens in ``fit()`` with TensorFlow" and of
the knowledge-distillation example, with the guides' structure and names:

- ``FIRST``: the guide's first example: a ``train_step`` returning
  ``{m.name: m.result() for m in self.metrics}``; with a compiled loss and
  metrics Keras nests the compiled metrics' results under ``compile_metrics``.
- ``DIRECT_UPDATE``: the first example with no optimizer: ``train_step`` moves each
  trained variable itself (``var.assign_sub(rate * gradient)``).
- ``LOWER_LEVEL``: "going lower-level": ``compile(optimizer=...)`` with no
  loss, the model's own ``Mean``/``MeanAbsoluteError`` trackers and a
  ``metrics`` property. Keras's own ``evaluate`` cannot run it (no loss, no
  ``test_step``).
- ``SAMPLE_WEIGHTS``: ``sample_weight`` unpacked in ``train_step``.
- ``OWN_TEST_STEP``: "providing your own evaluation step".
- ``GAN``: the end-to-end GAN: ``compile(d_optimizer, g_optimizer, loss_fn)``,
  two optimizers applied in ``train_step``, data = images only.
- ``GAN_EVERY_OTHER``: the GAN whose generator's apply is in a ``tf.cond`` taken on
  even steps only: the applies vary from step to step.
- ``DISTILLATION``: ``compute_loss`` overridden (without ``training``),
  ``super().compile(optimizer=..., metrics=...)`` without a loss; the
  teacher's weights are planted (the map that made the labels).
- ``FEATURES_ONLY``: a self-supervised ``train_step`` on a dataset of ``(x,)``
  elements (no labels), with its own ``test_step``.

``plain_fit`` trains one with Keras's own ``model.fit`` in this process: the
reference the library's results are compared with.
"""

import keras
import numpy as np
import tensorflow as tf

from tests.training.fit_tasks import CLASSES, FEATURES, SIZES, arrays

LATENT, IMAGE = 4, 6  # the GAN's latent size and image side


class _Task:
    def optimizer(self):
        return keras.optimizers.Adam(1e-2)

    def dataset(self, split):
        x, _, r = arrays(split)
        return tf.data.Dataset.from_tensor_slices((x, r[:, None]))


def _regressor(cls):
    x = keras.Input((FEATURES,), name="x")
    h = keras.layers.Dense(16, activation="relu")(x)
    return cls(x, keras.layers.Dense(1)(h))


# --- the first example ----------------------------------------------------------


def _metrics_logs(model, loss, *args, **kwargs):
    """The guides' metric update: the loss tracker gets the loss, every other metric
    ``update_state(*args, **kwargs)``; the logs are every metric's result."""
    for metric in model.metrics:
        if metric.name == "loss":
            metric.update_state(loss)
        else:
            metric.update_state(*args, **kwargs)
    return {m.name: m.result() for m in model.metrics}


class FirstModel(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.move(gradients, trainable_vars)
        return _metrics_logs(self, loss, y, y_pred)

    def move(self, gradients, variables):
        self.optimizer.apply(gradients, variables)


class First(_Task):
    model_class = FirstModel

    def build_model(self):
        model = _regressor(self.model_class)
        model.compile(optimizer=self.optimizer(), loss="mse", metrics=["mae"])
        return model


class DirectUpdateModel(FirstModel):
    """The first example with no optimizer: ``train_step`` moves each trained variable
    itself, ``var.assign_sub(rate * gradient)`` (plain SGD by hand)."""

    rate = 0.05

    def move(self, gradients, variables):
        for var, grad in zip(variables, gradients):
            var.assign_sub(self.rate * grad)


class DirectUpdate(First):
    model_class = DirectUpdateModel


# --- going lower-level ------------------------------------------------------------


class LowerLevelModel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        # Listed here, so that fit resets them at the start of each epoch.
        return [self.loss_tracker, self.mae_metric]


class LowerLevel(_Task):
    def build_model(self):
        model = _regressor(LowerLevelModel)
        model.compile(optimizer=self.optimizer())  # no loss
        return model


# --- sample weights ----------------------------------------------------------------


class WeightedModel(keras.Model):
    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        return _metrics_logs(self, loss, y, y_pred, sample_weight=sample_weight)


def class_2_share(y_true, y_pred):
    """The fraction of examples predicted as class 2 (0.32 without weights)."""
    return keras.ops.cast(keras.ops.argmax(y_pred, axis=-1) == 2, "float32")


class SampleWeights(_Task):
    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        h = keras.layers.Dense(32, activation="relu")(x)
        model = WeightedModel(x, keras.layers.Dense(CLASSES, activation="softmax")(h))
        model.compile(optimizer=self.optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy", class_2_share])
        return model

    def dataset(self, split):
        x, y, _ = arrays(split)
        # Class 2 counts ten times as much.
        return tf.data.Dataset.from_tensor_slices(
            (x, y, np.where(y == 2, 10.0, 1.0).astype("float32")))


# --- your own evaluation step -------------------------------------------------------


class TestStepModel(keras.Model):
    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        return _metrics_logs(self, loss, y, y_pred)


class OwnTestStep(_Task):
    def build_model(self):
        model = _regressor(TestStepModel)
        model.compile(optimizer=self.optimizer(), loss="mse", metrics=["mae"])
        return model


# --- the end-to-end GAN ---------------------------------------------------------------


class GANModel(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        # Sample random points in the latent space and decode them to fake images.
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        # Fake is 1, real is 0; a little noise on the labels (an important trick).
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)

        # Train the discriminator.
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        # Train the generator (without updating the discriminator), labels "all real".
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.apply_generator(grads)

        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


    def apply_generator(self, grads):
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))


class EveryOtherGANModel(GANModel):
    """The GAN whose generator trains on even steps only: its apply is in a ``tf.cond``
    on the discriminator's update count, so the applies vary from step to step."""

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile(d_optimizer, g_optimizer, loss_fn)
        # Its slots made here: TensorFlow cannot create a variable inside a tf.cond.
        self.g_optimizer.build(self.generator.trainable_weights)

    def apply_generator(self, grads):
        def apply():
            super(EveryOtherGANModel, self).apply_generator(grads)
            return tf.constant(True)

        # The discriminator's count, read after its update of this step: step + 1.
        return tf.cond(tf.equal(self.d_optimizer.iterations % 2, 1), apply,
                       lambda: tf.constant(False))


def images(split):
    """Planted "images": a bright bar at one of the rows, noise elsewhere (IMAGE x IMAGE x 1)."""
    n = {"train": 2_000, "test": 200}[split]
    rng = np.random.default_rng({"train": 11, "test": 12}[split])
    out = 0.1 * rng.normal(size=(n, IMAGE, IMAGE, 1)).astype("float32")
    rows = rng.integers(0, IMAGE, size=n)
    out[np.arange(n), rows, :, 0] += 1.0
    return out


class Gan:
    model_class = GANModel

    def build_model(self):
        discriminator = keras.Sequential([
            keras.Input((IMAGE, IMAGE, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(16),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Dense(1),
        ], name="discriminator")
        generator = keras.Sequential([
            keras.Input((LATENT,)),
            keras.layers.Dense(16),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Dense(IMAGE * IMAGE),
            keras.layers.Reshape((IMAGE, IMAGE, 1)),
        ], name="generator")
        gan = self.model_class(discriminator=discriminator, generator=generator,
                               latent_dim=LATENT)
        gan.compile(d_optimizer=keras.optimizers.Adam(learning_rate=3e-3),
                    g_optimizer=keras.optimizers.Adam(learning_rate=3e-3),
                    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
        return gan

    def dataset(self, split):
        return tf.data.Dataset.from_tensor_slices(images(split))  # images only


class GanEveryOther(Gan):
    """The GAN that skips its generator's apply on odd steps (``EveryOtherGANModel``)."""

    model_class = EveryOtherGANModel


class GanJit(Gan):
    """The GAN with jit_compile=True (the guide's compile() does not pass it on): fit
    compiles its train_step whole with XLA; multiworker, ps and ps-sync each call of
    its generator and discriminator (tfdist/training/workload/xla_calls.py)."""

    def build_model(self):
        gan = super().build_model()
        gan.jit_compile = True
        return gan


# --- knowledge distillation ------------------------------------------------------------


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            keras.ops.softmax(teacher_pred / self.temperature, axis=1),
            keras.ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature ** 2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def planted_map():
    """The linear map the labels are the argmax of (fit_tasks.arrays)."""
    return np.random.default_rng(0).normal(size=(FEATURES, CLASSES)).astype("float32")


class Distillation(_Task):
    def build_model(self):
        # The teacher knows the planted map (sharpened): a trained teacher, without training.
        teacher = keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(CLASSES, use_bias=False,
                               kernel_initializer=keras.initializers.Constant(3 * planted_map())),
        ], name="teacher")
        student = keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(CLASSES),
        ], name="student")
        distiller = Distiller(student=student, teacher=teacher)
        distiller.compile(optimizer=self.optimizer(),
                          metrics=[keras.metrics.SparseCategoricalAccuracy()],
                          student_loss_fn=keras.losses.SparseCategoricalCrossentropy(
                              from_logits=True),
                          distillation_loss_fn=keras.losses.KLDivergence(),
                          alpha=0.1, temperature=10)
        return distiller

    def dataset(self, split):
        x, y, _ = arrays(split)
        return tf.data.Dataset.from_tensor_slices((x, y))


# --- features only ---------------------------------------------------------------------


class AutoencoderModel(keras.Model):
    """Reconstructs its input through a 4-wide bottleneck: no labels anywhere."""

    def train_step(self, data):
        (x,) = data
        with tf.GradientTape() as tape:
            x_pred = self(x, training=True)
            loss = self.compute_loss(y=x, y_pred=x_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        return _metrics_logs(self, loss, x, x_pred)

    def test_step(self, data):
        (x,) = data
        x_pred = self(x, training=False)
        loss = self.compute_loss(y=x, y_pred=x_pred)
        return _metrics_logs(self, loss, x, x_pred)


class FeaturesOnly(_Task):
    def build_model(self):
        x = keras.Input((FEATURES,), name="x")
        model = AutoencoderModel(x, keras.layers.Dense(FEATURES)(keras.layers.Dense(4)(x)))
        model.compile(optimizer=self.optimizer(), loss="mse", metrics=["mae"])
        return model

    def dataset(self, split):
        x, _, _ = arrays(split)
        return tf.data.Dataset.from_tensor_slices((x,))  # (x,): features alone


FIRST = First()
LOWER_LEVEL = LowerLevel()
SAMPLE_WEIGHTS = SampleWeights()
OWN_TEST_STEP = OwnTestStep()
GAN = Gan()
GAN_JIT = GanJit()
GAN_EVERY_OTHER = GanEveryOther()
DIRECT_UPDATE = DirectUpdate()
DISTILLATION = Distillation()
FEATURES_ONLY = FeaturesOnly()


def plain_fit(task, epochs=2, batch_size=64, seed=0) -> dict:
    """Keras's own ``model.fit`` then ``evaluate``, in this process.

    {"train": the last epoch's training logs (as History has them),
     "test": evaluate's dict, or None where Keras's evaluate raises (the error's line)}.
    """
    keras.utils.set_random_seed(seed)
    model = task.build_model()
    train = task.dataset("train")
    size = int(train.cardinality())
    history = model.fit(train.shuffle(size, seed=seed).batch(batch_size), epochs=epochs,
                        verbose=0)
    out = {"train": {k: v[-1] for k, v in history.history.items()}, "test": None}
    try:
        out["test"] = model.evaluate(task.dataset("test").batch(1000), verbose=0,
                                     return_dict=True)
    except Exception as err:  # pylint: disable=broad-except
        out["test_error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return out


__all__ = ["SIZES"]
