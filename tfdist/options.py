"""Every training option, typed and TensorFlow-free: ``TrainOptions``.

``train.py``'s flags (after ``--``, every member's under ``launch.py``) and the
Python API's ``options=`` are one frozen dataclass, declared once with
``tfdist.flags.option`` (the rule in ``tfdist/flags.py``), with the checks that
need nothing but the options (``TrainOptions.check``). It sits below the
launcher and training alike: ``training.config.TrainConfig`` extends it with the
strategy, the task and the cluster; the launcher carries it typed from the
request to each member's command line (``flags.to_argv``, built once, by the
engine), and reads a member's option as a field, never from an argv.

**Adding a training option** (``--accumulation-steps``, ``--schedule``, ...): one
field of ``TrainOptions``, declared with ``tfdist.flags.option(default, help,
group=..., ...)``. That field is ``train.py``'s flag (built by
``tfdist.cli.train``, nothing to write there), its ``--help`` line and default,
``tfdist.TrainOptions``'s argument and what ``fit``/``launch`` pass to every
member; check its value in ``TrainOptions.check`` (or, if it needs more than the
options, ``TrainConfig.validate``). Never repeat its default elsewhere:
``tests/test_options.py`` checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tfdist.flags import option
from tfdist.protocol import ConfigError


OPTIMIZERS = ("adam", "sgd")
# Peak rates for the default cosine schedule (chosen in the benchmark notes).
DEFAULT_LEARNING_RATE = {"adam": 5e-3, "sgd": 0.1}
LR_SCHEDULES = ("cosine", "constant")
# --strategy pipeline: the order of each stage's forward and backward slots.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "dataflow")
# --variable-partitioner (training.sharding.POLICIES; this module imports no TensorFlow).
PARTITIONERS = ("none", "min-size", "fixed")
# What gradients cross the network as (--gradient-dtype); updates are float32 whatever it is.
# float16 is known only to be refused with its reason (no loss scaling), so not offered.
GRADIENT_DTYPES = ("float32", "bfloat16", "float16")
OFFERED_GRADIENT_DTYPES = ("float32", "bfloat16")
# --shard-state: how much of the training state is split over the data-parallel
# workers (ZeRO stages 1-3; FSDP's SHARD_GRAD_OP is stage 2, FULL_SHARD stage 3).
SHARD_STATE_LEVELS = ("off", "optimizer", "gradients", "weights")
# What the built-in tasks train with unless the flags say otherwise.
DEFAULT_OPTIMIZER, DEFAULT_LR_SCHEDULE = "adam", "cosine"
# Seeds feed TensorFlow's and NumPy's generators, which take 32-bit seeds.
MAX_SEED = 2**32 - 1
# A run that asks for more steps is a typo (a billion steps is years here).
MAX_STEPS = 10**9
# --stuck-timeout: its default, and the range a run may ask for. Below the
# minimum a busy but healthy task (a garbage collection, a slow host) would
# be taken for a stuck one; TensorFlow's heartbeats go every half of it.
DEFAULT_STUCK_TIMEOUT = 30.0
STUCK_TIMEOUT_RANGE = (2.0, 86400.0)
OUTPUT = "checkpoints, evaluation and output"
# Examples per replica when no --global-batch-size is given (TensorFlow's convention).
PER_REPLICA_BATCH = 64


def _default_bucket_kib() -> int:
    from tfdist.strategies.kinds import DEFAULT_BUCKET_BYTES

    return DEFAULT_BUCKET_BYTES // 1024


def _batch_unset() -> str:
    from tfdist.models import BUILTIN_TASKS

    return (f"{PER_REPLICA_BATCH} per replica x the replicas in sync, "
            + "".join(f"{n} {t.per_replica_batch}, " for n, t in BUILTIN_TASKS.items()
                      if t.per_replica_batch)
            + "TensorFlow's convention; ps-sync: per gradient x K")


@dataclass(frozen=True)
class TrainOptions:
    """How a run trains, checkpoints and reports: ``train.py``'s flags (after ``--``,
    every task's under ``launch.py``) and the Python API's ``options=``.

    A new training option is one field here, declared with ``tfdist.flags.option``:
    ``train.py``'s flag, ``tfdist.TrainOptions``, what ``fit``/``launch`` pass to
    every task, and ``--help`` all come from it (the ``tfdist.flags`` rule).
    """

    # --- the workload ---------------------------------------------------------
    task_options: tuple[str, ...] = option(
        (), "passed to the task's configure(**options); repeatable", flag="--task-option",
        metavar="KEY=VALUE", group="training")
    epochs: int = option(1, "passes over the task's training split", metavar="N",
                         group="training")
    steps: int | None = option(
        None, "total steps; overrides --epochs (required when the training split is infinite "
        "or of unknown size)", metavar="N", group="training", unset="--epochs' steps")
    global_batch_size: int | None = option(
        None, "examples behind one update, split over the replicas in sync", metavar="N",
        group="training",
        unset=_batch_unset)
    # None: the built-in tasks' defaults, or a user task's own compiled optimizer.
    optimizer: str | None = option(
        None, "the Keras optimizer; a task of yours trains with the optimizer it compiled "
        "unless this, --learning-rate or --lr-schedule is given", choices=OPTIMIZERS,
        group="training", unset=f"built-in tasks {DEFAULT_OPTIMIZER}, a task of yours its own")
    learning_rate: float | None = option(
        None, "peak rate", metavar="RATE", group="training",
        unset=", ".join(f"{v:g} for {k}" for k, v in DEFAULT_LEARNING_RATE.items()))
    lr_schedule: str | None = option(
        None, "constant, or cosine: decay to 0 over the run", choices=LR_SCHEDULES,
        group="training", unset=DEFAULT_LR_SCHEDULE)
    seed: int = option(42, "initial weights and data order (ps workers shuffle on their own)",
                       group="training")
    gradient_accumulation_steps: int | None = option(
        None, "each replica sums its gradients over N batches and the update (one all-reduce, "
        "one push to the ps) applies their mean, as Keras's gradient_accumulation_steps: a step "
        "is N batches", metavar="N", group="training",
        unset="the task optimizer's own, else 1")
    steps_per_execution: int | None = option(
        None, "steps per tf.function call (fewer host round trips)", metavar="N",
        group="training", unset="the model's compile(steps_per_execution=N), else 1")
    callbacks_file: str | None = option(
        None, "Keras callbacks pickled by tfdist.fit(callbacks=[...], workers=N): the chief runs "
        "them in place of the task's callbacks()", metavar="FILE", group="training",
        unset="the task's callbacks()")
    data_dir: str | None = option(None, "tfds data dir for the built-in MNIST tasks",
                                  metavar="DIR", group="training", unset="TFDS_DATA_DIR, else tfds's own")
    synthetic_data: bool = option(
        False, "train on the first batch, repeated (input-pipeline benchmark)", group="training")
    # --- the cluster ----------------------------------------------------------
    all_reduce: str = option("auto", "multiworker's collective implementation",
                             choices=("auto", "ring", "nccl"), group="cluster")
    all_reduce_bucket: str | None = option(
        None, "multiworker: gradients are all-reduced in buckets of about SIZE bytes (k, m: "
        "KiB, MiB), last layers first, each bucket's collective starting as soon as the "
        "backward pass has made its gradients (larger than the model: one all-reduce after "
        "the whole backward pass)", metavar="SIZE", group="cluster",
        unset=lambda: f"{_default_bucket_kib()}k")
    carry_all_reduce: str | None = option(
        None, "multiworker: the rest of the last layers' all-reduce crosses the network "
        "under the next step's first layers, the update still applied whole before "
        "either reads it: faster on slow links, slower on fast ones; auto times both "
        "steps for 20 steps each early in the run and keeps the faster "
        "(docs/performance.md)",
        choices=("auto", "on", "off"), group="cluster", unset="auto (multiworker), off")
    shard_state: str = option(
        "off", "multiworker: the training state split over the workers, ZeRO's stages: "
        "optimizer (stage 1: each worker updates 1/N of the weights with 1/N of the "
        "optimizer's slots; the gradients reduce-scattered, the updated weights all-gathered), "
        "gradients (stage 2, FSDP's SHARD_GRAD_OP: also each gradient bucket released once "
        "reduce-scattered), weights (stage 3, FSDP's FULL_SHARD); off is FSDP's NO_SHARD, "
        "plain data parallelism (docs/sharding.md)", choices=SHARD_STATE_LEVELS,
        group="cluster")
    startup_timeout: float = option(120.0, "seconds to wait for the other tasks before giving up",
                                    metavar="SECONDS", group="cluster")
    # Seconds a live task may go without progress before the job treats it
    # as stuck (docs/reliability.md: what each strategy does then).
    stuck_timeout: float = option(
        DEFAULT_STUCK_TIMEOUT, "seconds a live task may make no progress before the job treats "
        f"it as stuck ({STUCK_TIMEOUT_RANGE[0]:g} to {STUCK_TIMEOUT_RANGE[1]:g}): multiworker's "
        "heartbeat timeout; ps, ps-sync: the chief's wait for a step (ps reruns a stuck "
        "worker's steps on the others until a checkpoint must wait for it; then, or with "
        "nothing to route around, the chief ends naming the stuck task, exit 75)",
        metavar="SECONDS", group="cluster")
    replicas_to_aggregate: int | None = option(
        None, "ps-sync: gradients averaged into one update (fewer than the workers makes the "
        "N - K slowest backups whose late gradients are dropped)", metavar="K", group="cluster",
        unset="the number of workers")
    # What gradients cross the network as: cast before the all-reduce or the
    # push to the ps, cast back to float32 where the update is applied.
    gradient_dtype: str = option(
        "float32", "what gradients cross the network as (" + ", ".join(OFFERED_GRADIENT_DTYPES)
        + "): cast before multiworker's all-reduce or the push to the ps, the update applied "
        "in float32; bfloat16 halves the gradient bytes", metavar="DTYPE", group="cluster")
    # --strategy pipeline (training.pipeline.stages): micro-batches per step, data-parallel
    # copies of the pipeline, and the stage boundaries (None: balanced).
    micro_batches: int = option(
        1, "pipeline: micro-batches per step (each global/(P x M) examples); the idle bubble "
        "is (S-1)/(M+S-1)", metavar="M", group="cluster")
    pipelines: int = option(
        1, "pipeline: P data-parallel copies of the S-stage pipeline over P x S workers "
        "(hybrid parallelism)", metavar="P", group="cluster")
    stages: str | None = option(
        None, "pipeline: the first layer of each stage after the first", metavar="I,J,...",
        group="cluster", unset="stages balanced by parameter count")
    schedule: str | None = option(
        None, "pipeline: each stage's order of forwards and backwards: dataflow runs each as "
        "soon as its input is there, several at once on a stage's free threads; gpipe every "
        "forward then every backward; 1f1b holds at most S micro-batches' activations per "
        "stage", metavar="dataflow|gpipe|1f1b", group="cluster", unset="dataflow")
    read_ahead: str | None = option(
        None, "ps: each worker reads its next weights from the ps while it computes a step "
        "and pushes its gradients, so the ps link carries weights out "
        "and gradients in at once; every step is then at least 1 stale "
        "(docs/performance.md)", choices=("on", "off"), group="cluster", unset="off")
    # Parameter servers: which variables are split over the ps tasks (None:
    # min-size under a strategy with ps, none otherwise) and the minimum size.
    variable_partitioner: str | None = option(
        None, "ps, ps-sync: split Embedding tables and Dense kernels over the ps tasks, one "
        "shard per ps: min-size (those of --shard-min-bytes or more), fixed (all of them), "
        "none", choices=PARTITIONERS, group="cluster",
        unset="min-size with ps tasks, else none")
    shard_min_bytes: int = option(1 << 20, "--variable-partitioner min-size: the smallest "
                                  "variable split", metavar="BYTES", group="cluster")
    # --- checkpoints, evaluation and output -----------------------------------
    model_dir: str | None = option(
        None, "checkpoints, model.keras, logs/ and results.json; a rerun resumes there",
        metavar="DIR", group=OUTPUT, unset="runs/<strategy>, the strategy as resolved")
    checkpoint_every: int | None = option(
        None, "steps between checkpoints (epoch ends and the end always save)", metavar="N",
        group=OUTPUT, unset="epoch ends and the end only")
    eval_every: int = option(
        0, "steps between evaluations of the task's metrics on its test split, shared by the "
        "training members where they train in lockstep (multiworker), in shards on the "
        "workers under ps and ps-sync, else on the chief (0: at the end only); their time is "
        "left out of examples/s", metavar="N", group=OUTPUT)
    # Where evaluations run (training.loop.evaluation): "shared" where a trainer
    # names several members (multiworker), else the chief; "chief" always.
    evaluate_on: str = option(
        "shared", "shared: every training member evaluates its range of the split's batches "
        "and one all-reduce sums the metrics' states (multiworker; ps, ps-sync: the "
        "workers evaluate --eval-shards shards; elsewhere the chief evaluates); chief: the "
        "chief evaluates the whole split while the others wait",
        choices=("shared", "chief"), group=OUTPUT)
    # ps, ps-sync: the evaluation cut into shards the coordinator schedules on the
    # workers (training.ps.sharded_eval); auto: 5 per worker, as tf_keras's
    # pss_evaluation_shards.
    eval_shards: str = option(
        "auto", "ps, ps-sync: cut each evaluation into S shards of the split's batches, each "
        "evaluated by one closure on a worker and merged once on the chief (auto: 5 x "
        "workers); elsewhere unused", metavar="S|auto", group=OUTPUT)
    log_every: int = option(100, "steps between progress lines", metavar="N", group=OUTPUT)
    # --export DIR: the chief writes a SavedModel into DIR/<global step>/ at the
    # end (training.loop.export), and every --export-every steps when given.
    export: str | None = option(
        None, "the chief writes the trained model as a SavedModel (serving_default signature) "
        "into DIR/<global step>/, TF Serving's version layout, and checks it by loading it "
        "back in a fresh process (exit 73 if it cannot)", metavar="DIR", group=OUTPUT,
        unset="no export")
    export_every: int | None = option(
        None, "with --export: also export every N steps", metavar="N", group=OUTPUT,
        unset="at the end only")
    profile_steps: str | None = option(
        None, "a TensorFlow profiler trace of steps A to B (as a slice of the run's steps) for "
        "every task, in <model-dir>/logs/profile-<task>/: TensorBoard's Profile tab "
        "(tensorboard-plugin-profile) shows each task's timeline", metavar="A:B", group=OUTPUT,
        unset="no trace")

    def check(self) -> None:
        """Raise ConfigError naming the first bad value (the options alone, without
        TensorFlow, the cluster or the task); touches nothing."""
        choices = {"optimizer": OPTIMIZERS, "lr_schedule": LR_SCHEDULES,
                   "variable_partitioner": PARTITIONERS, "gradient_dtype": GRADIENT_DTYPES,
                   "schedule": PIPELINE_SCHEDULES, "shard_state": SHARD_STATE_LEVELS}
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ConfigError(
                    f"unknown --{name.replace('_', '-')} {value!r}; allowed: {', '.join(allowed)}"
                )
        if self.gradient_dtype == "float16":
            # float16's smallest normal is 6e-5: without loss scaling small
            # gradients flush to zero; bfloat16 has float32's exponent range.
            raise ConfigError(
                "--gradient-dtype float16 without loss scaling underflows small gradients "
                "(below 6e-5 they lose precision, below 6e-8 they become 0); use bfloat16, "
                "which has float32's range"
            )
        positive = {
            "epochs": self.epochs, "log_every": self.log_every, "startup_timeout": self.startup_timeout,
            "micro_batches": self.micro_batches, "pipelines": self.pipelines,
        }
        for name in ("steps", "checkpoint_every", "learning_rate", "global_batch_size",
                     "steps_per_execution"):
            if getattr(self, name) is not None:
                positive[name] = getattr(self, name)
        if self.eval_every < 0:
            raise ConfigError(
                f"--eval-every={self.eval_every} is not allowed; use 0 (evaluate at the end "
                "only) or a number of steps"
            )
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')}={value} is not allowed; it must be greater than 0"
                )
        low, high = STUCK_TIMEOUT_RANGE
        if not low <= self.stuck_timeout <= high:  # False for nan too
            raise ConfigError(
                f"--stuck-timeout={self.stuck_timeout:g} is not allowed; use {low:g} to "
                f"{high:g} seconds (how long a live task may make no progress before the job "
                "treats it as stuck)"
            )
        for name in ("learning_rate", "startup_timeout"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ConfigError(
                    f"--{name.replace('_', '-')}={value} is not allowed; it must be a finite number"
                )
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(
                f"--seed={self.seed} is not allowed; use an integer from 0 to {MAX_SEED}"
            )
        if self.steps is not None and self.steps > MAX_STEPS:
            raise ConfigError(
                f"--steps={self.steps} is more than the {MAX_STEPS} steps a run may ask for; "
                "use fewer"
            )
        if self.shard_min_bytes < 0:
            raise ConfigError(f"--shard-min-bytes={self.shard_min_bytes} is not allowed; use 0 "
                              "or more bytes")
        if self.gradient_accumulation_steps is not None and self.gradient_accumulation_steps < 1:
            raise ConfigError(
                f"--gradient-accumulation-steps={self.gradient_accumulation_steps} is not "
                "allowed; use a whole number of batches, at least 1 (1: no accumulation)"
            )
        if self.replicas_to_aggregate is not None and self.replicas_to_aggregate < 1:
            raise ConfigError(
                f"--replicas-to-aggregate={self.replicas_to_aggregate} is not allowed; it must "
                "be at least 1 (gradients averaged into one update)"
            )
        parse_size(self.all_reduce_bucket, "--all-reduce-bucket")  # one line if not a positive size


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20}


def parse_size(text: str | None, flag: str) -> int | None:
    """``"262144"``, ``"256k"``, ``"1m"`` -> bytes (k: KiB, m: MiB); ConfigError unless positive."""
    if text is None:
        return None
    raw = str(text).strip().lower().removesuffix("b").removesuffix("i")
    unit = raw[-1:] if raw[-1:] in ("k", "m") else ""
    try:
        value = float(raw[:len(raw) - len(unit)]) * _UNITS[unit]
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 1):
        raise ConfigError(f"{flag} {text!r} is not a positive size; give bytes, or KiB/MiB "
                          "with k/m (e.g. 262144, 256k, 1m)")
    return int(value)

