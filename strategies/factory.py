"""The one public strategy factory, and the pure rules it applies.

``resolve_strategy_name`` and ``check_batch_size`` import nothing from
TensorFlow, so ``train.py --dry-run`` and the tests can apply every rule
without starting a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strategies.tf_config import ClusterConfig, ConfigError

# "none": TensorFlow's default strategy, i.e. no distribution at all; the
# single-process baseline the benchmark compares every strategy against.
STRATEGY_NAMES = ("auto", "none", "mirrored", "multiworker", "ps")
ALL_REDUCE = ("auto", "ring", "nccl")


def resolve_strategy_name(name: str, cfg: ClusterConfig) -> str:
    """Turn ``name`` (possibly ``auto``) into a concrete strategy, or raise."""
    if name not in STRATEGY_NAMES:
        raise ConfigError(
            f"unknown strategy {name!r}; allowed: {', '.join(STRATEGY_NAMES)}"
        )
    if name == "auto":
        if cfg.num_ps:
            return "ps"
        return "multiworker" if cfg.num_workers > 1 else "mirrored"
    if name == "ps":
        if not cfg.num_ps:
            raise ConfigError(
                f"--strategy=ps needs a 'ps' job in TF_CONFIG, received roles "
                f"{sorted(cfg.cluster) or 'none (no TF_CONFIG)'}; add "
                '"ps": ["host:port"] or use --strategy=multiworker'
            )
        if "chief" not in cfg.cluster:
            raise ConfigError(
                f"--strategy=ps needs a 'chief' task (the coordinator) in TF_CONFIG, "
                f"received roles {sorted(cfg.cluster)}; add \"chief\": [\"host:port\"]"
            )
    if name == "multiworker" and cfg.num_ps:
        raise ConfigError(
            f"--strategy=multiworker is all-reduce and takes no 'ps' job, but "
            f"TF_CONFIG has {cfg.num_ps} ps task(s); remove the ps job or use --strategy=ps"
        )
    if name in ("none", "mirrored") and len(cfg.tasks()) > 1:
        raise ConfigError(
            f"--strategy={name} is one process, but TF_CONFIG describes "
            f"{len(cfg.tasks())} tasks; unset TF_CONFIG or use --strategy=multiworker|ps"
        )
    return name


def replicas_per_step(strategy: str, cfg: ClusterConfig, local_gpus: int) -> int:
    """How many replicas share one global batch.

    Sync strategies split it over every replica of every worker; under ps each
    worker runs whole steps on its own, split only over its local devices.
    """
    if strategy == "none":
        return 1  # one device, whatever the host has
    local = max(1, local_gpus)
    if strategy == "multiworker":
        return cfg.num_workers * local
    return local


def check_batch_size(global_batch_size: int, replicas: int) -> None:
    if global_batch_size <= 0 or global_batch_size % replicas:
        raise ConfigError(
            f"--global-batch-size={global_batch_size} does not divide evenly over "
            f"{replicas} replica(s); use a positive multiple of {replicas}"
        )


@dataclass(frozen=True)
class StrategyBundle:
    name: str
    strategy: Any
    coordinator: Any = None  # a ClusterCoordinator, for ps only


def _cluster_resolver(cfg: ClusterConfig):
    import tensorflow as tf

    # Built from our parsed config, so TF never reads TF_CONFIG on its own.
    # The evaluator is a side-car, not a member of the training cluster.
    jobs = {r: list(a) for r, a in cfg.cluster.items() if r != "evaluator"}
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(jobs),
        task_type=cfg.task_type,
        task_id=cfg.task_index,
        rpc_layer="grpc",
    )


def make_strategy(
    name: str,
    cfg: ClusterConfig,
    *,
    all_reduce: str = "auto",
    ps_shards: int = 1,
) -> StrategyBundle:
    """Build the ``tf.distribute`` strategy named ``name`` for this task.

    For ``ps`` this must run on the chief (the coordinator); ps and worker
    tasks only serve (see ``strategies.server``).
    """
    name = resolve_strategy_name(name, cfg)
    import tensorflow as tf

    if name == "none":
        return StrategyBundle(name, tf.distribute.get_strategy())
    if name == "mirrored":
        return StrategyBundle(name, tf.distribute.MirroredStrategy())
    if name == "multiworker":
        if all_reduce not in ALL_REDUCE:
            raise ConfigError(
                f"unknown --all-reduce {all_reduce!r}; allowed: {', '.join(ALL_REDUCE)}"
            )
        impl = tf.distribute.experimental.CommunicationImplementation
        options = tf.distribute.experimental.CommunicationOptions(
            implementation={"auto": impl.AUTO, "ring": impl.RING, "nccl": impl.NCCL}[
                all_reduce
            ]
        )
        return StrategyBundle(
            name,
            tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=_cluster_resolver(cfg), communication_options=options
            ),
        )
    if name == "ps":
        if cfg.task_type != "chief":
            raise ConfigError(
                f"the ps strategy object is built by the chief only; this task is "
                f"{cfg.task_name}, which serves (run train.py, not make_strategy)"
            )
        partitioner = None
        if ps_shards > 1:
            # Large variables are cut into at most ps_shards pieces of at least
            # 64 KiB, so they spread over the ps tasks instead of landing on one.
            partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
                min_shard_bytes=64 << 10, max_shards=ps_shards
            )
        strategy = tf.distribute.experimental.ParameterServerStrategy(
            _cluster_resolver(cfg), variable_partitioner=partitioner
        )
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        return StrategyBundle(name, strategy, coordinator)
    raise ConfigError(  # unreachable while STRATEGY_NAMES and the branches agree
        f"unknown strategy {name!r}; allowed: {', '.join(STRATEGY_NAMES)}"
    )
