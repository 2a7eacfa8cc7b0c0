"""Strategy kinds: one object per strategy, asked by everything else."""

import ast
import json
import re
from pathlib import Path

import pytest

from tfdist.launcher import plan as launch_plan
from tfdist.cli import train
from tfdist.strategies import ConfigError, kinds, make_strategy, parse_tf_config
from tfdist.strategies.kinds import StrategyBundle, StrategyKind

REPO = Path(__file__).resolve().parents[2]
W2 = {"worker": ["a:1", "b:1"]}


class Toy(StrategyKind):
    """A new strategy is one class plus one registration."""

    name = "toy"
    summary = "a toy that trains on every worker"

    def check(self, cluster):
        if cluster.num_ps:
            raise ConfigError("--strategy=toy takes no ps tasks")

    def duty(self, cluster):
        return "play with toy blocks"

    def build(self, cluster, *, all_reduce="auto"):
        return StrategyBundle(self, strategy=f"toy strategy for {cluster.member_name}")


@pytest.fixture
def toy():
    kind = kinds.register(Toy())
    yield kind
    kinds.unregister("toy")


def test_a_registered_kind_shows_in_dry_run_and_the_factory(toy, monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": W2, "task": {"type": "worker", "index": 1}}))
    assert train.main(["--strategy=toy", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["strategy"] == "toy" and plan["action"] == "play with toy blocks"
    assert plan["replicas_in_sync"] == 1 and plan["task"] == "worker:1"
    cluster = parse_tf_config(json.dumps({"cluster": W2, "task": {"type": "worker", "index": 0}}))
    bundle = make_strategy("toy", cluster)
    assert bundle.kind is toy and bundle.strategy == "toy strategy for worker:0"
    assert "toy" in kinds.names()
    # The launcher derives its layout from the kind's facts, too.
    assert list(launch_plan.build_cluster(toy, 2, ports=[5, 6])) == ["worker:0", "worker:1"]
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    # argparse wraps the help at the terminal's width, wherever a summary ends.
    assert "toy: a toy that trains on every worker" in " ".join(capsys.readouterr().out.split())


def test_an_unregistered_kind_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert train.main(["--strategy=toy", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "'toy'" in err and "multiworker" in err


@pytest.mark.parametrize("cluster,expected", [
    (None, "mirrored"),
    (W2, "multiworker"),
    ({"chief": ["c:1"], "worker": ["a:1"], "ps": ["p:1"]}, "ps"),
])
def test_auto_asks_the_kinds_in_rank_order(cluster, expected):
    text = None if cluster is None else json.dumps(
        {"cluster": cluster, "task": {"type": next(iter(cluster)), "index": 0}})
    assert kinds.resolve("auto", parse_tf_config(text)).name == expected


def test_kinds_say_which_roles_may_rejoin():
    ps, mw = kinds.get("ps"), kinds.get("multiworker")
    assert ps.restartable_roles == ("worker",) and not mw.restartable_roles


def test_kinds_carry_no_launcher_policy():
    # Layout, deciding exits and survivable faults are the launcher's
    # (launcher/policy.py), derived from the kind's facts.
    for kind in kinds.all_kinds().values():
        for name in ("layout", "decides", "survivable_faults", "max_ps"):
            assert not hasattr(kind, name), f"{kind!r}.{name}"


def _project_modules():
    for path in REPO.rglob("*.py"):
        parts = path.relative_to(REPO).parts
        if parts[0].startswith(".") or parts[0] in ("runs", "build", "results"):
            continue
        yield path


def test_no_strategy_name_is_compared_outside_strategies():
    # A grep for compared strategy names, over the project's own files only: a virtualenv in
    # the checkout holds other projects' "== \"ps\"".
    compared = re.compile(r'== "(ps|multiworker|mirrored)"')
    outside = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
               for path in _project_modules()
               if path.relative_to(REPO).parts[0] not in ("strategies", "tests")
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if compared.search(line)]
    assert outside == []


def test_the_name_check_sees_project_files():
    # It must be able to fail: the walk finds the modules that ask the kinds.
    found = {path.relative_to(REPO).as_posix() for path in _project_modules()}
    assert {"train.py", "launch.py", "bench.py", "tfdist/launcher/plan.py"} <= found
    assert not any(name.startswith(".venv/") for name in found)


def test_no_module_imports_another_modules_private_name():
    offenders = []
    for path in _project_modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and alias.name != "__future__" \
                            and node.module != "__future__":
                        offenders.append(f"{path.relative_to(REPO)}: from {node.module} "
                                         f"import {alias.name}")
    assert offenders == []


@pytest.mark.parametrize("name", kinds.names(include_auto=False))
def test_every_kinds_loop_has_a_trainer_that_implements_the_contract(name):
    from tfdist.training.assemble import TRAINERS
    from tfdist.training.loop.trainer import Trainer

    kind = kinds.get(name)
    assert kind.trainer in kinds.LOOPS
    trainer = TRAINERS[kind.trainer]
    assert issubclass(trainer, Trainer)
    assert not getattr(trainer, "__abstractmethods__", None), trainer.__abstractmethods__
