"""The package as a user installs it: license shipped, console scripts that work anywhere.

The wheel is built from a copy of this checkout with the environment's own
setuptools (no build isolation, no index), installed into a fresh venv that
sees this environment's dependencies (TensorFlow is not installed twice),
and its console scripts run from a directory holding a ``models/`` package
of the user's own, which must never be imported.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import REPO, child_env

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+")

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
SCRIPTS = {"tfdist-train": "tfdist.cli.train:main", "tfdist-launch": "tfdist.cli.launch:main",
           "tfdist-bench": "tfdist.cli.bench:main"}
# The canonical text (https://www.apache.org/licenses/LICENSE-2.0.txt), by its SHA-256.
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", "venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
    "results", "tests",
)


def test_license_is_the_apache_2_text_and_declared_as_spdx():
    import hashlib

    assert hashlib.sha256((REPO / "LICENSE").read_bytes()).hexdigest() == APACHE_2_SHA256
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    assert PROJECT["requires-python"] == ">=3.10,<3.14"
    assert PROJECT["scripts"] == SCRIPTS
    requires = PYPROJECT["build-system"]["requires"]
    assert any(r.replace(" ", "").startswith("setuptools>=") and int(r.split(">=")[1].split(".")[0]) >= 77
               for r in requires), requires


def test_the_container_image_gets_the_license():
    from test_container import context_files, dockerfile_copies

    copied = {f for sources, _ in dockerfile_copies() for s in sources for f in context_files(s)}
    assert set(PROJECT["license-files"]) <= copied


BAD_ARGV = {"tfdist.cli.train:main": ["--epochs=0", "--dry-run"],
            "tfdist.cli.launch:main": ["--strategy", "horovod"],
            "tfdist.cli.bench:main": ["--steps", "0"]}


@pytest.mark.parametrize("target", sorted(SCRIPTS.values()))
def test_each_console_script_returns_an_exit_code(target, capsys, tmp_path, monkeypatch):
    """The wrapper does sys.exit(main()): main must return the code, not print it."""
    monkeypatch.chdir(tmp_path)
    module, _, func = target.partition(":")
    main = getattr(importlib.import_module(module), func)
    with pytest.raises(SystemExit) as done:  # argparse's --help exits 0 itself
        main(["--help"])
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out
    assert main(BAD_ARGV[target]) == 2
    assert capsys.readouterr().err.startswith("error:")
    assert list(tmp_path.iterdir()) == []


def _site_packages() -> list[str]:
    paths = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return list(dict.fromkeys(p for p in paths if os.path.isdir(p)))


class Installed(NamedTuple):
    venv: Path
    site: Path
    env: dict
    seconds: float  # building the wheel and installing it


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    """The wheel built from a copy of this checkout, installed into a fresh venv."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    started = time.monotonic()
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=NOT_COPIED)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(tmp_path / "wheel"), str(src)],
        capture_output=True, text=True, timeout=120,
    )
    assert built.returncode == 0, (
        "building the wheel needs setuptools>=77 in this environment (pip install -e '.[dev]'):\n"
        + built.stdout[-2000:] + built.stderr[-2000:]
    )
    assert "did not match any files" not in built.stdout + built.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        # One import name: everything under tfdist/, the two top-level folders mapped into it,
        # without the checkout's tutorial programs or its train/launch/bench.py commands.
        assert {"tfdist/__init__.py", "tfdist/api.py", "tfdist/cli/bench.py",
                "tfdist/bench/suites/scenarios.py", "tfdist/strategies/kinds.py",
                "tfdist/models/mnist.py", "tfdist/training/run.py"} <= names
        assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} \
            == {"tfdist"}, sorted(names)
        assert not any("/peers/" in n for n in names)
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        assert zf.read(f"{dist_info}/top_level.txt").decode().split() == ["tfdist"]
        assert zf.read(f"{dist_info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
        metadata = zf.read(f"{dist_info}/METADATA").decode()
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()
    assert "Requires-Python: <3.14,>=3.10" in metadata.splitlines()
    for name, target in SCRIPTS.items():
        assert f"{name} = {target}" in entry_points

    # A fresh venv that sees this environment's packages (TensorFlow, pip) but
    # not this checkout: a plain path list, so no editable-install hook runs.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    venv_site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.strip())
    (venv_site / "_parent_env.pth").write_text("\n".join(_site_packages()) + "\n")
    env = child_env()
    env.pop("PYTHONPATH", None)
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
         "--quiet", str(wheel)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    return Installed(venv, venv_site, env, time.monotonic() - started)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_wheel_installs_into_a_fresh_venv_and_its_scripts_run_anywhere(installed, tmp_path):
    started = time.monotonic()
    venv, venv_site, env = installed.venv, installed.site, installed.env
    python = venv / "bin" / "python"

    # The user's directory, with a models/ package of their own.
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "__init__.py").write_text(
        'raise ImportError("the user\'s own models/ package was imported")\n')
    (home / "train.py").write_text('raise SystemExit("the user\'s own train.py was run")\n')
    before = sorted(p.relative_to(home).as_posix() for p in home.rglob("*"))

    def run(*cmd, timeout=120):
        return subprocess.run(cmd, cwd=home, env=env, capture_output=True, text=True, timeout=timeout)

    # -I: `python -c` would put the current directory (the user's) first on sys.path.
    where = run(str(python), "-I", "-c", "import tfdist, tfdist.models, tfdist.strategies; "
                "print(tfdist.__file__); print(tfdist.models.__file__); "
                "print(tfdist.strategies.__file__)")
    assert where.returncode == 0, where.stderr
    for path in where.stdout.split():
        assert Path(path).is_relative_to(venv_site), where.stdout
    for generic in ("train", "launch", "bench", "protocol", "models", "strategies", "training",
                    "launcher"):
        gone = run(str(python), "-I", "-c", f"import {generic}")
        assert "ModuleNotFoundError" in gone.stderr, (generic, gone.stderr[-500:])
    for name in SCRIPTS:
        helped = run(str(venv / "bin" / name), "--help")
        assert helped.returncode == 0, f"{name}: {helped.stderr[-2000:]}"
        assert "usage:" in helped.stdout
    planned = run(str(venv / "bin" / "tfdist-train"), "--dry-run", "--model-dir", str(home / "run"))
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert '"strategy": "mirrored"' in planned.stdout
    refused = run(str(venv / "bin" / "tfdist-train"), "--epochs=0", "--dry-run")
    assert refused.returncode == 2 and refused.stderr.startswith("error: --epochs=0"), refused.stderr
    assert sorted(p.relative_to(home).as_posix() for p in home.rglob("*")) == before
    assert installed.seconds + time.monotonic() - started < 120


# A user's project as ML code is usually laid out: packages named like the
# library's own former top-level modules, and a task that imports from them.
USER_FILES = {
    "models/__init__.py": "",
    "models/mynet.py": '''
import keras


def make(classes):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(classes, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model
''',
    "training/__init__.py": "",
    "training/workload/data.py": '''
import numpy as np


def planted(n, seed):
    """A linearly separable 3-class problem: the label is the argmax of x @ W."""
    w = np.random.default_rng(0).normal(size=(8, 3))
    x = np.random.default_rng(seed).normal(size=(n, 8)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int64")
''',
    "strategies/__init__.py": "CLASSES = 3\n",
    "launcher/__init__.py": "TRAIN, TEST = 2048, 512\n",
    "protocol.py": "SEEDS = {'train': 1, 'test': 2}\n",
    "task.py": '''
import tensorflow as tf

import protocol
from launcher import TEST, TRAIN
from models.mynet import make
from strategies import CLASSES
from training.workload.data import planted


def build_model():
    return make(CLASSES)


def dataset(split):
    x, y = planted(TRAIN if split == "train" else TEST, protocol.SEEDS[split])
    return tf.data.Dataset.from_tensor_slices((x, y))
''',
    # A notebook's cells, as one script: one process, then a 2-worker cluster.
    "notebook.py": '''
import json

import tfdist
import task

here = tfdist.fit("task.py", strategy="none",
                  options=tfdist.TrainOptions(steps=60, model_dir="api-none"))
cluster = tfdist.fit(task, workers=2, options=tfdist.TrainOptions(steps=60, model_dir="api-mw"))
try:
    tfdist.fit(lambda: None, workers=2, options=tfdist.TrainOptions(steps=1))
except tfdist.TfdistError as err:
    refused = [err.exit_code, err.message]
print(json.dumps({"none": [here.strategy, here.global_step, here.metrics["accuracy"]],
                  "multiworker": [cluster.strategy, cluster.global_step,
                                  cluster.metrics["accuracy"], [t.member for t in cluster.members]],
                  "refused": refused}))
''',
}


# Five trainings through the installed wheel (~70 s idle): the long tier; the default
# tier installs the same wheel and runs its commands (the test above).
@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.timeout(420)
def test_a_users_own_top_level_packages_never_collide(installed, tmp_path):
    """models/, training/, strategies/, launcher/ and protocol.py of the user's own, imported by
    their task, trained through the installed commands and the Python API, from their folder."""
    home = tmp_path / "project"
    for rel, text in USER_FILES.items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(text.lstrip())
    bin_ = installed.venv / "bin"

    def run(*cmd):
        done = subprocess.run([str(c) for c in cmd], cwd=home, env=installed.env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{cmd}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    def accuracy(run_dir):
        record = json.loads((home / run_dir / "results.json").read_text())
        return record["strategy"], record["global_steps"], record["test_metrics"]["accuracy"]

    run(bin_ / "tfdist-train", "--task", "task.py", "--strategy", "none", "--steps", "60",
        "--model-dir", "cli-none")
    run(bin_ / "tfdist-launch", "--strategy", "multiworker", "--workers", "2", "--",
        "--task", "task.py", "--steps", "60", "--model-dir", "cli-mw")
    run(bin_ / "tfdist-launch", "--strategy", "ps", "--workers", "2", "--ps", "1", "--",
        "--task", "task.py", "--steps", "50", "--model-dir", "cli-ps")
    for run_dir, strategy, steps in (("cli-none", "none", 60), ("cli-mw", "multiworker", 60),
                                     ("cli-ps", "ps", 50)):
        got = accuracy(run_dir)
        assert got[:2] == (strategy, steps) and got[2] > 0.8, (run_dir, got)

    api = json.loads(run(installed.venv / "bin" / "python", "notebook.py").stdout.splitlines()[-1])
    assert api["none"][:2] == ["none", 60] and api["none"][2] > 0.8, api
    assert api["multiworker"][:2] == ["multiworker", 60] and api["multiworker"][2] > 0.8, api
    assert api["multiworker"][3] == ["worker:0", "worker:1"], api
    assert api["refused"][0] == 2 and "pass a module or file" in api["refused"][1], api
    # Nothing of the library was written into the user's packages.
    assert sorted(p.name for p in (home / "models").iterdir() if p.suffix == ".py") == [
        "__init__.py", "mynet.py"]
