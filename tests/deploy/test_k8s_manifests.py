"""The Kubeflow TFJob manifests in k8s/: shape, invariants, and every pod's plan.

For every replica of every TFJob the test builds the TF_CONFIG that Kubeflow's
training operator injects (its genClusterSpec/genTFConfigJSONStr: lower-case
replica types, ``<job>-<type>-<i>.<namespace>.svc:<port>``, the evaluator
left out of the cluster, ``"environment": "cloud"``) and runs the pod's
command, ``train.py <args> --dry-run``, in-process on it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from tfdist.cli import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
DOCS = [(path, doc) for path in sorted(K8S.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
TFJOBS = {doc["metadata"]["name"]: doc for _, doc in DOCS if doc["kind"] == "TFJob"}
POLICIES = [doc for _, doc in DOCS if doc["kind"] == "NetworkPolicy"]
PVCS = {doc["metadata"]["name"]: doc for _, doc in DOCS if doc["kind"] == "PersistentVolumeClaim"}
NAMESPACE = "default"
PORT = 2222  # EXPOSEd by the Dockerfile; TFJob's default port too
JOB_NAME_LABEL = "training.kubeflow.org/job-name"  # set by the operator on every pod
GPU = "nvidia.com/gpu"
# Servers under ps: they serve until the chief is gone, then exit 0.
SERVERS = ("PS", "Worker")


def _replicas(job):
    return job["spec"]["tfReplicaSpecs"]


def _strategy(job) -> str:
    return "ps" if "PS" in _replicas(job) else "multiworker"


def _container(spec) -> dict:
    named = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "tensorflow"]
    assert len(named) == 1, "the operator needs exactly one container named 'tensorflow'"
    return named[0]


def _port(spec) -> int:
    # As the operator does: the container port named tfjob-port, else 2222.
    for port in _container(spec).get("ports", []):
        if port.get("name") == "tfjob-port":
            return port["containerPort"]
    return 2222


def _flag(args, name):
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(values) == 1, f"expected one {name}=..., got {args}"
    return values[0]


def operator_tf_config(job, rtype: str, index: int, namespace: str = NAMESPACE) -> dict:
    name = job["metadata"]["name"]
    cluster = {}
    for rt, spec in _replicas(job).items():
        if rt == "Evaluator":
            continue
        cluster[rt.lower()] = [
            f"{name}-{rt.lower()}-{i}.{namespace}.svc:{_port(spec)}"
            for i in range(spec.get("replicas", 1))
        ]
    return {"cluster": cluster, "task": {"type": rtype.lower(), "index": index},
            "environment": "cloud"}


def operator_pod_labels(job, rtype: str, index: int) -> dict:
    spec = _replicas(job)[rtype]
    labels = dict(spec["template"].get("metadata", {}).get("labels", {}))
    labels.update({
        "training.kubeflow.org/operator-name": "tfjob-controller",
        JOB_NAME_LABEL: job["metadata"]["name"],
        "training.kubeflow.org/replica-type": rtype.lower(),
        "training.kubeflow.org/replica-index": str(index),
    })
    return labels


def _pods(job):
    return [(rt, i) for rt, spec in _replicas(job).items() for i in range(spec.get("replicas", 1))]


PODS = [(name, rt, i) for name, job in TFJOBS.items() for rt, i in _pods(job)]


def test_manifests_parse_into_the_expected_objects():
    # (The JobSets and the MNIST Job: tests/strategies/test_jobset.py, tests/deploy/test_k8s_schemas.py.)
    assert {doc["kind"] for _, doc in DOCS} == {"TFJob", "JobSet", "Job", "NetworkPolicy", "PersistentVolumeClaim"}
    assert sorted(_strategy(job) for job in TFJOBS.values()) == ["multiworker", "ps"]
    for job in TFJOBS.values():
        assert job["apiVersion"] == "kubeflow.org/v1"
        assert set(_replicas(job)) <= {"Chief", "Worker", "PS", "Evaluator"}
    ps_job = next(j for j in TFJOBS.values() if _strategy(j) == "ps")
    assert {"Chief", "PS", "Worker"} <= set(_replicas(ps_job))
    mw_job = next(j for j in TFJOBS.values() if _strategy(j) == "multiworker")
    assert "Worker" in _replicas(mw_job) and _replicas(mw_job)["Worker"]["replicas"] >= 2


@pytest.mark.parametrize("name", sorted(TFJOBS))
def test_every_pod_runs_train_py_with_the_jobs_strategy_on_port_2222(name):
    job = TFJOBS[name]
    commands = []
    for rt, spec in _replicas(job).items():
        c = _container(spec)
        assert c.get("image"), f"{rt}: no image"
        # No command: the image's ENTRYPOINT (train.py) runs, with these args.
        assert "command" not in c, f"{rt}: command overrides the image's train.py entrypoint"
        assert _flag(c["args"], "--strategy") == _strategy(job), rt
        assert _port(spec) == PORT, rt
        assert [p["containerPort"] for p in c["ports"]] == [PORT], rt
        commands.append(c["args"])
    # One command for every task, as on hand-started hosts; TF_CONFIG differs.
    assert all(args == commands[0] for args in commands), commands


@pytest.mark.parametrize("name", sorted(TFJOBS))
def test_gpus_only_where_steps_run(name):
    job = TFJOBS[name]
    for rt, spec in _replicas(job).items():
        c = _container(spec)
        res = c.get("resources", {})
        gpu = {k: v for part in ("requests", "limits") for k, v in res.get(part, {}).items() if k == GPU}
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert res.get("requests", {}).get("cpu") and res.get("limits", {}).get("memory"), rt
        if rt in ("PS", "Evaluator") or (rt == "Chief" and _strategy(job) == "ps"):
            assert not gpu, f"{rt} holds variables, coordinates or evaluates: no GPU"
            assert env.get("NVIDIA_VISIBLE_DEVICES") == "void", rt
        else:
            assert int(res["limits"][GPU]) >= 1, f"{rt} runs training steps: it needs a GPU"


@pytest.mark.parametrize("name", sorted(TFJOBS))
def test_restart_policies_fit_the_strategy(name):
    job = TFJOBS[name]
    strategy = _strategy(job)
    policies = {rt: spec["restartPolicy"] for rt, spec in _replicas(job).items()}
    for rt, policy in policies.items():
        if strategy == "ps" and rt in SERVERS:
            # They exit 0 when the chief is gone: only Always brings them back
            # for a restarted chief.
            assert policy == "Always", rt
        else:
            # They resume from the checkpoint on the shared volume.
            assert policy == "OnFailure", rt
    run_policy = job["spec"]["runPolicy"]
    assert run_policy["backoffLimit"] >= 1
    if "Always" in policies.values():
        assert run_policy["cleanPodPolicy"] == "Running", "Always pods would outlive the job"


@pytest.mark.parametrize("name", sorted(TFJOBS))
def test_model_dir_and_data_are_on_the_shared_volume(name):
    job = TFJOBS[name]
    strategy = _strategy(job)
    for rt, spec in _replicas(job).items():
        pod = spec["template"]["spec"]
        c = _container(spec)
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
        mounts = [m for m in c.get("volumeMounts", []) if m["name"] in claims]
        for claim in claims.values():
            assert claim in PVCS and "ReadWriteMany" in PVCS[claim]["spec"]["accessModes"]

        def on_volume(path, writable):
            return any(
                (path + "/").startswith(m["mountPath"].rstrip("/") + "/")
                and not (writable and m.get("readOnly")) for m in mounts
            )

        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        writes = rt == "Chief" or strategy == "multiworker"
        reads_data = rt != "PS"
        if writes:
            assert on_volume(_flag(c["args"], "--model-dir"), writable=True), rt
        if reads_data:
            assert on_volume(env["TFDS_DATA_DIR"], writable=False), rt
        if rt == "PS":
            assert not c.get("volumeMounts"), "a ps reads no files"
        if strategy == "ps" and rt == "Worker":
            assert all(m.get("readOnly") for m in mounts), "ps workers write nothing"


@pytest.mark.parametrize("name", sorted(TFJOBS))
def test_network_policy_admits_only_the_jobs_own_pods(name):
    job = TFJOBS[name]
    mine = [p for p in POLICIES if p["spec"]["podSelector"]["matchLabels"].get(JOB_NAME_LABEL) == name]
    assert len(mine) == 1, f"{name}: expected one NetworkPolicy selecting its pods"
    spec = mine[0]["spec"]
    selector = spec["podSelector"]["matchLabels"]
    assert selector == {JOB_NAME_LABEL: name}
    assert "Ingress" in spec["policyTypes"]
    for rt, i in _pods(job):  # selects every pod the operator makes for this job
        labels = operator_pod_labels(job, rt, i)
        assert selector.items() <= labels.items(), (rt, i)
    for other_name, other in TFJOBS.items():  # and no pod of another job
        if other_name != name:
            for rt, i in _pods(other):
                assert not selector.items() <= operator_pod_labels(other, rt, i).items()
    for rule in spec["ingress"]:
        assert rule["from"] == [{"podSelector": {"matchLabels": {JOB_NAME_LABEL: name}}}], \
            "ingress only from this job's pods: no namespaceSelector, no ipBlock"
        assert rule["ports"] == [{"protocol": "TCP", "port": PORT}]


def _dry_run(job, rtype, index, monkeypatch, capsys, tmp_path):
    c = _container(_replicas(job)[rtype])
    monkeypatch.setenv("TF_CONFIG", json.dumps(operator_tf_config(job, rtype, index)))
    for e in c.get("env", []):
        if e["name"] == "TFDS_DATA_DIR":
            continue  # /shared/tfds exists only in the pod; a dry run reads no data
        monkeypatch.setenv(e["name"], e["value"])
    args = [a for a in c["args"] if not a.startswith("--model-dir=")]
    model_dir = tmp_path / "model"  # --model-dir=/shared/... is not writable here
    code = train.main([*args, f"--model-dir={model_dir}", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert not model_dir.exists(), "--dry-run created the model dir"
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("name,rtype,index", PODS, ids=[f"{n}-{r.lower()}-{i}" for n, r, i in PODS])
def test_every_pod_gets_the_role_it_is_meant_to_have(name, rtype, index, monkeypatch, capsys, tmp_path):
    job = TFJOBS[name]
    tf_config = operator_tf_config(job, rtype, index)
    plan = _dry_run(job, rtype, index, monkeypatch, capsys, tmp_path)
    has_chief = "Chief" in _replicas(job)
    assert plan["strategy"] == _strategy(job)
    assert plan["task"] == f"{rtype.lower()}:{index}"
    assert plan["role"] == rtype.lower()
    assert plan["is_chief"] == (rtype == "Chief" or (rtype == "Worker" and index == 0 and not has_chief))
    assert plan["cluster"] == tf_config["cluster"]
    if rtype == "Evaluator":  # outside the cluster, as the operator writes it
        assert "evaluate each new checkpoint" in plan["action"]
        assert plan["devices"]["visible_gpus"] == []
        return
    assert plan["cluster"][rtype.lower()][index] == f"{name}-{rtype.lower()}-{index}.{NAMESPACE}.svc:{PORT}"
    if rtype == "PS" or (rtype == "Chief" and _strategy(job) == "ps"):
        assert plan["devices"]["visible_gpus"] == []


def test_an_evaluator_replica_under_ps_follows_the_checkpoints(monkeypatch, capsys, tmp_path):
    job = copy.deepcopy(TFJOBS["mnist-ps"])
    _replicas(job)["Evaluator"] = copy.deepcopy(_replicas(job)["Chief"])
    tf_config = operator_tf_config(job, "Evaluator", 0)
    assert "evaluator" not in tf_config["cluster"]  # the operator's shape
    plan = _dry_run(job, "Evaluator", 0, monkeypatch, capsys, tmp_path)
    assert plan["role"] == "evaluator" and not plan["is_chief"]
    assert "evaluate each new checkpoint" in plan["action"]
