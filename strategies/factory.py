"""The one public strategy factory.

Every rule about a strategy lives in its kind (``strategies.kinds``); this is
the single entry point that turns a name and a cluster into a built strategy.
"""

from __future__ import annotations

from tfdist.strategies import kinds
from tfdist.strategies.kinds import StrategyBundle
from tfdist.strategies.tf_config import ClusterConfig, ConfigError


def make_strategy(name: str, cluster: ClusterConfig, *, all_reduce: str = "auto",
                  bucket_bytes: int | None = None) -> StrategyBundle:
    """Build the ``tf.distribute`` strategy ``name`` (or ``auto``) names for this task.

    For a parameter-server kind this must run on the chief (the coordinator);
    ps and worker tasks only serve (see ``strategies.server``).
    """
    return build_kind(kinds.resolve(name, cluster), cluster, all_reduce=all_reduce,
                      bucket_bytes=bucket_bytes)


def build_kind(kind, cluster: ClusterConfig, *, all_reduce: str = "auto",
               bucket_bytes: int | None = None) -> StrategyBundle:
    """``kind.build``, with the bucket size passed only when one is given: a
    registered kind's build may not know the keyword (only kinds that bucket
    their all-reduce take it)."""
    extra = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    return kind.build(cluster, all_reduce=all_reduce, **extra)


def check_batch_size(global_batch_size: int, replicas: int) -> None:
    if global_batch_size <= 0 or global_batch_size % replicas:
        raise ConfigError(
            f"--global-batch-size={global_batch_size} does not divide evenly over "
            f"{replicas} replica(s); use a positive multiple of {replicas}"
        )
