"""Strategy selection: read the cluster once (TF_CONFIG, Slurm or JobSet), ask its kind."""

from tfdist.strategies.cluster import CLUSTER_RESOLVERS, cluster_from_environ
from tfdist.strategies.factory import check_batch_size, make_strategy
from tfdist.strategies.kinds import ALL_REDUCE, StrategyBundle, StrategyKind
from tfdist.strategies.tf_config import ROLES, ClusterConfig, ConfigError, from_environ, parse_tf_config

__all__ = [
    "ALL_REDUCE",
    "CLUSTER_RESOLVERS",
    "ROLES",
    "ClusterConfig",
    "ConfigError",
    "StrategyBundle",
    "StrategyKind",
    "check_batch_size",
    "cluster_from_environ",
    "from_environ",
    "make_strategy",
    "parse_tf_config",
]
