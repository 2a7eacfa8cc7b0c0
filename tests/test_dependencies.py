"""Dependencies point one way: no import cycle among the project's own modules.

The graph is built from the source, without importing anything: every
``import`` and ``from ... import`` (function-local ones too) and every
module name a module hands to ``importlib.import_module`` (a string naming
one of the project's modules, in a module that calls it). A cycle through
``importlib`` is a cycle all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Folder -> the dotted package it installs as: the tfdist package, and the two
# top-level folders setuptools maps into it (pyproject.toml's package-dir).
PACKAGES = {"tfdist": "tfdist", "strategies": "tfdist.strategies", "models": "tfdist.models"}
# Not modules of the project: the tutorials' programs (run by path, they
# import each other by bare name) and the tests.
NOT_MODULES = ("tfdist/bench/peers/",)

# Edges still in the graph that a change under way removes; each one is
# allowed here and nowhere else (tests/strategies/ reads this list too).
KNOWN_EDGES: set[tuple[str, str]] = set()  # none: every import points one way


def project_modules() -> dict[str, Path]:
    """Every module of the project: dotted name -> file."""
    found = {p.stem: p for p in REPO.glob("*.py")}
    for folder, package in PACKAGES.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO).as_posix()
            if any(rel.startswith(prefix) for prefix in NOT_MODULES):
                continue
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _target(name: str, modules) -> str | None:
    """The most specific project module ``name`` (or one of its parents) names."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_import_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in ("import_module", "__import__")


def _importlib_targets(tree: ast.AST, modules) -> set[str]:
    """Modules a file may import by name at run time: the string argument of an
    ``import_module`` call, and, in a file that calls it, dotted strings
    naming a module (``"pkg.mod"`` or ``"pkg.mod:NAME"`` kept in a table)."""
    calls = [n for n in ast.walk(tree) if _is_import_call(n)]
    if not calls:
        return set()
    found = {arg.value for call in calls for arg in call.args[:1]
             if isinstance(arg, ast.Constant) and isinstance(arg.value, str)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value.partition(":")[0]
            if "." in name and name in modules:
                found.add(name)
    return {name for name in found if name in modules}


def imports_of(module: str, path: Path, modules) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in modules else base)
    names.update(_importlib_targets(tree, modules))
    targets = {_target(n, modules) for n in names}
    return {t for t in targets if t is not None and t != module}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def without_known(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {t for t in targets if (m, t) not in KNOWN_EDGES} for m, targets in graph.items()}


def test_no_import_cycle_among_the_projects_modules():
    assert cycles(without_known(import_graph())) == []


# docs/architecture.md's order: a module imports only from layers after its own.
LAYERS = (("train", "launch", "bench"), ("tfdist.cli",), ("tfdist", "tfdist.api"),
          ("tfdist.bench",), ("tfdist.launcher",), ("tfdist.training",), ("tfdist.options",),
          ("tfdist.models",), ("tfdist.strategies",), ("tfdist.protocol", "tfdist.flags", "tfdist.linux"))


def layer(module: str) -> int:
    """The layer of the longest package prefix of ``module`` named in LAYERS."""
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (
                    best is None or len(name) > len(best[1])):
                best = (i, name)
    return best[0]


def test_imports_point_down_the_layers():
    upward = sorted(f"{m} -> {t}" for m, targets in without_known(import_graph()).items()
                    for t in targets if layer(t) < layer(m))
    assert upward == []


def test_every_known_exception_is_still_an_edge():
    # Once the change removes an edge, its entry must go too.
    graph = import_graph()
    assert [e for e in KNOWN_EDGES if e[1] not in graph.get(e[0], set())] == []


def test_the_graph_sees_static_local_and_importlib_imports(tmp_path):
    # It must be able to fail: a cycle through a function-local import and
    # one through an importlib string are both found.
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py", "c": tmp_path / "c.py",
               "pkg": tmp_path / "pkg" / "__init__.py", "pkg.d": tmp_path / "pkg" / "d.py"}
    (tmp_path / "pkg").mkdir()
    modules["a"].write_text("import b\n")
    modules["b"].write_text("def f():\n    from a import thing\n")
    modules["c"].write_text("import importlib\nM = ('pkg.d', 'X')\n"
                            "def g():\n    return importlib.import_module(M[0])\n")
    modules["pkg"].write_text("")
    modules["pkg.d"].write_text("from . import x\nfrom c import y\n")
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    assert graph["b"] == {"a"} and graph["c"] == {"pkg.d"} and graph["pkg.d"] == {"pkg", "c"}
    assert cycles(graph) == [["a", "b"], ["c", "pkg.d"]]


def test_the_graph_covers_the_project():
    graph = import_graph()
    assert {"train", "launch", "bench", "tfdist", "tfdist.api", "tfdist.protocol",
            "tfdist.cli.bench", "tfdist.launcher.config", "tfdist.strategies.kinds",
            "tfdist.training.loop.controller", "tfdist.models"} <= set(graph)
    assert not any(m.startswith(("tests", "tfdist.bench.peers")) for m in graph)
    assert "tfdist.launcher.config" in graph["tfdist.cli.launch"]
    assert "tfdist.protocol" in graph["tfdist.strategies.tf_config"]
    assert layer("tfdist.cli.train") < layer("tfdist.api") < layer("tfdist.training.plan")


# tfdist/training/'s sub-packages: the loop and the workload are shared; each
# strategy's sub-package is imported only from the entry modules at the top of
# training (run, plan, assemble), never from another strategy's or the loop.
TRAINING_SUBPACKAGES = ("loop", "workload", "sync", "ps", "pipeline")
# (importer, imported) pairs that must never appear.
FORBIDDEN_SUBPACKAGE_EDGES = {("ps", "pipeline"), ("pipeline", "ps"), ("sync", "ps"),
                              ("ps", "sync"), ("sync", "pipeline"), ("pipeline", "sync"),
                              ("loop", "ps"), ("loop", "sync"), ("loop", "pipeline"),
                              ("workload", "loop"), ("workload", "ps"), ("workload", "sync"),
                              ("workload", "pipeline")}


def training_subpackage(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] == ["tfdist", "training"] and len(parts) > 3 and parts[2] in TRAINING_SUBPACKAGES:
        return parts[2]
    return None


def sideways_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if (training_subpackage(m), training_subpackage(t)) in FORBIDDEN_SUBPACKAGE_EDGES)


def test_training_subpackages_import_no_sibling_strategy():
    assert sideways_imports(import_graph()) == []


def test_the_subpackage_rule_can_fail():
    graph = {"tfdist.training.ps.ps_trainer": {"tfdist.training.pipeline.stages"},
             "tfdist.training.loop.controller": {"tfdist.training.sync.sync_trainer"},
             "tfdist.training.assemble": {"tfdist.training.ps.ps_trainer"}}
    assert sideways_imports(graph) == [
        "tfdist.training.loop.controller -> tfdist.training.sync.sync_trainer",
        "tfdist.training.ps.ps_trainer -> tfdist.training.pipeline.stages"]


def test_training_top_keeps_at_most_twelve_modules():
    top = sorted(p.name for p in (REPO / "tfdist" / "training").glob("*.py"))
    assert len(top) <= 12, top


# --- command lines are parsed in tfdist/cli/ only ------------------------------------------

# Modules outside tfdist/cli/ that may import argparse, and why.
ARGPARSE_ALLOWED = {
    "tfdist/flags.py": "declares each option once as a dataclass field and hands the parsers in "
                       "cli/ their flags (add_options, from_args); it parses no command line itself",
    "tfdist/bench/peers/": "competitor programs, not the library: each is written the way "
                           "TensorFlow's tutorials (or Ray Train's) write theirs, flags included, and "
                           "is run by path (launch.py --program), never imported",
}


def imports_argparse(text: str) -> bool:
    """Any ``import argparse`` or ``from argparse import ...``, function-local ones too."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "argparse":
            return True
    return False


def parsers_outside_cli(files: dict[str, str]) -> list[str]:
    allowed = tuple(ARGPARSE_ALLOWED)
    return sorted(path for path, text in files.items()
                  if not path.startswith("tfdist/cli/") and not path.startswith(allowed)
                  and imports_argparse(text))


def _code_files() -> dict[str, str]:
    paths = [p for folder in PACKAGES for p in (REPO / folder).rglob("*.py")]
    return {p.relative_to(REPO).as_posix(): p.read_text() for p in paths}


def test_only_cli_parses_command_lines():
    assert parsers_outside_cli(_code_files()) == []


def test_every_parser_allowance_is_still_needed():
    files = _code_files()
    assert "tfdist/cli/train.py" in files and imports_argparse(files["tfdist/cli/train.py"])


def test_the_parser_rule_can_fail():
    files = {"tfdist/cli/x.py": "import argparse\n",
             "tfdist/bench/y.py": "def main():\n    import argparse\n",
             "tfdist/training/z.py": "from argparse import ArgumentParser\n",
             "tfdist/bench/peers/p.py": "import argparse\n",
             "tfdist/flags.py": "import argparse\n",
             "strategies/w.py": "import json  # argparse in a comment only\n"}
    assert parsers_outside_cli(files) == ["tfdist/bench/y.py", "tfdist/training/z.py"]


# --- every package stays small, and the benchmark's wings do not import each other ----------

MAX_MODULES = 12  # .py files at a package's top, __init__.py included


def packages() -> list[str]:
    """Every package of the project (a folder with ``__init__.py``), as a path from the root."""
    return sorted(p.parent.relative_to(REPO).as_posix() for folder in PACKAGES
                  for p in (REPO / folder).rglob("__init__.py"))


def over_the_cap(counts: dict[str, int], limit: int = MAX_MODULES) -> list[str]:
    return sorted(f"{package}: {n}" for package, n in counts.items() if n > limit)


def _module_counts() -> dict[str, int]:
    return {package: len(list((REPO / package).glob("*.py"))) for package in packages()}


def test_every_package_keeps_at_most_twelve_modules_at_its_top():
    counts = _module_counts()
    assert {"tfdist", "tfdist/bench", "tfdist/bench/suites", "tfdist/cli", "tfdist/training",
            "tfdist/training/loop", "strategies", "models"} <= set(counts)
    assert over_the_cap(counts) == []


def test_the_cap_can_fail():
    assert over_the_cap({"a": 12, "b": 13, "c/d": 20}) == ["b: 13", "c/d: 20"]


# tfdist/bench/'s wings share only the top (config, common, link_limit); neither imports the other.
BENCH_WINGS = ("suites", "links")


def wing(module: str, package: str, wings: tuple[str, ...]) -> str | None:
    """The wing of ``package`` (``tfdist.bench``) that ``module`` lies in, if any."""
    parts, top = module.split("."), package.split(".")
    if parts[:len(top)] == top and len(parts) > len(top) + 1 and parts[len(top)] in wings:
        return parts[len(top)]
    return None


def sideways(graph: dict[str, set[str]], package: str, wings: tuple[str, ...]) -> list[str]:
    """Every import from one wing of ``package`` into another."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if (a := wing(m, package, wings)) and (b := wing(t, package, wings)) and a != b)


def bench_sideways(graph: dict[str, set[str]]) -> list[str]:
    return sideways(graph, "tfdist.bench", BENCH_WINGS)


def test_bench_wings_import_no_sibling_wing():
    graph = import_graph()
    assert "tfdist.bench.common" in graph["tfdist.bench.suites.scenarios"]
    assert bench_sideways(graph) == []


def test_the_bench_wing_rule_can_fail():
    graph = {"tfdist.bench.suites.scaling": {"tfdist.bench.links.table", "tfdist.bench.link_limit"},
             "tfdist.bench.links.table": {"tfdist.bench.common", "tfdist.bench.links.overlap"},
             "tfdist.bench.soak": {"tfdist.bench.suites.default"}}
    assert bench_sideways(graph) == ["tfdist.bench.suites.scaling -> tfdist.bench.links.table"]


def dotted(package: str) -> str:
    parts = package.split("/")
    return ".".join(["tfdist", *parts] if parts[0] in ("strategies", "models") else parts)


def test_the_wheel_lists_every_package():
    # pyproject.toml names each package the wheel holds; a sub-package missing there
    # imports from a checkout and is absent once installed.
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {dotted(p) for p in packages()}
    assert {"tfdist.bench.suites", "tfdist.strategies"} <= found
    assert sorted(found ^ listed) == []


# tfdist/launcher/'s wings: each imports the top's shared modules (config, plan, policy,
# state, membership, files) and its own wing's, never another wing's; only the top (the
# job, the attempt loop, the checks, the outcome) puts the wings together.
LAUNCHER_WINGS = ("engine", "machine", "recovery")


def launcher_sideways(graph: dict[str, set[str]]) -> list[str]:
    return sideways(graph, "tfdist.launcher", LAUNCHER_WINGS)


def test_launcher_wings_import_no_other_wing():
    graph = import_graph()
    assert {"tfdist.launcher.engine.local", "tfdist.launcher.machine.network",
            "tfdist.launcher.recovery.elastic"} <= set(graph)
    assert launcher_sideways(graph) == []


def test_the_wing_rule_can_fail():
    graph = {"tfdist.launcher.engine.ray_engine": {"tfdist.launcher.recovery.elastic",
                                                   "tfdist.launcher.config"},
             "tfdist.launcher.machine.memory": {"tfdist.launcher.state",
                                                "tfdist.launcher.machine.cgroups"},
             "tfdist.launcher.attempts": {"tfdist.launcher.machine.slowdown"}}
    assert launcher_sideways(graph) == [
        "tfdist.launcher.engine.ray_engine -> tfdist.launcher.recovery.elastic"]


def test_launcher_top_keeps_at_most_twelve_modules():
    top = sorted(p.name for p in (REPO / "tfdist" / "launcher").glob("*.py"))
    assert len(top) <= 12, top
