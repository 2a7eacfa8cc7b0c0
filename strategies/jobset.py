"""The cluster of a pod of a Kubernetes JobSet, as the same frozen ``ClusterConfig``.

``from_jobset`` is the only reader of what JobSet (jobset.x-k8s.io/v1alpha2)
gives a pod, and the only place that knows JobSet's pod host names. JobSet
creates one Indexed Job per replica of each replicated job and annotates its
pods; the manifests in k8s/ turn the annotations into variables with the
downward API (``fieldRef``):

    JOBSET_NAME           metadata.annotations['jobset.sigs.k8s.io/jobset-name']
    REPLICATED_JOB_NAME   metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']
    JOB_INDEX             metadata.annotations['jobset.sigs.k8s.io/job-index']
    JOB_COMPLETION_INDEX  set by Kubernetes itself in every pod of an Indexed Job

A pod cannot see the other replicated jobs, so the manifest states the whole
shape once, in the same value for every pod (the tests check it against the
manifest's own replicas and parallelism):

    TF_JOBSET_SHAPE       "chief=1x1,ps=1x1,worker=1x2": <replicated job>=<replicas>x<pods per job>
    JOBSET_SUBDOMAIN      optional: spec.network.subdomain when set (JobSet's default: the JobSet name)

Replicated jobs are named after the TensorFlow roles they hold (chief, ps,
worker, evaluator). Pod ``p`` of job ``j`` of replicated job ``r`` is task
``j * <pods per job> + p`` of role ``r``, reachable (with
``spec.network.enableDNSHostnames``, JobSet's default) at
``<jobset>-<r>-<j>-<p>.<subdomain>:2222`` through the headless service JobSet
creates. As with Kubeflow's operator, an evaluator stays outside the cluster.
"""

from __future__ import annotations

import json
import re
from typing import Mapping

from tfdist.strategies.tf_config import ROLES, ConfigError, parse_tf_config, require_source

PORT = 2222  # the containerPort of every manifest in k8s/, EXPOSEd by the Dockerfile
POD_VARS = ("JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX", "JOB_COMPLETION_INDEX", "TF_JOBSET_SHAPE")
HOW_TO_RUN = (
    "run train.py in a pod of a JobSet whose container sets these variables (see k8s/jobset-*.yaml), "
    "or use --cluster-resolver=tf_config"
)
# RFC 1123 label: what a pod host name and each part of it must be.
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def parse_shape(text: str) -> dict[str, tuple[int, int]]:
    """``TF_JOBSET_SHAPE`` as {replicated job: (replicas, pods per job)} (pure)."""
    shape: dict[str, tuple[int, int]] = {}
    for item in text.split(","):
        m = re.fullmatch(r"\s*([a-z]+)=(\d+)x(\d+)\s*", item)
        if not m:
            raise ConfigError(
                f"TF_JOBSET_SHAPE is {text!r}; expected entries like 'worker=1x2' "
                "(<replicated job>=<replicas>x<pods per job>) separated by commas"
            )
        name, replicas, pods = m.group(1), int(m.group(2)), int(m.group(3))
        if name not in ROLES:
            raise ConfigError(
                f"TF_JOBSET_SHAPE names replicated job {name!r}; name the replicated jobs "
                f"after the roles they hold: {', '.join(ROLES)}"
            )
        if name in shape:
            raise ConfigError(f"TF_JOBSET_SHAPE names {name!r} twice: {text!r}")
        if replicas < 1 or pods < 1:
            raise ConfigError(f"TF_JOBSET_SHAPE gives {name!r} {replicas}x{pods}; both must be >= 1")
        shape[name] = (replicas, pods)
    return shape


def pod_host(jobset: str, replicated_job: str, job_index: int, pod_index: int, subdomain: str) -> str:
    """JobSet's DNS name of a pod: ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>``."""
    return f"{jobset}-{replicated_job}-{job_index}-{pod_index}.{subdomain}"


def _index(environ: Mapping[str, str], name: str, count: int, what: str) -> int:
    text = environ[name]
    if not text.isdigit() or int(text) >= count:
        raise ConfigError(
            f"{name} is {text!r}; expected an integer from 0 to {count - 1} ({what}); {HOW_TO_RUN}"
        )
    return int(text)


def from_jobset(environ: Mapping[str, str]):
    """This pod's ``ClusterConfig``, from the variables of a JobSet pod."""
    require_source(environ, "jobset", "JobSet pod", POD_VARS, HOW_TO_RUN)
    shape = parse_shape(environ["TF_JOBSET_SHAPE"])
    jobset = environ["JOBSET_NAME"]
    subdomain = environ.get("JOBSET_SUBDOMAIN") or jobset
    mine = environ["REPLICATED_JOB_NAME"]
    if mine not in shape:
        raise ConfigError(
            f"REPLICATED_JOB_NAME is {mine!r}, which TF_JOBSET_SHAPE "
            f"({environ['TF_JOBSET_SHAPE']!r}) does not name; allowed: {', '.join(shape)}"
        )
    replicas, pods = shape[mine]
    job_index = _index(environ, "JOB_INDEX", replicas, f"{mine} has {replicas} job(s)")
    pod_index = _index(environ, "JOB_COMPLETION_INDEX", pods, f"each {mine} job has {pods} pod(s)")

    cluster: dict[str, list[str]] = {}
    for role in ROLES:  # the evaluator is not a member of the training cluster
        if role in shape and role != "evaluator":
            role_replicas, role_pods = shape[role]
            cluster[role] = [
                f"{pod_host(jobset, role, j, p, subdomain)}:{PORT}"
                for j in range(role_replicas) for p in range(role_pods)
            ]
    for role, addresses in cluster.items():
        host = addresses[-1].split(".")[0]  # the longest: highest indices
        if len(host) > 63 or not _LABEL.fullmatch(host):
            raise ConfigError(
                f"pod host name {host!r} (JOBSET_NAME {jobset!r}, replicated job {role!r}) is not "
                "a DNS label of at most 63 lower-case letters, digits and '-'; use a shorter JobSet name"
            )
    # One validation path for every source: the same checks as a TF_CONFIG.
    return parse_tf_config(json.dumps({
        "cluster": cluster,
        "task": {"type": mine, "index": job_index * pods + pod_index},
        "environment": "cloud",
    }))
