"""TF_CONFIG parsing and the strategy rules: pure, no TensorFlow runtime.

parse_tf_config is total, and the reachability probe never raises: every
input, however malformed, gives either a ClusterConfig whose addresses the
real run (TensorFlow, and our own probe) can use, or a ConfigError whose
message is one short line. No network beyond loopback.
"""

import dataclasses
import json
import random
import socket

import pytest

from tfdist.strategies import ClusterConfig, ConfigError, kinds, parse_tf_config
from tfdist.strategies.devices import local_rank, plan_devices
from tfdist.strategies.server import missing_tasks, reachable
from tfdist.strategies.tf_config import ROLES


def tfc(cluster, task_type="worker", index=0, **extra):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}, **extra})


def outcome(text):
    """A ClusterConfig, or the ConfigError's line; anything else propagates."""
    try:
        return parse_tf_config(text)
    except ConfigError as err:
        line = str(err)
        assert line and "\n" not in line and "\r" not in line, repr(line)
        assert len(line.splitlines()) == 1, repr(line)
        assert len(line) < 600, line[:300]
        return line


def assert_usable(cluster: ClusterConfig):
    """What the real run needs of an accepted config."""
    assert set(cluster.roles) <= set(ROLES) and cluster.roles
    assert "worker" in cluster.roles or "ps" not in cluster.roles
    for role, index, address in cluster.members():
        assert address.isascii() and address.isprintable() and " " not in address
        if address.startswith("["):
            host, _, port = address[1:].partition("]:")
        else:
            host, _, port = address.rpartition(":")
            host.encode("idna")  # what socket.create_connection does first; must not raise
        assert port.isascii() and port.isdigit() and str(int(port)) == port
        assert 0 < int(port) < 65536
    assert isinstance(cluster.task_index, int) and not isinstance(cluster.task_index, bool)
    assert cluster.environment is None or isinstance(cluster.environment, str)
    assert parse_tf_config(cluster.to_json()) == cluster  # the watchdog re-reads it


def test_index_as_numeric_string_is_accepted_like_tensorflow():
    cluster = parse_tf_config(tfc({"worker": ["localhost:1", "localhost:2"]}, "worker", "1"))
    assert cluster.task_index == 1 and cluster.address == "localhost:2"
    assert json.loads(cluster.to_json())["task"]["index"] == 1


@pytest.mark.parametrize("index", ["1.0", "one", " 1", "1 ", "+1", "1_0", "01", "\u0661", "\u00b9", "",
                                   True, False, 1.5, 1.0, None, [1], {"i": 1}])
def test_other_indexes_are_refused(index):
    line = outcome(tfc({"worker": ["localhost:1", "localhost:2"]}, "worker", index))
    assert isinstance(line, str) and "task.index" in line


@pytest.mark.parametrize("address", [
    "localhost:2222", "127.0.0.1:2222", "[::1]:2222", "[::ffff:10.0.0.1]:2222", "[fe80::1%eth0]:1",
    "node-1:1", "NODE-1.Example.COM:65535", "node.example.com.:2222", "a" * 63 + ".b:1",
    "job-worker-0.ns.svc.cluster.local:2222", "web_1:8080", "10.0.0.255:1",
])
def test_addresses_the_run_can_use_are_kept_as_written(address):
    cluster = parse_tf_config(tfc({"worker": [address]}))
    assert cluster.address == address
    assert_usable(cluster)


@pytest.mark.parametrize("first,second", [
    ("localhost:2222", "localhost:2222"),
    ("node:2222", "NODE:2222"),
    ("node.example:2222", "node.example.:2222"),
    ("localhost:2222", "127.0.0.1:2222"),
    ("127.0.0.1:2222", "127.0.0.2:2222"),  # TensorFlow binds every interface
    ("localhost:2222", "[::1]:2222"),
    ("[::1]:2222", "[0::1]:2222"),
    ("10.0.0.1:2222", "[::ffff:10.0.0.1]:2222"),
    ("a.localhost:2222", "localhost:2222"),
])
def test_one_host_port_written_two_ways_is_refused(first, second):
    line = outcome(tfc({"chief": [first], "worker": [second]}, "chief"))
    assert isinstance(line, str) and "chief:0" in line and "worker:0" in line, line


def test_different_ports_or_hosts_are_not_duplicates():
    cluster = parse_tf_config(tfc({"worker": ["localhost:2222", "localhost:2223", "node:2222", "[::2]:2222"]}))
    assert cluster.num_workers == 4


@pytest.mark.parametrize("cluster,role", [
    ({"chief": ["localhost:1"], "ps": ["localhost:2"]}, "chief"),
    ({"ps": ["localhost:2"]}, "ps"),
    ({"chief": ["localhost:1"], "ps": ["localhost:2"], "evaluator": ["localhost:3"]}, "evaluator"),
])
def test_a_ps_cluster_needs_a_worker_as_tensorflow_does(cluster, role):
    line = outcome(tfc(cluster, role))
    assert isinstance(line, str) and "no worker" in line


def test_a_worker_cluster_needs_no_ps_and_evaluator_is_as_before():
    assert parse_tf_config(tfc({"chief": ["localhost:1"]}, "chief")).is_chief
    cluster = parse_tf_config(tfc({"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ["localhost:3"]},
                              "evaluator"))
    assert cluster.member_name == "evaluator:0" and cluster.address is None


@pytest.mark.parametrize("environment,ok", [
    ("cloud", True), ("google", True), ("", True), (None, True),
    (1, False), (["cloud"], False), ({"a": 1}, False), ("a b", False), ("x" * 65, False), ("cl\u00f6ud", False),
])
def test_environment(environment, ok):
    result = outcome(tfc({"worker": ["localhost:1"]}, environment=environment))
    assert isinstance(result, ClusterConfig) == ok, result
    if ok:
        assert result.environment == environment


@pytest.mark.parametrize("rpc_layer,ok", [
    ("grpc", True), (None, True), ("", False), ("GRPC", False), ("grpc+verbs", False), (1, False), ([], False),
])
def test_rpc_layer_is_grpc_or_absent(rpc_layer, ok):
    result = outcome(tfc({"worker": ["localhost:1"]}, rpc_layer=rpc_layer))
    assert isinstance(result, ClusterConfig) == ok, result


def test_messages_are_clipped():
    for text in (
        tfc({"worker": ["x" * 1_000_000 + ":1"]}),
        tfc({"worker": ["localhost:1"]}, environment="e" * 1_000_000),
        tfc({"w" * 1_000_000: ["localhost:1"]}),
        tfc({"worker": ["localhost:1"]}, "worker", "9" * 1_000_000),
        json.dumps({"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker"},
                    **{f"k{i}": i for i in range(10_000)}}),
        "{" * 1_000_000,
        "[" * 1_000_000,
    ):
        assert isinstance(outcome(text), str)


# A deterministic fuzzer: valid TF_CONFIGs with one part replaced by something odd.
ODD = [
    None, True, False, 0, -1, 1, 2, 65536, 1.5, float("inf"), "", " ", "1", "01", "1.0", "\u00b2", "\u0662",
    "worker", "chief", "ps", "evaluator", "master", "localhost", "localhost:", ":1", "localhost:0",
    "localhost:02222", "LOCALHOST:2222", "localhost.:2222", "127.0.0.1:2222", "[::1]:2222", "::1:2222",
    "grpc://localhost:1", "host..example:1", "a" * 64 + ":1", "\u00e9" * 70 + ":1", "b\u00fccher:1",
    "\ud800:1", "h\x00:1", "h\n:1", "x" * 300 + ":1", [], {}, [[]], [None], ["localhost:9"], {"type": "worker"},
    [[[[[[[[[[["deep"]]]]]]]]]]], {"a": {"b": {"c": {"d": {}}}}}, "grpc", "cloud", "trial",
]


def mutations(rng: random.Random, base: dict, depth: int = 0):
    """``base`` with one randomly chosen node replaced, renamed, removed or duplicated."""
    doc = json.loads(json.dumps(base))
    node, path = doc, []
    while isinstance(node, (dict, list)) and node and rng.random() < 0.75:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append((node, key))
        node = node[key]
    if not path:
        return rng.choice(ODD)
    parent, key = path[-1]
    action = rng.random()
    if action < 0.6:
        parent[key] = rng.choice(ODD)
    elif action < 0.75 and isinstance(parent, dict):
        parent[str(rng.choice(ODD))] = parent.pop(key)
    elif action < 0.85:
        parent.pop(key)
    elif isinstance(parent, list):
        parent.append(parent[key])
    else:
        parent[key] = [parent[key]]
    return doc


BASES = [
    {"cluster": {"worker": ["localhost:2222", "localhost:2223"]}, "task": {"type": "worker", "index": 1}},
    {"cluster": {"chief": ["h1:2222"], "worker": ["h1:2223", "h2:2222"], "ps": ["h2:2223"]},
     "task": {"type": "ps", "index": 0}, "environment": "cloud", "rpc_layer": "grpc"},
    {"cluster": {"chief": ["[::1]:1"], "worker": ["[::1]:2"], "evaluator": ["[::1]:3"]},
     "task": {"type": "evaluator", "index": 0}},
]


def test_fuzzed_tf_configs_are_a_usable_config_or_one_line():
    rng = random.Random(19)
    accepted = refused = 0
    for _ in range(10_000):
        doc = rng.choice(BASES)
        for _ in range(rng.randint(1, 3)):
            doc = mutations(rng, doc) if isinstance(doc, dict) else doc
        result = outcome(json.dumps(doc))  # anything but ConfigError fails the test
        if isinstance(result, ClusterConfig):
            assert_usable(result)
            accepted += 1
        else:
            refused += 1
    assert accepted > 100 and refused > 5000, (accepted, refused)  # both sides exercised


def test_fuzzed_text_is_a_config_or_one_line():
    rng = random.Random(18)
    valid = json.dumps(BASES[1])
    alphabet = '{}[]":,. 0123456789-+eE\\u\u00b2\u0662\ud800\x00\nabcdefgklnoprstuwxyz'
    for _ in range(10_000):
        chars = list(valid)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(chars))
            op = rng.random()
            if op < 0.4:
                chars[i] = rng.choice(alphabet)
            elif op < 0.7:
                del chars[i]
            else:
                chars.insert(i, rng.choice(alphabet))
        result = outcome("".join(chars))
        if isinstance(result, ClusterConfig):
            assert_usable(result)


@pytest.mark.parametrize("address", [
    "host..example:2222", "a" * 64 + ".example:2222", "\u00e9" * 70 + ":1", "\udcff:1", "localhost\x00:1",
    "localhost:99999", "localhost:-1", "localhost:x", "localhost:", ":", "", "[::1]:99999", "[::1]:", "[:1",
])
def test_reachable_never_raises(address):
    # A UnicodeError from the idna codec once escaped and killed the watchdog.
    assert reachable(address, timeout=0.2) is False


def test_reachable_sees_a_listening_loopback_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert reachable(f"127.0.0.1:{port}") is True
    assert reachable(f"127.0.0.1:{port}", timeout=0.2) is False


def test_missing_tasks_names_a_peer_with_an_unencodable_host():
    # Built directly, past the parser, as a Slurm step or an older TF_CONFIG could.
    cluster = ClusterConfig(roles={"worker": ("localhost:1", "host..example:2222")},
                        task_type="worker", task_index=0)
    assert missing_tasks(cluster) == ["worker:1 (host..example:2222)"]


PS_CLUSTER = {"chief": ["h1:2222"], "worker": ["h1:2223", "h2:2222"], "ps": ["h2:2223"]}


def test_no_tf_config_is_a_local_chief():
    cluster = parse_tf_config(None)
    assert cluster.is_local and cluster.is_chief and cluster.num_workers == 1 and cluster.num_ps == 0
    assert parse_tf_config("  ").is_local


def test_parses_roles_addresses_and_chief():
    cluster = parse_tf_config(tfc(PS_CLUSTER, "worker", 1))
    assert (cluster.task_type, cluster.task_index, cluster.address) == ("worker", 1, "h2:2222")
    assert not cluster.is_chief
    assert cluster.num_workers == 3 and cluster.num_ps == 1
    assert cluster.members()[0] == ("chief", 0, "h1:2222")
    assert parse_tf_config(tfc(PS_CLUSTER, "chief")).is_chief


def test_worker_zero_is_chief_only_without_a_chief_task():
    workers = {"worker": ["a:1", "b:1"]}
    assert parse_tf_config(tfc(workers, "worker", 0)).is_chief
    assert not parse_tf_config(tfc(workers, "worker", 1)).is_chief
    assert not parse_tf_config(tfc({"chief": ["c:1"], **workers}, "worker", 0)).is_chief


def test_kubeflow_environment_key_is_accepted():
    cluster = parse_tf_config(tfc({"worker": ["job-worker-0.ns.svc:2222"]}, "worker", environment="cloud"))
    assert cluster.environment == "cloud" and cluster.is_chief


def test_config_is_frozen():
    cluster = parse_tf_config(tfc(PS_CLUSTER, "ps"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cluster.task_index = 3
    with pytest.raises(TypeError):
        cluster.roles["ps"] = ("x:1",)


@pytest.mark.parametrize("cluster,expected", [
    ({"worker": ["a:1"]}, "mirrored"),
    ({"worker": ["a:1", "b:1"]}, "multiworker"),
    ({"chief": ["c:1"], "worker": ["a:1"]}, "multiworker"),
    (PS_CLUSTER, "ps"),
])
def test_auto_picks_by_cluster_shape(cluster, expected):
    first = next(iter(cluster))
    assert kinds.resolve("auto", parse_tf_config(tfc(cluster, first))).name == expected


def test_auto_without_tf_config_is_mirrored():
    assert kinds.resolve("auto", parse_tf_config(None)).name == "mirrored"


def test_replicas_per_step():
    mw = parse_tf_config(tfc({"worker": ["a:1", "b:1", "c:1"]}, "worker"))
    assert kinds.get("multiworker").replicas(mw, 0) == 3
    assert kinds.get("multiworker").replicas(mw, 2) == 6
    # Under ps each worker runs whole global batches.
    assert kinds.get("ps").replicas(parse_tf_config(tfc(PS_CLUSTER, "chief")), 0) == 1
    assert kinds.get("none").replicas(parse_tf_config(None), 2) == 1


GPUS = ["/physical_device:GPU:0", "/physical_device:GPU:1"]


def test_ps_tasks_and_ps_chief_get_no_gpu():
    for role in ("ps", "chief"):
        plan = plan_devices(kinds.get("ps").gpu_roles(), parse_tf_config(tfc(PS_CLUSTER, role)), GPUS)
        assert plan["visible_gpus"] == [] and plan["hidden_gpus"] == GPUS


def test_workers_sharing_a_host_split_its_gpus():
    cluster = {"worker": ["h1:1", "h1:2", "h2:1"]}
    cfgs = [parse_tf_config(tfc(cluster, "worker", i)) for i in range(3)]
    assert [local_rank(c) for c in cfgs] == [(0, 2), (1, 2), (0, 1)]
    plans = [plan_devices(kinds.get("multiworker").gpu_roles(), c, GPUS)["visible_gpus"] for c in cfgs]
    assert plans == [[GPUS[0]], [GPUS[1]], GPUS]
    # ps workers on one host: one GPU each; the ps itself none.
    ps_worker = plan_devices(kinds.get("ps").gpu_roles(), parse_tf_config(tfc(PS_CLUSTER, "worker", 0)), GPUS)
    assert ps_worker["visible_gpus"] == GPUS  # its host-mate, the chief, takes none
    assert plan_devices(kinds.get("mirrored").gpu_roles(), parse_tf_config(None), GPUS)["visible_gpus"] == GPUS


def test_bad_tf_config_raises_config_error():
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_tf_config("{nope")


def test_evaluator_may_stay_outside_the_cluster_as_kubeflow_writes_it():
    # The training operator leaves the evaluator out of "cluster".
    cluster = parse_tf_config(json.dumps({"cluster": PS_CLUSTER, "task": {"type": "evaluator", "index": 0},
                                      "environment": "cloud"}))
    assert cluster.member_name == "evaluator:0" and cluster.address is None and not cluster.is_chief
    assert parse_tf_config(cluster.to_json()) == cluster
    with pytest.raises(ConfigError, match="index is 1"):
        parse_tf_config(tfc(PS_CLUSTER, "evaluator", 1))
    with pytest.raises(ConfigError, match="'master'"):  # only the evaluator may be missing
        parse_tf_config(tfc(PS_CLUSTER, "master"))
