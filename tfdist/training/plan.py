"""A run resolved once: flags + cluster + strategy kind + task -> one frozen ``RunPlan``.

Everything that depends on more than one of them is decided here and
nowhere else: K (gradients per update), the global batch (TensorFlow's
convention when unset), the replicas in sync and this task's devices, the
split sizes and so the steps, the optimizer the run uses, the schedule.
``train.py --dry-run`` prints ``RunPlan.describe()``.

TensorFlow-free: GPUs and the task's split sizes come in as arguments (the
caller lists GPUs and inspects a user's task; the built-in tasks' sizes
are known up front).
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

from tfdist.protocol import ConfigError
from tfdist.strategies import ALL_REDUCE, check_batch_size, kinds
from tfdist.strategies.devices import plan_devices
from tfdist.strategies.kinds import StrategyKind
from tfdist.strategies.tf_config import ClusterConfig
from tfdist.training.pipeline import stages as pipeline_stages
from tfdist.training.workload import DATA_ORDER, tasks
from tfdist.training.config import (
    DEFAULT_LEARNING_RATE, DEFAULT_LR_SCHEDULE, DEFAULT_OPTIMIZER, DEFINING_FLAGS, MAX_STEPS,
    PER_REPLICA_BATCH, TrainConfig,
)
from tfdist.training.workload.tasks import TaskSpec


@dataclass(frozen=True)
class OptimizerPlan:
    """What the run trains with: the library's optimizer (built-in tasks, or a
    user task whose optimizer a flag overrides), or the task's own."""

    library: bool  # False: the optimizer the task compiled
    name: str | None = None  # adam | sgd when ``library``
    learning_rate: float | None = None  # the peak rate when ``library``
    schedule: str | None = None  # cosine | constant when ``library``

    def rate_at(self, step: int, total_steps: int) -> float | None:
        """The rate at ``step`` (Keras's CosineDecay, alpha 0); None for a task's own."""
        if not self.library:
            return None
        if self.schedule != "cosine":
            return self.learning_rate
        done = min(step, total_steps) / max(1, total_steps)
        return self.learning_rate * 0.5 * (1 + math.cos(math.pi * done))


@dataclass(frozen=True)
class ShardingPlan:
    """Which variables are split over the ps tasks (``training.sharding``)."""

    partitioner: str = "none"  # none | min-size | fixed
    num_shards: int = 1  # the ps tasks; 1 keeps a split layout that reshards
    min_bytes: int = 1 << 20


@dataclass(frozen=True)
class RunPlan:
    """A run resolved once, passed down frozen: the flags, the cluster, the strategy kind,
    the task's spec and sizes, K, the global batch, replicas, steps and epochs, the
    optimizer, sharding and the pipeline's cut. Owns every derived number; nothing
    after it resolves again (``--dry-run`` prints it)."""

    config: TrainConfig
    cluster: ClusterConfig
    kind: StrategyKind
    task: TaskSpec
    gradients_per_update: int  # K: fresh gradients averaged into one update (1 unless ps-sync)
    global_batch_size: int
    batch_chosen: bool  # True: TensorFlow's convention, no --global-batch-size given
    replicas: int  # replicas sharing one global batch
    devices: dict
    train_examples: int | None  # None: a streamed split (--steps given)
    test_examples: int | None
    total_steps: int
    steps_per_epoch: int
    optimizer: OptimizerPlan
    sharding: ShardingPlan = ShardingPlan()
    pipeline: "pipeline_stages.PipelinePlan | None" = None  # --strategy pipeline only
    # N: batches each replica sums its gradients over before one update (a step
    # is N batches; a model's own train_step is called on each, its applies routed); 1: none.
    accumulation_steps: int = 1
    # ps read-ahead (training.ps.read_ahead): each step's weights read during the step before.
    read_ahead: bool = False
    # --shard-state: the training state split over the workers (training.sync.zero); "off": not.
    shard_state: str = "off"
    # Steps per tf.function call: --steps-per-execution, else the model's compile(...), else 1.
    steps_per_execution: int = 1
    # --eval-shards resolved: the shards each evaluation is cut into under ps and
    # ps-sync (training.ps.sharded_eval); unused elsewhere.
    eval_shards: int = 1

    @property
    def trainer(self) -> str:
        """The training loop (one of ``kinds.LOOPS``): the kind's, or ``placed`` for a
        pipelined kind's model the cut cannot carry (``training.pipeline.placed``)."""
        return "placed" if self.pipeline is not None and self.pipeline.placed else \
            self.kind.trainer

    @property
    def examples_per_gradient(self) -> int:
        """Each of the K gradients behind one update is computed on global/K examples."""
        return self.global_batch_size // self.gradients_per_update

    @property
    def in_memory(self) -> bool:
        """A finite train split is held whole; an infinite or unknown one is streamed."""
        return self.train_examples is not None

    def learning_rate_at(self, step: int) -> float | None:
        return self.optimizer.rate_at(step, self.total_steps)

    def schedule(self, start_step: int = 0):
        """The run's cadences (calls, logs, evaluations, checkpoints) from ``start_step``."""
        from tfdist.training.loop.schedule import Schedule

        c = self.config
        return Schedule(
            total_steps=self.total_steps, steps_per_epoch=self.steps_per_epoch,
            steps_per_execution=self.steps_per_execution, checkpoint_every=c.checkpoint_every,
            eval_every=c.eval_every, log_every=c.log_every, start_step=start_step,
            export_every=(c.export_every or 0) if c.export else 0,
        )

    def defining_flags(self) -> dict:
        """What ``run.json`` records: the resolved kind, task and optimizer, so
        ``--strategy=auto`` and a default rate compare by what they mean."""
        opt = self.optimizer
        return {
            "strategy": self.kind.name, "task": self.task.name,
            "optimizer": opt.name if opt.library else "task's own",
            "learning_rate": opt.learning_rate if opt.library else None,
            "lr_schedule": opt.schedule if opt.library else None,
            "global_batch_size": self.global_batch_size, "seed": self.config.seed,
            "total_steps": self.total_steps,
            "variable_partitioner": self.sharding.partitioner,
            "shard_min_bytes": self.sharding.min_bytes,
            # A pipeline's checkpoint holds one object per stage: S is part of the run.
            "pipeline_stages": self.pipeline.stages if self.pipeline else None,
            # A step is this many batches: the data position and the updates depend on it.
            "gradient_accumulation_steps": self.accumulation_steps,
            # The order a seed gives (workload.data): another one would change the
            # remaining epochs' batches.
            "data_order": DATA_ORDER,
        }

    def batch_note(self) -> str | None:
        """The chief's line saying how a default global batch was chosen."""
        if not self.batch_chosen or not self.cluster.is_chief:
            return None
        per_replica = tasks.per_replica_batch(self.task, PER_REPLICA_BATCH)
        return (f"global batch {self.global_batch_size}: {per_replica} per replica "
                f"x {self.global_batch_size // per_replica} (TensorFlow's "
                "convention; --global-batch-size sets it)")

    def strategy_note(self) -> str | None:
        """The chief's line naming the strategy ``--strategy=auto`` chose (once per run)."""
        if self.config.strategy != kinds.AUTO or not self.cluster.is_chief:
            return None
        return kinds.auto_note(self.kind, self.cluster)

    def describe(self) -> dict:
        """The plan as ``--dry-run`` prints it (JSON)."""
        cluster, kind = self.cluster, self.kind
        return {
            "strategy": kind.name,
            "requested_strategy": self.config.strategy,
            "task": cluster.member_name,
            "training_task": self.task.name,
            "role": kind.role(cluster),
            "is_chief": cluster.is_chief,
            "action": kind.duty(cluster),
            "cluster": cluster.cluster_dict(),
            "num_workers": cluster.num_workers,
            "num_ps": cluster.num_ps,
            "replicas_in_sync": self.replicas,
            "global_batch_size": self.global_batch_size,
            "per_replica_batch_size": self.global_batch_size // self.replicas,
            "gradients_per_update": self.gradients_per_update,
            "gradient_accumulation_steps": self.accumulation_steps,
            "read_ahead": self.read_ahead,
            "shard_state": self.shard_state,
            "train_examples": self.train_examples,
            "variable_partitioner": self.sharding.partitioner,
            "shards_per_split_variable": self.sharding.num_shards,
            "total_steps": self.total_steps,
            "stuck_timeout": self.config.stuck_timeout,
            "devices": {**self.devices, "cpu": True},
            "model_dir": self.config.model_dir,
            **({"pipeline": self.pipeline.describe()} if self.pipeline else {}),
        }


@dataclass(frozen=True)
class RunRequest:
    """A run's flags read once: checked on their own, the strategy's kind chosen for this
    cluster, the task named (not yet imported). Everything after takes this, never the
    flags again; ``resolve`` adds what needs the task's sizes and the devices."""

    config: TrainConfig
    kind: StrategyKind
    task: TaskSpec

    def with_config(self, config: TrainConfig) -> "RunRequest":
        return dataclasses.replace(self, config=config)


def request(config: TrainConfig, task_object=None) -> RunRequest:
    """The one place a run's flags are checked, its kind chosen and its task spec parsed.

    ``task_object``: a task given as an object (the Python API in one process)
    instead of ``config.task``'s spec string."""
    config.validate()
    kind = kinds.resolve(config.strategy, config.cluster)
    config = config.with_model_dir(kind.name)
    spec = (tasks.parse_spec(config.task, config.task_options) if task_object is None
            else tasks.object_spec(task_object, config.task))
    return RunRequest(config=config, kind=kind, task=spec)


def resolve(run: RunRequest | TrainConfig, gpus: list[str], *,
            train_examples: int | None = None, test_examples: int | None = None,
            task_accumulation: int | None = None, own_train_step: bool = False,
            task_steps_per_execution: int | None = None,
            placed: str | None = None) -> RunPlan:
    """The one place a run is planned; ConfigError for anything that cannot run.

    ``train_examples`` None with no ``--steps``: the task's size is not known
    yet (a user's task before it is inspected), and the plan says so by
    raising; callers that only check flags pass ``--steps``-free built-ins.
    A bare ``TrainConfig`` is read first (``request``). The ``task_*`` and
    ``own_train_step`` keywords: what the inspected task says (``contract.plan_facts``);
    ``placed``: why a pipelined kind trains the model placed (``placed.why_placed``).
    """
    if isinstance(run, TrainConfig):
        run = request(run)
    config, kind, spec = run.config, run.kind, run.task
    cluster = config.cluster
    if config.all_reduce not in ALL_REDUCE:
        raise ConfigError(f"unknown --all-reduce {config.all_reduce!r}; allowed: "
                          f"{', '.join(ALL_REDUCE)}")
    k = _gradients_per_update(config, kind, cluster)
    for flag, value in (("--all-reduce-bucket", config.all_reduce_bucket),
                        ("--carry-all-reduce", config.carry_all_reduce)):
        if value is not None and not kind.buckets_all_reduce:
            able = "|".join(name for name, other in kinds.all_kinds().items()
                            if other.buckets_all_reduce)
            raise ConfigError(
                f"{flag} applies to --strategy {able} only (gradients all-reduced "
                f"between processes), received --strategy {kind.name}; drop the flag")
    devices = plan_devices(kind.gpu_roles(), cluster, gpus)
    replicas = kind.replicas(cluster, len(devices["visible_gpus"]))
    if kind.pipelined:
        replicas *= config.pipelines  # each copy takes its share of the batch
    else:
        _no_pipeline_flags(config, kind)
    chosen = config.global_batch_size is None
    per_replica = tasks.per_replica_batch(spec, PER_REPLICA_BATCH)
    batch = per_replica * replicas * k if chosen else config.global_batch_size
    if batch % k:
        raise ConfigError(
            f"--global-batch-size={batch} does not split into {k} gradients of equal size "
            f"(each update averages --replicas-to-aggregate={k} gradients of global/K "
            f"examples); use a multiple of {k}")
    check_batch_size(batch, replicas)
    if train_examples is not None and batch > train_examples:
        raise ConfigError(
            f"--global-batch-size={batch} is larger than task {spec.name}'s {train_examples} "
            f"training examples; use at most {train_examples}")
    accumulation = _accumulation(config, spec, task_accumulation)
    why = kind.optimizer_refusals.get("gradient_accumulation_steps")
    if accumulation > 1 and why:
        raise ConfigError(f"--gradient-accumulation-steps {accumulation} cannot be honoured "
                          f"under {kind.name}: {why}; drop it for this strategy")
    steps_per_epoch = max(1, train_examples // (batch * accumulation)) if train_examples else 1
    total = config.steps
    if total is None and train_examples is None:
        raise ConfigError(
            f"task {spec.name!r}: its training split's size is not known, so epochs cannot be "
            "counted; pass --steps N")
    total = config.epochs * steps_per_epoch if total is None else total
    if total > MAX_STEPS:
        flag, value = ("--steps", config.steps) if config.steps is not None else (
            "--epochs", config.epochs)
        raise ConfigError(
            f"{flag}={value} means {total} steps, more than the {MAX_STEPS} a run may ask for; "
            f"use fewer (one epoch is {steps_per_epoch} steps)")
    return RunPlan(
        pipeline=_pipeline(config, kind, batch, placed), config=config, cluster=cluster,
        kind=kind, task=spec,
        gradients_per_update=k, global_batch_size=batch, batch_chosen=chosen,
        replicas=replicas, devices=devices, train_examples=train_examples,
        test_examples=test_examples, total_steps=total, steps_per_epoch=steps_per_epoch,
        optimizer=_optimizer(config, spec), sharding=_sharding(config, kind, cluster),
        accumulation_steps=accumulation, read_ahead=_read_ahead(config, kind, own_train_step),
        shard_state=_shard_state(config, kind, replicas, own_train_step),
        steps_per_execution=_steps_per_execution(config, spec, task_steps_per_execution),
        eval_shards=eval_shards(config.eval_shards, cluster.num_members("worker")))


def _pipeline(config: TrainConfig, kind: StrategyKind, batch: int, placed: str | None):
    """A pipelined kind's cut (or placement: ``placed``), None for any other kind."""
    if not kind.pipelined:
        return None
    return pipeline_stages.make_plan(config.cluster.num_members("worker"), config.micro_batches,
                                     config.pipelines, config.stages, batch, config.schedule,
                                     placed)


# --eval-shards auto: shards per worker, as tf_keras's pss_evaluation_shards="auto".
EVAL_SHARDS_PER_WORKER = 5


def eval_shards(value: str, workers: int) -> int:
    """--eval-shards as a count (auto: ``EVAL_SHARDS_PER_WORKER`` x workers); ConfigError
    for anything but a positive whole number or auto."""
    if value == "auto":
        return EVAL_SHARDS_PER_WORKER * max(1, workers)
    try:
        shards = int(value)
    except ValueError:
        shards = 0
    if shards < 1 or str(shards) != value.strip():
        raise ConfigError(f"--eval-shards={value!r} is not allowed; use a positive whole "
                          f"number of shards (e.g. 10), or auto ({EVAL_SHARDS_PER_WORKER} per "
                          "worker)")
    return shards




def _shard_state(config: TrainConfig, kind: StrategyKind, replicas: int,
                 own_train_step: bool) -> str:
    """--shard-state: refused, in one line, where the run cannot split its state."""
    level = config.shard_state
    if level == "off":
        return level
    flag = f"--shard-state {level}"
    if kind.shard_state_refusal:
        able = "|".join(name for name, other in kinds.all_kinds().items()
                        if not other.shard_state_refusal)
        raise ConfigError(f"{flag} cannot be honoured under --strategy {kind.name}: "
                          f"{kind.shard_state_refusal}; use --strategy {able}, or drop the flag")
    why = None
    if replicas != config.cluster.num_workers:
        why = (f"the workers have {replicas} replicas in all, and the sharded update takes "
               "one replica (one device) per worker; hide all but one GPU per worker")
    elif own_train_step:
        why = ("the model overrides train_step, which applies its own optimizer to the whole "
               "model; move the logic into call()/compute_loss()")
    elif config.carry_all_reduce == "on":
        why = ("--carry-all-reduce on carries an all-reduce, and the sharded update has none "
               "(a reduce-scatter and an all-gather); drop --carry-all-reduce")
    if why:
        raise ConfigError(f"{flag} cannot be honoured: {why}")
    return level


def _read_ahead(config: TrainConfig, kind: StrategyKind, own_train_step: bool) -> bool:
    """--read-ahead on: refused where it cannot read anything ahead."""
    asked = config.read_ahead
    if asked is not None and not kind.reads_ahead:
        able = "|".join(name for name, other in kinds.all_kinds().items() if other.reads_ahead)
        raise ConfigError(
            f"--read-ahead {asked} applies to --strategy {able} only (workers reading their "
            f"next weights from the ps while they compute), received --strategy {kind.name}; "
            "drop the flag")
    if asked != "on":
        return False
    if own_train_step:
        raise ConfigError(
            "--read-ahead on cannot be honoured: the model overrides train_step, which "
            "reads its weights itself; drop the flag")
    return True


def _accumulation(config: TrainConfig, spec: TaskSpec, task_value: int | None) -> int:
    """N: the flag, else the task's own optimizers' (unless a flag replaced them), else 1.
    A model's own train_step too: its applies are routed to the library's
    accumulation (``training.loop.step.DirectApply``), which replaces Keras's."""
    if config.gradient_accumulation_steps is not None:
        return config.gradient_accumulation_steps
    if task_value and not (tasks.flags_set_optimizer(spec) or config.optimizer_overridden):
        return int(task_value)
    return 1


def _steps_per_execution(config: TrainConfig, spec: TaskSpec, task_value: int | None) -> int:
    """The flag, else the model's compile(steps_per_execution=N), else 1; the two
    disagreeing is one line (neither would be what the other asked for)."""
    flag = config.steps_per_execution
    if flag is not None and task_value is not None and flag != task_value:
        raise ConfigError(
            f"--steps-per-execution {flag} disagrees with task {spec.name!r}'s model, compiled "
            f"with steps_per_execution={task_value}; drop the flag or pass "
            f"--steps-per-execution {task_value}")
    return flag or task_value or 1


def _no_pipeline_flags(config: TrainConfig, kind: StrategyKind) -> None:
    """--micro-batches, --pipelines and --stages are refused where nothing is pipelined."""
    given = [f"--{name.replace('_', '-')} {value}" for name, value, unset in (
        ("micro_batches", config.micro_batches, 1), ("pipelines", config.pipelines, 1),
        ("stages", config.stages, None), ("schedule", config.schedule, None))
        if value != unset]
    if given:
        able = "|".join(name for name, other in kinds.all_kinds().items() if other.pipelined)
        raise ConfigError(
            f"{' '.join(given)} cut the model into pipeline stages, which --strategy "
            f"{kind.name} does not; drop the flag(s) or use --strategy {able}")


def _sharding(config: TrainConfig, kind: StrategyKind, cluster: ClusterConfig) -> ShardingPlan:
    """--variable-partitioner: min-size by default where variables live on ps tasks."""
    if kind.min_ps == 0:
        if config.variable_partitioner not in (None, "none"):
            able = "|".join(name for name, other in kinds.all_kinds().items() if other.min_ps)
            raise ConfigError(
                f"--variable-partitioner {config.variable_partitioner} splits variables over ps "
                f"tasks, and --strategy {kind.name} has none; drop the flag or use --strategy "
                f"{able}")
        return ShardingPlan("none", 1, config.shard_min_bytes)
    return ShardingPlan(config.variable_partitioner or "min-size", max(1, cluster.num_ps),
                        config.shard_min_bytes)


def _optimizer(config: TrainConfig, spec: TaskSpec) -> OptimizerPlan:
    """Built-in tasks train with the flags (their defaults when unset); a user's
    task with its own compiled optimizer unless a flag overrides it."""
    if not tasks.flags_set_optimizer(spec) and not config.optimizer_overridden:
        return OptimizerPlan(library=False)
    name = config.optimizer or DEFAULT_OPTIMIZER
    return OptimizerPlan(
        library=True, name=name,
        learning_rate=config.learning_rate or DEFAULT_LEARNING_RATE[name],
        schedule=config.lr_schedule or DEFAULT_LR_SCHEDULE,
    )


def _gradients_per_update(config: TrainConfig, kind: StrategyKind, cluster: ClusterConfig) -> int:
    """K, and --replicas-to-aggregate's checks: ps-sync only, 1..workers."""
    k = config.replicas_to_aggregate
    if not kind.aggregates_gradients:
        if k is not None:
            able = "|".join(name for name, other in kinds.all_kinds().items()
                            if other.aggregates_gradients)
            raise ConfigError(
                f"--replicas-to-aggregate applies to --strategy {able} only, received "
                f"--strategy {config.strategy}; drop the flag or use --strategy {able}")
        return 1
    workers = cluster.num_members("worker")
    if k is not None and workers and k > workers:
        # Every gradient of one update comes from a worker holding that
        # step's token, and there are only N tokens per step.
        raise ConfigError(
            f"--replicas-to-aggregate={k} is more than the {workers} worker(s) of this "
            f"cluster; use at most {workers} (the other N - K workers are backups)")
    return k if k is not None else max(1, workers)


__all__ = ["DEFINING_FLAGS", "OptimizerPlan", "RunPlan", "RunRequest", "request", "resolve"]
