"""Strategy selection: read the cluster once (TF_CONFIG or Slurm), build one strategy."""

from strategies.cluster import CLUSTER_RESOLVERS, cluster_from_environ
from strategies.factory import (
    ALL_REDUCE,
    STRATEGY_NAMES,
    StrategyBundle,
    check_batch_size,
    make_strategy,
    replicas_per_step,
    resolve_strategy_name,
)
from strategies.tf_config import ROLES, ClusterConfig, ConfigError, from_environ, parse_tf_config

__all__ = [
    "ALL_REDUCE",
    "CLUSTER_RESOLVERS",
    "ROLES",
    "STRATEGY_NAMES",
    "ClusterConfig",
    "ConfigError",
    "StrategyBundle",
    "check_batch_size",
    "cluster_from_environ",
    "from_environ",
    "make_strategy",
    "parse_tf_config",
    "replicas_per_step",
    "resolve_strategy_name",
]
