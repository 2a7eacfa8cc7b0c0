"""Parse and validate ``TF_CONFIG`` into one frozen object.

This module is the only place that reads ``TF_CONFIG`` (``from_environ``);
everything else receives a :class:`ClusterConfig`, whether it came from here
or from a Slurm job step (``strategies/slurm.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

ROLES = ("chief", "worker", "ps", "evaluator")
# Tasks that run training steps (ps only holds variables, evaluator only reads).
TRAINING_ROLES = ("chief", "worker")
EXPECTED_SHAPE = (
    '{"cluster": {"worker": ["host:port", ...], ...}, '
    '"task": {"type": "worker", "index": 0}}'
)


class ConfigError(ValueError):
    """Bad user input. ``str(err)`` is the one line shown to the user."""


@dataclass(frozen=True)
class ClusterConfig:
    """What ``TF_CONFIG`` says about the cluster and about this process.

    ``task_type`` is ``None`` when no ``TF_CONFIG`` is set: a single local
    process, which is the chief of its one-task "cluster".
    """

    cluster: Mapping[str, tuple[str, ...]]
    task_type: str | None = None
    task_index: int = 0
    environment: str | None = None

    def __post_init__(self):
        # Freeze the mapping too, so the dataclass is immutable all the way down.
        object.__setattr__(self, "cluster", MappingProxyType(dict(self.cluster)))

    @property
    def is_local(self) -> bool:
        return self.task_type is None

    @property
    def is_chief(self) -> bool:
        """The one task that writes checkpoints, logs and results.

        TensorFlow's rule: the ``chief`` task if the cluster has one, else
        ``worker:0``; a process without TF_CONFIG is its own chief.
        """
        if self.is_local:
            return True
        if self.task_type == "chief":
            return True
        return (
            self.task_type == "worker"
            and self.task_index == 0
            and "chief" not in self.cluster
        )

    @property
    def task_name(self) -> str:
        return "local:0" if self.is_local else f"{self.task_type}:{self.task_index}"

    @property
    def address(self) -> str | None:
        if self.is_local or self.task_type not in self.cluster:
            return None  # local, or an evaluator kept outside the cluster
        return self.cluster[self.task_type][self.task_index]

    def num_tasks(self, role: str) -> int:
        return len(self.cluster.get(role, ()))

    @property
    def num_workers(self) -> int:
        """Tasks that run training steps (chief + workers), at least 1."""
        return max(1, sum(self.num_tasks(r) for r in TRAINING_ROLES))

    @property
    def num_ps(self) -> int:
        return self.num_tasks("ps")

    def tasks(self) -> list[tuple[str, int, str]]:
        """Every task as ``(role, index, address)``, in role order."""
        return [
            (role, i, addr)
            for role in ROLES
            for i, addr in enumerate(self.cluster.get(role, ()))
        ]

    def cluster_dict(self) -> dict[str, list[str]]:
        return {role: list(addrs) for role, addrs in self.cluster.items()}

    def to_json(self) -> str:
        """The TF_CONFIG this object came from (normalised)."""
        data: dict = {"cluster": self.cluster_dict()}
        if not self.is_local:
            data["task"] = {"type": self.task_type, "index": self.task_index}
        if self.environment is not None:
            data["environment"] = self.environment
        return json.dumps(data)


LOCAL = ClusterConfig(cluster={})


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_address(role: str, index: int, address) -> str:
    where = f"TF_CONFIG cluster.{role}[{index}]"
    if not isinstance(address, str) or not address:
        raise ConfigError(
            f"{where} is {address!r}; expected a 'host:port' string"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"{where} is {address!r}, which has no valid port; "
            "expected 'host:port' with a port from 1 to 65535, e.g. 'localhost:2222'"
        )
    return address


def parse_tf_config(text: str | None) -> ClusterConfig:
    """Validate a ``TF_CONFIG`` JSON string (``None``/empty: local process)."""
    if text is None or not text.strip():
        return LOCAL
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"TF_CONFIG is not valid JSON ({err.msg} at char {err.pos}): "
            f"received {_clip(text)!r}; expected {EXPECTED_SHAPE}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"TF_CONFIG must be a JSON object, received {_clip(text)!r}; "
            f"expected {EXPECTED_SHAPE}"
        )
    unknown = sorted(set(data) - {"cluster", "task", "environment", "rpc_layer"})
    if unknown:
        raise ConfigError(
            f"TF_CONFIG has unknown key(s) {unknown}; allowed keys: "
            "cluster, task, environment, rpc_layer"
        )
    for key in ("cluster", "task"):
        if key not in data:
            raise ConfigError(
                f"TF_CONFIG has no {key!r} key (received keys {sorted(data)}); "
                f"expected {EXPECTED_SHAPE}"
            )

    cluster = data["cluster"]
    if not isinstance(cluster, dict) or not cluster:
        raise ConfigError(
            f"TF_CONFIG cluster is {cluster!r}; expected a non-empty object "
            "mapping roles (chief, worker, ps, evaluator) to address lists"
        )
    parsed: dict[str, tuple[str, ...]] = {}
    seen: dict[str, str] = {}
    for role in cluster:
        if role not in ROLES:
            raise ConfigError(
                f"TF_CONFIG cluster has role {role!r}; allowed roles: {', '.join(ROLES)}"
            )
        addrs = cluster[role]
        if not isinstance(addrs, list) or not addrs:
            raise ConfigError(
                f"TF_CONFIG cluster.{role} is {addrs!r}; expected a non-empty "
                "list of 'host:port' strings"
            )
        for i, addr in enumerate(addrs):
            _check_address(role, i, addr)
            if addr in seen:
                raise ConfigError(
                    f"TF_CONFIG address {addr!r} is used twice ({seen[addr]} and "
                    f"{role}:{i}); every task needs its own host:port"
                )
            seen[addr] = f"{role}:{i}"
        parsed[role] = tuple(addrs)
    for role in ("chief", "evaluator"):
        if len(parsed.get(role, ())) > 1:
            raise ConfigError(
                f"TF_CONFIG cluster.{role} has {len(parsed[role])} tasks; "
                f"at most 1 {role} task is allowed"
            )

    task = data["task"]
    if not isinstance(task, dict):
        raise ConfigError(
            f"TF_CONFIG task is {task!r}; expected an object like "
            '{"type": "worker", "index": 0}'
        )
    task_type = task.get("type")
    # TensorFlow's convention, which Kubeflow's training operator follows: the
    # evaluator is not a member of the training cluster, so its TF_CONFIG may
    # name a task type that the cluster lacks.
    outside = task_type == "evaluator" and task_type not in parsed
    if task_type not in parsed and not outside:
        raise ConfigError(
            f"TF_CONFIG task.type is {task_type!r}, which is not a role in the "
            f"cluster; allowed: {', '.join(parsed)}"
        )
    count = 1 if outside else len(parsed[task_type])
    index = task.get("index", 0)
    # bool is an int in Python; "index": true is a mistake, not task 1.
    if isinstance(index, bool) or not isinstance(index, int):
        raise ConfigError(
            f"TF_CONFIG task.index is {index!r}; expected an integer "
            f"from 0 to {count - 1}"
        )
    if not 0 <= index < count:
        raise ConfigError(
            f"TF_CONFIG task.index is {index}, out of range for {task_type!r}, "
            f"which has {count} task(s); allowed: 0 to {count - 1}"
        )
    environment = data.get("environment")
    if environment is not None and not isinstance(environment, str):
        raise ConfigError(
            f"TF_CONFIG environment is {environment!r}; expected a string such as 'cloud'"
        )
    return ClusterConfig(
        cluster=parsed, task_type=task_type, task_index=index, environment=environment
    )


def from_environ(environ: Mapping[str, str]) -> ClusterConfig:
    """The single reader of ``TF_CONFIG`` in this project."""
    return parse_tf_config(environ.get("TF_CONFIG"))


def tf_config_set(environ: Mapping[str, str]) -> bool:
    """Whether ``TF_CONFIG`` names a cluster, for sources that must not meet one."""
    return bool((environ.get("TF_CONFIG") or "").strip())
