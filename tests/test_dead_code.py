"""No dead code: every function of ``tfdist/``, ``strategies/`` and ``models/`` is used.

A top-level function is used when a file of the project other than the tests names it: a
call or any other reference (``f``, ``module.f``) in a file that imports or names its
module, an import of it, or a string naming it (an ``importlib`` table's ``"module:f"``,
``pyproject.toml``'s entry points); a use inside its own module counts, its ``def`` does not.
A method (of a class whose bases are the project's own: an outside base may call its
subclass's hooks) is used when any file outside the tests uses its name. A function only the
tests name is dead too, unless it is API listed in ``TESTED_API`` with the reason it stays.
Functions under a decorator that may register them (a Keras serializable, a fixture) are
left out; ``property``, ``lru_cache`` and the other plain wrappers are not.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from conftest import REPO

CODE = ("tfdist/", "strategies/", "models/")
# Functions the library offers that nothing but the tests calls yet, and why each stays.
TESTED_API: dict[str, str] = {
    "strategies/kinds.py:unregister": "register()'s inverse: a kind a program registered goes again "
                                      "(the registry is the extension point for a new strategy kind)",
    "tfdist/flags.py:problems": "the check of a parser against its dataclasses that flags.py offers "
                                "every command (docs/architecture.md); tests/test_options.py runs it "
                                "over each command's parser",
}

_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    return [p for p in out.stdout.split() if not p.startswith("results/")]


# Decorators that only wrap: a function so decorated is still checked. Any other decorator
# may register it (a Keras serializable, a fixture), which is a use nothing here can see.
WRAPPERS = {"property", "staticmethod", "classmethod", "cached_property", "lru_cache", "cache",
            "contextmanager"}


def _checked(node: ast.AST) -> bool:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
        return False
    names = [ast.unparse(d.func if isinstance(d, ast.Call) else d).rpartition(".")[2]
             for d in node.decorator_list]
    return all(n in WRAPPERS for n in names)


def definitions(path: str, tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """``path:name`` -> the node, for every top-level function not registered by a decorator."""
    return {f"{path}:{node.name}": node for node in tree.body if _checked(node)}


def methods(path: str, tree: ast.Module, ours: set[str]) -> dict[str, str]:
    """``path:Class.name`` -> ``name`` for the methods of every class whose bases are the
    project's own (a method of an outside base's subclass may be a hook the base calls)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and all(
                isinstance(b, ast.Name) and b.id in ours for b in node.bases):
            found.update({f"{path}:{node.name}.{m.name}": m.name for m in node.body if _checked(m)})
    return found


def names_used(tree: ast.AST) -> set[str]:
    """Every name a file uses: identifiers, attributes, imported names, and the names a
    string holds (``"pkg.mod:f"``, ``"f"``, ``"pkg.mod.f"``)."""
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.alias):
            used.add(node.name.rpartition(".")[2])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used.update(_IDENTIFIER.findall(node.value) if len(node.value) < 200 else ())
    return used


# Programs run by path, which import each other by bare name.
PROGRAMS = ("tfdist/bench/peers/",)


def module_name(path: str) -> str:
    """The dotted name ``path`` installs as (``strategies/`` and ``models/`` under ``tfdist``;
    a program's bare name)."""
    if path.startswith(PROGRAMS):
        return Path(path).stem
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts and parts[0] in ("strategies", "models"):
        parts.insert(0, "tfdist")
    return ".".join(parts)


def modules_named(path: str, tree: ast.Module) -> set[str]:
    """Every module a file imports or names in a string (``"pkg.mod:f"`` in a table), and,
    for ``from pkg import x``, both ``pkg`` and ``pkg.x``."""
    package = module_name(path) if path.endswith("__init__.py") else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 200:
            found.update(re.findall(r"[A-Za-z_][\w.]*", node.value))
    return found


def dead_functions(files: dict[str, str]) -> tuple[list[str], list[str]]:
    """(dead, used only by the tests): ``path:name`` of each top-level function of the code
    folders that no file outside the tests names, split by whether a test names it. A file
    names ``f`` of module ``m`` when it is ``m`` and uses the name ``f`` in a body, or
    imports or names ``m`` and uses ``f`` (``m.f``, ``from m import f``, ``"m:f"``)."""
    trees = {path: ast.parse(text, path) for path, text in files.items() if path.endswith(".py")}
    defined: dict[str, tuple[str, str]] = {}  # key -> (module, name)
    for path, tree in trees.items():
        if path.startswith(CODE):
            defined.update({key: (module_name(path), key.rpartition(":")[2])
                            for key in definitions(path, tree)})
    readers = {path: (module_name(path), modules_named(path, tree), names_used(tree))
               for path, tree in trees.items()}
    # Not Python (pyproject.toml's entry points, the Makefile): "module:function".
    text_refs = {m for path, text in files.items() if not path.endswith(".py")
                 for m in re.findall(r"([\w.]+:\w+)", text)}

    def named_by(module: str, name: str, in_tests: bool) -> bool:
        if not in_tests and f"{module}:{name}" in text_refs:
            return True
        return any(name in used and (me == module or module in named)
                   for path, (me, named, used) in readers.items()
                   if path.startswith("tests/") == in_tests)

    dead, tests_only = [], []
    for key, (module, name) in sorted(defined.items()):
        if named_by(module, name, in_tests=False):
            continue
        (tests_only if named_by(module, name, in_tests=True) else dead).append(key)
    ours = {n.name for tree in trees.values() for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    in_code = set().union(*(used for path, (_, _, used) in readers.items() if not path.startswith("tests/")))
    in_tests = set().union(*(used for path, (_, _, used) in readers.items() if path.startswith("tests/")))
    for path, tree in trees.items():
        for key, name in methods(path, tree, ours).items() if path.startswith(CODE) else ():
            if name not in in_code:
                (tests_only if name in in_tests else dead).append(key)
    return sorted(dead), sorted(tests_only)


def _project_files() -> dict[str, str]:
    keep = [p for p in _tracked() if p.endswith(".py") or p in ("pyproject.toml", "Makefile")]
    return {p: (REPO / p).read_text() for p in keep if (REPO / p).exists()}


def test_no_function_is_dead():
    dead, tests_only = dead_functions(_project_files())
    unused = [k for k in dead + tests_only if k not in TESTED_API]
    assert unused == []


def test_every_allowance_is_still_needed():
    dead, tests_only = dead_functions(_project_files())
    assert sorted(k for k in TESTED_API if k not in tests_only) == []


def test_the_check_finds_dead_and_test_only_functions():
    files = {
        "tfdist/a.py": ("import functools\n\ndef used():\n    return helper()\n\n"
                        "def helper():\n    return 1\n\ndef dead():\n    return 2\n\n"
                        "def only_tested():\n    return 3\n\n@register\ndef registered():\n    return 4\n\n"
                        "@functools.lru_cache\ndef cached_dead():\n    return 5\n\n"
                        "class C:\n    @property\n    def dead_property(self):\n        pass\n\n"
                        "    def called(self):\n        pass\n\n"
                        "class Hook(keras.callbacks.Callback):\n    def on_epoch_end(self):\n        pass\n"),
        "tfdist/b.py": ("from tfdist.a import used\n"
                        "def f(c):\n    c.called()\n    return dead_elsewhere()\n\nf(used)\n"),
        "tfdist/d.py": "TABLE = {'x': 'tfdist.c:by_string'}\n",
        "tfdist/c.py": "def by_string():\n    pass\n\ndef entry():\n    pass\n\ndef dead_elsewhere():\n    pass\n",
        "tfdist/bench/peers/lib.py": "def shared():\n    pass\n",
        "tfdist/bench/peers/prog.py": "import lib\nlib.shared()\n",
        "tests/test_a.py": "from tfdist.a import only_tested\n\ndef test_x():\n    only_tested()\n",
        "pyproject.toml": "[project.scripts]\nx = \"tfdist.c:entry\"\n",
    }
    dead, tests_only = dead_functions(files)
    # b.py calls a dead_elsewhere() it never imports from c: a name alone is not a use of
    # another module's function. A registering decorator exempts; lru_cache does not.
    assert dead == ["tfdist/a.py:C.dead_property", "tfdist/a.py:cached_dead", "tfdist/a.py:dead",
                    "tfdist/c.py:dead_elsewhere"]
    assert tests_only == ["tfdist/a.py:only_tested"]
