"""One MNIST input pipeline for every strategy.

``make_dataset_fn`` returns ``dataset_fn(input_context)``, the form that
``distribute_datasets_from_function`` and the ps coordinator's
``create_per_worker_dataset`` both take.
"""

from __future__ import annotations

import os

import tensorflow as tf

from strategies.tf_config import ConfigError


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
    for split in SPLITS:
        check_split(builder, split)


# Both splits are checked before training: the test split is otherwise read
# only after the whole run, and a damaged one would lose it.
SPLITS = ("train", "test")
# A TFRecord frames each record with a length, its CRC and the data's CRC.
_RECORD_FRAMING = 16


def check_split(builder, split: str) -> None:
    """Raise ConfigError if ``split``'s files are truncated or corrupt.

    Sizes against tfds's metadata first (catches truncation at no cost), then
    every record's checksums and the record count, read without decoding:
    about 0.2 s for MNIST. TensorFlow's record reader is used directly, not
    a tf.data op, because an op would start the eager runtime, and
    MultiWorkerMirroredStrategy must configure it before it starts.
    """
    from tensorflow.python.lib.io import tf_record
    from tensorflow.python.util import deprecation

    info = builder.info.splits[split]
    paths = [str(p) for p in info.filepaths]
    where = os.path.dirname(paths[0]) if paths else str(builder.data_dir)
    fix = ("prepare MNIST again (delete that directory; tfds downloads it when online) or "
           "point --data-dir (or TFDS_DATA_DIR) at a good copy")
    try:
        size = sum(os.path.getsize(p) for p in paths)
    except OSError as err:
        raise ConfigError(f"MNIST's {split} split in {where!r} is incomplete "
                          f"({err.strerror}: {os.path.basename(err.filename or '')}); {fix}") from None
    expected = int(info.num_bytes) + _RECORD_FRAMING * info.num_examples
    if size != expected:
        raise ConfigError(
            f"MNIST's {split} split in {where!r} is damaged: its files hold {size} bytes, "
            f"tfds's metadata says {expected} (truncated or replaced); {fix}"
        )
    count = 0
    for path in paths:
        try:
            with deprecation.silence():  # tf.compat.v1's reader: the same C++ iterator, no runtime
                for _ in tf_record.tf_record_iterator(path):
                    count += 1
        except Exception as err:  # DataLossError for a bad checksum, OSError, ...
            raise ConfigError(
                f"MNIST's {split} split in {where!r} is damaged: {os.path.basename(path)}: "
                f"{_clip(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)}"
                f"; {fix}"
            ) from None
    if count != info.num_examples:
        raise ConfigError(
            f"MNIST's {split} split in {where!r} is damaged: {count} records, tfds's metadata "
            f"says {info.num_examples}; {fix}"
        )


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def preprocess(image, label):
    return tf.cast(image, tf.float32) / 255.0, label


def _in_memory(source: tf.data.Dataset):
    """Every element of ``source`` as one batch of tensors, read once.

    MNIST's training split is 47 MB as uint8: holding it costs less than
    the per-example tf.data work (decode on every first epoch, a shuffle
    buffer and batching); docs/performance.md has the measurement.
    """
    return source.batch(1 << 30).get_single_element()


def _seed_tensor(seed: int | None) -> tf.Tensor:
    if seed is not None:
        return tf.constant(seed, tf.int64)
    # Evaluated where the pipeline is built, i.e. on each ps worker: the
    # coordinator traces one dataset_fn for all of them (each sees input
    # pipeline 0 of 1), and any seed fixed at trace time, the global seed's
    # too, would feed every worker the same batches.
    return tf.bitcast(tf.timestamp(), tf.int64)


def build_pipeline(
    source: tf.data.Dataset,
    input_context: tf.distribute.InputContext | None,
    global_batch_size: int,
    *,
    seed: int | None,
    shuffle: bool = True,
    repeat: bool = True,
    map_fn=preprocess,
    first_batch: int = 0,
) -> tf.data.Dataset:
    """Shard ``source``, hold it in memory, and serve shuffled batches.

    Sharding comes first, so no example is in two input pipelines. With
    ``repeat`` the batches run across epoch boundaries (nothing is dropped)
    and batch ``k`` covers positions ``k*B .. k*B+B-1`` of an endless
    sequence of epochs, each epoch a stateless permutation of the shard
    keyed by ``(seed, epoch)``: the order is reproducible, and a resumed
    run starts at ``first_batch`` and sees exactly the batches it would
    have seen. Every op works on whole batches, none per example.
    """
    batch = global_batch_size
    if input_context is not None:
        batch = input_context.get_per_replica_batch_size(global_batch_size)
        if input_context.num_input_pipelines > 1:
            source = source.shard(
                input_context.num_input_pipelines, input_context.input_pipeline_id
            )
    elements = _in_memory(source)
    n = tf.shape(tf.nest.flatten(elements)[0], out_type=tf.int64)[0]
    seed_t = _seed_tensor(seed)

    b = tf.constant(batch, tf.int64)

    def batch_at(k):
        start = k * b
        if repeat:
            # A Python-int length gives the batch a static shape.
            positions = start + tf.range(batch, dtype=tf.int64)
        else:
            positions = tf.range(start, tf.minimum(start + b, n))
        index = positions % n
        if shuffle:
            epoch = positions // n
            keys = tf.stack([tf.fill(tf.shape(epoch), seed_t), epoch, tf.zeros_like(epoch)],
                            axis=1)
            # The raw op: tf.random.experimental.index_shuffle's wrapper
            # mangles a batch of [n, 3] seeds in TF 2.21.
            index = tf.raw_ops.RandomIndexShuffle(
                index=index, seed=keys, max_index=tf.fill(tf.shape(index), n - 1), rounds=4
            )
        picked = tf.nest.map_structure(lambda t: tf.gather(t, index), elements)
        return map_fn(*picked) if isinstance(picked, tuple) else map_fn(picked)

    # Batch numbers: endless with ``repeat``, else one pass with a short last batch.
    # Endless must be *infinite* cardinality (``counter``, not a huge range)
    # and the batches statically shaped: otherwise a distributed iterator
    # guards every step against a partial last batch (get_next_as_optional),
    # which under MultiWorkerMirroredStrategy is one more all-reduce per step
    # (docs/performance.md).
    ks = (tf.data.Dataset.counter(first_batch) if repeat
          else tf.data.Dataset.range((n + b - 1) // b))
    ds = ks.map(batch_at, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)


def make_dataset_fn(
    global_batch_size: int,
    *,
    seed: int | None,
    data_dir: str | None,
    split: str = "train",
    synthetic: bool = False,
    start_step: int = 0,
):
    """``dataset_fn(input_context)`` for training on ``split``.

    ``seed=None`` shuffles differently in every process (the ps workers).
    ``start_step`` resumes the data where a run of the same seed left it.
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
        # A pipeline feeding several local replicas gives one batch per
        # replica per step.
        per_step = 1
        if input_context is not None:
            per_step = max(1, input_context.num_replicas_in_sync
                           // input_context.num_input_pipelines)
        return build_pipeline(
            load_split(split, data_dir), input_context, global_batch_size, seed=seed,
            first_batch=start_step * per_step,
        )

    return dataset_fn


def eval_dataset(data_dir: str | None, batch_size: int = 1000) -> tf.data.Dataset:
    """The whole test split, once, in order."""
    return build_pipeline(
        load_split("test", data_dir), None, batch_size, seed=0, shuffle=False, repeat=False
    )
