"""Every object in k8s/ against the schema its API server would apply, made strict.

Custom resources (TFJob, JobSet) are checked against the openAPIV3Schema of
their released CRDs, core objects (Job, PersistentVolumeClaim,
NetworkPolicy) against Kubernetes' published JSON schemas; every file is
vendored in tests/schemas/ (sources and versions: tests/schemas/README.md).
The CRD schemas leave unknown fields open (the API server prunes them
silently), so objects without ``additionalProperties`` are closed here: a
misspelled field fails instead of vanishing.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "tests" / "schemas"
DOCS = [(path.name, doc) for path in sorted((ROOT / "k8s").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
# (apiVersion, kind) -> (vendored CRD file, served version)
CRDS = {
    ("kubeflow.org/v1", "TFJob"): ("kubeflow.org_tfjobs.yaml", "v1"),
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): ("jobset.x-k8s.io_jobsets.yaml", "v1alpha2"),
}
CORE = {
    ("batch/v1", "Job"): "io.k8s.api.batch.v1.Job",
    ("v1", "PersistentVolumeClaim"): "io.k8s.api.core.v1.PersistentVolumeClaim",
    ("networking.k8s.io/v1", "NetworkPolicy"): "io.k8s.api.networking.v1.NetworkPolicy",
}
# ObjectMeta's fields for the CRDs, whose schemas say only "metadata: object".
META_FIELDS = {"name", "namespace", "labels", "annotations", "generateName"}


def strict(schema):
    """A copy of an OpenAPI v3 schema with every open object closed."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node
                    and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


@functools.lru_cache(maxsize=None)
def _crd_validator(file: str, version: str):
    # The C loader when there is one: the CRDs are 0.6-0.8 MB of YAML.
    crd = yaml.load((SCHEMAS / file).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served["served"], f"{file}: {version} is not served"
    schema = strict(served["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {f: {} for f in META_FIELDS},
    }
    return jsonschema.Draft202012Validator(schema)


CORE_DEFS = json.loads((SCHEMAS / "kubernetes-v1.33-strict-subset.json").read_text())


@functools.lru_cache(maxsize=None)
def _core_validator(definition: str):
    return jsonschema.Draft202012Validator({"$ref": f"#/$defs/{definition}", "$defs": CORE_DEFS["$defs"]})


def validator_for(doc):
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRDS:
        return _crd_validator(*CRDS[key])
    assert key in CORE, f"no vendored schema for {key}"
    return _core_validator(CORE[key])


def errors(doc) -> list[str]:
    found = sorted(validator_for(doc).iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in found]


@pytest.mark.parametrize("doc", [d for _, d in DOCS],
                         ids=[f"{f}:{d['kind']}:{d['metadata']['name']}" for f, d in DOCS])
def test_manifest_is_valid_against_its_schema(doc):
    assert errors(doc) == []


def test_every_kind_in_k8s_has_a_schema():
    kinds = {(d["apiVersion"], d["kind"]) for _, d in DOCS}
    assert kinds == set(CRDS) | set(CORE)


def _first(kind):
    return copy.deepcopy(next(d for _, d in DOCS if d["kind"] == kind))


def _rename(mapping: dict, old: str, new: str):
    mapping[new] = mapping.pop(old)


MISSPELLED = {
    # A typo deep in a JobSet's pod template: parallelism of a replicated job.
    "jobset-parallelism": ("JobSet", lambda d: _rename(d["spec"]["replicatedJobs"][0]["template"]["spec"],
                                                        "parallelism", "paralellism"), "paralellism"),
    # ... and in the failure policy.
    "jobset-failure-policy": ("JobSet", lambda d: _rename(d["spec"]["failurePolicy"], "maxRestarts",
                                                          "maxRestart"), "maxRestart"),
    "tfjob-restart-policy": ("TFJob", lambda d: _rename(d["spec"]["tfReplicaSpecs"]["Worker"],
                                                        "restartPolicy", "restartpolicy"), "restartpolicy"),
    "tfjob-container": ("TFJob", lambda d: d["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]
                        ["containers"][0].update(imagePullPolcy="Always"), "imagePullPolcy"),
    "job-backoff": ("Job", lambda d: _rename(d["spec"], "backoffLimit", "backofLimit"), "backofLimit"),
    "pvc-access-modes": ("PersistentVolumeClaim", lambda d: _rename(d["spec"], "accessModes", "accessMode"),
                         "accessMode"),
    "networkpolicy-ingress": ("NetworkPolicy", lambda d: _rename(d["spec"], "ingress", "ingres"), "ingres"),
    "metadata": ("JobSet", lambda d: d["metadata"].update(nmae="x"), "nmae"),
}


@pytest.mark.parametrize("case", sorted(MISSPELLED))
def test_a_misspelled_field_fails_validation(case):
    kind, spoil, word = MISSPELLED[case]
    doc = _first(kind)
    assert errors(doc) == []
    spoil(doc)
    found = errors(doc)
    assert found and any(word in e for e in found), found


def test_a_wrong_type_fails_validation():
    doc = _first("JobSet")
    doc["spec"]["replicatedJobs"][0]["replicas"] = "two"
    assert any("replicas" in e for e in errors(doc))


def test_vendored_schemas_are_the_stated_releases():
    """The README's provenance lines match the files (version and kind)."""
    readme = (SCHEMAS / "README.md").read_text()
    for file, kind, version in (("kubeflow.org_tfjobs.yaml", "TFJob", "v1.9.0"),
                                ("jobset.x-k8s.io_jobsets.yaml", "JobSet", "v0.12.0")):
        text = (SCHEMAS / file).read_text()
        assert f"    kind: {kind}\n" in text and f"`{file}`" in readme and version in readme
    assert set(CORE.values()) <= set(CORE_DEFS["$defs"]) and "v1.33" in readme
