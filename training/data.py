"""One MNIST input pipeline for every strategy.

``make_dataset_fn`` returns ``dataset_fn(input_context)``, the form that
``distribute_datasets_from_function`` and the ps coordinator's
``create_per_worker_dataset`` both take.
"""

from __future__ import annotations

import os

import tensorflow as tf

from strategies.tf_config import ConfigError

TRAIN_EXAMPLES = 60_000
TEST_EXAMPLES = 10_000
SHUFFLE_BUFFER = 10_000


def load_split(split: str, data_dir: str | None) -> tf.data.Dataset:
    """MNIST ``split`` as (uint8 image, int64 label) pairs, or a clear error."""
    import tensorflow_datasets as tfds

    try:
        return tfds.load(
            "mnist", split=split, data_dir=data_dir, as_supervised=True,
            shuffle_files=False,
        )
    except Exception as err:  # tfds raises many kinds when offline or missing
        where = data_dir or os.path.join("~", "tensorflow_datasets")
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"MNIST could not be loaded from {where!r} or downloaded ({_clip(first)}); "
            "point --data-dir (or TFDS_DATA_DIR) at a prepared tfds copy that holds mnist/3.0.1"
        ) from None


def ensure_available(data_dir: str | None) -> None:
    """Make sure MNIST is prepared (downloading it when online), or raise.

    Uses only the tfds builder, which starts no TensorFlow runtime, so it can
    run before the strategy is created.
    """
    import tensorflow_datasets as tfds

    where = data_dir or os.path.join("~", "tensorflow_datasets")
    try:
        builder = tfds.builder("mnist", data_dir=data_dir)
        if not builder.is_prepared():
            if data_dir is not None:
                # A directory the user chose should already hold the data;
                # downloading into it offline only retries for minutes.
                raise FileNotFoundError(f"no prepared mnist/{builder.version} there")
            builder.download_and_prepare()
    except Exception as err:  # offline download failures come in many types
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"MNIST could not be loaded from {where!r} ({_clip(first)}); "
            "point --data-dir (or TFDS_DATA_DIR) at a prepared tfds copy that holds mnist/3.0.1"
        ) from None


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def preprocess(image, label):
    return tf.cast(image, tf.float32) / 255.0, label


def build_pipeline(
    source: tf.data.Dataset,
    input_context: tf.distribute.InputContext | None,
    global_batch_size: int,
    *,
    seed: int | None,
    shuffle: bool = True,
    repeat: bool = True,
    map_fn=preprocess,
) -> tf.data.Dataset:
    """Shard, cache, shuffle, repeat, batch and prefetch ``source``.

    Sharding comes first, so each input pipeline caches only its own slice and
    no example is in two slices. Repeating before batching means batches run
    across epoch boundaries, so ``drop_remainder`` never drops an example.
    """
    batch = global_batch_size
    if input_context is not None:
        batch = input_context.get_per_replica_batch_size(global_batch_size)
        if input_context.num_input_pipelines > 1:
            source = source.shard(
                input_context.num_input_pipelines, input_context.input_pipeline_id
            )
    ds = source.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE).cache()
    if shuffle:
        if seed is not None:
            pipeline = 0 if input_context is None else input_context.input_pipeline_id
            seed += pipeline
        ds = ds.shuffle(SHUFFLE_BUFFER, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    ds = ds.batch(batch, drop_remainder=repeat)
    return ds.prefetch(tf.data.AUTOTUNE)


def make_dataset_fn(
    global_batch_size: int,
    *,
    seed: int | None,
    data_dir: str | None,
    split: str = "train",
    synthetic: bool = False,
):
    """``dataset_fn(input_context)`` for training on ``split``.

    ``seed=None`` shuffles differently in every process: the ps coordinator
    sends one traced ``dataset_fn`` to all workers (each sees input pipeline 0
    of 1), so a fixed seed would feed every worker the same batches.
    ``synthetic`` replaces MNIST with one in-memory random batch, repeated:
    the benchmark uses it to show whether input is the bottleneck.
    """
    if synthetic:
        def dataset_fn(input_context=None):
            batch = global_batch_size
            if input_context is not None:
                batch = input_context.get_per_replica_batch_size(global_batch_size)
            rng = tf.random.Generator.from_seed(seed or 0)
            images = rng.uniform((batch, 28, 28, 1))
            labels = rng.uniform((batch,), 0, 10, dtype=tf.int64)
            return tf.data.Dataset.from_tensors((images, labels)).repeat()
        return dataset_fn

    # Fail in the caller, with the one-line error, not inside a traced function.
    load_split(split, data_dir)

    def dataset_fn(input_context=None):
        return build_pipeline(
            load_split(split, data_dir), input_context, global_batch_size, seed=seed
        )

    return dataset_fn


def eval_dataset(data_dir: str | None, batch_size: int = 1000) -> tf.data.Dataset:
    """The whole test split, once, in order."""
    return build_pipeline(
        load_split("test", data_dir), None, batch_size, seed=0, shuffle=False, repeat=False
    )
