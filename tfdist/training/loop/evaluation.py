"""The task's compiled loss and metrics on its whole test split, and the weights' fingerprint."""

from __future__ import annotations

import hashlib
import math

import keras
import numpy as np

from tfdist.training.workload import data


def local_copy(model: keras.Model, local: keras.Model) -> keras.Model:
    """``local`` (a model built outside any strategy) holding ``model``'s current weights.

    Evaluation, hashing and saving use it: it reads distributed or ps-hosted
    variables once, and Keras 3 cannot predict or save through a
    ParameterServerStrategy-scoped model.
    """
    from tfdist.training.sharding import full_weights

    local.set_weights(full_weights(model))
    return local


class Evaluator:
    """The compiled loss and every compiled metric over the whole test split, once.

    Keras's own ``evaluate`` on the local copy: metrics accumulate over every
    example (a short last batch counts exactly) and the loss is weighted by
    batch size. The split is cached after the first pass, and the traced
    test function is reused.
    """

    def __init__(self, task, local: keras.Model, batch_size: int = 1000, split: str = "test"):
        self.local = local
        self.dataset = data.eval_dataset(task, batch_size, split).cache()

    def __call__(self, model: keras.Model) -> dict[str, float]:
        """{"loss": ..., metric: ...} of ``model``'s current weights."""
        local_copy(model, self.local)
        out = self.local.evaluate(self.dataset, verbose=0, return_dict=True)
        return {name: float(value) for name, value in out.items()}


def split_metrics(values: dict[str, float]) -> tuple[float, dict[str, float]]:
    """(test loss, {metric: value}) from an evaluation's dict."""
    metrics = {k: v for k, v in values.items() if k != "loss"}
    return values.get("loss", math.nan), metrics


def weights_sha256(model: keras.Model) -> str:
    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(np.ascontiguousarray(w).tobytes())
    return digest.hexdigest()
