"""The frozen run configuration: ``train.py``'s flags, checked on their own.

What follows from the flags *and* the cluster, the strategy kind and the
task (K, the global batch, replicas, steps) is resolved once, into a
``training.plan.RunPlan``; nothing here imports the strategy kinds.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field

from tfdist.models import DEFAULT_TASK
from tfdist.protocol import ConfigError
from tfdist.strategies.tf_config import LOCAL, ClusterConfig

OPTIMIZERS = ("adam", "sgd")
# Peak rates for the default cosine schedule (chosen in the benchmark notes).
DEFAULT_LEARNING_RATE = {"adam": 5e-3, "sgd": 0.1}
LR_SCHEDULES = ("cosine", "constant")
# --variable-partitioner (training.sharding.POLICIES; this module imports no TensorFlow).
PARTITIONERS = ("none", "min-size", "fixed")
# What gradients cross the network as (--gradient-dtype); updates are float32 whatever it is.
GRADIENT_DTYPES = ("float32", "bfloat16", "float16")
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
# Examples per replica when no --global-batch-size is given (TensorFlow's convention).
PER_REPLICA_BATCH = 64
# The flags that define what a run's checkpoints are: resuming with any of
# them changed would mix two runs (``training.loop.checkpoints.check_run_record``).
# ``total_steps`` is recorded too, but a resume may extend a run.
DEFINING_FLAGS = ("strategy", "task", "optimizer", "learning_rate", "lr_schedule",
                  "global_batch_size", "seed", "variable_partitioner", "shard_min_bytes",
                  "pipeline_stages")


@dataclass(frozen=True)
class TrainConfig:
    """``train.py``'s flags as one frozen object (the API builds the same): what to train,
    how long, with what optimizer and batch, where to write, every cadence and fault
    setting, and the cluster read once. Owns checking each flag on its own
    (``validate``); what needs the cluster, kind or task is ``training.plan``'s."""

    strategy: str = "auto"
    task: str = DEFAULT_TASK  # a built-in name, pkg.mod[:NAME] or path/to/task.py
    task_options: tuple[str, ...] = ()  # --task-option KEY=VALUE, for the task's configure()
    epochs: int = 1
    steps: int | None = None  # overrides epochs when set
    global_batch_size: int | None = None  # None: PER_REPLICA_BATCH x the replicas in sync
    # None: the built-in tasks' defaults, or a user task's own compiled optimizer.
    optimizer: str | None = None
    learning_rate: float | None = None
    lr_schedule: str | None = None
    seed: int = 42
    model_dir: str = "runs/default"
    data_dir: str | None = None
    steps_per_execution: int = 1
    log_every: int = 100
    eval_every: int = 0  # steps between test-set evaluations on the chief; 0: at the end only
    checkpoint_every: int | None = None  # steps; epoch ends and the end always checkpoint
    all_reduce: str = "auto"
    startup_timeout: float = 120.0
    # Seconds a live task may go without progress before the job treats it
    # as stuck (docs/reliability.md: what each strategy does then).
    stuck_timeout: float = DEFAULT_STUCK_TIMEOUT
    # ps-sync: gradients averaged into one update (None: one per worker).
    replicas_to_aggregate: int | None = None
    # What gradients cross the network as: cast before the all-reduce or the
    # push to the ps, cast back to float32 where the update is applied.
    gradient_dtype: str = "float32"
    synthetic_data: bool = False
    # --strategy pipeline (training.pipeline.stages): micro-batches per step, data-parallel
    # copies of the pipeline, and the stage boundaries (None: balanced).
    micro_batches: int = 1
    pipelines: int = 1
    stages: str | None = None
    # Parameter servers: which variables are split over the ps tasks (None:
    # min-size under a strategy with ps, none otherwise) and the minimum size.
    variable_partitioner: str | None = None
    shard_min_bytes: int = 1 << 20
    # --export DIR: the chief writes a SavedModel into DIR/<global step>/ at the
    # end (training.loop.export), and every --export-every steps when given.
    export: str | None = None
    export_every: int | None = None
    dry_run: bool = False
    cluster: ClusterConfig = field(default=LOCAL)

    @property
    def optimizer_overridden(self) -> bool:
        """Whether a flag asked for an optimizer other than a task's own."""
        return any(v is not None for v in (self.optimizer, self.learning_rate, self.lr_schedule))

    def validate(self) -> None:
        """Raise ConfigError naming the first bad value; touches nothing."""
        choices = {"optimizer": OPTIMIZERS, "lr_schedule": LR_SCHEDULES,
                   "variable_partitioner": PARTITIONERS, "gradient_dtype": GRADIENT_DTYPES}
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
            "epochs": self.epochs, "steps_per_execution": self.steps_per_execution,
            "log_every": self.log_every, "startup_timeout": self.startup_timeout,
            "micro_batches": self.micro_batches, "pipelines": self.pipelines,
        }
        for name in ("steps", "checkpoint_every", "learning_rate", "global_batch_size"):
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
        if self.replicas_to_aggregate is not None and self.replicas_to_aggregate < 1:
            raise ConfigError(
                f"--replicas-to-aggregate={self.replicas_to_aggregate} is not allowed; it must "
                "be at least 1 (gradients averaged into one update)"
            )
        from tfdist.training.loop.export import check_export_flags

        check_export_flags(self.export, self.export_every)
        if not self.model_dir or not self.model_dir.strip():
            raise ConfigError(
                f"--model-dir={self.model_dir!r} is empty; pass a directory path "
                "(it is created if missing)"
            )
        if os.path.exists(self.model_dir) and not os.path.isdir(self.model_dir):
            raise ConfigError(
                f"--model-dir {self.model_dir!r} exists and is not a directory; "
                "pass a directory path (it is created if missing)"
            )


def check_model_dir(path: str, flag: str = "--model-dir") -> None:
    """Refuse a ``--model-dir`` the chief could not write, leaving nothing behind.

    Permission bits say little (root ignores them, a read-only mount or
    ``/proc`` refuses anyway), so this tries what the run will do: create
    the directory and a file in it, then removes whatever it created. Runs
    before TensorFlow starts, so an unusable path costs no start-up time.
    """
    created: list[str] = []  # deepest first
    try:
        parent = os.path.normpath(path)
        while not os.path.exists(parent):
            created.append(parent)
            parent = os.path.dirname(parent) or os.curdir
        if not os.path.isdir(parent):
            raise ConfigError(
                f"{flag} {path!r} cannot be created: {parent!r} is not a directory; "
                "pass a directory path"
            )
        for d in reversed(created):
            os.mkdir(d)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except ConfigError:
        raise
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ConfigError(
            f"{flag} {path!r} is not a writable directory ({reason}); pass a "
            "directory this task can create and write"
        ) from None
    finally:
        for d in created:  # only what this check made
            try:
                os.rmdir(d)
            except (OSError, ValueError):
                pass
