"""The frozen run configuration that ``train.run`` takes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from models import MODEL_NAMES
from strategies import ALL_REDUCE, STRATEGY_NAMES, ClusterConfig, ConfigError
from strategies.tf_config import LOCAL

OPTIMIZERS = ("adam", "sgd")
LR_SCHEDULES = ("cosine", "constant")
TRAIN_EXAMPLES = 60_000  # MNIST train split; checked against tfds in the tests


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
    ps_shards: int = 1
    startup_timeout: float = 120.0
    synthetic_data: bool = False
    dry_run: bool = False
    cluster: ClusterConfig = field(default=LOCAL)

    @property
    def steps_per_epoch(self) -> int:
        return max(1, TRAIN_EXAMPLES // self.global_batch_size)

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.epochs * self.steps_per_epoch

    def validate(self) -> None:
        """Raise ConfigError naming the first bad value; touches nothing."""
        choices = {
            "strategy": STRATEGY_NAMES, "model": MODEL_NAMES,
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
            "ps_shards": self.ps_shards, "startup_timeout": self.startup_timeout,
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
        if self.ps_shards > 1:
            # Measured: Keras 3 layers fail on the ShardedVariable a partitioner
            # makes ("'ShardedVariable' object has no attribute 'handle'").
            raise ConfigError(
                f"--ps-shards={self.ps_shards} is not supported: Keras 3 layers cannot use "
                "partitioned (sharded) variables; use --ps-shards=1 (whole variables are "
                "spread round-robin over the ps tasks)"
            )
        if os.path.exists(self.model_dir) and not os.path.isdir(self.model_dir):
            raise ConfigError(
                f"--model-dir {self.model_dir!r} exists and is not a directory; "
                "pass a directory path (it is created if missing)"
            )
