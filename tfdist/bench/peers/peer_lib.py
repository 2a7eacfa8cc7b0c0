"""What the tutorial peers share: their flags, MNIST, the clock and the record.

The peers are written after TensorFlow's tutorials, not after this
library: they are what a user would run instead of it. This module holds
only what every peer needs so that its figures compare with the library's:
train.py's flags (the benchmark passes the same ones), MNIST from the same
tfds copy, steady-state examples/s with start-up left out, and a small
``peer_results.json``, which ``bench.py`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import time

STARTED = time.perf_counter()
RESULTS_FILE = "peer_results.json"
TRAIN_EXAMPLES = 60_000


def parse_args(argv=None) -> argparse.Namespace:
    """train.py's flags that define the work; any other flag is accepted and ignored."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--strategy", default=None)  # the launcher passes it; each peer has one
    p.add_argument("--model", default="cnn")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--global-batch-size", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--steps-per-execution", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--model-dir", default="runs/peer")
    args, _ = p.parse_known_args(argv)
    if args.model != "cnn":
        p.error(f"the peers train the CNN only, received --model {args.model}")
    steps_per_epoch = max(1, TRAIN_EXAMPLES // args.global_batch_size)
    args.total_steps = args.steps or args.epochs * steps_per_epoch
    args.requested_steps_per_execution = args.steps_per_execution
    args.chunk, args.steps_per_execution = chunk_size(args.total_steps, args.eval_every,
                                                      args.steps_per_execution)
    return args


def chunk_size(total_steps: int, eval_every: int, steps_per_execution: int) -> tuple[int, int]:
    """Steps per Keras "epoch" (``steps_per_epoch``) and steps per call; pure.

    ``model.fit`` under ParameterServerStrategy only waits for its workers at
    an epoch end, so epoch ends are the one clock every peer reads
    truthfully; the first epoch (tracing, connecting) is start-up. An epoch
    is a divisor of the run near ``eval_every`` (else a sixth of the run),
    at least two epochs, within a factor of two of that where it can be.
    The steps per call are the largest divisor of the epoch not above the
    ones asked for (the epoch is chosen to keep them largest), so every
    call is whole and both Keras run exactly the steps asked for: Keras 3
    would run a whole call past an epoch's end (more steps than counted),
    tf_keras would add a short call at each epoch's end.
    """
    target = eval_every if eval_every > 0 else max(1, total_steps // 6)
    sizes = [d for d in range(1, total_steps + 1)
             if total_steps % d == 0 and total_steps // d >= 2] or [total_steps]

    def calls(size: int) -> int:
        return max(k for k in range(1, min(steps_per_execution, size) + 1) if size % k == 0)

    def rank(size: int):
        near = target / 2 <= size <= 2 * target
        return (not near, -calls(size), abs(size - target), size)

    chunk = min(sizes, key=rank)
    return chunk, calls(chunk)


def load_arrays(split: str, data_dir: str | None):
    """MNIST ``split`` as numpy (images uint8 [n, 28, 28, 1], labels int64)."""
    import tensorflow_datasets as tfds

    images, labels = tfds.as_numpy(tfds.load("mnist", split=split, batch_size=-1,
                                             as_supervised=True, data_dir=data_dir))
    return images, labels


def normalize_img(image, label):
    import tensorflow as tf

    return tf.cast(image, tf.float32) / 255.0, label


def tfds_examples(data_dir):
    """MNIST's training examples, scaled to [0, 1] and cached after the first pass."""
    import tensorflow as tf
    import tensorflow_datasets as tfds

    ds = tfds.load("mnist", split="train", as_supervised=True, data_dir=data_dir)
    return ds.map(normalize_img, num_parallel_calls=tf.data.AUTOTUNE).cache()


def tfds_train_dataset(data_dir, batch_size: int, seed: int | None):
    """The tfds Keras tutorial's pipeline, repeated: map, cache, shuffle, batch, prefetch."""
    import tensorflow as tf

    ds = tfds_examples(data_dir).shuffle(TRAIN_EXAMPLES, seed=seed).repeat().batch(batch_size)
    return ds.prefetch(tf.data.AUTOTUNE)


def epoch_clock(keras):
    """A Keras callback that notes the time at each epoch end."""

    class EpochClock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends: list[float] = []

        def on_epoch_end(self, epoch, logs=None):
            self.ends.append(time.perf_counter())

    return EpochClock()


def figures(ends: list[float], chunk: int, batch: int, started: float = STARTED) -> dict:
    """Start-up (to the first epoch end) and steady examples/s after it; pure."""
    if len(ends) < 2:
        raise ValueError("steady-state throughput needs at least two epochs")
    steady = (len(ends) - 1) * chunk
    seconds = ends[-1] - ends[0]
    return {"startup_seconds": round(ends[0] - started, 3), "train_seconds": round(seconds, 3),
            "steady_steps": steady, "examples_per_sec": steady * batch / seconds}


def cnn(keras):
    """models/mnist.py's CNN, layer for layer, in whichever Keras is passed."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        layers.Conv2D(32, 3, activation="relu"),
        layers.MaxPooling2D(),
        layers.Conv2D(64, 3, activation="relu"),
        layers.MaxPooling2D(),
        layers.Flatten(),
        layers.Dense(128, activation="relu"),
        layers.Dense(10),
    ], name="cnn")


def compile_args(keras, args) -> dict:
    """The library's optimizer and loss: Adam, cosine decay to 0 over the run, logits."""
    schedule = keras.optimizers.schedules.CosineDecay(args.learning_rate, args.total_steps)
    return {"optimizer": keras.optimizers.Adam(schedule),
            "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "metrics": ["accuracy"], "steps_per_execution": args.steps_per_execution}


def test_accuracy(keras, model, data_dir) -> float:
    """Test accuracy of a local copy of ``model`` (no strategy, no collective)."""
    images, labels = load_arrays("test", data_dir)
    local = cnn(keras)
    local.set_weights(model.get_weights())
    logits = local.predict(images.astype("float32") / 255.0, batch_size=1000, verbose=0)
    return float((logits.argmax(axis=-1) == labels).mean())


def write_results(args, peer: str, keras_version: str, clock, accuracy: float,
                  workers: int) -> dict:
    record = {"peer": peer, "keras_version": keras_version, "num_workers": workers,
              "global_batch_size": args.global_batch_size, "total_steps": args.total_steps,
              "steps_per_execution": args.steps_per_execution, "steps_per_epoch": args.chunk,
              "requested_steps_per_execution": args.requested_steps_per_execution,
              "test_accuracy": accuracy,
              "wall_seconds": round(time.perf_counter() - STARTED, 3),
              **figures(clock.ends, args.chunk, args.global_batch_size)}
    os.makedirs(args.model_dir, exist_ok=True)
    path = os.path.join(args.model_dir, RESULTS_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)
    print("PEER " + json.dumps(record, sort_keys=True), flush=True)
    return record


def tutorial_fit(keras, args, peer: str) -> None:
    """The multi-worker tutorial's ``model.fit`` under ``MultiWorkerMirroredStrategy`` on
    this process's ``TF_CONFIG``; its worker 0 (the tutorial's chief) writes the record.
    Shared by the launcher's peer and Ray Train's, so both time the same program."""
    import tensorflow as tf

    tf_config = json.loads(os.environ["TF_CONFIG"])
    is_chief = tf_config["task"]["index"] == 0
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras.utils.set_random_seed(args.seed)
    # The tutorial's global batch is the per-worker batch times the workers;
    # here the library's global batch, split the same way by the strategy.
    dataset = tfds_train_dataset(args.data_dir, args.global_batch_size, args.seed)
    # The tutorial's "Dataset sharding" section: MNIST's train split is one
    # file, so shard by data, not by file.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)
    with strategy.scope():
        model = cnn(keras)
        model.compile(**compile_args(keras, args))
    clock = epoch_clock(keras)
    model.fit(dataset, epochs=args.total_steps // args.chunk, steps_per_epoch=args.chunk,
              callbacks=[clock], verbose=2 if is_chief else 0)
    if is_chief:
        accuracy = test_accuracy(keras, model, args.data_dir)
        write_results(args, peer, keras.__version__ + f" (TF {tf.__version__})", clock, accuracy,
                      workers=len(tf_config["cluster"]["worker"]))
