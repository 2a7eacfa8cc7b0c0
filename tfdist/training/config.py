"""The frozen run configuration: ``train.py``'s flags, checked on their own.

What follows from the flags *and* the cluster, the strategy kind and the
task (K, the global batch, replicas, steps) is resolved once, into a
``training.plan.RunPlan``.

**Adding a training option** (``--accumulation-steps``, ``--schedule``, ...): one
field of ``tfdist.options.TrainOptions``, declared with ``tfdist.flags.option(default, help,
group=..., ...)``. That field is ``train.py``'s flag (built by
``tfdist.cli.train``, nothing to write there), its ``--help`` line and default,
``tfdist.TrainOptions``'s argument and what ``fit``/``launch`` pass to every
task. ``TrainOptions`` and the checks that need only the options live in
``tfdist/options.py`` (the launcher carries them typed); check a value that needs
the strategy, the task or the cluster in ``TrainConfig.validate``. Never repeat its default
elsewhere: ``tests/test_options.py`` checks.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field

from tfdist.flags import option
from tfdist.models import DEFAULT_TASK
from tfdist.protocol import ConfigError, default_model_dir
from tfdist.strategies.tf_config import LOCAL, ClusterConfig
from tfdist.options import (  # noqa: F401 (their home is tfdist.options; named here too)
    OPTIMIZERS, DEFAULT_LEARNING_RATE, LR_SCHEDULES, PIPELINE_SCHEDULES, PARTITIONERS,
    GRADIENT_DTYPES, OFFERED_GRADIENT_DTYPES, SHARD_STATE_LEVELS, DEFAULT_OPTIMIZER,
    DEFAULT_LR_SCHEDULE, MAX_SEED, MAX_STEPS, DEFAULT_STUCK_TIMEOUT, STUCK_TIMEOUT_RANGE,
    OUTPUT, PER_REPLICA_BATCH, TrainOptions, parse_size,
)

# The flags that define what a run's checkpoints are: resuming with any of
# them changed would mix two runs (``training.loop.survival.checkpoints.check_run_record``).
# ``total_steps`` is recorded too, but a resume may extend a run. ``data_order``
# is the input pipeline's order version (``workload.DATA_ORDER``); a record
# without it was written with order 1.
DEFINING_FLAGS = ("strategy", "task", "optimizer", "learning_rate", "lr_schedule",
                  "global_batch_size", "seed", "variable_partitioner", "shard_min_bytes",
                  "pipeline_stages", "gradient_accumulation_steps", "data_order")


def _strategy_help() -> str:
    from tfdist.strategies import kinds

    return ("; ".join(f"{name}: {kind.summary}" for name, kind in kinds.all_kinds().items())
            + "; auto: ps with ps tasks, multiworker with several workers, else mirrored "
            "(the run's first line says which)")


def _strategies() -> tuple[str, ...]:
    from tfdist.strategies import kinds

    return kinds.names()


def _task_help() -> str:
    from tfdist.models import BUILTIN_TASKS

    return ("what to train: a built-in (" + ", ".join(BUILTIN_TASKS) + "), an import path "
            "pkg.mod[:NAME] or a file path/to/task.py providing build_model() and dataset(split)")





@dataclass(frozen=True)
class TrainConfig(TrainOptions):
    """One task's run as ``train.py`` reads it: the strategy and the task, the options,
    and the cluster (from ``TF_CONFIG``); frozen, checked by :meth:`validate`."""

    strategy: str = option("auto", _strategy_help, choices=_strategies, group="cluster")
    task: str = option(DEFAULT_TASK, _task_help, group="training")
    dry_run: bool = option(False, "print the resolved plan as JSON and exit without starting "
                           "anything", group=OUTPUT)
    cluster: ClusterConfig = field(default=LOCAL)

    @classmethod
    def from_options(cls, options: TrainOptions, **fields) -> "TrainConfig":
        """A config of ``options`` (the Python API's) and the rest (strategy, task, ...)."""
        values = {f.name: getattr(options, f.name) for f in dataclasses.fields(TrainOptions)}
        return cls(**{**values, **fields})

    @property
    def bucket_bytes(self) -> int | None:
        """--all-reduce-bucket in bytes (None: the strategy's default)."""
        return parse_size(self.all_reduce_bucket, "--all-reduce-bucket")

    @property
    def optimizer_overridden(self) -> bool:
        """Whether a flag asked for an optimizer other than a task's own."""
        return any(v is not None for v in (self.optimizer, self.learning_rate, self.lr_schedule))

    def validate(self) -> None:
        """Raise ConfigError naming the first bad value; touches nothing."""
        self.check()
        from tfdist.training.loop.export import check_export_flags
        from tfdist.training.loop.profiling import parse_steps

        check_export_flags(self.export, self.export_every)
        parse_steps(self.profile_steps)
        if self.model_dir is not None:
            check_model_dir_path(self.model_dir)

    def with_model_dir(self, strategy: str) -> "TrainConfig":
        """This config with its run directory: ``--model-dir``, else the one rule
        (``protocol.default_model_dir`` of the strategy as resolved), checked."""
        if self.model_dir is not None:
            return self
        path = default_model_dir(strategy)
        check_model_dir_path(path)
        return dataclasses.replace(self, model_dir=path)


def check_model_dir_path(path: str) -> None:
    """A ``--model-dir`` value that can name a directory (nothing is touched)."""
    if not path or not path.strip():
        raise ConfigError(
            f"--model-dir={path!r} is empty; pass a directory path (it is created if missing)"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(
            f"--model-dir {path!r} exists and is not a directory; "
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
