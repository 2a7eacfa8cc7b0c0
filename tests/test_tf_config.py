"""TF_CONFIG parsing and the strategy rules: pure, no TensorFlow runtime."""

import dataclasses
import json

import pytest

from strategies import ConfigError, kinds, parse_tf_config
from strategies.devices import local_rank, plan_devices


def tfc(cluster, task_type, index=0, **extra):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}, **extra})


PS_CLUSTER = {"chief": ["h1:2222"], "worker": ["h1:2223", "h2:2222"], "ps": ["h2:2223"]}


def test_no_tf_config_is_a_local_chief():
    cfg = parse_tf_config(None)
    assert cfg.is_local and cfg.is_chief and cfg.num_workers == 1 and cfg.num_ps == 0
    assert parse_tf_config("  ").is_local


def test_parses_roles_addresses_and_chief():
    cfg = parse_tf_config(tfc(PS_CLUSTER, "worker", 1))
    assert (cfg.task_type, cfg.task_index, cfg.address) == ("worker", 1, "h2:2222")
    assert not cfg.is_chief
    assert cfg.num_workers == 3 and cfg.num_ps == 1
    assert cfg.tasks()[0] == ("chief", 0, "h1:2222")
    assert parse_tf_config(tfc(PS_CLUSTER, "chief")).is_chief


def test_worker_zero_is_chief_only_without_a_chief_task():
    workers = {"worker": ["a:1", "b:1"]}
    assert parse_tf_config(tfc(workers, "worker", 0)).is_chief
    assert not parse_tf_config(tfc(workers, "worker", 1)).is_chief
    assert not parse_tf_config(tfc({"chief": ["c:1"], **workers}, "worker", 0)).is_chief


def test_kubeflow_environment_key_is_accepted():
    cfg = parse_tf_config(tfc({"worker": ["job-worker-0.ns.svc:2222"]}, "worker", environment="cloud"))
    assert cfg.environment == "cloud" and cfg.is_chief


def test_config_is_frozen():
    cfg = parse_tf_config(tfc(PS_CLUSTER, "ps"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.task_index = 3
    with pytest.raises(TypeError):
        cfg.cluster["ps"] = ("x:1",)


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
    cfg = parse_tf_config(json.dumps({"cluster": PS_CLUSTER, "task": {"type": "evaluator", "index": 0},
                                      "environment": "cloud"}))
    assert cfg.task_name == "evaluator:0" and cfg.address is None and not cfg.is_chief
    assert parse_tf_config(cfg.to_json()) == cfg
    with pytest.raises(ConfigError, match="index is 1"):
        parse_tf_config(tfc(PS_CLUSTER, "evaluator", 1))
    with pytest.raises(ConfigError, match="'master'"):  # only the evaluator may be missing
        parse_tf_config(tfc(PS_CLUSTER, "master"))
