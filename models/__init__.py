"""Models shared by every strategy.

Importing this package does not import Keras, so flag validation and
``train.py --dry-run`` errors come before TensorFlow's start-up noise.
"""

MODEL_NAMES = ("cnn", "logreg")


def build_model(name: str):
    """The Keras model called ``name`` (see ``models.mnist``); outputs logits."""
    from models.mnist import build_model as build

    return build(name)


__all__ = ["MODEL_NAMES", "build_model"]
