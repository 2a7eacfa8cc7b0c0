"""The frozen run configuration that ``train.run`` takes."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field

from models import MODEL_NAMES
from strategies import ALL_REDUCE, ClusterConfig, ConfigError, kinds
from strategies.tf_config import LOCAL

# The one strategy that takes --replicas-to-aggregate (strategies.kinds.SyncParameterServer).

OPTIMIZERS = ("adam", "sgd")
# Peak rates for the default cosine schedule (chosen in the benchmark notes).
DEFAULT_LEARNING_RATE = {"adam": 5e-3, "sgd": 0.1}
LR_SCHEDULES = ("cosine", "constant")
# Seeds feed TensorFlow's and NumPy's generators, which take 32-bit seeds.
MAX_SEED = 2**32 - 1
# A run that asks for more steps is a typo (a billion steps is years here).
MAX_STEPS = 10**9
# MNIST's splits; checked against tfds in the tests.
TRAIN_EXAMPLES = 60_000
# Examples per replica when no --global-batch-size is given (train.default_global_batch).
PER_REPLICA_BATCH = 64
TEST_EXAMPLES = 10_000
# The flags that define what a run's checkpoints are: resuming with any of
# them changed would mix two runs (``training.checkpoints.check_run_record``).
# ``total_steps`` is recorded too, but a resume may extend a run.
DEFINING_FLAGS = ("strategy", "model", "optimizer", "learning_rate", "lr_schedule",
                  "global_batch_size", "seed")


@dataclass(frozen=True)
class TrainConfig:
    strategy: str = "auto"
    model: str = "cnn"
    epochs: int = 1
    steps: int | None = None  # overrides epochs when set
    global_batch_size: int = 128
    optimizer: str = "adam"
    learning_rate: float | None = None
    lr_schedule: str = "cosine"
    seed: int = 42
    model_dir: str = "runs/default"
    data_dir: str | None = None
    steps_per_execution: int = 1
    log_every: int = 100
    eval_every: int = 0  # steps between test-set evaluations on the chief; 0: at the end only
    checkpoint_every: int | None = None  # steps; epoch ends and the end always checkpoint
    all_reduce: str = "auto"
    startup_timeout: float = 120.0
    # ps-sync: gradients averaged into one update (None: one per worker).
    replicas_to_aggregate: int | None = None
    synthetic_data: bool = False
    dry_run: bool = False
    cluster: ClusterConfig = field(default=LOCAL)

    @property
    def steps_per_epoch(self) -> int:
        return max(1, TRAIN_EXAMPLES // self.global_batch_size)

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.epochs * self.steps_per_epoch

    @property
    def peak_learning_rate(self) -> float:
        return self.learning_rate or DEFAULT_LEARNING_RATE[self.optimizer]

    def learning_rate_at(self, step: int) -> float:
        """The rate the optimizer uses at ``step`` (Keras's CosineDecay, alpha 0)."""
        if self.lr_schedule != "cosine":
            return self.peak_learning_rate
        done = min(step, self.total_steps) / max(1, self.total_steps)
        return self.peak_learning_rate * 0.5 * (1 + math.cos(math.pi * done))

    def defining_flags(self, strategy: str) -> dict:
        """What ``run.json`` records: the resolved strategy kind and the peak rate,
        so ``--strategy=auto`` and a default rate compare by what they mean."""
        return {
            "strategy": strategy, "model": self.model, "optimizer": self.optimizer,
            "learning_rate": self.peak_learning_rate, "lr_schedule": self.lr_schedule,
            "global_batch_size": self.global_batch_size, "seed": self.seed,
            "total_steps": self.total_steps,
        }

    @property
    def gradients_per_update(self) -> int:
        """K: fresh gradients averaged into one applied update (1 unless ps-sync)."""
        if self.replicas_to_aggregate is not None:
            return self.replicas_to_aggregate
        return max(1, self.cluster.num_tasks("worker")) if self._aggregates() else 1

    @property
    def examples_per_gradient(self) -> int:
        """Each of the K gradients behind one update is computed on global/K examples."""
        return self.global_batch_size // self.gradients_per_update

    def schedule(self, start_step: int = 0):
        """The run's cadences (calls, logs, evaluations, checkpoints) from ``start_step``."""
        from training.schedule import Schedule

        return Schedule(
            total_steps=self.total_steps, steps_per_epoch=self.steps_per_epoch,
            steps_per_execution=self.steps_per_execution,
            checkpoint_every=self.checkpoint_every, eval_every=self.eval_every,
            log_every=self.log_every, start_step=start_step,
        )

    def validate(self) -> None:
        """Raise ConfigError naming the first bad value; touches nothing."""
        choices = {
            "strategy": kinds.names(), "model": MODEL_NAMES,
            "optimizer": OPTIMIZERS, "all_reduce": ALL_REDUCE,
            "lr_schedule": LR_SCHEDULES,
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(
                    f"unknown --{name.replace('_', '-')} {value!r}; allowed: {', '.join(allowed)}"
                )
        positive = {
            "epochs": self.epochs, "global_batch_size": self.global_batch_size,
            "steps_per_execution": self.steps_per_execution, "log_every": self.log_every,
            "startup_timeout": self.startup_timeout,
        }
        if self.steps is not None:
            positive["steps"] = self.steps
        if self.checkpoint_every is not None:
            positive["checkpoint_every"] = self.checkpoint_every
        if self.learning_rate is not None:
            positive["learning_rate"] = self.learning_rate
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
        if self.global_batch_size > TRAIN_EXAMPLES:
            raise ConfigError(
                f"--global-batch-size={self.global_batch_size} is larger than MNIST's "
                f"{TRAIN_EXAMPLES} training examples; use at most {TRAIN_EXAMPLES}"
            )
        if self.total_steps > MAX_STEPS:
            flag = "--steps" if self.steps is not None else "--epochs"
            value = self.steps if self.steps is not None else self.epochs
            raise ConfigError(
                f"{flag}={value} means {self.total_steps} steps, more than the {MAX_STEPS} "
                f"a run may ask for; use fewer (one epoch is {self.steps_per_epoch} steps)"
            )
        if not self.model_dir or not self.model_dir.strip():
            raise ConfigError(
                f"--model-dir={self.model_dir!r} is empty; pass a directory path "
                "(it is created if missing)"
            )
        self._validate_aggregation()
        if os.path.exists(self.model_dir) and not os.path.isdir(self.model_dir):
            raise ConfigError(
                f"--model-dir {self.model_dir!r} exists and is not a directory; "
                "pass a directory path (it is created if missing)"
            )

    def _aggregates(self) -> bool:
        """Whether the chosen strategy kind averages K gradients per update."""
        kind = kinds.all_kinds().get(self.strategy)  # auto never picks such a kind
        return kind is not None and kind.aggregates_gradients

    def _validate_aggregation(self) -> None:
        """--replicas-to-aggregate: ps-sync only, 1..workers, and dividing the global batch."""
        k = self.replicas_to_aggregate
        if k is not None and not self._aggregates():
            able = "|".join(name for name, kind in kinds.all_kinds().items()
                            if kind.aggregates_gradients)
            raise ConfigError(
                f"--replicas-to-aggregate applies to --strategy {able} only, received "
                f"--strategy {self.strategy}; drop the flag or use --strategy {able}"
            )
        if not self._aggregates():
            return
        if k is not None and k < 1:
            raise ConfigError(
                f"--replicas-to-aggregate={k} is not allowed; it must be at least 1 "
                "(gradients averaged into one update)"
            )
        workers = self.cluster.num_tasks("worker")
        if k is not None and workers and k > workers:
            # Every gradient of one update comes from a worker holding that
            # step's token, and there are only N tokens per step.
            raise ConfigError(
                f"--replicas-to-aggregate={k} is more than the {workers} worker(s) of this "
                f"cluster; use at most {workers} (the other N - K workers are backups)"
            )
        per_update = self.gradients_per_update
        if self.global_batch_size % per_update:
            raise ConfigError(
                f"--global-batch-size={self.global_batch_size} does not split into "
                f"{per_update} gradients of equal size (each update averages "
                f"--replicas-to-aggregate={per_update} gradients of global/K examples); "
                f"use a multiple of {per_update}"
            )


def check_model_dir(path: str) -> None:
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
                f"--model-dir {path!r} cannot be created: {parent!r} is not a directory; "
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
            f"--model-dir {path!r} is not a writable directory ({reason}); pass a "
            "directory this task can create and write"
        ) from None
    finally:
        for d in created:  # only what this check made
            try:
                os.rmdir(d)
            except (OSError, ValueError):
                pass
