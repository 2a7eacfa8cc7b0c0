"""Peer, written after TensorFlow's tutorials: Keras 3 ``model.fit`` in one process.

As the "Training a neural network on MNIST with Keras" tutorial does it
(tfds pipeline: map, cache, shuffle, batch, prefetch; ``compile``/``fit``),
with the library's CNN and hyperparameters. Compared with ``--strategy none``.

    python tfdist/bench/peers/keras3_fit.py --epochs 3 --steps-per-execution 10 --model-dir runs/peer-k3
"""

import sys

import peer_lib


def main(argv=None) -> int:
    args = peer_lib.parse_args(argv)
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(args.seed)
    ds_train = peer_lib.tfds_train_dataset(args.data_dir, args.global_batch_size, args.seed)
    model = peer_lib.cnn(keras)
    model.compile(**peer_lib.compile_args(keras, args))
    clock = peer_lib.epoch_clock(keras)
    model.fit(ds_train, epochs=args.total_steps // args.chunk, steps_per_epoch=args.chunk,
              callbacks=[clock], verbose=2)
    accuracy = peer_lib.test_accuracy(keras, model, args.data_dir)
    peer_lib.write_results(args, "keras3-fit", keras.__version__ + f" (TF {tf.__version__})",
                           clock, accuracy, workers=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
