"""Peer: Ray Train's own ``TensorflowTrainer`` (Ray 2.60.0), for the side-by-side with
``--engine ray`` in docs/deployment.md.

The TF multi-worker tutorial (``tf_keras_multiworker.py``'s model, data and
hyperparameters, from ``peer_lib``) as Ray Train runs it: ``TensorflowTrainer``
with ``--workers`` workers, each given a worker-only ``TF_CONFIG`` by Ray
(``ray/train/tensorflow/config.py``), ``model.fit`` under
``MultiWorkerMirroredStrategy``. ``--keras keras3``: Keras 3's ``fit`` there
(keras-team/keras#20585, ray-project/ray#47464: expected to fail; the one line
is printed); ``--keras tf_keras``: Keras 2 (``tf_keras``, as Ray's CI pins it).
Worker 0 writes ``peer_results.json`` in ``--model-dir`` (examples/s after the
first epoch, test accuracy). Needs ``pip install 'ray[train]==2.60.0'`` (not in
any extra: CI does not run it). On a running Ray cluster (``--address``), beside

    tfdist-launch --engine ray --address ADDR --strategy multiworker --workers 2 \\
        -- --model cnn --steps 300 --steps-per-execution 10 --model-dir runs/lib

    python tfdist/bench/peers/ray_tensorflow_trainer.py --address ADDR --keras tf_keras \\
        --steps 300 --steps-per-execution 10 --model-dir runs/ray-train
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker: the tutorial's ``fit`` under MWMS, on Ray's TF_CONFIG."""
    sys.path.insert(0, config["peers_dir"])
    import peer_lib

    args = argparse.Namespace(**config["args"])
    if config["keras"] == "tf_keras":
        import tf_keras as keras
    else:
        import keras
    peer_lib.tutorial_fit(keras, args, f"ray-TensorflowTrainer-{config['keras']}")


def one_line(err: BaseException) -> str:
    """The worker's own error in Ray's report, on one line (a PerReplica's contents elided)."""
    import re

    text = " ".join(str(err).split())
    found = re.findall(r"\b(\w+Error: .*?)(?= \w+Error: |\[Rank |$)", text)
    line = next((f for f in found if not f.startswith(("WorkerGroupError", "TrainingFailedError"))),
                found[-1] if found else f"{type(err).__name__}: {text}")
    return re.sub(r"\(PerReplica:\{.*?\}\)", "(PerReplica:{...})", line)[:300]


def main(argv=None) -> int:
    sys.path.insert(0, HERE)
    import peer_lib

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default=None, help="a running Ray cluster (else a local one)")
    p.add_argument("--keras", choices=("keras3", "tf_keras"), required=True)
    p.add_argument("--workers", type=int, default=2)
    own, rest = p.parse_known_args(argv)
    args = peer_lib.parse_args(rest)
    args.model_dir = os.path.abspath(args.model_dir)
    args.data_dir = args.data_dir or os.environ.get("TFDS_DATA_DIR")

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    env = {k: os.environ[k] for k in ("TFDS_DATA_DIR", "TF_CPP_MIN_LOG_LEVEL") if k in os.environ}
    ray.init(address=own.address, runtime_env={"env_vars": env}, log_to_driver=True)
    trainer = TensorflowTrainer(
        train_loop_per_worker,
        train_loop_config={"args": vars(args), "keras": own.keras, "peers_dir": HERE},
        scaling_config=ScalingConfig(num_workers=own.workers, use_gpu=False),
        run_config=RunConfig(storage_path=os.path.join(args.model_dir, "ray_train"),
                             name="tutorial"))
    try:
        trainer.fit()
    except Exception as err:  # noqa: BLE001 - the peer reports what Ray Train raised, in one line
        print(f"PEER FAILED {own.keras}: {one_line(err)}", flush=True)
        return 1
    finally:
        ray.shutdown()
    with open(os.path.join(args.model_dir, peer_lib.RESULTS_FILE)) as f:
        print("PEER RESULT " + f.read().replace("\n", " "), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
