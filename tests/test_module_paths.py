"""Every ``python -m X`` the project names resolves: a module that exists and runs as a program.

Read from the code (``tfdist/``, ``strategies/``, ``models/``, the commands at the top, what
they print and the argv they build: ``python -m X``, ``[sys.executable, "-m", "X"]``,
``("-m", "X")``), the Makefile and ``.ci/``, and every document (``README.md``, ``docs/``
and the other folders' ``*.md``). Each target must be found by ``importlib.util.find_spec``
(nothing of it runs: its parent packages import, which are TensorFlow-free) and run as a
program: a module with an ``if __name__ == "__main__":`` block, or a package with a
``__main__.py``. The check names no module itself, so moving a module only changes the
strings that name it.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

from conftest import REPO

# ``python -m X`` in prose, a shell line or a printed string; ``$(PY) -m X`` in the Makefile;
# ``[sys.executable, "-m", "X"]`` and ``("-m", "X")`` in an argv built by the code.
_TARGET = re.compile(r"(?:\bpython3?|\$\(PY(?:THON)?\))\s+-m\s+([A-Za-z_][\w.]*[\w])"
                     r"|[\"']-m[\"'],\s*[\"']([A-Za-z_][\w.]*[\w])[\"']")



def _sources() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    files = out.stdout.split()
    code = [f for f in files if f.endswith(".py") and not f.startswith(("tests/", "results/"))]
    docs = [f for f in files if f.endswith(".md") and not f.startswith(("tests/", "results/"))]
    other = [f for f in files if f == "Makefile" or f.startswith(".ci/")]
    return sorted(set(code + docs + other))


def targets(text: str) -> list[str]:
    return [a or b for a, b in _TARGET.findall(text)]


def named_targets(paths: list[str], root: Path = REPO) -> dict[str, set[str]]:
    """target -> the files that name it."""
    found: dict[str, set[str]] = {}
    for path in paths:
        for target in targets((root / path).read_text(errors="replace")):
            found.setdefault(target, set()).add(path)
    return found


def runs_as_program(target: str) -> bool:
    """The module is found and has a ``__main__`` block, or is a package with ``__main__.py``."""
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return False
    if spec is None or spec.origin is None:
        return False
    if spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
        return (Path(spec.origin).parent / "__main__.py").exists()
    if not spec.origin.endswith(".py"):
        return False
    return re.search(r"^if __name__ == [\"']__main__[\"']:", Path(spec.origin).read_text(),
                     flags=re.M) is not None


def stale(found: dict[str, set[str]]) -> list[str]:
    return sorted(f"{path}: python -m {target}" for target, paths in found.items()
                  if not runs_as_program(target) for path in paths)


def test_every_python_m_target_runs_as_a_program():
    found = named_targets(_sources())
    # The real tree: the commands' argv and the documented tools are all read.
    assert {"tfdist.cli.train", "tfdist.strategies.server", "pytest"} <= set(found)
    assert stale(found) == []


def test_the_check_finds_stale_targets(tmp_path):
    (tmp_path / "a.md").write_text("run `python -m tfdist.no_such_module --x` or "
                                   "`python -m tfdist.protocol` then python3 -m tfdist.cli.train\n")
    (tmp_path / "b.py").write_text('ARGV = [sys.executable, "-m", "tfdist.gone.away", "x"]\n'
                                   'TRAIN = ("-m", "tfdist.cli.launch")\n'
                                   'print("see python -m bench.soak")\n')
    (tmp_path / "Makefile").write_text("test:\n\t$(PY) -m pytest -q -m 'not long'\n")
    found = named_targets(["a.md", "b.py", "Makefile"], root=tmp_path)
    assert set(found) == {"tfdist.no_such_module", "tfdist.protocol", "tfdist.cli.train",
                          "tfdist.gone.away", "tfdist.cli.launch", "bench.soak", "pytest"}
    # protocol exists but is no program (no __main__ block); the others are gone.
    assert stale(found) == ["a.md: python -m tfdist.no_such_module", "a.md: python -m tfdist.protocol",
                            "b.py: python -m bench.soak", "b.py: python -m tfdist.gone.away"]
