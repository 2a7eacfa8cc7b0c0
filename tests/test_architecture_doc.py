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
