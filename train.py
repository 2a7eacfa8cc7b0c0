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
preemption (SIGTERM) with a checkpoint at an agreed step and exit code 42; a
NaN or infinite loss with one ``error:`` line and exit code 65, the last good
checkpoint kept. The chief holds ``<model-dir>/.lock`` while it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import protocol
from protocol import Exit
from strategies import CLUSTER_RESOLVERS, ConfigError, check_batch_size, cluster_from_environ, kinds
from strategies.devices import plan_devices
from training.config import PER_REPLICA_BATCH, TrainConfig, check_model_dir


def _physical_gpus() -> list[str]:
    import tensorflow as tf

    return [d.name for d in tf.config.list_physical_devices("GPU")]


def default_global_batch(config: TrainConfig, gpus: list[str] | None = None) -> int:
    """TensorFlow's convention when no ``--global-batch-size`` is given.

    ``PER_REPLICA_BATCH`` examples per replica in sync (per gradient, times
    the K gradients of one update, under ps-sync), so any cluster shape
    splits evenly. ``config`` is checked first, with a placeholder batch,
    so bad flags are refused before TensorFlow is imported to list GPUs.
    """
    config = dataclasses.replace(
        config, global_batch_size=PER_REPLICA_BATCH * max(1, config.gradients_per_update))
    config.validate()
    cfg = config.cluster
    kind = kinds.resolve(config.strategy, cfg)
    if gpus is None:
        gpus = _physical_gpus() if kind.role(cfg) in kind.gpu_roles() else []
    return PER_REPLICA_BATCH * replicas_in_sync(kind, cfg, gpus)[1] * config.gradients_per_update


def replicas_in_sync(kind, cfg, gpus: list[str]) -> tuple[dict, int]:
    """This task's device plan, and the replicas one step of the job runs on."""
    devices = plan_devices(kind.gpu_roles(), cfg, gpus)
    return devices, kind.replicas(cfg, len(devices["visible_gpus"]))


def plan(config: TrainConfig, gpus: list[str] | None = None) -> dict:
    """Validate everything that can be checked without a server; describe the run.

    TensorFlow is imported only to list GPUs (when ``gpus`` is None), after
    every check that does not need it.
    """
    config.validate()
    cfg = config.cluster
    kind = kinds.resolve(config.strategy, cfg)
    config.schedule()  # refuses impossible cadences before anything starts
    if cfg.is_chief:
        # The chief writes there; an unusable path fails now, not after TF starts.
        check_model_dir(config.model_dir)
    if kind.role(cfg) != "evaluator" and not kind.serves(cfg):
        from training.checkpoints import check_run_record

        # A resume with other defining flags is refused by --dry-run too.
        check_run_record(config.model_dir, config.defining_flags(kind.name))
    if gpus is None:
        gpus = _physical_gpus()
    devices, replicas = replicas_in_sync(kind, cfg, gpus)
    check_batch_size(config.global_batch_size, replicas)
    return {
        "strategy": kind.name,
        "requested_strategy": config.strategy,
        "task": cfg.task_name,
        "role": kind.role(cfg),
        "is_chief": cfg.is_chief,
        "action": kind.duty(cfg),
        "cluster": cfg.cluster_dict(),
        "num_workers": cfg.num_workers,
        "num_ps": cfg.num_ps,
        "replicas_in_sync": replicas,
        "global_batch_size": config.global_batch_size,
        "per_replica_batch_size": config.global_batch_size // replicas,
        "gradients_per_update": config.gradients_per_update,
        "total_steps": config.total_steps,
        "devices": {**devices, "cpu": True},
        "model_dir": config.model_dir,
    }


def run(config: TrainConfig, as_command: bool = False, batch_note: str | None = None) -> dict | None:
    """Run this task's part of the job; the chief returns the results dict.

    Raises ConfigError for bad input before anything is written.
    ``as_command``: the process ends right after (``python train.py``).
    ``batch_note``: how a default global batch was chosen, printed once the
    checks have passed.
    """
    if config.dry_run:
        print(json.dumps(plan(config), indent=None, sort_keys=True), flush=True)
        return None
    cfg = config.cluster
    # Everything that can be checked without TensorFlow first (its import
    # takes seconds): the plan without this host's GPUs (it reads the run
    # directory's record) and this task's port. None of them writes anything.
    kind = kinds.get(plan(config, gpus=[])["strategy"])
    evaluator = kind.role(cfg) == "evaluator"
    if not cfg.is_local and not evaluator:
        check_own_port(cfg)
    the_plan = plan(config)
    if batch_note:
        print(batch_note, flush=True)
    for name, value in kind.process_env().items():
        os.environ.setdefault(name, value)

    from strategies.devices import configure_devices
    from training import data
    from training.checkpoints import RunLock

    if kind.reads_data(cfg):
        # One clear line if MNIST is missing, truncated or corrupt (both splits).
        data.ensure_available(config.data_dir)
    configure_devices(kind.gpu_roles(), cfg)
    if evaluator:
        print(f"{cfg.task_name}: {the_plan['action']}; exiting", flush=True)
        return None
    if kind.serves(cfg):
        from strategies.server import serve

        serve(cfg, startup_timeout=config.startup_timeout)
        return None

    from strategies.server import StartupWatchdog
    from training.controller import train_and_evaluate

    lock = None
    if cfg.is_chief:
        # The first thing written: a second job on this directory stops here.
        os.makedirs(config.model_dir, exist_ok=True)
        lock = RunLock(config.model_dir)
    try:
        watchdog = StartupWatchdog(
            cfg, config.startup_timeout, "connect to every task and run the first step"
        )
        bundle = kind.build(cfg, all_reduce=config.all_reduce)
        return train_and_evaluate(config, bundle, the_plan["replicas_in_sync"], watchdog.done,
                                  as_command=as_command)
    finally:
        if lock is not None:
            lock.release()


def check_own_port(cfg) -> None:
    """Refuse to start when this task's port is already taken on this host.

    TensorFlow's server listens on every interface, so a port held on any of
    them (by a second task started with the same TF_CONFIG, or anything
    else) fails it with a traceback that names no port. The probe binds the
    wildcard addresses as gRPC does (SO_REUSEADDR: a port in TIME_WAIT after
    a relaunch is free) and lets go at once.
    """
    import errno
    import socket

    port = int(cfg.address.rpartition(":")[2])
    probes = [(socket.AF_INET, "")]
    if socket.has_ipv6:
        probes.append((socket.AF_INET6, "::"))
    for family, wildcard in probes:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no such address family on this host
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((wildcard, port))
                sock.listen(1)
            except OSError as err:
                if err.errno == errno.EADDRNOTAVAIL:
                    continue  # IPv6 switched off: gRPC will not use it either
                why = ("already in use on this host (by another task started with the same "
                       "TF_CONFIG, or another program)" if err.errno == errno.EADDRINUSE
                       else f"not available ({err.strerror})")
                raise ConfigError(
                    f"{cfg.task_name} cannot listen on port {port} (its TF_CONFIG address "
                    f"{cfg.address}): the port is {why}; give every task its own TF_CONFIG "
                    "task and port, or free the port"
                ) from None


def parse_args(argv=None) -> argparse.Namespace:
    from models import MODEL_NAMES
    from strategies.kinds import ALL_REDUCE
    from training.config import LR_SCHEDULES, OPTIMIZERS

    p = protocol.OneLineParser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=protocol.HelpFormatter,
        epilog="TF_CONFIG (environment) describes the cluster and this task; with "
               "--cluster-resolver=slurm, the Slurm job step does. " + protocol.exit_epilog(),
    )
    d = TrainConfig()
    cluster = p.add_argument_group("cluster")
    cluster.add_argument(
        "--strategy", default=d.strategy, choices=kinds.names(),
        help="; ".join(f"{name}: {kind.summary}" for name, kind in kinds.all_kinds().items())
        + "; auto: ps with ps tasks, multiworker with several workers, else mirrored")
    cluster.add_argument("--cluster-resolver", default="tf_config", choices=CLUSTER_RESOLVERS,
                         help="where this task learns the cluster")
    cluster.add_argument("--all-reduce", default=d.all_reduce, choices=ALL_REDUCE,
                         help="multiworker's collective implementation")
    cluster.add_argument("--startup-timeout", type=float, default=d.startup_timeout,
                         help="seconds to wait for the other tasks before giving up")
    cluster.add_argument("--replicas-to-aggregate", type=int, default=d.replicas_to_aggregate,
                         help="ps-sync: gradients averaged into one update (unset: the number of "
                              "workers; fewer makes the N - K slowest backups whose late gradients "
                              "are dropped)")
    train = p.add_argument_group("training")
    train.add_argument("--model", default=d.model, choices=MODEL_NAMES, help="the Keras model")
    train.add_argument("--epochs", type=int, default=d.epochs, help="passes over MNIST's 60,000 examples")
    train.add_argument("--steps", type=int, default=None, help="total steps; overrides --epochs")
    train.add_argument("--global-batch-size", type=int, default=None,
                       help="examples behind one update, split over the replicas in sync "
                            f"(default: {PER_REPLICA_BATCH} per replica x the replicas in sync, "
                            "TensorFlow's convention; ps-sync: per gradient x K)")
    train.add_argument("--optimizer", default=d.optimizer, choices=OPTIMIZERS, help="Keras optimizer")
    train.add_argument("--learning-rate", type=float, default=None,
                       help="peak rate (default: 0.005 for adam, 0.1 for sgd)")
    train.add_argument("--lr-schedule", default=d.lr_schedule, choices=LR_SCHEDULES,
                       help="cosine: decay to 0 over the run")
    train.add_argument("--seed", type=int, default=d.seed,
                       help="initial weights and data order (ps workers shuffle on their own)")
    train.add_argument("--steps-per-execution", type=int, default=d.steps_per_execution,
                       help="steps per tf.function call (fewer host round trips)")
    train.add_argument("--data-dir", default=None,
                       help="tfds data dir holding mnist (default: TFDS_DATA_DIR, else tfds's own)")
    train.add_argument("--synthetic-data", action="store_true",
                       help="train on one in-memory random batch (input-pipeline benchmark)")
    out = p.add_argument_group("checkpoints, evaluation and output")
    out.add_argument("--model-dir", default=d.model_dir,
                     help="checkpoints, model.keras, logs/ and results.json; a rerun resumes there")
    out.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                     help="steps between checkpoints (epoch ends and the end always save)")
    out.add_argument("--eval-every", type=int, default=d.eval_every,
                     help="steps between test-accuracy evaluations on the chief (0: at the end "
                          "only); their time is left out of examples/s")
    out.add_argument("--log-every", type=int, default=d.log_every, help="steps between progress lines")
    out.add_argument("--verbose", action="store_true",
                     help="keep TensorFlow's own start-up and C++ log lines (hidden by default)")
    out.add_argument("--dry-run", action="store_true",
                     help="print the resolved plan as JSON and exit without starting anything")
    # launch.py's pre-flight: --dry-run's checks without importing TensorFlow
    # (GPUs are not listed), so every task is checked in well under a second.
    out.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)
    slurm = p.add_argument_group("Slurm (--cluster-resolver=slurm)")
    slurm.add_argument("--slurm-ps", type=int, default=None,
                       help="rank 0 is the chief, the next N ranks are ps tasks, the rest "
                            "workers (unset: every rank is a worker)")
    slurm.add_argument("--slurm-port", type=int, default=None,
                       help="first port on each node; a node's tasks take consecutive ports "
                            "(unset: 2222)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """The command line (``argv=None``: ``sys.argv``); returns the exit code."""
    try:
        args = parse_args(argv)
        verbose = args.__dict__.pop("verbose")
        if argv is None and not verbose:
            # Only as a command: a caller's own stderr (a test's capture) is left alone.
            from training.noise import filter_stderr

            filter_stderr()
        if args.data_dir is None:
            # tfds would read it too; resolved here so the config says where data comes from.
            args.data_dir = os.environ.get("TFDS_DATA_DIR") or None
        options = vars(args)
        cluster = cluster_from_environ(
            options.pop("cluster_resolver"), os.environ,
            slurm_ps=options.pop("slurm_ps"), slurm_port=options.pop("slurm_port"),
        )
        check_only = options.pop("check_only")
        chosen = options["global_batch_size"] is None
        if chosen:
            options["global_batch_size"] = default_global_batch(
                TrainConfig(cluster=cluster, **{**options, "global_batch_size": PER_REPLICA_BATCH}),
                gpus=[] if check_only else None)
        config = TrainConfig(cluster=cluster, **options)
        note = None
        if chosen and config.cluster.is_chief:
            note = (f"global batch {config.global_batch_size}: {PER_REPLICA_BATCH} per replica "
                    f"x {config.global_batch_size // PER_REPLICA_BATCH} (TensorFlow's "
                    "convention; --global-batch-size sets it)")
        if check_only:
            print(json.dumps(plan(config, gpus=[]), sort_keys=True), flush=True)
            return Exit.OK
        run(config, as_command=argv is None, batch_note=note)
    except (ConfigError, protocol.UsageError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return Exit.BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return Exit.INTERRUPTED
    except Exception as err:
        code = _fault_exit(err)
        if code is None:
            raise
        return code
    return Exit.OK


def _fault_exit(err: Exception) -> int | None:
    """The exit code and line for a survived fault; None for anything else."""
    from training.recovery import Diverged, Preempted, TaskLost, cluster_disagreement

    disagreement = cluster_disagreement(err)
    if disagreement is not None:
        print(f"error: {disagreement}", file=sys.stderr, flush=True)
        return Exit.BAD_INPUT
    if isinstance(err, Diverged):
        print(f"error: {err}", file=sys.stderr, flush=True)
        return Exit.DIVERGED
    if isinstance(err, TaskLost):
        print(f"error: {err}", file=sys.stderr, flush=True)
        return Exit.TASK_LOST
    if isinstance(err, Preempted):
        print(f"preempted: checkpoint saved at step {err.step}; exiting with code "
              f"{int(Exit.PREEMPTED)} so the job is relaunched and resumes there", flush=True)
        return Exit.PREEMPTED
    return None


if __name__ == "__main__":
    sys.exit(main())
