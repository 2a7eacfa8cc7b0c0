"""``--cluster-resolver=slurm``: the cluster from a (faked) Slurm job step.

A step is faked with the variables srun sets for each task. TensorFlow 2.21's
SlurmClusterResolver expands node lists itself; a failing ``scontrol`` first
on PATH checks that nothing calls the real one either.
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

import train
from strategies import ConfigError
from strategies.slurm import from_slurm, slurm_jobs

ROOT = Path(__file__).resolve().parent.parent
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
    """Our mapping-reading hooks against the stock resolver reading os.environ."""
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


def _srun_args(path: Path) -> tuple[list[str], int, int]:
    """train.py's arguments in an sbatch file, and its node and task counts."""
    text = path.read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    per_node = int(re.search(r"^#SBATCH --ntasks-per-node=(\d+)$", text, re.M).group(1))
    srun = re.search(r"^srun .*?(?<!\\)$", text.replace("\\\n", " "), re.M).group(0)
    words = shlex.split(srun)
    args = words[next(i for i, w in enumerate(words) if w.endswith("train.py")) + 1:]
    i = args.index("--model-dir")
    return args[:i] + args[i + 2:], nodes, per_node


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_example_gives_every_rank_its_role(path, slurm_step, capsys, tmp_path):
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    args, nodes, per_node = _srun_args(path)
    assert "--cluster-resolver=slurm" in args
    strategy = next(a.split("=", 1)[1] for a in args if a.startswith("--strategy="))
    assert strategy in path.name
    roles = []
    for rank in range(nodes * per_node):
        slurm_step(step_env(rank, nodes, per_node))
        plan = dry_run(args, capsys, tmp_path)
        assert plan["strategy"] == strategy
        roles.append((plan["task"], plan["is_chief"]))
    tasks = [t for t, _ in roles]
    assert len(set(tasks)) == len(tasks), "two ranks got the same task"
    assert [t for t, chief in roles if chief] == [tasks[0]], "rank 0, and only it, is the chief"
    if strategy == "ps":
        assert tasks[:2] == ["chief:0", "ps:0"] and all(t.startswith("worker:") for t in tasks[2:])


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
