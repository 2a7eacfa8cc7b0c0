"""The ``Trainer`` contract (``training/loop/trainer.py``) declares everything the loop
and ``assemble`` use of a trainer: no probing with ``getattr``/``hasattr``, no name a
trainer may or may not have."""

import ast
import inspect

from conftest import REPO

from tfdist.training.loop import trainer as trainer_module
from tfdist.training.loop.trainer import Trainer

# Who drives a trainer: the loop's modules and the assembly.
DRIVERS = sorted((REPO / "tfdist" / "training" / "loop").glob("*.py")) + [
    REPO / "tfdist" / "training" / "assemble.py"]
TRAINER_NAMES = {"trainer", "trainer_class", "_trainer"}  # what the drivers call one


def _is_trainer(node: ast.AST) -> bool:
    """``trainer``, ``self.trainer``, ``self._trainer``, ``trainer_class``."""
    if isinstance(node, ast.Name):
        return node.id in TRAINER_NAMES
    return isinstance(node, ast.Attribute) and node.attr in TRAINER_NAMES


def used_names(sources: dict[str, str]) -> tuple[set[str], list[str]]:
    """(every attribute read from a trainer, every getattr/hasattr probe of one)."""
    used, probes = set(), []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and _is_trainer(node.value):
                used.add(node.attr)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args
                    and _is_trainer(node.args[0])):
                probes.append(f"{path}:{node.lineno}")
    return used, probes


def declared_names(cls=Trainer) -> set[str]:
    """The class's attributes, and what its constructor sets on ``self``."""
    names = {n for n in dir(cls) if not n.startswith("__")}
    init = ast.parse(inspect.getsource(trainer_module)).body
    for node in ast.walk(ast.Module(body=init, type_ignores=[])):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self" and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def _drivers() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in DRIVERS if p.name != "trainer.py"}


def test_the_contract_declares_everything_the_drivers_use():
    used, probes = used_names(_drivers())
    assert {"train", "drain", "build_state", "result_fields", "close"} <= used  # the scan sees them
    assert probes == []
    assert sorted(used - declared_names()) == []


def test_a_use_outside_the_contract_is_found():
    used, probes = used_names({"x.py": "def f(trainer):\n"
                                       "    trainer.undeclared()\n"
                                       "    getattr(trainer, 'build_state', None)\n"})
    assert used - declared_names() == {"undeclared"} and probes == ["x.py:3"]


def test_every_trainer_keeps_the_contracts_signatures():
    from tfdist.training.assemble import TRAINERS

    for cls in TRAINERS.values():
        assert issubclass(cls, Trainer)
        for name in ("build_state", "train", "drain", "result_fields", "close"):
            ours, theirs = inspect.signature(getattr(Trainer, name)), inspect.signature(getattr(cls, name))
            assert list(theirs.parameters) == list(ours.parameters), (cls.__name__, name)
