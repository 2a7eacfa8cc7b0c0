"""The Dockerfile is well formed, without a Docker daemon.

It is parsed instruction by instruction, its build context is rebuilt from
its COPY lines and .dockerignore, and the package is built from that
context the way its ``pip install`` would.
"""

from __future__ import annotations

import glob
import json
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from strategies.slurm import DEFAULT_PORT

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+")

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuations joined."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


INSTR = instructions(DOCKERFILE.read_text())


def _all(name):
    return [args for word, args in INSTR if word == name]


def _copies() -> list[tuple[list[str], str]]:
    result = []
    for args in _all("COPY"):
        assert not args.startswith("--from"), "single-stage build expected"
        parts = json.loads(args) if args.startswith("[") else shlex.split(args)
        result.append((parts[:-1], parts[-1]))
    return result


def _ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [l.strip() for l in lines if l.strip() and not l.lstrip().startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "exceptions are not modelled here"
    return patterns


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: a path is out if it or a parent matches a pattern."""
    parts = rel.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        rx = re.escape(pattern.strip("/"))
        rx = rx.replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        rx = rx.replace(r"\?", "[^/]")
        if any(re.fullmatch(rx, c) for c in candidates):
            return True
    return False


def _context_files(source: str) -> list[str]:
    """Files a COPY source brings into the image, relative to the repo root."""
    patterns = _ignore_patterns()
    files = []
    for match in glob.glob(str(ROOT / source)):
        path = Path(match)
        found = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        files += [p.relative_to(ROOT).as_posix() for p in found]
    return sorted(f for f in files if not _ignored(f, patterns))


def test_from_comes_first_and_names_a_pinned_base():
    assert INSTR[0][0] == "FROM"
    base = INSTR[0][1].split()[0]
    assert ":" in base and not base.endswith(":latest"), f"pin the base image: {base}"
    assert len(_all("FROM")) == 1


def test_every_copied_file_exists_and_survives_dockerignore():
    copies = _copies()
    assert copies
    for sources, dest in copies:
        assert dest.endswith("/") or dest == ".", f"COPY destination {dest!r} should be a directory"
        for source in sources:
            assert _context_files(source), f"COPY {source}: nothing in the build context"


def test_the_image_gets_everything_pyproject_installs():
    copied = {f for sources, _ in _copies() for s in sources for f in _context_files(s)}
    setuptools = PYPROJECT["tool"]["setuptools"]
    for package in setuptools["packages"]:
        assert f"{package}/__init__.py" in copied, package
    for module in setuptools["py-modules"]:
        if (ROOT / f"{module}.py").exists():  # listed modules may not exist yet
            assert f"{module}.py" in copied, module
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied


def test_it_installs_the_package_from_pyproject_with_the_gpu_extra():
    installs = [r for r in _all("RUN") if re.search(r"pip install\s+[\"']?\.(\[[\w,-]+\])?[\"']?(\s|$)", r)]
    assert len(installs) == 1, _all("RUN")
    extras = re.search(r"pip install\s+[\"']?\.\[([\w,-]+)\]", installs[0])
    assert extras and extras.group(1) == "gpu"
    gpu = PYPROJECT["project"]["optional-dependencies"]["gpu"]
    assert any(d.startswith("tensorflow[and-cuda]") for d in gpu), gpu


def test_entrypoint_runs_train_py_as_copied():
    (entry,) = _all("ENTRYPOINT")
    argv = json.loads(entry)  # exec form: signals reach python, not a shell
    assert argv[0].startswith("python") and argv[-1].endswith("train.py")
    workdir = _all("WORKDIR")[-1].rstrip("/")
    copied_to = {f"{workdir}/{f}" for sources, dest in _copies() if dest in ("./", ".")
                 for s in sources for f in _context_files(s) if "/" not in f}
    assert argv[-1] in copied_to


def test_exposes_the_port_every_manifest_uses_and_runs_unprivileged():
    assert _all("EXPOSE") == [str(DEFAULT_PORT)]
    assert DEFAULT_PORT == 2222
    (user,) = _all("USER")
    assert user.split(":")[0] not in ("0", "root")


def test_dockerignore_keeps_local_state_out():
    patterns = _ignore_patterns()
    for path in (".venv/bin/python", "runs/demo/results.json", ".git/HEAD",
                 "strategies/__pycache__/x.pyc", "tests/test_container.py"):
        assert _ignored(path, patterns), path
    assert not _ignored("strategies/slurm.py", patterns)


@pytest.mark.timeout(180)
def test_the_build_context_builds_the_package(tmp_path):
    """What `pip install .` does in the image, from exactly the files COPY brings."""
    pytest.importorskip("setuptools")
    context = tmp_path / "context"
    for sources, _ in _copies():
        for s in sources:
            for rel in _context_files(s):
                (context / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, context / rel)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(tmp_path / "wheel"), str(context)],
        capture_output=True, text=True, timeout=170,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"train.py", "launch.py", "strategies/slurm.py", "training/runners.py",
            "models/__init__.py"} <= names
