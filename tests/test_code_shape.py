"""Shape rules over the project's own files: no function outside the tests longer than
``MAX_FUNCTION_LINES`` lines, and no file naming the project's issue numbers (code and
docs say what a thing does, not which ticket asked for it)."""

import ast
import re
import subprocess

from conftest import REPO

MAX_FUNCTION_LINES = 80
MAX_LAUNCHER_PARAMETERS = 8  # tfdist/launcher/: more belongs in a typed object (a RunContext, a group)
DOCSTRING_FROM_LINES = 100  # a class this long says what it owns
ISSUE_NUMBER = re.compile(r"(?<![\w-])issues?[\s#:-]*\d+", re.IGNORECASE)


def _tracked(*patterns: str) -> list[str]:
    # Tracked and new (not ignored) files: a file added but not yet committed counts too.
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True)
    return out.stdout.split()


def long_functions(sources: dict[str, str], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:name lines`` for every function (or method) over ``limit`` lines, def to last line."""
    found = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path}:{node.name} {lines}")
    return sorted(found)


def wide_signatures(sources: dict[str, str], limit: int = MAX_LAUNCHER_PARAMETERS) -> list[str]:
    """``path:name count`` for every function taking more than ``limit`` parameters
    (``self``/``cls`` not counted; ``*args`` and ``**kwargs`` count one each)."""
    found = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                count = len(names) + bool(a.vararg) + bool(a.kwarg) - (names[:1] in (["self"], ["cls"]))
                if count > limit:
                    found.append(f"{path}:{node.name} {count}")
    return sorted(found)


def undocumented_classes(sources: dict[str, str], lines: int = DOCSTRING_FROM_LINES) -> list[str]:
    """``path:name`` for every class of at least ``lines`` lines without a docstring."""
    return sorted(f"{path}:{node.name}" for path, text in sources.items()
                  for node in ast.walk(ast.parse(text, path))
                  if isinstance(node, ast.ClassDef) and not ast.get_docstring(node)
                  and node.end_lineno - node.lineno + 1 >= lines)


def _code() -> dict[str, str]:
    return {p: (REPO / p).read_text() for p in _tracked("*.py") if not p.startswith("tests/")}


def test_every_large_class_says_what_it_owns():
    assert undocumented_classes(_code()) == []
    assert undocumented_classes({"a.py": "class A:\n" + "    x = 1\n" * 99}) == ["a.py:A"]
    assert undocumented_classes({"a.py": "class A:\n    \"\"\"Owns x.\"\"\"\n" + "    x = 1\n" * 99}) == []


def test_no_function_outside_the_tests_is_over_80_lines():
    sources = _code()
    assert len(sources) > 80  # the real tree: tfdist/, strategies/, models/, the commands
    assert long_functions(sources) == []


def test_no_function_in_the_launcher_takes_more_than_8_parameters():
    sources = {p: t for p, t in _code().items() if p.startswith("tfdist/launcher/")}
    assert len(sources) > 20
    assert wide_signatures(sources) == []


def test_the_parameter_rule_counts_every_kind_of_parameter():
    assert wide_signatures({"a.py": "def f(a, b, c, d, e, f, g, h, i):\n    pass\n"}) == ["a.py:f 9"]
    assert wide_signatures({"a.py": "def f(a, b, c, d, e, f, g, *h, i, **j):\n    pass\n"}) == [
        "a.py:f 10"]
    method = "class A:\n    def f(self, a, b, c, d, e, f, g, h):\n        pass\n"
    assert wide_signatures({"a.py": method}) == []
    assert wide_signatures({"a.py": method}, limit=7) == ["a.py:f 8"]


def task_named_types(sources: dict[str, str]) -> list[str]:
    """``path:name`` for every class named ``Task...``: in the launcher a process of the
    cluster is a member (docs/architecture.md's words); a task is the user's workload."""
    return sorted(f"{path}:{node.name}" for path, text in sources.items()
                  for node in ast.walk(ast.parse(text, path))
                  if isinstance(node, ast.ClassDef) and node.name.startswith("Task"))


def test_launcher_types_name_members_not_tasks():
    sources = {p: t for p, t in _code().items() if p.startswith("tfdist/launcher/")}
    assert task_named_types(sources) == []
    assert task_named_types({"a.py": "class TaskHost:\n    pass\nclass MemberHost:\n    pass\n"}) == [
        "a.py:TaskHost"]


def test_the_length_rule_counts_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions({"a.py": f"def f():\n{body}\n"}) == ["a.py:f 81"]
    assert long_functions({"a.py": f"def f():\n{body}\n"}, limit=81) == []


def test_no_file_names_an_issue_number():
    paths = [p for p in _tracked("*.py", "*.md", "Makefile", "*.toml", "*.cfg", "*.yaml", "*.sh")
             if not p.startswith("results/")]
    assert "tests/test_code_shape.py" in paths and len(paths) > 150
    named = [f"{p}:{n}: {line.strip()}" for p in paths
             for n, line in enumerate((REPO / p).read_text(errors="replace").splitlines(), 1)
             if ISSUE_NUMBER.search(line)]
    assert named == []


def test_the_issue_rule_matches_the_ways_a_number_is_written():
    # Formatted, so that this file's own source names no number.
    for text in ("Every callback issue %d names", "# Issue %d: a crash", "see issue #%d", "issues %d and 4"):
        assert ISSUE_NUMBER.search(text % 37), text
    assert not ISSUE_NUMBER.search("the tissue sample 37") and not ISSUE_NUMBER.search("re-issues 2 tokens")
