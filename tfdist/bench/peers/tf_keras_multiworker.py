"""Peer, written after TensorFlow's "Multi-worker training with Keras" tutorial.

Keras 2 (``tf_keras``, with ``TF_USE_LEGACY_KERAS=1`` before TensorFlow is
imported) ``model.fit`` under ``MultiWorkerMirroredStrategy``, every worker
running this program with its own ``TF_CONFIG``; the library's CNN and
hyperparameters (the same steps per call as the library gets). Started by
the library's launcher, on the same simulated cluster:

    python launch.py --strategy multiworker --workers 2 --program bench/peers/tf_keras_multiworker.py \\
        -- --epochs 3 --steps-per-execution 10 --model-dir runs/peer-mw
"""

import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported

import peer_lib  # noqa: E402


def main(argv=None) -> int:
    args = peer_lib.parse_args(argv)
    import json

    import tensorflow as tf
    import tf_keras as keras

    tf_config = json.loads(os.environ["TF_CONFIG"])
    num_workers = len(tf_config["cluster"]["worker"])
    is_chief = tf_config["task"]["index"] == 0  # the tutorial's chief: worker 0
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    keras.utils.set_random_seed(args.seed)
    # The tutorial's global batch is the per-worker batch times the workers;
    # here the library's global batch, split the same way by the strategy.
    multi_worker_dataset = peer_lib.tfds_train_dataset(args.data_dir, args.global_batch_size,
                                                       args.seed)
    # The tutorial's "Dataset sharding" section: MNIST's train split is one
    # file, so shard by data, not by file.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    multi_worker_dataset = multi_worker_dataset.with_options(options)
    with strategy.scope():
        multi_worker_model = peer_lib.cnn(keras)
        multi_worker_model.compile(**peer_lib.compile_args(keras, args))
    clock = peer_lib.epoch_clock(keras)
    multi_worker_model.fit(multi_worker_dataset, epochs=args.total_steps // args.chunk,
                           steps_per_epoch=args.chunk, callbacks=[clock],
                           verbose=2 if is_chief else 0)
    if is_chief:
        accuracy = peer_lib.test_accuracy(keras, multi_worker_model, args.data_dir)
        peer_lib.write_results(args, "tf_keras-multiworker-fit",
                               keras.__version__ + f" (TF {tf.__version__})", clock, accuracy,
                               workers=num_workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
