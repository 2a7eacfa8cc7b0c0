"""A parameter-server cluster member for the sharding tests (not the library's trainer).

``serve JOB INDEX SPEC``: a tf.distribute.Server (ps or worker), which ends
once the chief stops answering. ``chief SPEC MODEL_DIR STEPS [restore]``:
builds the ctr task (small) with its table split over the ps tasks, trains
STEPS steps through the ClusterCoordinator (GradientTape + the model's
optimizer), saves a checkpoint (and the full table as .npy) and prints one
``RESULT {json}`` line.
"""

import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CTR_OPTIONS = {"rows": "40000", "features": "8", "train_size": "20000", "test_size": "2000"}


def serve(job, index, spec):
    import tensorflow as tf

    tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job, task_index=index,
                         protocol="grpc", start=True)
    print("SERVING", flush=True)
    host, port = spec["chief"][0].rsplit(":", 1)
    seen, deadline = False, time.monotonic() + 120
    while True:
        time.sleep(0.3)
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                seen = True
        except OSError:
            if seen or time.monotonic() > deadline:
                os._exit(0)


def chief(spec, model_dir, steps, restore):
    import numpy as np
    import tensorflow as tf
    import keras

    from tfdist.models import ctr
    from tfdist.training import sharding

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    task = ctr.CtrTask()
    task.configure(**CTR_OPTIONS)
    policy = sharding.ShardingPolicy("min-size", num_shards=len(spec["ps"]), min_bytes=1 << 20)
    with strategy.scope():
        with sharding.sharding_scope(policy):
            model = task.build_model()
        optimizer = model.optimizer
        optimizer.build(model.trainable_variables)
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                  aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    sparse = sharding.sparse_updates(optimizer)
    checkpoint = tf.train.Checkpoint(**sharding.checkpoint_objects(model, optimizer),
                                     global_step=global_step)
    table = model.get_layer("table")
    out = {"sparse_updates": sparse, "shards": [list(s.shape) for s in table.shards],
           "shard_devices": [s.value.device for s in table.shards],
           "ps_variable_bytes": sharding.ps_variable_bytes(model.weights, optimizer.variables)}
    if restore:
        checkpoint.restore(tf.train.latest_checkpoint(model_dir)).assert_existing_objects_matched()
        saved = np.load(os.path.join(model_dir, "table.npy"))
        out["restored_step"] = int(global_step.numpy())
        out["restored_table_equal"] = bool(np.array_equal(table.embeddings.numpy(), saved))

    def dataset_fn(context):
        return task.dataset("train").shuffle(1000, seed=context.input_pipeline_id).batch(
            64).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(dataset_fn)))
    grad_types = {}

    def step_fn(ids, labels):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.binary_crossentropy(
                labels, model(ids, training=True), from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        grad_types.update({v.path: type(g).__name__ for v, g in zip(model.trainable_variables, grads)})
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train(it):
        loss = strategy.run(step_fn, args=next(it))
        global_step.assign_add(1)
        return loss

    losses = [coordinator.schedule(train, args=(iterator,)) for _ in range(steps)]
    coordinator.join()
    out["final_loss"] = float(losses[-1].fetch())
    out["global_step"] = int(global_step.numpy())
    out["grad_types"] = grad_types
    np.save(os.path.join(model_dir, "table.npy"), table.embeddings.numpy())
    checkpoint.save(os.path.join(model_dir, "ckpt"))
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # servers cannot be shut down cleanly; the peers end on their own


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
    else:
        chief(json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]), len(sys.argv) > 5)
