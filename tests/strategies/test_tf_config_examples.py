"""Every TF_CONFIG in TF_CONFIG_examples/ is accepted by TensorFlow and by train.py.

Layout: ``TF_CONFIG_examples/<strategy>/[<variant>/]<type>-<index>.json``; the
first directory is the ``--strategy`` the file is for, the file's own
directory is one cluster layout. Adding a file adds its tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "TF_CONFIG_examples"
FILES = sorted(EXAMPLES.rglob("*.json"))
LAYOUTS = sorted({f.parent for f in FILES})
DRY_RUN_TIMEOUT = 120


def _id(path: Path) -> str:
    return path.relative_to(EXAMPLES).as_posix()


def _strategy(path: Path) -> str:
    return path.relative_to(EXAMPLES).parts[0]


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _dry_run(tmp_path: Path, strategy: str, tf_config: str | None, flag: str = "--dry-run"):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    model_dir = tmp_path / "m"
    proc = subprocess.run(
        [sys.executable, "train.py", flag, f"--strategy={strategy}",
         "--model-dir", str(model_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output\nstderr:\n{proc.stderr}"
    assert not model_dir.exists(), "--dry-run created the model dir"
    return json.loads(lines[-1])


def test_examples_exist():
    strategies = {_strategy(f) for f in FILES}
    assert strategies == {"multiworker", "ps"}
    assert (EXAMPLES / "README.md").is_file()
    assert (EXAMPLES / "mirrored" / "README.md").is_file()
    assert not list((EXAMPLES / "mirrored").rglob("*.json")), "mirrored needs no TF_CONFIG"


@pytest.mark.parametrize("path", FILES, ids=_id)
def test_file_shape_and_name(path):
    data = _load(path)
    assert set(data) == {"cluster", "task"}
    task = data["task"]
    assert set(task) == {"type", "index"}
    assert path.name == f"{task['type']}-{task['index']}.json", "file name must be <type>-<index>.json"
    assert 0 <= task["index"] < len(data["cluster"][task["type"]])


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_layout_shares_cluster_and_covers_every_task(layout):
    files = sorted(layout.glob("*.json"))
    clusters = [_load(f)["cluster"] for f in files]
    assert all(c == clusters[0] for c in clusters), f"{_id(layout)}: files disagree on the cluster"
    tasks = defaultdict(int)
    for f in files:
        task = _load(f)["task"]
        tasks[(task["type"], task["index"])] += 1
    expected = {(role, i) for role, addrs in clusters[0].items() for i in range(len(addrs))}
    assert set(tasks) == expected, f"{_id(layout)}: tasks without a file: {sorted(expected - set(tasks))}"
    assert all(n == 1 for n in tasks.values())
    addresses = [a for addrs in clusters[0].values() for a in addrs]
    assert len(addresses) == len(set(addresses)), "every task needs its own host:port"


@pytest.mark.parametrize("path", FILES, ids=_id)
def test_tensorflow_resolver_accepts(path, monkeypatch):
    import tensorflow as tf

    data = _load(path)
    monkeypatch.setenv("TF_CONFIG", path.read_text())
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    assert resolver.cluster_spec().as_dict() == data["cluster"]
    assert resolver.task_type == data["task"]["type"]
    assert resolver.task_id == data["task"]["index"]


@pytest.mark.parametrize("path", FILES, ids=_id)
def test_train_dry_run_accepts(path, tmp_path):
    strategy = _strategy(path)
    task = _load(path)["task"]
    # Every --dry-run check without the GPU listing's TensorFlow import (the
    # launcher's pre-flight); the full --dry-run runs below and in test_kinds.
    plan = _dry_run(tmp_path, strategy, path.read_text(), flag="--check-only")
    assert plan["strategy"] == strategy
    assert plan["task"] == f"{task['type']}:{task['index']}"
    assert plan["role"] == task["type"]


def test_mirrored_dry_run_needs_no_tf_config(tmp_path):
    plan = _dry_run(tmp_path, "mirrored", None)
    assert plan["strategy"] == "mirrored"
    assert plan["task"] == "local:0"
