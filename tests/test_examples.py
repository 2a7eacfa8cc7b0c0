"""examples/ run as a newcomer would copy them: the notebook-style script, the multi-host
walk-through (every host on this machine), and the README's Python example.

The task file, examples/custom_task.py, is trained under every strategy by
tests/training/test_task_features.py.
"""

import json
import os
import re
import socket
import sys
from pathlib import Path

import pytest

from conftest import REPO, Proc, child_env

WALK = REPO / "examples" / "multi_host.md"
NOTEBOOK = REPO / "examples" / "notebook.py"
BLOCK = re.compile(r"```bash\n(export TF_CONFIG='(.*?)'\n(tfdist-train .*?))\n```", re.S)


def walkthrough_layouts() -> dict[str, list[tuple[dict, str]]]:
    """Each layout's processes, in the doc's order: (TF_CONFIG, command)."""
    layouts: dict[str, list] = {}
    for m in BLOCK.finditer(WALK.read_text()):
        tf_config, command = json.loads(m.group(2)), m.group(3)
        strategy = re.search(r"--strategy=(\S+)", command).group(1)
        layouts.setdefault(strategy, []).append((tf_config, command))
    return layouts


def test_the_walkthrough_gives_every_task_of_each_cluster_once():
    layouts = walkthrough_layouts()
    assert sorted(layouts) == ["multiworker", "ps"]
    for strategy, processes in layouts.items():
        clusters = {json.dumps(c["cluster"], sort_keys=True) for c, _ in processes}
        assert len(clusters) == 1, f"{strategy}: every process must share one cluster"
        cluster = processes[0][0]["cluster"]
        tasks = sorted((c["task"]["type"], c["task"]["index"]) for c, _ in processes)
        assert tasks == sorted((role, i) for role, addrs in cluster.items()
                               for i in range(len(addrs)))
        assert len({cmd for _, cmd in processes}) == 1, f"{strategy}: one command for all"
        addresses = [a for addrs in cluster.values() for a in addrs]
        assert len(set(addresses)) == len(addresses)


def test_the_readmes_python_example_is_the_notebooks():
    # The README's example runs as the notebook's first cells (test_the_notebook_runs).
    readme = (REPO / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    code = [line for line in example.splitlines() if line.strip() and not line.startswith("#")]
    notebook = NOTEBOOK.read_text().splitlines()
    assert len(code) >= 4 and [line for line in code if line not in notebook] == []


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _on_one_machine(processes, model_dir: Path):
    """The walk-through's processes with each host:port replaced by 127.0.0.1:<free port>."""
    cluster = processes[0][0]["cluster"]
    addresses = [a for addrs in cluster.values() for a in addrs]
    local = dict(zip(addresses, (f"127.0.0.1:{p}" for p in _free_ports(len(addresses)))))
    out = []
    for tf_config, command in processes:
        tf_config = {"cluster": {r: [local[a] for a in addrs] for r, addrs in cluster.items()},
                     "task": tf_config["task"]}
        command = re.sub(r"--model-dir \S+", f"--model-dir {model_dir}", command)
        out.append((tf_config, command))
    return out


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["multiworker", "ps"])
def test_the_walkthrough_runs_with_every_host_on_this_machine(strategy, tmp_path, spawn):
    processes = _on_one_machine(walkthrough_layouts()[strategy], tmp_path / "run")
    bin_dir = str(Path(sys.executable).parent)  # tfdist-train, as installed
    procs = {}
    for tf_config, command in processes:
        env = child_env(json.dumps(tf_config), PATH=bin_dir + os.pathsep + os.environ["PATH"])
        task = f"{tf_config['task']['type']}:{tf_config['task']['index']}"
        procs[task] = spawn(["bash", "-c", command], env)
    codes = {task: p.wait(timeout=600) for task, p in procs.items()}
    assert codes == {task: 0 for task in procs}, {t: p.output[-2000:] for t, p in procs.items()}
    chief = procs["worker:0" if strategy == "multiworker" else "chief:0"]
    summary = chief.wait_for_line(r"SUMMARY strategy=" + strategy, timeout=5)
    assert float(re.search(r"test_accuracy=([\d.]+)", summary).group(1)) >= 0.85
    if strategy == "multiworker":
        hashes = {re.search(r"weights_sha256=(\w+)", p.wait_for_line("weights_sha256=", 5)).group(1)
                  for p in procs.values()}
        assert len(hashes) == 1, "both workers must end with identical weights"
    else:
        for task in ("ps:0", "worker:0", "worker:1"):
            procs[task].wait_for_line("is gone; stopping", timeout=5)


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_the_notebook_runs(tmp_path):
    p = Proc([sys.executable, str(NOTEBOOK)], child_env(), cwd=tmp_path)  # its runs/ in tmp_path
    try:
        code = p.wait(timeout=900)
    finally:
        if p.proc.poll() is None:
            p.kill()
    assert code == 0, p.output[-3000:]
    lines = [line for line in p.lines if not re.match(r"\[(launch|chief|worker|ps)\b", line)]
    assert any(re.match(r"0\.\d+ 200 runs/one/model.keras$", line) for line in lines), p.output[-3000:]
    assert any("('worker:0', 200)" in line and "('worker:1', 200)" in line for line in lines)
    assert any(re.search(r"'worker:1': 1\b", line) for line in lines), "worker:1 restarted once"
    assert any(line.endswith("exit code 2") for line in lines)
