"""One input pipeline for every strategy and every task.

``make_dataset_fn`` returns ``dataset_fn(input_context)``, the form that
``distribute_datasets_from_function`` and the ps coordinator's
``create_per_worker_dataset`` both take. The task gives unbatched
``(features, label)`` examples; everything else (sharding, shuffling with
the run's seed, batching to the per-replica batch, repeating, resuming at
the right batch) happens here, the same for every task.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.training.workload import contract


def _in_memory(source: tf.data.Dataset):
    """Every element of ``source`` as one batch of tensors, read once.

    MNIST's training split is 47 MB as uint8: holding it costs less than
    the per-example tf.data work (decode on every first epoch, a shuffle
    buffer and batching); docs/performance.md has the measurement.
    """
    return source.batch(1 << 30).get_single_element()


# A seed's key: 24 bits, the most RandomIndexShuffle reads of its three words
# on a split of up to 65,536 examples (8 bits each); the epoch moves it by
# EPOCH_STRIDE, odd and near 2**24 / golden ratio, so a run's epochs never repeat
# a key within 2**24 epochs and two seeds' epochs rarely meet.
SEED_BITS = 24
EPOCH_STRIDE = 0x9E3779


def seed_key(seed: int) -> int:
    """The 24-bit key of ``seed``: the seed itself below 2**24; above, its high
    bits folded in (2**32 seeds cannot have 2**24 keys each)."""
    return (seed ^ (seed >> SEED_BITS)) & ((1 << SEED_BITS) - 1)


def _drawn_key() -> tf.Tensor:
    """Three key words drawn from the time the pipeline is built (no seed given).

    That is on each ps worker: the coordinator traces one dataset_fn for all
    of them (each sees input pipeline 0 of 1), and any seed fixed at trace
    time, the global seed's too, would feed every worker the same batches.
    ``RandomIndexShuffle`` reads only the low 8 bits of each key word on a
    split of up to 65,536 examples (its block is 16 bits, a word half of it;
    measured, TF 2.21), so three drawn words make two workers' orders collide
    once in 2**24 pairs, where one word of time did once in 256.
    """
    stamp = tf.bitcast(tf.timestamp(), tf.int64)
    pair = tf.stack([stamp, tf.bitwise.right_shift(stamp, 32)])
    words = tf.random.stateless_uniform([3], seed=pair, minval=None, maxval=None,
                                        dtype=tf.int64)
    return tf.bitwise.bitwise_and(words, 0xFFFFFFFF)


def epoch_keys(seed: int | None, drawn: tf.Tensor | None, epoch: tf.Tensor) -> tf.Tensor:
    """``[len(epoch), 3]`` key words of ``RandomIndexShuffle`` for each element's epoch.

    A seed's 24-bit key plus ``epoch * EPOCH_STRIDE`` (mod 2**24), one byte per
    word: distinct seeds below 2**24 give distinct keys in every epoch (the
    map is a bijection for a fixed epoch), where a seed kept in one word gave
    256 orders. Without a seed, the drawn words plus the epoch in the second.
    """
    if seed is None:
        return tf.stack([tf.fill(tf.shape(epoch), drawn[0]), epoch + drawn[1],
                         tf.fill(tf.shape(epoch), drawn[2])], axis=1)
    mask = (1 << SEED_BITS) - 1
    v = tf.bitwise.bitwise_and(seed_key(seed) + epoch * EPOCH_STRIDE, mask)
    return tf.stack([tf.bitwise.bitwise_and(tf.bitwise.right_shift(v, shift), 0xFF)
                     for shift in (0, 8, 16)], axis=1)


def shuffled(index: tf.Tensor, n, seed: int | None, drawn: tf.Tensor | None = None,
             epoch: tf.Tensor | None = None) -> tf.Tensor:
    """Where each of ``index`` (int64 positions in ``[0, n)``) goes in the epoch's permutation."""
    epoch = tf.zeros_like(index) if epoch is None else epoch
    n = tf.cast(n, tf.int64)
    # The raw op: tf.random.experimental.index_shuffle's wrapper
    # mangles a batch of [n, 3] seeds in TF 2.21.
    return tf.raw_ops.RandomIndexShuffle(
        index=index, seed=epoch_keys(seed, drawn, epoch),
        max_index=tf.fill(tf.shape(index), n - 1), rounds=4)


def build_pipeline(
    source: tf.data.Dataset,
    input_context: tf.distribute.InputContext | None,
    global_batch_size: int,
    *,
    seed: int | None,
    shuffle: bool = True,
    repeat: bool = True,
    map_fn=None,
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
    drawn = _drawn_key() if seed is None else None

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
            index = shuffled(index, n, seed, drawn, epoch=positions // n)
        picked = tf.nest.map_structure(lambda t: tf.gather(t, index), elements)
        if map_fn is None:
            return picked
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


# Examples a streamed (infinite or unknown-size) train split shuffles among.
SHUFFLE_BUFFER = 10_000


def stream_pipeline(source, input_context, global_batch_size: int, *, seed: int | None,
                    first_batch: int = 0) -> tf.data.Dataset:
    """A train split that cannot be held in memory (infinite or of unknown size).

    Sharded, shuffled from a buffer with the run's seed, batched and
    repeated; a resume skips the batches already trained on, which replays
    exactly when the source itself is deterministic.
    """
    batch = global_batch_size
    if input_context is not None:
        batch = input_context.get_per_replica_batch_size(global_batch_size)
        if input_context.num_input_pipelines > 1:
            source = source.shard(input_context.num_input_pipelines,
                                  input_context.input_pipeline_id)
    ds = source.shuffle(SHUFFLE_BUFFER, seed=seed).batch(batch, drop_remainder=True).repeat()
    return ds.skip(first_batch).prefetch(tf.data.AUTOTUNE)


def make_dataset_fn(task, global_batch_size: int, *, seed: int | None, split: str = "train",
                    synthetic: bool = False, start_step: int = 0, in_memory: bool = True):
    """``dataset_fn(input_context)`` for training on the task's ``split``.

    ``seed=None`` shuffles differently in every process (the ps workers).
    ``start_step`` resumes the data where a run of the same seed left it.
    ``in_memory``: the split is finite and held whole (an exact, cheap
    shuffle per epoch); otherwise it is streamed.
    ``synthetic`` repeats the first batch forever: the benchmark uses it to
    show whether input is the bottleneck.
    """

    def dataset_fn(input_context=None):
        # A pipeline feeding several local replicas gives one batch per
        # replica per step.
        per_step = 1
        if input_context is not None:
            per_step = max(1, input_context.num_replicas_in_sync
                           // input_context.num_input_pipelines)
        source = task_split(task, split, train=True)
        if not in_memory:
            return stream_pipeline(source, input_context, global_batch_size, seed=seed,
                                   first_batch=start_step * per_step)
        ds = build_pipeline(source, input_context, global_batch_size, seed=seed,
                            first_batch=start_step * per_step)
        if synthetic:
            return ds.take(1).cache().repeat()
        return ds

    return dataset_fn


def eval_dataset(task, batch_size: int = 1000, split: str = "test") -> tf.data.Dataset:
    """The task's whole test (or validation) split, once, in order; the last batch may be short."""
    return task_split(task, split).batch(batch_size).prefetch(tf.data.AUTOTUNE)


def task_split(task, split: str, train: bool = False) -> tf.data.Dataset:
    """The task's ``split`` as a Dataset of unbatched elements, as ``fit`` takes data.

    NumPy arrays are sliced (``contract.as_dataset``); for training, a task's
    ``class_weight`` becomes each example's sample weight, as ``fit`` applies
    it (to the training data only).
    """
    ds = contract.as_dataset(task.dataset(split), f"dataset({split!r})")
    weights = contract.class_weight_of(task) if train else None
    return contract.class_weights(ds, weights) if weights else ds
