"""Test accuracy of the training weights, and the weights' fingerprint."""

from __future__ import annotations

import hashlib

import keras
import numpy as np
import tensorflow as tf

from models import build_model


def local_copy(model: keras.Model, model_name: str) -> keras.Model:
    """A non-distributed copy of ``model``'s current weights.

    Evaluation, hashing and saving use this copy: it reads distributed or
    ps-hosted variables once, and Keras 3 cannot predict or save through a
    ParameterServerStrategy-scoped model.
    """
    copy = build_model(model_name)
    copy.set_weights([np.asarray(w) for w in model.get_weights()])
    return copy


def evaluate(model: keras.Model, dataset: tf.data.Dataset) -> tuple[float, float]:
    """(accuracy, mean loss) of a local model over ``dataset``."""
    return make_evaluator(model)(dataset)


def make_evaluator(model: keras.Model):
    @tf.function
    def batch_stats(images, labels):
        logits = model(images, training=False)
        loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        correct = tf.cast(tf.equal(tf.argmax(logits, axis=-1), labels), tf.float64)
        return tf.reduce_sum(tf.cast(loss, tf.float64)), tf.reduce_sum(correct)

    def run(dataset) -> tuple[float, float]:
        total_loss = total_correct = count = 0.0
        for images, labels in dataset:
            loss, correct = batch_stats(images, labels)
            total_loss += float(loss)
            total_correct += float(correct)
            count += int(labels.shape[0])
        return total_correct / count, total_loss / count

    return run


class PeriodicEval:
    """Test accuracy of the training weights, during training, on the chief.

    One local model and one traced function are reused, so each evaluation
    costs a weight copy and a pass over the test split, no retracing.
    """

    def __init__(self, model_name: str, dataset: tf.data.Dataset):
        self.local = build_model(model_name)
        self.dataset = dataset.cache()
        self.run = make_evaluator(self.local)

    def __call__(self, model: keras.Model) -> tuple[float, float]:
        self.local.set_weights([np.asarray(w) for w in model.get_weights()])
        return self.run(self.dataset)


def weights_sha256(model: keras.Model) -> str:
    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(np.ascontiguousarray(w).tobytes())
    return digest.hexdigest()
