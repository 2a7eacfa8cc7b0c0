"""Built-in tasks: the models and data the library ships.

Each is a *task* written against the same public contract as a user's own
(``training.workload.tasks``): ``build_model()`` returns a compiled Keras 3 model and
``dataset(split)`` unbatched ``(features, label)`` examples. No
``tf.distribute`` here: the library calls ``build_model`` inside the
strategy's scope, which is what places the variables.

Importing this package does not import Keras, so flag validation and
``train.py --dry-run`` errors come before TensorFlow's start-up noise.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltinTask:
    """A task the library ships: where it lives, and what is known without TensorFlow."""

    name: str
    target: str  # "module:OBJECT", loaded like a user's ``--task pkg.mod:NAME``
    summary: str
    # Split sizes when they are fixed, so a dry run and the launcher's
    # pre-flight check can plan steps without importing TensorFlow; None
    # when the task's options decide them (the task is then inspected).
    train_examples: int | None = None
    test_examples: int | None = None
    # Whether the task reads a tfds data directory (--data-dir).
    reads_tfds: bool = False
    # Whether --optimizer, --learning-rate and --lr-schedule (with their
    # defaults) replace the compiled optimizer, or only when given.
    flags_set_optimizer: bool = True
    # Its default batch per replica; None: the library's (--global-batch-size
    # overrides either).
    per_replica_batch: int | None = None


BUILTIN_TASKS = {
    "mnist-cnn": BuiltinTask(
        "mnist-cnn", "tfdist.models.mnist:CNN",
        "MNIST, two conv blocks and a dense head (~99 % in 2-3 epochs)",
        train_examples=60_000, test_examples=10_000, reads_tfds=True),
    "mnist-logreg": BuiltinTask(
        "mnist-logreg", "tfdist.models.mnist:LOGREG",
        "MNIST, 784 -> 10 softmax regression (the classic parameter-server example)",
        train_examples=60_000, test_examples=10_000, reads_tfds=True),
    "mnist-mlp": BuiltinTask(
        "mnist-mlp", "tfdist.models.mnist:MLP",
        "MNIST, a deep MLP (four ~200k-parameter Dense layers): a chain for --strategy pipeline",
        train_examples=60_000, test_examples=10_000, reads_tfds=True),
    "dense-chain": BuiltinTask(
        "dense-chain", "tfdist.models.dense_chain:TASK",
        "synthetic, 4 x Dense(2048) over 256 features (13 M parameters): a compute-heavy "
        "chain for --strategy pipeline",
        # Its compiled Adam(1e-3), not the flags' 5e-3 with cosine decay: at
        # 5e-3 the wide ReLU chain stayed at the class prior (test accuracy
        # 0.3783) through 150 steps at batch 256, one process and pipeline
        # alike; at 1e-3 it reached 0.650 in 60.
        flags_set_optimizer=False),
    "wide-mlp": BuiltinTask(
        "wide-mlp", "tfdist.models.wide_mlp:TASK",
        "MNIST, 784 -> 64 -> 400k -> 64 -> 10 (51 M parameters, 0.8 GB of Adam training "
        "state): the memory study of --shard-state",
        train_examples=60_000, test_examples=10_000, reads_tfds=True),
    "ctr": BuiltinTask(
        "ctr", "tfdist.models.ctr:TASK",
        "click-through prediction: a 2M x 16 embedding table over hashed categorical features "
        "(synthetic, planted logistic model; AUC and its ceiling)",
        # Click logs train on large batches: each row is seen rarely, and a
        # step's cost is the rows it touches, not the batch. Measured here, one
        # process, 600 steps: batch 64 ended 0.014 short of the AUC ceiling,
        # 256 ended 0.006 short.
        flags_set_optimizer=False, per_replica_batch=256),
}

# ``--model cnn|logreg`` predates tasks; scripts and docs still use it.
MODEL_ALIASES = {"cnn": "mnist-cnn", "logreg": "mnist-logreg"}
MODEL_NAMES = tuple(MODEL_ALIASES)
DEFAULT_TASK = "mnist-cnn"

__all__ = ["BUILTIN_TASKS", "BuiltinTask", "DEFAULT_TASK", "MODEL_ALIASES", "MODEL_NAMES"]
