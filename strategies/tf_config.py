"""Parse and validate ``TF_CONFIG`` into one frozen object.

This module is the only place that reads ``TF_CONFIG`` (``from_environ``);
everything else receives a :class:`ClusterConfig`, whether it came from here
or from a Slurm job step (``strategies/slurm.py``) or a JobSet pod (``strategies/jobset.py``).
"""

from __future__ import annotations

import ipaddress
import json
import re
import reprlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from tfdist.protocol import ConfigError  # re-exported: ``from strategies.tf_config import ConfigError``

ROLES = ("chief", "worker", "ps", "evaluator")
# Tasks that run training steps (ps only holds variables, evaluator only reads).
TRAINING_ROLES = ("chief", "worker")
EXPECTED_SHAPE = (
    '{"cluster": {"worker": ["host:port", ...], ...}, '
    '"task": {"type": "worker", "index": 0}}'
)


@dataclass(frozen=True)
class ClusterConfig:
    """What ``TF_CONFIG`` says about the cluster and about this process.

    ``task_type`` is ``None`` when no ``TF_CONFIG`` is set: a single local
    process, which is the chief of its one-task "cluster".
    """

    roles: Mapping[str, tuple[str, ...]]  # TF_CONFIG's "cluster": role -> addresses
    task_type: str | None = None
    task_index: int = 0
    environment: str | None = None

    def __post_init__(self):
        # Freeze the mapping too, so the dataclass is immutable all the way down.
        object.__setattr__(self, "roles", MappingProxyType(dict(self.roles)))

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
            and "chief" not in self.roles
        )

    @property
    def member_name(self) -> str:
        return "local:0" if self.is_local else f"{self.task_type}:{self.task_index}"

    @property
    def address(self) -> str | None:
        if self.is_local or self.task_type not in self.roles:
            return None  # local, or an evaluator kept outside the cluster
        return self.roles[self.task_type][self.task_index]

    def num_members(self, role: str) -> int:
        return len(self.roles.get(role, ()))

    @property
    def num_workers(self) -> int:
        """Tasks that run training steps (chief + workers), at least 1."""
        return max(1, sum(self.num_members(r) for r in TRAINING_ROLES))

    @property
    def num_ps(self) -> int:
        return self.num_members("ps")

    def members(self) -> list[tuple[str, int, str]]:
        """Every task as ``(role, index, address)``, in role order."""
        return [
            (role, i, addr)
            for role in ROLES
            for i, addr in enumerate(self.roles.get(role, ()))
        ]

    def cluster_dict(self) -> dict[str, list[str]]:
        return {role: list(addrs) for role, addrs in self.roles.items()}

    def to_json(self) -> str:
        """The TF_CONFIG this object came from (normalised)."""
        data: dict = {"cluster": self.cluster_dict()}
        if not self.is_local:
            data["task"] = {"type": self.task_type, "index": self.task_index}
        if self.environment is not None:
            data["environment"] = self.environment
        return json.dumps(data)


LOCAL = ClusterConfig(roles={})


# Values from the user are shown through this: bounded in length and depth
# (a TF_CONFIG can be megabytes, or nested thousands deep), and, being reprs,
# always on one line whatever control characters the value holds.
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 3, 80, 80, 40
_SHOWN.maxlist = _SHOWN.maxdict = 4


def _show(value) -> str:
    return _SHOWN.repr(value)


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


TASK_KEYS = ("type", "index", "trial")  # "trial": set by hyperparameter tuners, unused
EXAMPLE_ADDRESS = "e.g. 'localhost:2222', 'node-1.example.com:2222' or '[::1]:2222'"
_PORT = re.compile(r"[0-9]{1,5}")
# One DNS label, as resolvers accept it (underscores included: Docker's names).
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_SCOPE = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # an IPv6 zone: an interface name or number
_ENVIRONMENT = re.compile(r"[A-Za-z0-9_.-]{0,64}")
_INDEX_TEXT = re.compile(r"0|[1-9][0-9]{0,8}")
LOOPBACK = "this machine's loopback"


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _host_key(host: str, bracketed: bool, where: str, address: str) -> str:
    """Validate ``host``; return a key equal for two spellings of one host."""
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{where} is {_show(address)}: {why}; expected 'host:port', {EXAMPLE_ADDRESS}")

    if bracketed:
        ip_text, _, scope = host.partition("%")
        try:
            ip = ipaddress.IPv6Address(ip_text)
        except ValueError:
            raise bad(f"{_show(host)} in brackets is not an IPv6 address") from None
        if "%" in host and not _SCOPE.fullmatch(scope):
            raise bad(f"the IPv6 zone {_show(scope)} is not an interface name")
        return _ip_key(ip, scope, bad)
    if not host:
        raise bad("the host is missing")
    if ":" in host:
        raise bad("an IPv6 address must be written in brackets, like '[::1]:2222'")
    if not host.isascii():
        try:
            ascii_form = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise bad("the host name is not ASCII and has no IDNA (punycode) form") from None
        raise bad(f"the host name is not ASCII; write its IDNA (punycode) form {_show(ascii_form)}")
    try:
        return _ip_key(ipaddress.IPv4Address(host), "", bad)
    except ipaddress.AddressValueError:
        pass
    name = host[:-1] if host.endswith(".") else host  # a trailing dot: the same, fully qualified
    labels = name.split(".")
    if len(name) > 253:
        raise bad(f"the host name has {len(name)} characters; at most 253 are allowed")
    for label in labels:
        if not label:
            raise bad("the host name has an empty label (two dots in a row, or a leading dot)")
        if len(label) > 63:
            raise bad(f"the host name has a label of {len(label)} characters; at most 63 are allowed")
        if not _LABEL.fullmatch(label):
            raise bad(
                f"the host name label {_show(label)} may hold only letters, digits, '-' and '_', "
                "and may not start or end with '-'"
            )
    if labels[-1].isdigit():
        raise bad(
            "the host is not a valid IPv4 address (write four decimal parts without "
            "leading zeros, like 127.0.0.1) and not a host name"
        )
    name = name.lower()
    return LOOPBACK if name == "localhost" or name.endswith(".localhost") else name


def _ip_key(ip, scope: str, bad) -> str:
    mapped = getattr(ip, "ipv4_mapped", None)
    if mapped is not None:
        ip = mapped
    if ip.is_unspecified or ip.is_multicast or str(ip) == "255.255.255.255":
        raise bad(
            f"{ip} is not an address another task can connect to; "
            "name the host's own address or name"
        )
    if ip.is_loopback:
        return LOOPBACK
    return f"{ip}%{scope}" if scope else str(ip)


def _check_address(role: str, index: int, address) -> tuple[str, int]:
    """Validate one ``host:port``; return a key equal for two spellings of it."""
    where = f"TF_CONFIG cluster.{role}[{index}]"
    if not isinstance(address, str) or not address:
        raise ConfigError(
            f"{where} is {_show(address)}; expected a 'host:port' string, {EXAMPLE_ADDRESS}"
        )
    scheme, sep, rest = address.partition("://")
    if sep:
        raise ConfigError(
            f"{where} is {_show(address)}, with a scheme prefix {_show(scheme + sep)}; "
            f"TF_CONFIG addresses are plain 'host:port' (the protocol is gRPC), so write {_show(rest.split('/')[0])}"
        )
    if not address.isprintable() or any(c.isspace() for c in address):
        raise ConfigError(
            f"{where} is {_show(address)}, which holds spaces or control characters; "
            f"expected 'host:port', {EXAMPLE_ADDRESS}"
        )
    bracketed = address.startswith("[")
    if bracketed:
        host, close, port = address[1:].partition("]")
        if not close or not port.startswith(":"):
            raise ConfigError(
                f"{where} is {_show(address)}; an IPv6 address is written '[address]:port', "
                "like '[::1]:2222'"
            )
        port = port[1:]
    else:
        host, colon, port = address.rpartition(":")
        if not colon:
            port = None
    if port is not None and _PORT.fullmatch(port) and port[0] == "0" and 0 < int(port) < 65536:
        # The same port as without the zeros: two spellings that would hide a clash.
        raise ConfigError(
            f"{where} is {_show(address)}, whose port has leading zeros; "
            f"write it as {int(port)} ({_show(address[: -len(port)] + str(int(port)))})"
        )
    if port is None or not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        why = "no port" if port is None else f"the port {_show(port)}"
        raise ConfigError(
            f"{where} is {_show(address)}, with {why}; expected 'host:port' with a port "
            f"from 1 to 65535 in plain ASCII digits, {EXAMPLE_ADDRESS}"
        )
    return _host_key(host, bracketed, where, address), int(port)


def _member_index(member: dict, task_type: str, count: int) -> int:
    index = member.get("index", 0)
    allowed = f"an integer from 0 to {count - 1}"
    # TensorFlow's resolver takes int(index), so "1" works there and here; but
    # bool is an int in Python ("index": true is a mistake, not task 1), and
    # int() would also take " 1", "+1", "1_0" and non-ASCII digits.
    if isinstance(index, str) and _INDEX_TEXT.fullmatch(index):
        index = int(index)
    elif isinstance(index, bool) or not isinstance(index, int):
        raise ConfigError(
            f"TF_CONFIG task.index is {_show(index)}; expected {allowed} (a JSON number, "
            'or a string of digits like "1")'
        )
    if not 0 <= index < count:
        raise ConfigError(
            f"TF_CONFIG task.index is {_show(index)}, out of range for {task_type!r}, "
            f"which has {count} task(s); allowed: 0 to {count - 1}"
        )
    return index


def parse_tf_config(text: str | None) -> ClusterConfig:
    """Validate a ``TF_CONFIG`` JSON string (``None``/empty: local process).

    Total: every input gives a ``ClusterConfig`` the real run can use, or a
    ``ConfigError`` whose message is one line.
    """
    if text is None or not text.strip():
        return LOCAL
    data = _load(text)
    parsed = _parse_cluster(data["cluster"])
    task_type, index = _parse_member(data["task"], parsed)
    environment = _check_extras(data)
    return ClusterConfig(
        roles=parsed, task_type=task_type, task_index=index, environment=environment
    )


def _load(text: str) -> dict:
    """The JSON object, with only known keys and both required ones."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"TF_CONFIG is not valid JSON ({err.msg} at char {err.pos}): "
            f"received {_show(text)}; expected {EXPECTED_SHAPE}"
        ) from None
    except _DuplicateKey as err:
        raise ConfigError(
            f"TF_CONFIG names the key {_show(err.args[0])} twice in one object, and only one "
            f"can count; write each key once; expected {EXPECTED_SHAPE}"
        ) from None
    except RecursionError:
        raise ConfigError(
            f"TF_CONFIG is nested too deeply to read ({_show(text)}); expected {EXPECTED_SHAPE}"
        ) from None
    except ValueError as err:  # e.g. an integer past Python's digit limit
        raise ConfigError(
            f"TF_CONFIG cannot be read ({_clip(str(err).splitlines()[0], 80)}): received "
            f"{_show(text)}; expected {EXPECTED_SHAPE}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"TF_CONFIG must be a JSON object, received {_show(text)}; "
            f"expected {EXPECTED_SHAPE}"
        )
    unknown = sorted(set(data) - {"cluster", "task", "environment", "rpc_layer"})
    if unknown:
        raise ConfigError(
            f"TF_CONFIG has unknown key(s) {_show(unknown)}; allowed keys: "
            "cluster, task, environment, rpc_layer"
        )
    for key in ("cluster", "task"):
        if key not in data:
            raise ConfigError(
                f"TF_CONFIG has no {key!r} key (received keys {_show(sorted(data))}); "
                f"expected {EXPECTED_SHAPE}"
            )
    return data


def _parse_cluster(cluster) -> dict[str, tuple[str, ...]]:
    """``cluster``: known roles, non-empty address lists, every host:port once."""
    if not isinstance(cluster, dict) or not cluster:
        raise ConfigError(
            f"TF_CONFIG cluster is {_show(cluster)}; expected a non-empty object "
            "mapping roles (chief, worker, ps, evaluator) to address lists"
        )
    parsed: dict[str, tuple[str, ...]] = {}
    seen: dict[tuple[str, int], tuple[str, str]] = {}
    for role in cluster:
        if role not in ROLES:
            raise ConfigError(
                f"TF_CONFIG cluster has role {_show(role)}; allowed roles: {', '.join(ROLES)}"
            )
        addrs = cluster[role]
        if not isinstance(addrs, list) or not addrs:
            raise ConfigError(
                f"TF_CONFIG cluster.{role} is {_show(addrs)}; expected a non-empty "
                "list of 'host:port' strings"
            )
        for i, addr in enumerate(addrs):
            key = _check_address(role, i, addr)
            if key in seen:
                first, written = seen[key]
                same = (
                    f"address {_show(addr)} is used twice ({first} and {role}:{i})"
                    if written == addr else
                    f"addresses {_show(written)} ({first}) and {_show(addr)} ({role}:{i}) "
                    f"are the same host:port"
                    + (f" ({LOOPBACK})" if key[0] == LOOPBACK else "")
                )
                raise ConfigError(
                    f"TF_CONFIG {same}; every task needs its own host:port"
                )
            seen[key] = (f"{role}:{i}", addr)
        parsed[role] = tuple(addrs)
    for role in ("chief", "evaluator"):
        if len(parsed.get(role, ())) > 1:
            raise ConfigError(
                f"TF_CONFIG cluster.{role} has {len(parsed[role])} tasks; "
                f"at most 1 {role} task is allowed"
            )
    if "ps" in parsed and "worker" not in parsed:
        # TensorFlow's rule (ParameterServerStrategy: "There must be at least one worker").
        raise ConfigError(
            f"TF_CONFIG has {len(parsed['ps'])} ps task(s) but no worker, received roles "
            f"{', '.join(parsed)}; a cluster with ps tasks needs at least one worker: add "
            '"worker": ["host:port"]'
        )
    return parsed


def _parse_member(member, parsed: dict[str, tuple[str, ...]]) -> tuple[str, int]:
    """``task``: a type the cluster has (or the evaluator outside it) and an index in range."""
    if not isinstance(member, dict):
        raise ConfigError(
            f"TF_CONFIG task is {_show(member)}; expected an object like "
            '{"type": "worker", "index": 0}'
        )
    unknown = sorted(set(member) - set(TASK_KEYS))
    if unknown:
        raise ConfigError(
            f"TF_CONFIG task has unknown key(s) {_show(unknown)}; allowed keys: type, index (and trial)"
        )
    task_type = member.get("type")
    # TensorFlow's convention, which Kubeflow's training operator follows: the
    # evaluator is not a member of the training cluster, so its TF_CONFIG may
    # name a task type that the cluster lacks.
    outside = task_type == "evaluator" and task_type not in parsed
    if not isinstance(task_type, str) or (task_type not in parsed and not outside):
        raise ConfigError(
            f"TF_CONFIG task.type is {_show(task_type)}, which is not a role in the "
            f"cluster; allowed: {', '.join(parsed)}"
        )
    count = 1 if outside else len(parsed[task_type])
    index = _member_index(member, task_type, count)
    return task_type, index


def _check_extras(data: dict) -> str | None:
    """``environment`` and ``rpc_layer``, if given; the environment."""
    environment = data.get("environment")
    if environment is not None and (
        not isinstance(environment, str) or not _ENVIRONMENT.fullmatch(environment)
    ):
        raise ConfigError(
            f"TF_CONFIG environment is {_show(environment)}; expected a short name of "
            "letters, digits, '.', '_' or '-', such as 'cloud' (or leave it out)"
        )
    rpc_layer = data.get("rpc_layer")
    if rpc_layer is not None and rpc_layer != "grpc":
        raise ConfigError(
            f"TF_CONFIG rpc_layer is {_show(rpc_layer)}; this project runs over gRPC only: "
            "use \"grpc\" or leave it out"
        )
    return environment


def from_environ(environ: Mapping[str, str]) -> ClusterConfig:
    """The single reader of ``TF_CONFIG`` in this project."""
    return parse_tf_config(environ.get("TF_CONFIG"))


def tf_config_set(environ: Mapping[str, str]) -> bool:
    """Whether ``TF_CONFIG`` names a cluster, for sources that must not meet one."""
    return bool((environ.get("TF_CONFIG") or "").strip())


def require_source(environ: Mapping[str, str], resolver: str, source: str,
                   names: tuple[str, ...], how_to_run: str) -> None:
    """For a cluster source other than TF_CONFIG: its variables are all set, TF_CONFIG is not.

    ``source`` names what was looked for ("Slurm job step"); one ConfigError line otherwise.
    """
    missing = [name for name in names if not environ.get(name)]
    if missing:
        raise ConfigError(
            f"--cluster-resolver={resolver} found no {source}: {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set; {how_to_run}"
        )
    if tf_config_set(environ):
        # Two descriptions of one cluster: which one wins would be a guess.
        raise ConfigError(
            f"--cluster-resolver={resolver}, but TF_CONFIG is set too; unset TF_CONFIG, or use "
            "--cluster-resolver=tf_config to take the cluster from it"
        )
