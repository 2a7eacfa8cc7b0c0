"""Where this task's cluster comes from: ``TF_CONFIG``, a Slurm job step or a JobSet pod.

Every source ends in the same frozen ``ClusterConfig``; nothing after this
point knows which one was used.
"""

from __future__ import annotations

from typing import Mapping

from tfdist.strategies.tf_config import ClusterConfig, ConfigError, from_environ

CLUSTER_RESOLVERS = ("tf_config", "slurm", "jobset")


def cluster_from_environ(
    resolver: str,
    environ: Mapping[str, str],
    *,
    slurm_ps: int | None = None,
    slurm_port: int | None = None,
) -> ClusterConfig:
    if resolver not in CLUSTER_RESOLVERS:
        raise ConfigError(
            f"unknown --cluster-resolver {resolver!r}; allowed: {', '.join(CLUSTER_RESOLVERS)}"
        )
    if resolver != "slurm":
        given = [f for f, v in (("--slurm-ps", slurm_ps), ("--slurm-port", slurm_port)) if v is not None]
        if given:
            # Silently ignoring them would run a different cluster than asked for.
            raise ConfigError(
                f"{' and '.join(given)} only apply to --cluster-resolver=slurm, "
                f"received --cluster-resolver={resolver}; add --cluster-resolver=slurm or drop them"
            )
    if resolver == "tf_config":
        return from_environ(environ)
    if resolver == "jobset":
        from tfdist.strategies.jobset import from_jobset

        return from_jobset(environ)
    from tfdist.strategies.slurm import DEFAULT_PORT, from_slurm

    return from_slurm(
        environ,
        num_ps=0 if slurm_ps is None else slurm_ps,
        port=DEFAULT_PORT if slurm_port is None else slurm_port,
    )
