"""The run protocol: exit codes, progress events, the results record (no TensorFlow)."""

import json

import pytest

from tfdist import protocol
from tfdist.protocol import Exit


def test_exit_codes_are_defined_once_and_relaunch_only_on_recoverable_ones():
    assert [int(c) for c in (Exit.BAD_INPUT, Exit.PREEMPTED, Exit.TASK_LOST)] == [2, 42, 75]
    assert protocol.RELAUNCH == {Exit.PREEMPTED, Exit.TASK_LOST}
    assert set(protocol.EXIT_MEANINGS) == set(Exit)
    assert "42 preempted" in protocol.exit_epilog()


def test_events_round_trip_and_a_reader_sees_each_once(tmp_path):
    path = str(tmp_path / "worker-0.jsonl")
    log = protocol.EventLog("worker:0", path)
    reader = protocol.EventReader(path)
    assert reader.read() == []  # no file yet
    log.emit(protocol.PROGRESS, 10, loss=0.5, total=100)
    log.emit(protocol.CHECKPOINT, 20, path="x")
    events = reader.read()
    assert [(e.kind, e.member, e.step) for e in events] == [
        ("progress", "worker:0", 10), ("checkpoint", "worker:0", 20)]
    assert events[0].data == {"loss": 0.5, "total": 100}
    assert reader.read() == []
    log.emit(protocol.DONE, 30)
    assert [e.step for e in reader.read()] == [30]


def test_a_half_written_line_waits_and_stray_lines_are_skipped(tmp_path):
    path = tmp_path / "e.jsonl"
    line = protocol.Event(protocol.PROGRESS, "chief:0", 5).to_json()
    path.write_text("not json\n" + line[:10])
    reader = protocol.EventReader(str(path))
    assert reader.read() == []
    with open(path, "a") as f:
        f.write(line[10:] + "\n")
    assert [e.step for e in reader.read()] == [5]


def test_non_finite_values_become_null_not_invalid_json(tmp_path):
    path = str(tmp_path / "e.jsonl")
    protocol.EventLog("chief:0", path).emit(protocol.PROGRESS, 1, loss=float("nan"))
    assert json.loads(open(path).read())["data"]["loss"] is None


def test_without_the_variable_events_go_nowhere(monkeypatch, tmp_path):
    monkeypatch.delenv(protocol.EVENTS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    protocol.EventLog("local:0").emit(protocol.PROGRESS, 1)
    assert list(tmp_path.iterdir()) == []


def _results(**over):
    base = dict(
        strategy="ps", task="logreg", optimizer="adam", learning_rate=0.005,
        lr_schedule="cosine", num_workers=2, num_ps=1, replicas_in_sync=1,
        global_batch_size=128, steps_per_execution=1, seed=42, global_steps=10,
        completed_steps=10, steps_this_run=10, resumed_from_step=0,
        steps_per_worker={"worker:0": 6, "worker:1": 4}, startup_seconds=1.0,
        train_seconds=2.0, steady_steps=9, examples_per_sec=100.0, wall_seconds=3.0,
        eval_curve=[], eval_seconds=0.0, test_accuracy=0.9, test_loss=0.3,
        weights_sha256="ab", tf_version="2.21.0", keras_version="3", applied_steps=10,
        scheduled_steps=10,
    )
    base.update(over)
    return protocol.Results(**base)


def test_results_record_round_trips_with_its_schema_version(tmp_path):
    path = str(tmp_path / "results.json")
    _results().write(path)
    data = json.loads(open(path).read())
    assert data["schema_version"] == protocol.RESULTS_SCHEMA_VERSION
    assert protocol.Results.load(path) == _results()
    data["schema_version"] = 999
    with pytest.raises(ValueError, match="schema_version 999"):
        protocol.Results.from_dict(data)



def test_a_record_names_its_task_once_and_an_older_one_still_reads():
    data = _results().to_dict()
    assert data["task"] == "logreg" and "model" not in data
    # Schema 1 wrote the task's name twice, as "model" and "task" (or as "model" alone).
    old = {**{k: v for k, v in data.items() if k != "task"}, "schema_version": 1, "model": "logreg"}
    assert protocol.Results.from_dict(old) == _results()
    assert "model" not in protocol.Results.from_dict(old).to_dict()

def test_results_refuse_non_finite_numbers(tmp_path):
    with pytest.raises(ValueError):
        _results(test_loss=float("nan")).write(str(tmp_path / "r.json"))
    assert list(tmp_path.iterdir()) == []


def test_readme_exit_code_table_matches_the_protocol():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme.split("## Faults and exit codes", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].isdigit():
            rows[int(cells[0])] = cells[1]
    assert rows == {int(code): meaning for code, meaning in protocol.EXIT_MEANINGS.items()}


def test_the_task_contract_is_exported_and_tensorflow_free():
    # A user types a task of theirs against tfdist.Task without importing TensorFlow.
    import subprocess
    import sys

    code = ("import sys, tfdist\n"
            "T = tfdist.Task\n"
            "assert 'tensorflow' not in sys.modules\n"
            "class Mine:\n"
            "    def build_model(self): ...\n"
            "    def dataset(self, split): ...\n"
            "class NoData:\n"
            "    def build_model(self): ...\n"
            "assert isinstance(Mine(), T) and not isinstance(NoData(), T)\n"
            "assert 'Task' in tfdist.__all__\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
