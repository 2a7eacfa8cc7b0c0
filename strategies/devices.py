"""Which local GPUs a task uses: a pure plan, then one call that applies it.

Parameter servers only hold variables, so they never take a GPU; several
worker processes on one host split the host's GPUs between them instead of
all grabbing GPU 0.
"""

from __future__ import annotations

from tfdist.strategies.tf_config import TRAINING_ROLES, ClusterConfig


def _host(address: str) -> str:
    return address.rpartition(":")[0]


def local_rank(cluster: ClusterConfig, gpu_roles: tuple[str, ...] = TRAINING_ROLES) -> tuple[int, int]:
    """(this task's rank, number of GPU-using tasks) on this task's host.

    ``gpu_roles``: the roles that take GPUs (the strategy kind's; under ps
    the chief only coordinates, so it takes no share).
    """
    if cluster.is_local or cluster.task_type not in gpu_roles:
        return 0, 1
    host = _host(cluster.address)
    peers = [
        (role, i)
        for role, i, addr in cluster.members()
        if role in gpu_roles and _host(addr) == host
    ]
    return peers.index((cluster.task_type, cluster.task_index)), len(peers)


def plan_devices(gpu_roles: tuple[str, ...], cluster: ClusterConfig, gpus: list[str]) -> dict:
    """Split ``gpus`` (names of this host's physical GPUs) for this task."""
    role = "local" if cluster.is_local else cluster.task_type
    if role != "local" and role not in gpu_roles:
        # ps: variables only; a ps coordinator dispatches and evaluates a
        # small model on the CPU, leaving every GPU to the workers.
        visible: list[str] = []
    else:
        rank, sharing = local_rank(cluster, gpu_roles)
        if sharing <= 1 or not gpus:
            visible = list(gpus)
        elif len(gpus) >= sharing:
            visible = [g for i, g in enumerate(gpus) if i % sharing == rank]
        else:
            visible = [gpus[rank % len(gpus)]]
    return {
        "visible_gpus": visible,
        "hidden_gpus": [g for g in gpus if g not in visible],
        "memory_growth": bool(visible),
    }


def configure_devices(gpu_roles: tuple[str, ...], cluster: ClusterConfig) -> dict:
    """Apply :func:`plan_devices` before TensorFlow initialises its runtime.

    Nothing here may start the runtime (no logical-device listing, no eager
    op): MultiWorkerMirroredStrategy must configure collectives first.
    """
    import tensorflow as tf

    physical = tf.config.list_physical_devices("GPU")
    plan = plan_devices(gpu_roles, cluster, [d.name for d in physical])
    keep = [d for d in physical if d.name in plan["visible_gpus"]]
    tf.config.set_visible_devices(keep, "GPU")
    for device in keep:
        tf.config.experimental.set_memory_growth(device, True)
    return plan
