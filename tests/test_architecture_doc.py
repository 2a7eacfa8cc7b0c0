"""docs/architecture.md lists every module of the real tree, and nothing that is gone."""

import re

from conftest import REPO

DOC = REPO / "docs" / "architecture.md"
PACKAGES = ("tfdist", "strategies", "models")
# tfdist/bench/peers/ is one row: programs, not modules of the package.
GROUPED = ("tfdist/bench/peers/",)


def tree_modules() -> set[str]:
    found = {p.name for p in REPO.glob("*.py")}
    for package in PACKAGES:
        found |= {p.relative_to(REPO).as_posix() for p in (REPO / package).rglob("*.py")}
    return {m for m in found if not m.startswith(GROUPED)}


def documented_paths() -> set[str]:
    """Every `path.py` in the doc's module table (the first cell of each row)."""
    return set(re.findall(r"^\| `([\w/]+\.py)` \|", DOC.read_text(), flags=re.M))


def test_every_module_has_a_line():
    assert sorted(tree_modules() - documented_paths()) == []


def test_no_line_for_a_module_that_is_gone():
    assert sorted(documented_paths() - tree_modules()) == []


def test_the_check_reads_the_real_tree():
    modules = tree_modules()
    assert {"train.py", "launch.py", "tfdist/launcher/config.py", "tfdist/cli/bench.py",
            "tfdist/api.py", "strategies/kinds.py", "tfdist/training/loop/controller.py",
            "models/mnist.py"} <= modules
    assert not any(m.startswith(("tests/", "tfdist/bench/peers/")) for m in modules)
    assert len(documented_paths()) > 40


def test_test_files_have_unique_names():
    # The tests folders are not packages: pytest imports each file by its bare name, so two
    # test_x.py in different folders fail the whole collection.
    import collections

    names = collections.Counter(p.name for p in (REPO / "tests").rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []


# --- every name the document uses exists ----------------------------------------------

# CamelCase names that are not the project's: classes of TensorFlow, Keras and the tools the
# document compares with, and Linux's VmHWM.
EXTERNAL_CLASSES = {
    "AbstractTrainer", "Dense", "Embedding", "MultiWorkerMirroredStrategy", "ParameterServerStrategy",
    "PreemptionCheckpointHandler", "SyncReplicasOptimizer", "TensorflowTrainer", "Popen", "VmHWM",
}
# Paths in other projects' sources (TensorFlow's, XLA's), quoted as where something is.
EXTERNAL_SOURCES = ("tensorflow/", "xla/")
_TICKED = re.compile(r"`([^`\n]+)`")


def ticked(text: str) -> list[str]:
    return _TICKED.findall(text)


def project_classes() -> set[str]:
    import ast

    names = set()
    for module in tree_modules() | {p.relative_to(REPO).as_posix()
                                    for p in (REPO / "tfdist" / "bench" / "peers").glob("*.py")}:
        for node in ast.walk(ast.parse((REPO / module).read_text())):
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
    return names


def missing_paths(text: str) -> list[str]:
    """Every backticked ``x/y.py`` or ``x/y/`` (from the root, or below ``tfdist/``) that is not there,
    and every ``path.py: name`` whose module does not define ``name``."""
    missing = []
    for tick in ticked(text):
        m = re.fullmatch(r"([\w./]+?\.py|[\w./]+/)(?:: (\w+))?", tick)
        if m is None or tick.startswith(("runs/", "results/", "DIR/", "path/to/", *EXTERNAL_SOURCES)) \
                or "/" not in m.group(1):
            continue
        path, name = m.group(1), m.group(2)
        found = [REPO / path, REPO / "tfdist" / path]
        where = next((p for p in found if p.exists()), None)
        if where is None:
            missing.append(tick)
        elif name is not None and not re.search(rf"^(def|class) {name}\b|^{name} = ",
                                                 where.read_text(), flags=re.M):
            missing.append(tick)
    return missing


def _module_file(dotted: str):
    parts = dotted.split(".")
    if parts[0] == "tfdist" and len(parts) > 1 and parts[1] in ("strategies", "models"):
        parts = parts[1:]  # installed names of the two top-level folders
    base = REPO.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def missing_modules(text: str) -> list[str]:
    """Every ``python -m X`` whose module is missing or has no ``__main__`` block, and every
    backticked dotted module name (``launcher.policy``, ``training.loop.export``) not in the tree."""
    missing = []
    for target in re.findall(r"python -m ([\w.]+)", text):
        path = _module_file(target)
        if path is None or "__main__" not in path.read_text():
            missing.append(f"python -m {target}")
    tops = ("tfdist", "training", "launcher", "bench", "cli", "strategies", "models")
    for tick in ticked(text):
        if re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", tick) and tick.split(".")[0] in tops \
                and not tick.endswith(".py") and not _names_something(tick):
            missing.append(tick)
    return missing


def _names_something(dotted: str) -> bool:
    """A module (``launcher.policy``), or a name in one (``launcher.job.run_request``, ``tfdist.fit``)."""
    for name in (dotted, "tfdist." + dotted):
        if _module_file(name) is not None:
            return True
        parent, _, attr = name.rpartition(".")
        module = _module_file(parent)
        if module is not None and re.search(rf"^(def|class) {attr}\b|^{attr} = |\"{attr}\"",
                                            module.read_text(), flags=re.M):
            return True
    return False


def missing_classes(text: str) -> list[str]:
    """Backticked CamelCase names that are neither a class of the project nor a known outside one."""
    ours = project_classes()
    named = {t for t in ticked(text) if re.fullmatch(r"[A-Z][a-z]+[A-Z]\w*|[A-Z][a-z]+", t)}
    return sorted(n for n in named if n not in ours and n not in EXTERNAL_CLASSES)


def test_every_path_the_document_names_exists():
    assert missing_paths(DOC.read_text()) == []


def test_every_module_and_command_the_document_names_exists():
    assert missing_modules(DOC.read_text()) == []


def test_every_class_the_document_names_exists():
    assert missing_classes(DOC.read_text()) == []
    # The outside names are not ours (else they would not need listing).
    assert not EXTERNAL_CLASSES & project_classes()


def test_the_document_names_every_strategy_kind():
    from tfdist.strategies import kinds

    row = next(line for line in DOC.read_text().splitlines() if line.startswith("| `strategies/kinds.py` |"))
    assert [n for n in kinds.names(include_auto=False) if f"`{n}`" not in row] == []


def test_the_checks_find_what_is_not_there():
    text = ("`training/gone.py`, `training/plan.py: no_such_function`, `python -m training.prepare_data`, "
            "`launcher.nowhere`, `NoSuchClass`, `training/run.py: run`, `launcher.policy`, `RunPlan`")
    assert missing_paths(text) == ["training/gone.py", "training/plan.py: no_such_function"]
    assert missing_modules(text) == ["python -m training.prepare_data", "launcher.nowhere"]
    assert missing_classes(text) == ["NoSuchClass"]
