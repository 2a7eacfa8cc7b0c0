"""Train the MNIST model under any tf.distribute strategy.

Each process runs this same program; ``TF_CONFIG`` says which task it is.

    # one process, no distribution strategy at all (the benchmark's baseline):
    python train.py --strategy=none --epochs 1 --model-dir runs/none

    # one process, every local GPU (CPU when none):
    python train.py --strategy=mirrored --epochs 1 --model-dir runs/mirrored

    # synchronous all-reduce, one process per worker (TF_CONFIG differs per process):
    TF_CONFIG='{"cluster": {"worker": ["host1:2222", "host2:2222"]},
                "task": {"type": "worker", "index": 0}}' \
        python train.py --strategy=multiworker --epochs 1 --model-dir /shared/runs/mw

    # asynchronous parameter servers: run on chief, every worker and every ps:
    TF_CONFIG='{"cluster": {"chief": ["host1:2222"], "worker": ["host1:2223", "host2:2222"],
                "ps": ["host2:2223"]}, "task": {"type": "chief", "index": 0}}' \
        python train.py --strategy=ps --epochs 1 --model-dir /shared/runs/ps

    # check a TF_CONFIG without starting anything:
    python train.py --strategy=auto --dry-run

    # the cluster from a Slurm job step instead of TF_CONFIG (one task per srun rank):
    srun python train.py --cluster-resolver=slurm --slurm-ps 1 --strategy=ps --model-dir /shared/runs/ps

``launch.py`` starts a whole simulated cluster on one host with these commands.
Bad input ends with one ``error:`` line on stderr and exit code 2; a lost
peer task with one ``error:`` line and exit code 75 (relaunch to resume); a
preemption (SIGTERM) with a checkpoint at an agreed step and exit code 42.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from strategies import (
    CLUSTER_RESOLVERS, ClusterConfig, ConfigError, check_batch_size, cluster_from_environ,
    replicas_per_step, resolve_strategy_name,
)
from strategies.devices import plan_devices
from training.config import TrainConfig

EXIT_BAD_INPUT = 2
# Kept in step with training.recovery, which TensorFlow-free code cannot import.
EXIT_PREEMPTED = 42
EXIT_TASK_LOST = 75


def _role_action(strategy: str, cfg: ClusterConfig) -> tuple[str, str]:
    role = "local" if cfg.is_local else cfg.task_type
    if role == "evaluator":
        return role, "not used by train.py: evaluation runs on the chief after training"
    if strategy == "ps":
        return role, {
            "chief": "coordinate: hold no data, schedule training steps on the workers, "
                     "checkpoint, evaluate and write results",
            "worker": "serve: run the training steps the chief schedules",
            "ps": "serve: hold the model variables (CPU only)",
        }[role]
    if strategy == "multiworker":
        duty = "write checkpoints, logs and results" if cfg.is_chief else "keep checkpoints private"
        return role, f"train on its data shard with all-reduce every step; {duty}"
    return role, "train on all local devices; write checkpoints, logs and results"


def _physical_gpus() -> list[str]:
    import tensorflow as tf

    return [d.name for d in tf.config.list_physical_devices("GPU")]


def plan(config: TrainConfig, gpus: list[str] | None = None) -> dict:
    """Validate everything that can be checked without a server; describe the run.

    TensorFlow is imported only to list GPUs (when ``gpus`` is None), after
    every check that does not need it.
    """
    config.validate()
    cfg = config.cluster
    strategy = resolve_strategy_name(config.strategy, cfg)
    if gpus is None:
        gpus = _physical_gpus()
    devices = plan_devices(strategy, cfg, gpus)
    replicas = replicas_per_step(strategy, cfg, len(devices["visible_gpus"]))
    check_batch_size(config.global_batch_size, replicas)
    role, action = _role_action(strategy, cfg)
    return {
        "strategy": strategy,
        "requested_strategy": config.strategy,
        "task": cfg.task_name,
        "role": role,
        "is_chief": cfg.is_chief,
        "action": action,
        "cluster": cfg.cluster_dict(),
        "num_workers": cfg.num_workers,
        "num_ps": cfg.num_ps,
        "replicas_in_sync": replicas,
        "global_batch_size": config.global_batch_size,
        "per_replica_batch_size": config.global_batch_size // replicas,
        "total_steps": config.total_steps,
        "devices": {**devices, "cpu": True},
        "model_dir": config.model_dir,
    }


def run(config: TrainConfig) -> dict | None:
    """Run this task's part of the job; the chief returns the results dict.

    Raises ConfigError for bad input before anything is written.
    """
    the_plan = plan(config)
    if config.dry_run:
        print(json.dumps(the_plan, indent=None, sort_keys=True), flush=True)
        return None
    cfg, strategy = config.cluster, the_plan["strategy"]
    if strategy == "ps":
        # TensorFlow's ps guide: fail RPCs to a lost task at once instead of
        # retrying, so the coordinator can reschedule the closure elsewhere.
        os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")

    from strategies.devices import configure_devices
    from training import data

    if the_plan["role"] in ("chief", "local") or (
        strategy == "multiworker" and the_plan["role"] == "worker"
    ):
        data.ensure_available(config.data_dir)  # one clear line if MNIST is missing
    configure_devices(strategy, cfg)
    if the_plan["role"] == "evaluator":
        print(f"{cfg.task_name}: {the_plan['action']}; exiting", flush=True)
        return None
    if strategy == "ps" and the_plan["role"] in ("ps", "worker"):
        from strategies.server import serve

        serve(cfg, startup_timeout=config.startup_timeout)
        return None

    from strategies import make_strategy
    from strategies.server import StartupWatchdog

    watchdog = StartupWatchdog(
        cfg, config.startup_timeout, "connect to every task and run the first step"
    )
    bundle = make_strategy(
        strategy, cfg, all_reduce=config.all_reduce, ps_shards=config.ps_shards
    )
    if cfg.is_chief:
        os.makedirs(config.model_dir, exist_ok=True)
    if strategy == "ps":
        from training.ps_runner import run_ps

        return run_ps(config, bundle, the_plan["replicas_in_sync"], watchdog.done)
    from training.runners import run_sync

    return run_sync(config, bundle, the_plan["replicas_in_sync"], watchdog.done)


class _ArgumentError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse whose errors take our one-line error path (exit 2)."""

    def error(self, message):
        raise _ArgumentError(f"{message}; see --help")


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="TF_CONFIG (environment) describes the cluster and this task; with "
               "--cluster-resolver=slurm, the Slurm job step does.",
    )
    d = TrainConfig()
    p.add_argument("--strategy", default=d.strategy, help="auto|none|mirrored|multiworker|ps (none: no distribution, the baseline)")
    p.add_argument("--model", default=d.model, help="cnn|logreg")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--steps", type=int, default=None, help="total steps; overrides --epochs")
    p.add_argument("--global-batch-size", type=int, default=d.global_batch_size)
    p.add_argument("--optimizer", default=d.optimizer, help="adam|sgd")
    p.add_argument("--learning-rate", type=float, default=None,
                   help="peak rate; default 0.005 for adam, 0.1 for sgd")
    p.add_argument("--lr-schedule", default=d.lr_schedule,
                   help="cosine (decay to 0 over the run, default) | constant")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--model-dir", default=d.model_dir)
    p.add_argument("--data-dir", default=None,
                   help="tfds data dir holding mnist (default: TFDS_DATA_DIR, else tfds's own)")
    p.add_argument("--steps-per-execution", type=int, default=d.steps_per_execution)
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between progress lines")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="steps between test-accuracy evaluations on the chief (0: at the end only); "
                        "their time is left out of examples/s")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="steps between checkpoints (default: epoch ends only; the end always)")
    p.add_argument("--all-reduce", default=d.all_reduce, help="auto|ring|nccl (multiworker)")
    p.add_argument("--ps-shards", type=int, default=d.ps_shards,
                   help="split large variables over up to this many ps tasks")
    p.add_argument("--startup-timeout", type=float, default=d.startup_timeout,
                   help="seconds to wait for the other tasks before giving up")
    p.add_argument("--synthetic-data", action="store_true",
                   help="train on one in-memory random batch (input-pipeline benchmark)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved plan as JSON and exit without starting anything")
    p.add_argument("--cluster-resolver", default="tf_config",
                   help=f"where the cluster comes from: {'|'.join(CLUSTER_RESOLVERS)} (default tf_config)")
    p.add_argument("--slurm-ps", type=int, default=None,
                   help="slurm: rank 0 is the chief, the next N ranks are ps tasks, the rest "
                        "workers (default 0: every rank is a worker)")
    p.add_argument("--slurm-port", type=int, default=None,
                   help="slurm: first port on each node; a node's tasks take consecutive ports "
                        "(default 2222)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        if args.data_dir is None:
            # tfds would read it too; resolved here so the config says where data comes from.
            args.data_dir = os.environ.get("TFDS_DATA_DIR") or None
        options = vars(args)
        cluster = cluster_from_environ(
            options.pop("cluster_resolver"), os.environ,
            slurm_ps=options.pop("slurm_ps"), slurm_port=options.pop("slurm_port"),
        )
        config = TrainConfig(cluster=cluster, **options)
        run(config)
    except (ConfigError, _ArgumentError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as err:
        code = _fault_exit(err)
        if code is None:
            raise
        return code
    return 0


def _fault_exit(err: Exception) -> int | None:
    """The exit code and line for a survived fault; None for anything else."""
    from training.recovery import Preempted, TaskLost

    if isinstance(err, TaskLost):
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_TASK_LOST
    if isinstance(err, Preempted):
        print(f"preempted: checkpoint saved at step {err.step}; exiting with code "
              f"{EXIT_PREEMPTED} so the job is relaunched and resumes there", flush=True)
        return EXIT_PREEMPTED
    return None


if __name__ == "__main__":
    code = main()
    # Interpreter teardown can block on gRPC channels to tasks that are gone,
    # and a multiworker chief's coordination service waits at exit for the
    # heartbeat timeout of a worker that has already left ("tasks are
    # unhealthy": 40-100 s per run, seen in the benchmark). Everything worth
    # keeping is on disk by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
