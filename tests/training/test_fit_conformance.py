"""What ``model.fit`` trains, every strategy trains: each ``fit_tasks`` task trained
by plain ``model.fit`` in this process and by the library, the same test metric
within the stated tolerance; what a strategy cannot honour, one line and exit 2.

docs/fit-conformance.md is the table these tests hold; the last test checks
that every ``compile``/``fit`` argument and step override Keras has is in it.
"""

import functools
import inspect
import json
import os
import re

import keras
import pytest

from conftest import REPO, launch_cmd, read_results, refused_line, tensorboard_tags
from tests.training.conformance import BATCH, CLUSTERS, EPOCHS, launched_results
from tests.training import fit_tasks

SPEC = str(REPO / "tests" / "training" / "fit_tasks.py") + ":"
# Measured against plain fit (docs/fit-conformance.md): the synchronous
# strategies see the same batches in another order, so they land within
# the noise of two epochs; async ps a little further.
SYNC_TOLERANCE, PS_TOLERANCE = 0.04, 0.06
# The metrics each task is judged by; a loss is compared with a tolerance of
# its own (REGULARIZED: the penalties make it ~0.38, 0.09 without).
METRICS = {
    "SUBCLASSED": ("accuracy",),
    "TWO_OUTPUTS": ("cls_accuracy", "reg_mae", "cls_weighted_accuracy"),
    "LIST_OUTPUTS": ("cls_accuracy", "reg_mae"),
    "SAMPLE_WEIGHTED": ("weighted_accuracy", "accuracy"),
    # class_2_share: 0.39 weighted, 0.32 without the weights.
    "CLASS_WEIGHTED": ("class_2_share", "accuracy"),
    "REGULARIZED": ("loss", "accuracy"),
    # Honoured, the flipped labels leave it at 0.34; the library's own step would give 0.97.
    "FLIPPED_TRAIN_STEP": ("accuracy",),
    "BOOL_FEATURES": ("accuracy",),
    "CLIP_NORM": ("accuracy",),
    "GLOBAL_CLIP_NORM": ("accuracy",),
    "EMA": ("accuracy",),
    "LOSS_SCALED": ("accuracy",),
    "JIT": ("accuracy",),
    # Its own train_step compiled with XLA, as fit compiles it: the flipped labels, 0.34.
    "OWN_STEP_JIT": ("accuracy",),
    "NUMPY_DATA": ("accuracy",),
    # compile(steps_per_execution=10): the run packs 10 steps a call, as the flag does.
    "STEPS_PER_EXECUTION": ("accuracy",),
    "GRADIENT_ACCUMULATION": ("accuracy",),
    # A model's own train_step with gradient_accumulation_steps=4: the library's
    # accumulation takes its applies (flipped labels: 0.34 honoured).
    "OWN_STEP_ACCUMULATION": ("accuracy",),
    # val_* of the last epoch, as fit(validation_data=...) logs them.
    "VALIDATED": ("accuracy", "val_accuracy", "val_loss"),
}
# In the default tier (seconds each); the rest in the long tier.
FAST = ("TWO_OUTPUTS", "FLIPPED_TRAIN_STEP",  # SUBCLASSED: under multiworker
        "STEPS_PER_EXECUTION")


@functools.lru_cache(maxsize=None)
def plain_fit(name: str) -> dict:
    return fit_tasks.plain_fit(getattr(fit_tasks, name), epochs=EPOCHS, batch_size=BATCH)


def _compare(name: str, got: dict, tolerance: float, strategy: str) -> None:
    want = plain_fit(name)
    _record(name, strategy, got, want)
    # The same names Keras gives (cls_accuracy, reg_mae, ...), loss aside.
    assert set(got["test_metrics"]) == {k for k in want if not k.startswith("val_")} - {
        "loss"}, (got["test_metrics"], want)
    assert set(got.get("val_metrics") or {}) == {k for k in want if k.startswith("val_")}
    for metric in METRICS[name]:
        value = (got["test_loss"] if metric == "loss" else got["val_metrics"][metric]
                 if metric.startswith("val_") else got["test_metrics"][metric])
        assert abs(value - want[metric]) <= tolerance, (name, metric, value, want[metric])


def _record(name: str, strategy: str, got: dict, want: dict) -> None:
    """With TFDIST_CONFORMANCE_RECORD=FILE, append each cell's figures (JSON lines):
    docs/fit-conformance.md's table is filled from them, never typed in."""
    path = os.environ.get("TFDIST_CONFORMANCE_RECORD")
    if not path:
        return
    row = {"task": name, "strategy": strategy, "fit": want,
           "library": {**got["test_metrics"], "loss": got["test_loss"],
                       **(got.get("val_metrics") or {})}}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _config(strategy, name, model_dir, **kw):
    from tfdist.training.config import TrainConfig

    return TrainConfig(strategy=strategy, task=SPEC + name, model_dir=str(model_dir),
                       **{"epochs": EPOCHS, "global_batch_size": BATCH, "log_every": 60, **kw})


def _param(strategy, name, fast=()):
    marks = [] if name in fast else [pytest.mark.long]
    return pytest.param(strategy, name, marks=marks, id=f"{strategy}-{name}")


IN_PROCESS = [_param(s, n, FAST if s == "none" else ("OWN_STEP_ACCUMULATION",))
              for s in ("none", "mirrored") for n in METRICS]


@pytest.mark.parametrize("strategy,name", IN_PROCESS)
def test_one_process_strategies_train_as_fit(tmp_path, capsys, strategy, name):
    from tfdist.training import run

    results = run.run(_config(strategy, name, tmp_path))
    _compare(name, results, SYNC_TOLERANCE, strategy)
    if name == "TWO_OUTPUTS":
        # Keras's names in the progress lines, TensorBoard and results.json.
        out = capsys.readouterr().out
        line = [l for l in out.splitlines() if l.startswith("step 60/")][0]
        for metric in ("cls_accuracy", "reg_mae", "cls_weighted_accuracy"):
            assert f" {metric} " in line, line
        tags = tensorboard_tags(str(tmp_path / "logs"))["scalars"]
        assert {"train/cls_accuracy", "train/reg_mae", "test/cls_accuracy"} <= tags, tags
    if name == "VALIDATED":
        # Every epoch end: a line and TensorBoard's val/ scalars.
        out = capsys.readouterr().out
        assert len(re.findall(r"^validation step \d+ epoch \d+ val_accuracy ", out, re.M)) == 2
        assert [p["epoch"] for p in results["val_curve"]] == [1, 2]
        assert {"val/accuracy", "val/loss"} <= tensorboard_tags(str(tmp_path / "logs"))["scalars"]
    if name == "STEPS_PER_EXECUTION":
        # The model's 10 steps a call, as --steps-per-execution 10 would pack them.
        assert results["steps_per_execution"] == 10, results["steps_per_execution"]
    if name == "FLIPPED_TRAIN_STEP":
        # The model's own step ran: its tracked loss is in the progress lines.
        out = capsys.readouterr().out
        line = [l for l in out.splitlines() if l.startswith("step 60/")][0]
        assert float(re.search(r" loss ([0-9.]+)", line).group(1)) > 0.0, line


# What the pipeline's cut cannot carry (a model's own train_step): trained placed
# (training.pipeline.placed; the default tier's launch is tests/training/test_placed.py).
PLACED = ("FLIPPED_TRAIN_STEP", "OWN_STEP_ACCUMULATION", "OWN_STEP_JIT")
# What the pipeline cuts as a graph of layer calls (no chain): a subclassed model's
# traced call, functional models with two outputs (stages.graph_stages).
GRAPHS = ("SUBCLASSED", "TWO_OUTPUTS", "LIST_OUTPUTS")
# In the default tier: one cluster strategy for the fit contract, with the library's
# own gradient accumulation (each replica sums N batches, one all-reduce), and the
# pipeline with sample weights (they travel with the labels to the last stage); a
# user's task under multiworker is also the callbacks' cluster test; and XLA under
# multiworker (the forward and backward pass compiled, the all-reduce outside XLA).
CLUSTER_FAST = (("multiworker", "GRADIENT_ACCUMULATION"), ("pipeline", "SAMPLE_WEIGHTED"),
                ("multiworker", "JIT"))
CLUSTER = [pytest.param(s, n, marks=[pytest.mark.multiprocess]
                        + ([] if (s, n) in CLUSTER_FAST else [pytest.mark.long]),
                        id=f"{s}-{n}")
           for s in CLUSTERS for n in METRICS]


@pytest.mark.parametrize("strategy,name", CLUSTER)
def test_cluster_strategies_train_as_fit(tmp_path, spawn, strategy, name):
    results = launched_results(tmp_path, spawn, strategy, SPEC + name, log_every=60)
    _compare(name, results, PS_TOLERANCE if strategy == "ps" else SYNC_TOLERANCE, strategy)
    if strategy == "pipeline":
        assert results["pipeline"]["mode"] == ("placed" if name in PLACED else "cut")


# --- refused in one line -----------------------------------------------------------


def _checked(name):
    from tfdist.training.workload import tasks

    spec = tasks.parse_spec(SPEC + name)
    return tasks.inspect(spec, tasks.load(spec), steps_given=False)


@pytest.mark.parametrize("name", PLACED)
def test_what_the_pipelines_cut_cannot_carry_is_placed_with_its_reason(name):
    """Every strategy takes a model's own train_step; under pipeline the plan says it
    trains placed, and why, in the words of its one notice line."""
    import types

    from tfdist.strategies import kinds
    from tfdist.training.pipeline import placed, stages
    from tfdist.training.workload import contract

    checked = _checked(name)
    for kind in kinds.all_kinds().values():
        contract.check(kind, checked)
    config = types.SimpleNamespace(cluster=types.SimpleNamespace(num_members=lambda role: 2),
                                   pipelines=1, stages=None)
    why = placed.why_placed(kinds.get("pipeline"), checked, config)
    assert why == "its model overrides train_step, which the cut into stages cannot carry"
    assert placed.why_placed(kinds.get("multiworker"), checked, config) is None
    plan = stages.make_plan(2, 2, 1, None, 64, None, placed=why)
    assert plan.describe()["mode"] == "placed" and plan.unused == "--micro-batches 2"


@pytest.mark.parametrize("name", GRAPHS)
def test_the_pipelines_cut_takes_a_model_that_is_not_a_chain_at_its_layer_calls(name):
    """Cut into two stages as the launcher's pre-flight cuts it, the stages compute the
    task's model."""
    import numpy as np
    import tensorflow as tf

    from tfdist.training.pipeline import stages
    from tfdist.training.workload import tasks

    spec = tasks.parse_spec(SPEC + name)
    task = tasks.load(spec)
    model = task.build_model()
    # No example given: a subclassed model's trace reads the first training element.
    local, cut = stages.local_stages(task, model, stages.PipelinePlan(2, 2, 1), spec.name)
    assert cut.startswith("stage 0: layer calls") and len(local) == 2, cut
    x = np.random.default_rng(0).normal(size=(5, 8)).astype("float32")
    for got, want in zip(tf.nest.flatten(local[1](local[0](x))), tf.nest.flatten(model(x))):
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("argv,says", [
    (["--task", SPEC + "STRING_FEATURES"], "feature 'x' is string, the model's input is float32"),
    (["--task", SPEC + "STEPS_PER_EXECUTION", "--steps-per-execution", "5"],
     "--steps-per-execution 5 disagrees with task"),
])
def test_the_command_refuses_in_one_line_with_exit_2(tmp_path, capsys, argv, says):
    assert says in refused_line(argv, tmp_path, capsys)


def test_a_model_of_its_own_step_is_found():
    from tfdist.training.workload import contract

    assert contract.overrides(fit_tasks.FLIPPED_TRAIN_STEP.build_model(), "train_step")
    assert not contract.overrides(fit_tasks.SUBCLASSED.build_model(), "train_step")
    assert not contract.overrides(fit_tasks.BLOBS.build_model(), "test_step")


# --- the table ---------------------------------------------------------------------


def test_every_compile_and_fit_argument_and_override_is_in_the_table():
    """Keras 3's own signatures, listed: each is honoured (a row of the table) or
    refused in one line; a new Keras argument fails this until it is decided."""
    from tfdist.training.workload import contract

    doc = (REPO / "docs" / "fit-conformance.md").read_text()
    keras_has = {
        "compile": [p for p in inspect.signature(keras.Model.compile).parameters if p != "self"],
        "fit": [p for p in inspect.signature(keras.Model.fit).parameters if p != "self"],
        "override": sorted(n for n in dir(keras.Model)
                           if n.endswith("_step") or n in ("compute_loss", "compute_metrics")),
    }
    for where, names in keras_has.items():
        table = contract.CONTRACT[where]
        assert set(names) <= set(table), (where, sorted(set(names) - set(table)))
        for name in names:
            how = table[name]
            assert how.startswith(("honoured", "refused", "mapped")), (name, how)
            assert f"`{name}`" in doc, f"docs/fit-conformance.md has no row for `{name}`"


# --- callbacks ---------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["none", pytest.param("mirrored", marks=pytest.mark.long)])
def test_callbacks_run_as_fit_runs_them_and_early_stopping_ends_the_run(tmp_path, capsys,
                                                                         strategy):
    from tfdist.training import run

    task = fit_tasks.WithCallbacks()
    task.csv_path = str(tmp_path / "log.csv")
    results = run.run(_config(strategy, "WITH_CALLBACKS", tmp_path / "run", epochs=5),
                      task=task)
    calls = task.recorder.calls
    # EarlyStopping (min_delta 1.0 cannot be met) stops after the second epoch, as fit does.
    assert results["stopped_by"] == "EarlyStopping", results.get("stopped_by")
    assert results["completed_steps"] == 124  # 2 epochs of 62 steps, of 5
    assert calls[0] == ("train_begin", None) and calls[-1][0] == "train_end"
    assert [c[1] for c in calls if c[0] == "epoch_begin"] == [0, 1]
    ends = [c for c in calls if c[0] == "epoch_end"]
    assert [c[1] for c in ends] == [0, 1]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(ends[0][2])
    assert any(c[0] == "batch_end" and "loss" in c[1] for c in calls)
    assert calls[-1][1] > 0  # self.model is the trained model
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert len(rows) == 3 and "val_loss" in rows[0], rows
    out = capsys.readouterr().out
    assert re.search(r"^stopped by EarlyStopping at step \d+ of 310", out, re.M), out[-2000:]
    assert 0.9 < results["test_accuracy"]


@pytest.mark.long
def test_the_python_api_takes_callbacks_as_fit_does(tmp_path):
    import tfdist

    recorder = fit_tasks.Recorder()
    r = tfdist.fit(fit_tasks.VALIDATED, strategy="mirrored", callbacks=[recorder],
                   options=tfdist.TrainOptions(model_dir=str(tmp_path), epochs=1,
                                               global_batch_size=BATCH))
    assert [c[0] for c in recorder.calls][:2] == ["train_begin", "epoch_begin"]
    assert "val_accuracy" in [c for c in recorder.calls if c[0] == "epoch_end"][0][2]
    assert r.global_step == 62


def _local_callback():
    # Defined in a function: the cluster's chief, another process, cannot import it.
    class Here(keras.callbacks.Callback):
        pass

    return Here()


@pytest.mark.parametrize("callback,says", [
    (_local_callback(), "callbacks[1] (Here) cannot be sent to the cluster's chief"),
    (keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr),
     "callbacks[1] (LearningRateScheduler) cannot be sent to the cluster's chief"),
])
def test_a_callback_the_chief_cannot_import_is_refused_in_one_line(tmp_path, callback, says):
    import tfdist

    with pytest.raises(tfdist.TfdistError) as refused:
        tfdist.fit(SPEC + "BLOBS", workers=2, callbacks=[keras.callbacks.Callback(), callback],
                   options=tfdist.TrainOptions(model_dir=str(tmp_path / "run")))
    line = refused.value.message
    assert refused.value.exit_code == 2 and "\n" not in line and says in line, line
    assert "not a lambda, not in __main__" in line, line
    assert not (tmp_path / "run").exists()  # refused before anything started


@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.parametrize("strategy,ps", [("multiworker", 0), ("ps", 1)])
def test_callbacks_given_to_fit_run_on_a_clusters_chief(tmp_path, monkeypatch, strategy, ps):
    """tfdist.fit(callbacks=[...], workers=2): pickled, run on the chief in place of the
    task's own (VALIDATED has none), EarlyStopping ends the run as under fit."""
    import tempfile

    import tfdist

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))

    recorder = fit_tasks.LoggingRecorder(str(tmp_path))
    r = tfdist.fit(SPEC + "VALIDATED", strategy, workers=2, ps=ps, callbacks=[
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=1.0),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")), recorder],
        options=tfdist.TrainOptions(model_dir=str(tmp_path / "run"), epochs=5,
                                    global_batch_size=BATCH, log_every=60))
    assert r.record["stopped_by"] == "EarlyStopping" and r.global_step == 124, r.record
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert len(rows) == 3 and "val_loss" in rows[0], rows
    calls = json.loads((tmp_path / "calls.json").read_text())
    assert calls[0][0] == "train_begin" and calls[-1][0] == "train_end", calls
    assert [c[1] for c in calls if c[0] == "epoch_end"] == [0, 1]
    assert recorder.calls == []  # the chief's copy ran, not this process's
    assert not list((tmp_path / "tmp").iterdir())  # the pickle's directory is gone


@pytest.mark.multiprocess
@pytest.mark.long
def test_the_chiefs_early_stop_reaches_every_multiworker_worker(tmp_path, spawn):
    """EarlyStopping runs on the chief; the other worker stops at the same step, exit 0."""
    p = spawn(launch_cmd("multiworker", "--workers", "2", train_args=[
        "--task", SPEC + "WITH_CALLBACKS", "--epochs", "5", "--global-batch-size", str(BATCH),
        "--log-every", "60", "--model-dir", str(tmp_path)]))
    assert p.wait(timeout=300) == 0, p.output
    results = read_results(tmp_path)
    assert results["stopped_by"] == "EarlyStopping" and results["completed_steps"] == 124
    assert re.search(r"stopped by EarlyStopping at step 124 of 310", p.output), p.output[-3000:]
    assert re.search(r"worker:1.*stopped by the chief's callbacks at step 124 of 310",
                     p.output), p.output[-3000:]
    hashes = set(re.findall(r"weights_sha256=([0-9a-f]{64})", p.output))
    assert hashes == {results["weights_sha256"]}


@pytest.mark.parametrize("body,says", [
    ("def dataset(split):\n    return np.zeros((5, 8), 'float32'), np.zeros(4, 'int32')\n",
     "returned arrays of different lengths ([4, 5])"),
    ("class_weight = {'a': 1}\ndef dataset(split):\n"
     "    return np.zeros((5, 8), 'float32'), np.zeros(5, 'int32')\n",
     "class_weight is {'a': 1}; give a dict of class index"),
])
def test_a_mistake_in_fit_style_data_is_one_line(tmp_path, capsys, body, says):
    path = tmp_path / "task.py"
    path.write_text("import keras\nimport numpy as np\nfrom tests.training.fit_tasks import BLOBS\n"
                    "build_model = BLOBS.build_model\n" + body)
    line = refused_line(["--task", str(path)], tmp_path, capsys)
    assert line.startswith("error: task '") and says in line, line


def test_a_models_own_test_step_is_what_evaluation_runs(tmp_path):
    from tfdist.training import run

    results = run.run(_config("none", "OWN_TEST_STEP", tmp_path, epochs=1, steps=20))
    assert results["test_metrics"] == {"own_number": 42.0}, results["test_metrics"]
