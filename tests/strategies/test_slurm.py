"""``--cluster-resolver=slurm``: the cluster from a (faked) Slurm job step.

A step is faked with the variables srun sets for each task; a failing
``scontrol`` first on PATH checks that nothing calls the real one. The real
thing, on a Slurm cluster emulated on this host: tests/deploy/test_slurm_cluster.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tfdist.cli import train
from tfdist.strategies import ConfigError
from tfdist.strategies.slurm import expand_hostlist, expand_tasks_per_node, from_slurm, slurm_jobs

ROOT = Path(__file__).resolve().parents[2]
SBATCH = sorted((ROOT / "slurm").glob("*.sbatch"))
SLURM_VARS = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST",
              "SLURM_STEP_TASKS_PER_NODE", "SLURMD_NODENAME")


def step_env(rank: int, nodes: int, per_node: int, prefix: str = "gpu") -> dict[str, str]:
    """What srun sets for task ``rank`` of a block-distributed step."""
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_STEP_NUM_TASKS": str(nodes * per_node),
        "SLURM_STEP_NODELIST": f"{prefix}[01-{nodes:02d}]" if nodes > 1 else f"{prefix}01",
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
        "SLURMD_NODENAME": f"{prefix}{rank // per_node + 1:02d}",
    }


@pytest.fixture
def slurm_step(monkeypatch, tmp_path):
    """Sets a fake step in os.environ; a failing scontrol records any call."""
    marker = tmp_path / "scontrol-called"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {marker}\nexit 1\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name in SLURM_VARS:
        monkeypatch.delenv(name, raising=False)

    def set_step(env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    yield set_step
    assert not marker.exists(), f"scontrol was called: {marker.read_text()}"


def dry_run(argv, capsys, tmp_path):
    model_dir = tmp_path / "model"
    code = train.main([*argv, "--model-dir", str(model_dir), "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert not model_dir.exists()
    return json.loads(out.strip().splitlines()[-1])


PS_CLUSTER = {
    "chief": ["gpu01:2222"], "ps": ["gpu01:2223"],
    "worker": ["gpu02:2222", "gpu02:2223", "gpu03:2222", "gpu03:2223"],
}
PS_ROLES = ["chief:0", "ps:0", "worker:0", "worker:1", "worker:2", "worker:3"]


@pytest.mark.parametrize("rank", range(6))
def test_ps_roles_by_rank(rank, slurm_step, capsys, tmp_path):
    slurm_step(step_env(rank, nodes=3, per_node=2))
    plan = dry_run(["--cluster-resolver=slurm", "--slurm-ps=1", "--strategy=ps"], capsys, tmp_path)
    assert plan["strategy"] == "ps"
    assert plan["cluster"] == PS_CLUSTER
    assert plan["task"] == PS_ROLES[rank]
    assert plan["is_chief"] == (rank == 0)


@pytest.mark.parametrize("rank", range(4))
def test_multiworker_roles_by_rank_and_port(rank, slurm_step, capsys, tmp_path):
    slurm_step(step_env(rank, nodes=2, per_node=2))
    plan = dry_run(["--cluster-resolver=slurm", "--slurm-port=3000"], capsys, tmp_path)
    assert plan["strategy"] == "multiworker"  # --strategy=auto: no ps, 4 workers
    assert plan["cluster"] == {"worker": ["gpu01:3000", "gpu01:3001", "gpu02:3000", "gpu02:3001"]}
    assert plan["task"] == f"worker:{rank}"
    assert plan["is_chief"] == (rank == 0)


def test_same_cluster_as_tensorflows_own_resolver(slurm_step):
    """Ours against the stock resolver where they should agree: node names whose
    text order is their node-list order (gpu01..gpu03)."""
    import tensorflow as tf

    for rank in (0, 3, 5):
        env = step_env(rank, nodes=3, per_node=2)
        slurm_step(env)
        stock = tf.distribute.cluster_resolver.SlurmClusterResolver(
            jobs={"chief": 1, "ps": 1, "worker": 4}, port_base=2222, gpus_per_node=6,
            gpus_per_task=1, auto_set_gpu=False,
        )
        ours = from_slurm(env, num_ps=1)
        assert stock.cluster_spec().as_dict() == ours.cluster_dict()
        assert stock.get_task_info() == (ours.task_type, ours.task_index)


def test_jobs_split():
    assert slurm_jobs(4, 0) == {"worker": 4}
    assert slurm_jobs(6, 2) == {"chief": 1, "ps": 2, "worker": 3}
    with pytest.raises(ConfigError, match="leaves no worker"):
        slurm_jobs(3, 2)


def _components(text: str) -> list[dict[str, str]]:
    """The #SBATCH options of each component of a (heterogeneous) job."""
    comps: list[dict[str, str]] = [{}]
    for line in re.findall(r"^#SBATCH (.*)$", text, re.M):
        if line.strip() == "hetjob":
            comps.append({})
            continue
        for word in shlex.split(line):
            key, _, value = word.partition("=")
            comps[-1][key] = value
    return comps


def _srun_args(path: Path) -> tuple[list[str], list[int]]:
    """train.py's arguments in an sbatch file, and the tasks on each of its nodes."""
    text = path.read_text()
    per_node = [int(c["--ntasks-per-node"]) for c in _components(text)
                for _ in range(int(c["--nodes"]))]
    joined = text.replace("\\\n", " ")
    # The members' step (an EVALUATOR=1 step runs train.py too, outside the cluster).
    command = re.search(r"\"\$PYTHON\" train\.py (--cluster-resolver.*?)\"\$@\"", joined,
                        re.S).group(1)
    # The per-job port (slurm/requeue.sh's job_port) as job 1 gets it.
    args = shlex.split(command.replace('"$(job_port)"', "20010"))
    i = args.index("--model-dir")
    return args[:i] + args[i + 2:], per_node


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_example_gives_every_rank_its_role(path, slurm_step, capsys, tmp_path):
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    args, per_node = _srun_args(path)
    assert "--cluster-resolver=slurm" in args
    strategy = next(a.split("=", 1)[1] for a in args if a.startswith("--strategy="))
    assert strategy in path.name
    roles = []
    for rank in range(sum(per_node)):
        # node9, node10, ...: names whose text order is not Slurm's order.
        slurm_step(step_env_nodes(rank, per_node))
        plan = dry_run(args, capsys, tmp_path)
        assert plan["strategy"] == strategy
        roles.append((plan["task"], plan["is_chief"]))
    tasks = [t for t, _ in roles]
    assert len(set(tasks)) == len(tasks), "two ranks got the same task"
    assert [t for t, chief in roles if chief] == [tasks[0]], "rank 0, and only it, is the chief"
    if strategy == "ps":
        assert tasks[:2] == ["chief:0", "ps:0"] and all(t.startswith("worker:") for t in tasks[2:])


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_scripts_requeue_pass_cpus_and_take_job_ports(path):
    text = path.read_text()
    comps = _components(text)
    assert "--requeue" in comps[0] and comps[0].get("--open-mode") == "append"
    assert re.fullmatch(r"TERM@\d+", comps[0]["--signal"])  # SIGTERM before the time limit
    assert 'source "$SLURM_SUBMIT_DIR/slurm/requeue.sh"' in text
    assert re.search(r'^requeue_on_relaunch_code "\$code"$', text, re.M)
    assert '--slurm-port="$(job_port)"' in text
    assert '"${PYTHON:-.venv/bin/python}"' in text.replace("PYTHON=", "")
    sruns = re.findall(r"^srun (.*?)(?:\|\| code=\$\?)", text.replace("\\\n", " "), re.M | re.S)
    assert len(sruns) == 1
    # It would kill a worker still exiting 42 after a peer exited 42 first (then 143: no requeue).
    assert "--kill-on-bad-exit" not in sruns[0]
    # srun no longer inherits --cpus-per-task from sbatch (Slurm >= 22.05).
    for i, _ in enumerate(comps):
        var = "SLURM_CPUS_PER_TASK" if len(comps) == 1 else f"SLURM_CPUS_PER_TASK_HET_GROUP_{i}"
        assert f'--cpus-per-task="${var}"' in sruns[0], var
    if "ps" in path.name:
        # chief + ps: one component without GPUs; the workers: one GPU each.
        assert len(comps) == 2 and not any("gpu" in k for k in comps[0])
        assert comps[1]["--gpus-per-task"] == "1"
        assert int(comps[0]["--ntasks-per-node"]) == 2 and int(comps[0]["--nodes"]) == 1


def _requeue(code: int, restarts: int, tmp_path) -> tuple[int, str]:
    """slurm/requeue.sh's rule run for an srun exit code, with a recording scontrol."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": str(restarts)}
    proc = subprocess.run(["bash", "-c", f"source slurm/requeue.sh; requeue_on_relaunch_code {code}"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    calls = tmp_path / "calls"
    return proc.returncode, calls.read_text() if calls.exists() else ""


@pytest.mark.parametrize("code,restarts,requeued", [
    (42, 0, True), (75, 3, True), (42, 10, False), (2, 0, False), (1, 0, False), (0, 0, False),
])
def test_requeue_only_on_42_and_75(code, restarts, requeued, tmp_path):
    exit_code, calls = _requeue(code, restarts, tmp_path)
    assert exit_code == code  # the job's own exit code is kept either way
    assert calls == ("requeue 77\n" if requeued else "")


def test_job_ports_differ_between_jobs():
    def port(job_id):
        out = subprocess.run(["bash", "-c", "source slurm/requeue.sh; job_port"], cwd=ROOT,
                             env={"SLURM_JOB_ID": str(job_id), "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True)
        return int(out.stdout)
    ports = [port(j) for j in (1, 2, 3999, 4000, 123456)]
    assert all(20000 <= p <= 65535 - 10 for p in ports)
    assert len(set(ports[:3])) == 3 and abs(ports[0] - ports[1]) >= 10


def step_env_nodes(rank: int, per_node: list[int], first: int = 9) -> dict[str, str]:
    """A block-distributed step on node9, node10, ... with ``per_node`` tasks each."""
    nodes = len(per_node)
    owner = [n for n, count in enumerate(per_node) for _ in range(count)][rank]
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_STEP_NUM_TASKS": str(sum(per_node)),
        "SLURM_STEP_NODELIST": f"node[{first}-{first + nodes - 1}]" if nodes > 1 else f"node{first}",
        "SLURM_STEP_TASKS_PER_NODE": ",".join(map(str, per_node)),
        "SLURMD_NODENAME": f"node{first + owner}",
    }


@pytest.mark.parametrize("rank", range(3))
def test_node9_comes_before_node10(rank, slurm_step, capsys, tmp_path):
    """Slurm ranks nodes in node-list order; text order would put node10 first."""
    slurm_step(step_env_nodes(rank, [1, 1, 1], first=9))
    plan = dry_run(["--cluster-resolver=slurm", "--global-batch-size=129"], capsys, tmp_path)
    assert plan["cluster"] == {"worker": ["node9:2222", "node10:2222", "node11:2222"]}
    assert plan["task"] == f"worker:{rank}"


def test_het_step_ranks_component_0_first(slurm_step, capsys, tmp_path):
    """A heterogeneous step whose component 0 got the node that sorts last."""
    env = {  # component 0: node10, 2 tasks; component 1: node9, 3 tasks (sorted in the step)
        "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "5", "SLURM_STEP_NODELIST": "node[9-10]",
        "SLURM_STEP_TASKS_PER_NODE": "3,2", "SLURMD_NODENAME": "node10", "SLURM_HET_SIZE": "2",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "node10", "SLURM_JOB_NODELIST_HET_GROUP_1": "node9",
    }
    slurm_step(env)
    plan = dry_run(["--cluster-resolver=slurm", "--slurm-ps=1", "--strategy=ps"], capsys, tmp_path)
    assert plan["cluster"] == {"chief": ["node10:2222"], "ps": ["node10:2223"],
                               "worker": ["node9:2222", "node9:2223", "node9:2224"]}
    assert plan["task"] == "chief:0"


@pytest.mark.parametrize("hostlist,hosts", [
    ("node[9-10]", ["node9", "node10"]),
    ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
    ("node10,node9", ["node10", "node9"]),  # the order given is kept
    ("a[1,3-4],b7", ["a1", "a3", "a4", "b7"]),
    ("r[1-2]n[8-9]", ["r1n8", "r1n9", "r2n8", "r2n9"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-", "gpu[3-1]", "a[x]", "a,,b", "a]b["])
def test_expand_hostlist_refuses_what_slurm_would_not_write(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError):
        expand_tasks_per_node("2(x)")


def test_train_py_reads_the_step_from_its_environment(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", *SLURM_VARS)}
    env.update(step_env(3, nodes=3, per_node=2), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "train.py", "--cluster-resolver=slurm", "--slurm-ps=1", "--strategy=ps",
         "--dry-run", "--model-dir", str(tmp_path / "m")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (plan["task"], plan["role"], plan["cluster"]) == ("worker:1", "worker", PS_CLUSTER)


# (case, Slurm step or None, TF_CONFIG, argv, words the one error line must contain)
BAD = [
    ("no-step", None, None, ["--cluster-resolver=slurm"], ["SLURM_PROCID", "srun", "--cluster-resolver=tf_config"]),
    ("ps-leaves-no-worker", step_env(0, 2, 1), None, ["--cluster-resolver=slurm", "--slurm-ps=1"],
     ["--slurm-ps=1", "2 task(s)", "at least 3 tasks"]),
    ("negative-ps", step_env(0, 2, 1), None, ["--cluster-resolver=slurm", "--slurm-ps=-1"], ["--slurm-ps=-1", "0"]),
    ("slurm-flag-without-slurm", None, None, ["--slurm-ps=1"], ["--slurm-ps", "--cluster-resolver=slurm"]),
    ("unknown-resolver", None, None, ["--cluster-resolver=yarn"], ["'yarn'", "tf_config, slurm"]),
    ("bad-port", step_env(0, 2, 1), None, ["--cluster-resolver=slurm", "--slurm-port=70000"], ["70000", "1 to 65535"]),
    ("rank-out-of-step", {**step_env(0, 2, 1), "SLURM_PROCID": "7"}, None, ["--cluster-resolver=slurm"],
     ["SLURM_PROCID is 7", "SLURM_STEP_NUM_TASKS is 2"]),
    ("rank-not-int", {**step_env(0, 2, 1), "SLURM_PROCID": "x"}, None, ["--cluster-resolver=slurm"], ["'x'", "integer"]),
    ("bad-nodelist", {**step_env(0, 2, 1), "SLURM_STEP_NODELIST": "gpu[01-"}, None, ["--cluster-resolver=slurm"],
     ["'gpu[01-'", "not understood"]),
    ("tasks-disagree", {**step_env(0, 2, 1), "SLURM_STEP_TASKS_PER_NODE": "3(x2)"}, None,
     ["--cluster-resolver=slurm"], ["'3(x2)'", "SLURM_STEP_NUM_TASKS=2"]),
    ("cyclic-placement", {**step_env(1, 2, 2), "SLURMD_NODENAME": "gpu02"}, None, ["--cluster-resolver=slurm"],
     ["'gpu02'", "gpu01:2223", "--distribution=block"]),
    ("port-too-high", step_env(0, 2, 2), None, ["--cluster-resolver=slurm", "--slurm-port=65535"],
     ["--slurm-port=65535", "65536", "--slurm-port=65534"]),
    ("tf-config-too", step_env(0, 2, 1), '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}',
     ["--cluster-resolver=slurm"], ["TF_CONFIG is set", "unset TF_CONFIG"]),
]


@pytest.mark.parametrize("case,step,tf_config,argv,words", BAD, ids=[c[0] for c in BAD])
def test_bad_slurm_input_is_one_line_and_exit_2(case, step, tf_config, argv, words, slurm_step,
                                                 monkeypatch, capsys, tmp_path):
    if step:
        slurm_step(step)
    if tf_config:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    code = train.main([*argv, "--model-dir", str(tmp_path / "m"), "--dry-run"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, err
    assert len(errors) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in errors[0], f"{word!r} not in {errors[0]!r}"
    assert not (tmp_path / "m").exists()
