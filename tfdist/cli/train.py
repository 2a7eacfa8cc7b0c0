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

from tfdist import flags, protocol
from tfdist.cli.parsing import OneLineParser
from tfdist.protocol import ConfigError, Exit
from tfdist.strategies import CLUSTER_RESOLVERS, cluster_from_environ
from tfdist.training.config import OUTPUT, TrainConfig
from tfdist.training.plan import request
from tfdist.training.run import failure, preflight, run


def parser() -> OneLineParser:
    """train.py's flags: every ``TrainConfig`` option (``tfdist.flags``: a new one is a
    field there, nothing here), and this command's own (the cluster's source, Slurm's
    layout, the --model alias, --verbose)."""
    from tfdist.models import MODEL_NAMES

    p = OneLineParser(
        allow_abbrev=False,
        description=flags.description(__doc__),
        formatter_class=flags.HelpFormatter,
        epilog="TF_CONFIG (environment) describes the cluster and this task; with\n"
               "--cluster-resolver=slurm, the Slurm job step does.\n\n"
               + protocol.exit_epilog(codes=set(Exit) - {Exit.TIMEOUT, Exit.TERMINATED}),
    )
    # Sections in this order; the strategy and the task first in theirs.
    for title in ("cluster", "training", OUTPUT):
        p.add_argument_group(title)
    flags.add_options(p, TrainConfig, only=("strategy",))
    groups = {g.title: g for g in p._action_groups}
    groups["cluster"].add_argument(
        "--cluster-resolver", default="tf_config", choices=CLUSTER_RESOLVERS,
        help="where this task learns the cluster: tf_config (the TF_CONFIG variable), slurm "
             "(the Slurm job step), jobset (a Kubernetes JobSet's pod environment)")
    flags.add_options(p, TrainConfig, only=("task",))
    groups["training"].add_argument(
        "--model", default=None, choices=MODEL_NAMES,
        help="alias: --model cnn is --task mnist-cnn, --model logreg --task mnist-logreg")
    flags.add_options(p, TrainConfig, exclude=("strategy", "task"))
    groups[OUTPUT].add_argument(
        "--verbose", action="store_true",
        help="keep TensorFlow's own start-up and C++ log lines (hidden by default)")
    # launch.py's pre-flight: --dry-run's checks without listing GPUs; a
    # built-in task needs no TensorFlow for them, so it takes well under a second.
    p.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)
    slurm = p.add_argument_group("Slurm (--cluster-resolver=slurm)")
    slurm.add_argument("--slurm-ps", type=int, default=None, metavar="N",
                       help="rank 0 is the chief, the next N ranks are ps tasks, the rest "
                            "workers (default: every rank is a worker)")
    slurm.add_argument("--slurm-port", type=int, default=None, metavar="PORT",
                       help="first port on each node; a node's tasks take consecutive ports "
                            "(default: 2222)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    # --model is an alias of --task: both given is a contradiction, whatever the values.
    args.task_given = any(a == "--task" or a.startswith("--task=") for a in given)
    return args


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Flags -> the frozen config (the only place train.py's Namespace is read)."""
    options = dict(vars(args))
    if options["data_dir"] is None:
        # tfds would read it too; resolved here so the config says where data comes from.
        options["data_dir"] = os.environ.get("TFDS_DATA_DIR") or None
    model = options["model"]
    if model is not None and options.get("task_given", options["task"] != TrainConfig.task):
        raise protocol.UsageError(f"--model {model} and --task {options['task']} both given; "
                                  "--model is an alias of --task, pass one of them")
    if model is not None:
        from tfdist.models import MODEL_ALIASES

        options["task"] = MODEL_ALIASES[model]
    cluster = cluster_from_environ(
        options["cluster_resolver"], os.environ,
        slurm_ps=options["slurm_ps"], slurm_port=options["slurm_port"],
    )
    return flags.from_args(TrainConfig, options, cluster=cluster)


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
