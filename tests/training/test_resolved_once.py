"""A run is read once: its flags checked, its kind chosen and its task spec parsed one time
per process, then passed down (``training.plan.request``)."""

from __future__ import annotations

import json

import pytest

from tfdist.strategies import kinds
from tfdist.training import run as runs
from tfdist.training.workload import tasks
from tfdist.training.config import TrainConfig


@pytest.fixture
def counted(monkeypatch):
    calls = {"validate": 0, "kinds.resolve": 0, "parse_spec": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(TrainConfig, "validate", counting("validate", TrainConfig.validate))
    monkeypatch.setattr(kinds, "resolve", counting("kinds.resolve", kinds.resolve))
    monkeypatch.setattr(tasks, "parse_spec", counting("parse_spec", tasks.parse_spec))
    return calls


def test_a_run_reads_its_flags_once(counted, tmp_path):
    record = runs.run(TrainConfig(strategy="none", task="mnist-logreg", steps=5, log_every=5,
                                  model_dir=str(tmp_path / "run")))
    assert record["global_steps"] == 5
    assert counted == {"validate": 1, "kinds.resolve": 1, "parse_spec": 1}


def test_a_dry_run_reads_its_flags_once_and_prints_the_plan(counted, tmp_path, capsys):
    assert runs.run(TrainConfig(strategy="auto", task="mnist-logreg", steps=5, dry_run=True,
                                model_dir=str(tmp_path / "run"))) is None
    plan = json.loads(capsys.readouterr().out)
    assert plan["strategy"] == "mirrored" and plan["total_steps"] == 5
    assert counted == {"validate": 1, "kinds.resolve": 1, "parse_spec": 1}


def test_the_count_can_fail(counted):
    # The counters see the calls the run would make: reading twice counts twice.
    from tfdist.training.plan import request

    config = TrainConfig(strategy="none", task="mnist-logreg", steps=5)
    request(config)
    request(config)
    assert counted == {"validate": 2, "kinds.resolve": 2, "parse_spec": 2}
