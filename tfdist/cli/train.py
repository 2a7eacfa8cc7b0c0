"""Train a Keras 3 model (a task) under any tf.distribute strategy.

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
The flags become one frozen ``TrainConfig``; ``tfdist.training.run`` runs it.
Bad input ends with one ``error:`` line on stderr and exit code 2; a lost
peer task with one ``error:`` line and exit code 75 (relaunch to resume); a
preemption (SIGTERM) with a checkpoint at an agreed step and exit code 42; a
NaN or infinite loss with one ``error:`` line and exit code 65, the last good
checkpoint kept; a write into ``--model-dir`` that fails because its disk is
full or read-only with one ``error:`` line and exit code 74 (the previous
checkpoint kept: free space or remount, then relaunch); an ``--export`` the
model cannot make, or whose reloaded SavedModel predicts otherwise, with one
``error:`` line and exit code 73 (results, checkpoints and model.keras kept).
The chief holds ``<model-dir>/.lock`` while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tfdist import protocol
from tfdist.protocol import ConfigError, Exit
from tfdist.strategies import CLUSTER_RESOLVERS, cluster_from_environ, kinds
from tfdist.training.config import PER_REPLICA_BATCH, TrainConfig
from tfdist.training.plan import request
from tfdist.training.run import failure, preflight, run


def parse_args(argv=None) -> argparse.Namespace:
    p = protocol.OneLineParser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=protocol.HelpFormatter,
        epilog="TF_CONFIG (environment) describes the cluster and this task; with "
               "--cluster-resolver=slurm, the Slurm job step does. " + protocol.exit_epilog(),
    )
    d = TrainConfig()
    _cluster_flags(p.add_argument_group("cluster"), d)
    _training_flags(p.add_argument_group("training"), d)
    _output_flags(p.add_argument_group("checkpoints, evaluation and output"), d)
    slurm = p.add_argument_group("Slurm (--cluster-resolver=slurm)")
    slurm.add_argument("--slurm-ps", type=int, default=None,
                       help="rank 0 is the chief, the next N ranks are ps tasks, the rest "
                            "workers (unset: every rank is a worker)")
    slurm.add_argument("--slurm-port", type=int, default=None,
                       help="first port on each node; a node's tasks take consecutive ports "
                            "(unset: 2222)")
    return p.parse_args(argv)


def _cluster_flags(cluster, d: TrainConfig) -> None:
    from tfdist.strategies.kinds import ALL_REDUCE

    cluster.add_argument(
        "--strategy", default=d.strategy, choices=kinds.names(),
        help="; ".join(f"{name}: {kind.summary}" for name, kind in kinds.all_kinds().items())
        + "; auto: ps with ps tasks, multiworker with several workers, else mirrored")
    cluster.add_argument("--cluster-resolver", default="tf_config", choices=CLUSTER_RESOLVERS,
                         help="where this task learns the cluster")
    cluster.add_argument("--all-reduce", default=d.all_reduce, choices=ALL_REDUCE,
                         help="multiworker's collective implementation")
    from tfdist.strategies.kinds import DEFAULT_BUCKET_BYTES

    cluster.add_argument("--all-reduce-bucket", default=d.all_reduce_bucket, metavar="SIZE",
                         help="multiworker: gradients are all-reduced in buckets of about SIZE "
                              "bytes (k, m: KiB, MiB), last layers first, each bucket's "
                              "collective starting as soon as the backward pass has made its "
                              f"gradients (default {DEFAULT_BUCKET_BYTES // 1024}k; larger than "
                              "the model: one all-reduce after the whole backward pass)")
    cluster.add_argument("--startup-timeout", type=float, default=d.startup_timeout,
                         help="seconds to wait for the other tasks before giving up")
    from tfdist.training.config import STUCK_TIMEOUT_RANGE

    cluster.add_argument("--stuck-timeout", type=float, default=d.stuck_timeout,
                         metavar="SECONDS",
                         help="seconds a live task may make no progress before the job treats "
                              f"it as stuck ({STUCK_TIMEOUT_RANGE[0]:g} to "
                              f"{STUCK_TIMEOUT_RANGE[1]:g}): multiworker's heartbeat timeout; "
                              "ps, ps-sync: the chief's wait for a step (ps reruns a stuck "
                              "worker's steps on the others until a checkpoint must wait for "
                              "it; then, or with nothing to route around, the chief ends "
                              "naming the stuck task, exit 75)")
    cluster.add_argument("--replicas-to-aggregate", type=int, default=d.replicas_to_aggregate,
                         help="ps-sync: gradients averaged into one update (unset: the number of "
                              "workers; fewer makes the N - K slowest backups whose late gradients "
                              "are dropped)")
    cluster.add_argument("--micro-batches", type=int, default=d.micro_batches, metavar="M",
                         help="pipeline: micro-batches per step (each global/(P x M) examples); "
                              "the idle bubble is (S-1)/(M+S-1)")
    cluster.add_argument("--pipelines", type=int, default=d.pipelines, metavar="P",
                         help="pipeline: P data-parallel copies of the S-stage pipeline over "
                              "P x S workers (hybrid parallelism)")
    cluster.add_argument("--stages", default=d.stages, metavar="I,J,...",
                         help="pipeline: the first layer of each stage after the first (unset: "
                              "stages balanced by parameter count)")
    from tfdist.training.config import GRADIENT_DTYPES

    cluster.add_argument("--gradient-dtype", default=d.gradient_dtype, metavar="DTYPE",
                         help="what gradients cross the network as (" + ", ".join(GRADIENT_DTYPES)
                         + "): cast before multiworker's all-reduce or the push to the ps, the "
                         "update applied in float32; bfloat16 halves the gradient bytes. float16 "
                         "is refused (no loss scaling)")


def _training_flags(train, d: TrainConfig) -> None:
    from tfdist.models import BUILTIN_TASKS, DEFAULT_TASK, MODEL_NAMES
    from tfdist.training.config import DEFAULT_LEARNING_RATE, LR_SCHEDULES, OPTIMIZERS, PARTITIONERS

    train.add_argument("--task", default=None,
                       help="what to train: a built-in (" + ", ".join(BUILTIN_TASKS)
                       + f"; default {DEFAULT_TASK}), an import path pkg.mod[:NAME] or a file "
                       "path/to/task.py providing build_model() and dataset(split)")
    train.add_argument("--task-option", dest="task_options", action="append", default=[],
                       metavar="KEY=VALUE",
                       help="passed to the task's configure(**options); repeatable")
    train.add_argument("--model", default=None, choices=MODEL_NAMES,
                       help="alias: --model cnn is --task mnist-cnn, --model logreg --task mnist-logreg")
    train.add_argument("--epochs", type=int, default=d.epochs,
                       help="passes over the task's training split")
    train.add_argument("--steps", type=int, default=None,
                       help="total steps; overrides --epochs (required when the training split "
                            "is infinite or of unknown size)")
    train.add_argument("--global-batch-size", type=int, default=None,
                       help="examples behind one update, split over the replicas in sync "
                            f"(default: {PER_REPLICA_BATCH} per replica x the replicas in sync, "
                            + "".join(f"{n} {t.per_replica_batch}, " for n, t in BUILTIN_TASKS.items()
                                      if t.per_replica_batch)
                            + "TensorFlow's convention; ps-sync: per gradient x K)")
    train.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                       help="built-in tasks: the Keras optimizer (default adam); a task of yours "
                            "trains with the optimizer it compiled unless this, --learning-rate "
                            "or --lr-schedule is given")
    train.add_argument("--learning-rate", type=float, default=None,
                       help="peak rate (default: " + ", ".join(
                           f"{v:g} for {k}" for k, v in DEFAULT_LEARNING_RATE.items()) + ")")
    train.add_argument("--lr-schedule", default=None, choices=LR_SCHEDULES,
                       help="cosine (default): decay to 0 over the run")
    train.add_argument("--gradient-accumulation-steps", type=int,
                       default=d.gradient_accumulation_steps, metavar="N",
                       help="each replica sums its gradients over N batches and the update "
                            "(one all-reduce, one push to the ps) applies their mean, as Keras's "
                            "gradient_accumulation_steps: a step is N batches (unset: the task "
                            "optimizer's own, else 1)")
    train.add_argument("--seed", type=int, default=d.seed,
                       help="initial weights and data order (ps workers shuffle on their own)")
    train.add_argument("--steps-per-execution", type=int, default=d.steps_per_execution,
                       help="steps per tf.function call (fewer host round trips)")
    train.add_argument("--data-dir", default=None,
                       help="tfds data dir for the built-in MNIST tasks (default: TFDS_DATA_DIR, "
                            "else tfds's own)")
    train.add_argument("--variable-partitioner", default=None, choices=PARTITIONERS,
                       help="ps, ps-sync: split Embedding tables and Dense kernels over the ps "
                            "tasks, one shard per ps: min-size (default; those of "
                            "--shard-min-bytes or more), fixed (all of them), none")
    train.add_argument("--shard-min-bytes", type=int, default=d.shard_min_bytes,
                       help="--variable-partitioner min-size: the smallest variable split")
    train.add_argument("--synthetic-data", action="store_true",
                       help="train on the first batch, repeated (input-pipeline benchmark)")


def _output_flags(out, d: TrainConfig) -> None:
    out.add_argument("--model-dir", default=d.model_dir,
                     help="checkpoints, model.keras, logs/ and results.json; a rerun resumes there")
    out.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                     help="steps between checkpoints (epoch ends and the end always save)")
    out.add_argument("--eval-every", type=int, default=d.eval_every,
                     help="steps between evaluations of the task's metrics on its test split, "
                          "on the chief (0: at the end only); their time is left out of examples/s")
    out.add_argument("--log-every", type=int, default=d.log_every, help="steps between progress lines")
    out.add_argument("--export", default=d.export, metavar="DIR",
                     help="the chief writes the trained model as a SavedModel (serving_default "
                          "signature) into DIR/<global step>/, TF Serving's version layout, and "
                          "checks it by loading it back in a fresh process (exit 73 if it "
                          "cannot)")
    out.add_argument("--export-every", type=int, default=d.export_every, metavar="N",
                     help="with --export: also export every N steps (the end always exports)")
    out.add_argument("--profile-steps", default=d.profile_steps, metavar="A:B",
                     help="a TensorFlow profiler trace of steps A to B (as a slice of the "
                          "run's steps) for every task, in <model-dir>/logs/profile-<task>/: "
                          "TensorBoard's Profile tab (tensorboard-plugin-profile) shows each "
                          "task's timeline")
    out.add_argument("--verbose", action="store_true",
                     help="keep TensorFlow's own start-up and C++ log lines (hidden by default)")
    out.add_argument("--dry-run", action="store_true",
                     help="print the resolved plan as JSON and exit without starting anything")
    # launch.py's pre-flight: --dry-run's checks without listing GPUs; a
    # built-in task needs no TensorFlow for them, so it takes well under a second.
    out.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Flags -> the frozen config (the only place train.py's Namespace is read)."""
    options = vars(args)
    options.pop("verbose", None)
    if options["data_dir"] is None:
        # tfds would read it too; resolved here so the config says where data comes from.
        options["data_dir"] = os.environ.get("TFDS_DATA_DIR") or None
    model = options.pop("model")
    if model is not None and options["task"] is not None:
        raise protocol.UsageError(f"--model {model} and --task {options['task']} both given; "
                                  "--model is an alias of --task, pass one of them")
    if model is not None:
        from tfdist.models import MODEL_ALIASES

        options["task"] = MODEL_ALIASES[model]
    if options["task"] is None:
        options.pop("task")
    options["task_options"] = tuple(options["task_options"])
    cluster = cluster_from_environ(
        options.pop("cluster_resolver"), os.environ,
        slurm_ps=options.pop("slurm_ps"), slurm_port=options.pop("slurm_port"),
    )
    options.pop("check_only")
    return TrainConfig(cluster=cluster, **options)


def main(argv=None) -> int:
    """The command line (``argv=None``: ``sys.argv``); returns the exit code."""
    try:
        args = parse_args(argv)
        if argv is None and not args.verbose:
            # Only as a command: a caller's own stderr (a test's capture) is left alone.
            from tfdist.training.noise import filter_stderr

            filter_stderr()
        check_only = args.check_only
        config = config_from_args(args)
        if check_only:
            print(json.dumps(preflight(request(config), gpus=[]).describe(), sort_keys=True),
                  flush=True)
            return Exit.OK
        run(config, as_command=argv is None)
    except (ConfigError, protocol.UsageError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return Exit.BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return Exit.INTERRUPTED
    except Exception as err:
        code = fault_exit(err)
        if code is None:
            raise
        return code
    return Exit.OK


def fault_exit(err: Exception) -> int | None:
    """Print a survived fault's one line; its exit code (None: not a fault, a bug)."""
    found = failure(err)
    if found is None:
        return None
    print(found.line, file=sys.stderr if found.to_stderr else sys.stdout, flush=True)
    return found.code


if __name__ == "__main__":
    sys.exit(main())
