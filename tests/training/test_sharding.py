"""training.sharding: split Embedding/Dense variables, resharding checkpoints, sparse updates."""

import json
import sys

import numpy as np
import pytest

from conftest import REPO, child_env
from tfdist.launcher.plan import free_ports
from tfdist.training import sharding

PROGRAM = REPO / "tests" / "training" / "sharded_ps_program.py"


# -- pure -----------------------------------------------------------------
def test_split_rows_is_the_div_layout():
    assert sharding.split_rows(10, 3) == [4, 3, 3]
    assert sharding.split_rows(9, 3) == [3, 3, 3]
    assert sharding.split_rows(5, 1) == [5]


def test_policy_selects_by_size():
    big, small = (1 << 18, 1), (10, 1)  # 1 MiB and 40 bytes of float32
    assert sharding.ShardingPolicy("min-size", 2).selects(big, 4)
    assert not sharding.ShardingPolicy("min-size", 2).selects(small, 4)
    assert sharding.ShardingPolicy("fixed", 2).selects(small, 4)
    assert not sharding.ShardingPolicy("none", 2).selects(big, 4)


@pytest.mark.parametrize("kwargs", [dict(partitioner="auto"), dict(num_shards=0),
                                    dict(min_bytes=-1)])
def test_bad_policy_is_one_clear_error(kwargs):
    with pytest.raises(sharding.ShardingError) as err:
        sharding.ShardingPolicy(**kwargs)
    assert "\n" not in str(err.value)


# -- one process ----------------------------------------------------------
def _model(num_shards, partitioner="fixed", rows=101, optimizer="adam"):
    import keras

    keras.utils.set_random_seed(1)
    with sharding.sharding_scope(sharding.ShardingPolicy(partitioner, num_shards)):
        ids = keras.Input((4,), dtype="int32")
        x = keras.layers.Flatten()(keras.layers.Embedding(rows, 8, name="table")(ids))
        x = keras.layers.Dense(6, activation="relu", name="hidden")(x)
        model = keras.Model(ids, keras.layers.Dense(1, name="out")(x))
    model.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
    return model


def test_layers_split_and_compute_what_the_whole_layer_would():
    import tensorflow as tf

    model = _model(3)
    table, hidden = model.get_layer("table"), model.get_layer("hidden")
    assert [tuple(s.shape) for s in table.shards] == [(34, 8), (34, 8), (33, 8)]
    assert [tuple(s.shape) for s in hidden.shards] == [(11, 6), (11, 6), (10, 6)]
    ids = tf.constant(np.random.RandomState(0).randint(0, 101, (16, 4)), tf.int32)
    full = table.embeddings.numpy()
    np.testing.assert_array_equal(table(ids).numpy(), full[ids.numpy()])
    x = tf.random.normal((5, 32))
    want = np.maximum(x.numpy() @ hidden.kernel.numpy() + hidden.bias.numpy(), 0)
    np.testing.assert_allclose(hidden(x).numpy(), want, rtol=1e-5, atol=1e-5)


def test_table_gradients_are_row_sparse_per_shard():
    import tensorflow as tf

    model = _model(2)
    ids = tf.constant([[0, 1, 2, 100]], tf.int32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(ids))
    grads = dict(zip([v.path for v in model.trainable_variables],
                     tape.gradient(loss, model.trainable_variables)))
    g0, g1 = grads["table/embeddings__shard0"], grads["table/embeddings__shard1"]
    assert isinstance(g0, tf.IndexedSlices) and isinstance(g1, tf.IndexedSlices)
    # Rows 0-50 on shard 0, 51-100 on shard 1 (local index 49).
    assert sorted(g0.indices.numpy().tolist()) == [0, 1, 2]
    assert g1.indices.numpy().tolist() == [49]


def test_small_layers_stay_whole_under_min_size():
    model = _model(2, partitioner="min-size")
    assert sharding.sharded_layers(model) == []
    assert sharding.checkpoint_objects(model, model.optimizer).keys() == {"model", "optimizer"}


def test_more_shards_than_rows_is_refused():
    with pytest.raises(sharding.ShardingError, match="fewer than the 3 shards"):
        _model(3, rows=2)


def test_checkpoint_reshards_model_and_optimizer_slots(tmp_path):
    import tensorflow as tf

    model = _model(3)
    ids = tf.constant(np.random.RandomState(0).randint(0, 101, (32, 4)), tf.int32)
    model.train_on_batch(ids, np.ones((32, 1), np.float32))
    opt = model.optimizer

    def slots(m):
        o = m.optimizer
        return np.concatenate([o._momentums[o._get_variable_index(s)].numpy()
                               for s in m.get_layer("table").shards])

    saved_table, saved_slots = model.get_layer("table").embeddings.numpy(), slots(model)
    assert np.abs(saved_slots).sum() > 0
    path = tf.train.Checkpoint(**sharding.checkpoint_objects(model, opt)).save(
        str(tmp_path / "ckpt"))
    stored = dict(tf.train.list_variables(path))
    assert stored["model_variables/0_embeddings/.ATTRIBUTES/VARIABLE_VALUE"] == [101, 8]
    for shards in (2, 1, 4):
        other = _model(shards)
        tf.train.Checkpoint(**sharding.checkpoint_objects(other, other.optimizer)).restore(
            path).assert_existing_objects_matched()
        assert len(other.get_layer("table").shards) == shards
        np.testing.assert_array_equal(other.get_layer("table").embeddings.numpy(), saved_table)
        np.testing.assert_array_equal(slots(other), saved_slots)
        np.testing.assert_array_equal(other.get_layer("hidden").kernel.numpy(),
                                      model.get_layer("hidden").kernel.numpy())


@pytest.mark.parametrize("duplicates", [False, True])
def test_sparse_adagrad_is_keras_adagrad_on_the_dense_gradient(duplicates):
    import keras
    import tensorflow as tf

    results = {}
    for mode in ("dense", "sparse"):
        var = keras.Variable(np.random.RandomState(0).normal(size=(50, 4)).astype("float32"))
        opt = keras.optimizers.Adagrad(0.3)
        opt.build([var])
        if mode == "sparse":
            assert sharding.sparse_updates(opt) == "adagrad"

        @tf.function
        def step(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(tf.gather(var.value, ids) - 1.0))
            grad = tape.gradient(loss, var)
            if mode == "dense":
                grad = tf.convert_to_tensor(grad)  # the reference: Adagrad's definition
            opt.apply_gradients([(grad, var)])

        for i in range(10):
            rng = np.random.RandomState(i)
            step(tf.constant(rng.randint(0, 50, 30) if duplicates else rng.permutation(50)[:30]))
        results[mode] = var.numpy()
    np.testing.assert_allclose(results["sparse"], results["dense"], rtol=1e-6, atol=1e-6)


def test_sparse_updates_says_what_it_did():
    import keras

    assert sharding.sparse_updates(keras.optimizers.SGD(0.1)) == "sgd"
    assert sharding.sparse_updates(keras.optimizers.SGD(0.1, momentum=0.9)) == "dense"
    assert sharding.sparse_updates(keras.optimizers.Adam()) == "dense"


def test_ps_variable_bytes_counts_each_variable_once():
    model = _model(2)
    weights = model.weights
    total = sum(int(np.prod(v.shape)) * 4 for v in weights)
    assert sum(sharding.ps_variable_bytes(weights, weights).values()) == total


# -- a real cluster ---------------------------------------------------------
def _cluster(spawn, num_ps, workers=2):
    ports = free_ports(1 + workers + num_ps)
    spec = {"chief": [f"127.0.0.1:{ports[0]}"],
            "worker": [f"127.0.0.1:{p}" for p in ports[1:1 + workers]],
            "ps": [f"127.0.0.1:{p}" for p in ports[1 + workers:]]}
    env = child_env(CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    servers = [spawn([sys.executable, str(PROGRAM), "serve", job, str(i), json.dumps(spec)], env)
               for job in ("ps", "worker") for i in range(len(spec[job]))]
    for s in servers:
        s.wait_for_line(r"^SERVING", timeout=90)
    return spec, env, servers


def _run_chief(spawn, num_ps, model_dir, steps, restore=False):
    spec, env, servers = _cluster(spawn, num_ps)
    cmd = [sys.executable, str(PROGRAM), "chief", json.dumps(spec), str(model_dir), str(steps)]
    chief = spawn(cmd + (["restore"] if restore else []), env)
    line = chief.wait_for_line(r"^RESULT ", timeout=240)
    assert chief.wait(timeout=60) == 0, chief.output[-3000:]
    for s in servers:  # each server ends once the chief is gone
        assert s.wait(timeout=60) == 0, s.output[-2000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.multiprocess
def test_ps_cluster_trains_a_split_table_and_resumes_on_3_and_1_ps(spawn, tmp_path):
    first = _run_chief(spawn, 2, tmp_path, steps=30)
    # 40,000 x 16 float32 table (2.56 MB) and its Adagrad accumulator, split in two.
    assert first["shards"] == [[20000, 16], [20000, 16]]
    assert sorted(d.split("/")[3] for d in first["shard_devices"]) == ["task:0", "task:1"]
    byts = first["ps_variable_bytes"]
    assert set(byts) == {"ps:0", "ps:1"}
    for b in byts.values():
        assert 0.3 <= b / sum(byts.values()) <= 0.7, byts
    assert first["sparse_updates"] == "adagrad"
    assert first["grad_types"]["table/embeddings__shard0"] == "IndexedSlices"
    assert first["grad_types"]["table/embeddings__shard1"] == "IndexedSlices"
    assert first["global_step"] == 30 and np.isfinite(first["final_loss"])

    three = _run_chief(spawn, 3, tmp_path, steps=10, restore=True)
    assert three["shards"] == [[13334, 16], [13333, 16], [13333, 16]]
    assert three["restored_step"] == 30 and three["restored_table_equal"]
    assert three["global_step"] == 40

    one = _run_chief(spawn, 1, tmp_path, steps=10, restore=True)
    assert one["shards"] == [[40000, 16]]
    assert one["restored_step"] == 40 and one["restored_table_equal"]
    assert one["global_step"] == 50


def test_shards_keep_the_whole_kernels_initial_statistics():
    import keras

    with sharding.sharding_scope(sharding.ShardingPolicy("fixed", 4)):
        dense = keras.layers.Dense(100)
        dense.build((None, 4000))
        seeded = keras.layers.Embedding(10, 3, embeddings_initializer=keras.initializers.RandomUniform(seed=3))
        seeded.build()
    assert len(dense.shards) == 4
    # Glorot uniform over the full 4000 x 100 kernel: limit sqrt(6 / 4100), std limit / sqrt(3).
    limit = np.sqrt(6 / 4100)
    kernel = dense.kernel.numpy()
    assert np.abs(kernel).max() <= limit
    assert kernel.std() == pytest.approx(limit / np.sqrt(3), rel=0.02)
    # A fixed seed is offset per shard, or all shards would start equal.
    assert not np.array_equal(seeded.shards[0].numpy(), seeded.shards[1].numpy())


def test_set_full_weights_is_the_inverse_of_full_weights():
    """A callback's weights on the unsplit copy reach the split model (training.loop.callbacks)."""
    model = _model(3)
    whole = [w + 1.0 for w in sharding.full_weights(model)]
    sharding.set_full_weights(model, whole)
    got = sharding.full_weights(model)
    assert len(got) == len(whole)
    for a, b in zip(got, whole):
        np.testing.assert_array_equal(a, b)
    assert len(model.weights) > len(whole)  # shards were there to assign row by row
