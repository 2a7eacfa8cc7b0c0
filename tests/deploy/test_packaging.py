"""The package as a user installs it: license shipped, console scripts that work anywhere.

The wheel is built from a copy of this checkout with the environment's own
setuptools (no build isolation, no index), installed into a fresh venv that
sees this environment's dependencies (TensorFlow is not installed twice),
and its console scripts run from a directory holding a ``models/`` package
of the user's own, which must never be imported.
"""

from __future__ import annotations

import importlib
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, child_env

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+")

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
SCRIPTS = {"tfdist-train": "train:main", "tfdist-launch": "launch:main",
           "tfdist-bench": "tfdist.bench.cli:main"}
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


BAD_ARGV = {"train:main": ["--epochs=0", "--dry-run"], "launch:main": ["--strategy", "horovod"],
            "tfdist.bench.cli:main": ["--steps", "0"]}


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


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_wheel_installs_into_a_fresh_venv_and_its_scripts_run_anywhere(tmp_path):
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
        # The bench package, without the checkout's tutorial programs or its bench.py command.
        assert {"bench/__init__.py", "bench/cli.py", "bench/scenarios.py"} <= names
        assert not any(n.startswith("bench/peers/") for n in names) and "bench.py" not in names
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
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
    where = run(str(python), "-I", "-c", "import train, models, strategies; "
                "print(train.__file__); print(models.__file__); print(strategies.__file__)")
    assert where.returncode == 0, where.stderr
    for path in where.stdout.split():
        assert Path(path).is_relative_to(venv_site), where.stdout
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
    assert time.monotonic() - started < 120
