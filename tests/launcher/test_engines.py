"""One engine contract: the local engine and Ray's implement every method the supervisor
and the attempt loop call, and nothing in the launcher asks which engine it has."""

import abc
import re

import pytest

from conftest import REPO
from tfdist.launcher.engine.api import Engine
from tfdist.launcher.engine.local import LocalEngine
from tfdist.launcher.engine.ray_engine import RayEngine


def missing_methods(cls) -> list[str]:
    """The contract's methods ``cls`` leaves unimplemented (its own or inherited)."""
    return sorted(name for name in Engine.__abstractmethods__
                  if getattr(cls, name, None) is None
                  or getattr(getattr(cls, name), "__isabstractmethod__", False))


@pytest.mark.parametrize("engine", [LocalEngine, RayEngine])
def test_every_engine_implements_the_whole_contract(engine):
    assert issubclass(engine, Engine)
    assert missing_methods(engine) == []
    assert {"open", "new_attempt", "start", "signal", "poll", "wait", "stop", "membership",
            "reads_memory", "close"} <= Engine.__abstractmethods__


def test_the_check_finds_a_missing_method():
    class Partial(Engine):  # no signal, no membership, ...
        def open(self, log):
            return None

    assert "signal" in missing_methods(Partial) and "open" not in missing_methods(Partial)
    with pytest.raises(TypeError):
        Partial()
    assert isinstance(Engine, abc.ABCMeta)


def probes(text: str) -> list[str]:
    """Lines that ask which engine (or which process handle) they have."""
    return [line.strip() for line in text.splitlines()
            if re.search(r"\bengine is (not )?None\b|\bhasattr\(|isinstance\([^)]*Engine\b", line)]


def test_nothing_in_the_launcher_asks_which_engine_it_has():
    sources = {p.relative_to(REPO).as_posix(): p.read_text()
               for p in (REPO / "tfdist" / "launcher").rglob("*.py")}
    assert len(sources) > 20
    assert {path: found for path, text in sources.items() if (found := probes(text))} == {}
    assert probes("if engine is None:\n    pass\nif hasattr(proc, 'signal_group'):\n") == [
        "if engine is None:", "if hasattr(proc, 'signal_group'):"]


def shadowed_methods(source: str) -> list[str]:
    """Contract methods an engine's instance attribute would hide (``self.membership = ...``)."""
    import ast

    return sorted({node.attr for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                   and isinstance(node.value, ast.Name) and node.value.id == "self"
                   and node.attr in Engine.__abstractmethods__})


def test_no_engine_hides_a_contract_method_behind_an_attribute():
    for module in ("local.py", "ray_engine.py"):
        assert shadowed_methods((REPO / "tfdist/launcher/engine" / module).read_text()) == []
    assert shadowed_methods("class E:\n    def __init__(self):\n        self.membership = None\n"
                            ) == ["membership"]
