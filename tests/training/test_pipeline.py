"""Input pipeline math: batch sizes, sharding, streamed splits, and the real MNIST tasks."""

import numpy as np
import pytest
import tensorflow as tf

from tfdist.models import BUILTIN_TASKS, MODEL_ALIASES, MODEL_NAMES
from tfdist.training.workload import data
from tfdist.training.workload import tasks


def builtin(name):
    return tasks.load(tasks.parse_spec(name))


def contexts(n):
    return [tf.distribute.InputContext(num_input_pipelines=n, input_pipeline_id=i,
                                       num_replicas_in_sync=n) for i in range(n)]


@pytest.mark.parametrize("pipelines", [1, 2, 3])
def test_shards_cover_every_example_once(pipelines):
    n = 1000
    seen = []
    for ctx in contexts(pipelines):
        ds = data.build_pipeline(tf.data.Dataset.range(n), ctx, 30, seed=1, repeat=False,
                                 map_fn=lambda x: x)
        for batch in ds:
            assert batch.shape[0] <= 30 // pipelines
            seen.extend(batch.numpy().tolist())
    assert sorted(seen) == list(range(n))


def test_training_batches_are_per_replica_and_span_epochs():
    ctx = contexts(4)[1]
    ds = data.build_pipeline(tf.data.Dataset.range(10), ctx, 8, seed=3, map_fn=lambda x: x)
    batches = [b.numpy() for b in ds.take(5)]
    assert all(b.shape == (2,) for b in batches)  # 8 global / 4 replicas
    # Shard 1 of 4 of range(10) is {1, 5, 9}; repeating before batching
    # drops nothing at epoch ends.
    assert sorted(np.concatenate(batches[:3]).tolist()) == [1, 1, 5, 5, 9, 9]


def test_seeded_shuffle_is_reproducible_and_reshuffles_each_epoch():
    def first_epochs(seed):
        ds = data.build_pipeline(tf.data.Dataset.range(50), None, 50, seed=seed, map_fn=lambda x: x)
        return [b.numpy().tolist() for b in ds.take(2)]

    a, b = first_epochs(7), first_epochs(7)
    assert a == b and a[0] != a[1] and sorted(a[0]) == list(range(50))


def test_real_mnist_splits():
    task = builtin("mnist-cnn")
    entry = BUILTIN_TASKS["mnist-cnn"]
    # The sizes the launcher plans with, without TensorFlow, are tfds's own.
    assert int(task.dataset("train").cardinality()) == entry.train_examples == 60_000
    assert int(task.dataset("test").cardinality()) == entry.test_examples == 10_000
    images, labels = next(iter(data.eval_dataset(task, batch_size=100)))
    # uint8 in the data; the model's first layer scales it.
    assert images.shape == (100, 28, 28, 1) and images.dtype == tf.uint8
    counts = np.bincount(
        np.concatenate([l.numpy() for _, l in data.eval_dataset(task, batch_size=1000)]), minlength=10
    )
    # The published MNIST test-set label counts.
    assert counts.tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_dataset_fn_gives_per_replica_batches_of_mnist():
    fn = data.make_dataset_fn(builtin("mnist-cnn"), 64, seed=0)
    images, labels = next(iter(fn(contexts(2)[0])))
    assert images.shape == (32, 28, 28, 1) and labels.shape == (32,)


def test_model_aliases_name_the_builtin_tasks():
    assert [MODEL_ALIASES[n] for n in MODEL_NAMES] == ["mnist-cnn", "mnist-logreg"]
    model = builtin("mnist-logreg").build_model()
    assert model.count_params() == 784 * 10 + 10
    assert model.compiled and model.name == "mnist_logreg"
    assert builtin("mnist-cnn").build_model().count_params() == 225_034


def test_streamed_split_is_sharded_batched_and_resumes_at_its_batch():
    """An infinite train split (given --steps) is streamed, not held in memory."""
    source = tf.data.Dataset.range(1000).repeat()
    whole = [b.numpy().tolist() for b in data.stream_pipeline(source, None, 8, seed=3).take(6)]
    assert all(len(b) == 8 for b in whole)
    resumed = [b.numpy().tolist()
               for b in data.stream_pipeline(source, None, 8, seed=3, first_batch=2).take(4)]
    assert resumed == whole[2:]
    ctx = contexts(2)[1]
    shard = next(iter(data.stream_pipeline(tf.data.Dataset.range(10).repeat(), ctx, 8, seed=1)))
    assert shard.shape == (4,) and all(v % 2 == 1 for v in shard.numpy())


def test_resumed_pipeline_replays_the_same_batches():
    def batches(first_batch, k):
        ds = data.build_pipeline(tf.data.Dataset.range(20), None, 6, seed=5, map_fn=lambda x: x,
                                 first_batch=first_batch)
        return [b.numpy().tolist() for b in ds.take(k)]

    whole = batches(0, 9)  # 54 positions: almost three epochs of 20
    assert batches(4, 5) == whole[4:]
    # Each epoch is a permutation of its own, and every example is in each.
    flat = sum(whole, [])
    assert sorted(flat[:20]) == sorted(flat[20:40]) == list(range(20)) and flat[:20] != flat[20:40]


def test_unseeded_pipelines_differ_per_build():
    """seed=None (ps workers) must not feed two workers the same batches."""
    tf.random.set_seed(1)  # a global seed, as the chief sets one, must not make them equal
    # 40 builds are 780 pairs: with the 256 orders one key word allows, some pair
    # would match in 95 % of runs; with three words drawn, in 0.005 %.
    first = {tuple(next(iter(data.build_pipeline(tf.data.Dataset.range(1000), None, 50,
                                                 seed=None, map_fn=lambda x: x))).numpy())
             for _ in range(40)}
    assert len(first) == 40


def test_a_given_seed_keeps_its_order():
    """A seed's order is the same from run to run: its key, one byte per word."""
    def order(seed):
        ds = data.build_pipeline(tf.data.Dataset.range(1000), None, 1000, seed=seed)
        return next(iter(ds)).numpy()

    assert np.array_equal(order(7), order(7))
    assert not np.array_equal(order(7), order(8))
    # Seed 0x030201's key words are its bytes, low first.
    keys = tf.tile(tf.constant([[1, 2, 3]], tf.int64), [1000, 1])
    expected = tf.raw_ops.RandomIndexShuffle(index=tf.range(1000, dtype=tf.int64), seed=keys,
                                             max_index=tf.fill([1000], tf.constant(999, tf.int64)),
                                             rounds=4)
    assert np.array_equal(order(0x030201), expected.numpy())


def first_positions(seeds, n=60_000, k=6, epoch=0):
    """The first ``k`` positions of each seed's permutation of ``n`` at ``epoch``,
    computed as the pipeline computes them, without building a dataset."""
    index = tf.tile(tf.range(k, dtype=tf.int64), [len(seeds)])
    return [tuple(data.shuffled(index[i * k:(i + 1) * k], n, seed,
                                epoch=tf.fill([k], tf.constant(epoch, tf.int64))).numpy())
            for i, seed in enumerate(seeds)]


def test_a_thousand_seeds_give_a_thousand_orders():
    """RandomIndexShuffle reads 8 bits of each key word on MNIST's 60,000: a seed
    kept in one word gave 256 orders (seeds 256 apart shared one)."""
    firsts = first_positions(range(1000))
    assert len(set(firsts)) == 1000
    assert first_positions([0])[0] != first_positions([256])[0]
    # In a later epoch, too; and a seed's epochs differ from each other.
    assert len(set(first_positions(range(0, 1000, 7), epoch=3))) == len(range(0, 1000, 7))
    assert first_positions([5], epoch=0) != first_positions([5], epoch=1)


def test_seeds_and_epochs_of_a_sweep_never_share_a_key():
    """Seeds 0-999 over their first 1,000 epochs: a million (seed, epoch) pairs, a
    million keys (pure arithmetic of data.epoch_keys)."""
    seeds = np.arange(1000, dtype=np.int64)[:, None]
    epochs = np.arange(1000, dtype=np.int64)[None, :]
    keys = (seeds + epochs * data.EPOCH_STRIDE) & ((1 << data.SEED_BITS) - 1)
    assert len(np.unique(keys)) == 1000 * 1000
    # The pipeline's own words for a few of them.
    words = data.epoch_keys(999, None, tf.constant([0, 999], tf.int64)).numpy()
    for row, epoch in zip(words, (0, 999)):
        v = (999 + epoch * data.EPOCH_STRIDE) % (1 << 24)
        assert row.tolist() == [v & 0xFF, (v >> 8) & 0xFF, v >> 16]
    assert data.seed_key(2**24 - 1) == 2**24 - 1 and data.seed_key(2**32 - 1) != 2**24 - 1


def test_training_pipeline_needs_no_partial_batch_guard():
    """Infinite and statically shaped: a distributed iterator then skips
    get_next_as_optional, which under multiworker costs an all-reduce per step."""
    ds = data.make_dataset_fn(builtin("mnist-cnn"), 64, seed=1)(contexts(2)[0])
    assert ds.cardinality() == tf.data.INFINITE_CARDINALITY
    images, labels = ds.element_spec
    assert images.shape == (32, 28, 28, 1) and labels.shape == (32,)
    dist = tf.distribute.MirroredStrategy().distribute_datasets_from_function(
        data.make_dataset_fn(builtin("mnist-cnn"), 64, seed=1))
    # The private flag the decision ends in (input_lib._enable_get_next_as_optional).
    assert dist._enable_get_next_as_optional is False
