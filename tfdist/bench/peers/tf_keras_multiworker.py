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
    import tf_keras as keras

    peer_lib.tutorial_fit(keras, peer_lib.parse_args(argv), "tf_keras-multiworker-fit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
