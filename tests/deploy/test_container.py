"""The Dockerfile is well formed, without a container engine.

It is parsed instruction by instruction, its build context is rebuilt from
its COPY lines and .dockerignore, and the package is built from that
context the way its ``pip install`` would. Both locks (GPU-capable and CPU)
are checked against pyproject.toml. tests/image/ builds the image for real
and runs jobs of it (``make test-image``).
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

from tfdist.strategies.slurm import DEFAULT_PORT

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+")

ROOT = Path(__file__).resolve().parents[2]
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


def build_args() -> dict[str, str]:
    """Every ``ARG name=default`` of the Dockerfile."""
    pairs = [a.split("=", 1) for a in _all("ARG")]
    assert all(len(p) == 2 for p in pairs), "every build argument needs a default"
    return dict(pairs)


def _expand(text: str, args: dict[str, str] | None = None) -> str:
    """``${NAME}`` as a build with ``args`` (the defaults otherwise) sees it."""
    values = {**build_args(), **(args or {})}
    return re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], text)


def dockerfile_copies(args: dict[str, str] | None = None) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY, build arguments expanded."""
    result = []
    for raw in _all("COPY"):
        assert not raw.startswith("--from"), "single-stage build expected"
        parts = json.loads(raw) if raw.startswith("[") else shlex.split(raw)
        parts = [_expand(p, args) for p in parts]
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


def context_files(source: str) -> list[str]:
    """Files a COPY source brings into the image, relative to the repo root."""
    patterns = _ignore_patterns()
    files = []
    for match in glob.glob(str(ROOT / source)):
        path = Path(match)
        found = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        files += [p.relative_to(ROOT).as_posix() for p in found]
    return sorted(f for f in files if not _ignored(f, patterns))


def test_the_base_is_a_build_argument_defaulting_to_a_pinned_official_image():
    """``--build-arg BASE=...`` swaps the base (a mirror, a local stand-in); nothing else changes."""
    words = [w for w, _ in INSTR]
    first_from = words.index("FROM")
    assert set(words[:first_from]) == {"ARG"}, "only build arguments before FROM"
    assert _all("FROM") == ["${BASE}"]
    base = build_args()["BASE"]
    assert base == "python:3.11-slim-bookworm", f"the default base is the official image: {base}"
    assert ":" in base and not base.endswith(":latest"), f"pin the base image: {base}"


def test_every_copied_file_exists_and_survives_dockerignore():
    copies = dockerfile_copies()
    assert copies
    for sources, dest in copies:
        # A directory, or a file name for one file (the chosen lock, renamed).
        one_file = len(sources) == 1 and (ROOT / _expand(sources[0])).is_file() and "/" not in dest
        assert dest.endswith("/") or dest == "." or one_file, f"COPY destination {dest!r} should be a directory"
        for source in sources:
            assert context_files(source), f"COPY {source}: nothing in the build context"


def test_the_image_gets_everything_pyproject_installs():
    copied = {f for sources, _ in dockerfile_copies() for s in sources for f in context_files(s)}
    setuptools = PYPROJECT["tool"]["setuptools"]
    folders = setuptools.get("package-dir", {})
    for package in setuptools["packages"]:
        folder = folders.get(package, package.replace(".", "/"))
        assert f"{folder}/__init__.py" in copied, package
    for module in setuptools.get("py-modules", []):
        if (ROOT / f"{module}.py").exists():  # listed modules may not exist yet
            assert f"{module}.py" in copied, module
    assert {"pyproject.toml", PYPROJECT["project"]["readme"], "requirements.lock"} <= copied
    # The CPU variant's lock is in the build context too.
    cpu = {f for sources, _ in dockerfile_copies({"REQUIREMENTS": "requirements-cpu.lock"})
           for s in sources for f in context_files(s)}
    assert "requirements-cpu.lock" in cpu


def _index(predicate) -> int:
    found = [i for i, (word, args) in enumerate(INSTR) if predicate(word, args)]
    assert found, "instruction not found"
    return found[0]


def test_dependencies_get_their_own_layer_before_any_source():
    """A source edit must not reinstall gigabytes: lock, install, then sources, then --no-deps ."""
    copy_lock = _index(lambda w, a: w == "COPY" and a.split() == ["${REQUIREMENTS}", "requirements.lock"])
    assert build_args()["REQUIREMENTS"] == "requirements.lock", "the default image is the GPU-capable one"
    install_lock = _index(lambda w, a: w == "RUN" and "-r requirements.lock" in a)
    assert "--require-hashes" in INSTR[install_lock][1] and "--no-deps" in INSTR[install_lock][1]
    sources = [i for i, (w, a) in enumerate(INSTR) if w == "COPY" and i != copy_lock]
    install_pkg = _index(lambda w, a: w == "RUN" and re.search(r"pip install .*\s\.$", a))
    assert copy_lock < install_lock < min(sources), "dependencies first, from the lock alone"
    assert max(sources) < install_pkg, "the package is installed after every source is copied"
    assert "--no-deps" in INSTR[install_pkg][1] and "--no-build-isolation" in INSTR[install_pkg][1]
    pip_runs = [a for w, a in INSTR if w == "RUN" and "pip install" in a]
    assert len(pip_runs) == 2, pip_runs  # nothing else installs from an index


LOCKS = {"requirements.lock": "gpu", "requirements-cpu.lock": "cpu"}


def _lock(name: str = "requirements.lock") -> dict[str, tuple[str, list[str]]]:
    """A lock file as {name: (version, hashes)}."""
    text = (ROOT / name).read_text()
    entries = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 1)[1] if text.startswith("#") else text):
        m = re.match(r"([A-Za-z0-9._-]+)==([^\s\\]+)", block.strip())
        if m:
            entries[_normal(m.group(1))] = (m.group(2), re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
    return entries


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("lock_file", sorted(LOCKS))
def test_lock_pins_every_dependency_of_pyproject_with_hashes(lock_file):
    from packaging.requirements import Requirement
    from packaging.version import Version

    lock = _lock(lock_file)
    assert len(lock) > 20
    assert all(hashes for _, hashes in lock.values()), "every pin needs a hash (--require-hashes)"
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]["gpu"] if LOCKS[lock_file] == "gpu" else []
    wanted = [Requirement(r) for r in project["dependencies"] + extras]
    for req in wanted:
        name = _normal(req.name)
        assert name in lock, f"{req.name} is in pyproject.toml but not in {lock_file}: re-lock"
        assert Version(lock[name][0]) in req.specifier, \
            f"{lock_file} pins {req.name}=={lock[name][0]}, pyproject.toml asks {req.specifier}: re-lock"
    cuda = {n for n in lock if n.startswith("nvidia-")}
    if LOCKS[lock_file] == "gpu":  # tensorflow[and-cuda]: the CUDA wheels are pinned too.
        assert any(n.startswith("nvidia-cudnn") for n in cuda) and "nvidia-nccl-cu12" in cuda
    else:
        assert not cuda, f"the CPU lock pins CUDA wheels: {sorted(cuda)}"
    # setuptools: the package is built in the image with --no-build-isolation.
    assert "setuptools" in lock
    # The lock was made for the base image's Python.
    base_python = re.search(r"python:(\d+\.\d+)", build_args()["BASE"]).group(1)
    assert f"--python-version {base_python}" in (ROOT / lock_file).read_text()


def test_the_cpu_lock_is_the_gpu_lock_without_the_cuda_wheels():
    """Same pins, same hashes: the two images differ by the CUDA wheels only."""
    gpu, cpu = _lock("requirements.lock"), _lock("requirements-cpu.lock")
    assert set(gpu) - set(cpu) == {n for n in gpu if n.startswith("nvidia-")}
    assert set(cpu) <= set(gpu)
    for name, (version, hashes) in cpu.items():
        assert (version, sorted(hashes)) == (gpu[name][0], sorted(gpu[name][1])), name


def test_entrypoint_runs_train_py_under_tini():
    (entry,) = _all("ENTRYPOINT")
    argv = json.loads(entry)  # exec form: no shell between tini and python
    assert argv[:2] == ["tini", "--"], "an init process as PID 1 forwards signals and reaps"
    assert argv[2].startswith("python") and argv[-1].endswith("train.py")
    assert any(re.search(r"apt-get install .*\btini\b", a) for a in _all("RUN"))
    workdir, copied_to = "/", set()
    for word, args in INSTR:  # where each COPY puts its files
        if word == "WORKDIR":
            workdir = args.rstrip("/")
        elif word == "COPY" and args.split()[-1] in ("./", "."):
            copied_to |= {f"{workdir}/{f}" for s in shlex.split(args)[:-1] for f in context_files(s) if "/" not in f}
    assert argv[-1] in copied_to


def test_gpu_driver_capabilities_and_a_writable_default_model_dir():
    env = " ".join(_all("ENV"))
    assert re.search(r"NVIDIA_DRIVER_CAPABILITIES=compute,utility\b", env)
    # train.py's default --model-dir is relative to the final WORKDIR, which
    # must belong to the user the image runs as.
    from tfdist.protocol import default_model_dir

    assert not any(default_model_dir(s).startswith("/") for s in ("none", "multiworker", "ps"))
    final_dir = _all("WORKDIR")[-1]
    (user,) = _all("USER")
    assert any(re.search(rf"install -d -o {user} -g {user} {re.escape(final_dir)}(\s|$)", a) for a in _all("RUN"))


def test_exposes_the_port_every_manifest_uses_and_runs_unprivileged():
    assert _all("EXPOSE") == [str(DEFAULT_PORT)]
    assert DEFAULT_PORT == 2222
    (user,) = _all("USER")
    assert user.split(":")[0] not in ("0", "root")


def test_dockerignore_keeps_local_state_out():
    patterns = _ignore_patterns()
    for path in (".venv/bin/python", "runs/demo/results.json", ".git/HEAD",
                 "strategies/__pycache__/x.pyc", "tests/deploy/test_container.py"):
        assert _ignored(path, patterns), path
    assert not _ignored("strategies/slurm.py", patterns)


@pytest.mark.timeout(180)
def test_the_build_context_builds_the_package(tmp_path):
    """What `pip install .` does in the image, from exactly the files COPY brings."""
    pytest.importorskip("setuptools")
    context = tmp_path / "context"
    for sources, _ in dockerfile_copies():
        for s in sources:
            for rel in context_files(s):
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
    assert {"tfdist/cli/train.py", "tfdist/cli/launch.py", "tfdist/strategies/slurm.py",
            "tfdist/training/loop/controller.py", "tfdist/protocol.py", "tfdist/models/__init__.py"} <= names
