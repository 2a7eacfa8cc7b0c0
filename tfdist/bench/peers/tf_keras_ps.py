"""Peer, written after TensorFlow's "Parameter server training" tutorial.

Keras 2 (``tf_keras``, with ``TF_USE_LEGACY_KERAS=1`` before TensorFlow is
imported) ``model.fit`` with ``steps_per_execution`` under
``ParameterServerStrategy``: the chief is the coordinator
(``ClusterCoordinator``, implicit in ``model.fit``) and builds the input
with a ``DatasetCreator``; workers and ps tasks only run a
``tf.distribute.Server``. The library's CNN and hyperparameters. Started by
the library's launcher, on the same simulated cluster:

    python launch.py --strategy ps --workers 2 --ps 1 --program bench/peers/tf_keras_ps.py \\
        -- --epochs 3 --steps-per-execution 10 --model-dir runs/peer-ps
"""

import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported
# The tutorial: a lost worker's RPCs fail at once, so its closures move on.
os.environ["GRPC_FAIL_FAST"] = "use_caller"

import peer_lib  # noqa: E402


def main(argv=None) -> int:
    args = peer_lib.parse_args(argv)
    import tensorflow as tf
    import tf_keras as keras

    cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if cluster_resolver.task_type in ("worker", "ps"):
        server = tf.distribute.Server(
            cluster_resolver.cluster_spec(), job_name=cluster_resolver.task_type,
            task_index=cluster_resolver.task_id, protocol=cluster_resolver.rpc_layer or "grpc",
            start=True)
        server.join()  # until the launcher stops it, as in the tutorial
        return 0

    num_ps = cluster_resolver.cluster_spec().num_tasks("ps")
    num_workers = cluster_resolver.cluster_spec().num_tasks("worker")
    variable_partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=(256 << 10), max_shards=num_ps)
    strategy = tf.distribute.ParameterServerStrategy(
        cluster_resolver, variable_partitioner=variable_partitioner)

    keras.utils.set_random_seed(args.seed)

    def dataset_fn(input_context):
        # The tutorial's dataset_fn, on MNIST: runs on each worker.
        batch_size = input_context.get_per_replica_batch_size(args.global_batch_size)
        dataset = peer_lib.tfds_examples(args.data_dir).shuffle(peer_lib.TRAIN_EXAMPLES).repeat()
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        dataset = dataset.batch(batch_size)
        return dataset.prefetch(2)

    dc = keras.utils.experimental.DatasetCreator(dataset_fn)
    with strategy.scope():
        model = peer_lib.cnn(keras)
        model.compile(**peer_lib.compile_args(keras, args))
    clock = peer_lib.epoch_clock(keras)
    model.fit(dc, epochs=args.total_steps // args.chunk, steps_per_epoch=args.chunk,
              callbacks=[clock], verbose=2)
    accuracy = peer_lib.test_accuracy(keras, model, args.data_dir)
    peer_lib.write_results(args, "tf_keras-ps-fit", keras.__version__ + f" (TF {tf.__version__})",
                           clock, accuracy, workers=num_workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
