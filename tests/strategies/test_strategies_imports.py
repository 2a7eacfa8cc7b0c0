"""strategies/ is below training/: it never names a training module, not even as a string."""

import ast
import re
from pathlib import Path

from conftest import REPO
from test_dependencies import KNOWN_EDGES

STRATEGIES = REPO / "strategies"
# A string that names a module of training/ ("tfdist.training.sync.sync_trainer").
TRAINING_MODULE = re.compile(r"^(tfdist\.)?training(\.\w+)+$")


def training_strings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and TRAINING_MODULE.match(node.value)]


def test_strategies_name_no_training_module():
    allowed = {target for source, target in KNOWN_EDGES if source.startswith("strategies.")}
    found = {f"{path.relative_to(REPO)}: {text}"
             for path in sorted(STRATEGIES.rglob("*.py"))
             for text in training_strings(path) if text not in allowed}
    assert found == set()


def test_strategies_import_nothing_from_training():
    imported = []
    for path in sorted(STRATEGIES.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            imported += [f"{path.relative_to(REPO)}: {n}" for n in names
                         if n.removeprefix("tfdist.") == "training"
                         or n.removeprefix("tfdist.").startswith("training.")]
    assert imported == []


def test_the_string_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('TRAINERS = {"sync": ("tfdist.training.sync.sync_trainer", "SyncTrainer")}\n'
                   'NOTE = "training. is fine in prose"\n')
    assert training_strings(bad) == ["tfdist.training.sync.sync_trainer"]
