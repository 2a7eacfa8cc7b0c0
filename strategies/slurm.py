"""The cluster of a Slurm job step, as the same frozen ``ClusterConfig``.

``from_slurm`` is the only reader of Slurm's environment in this project.
It asks TensorFlow's ``SlurmClusterResolver`` for the cluster, so every
task of an ``srun`` step derives the same cluster from the same variables,
and then applies the checks ``parse_tf_config`` applies to ``TF_CONFIG``.

Roles come from the task's rank (``SLURM_PROCID``) in blocks: with
``--slurm-ps N`` rank 0 is the chief, ranks 1..N the ps tasks, the rest
workers; without, every task is a worker (worker:0 is the chief). Tasks on
one node take consecutive ports from ``--slurm-port``.
"""

from __future__ import annotations

import json
from typing import Mapping

from strategies.tf_config import ConfigError, parse_tf_config, tf_config_set

DEFAULT_PORT = 2222
# What the resolver reads inside an srun step (TensorFlow 2.21; it no longer
# runs `scontrol`). SLURMD_NODENAME, set by slurmd per task, is only checked.
STEP_VARS = (
    "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE",
)
HOW_TO_RUN = (
    "run train.py through srun inside an allocation (see slurm/*.sbatch), "
    "or use --cluster-resolver=tf_config"
)


def slurm_jobs(num_tasks: int, num_ps: int) -> dict[str, int]:
    """How many tasks of each role a step of ``num_tasks`` tasks holds (pure)."""
    if num_ps < 0:
        raise ConfigError(f"--slurm-ps={num_ps} is not allowed; use 0 (all workers) or more")
    if num_ps == 0:
        return {"worker": num_tasks}
    workers = num_tasks - 1 - num_ps
    if workers < 1:
        raise ConfigError(
            f"--slurm-ps={num_ps} leaves no worker in a Slurm step of {num_tasks} task(s) "
            f"(1 chief + {num_ps} ps); ask srun for at least {num_ps + 2} tasks or lower --slurm-ps"
        )
    return {"chief": 1, "ps": num_ps, "worker": workers}


def _int_var(environ: Mapping[str, str], name: str, minimum: int) -> int:
    text = environ[name]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(
            f"{name} is {text!r}; expected an integer >= {minimum} as srun sets it; {HOW_TO_RUN}"
        )
    return value


def _resolver_class():
    import tensorflow as tf
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm

    class MappingSlurmResolver(tf.distribute.cluster_resolver.SlurmClusterResolver):
        """TensorFlow's resolver, reading the mapping it is given.

        TensorFlow reads ``os.environ`` in these four hooks only; reading the
        caller's mapping instead keeps ``from_slurm`` the one reader of the
        environment (and lets the tests pass a fake step).
        """

        def __init__(self, environ: Mapping[str, str], **kwargs):
            self._environ = environ
            super().__init__(**kwargs)

        def _resolve_own_rank(self):
            return int(self._environ["SLURM_PROCID"])

        def _resolve_num_tasks(self):
            return int(self._environ["SLURM_STEP_NUM_TASKS"])

        def _resolve_hostlist(self):
            return slurm.expand_hostlist(self._environ["SLURM_STEP_NODELIST"])

        def _resolve_task_configuration(self):
            hosts = self._resolve_hostlist()
            counts = slurm.expand_tasks_per_node(self._environ["SLURM_STEP_TASKS_PER_NODE"])
            return dict(zip(hosts, counts))

    return MappingSlurmResolver


def from_slurm(environ: Mapping[str, str], *, num_ps: int = 0, port: int = DEFAULT_PORT):
    """This task's ``ClusterConfig``, from the variables srun sets for each task."""
    missing = [name for name in STEP_VARS if not environ.get(name)]
    if missing:
        raise ConfigError(
            f"--cluster-resolver=slurm found no Slurm job step: {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set; {HOW_TO_RUN}"
        )
    if tf_config_set(environ):
        raise ConfigError(
            "--cluster-resolver=slurm, but TF_CONFIG is set too; unset TF_CONFIG, or use "
            "--cluster-resolver=tf_config to take the cluster from it"
        )
    if not 0 < port < 65536:
        raise ConfigError(f"--slurm-port={port} is not allowed; use a port from 1 to 65535")
    num_tasks = _int_var(environ, "SLURM_STEP_NUM_TASKS", 1)
    rank = _int_var(environ, "SLURM_PROCID", 0)
    if rank >= num_tasks:
        raise ConfigError(
            f"SLURM_PROCID is {rank}, but SLURM_STEP_NUM_TASKS is {num_tasks}; {HOW_TO_RUN}"
        )
    jobs = slurm_jobs(num_tasks, num_ps)
    try:
        resolver = _resolver_class()(
            environ, jobs=jobs, port_base=port,
            # The resolver hands out one address per GPU slot; one nominal slot
            # per task keeps every task. strategies/devices.py assigns the real
            # GPUs, so the resolver must not set CUDA_VISIBLE_DEVICES itself.
            gpus_per_node=num_tasks, gpus_per_task=1, auto_set_gpu=False,
        )
        spec = resolver.cluster_spec().as_dict()
        task_type, task_index = resolver.get_task_info()
    except (RuntimeError, ValueError) as err:
        raise ConfigError(
            f"Slurm step not understood (SLURM_STEP_NODELIST="
            f"{environ['SLURM_STEP_NODELIST']!r}, SLURM_STEP_TASKS_PER_NODE="
            f"{environ['SLURM_STEP_TASKS_PER_NODE']!r}, SLURM_STEP_NUM_TASKS={num_tasks}): "
            f"{str(err).splitlines()[0]}; {HOW_TO_RUN}"
        ) from None
    # One validation path for every source: the same checks as a TF_CONFIG.
    cfg = parse_tf_config(json.dumps(
        {"cluster": spec, "task": {"type": task_type, "index": task_index}}
    ))
    node = environ.get("SLURMD_NODENAME")
    host = cfg.address.rpartition(":")[0]
    if node and node != host:
        # The resolver orders nodes by name as strings and hands out ranks in
        # blocks; Slurm's own placement can differ (cyclic distribution,
        # node9 before node10), and then tasks would bind on another node.
        raise ConfigError(
            f"Slurm runs SLURM_PROCID={rank} on node {node!r}, but the cluster puts "
            f"{cfg.task_name} at {cfg.address}; start the step with "
            "`srun --distribution=block` and node names that sort the same as text"
        )
    return cfg
