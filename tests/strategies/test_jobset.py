"""``--cluster-resolver=jobset``: the cluster from what JobSet gives a pod, and the JobSet manifests.

For every pod of every JobSet in k8s/ the test derives the pod's variables
the way JobSet and Kubernetes set them (JobSet's labelAndAnnotateObject:
the jobset-name, replicatedjob-name and job-index annotations, which the
manifest maps to variables with fieldRef; Kubernetes: JOB_COMPLETION_INDEX
in every pod of an Indexed Job) and runs the pod's command,
``train.py <args> --dry-run``, in-process on them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from tfdist.cli import train  # noqa: E402
from tfdist.strategies import ConfigError  # noqa: E402
from tfdist.strategies.jobset import from_jobset, parse_shape, pod_host  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
JOBSETS = {doc["metadata"]["name"]: doc for path in sorted((ROOT / "k8s").glob("*.yaml"))
           for doc in yaml.safe_load_all(path.read_text()) if doc and doc["kind"] == "JobSet"}
# What JobSet annotates every pod with (api/jobset/v1alpha2/jobset_types.go).
ANNOTATION = {
    "jobset.sigs.k8s.io/jobset-name": lambda js, rjob, j, p: js,
    "jobset.sigs.k8s.io/replicatedjob-name": lambda js, rjob, j, p: rjob,
    "jobset.sigs.k8s.io/job-index": lambda js, rjob, j, p: str(j),
    "batch.kubernetes.io/job-completion-index": lambda js, rjob, j, p: str(p),
}
POD_VARS = ("JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX", "JOB_COMPLETION_INDEX",
            "TF_JOBSET_SHAPE", "JOBSET_SUBDOMAIN", "TF_CONFIG")
GPU = "nvidia.com/gpu"


def _container(rjob) -> dict:
    (c,) = [c for c in rjob["template"]["spec"]["template"]["spec"]["containers"]
            if c["name"] == "tensorflow"]
    return c


def _pods(jobset):
    """(replicated job, job index, pod index) of every pod JobSet creates."""
    return [(r["name"], j, p) for r in jobset["spec"]["replicatedJobs"]
            for j in range(r.get("replicas", 1)) for p in range(r["template"]["spec"]["parallelism"])]


def pod_env(jobset, rjob_name: str, j: int, p: int) -> dict[str, str]:
    """The variables of one pod, from its manifest, as JobSet and Kubernetes fill them in."""
    name = jobset["metadata"]["name"]
    rjob = next(r for r in jobset["spec"]["replicatedJobs"] if r["name"] == rjob_name)
    env = {"JOB_COMPLETION_INDEX": str(p)}  # Kubernetes, for every Indexed Job
    for e in _container(rjob).get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        path = e["valueFrom"]["fieldRef"]["fieldPath"]
        key = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path).group(1)
        env[e["name"]] = ANNOTATION[key](name, rjob_name, j, p)
    return env


POD_CASES = [(n, r, j, p) for n, js in JOBSETS.items() for r, j, p in _pods(js)]


def test_both_strategies_have_a_jobset():
    strategies = sorted(next(a for a in _container(js["spec"]["replicatedJobs"][0])["args"]
                             if a.startswith("--strategy=")) for js in JOBSETS.values())
    assert strategies == ["--strategy=multiworker", "--strategy=ps"]


@pytest.mark.parametrize("name", sorted(JOBSETS))
def test_shape_variable_matches_the_manifest(name):
    """TF_JOBSET_SHAPE states what the manifest's replicas and parallelism make."""
    js = JOBSETS[name]
    made = {r["name"]: (r.get("replicas", 1), r["template"]["spec"]["parallelism"])
            for r in js["spec"]["replicatedJobs"]}
    for r in js["spec"]["replicatedJobs"]:
        spec = r["template"]["spec"]
        assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"], r["name"]
        env = pod_env(js, r["name"], 0, 0)
        assert parse_shape(env["TF_JOBSET_SHAPE"]) == made, r["name"]
        assert "TF_CONFIG" not in env
        args = _container(r)["args"]
        assert "--cluster-resolver=jobset" in args
        assert args == _container(js["spec"]["replicatedJobs"][0])["args"], "one command for every pod"
    assert js["spec"]["network"]["enableDNSHostnames"] is True
    assert "subdomain" not in js["spec"]["network"], "the resolver assumes the default subdomain"


@pytest.mark.parametrize("name,rjob,j,p", POD_CASES, ids=[f"{n}-{r}-{j}-{p}" for n, r, j, p in POD_CASES])
def test_every_pod_gets_the_role_it_is_meant_to_have(name, rjob, j, p, monkeypatch, capsys, tmp_path):
    js = JOBSETS[name]
    for var in POD_VARS:
        monkeypatch.delenv(var, raising=False)
    env = pod_env(js, rjob, j, p)
    for var, value in env.items():
        if var != "TFDS_DATA_DIR":  # /shared/tfds exists only in the pod; a dry run reads no data
            monkeypatch.setenv(var, value)
    args = [a for a in _container(next(r for r in js["spec"]["replicatedJobs"] if r["name"] == rjob))["args"]
            if not a.startswith("--model-dir=")]
    model_dir = tmp_path / "model"
    code = train.main([*args, f"--model-dir={model_dir}", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert not model_dir.exists()
    plan = json.loads(out.strip().splitlines()[-1])

    # The cluster, from JobSet's DNS scheme: <jobset>-<rjob>-<jobIndex>-<podIndex>.<jobset>.
    expected = {r: [f"{name}-{r}-{jj}-{pp}.{name}:2222" for rr, jj, pp in _pods(js) if rr == r]
                for r in ("chief", "worker", "ps") if any(rr == r for rr, _, _ in _pods(js))}
    parallelism = next(r for r in js["spec"]["replicatedJobs"] if r["name"] == rjob)["template"]["spec"]["parallelism"]
    strategy = "ps" if "ps" in expected else "multiworker"
    assert plan["strategy"] == strategy
    assert plan["cluster"] == expected
    assert plan["task"] == f"{rjob}:{j * parallelism + p}"
    assert plan["cluster"][rjob][j * parallelism + p] == f"{name}-{rjob}-{j}-{p}.{name}:2222"
    assert plan["is_chief"] == (rjob == "chief" or (rjob == "worker" and j == p == 0 and "chief" not in expected))
    if rjob == "ps" or (rjob == "chief" and strategy == "ps"):
        assert plan["devices"]["visible_gpus"] == []
        c = _container(next(r for r in js["spec"]["replicatedJobs"] if r["name"] == rjob))
        assert GPU not in c["resources"].get("limits", {}) and env.get("NVIDIA_VISIBLE_DEVICES") == "void"


def _fail_rule(js, code: int) -> str:
    """The JobSet failurePolicy action taken when a pod exits with ``code``."""
    for r in js["spec"]["replicatedJobs"]:
        rules = r["template"]["spec"]["podFailurePolicy"]["rules"]
        assert r["template"]["spec"]["template"]["spec"]["restartPolicy"] == "Never"
        matching = [i for i, rule in enumerate(rules)
                    if rule["onExitCodes"]["operator"] == "In" and code in rule["onExitCodes"]["values"]]
        if not matching:
            return "default"  # BackoffLimitExceeded: JobSet's default, RestartJobSet
        # Kubernetes' message for a FailJob rule (pkg/controller/job/pod_failure_policy.go).
        message = (f"Container tensorflow for pod ns/{r['name']}-0 failed with exit code {code} "
                   f"matching FailJob rule at index {matching[0]}")
        for rule in js["spec"]["failurePolicy"]["rules"]:
            if "PodFailurePolicy" in rule["onJobFailureReasons"] and any(
                    re.search(pat, message) for pat in rule["onJobFailureMessagePatterns"]):
                return rule["action"]
        return "default"


@pytest.mark.parametrize("name", sorted(JOBSETS))
def test_relaunch_on_42_and_75_never_on_2(name):
    js = JOBSETS[name]
    assert _fail_rule(js, 2) == "FailJobSet"
    assert _fail_rule(js, 42) == "RestartJobSetAndIgnoreMaxRestarts"
    assert _fail_rule(js, 75) == "RestartJobSet"
    assert _fail_rule(js, 1) == "default"  # a crash: restarted, counted against maxRestarts
    assert js["spec"]["failurePolicy"]["maxRestarts"] >= 1


# --- the resolver alone ---------------------------------------------------------------

def _env(**overrides):
    env = {"JOBSET_NAME": "js", "REPLICATED_JOB_NAME": "worker", "JOB_INDEX": "0",
           "JOB_COMPLETION_INDEX": "0", "TF_JOBSET_SHAPE": "chief=1x1,worker=2x2,ps=1x1"}
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


def test_task_index_counts_jobs_then_pods():
    cluster = from_jobset(_env(JOB_INDEX="1", JOB_COMPLETION_INDEX="0"))
    assert (cluster.task_type, cluster.task_index) == ("worker", 2)
    assert cluster.cluster_dict() == {
        "chief": ["js-chief-0-0.js:2222"],
        "worker": ["js-worker-0-0.js:2222", "js-worker-0-1.js:2222",
                   "js-worker-1-0.js:2222", "js-worker-1-1.js:2222"],
        "ps": ["js-ps-0-0.js:2222"],
    }
    assert cluster.address == "js-worker-1-0.js:2222" and not cluster.is_chief


def test_subdomain_and_evaluator():
    cluster = from_jobset(_env(REPLICATED_JOB_NAME="evaluator", JOBSET_SUBDOMAIN="net",
                           TF_JOBSET_SHAPE="worker=1x2,evaluator=1x1"))
    assert cluster.cluster_dict() == {"worker": ["js-worker-0-0.net:2222", "js-worker-0-1.net:2222"]}
    assert cluster.task_type == "evaluator" and cluster.address is None
    assert pod_host("a", "b", 1, 2, "c") == "a-b-1-2.c"


BAD = [
    ("no-pod", {"JOBSET_NAME": None, "JOB_INDEX": None}, ["JOBSET_NAME, JOB_INDEX are not set", "k8s/jobset-"]),
    ("tf-config-too", {"TF_CONFIG": '{"cluster": {}}'}, ["TF_CONFIG is set too"]),
    ("shape-syntax", {"TF_JOBSET_SHAPE": "worker=2"}, ["'worker=2'", "<replicas>x<pods per job>"]),
    ("shape-role", {"TF_JOBSET_SHAPE": "trainer=1x2"}, ["'trainer'", "chief, worker, ps, evaluator"]),
    ("shape-twice", {"TF_JOBSET_SHAPE": "worker=1x2,worker=1x1"}, ["'worker' twice"]),
    ("shape-zero", {"TF_JOBSET_SHAPE": "worker=0x2"}, ["0x2", ">= 1"]),
    ("not-in-shape", {"REPLICATED_JOB_NAME": "ps", "TF_JOBSET_SHAPE": "worker=1x2"}, ["'ps'", "allowed: worker"]),
    ("job-index", {"JOB_INDEX": "2"}, ["JOB_INDEX is '2'", "0 to 1"]),
    ("pod-index", {"JOB_COMPLETION_INDEX": "-1"}, ["JOB_COMPLETION_INDEX is '-1'"]),
    ("long-name", {"JOBSET_NAME": "x" * 60}, ["63", "shorter JobSet name"]),
    ("bad-name", {"JOBSET_NAME": "My_Job"}, ["'My_Job-chief-0-0'"]),
]


@pytest.mark.parametrize("case,overrides,words", BAD, ids=[b[0] for b in BAD])
def test_bad_pod_variables_name_the_problem(case, overrides, words):
    with pytest.raises(ConfigError) as err:
        from_jobset(_env(**overrides))
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_bad_input_through_train_py_is_one_error_line_and_exit_2(monkeypatch, capsys, tmp_path):
    for var in POD_VARS:
        monkeypatch.delenv(var, raising=False)
    code = train.main(["--cluster-resolver=jobset", "--model-dir", str(tmp_path / "m"), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2
    assert [l for l in err.splitlines() if l.startswith("error:")] == [err.strip()]
    assert "--cluster-resolver=jobset found no JobSet pod" in err
    code = train.main(["--cluster-resolver=jobset", "--slurm-ps=1", "--model-dir", str(tmp_path / "m"),
                       "--dry-run"])
    assert code == 2 and "only apply to --cluster-resolver=slurm" in capsys.readouterr().err
