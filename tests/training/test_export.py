"""--export DIR: a SavedModel with a serving signature, written by the chief and
checked by loading it back (tfdist/training/loop/export.py).

In this process (default tier): a ``none`` run exported into numbered version
folders, its signature read by ``saved_model_cli``; a task with dict inputs
through ``tfdist.fit(options=TrainOptions(export=...))``; a model that cannot be served. The flag
checks and the comparison as units. Clusters of real processes:
tests/integration/test_export_cluster.py.
"""

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, read_results
from tfdist.cli import train
from tfdist.protocol import Exit
from tfdist.training.loop import export
from tfdist.training.config import TrainConfig

TASKS = str(REPO / "tests" / "training" / "export_tasks.py")
DATA_DIR = os.environ.get("TFDS_DATA_DIR")


def _saved_model_cli(*args) -> subprocess.CompletedProcess:
    """TensorFlow's own saved_model_cli (installed beside this Python with TensorFlow)."""
    script = Path(sys.executable).parent / "saved_model_cli"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m",
                                                 "tensorflow.python.tools.saved_model_cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, check=False)


def _serve(path, **inputs):
    """What a serving process does: tf.saved_model.load, call serving_default."""
    import tensorflow as tf

    fn = tf.saved_model.load(str(path)).signatures["serving_default"]
    return {k: v.numpy() for k, v in fn(**{k: tf.constant(v) for k, v in inputs.items()}).items()}


def test_none_run_exports_numbered_versions_that_serve_the_trained_model(tmp_path):
    import keras
    import tensorflow as tf

    run, out = tmp_path / "run", tmp_path / "serving" / "mnist"
    results = train.run(TrainConfig(strategy="none", task="mnist-logreg", steps=20,
                                    log_every=10, model_dir=str(run), data_dir=DATA_DIR,
                                    export=str(out)))
    # TF Serving's layout: one folder per version, named by the global step; nothing else.
    assert sorted(os.listdir(out)) == ["20"]
    record = results["export"]
    assert read_results(run)["export"] == record
    assert record["path"] == str(out / "20") and results["global_steps"] == 20
    assert record["signature"] == {
        "inputs": {"image": {"dtype": "uint8", "shape": [None, 28, 28, 1]}},
        "outputs": {"output_0": {"dtype": "float32", "shape": [None, 10]}}}
    assert record["max_abs_diff"] <= 1e-4 and record["bytes"] > 784 * 10 * 4
    assert 0 < record["check_seconds"] <= record["seconds"]
    # Served, it predicts what the saved Keras model predicts.
    from tfdist.models.mnist import LOGREG

    images = np.stack([img.numpy() for img, _ in LOGREG.dataset("test").take(64)])
    served = _serve(out / "20", image=images)["output_0"]
    trained = keras.saving.load_model(run / "model.keras")
    np.testing.assert_allclose(served, trained.predict_on_batch(images), atol=1e-4)
    # Plain variables, whole: no replica or shard left in the graph.
    names = [v.name for v in tf.saved_model.load(str(out / "20")).variables]
    assert sorted(v.shape.as_list() for v in tf.saved_model.load(str(out / "20")).variables) \
        == [[10], [784, 10]] and not any("shard" in n or "replica" in n for n in names), names
    shown = _saved_model_cli("show", "--all", "--dir", str(out / "20"))
    assert shown.returncode == 0, shown.stderr
    assert "signature_def['serving_default']" in shown.stdout
    assert "inputs['image'] tensor_info:" in shown.stdout and "dtype: DT_UINT8" in shown.stdout
    assert "outputs['output_0'] tensor_info:" in shown.stdout


def test_dict_inputs_keep_their_names_through_fit_and_a_finished_run_exports_on_rerun(
        tmp_path):
    import keras

    import tfdist
    from export_tasks import DICT_INPUTS

    run, out = tmp_path / "run", tmp_path / "export"
    options = tfdist.TrainOptions(steps=40, log_every=20, model_dir=str(run))
    trained = tfdist.fit(DICT_INPUTS, strategy="none", options=options)
    assert trained.record["export"] is None and not out.exists()
    # The same run again with export=: already complete, so no step is trained;
    # its final weights are exported and its results gain the record.
    result = tfdist.fit(DICT_INPUTS, strategy="none",
                        options=dataclasses.replace(options, export=str(out)))
    assert result.record["weights_sha256"] == trained.record["weights_sha256"]
    assert result.record["steps_this_run"] == trained.record["steps_this_run"] == 40
    record = result.record["export"]
    assert read_results(run)["export"] == record
    assert record["signature"]["inputs"] == {"cat": {"dtype": "int32", "shape": [None]},
                                             "x": {"dtype": "float32", "shape": [None, 4]}}
    assert os.listdir(out) == ["40"] and record["max_abs_diff"] <= 1e-4
    features, _ = next(iter(DICT_INPUTS.dataset("test").batch(32)))
    served = _serve(record["path"], x=features["x"].numpy(), cat=features["cat"].numpy())
    model = keras.saving.load_model(run / "model.keras")
    np.testing.assert_allclose(served["output_0"], model.predict_on_batch(features), atol=1e-4)


def test_a_model_that_cannot_be_served_is_one_line_and_keeps_the_training_results(tmp_path,
                                                                                   capsys):
    run, out = tmp_path / "run", tmp_path / "export"
    code = train.main(["--strategy", "none", "--task", TASKS + ":PYTHON_LAYER", "--steps", "10",
                       "--log-every", "10", "--model-dir", str(run), "--export", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == Exit.EXPORT == 73
    assert len(err) == 1 and err[0].startswith("error: the SavedModel was written but a fresh "
                                               "process cannot serve it"), err
    assert "EagerPyFunc" in err[0] or "py_func" in err[0].lower(), err
    # Training's outputs are all there; no version folder a server would load.
    results = read_results(run)
    assert results["global_steps"] == 10 and results["export"] is None
    assert (run / "model.keras").exists() and (run / "checkpoints" / "checkpoint").exists()
    assert os.listdir(out) == []


# --- units --------------------------------------------------------------------------


@pytest.mark.parametrize("flags,expected", [
    (["--export-every", "5"], "--export-every 5 without --export DIR"),
    (["--export", "EXPORT", "--export-every", "0"], "--export-every=0 is not allowed"),
    (["--export", "FILE"], "exists and is not a directory"),
    (["--export", " "], "--export is empty"),
])
def test_bad_export_flags_are_one_line_before_anything_starts(tmp_path, capsys, flags, expected):
    (tmp_path / "FILE").write_text("x")
    flags = [str(tmp_path / f) if f in ("EXPORT", "FILE") else f for f in flags]
    code = train.main(["--strategy", "none", "--model", "logreg", "--steps", "5",
                       "--model-dir", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == Exit.BAD_INPUT and len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "run").exists()


def test_an_unwritable_export_dir_is_refused_before_training(tmp_path, capsys):
    if os.geteuid() == 0:
        target = "/proc/tfdist-export"  # root ignores permission bits; /proc refuses anyway
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
        target = str(tmp_path / "ro" / "export")
    code = train.main(["--strategy", "none", "--model", "logreg", "--steps", "5", "--dry-run",
                       "--model-dir", str(tmp_path / "run"), "--export", target])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == Exit.BAD_INPUT and len(err) == 1, err
    assert err[0].startswith(f"error: --export {target!r} is not a writable directory"), err


def test_an_export_failure_is_not_relaunched():
    from tfdist.launcher.recovery.faults import should_relaunch

    assert not should_relaunch(Exit.EXPORT, attempt=0, max_restarts=3)
    assert should_relaunch(Exit.TASK_LOST, attempt=0, max_restarts=3)


def test_outputs_are_named_as_a_signature_names_them():
    a, b = np.zeros((2, 1)), np.ones((2, 3))
    assert list(export._named_outputs(a)) == ["output_0"]
    assert list(export._named_outputs([a, b])) == ["output_0", "output_1"]
    assert sorted(export._named_outputs({"score": a, "emb": b})) == ["emb", "score"]


def _info(inputs=None):
    return {"signature": {"inputs": inputs or {"x": {"dtype": "float32", "shape": [None, 3]}},
                          "outputs": {"output_0": {"dtype": "float32", "shape": [None, 1]}}},
            "devices": []}


def _model():
    import keras

    x = keras.Input((3,), name="x")
    return keras.Model(x, keras.layers.Dense(1)(x))


def test_a_reloaded_model_predicting_otherwise_is_refused():
    model, want = _model(), {"output_0": np.array([[1.0], [2.0]], "float32")}
    ok = export._compare(model, want, {"output_0": want["output_0"] + 5e-5}, _info())
    assert ok["max_abs_diff"] == pytest.approx(5e-5, rel=1e-2)
    with pytest.raises(export.ExportFailed, match=r"differ from the trained model's: output "
                                                  r"'output_0' by up to 0.01 .*1 of 2 values"):
        export._compare(model, want, {"output_0": want["output_0"] + [[0.0], [0.01]]}, _info())
    with pytest.raises(export.ExportFailed, match="inputs are {'x': 'int32'}, the model's "
                                                  "{'x': 'float32'}"):
        export._compare(model, want, want, _info({"x": {"dtype": "int32", "shape": [None, 3]}}))
    with pytest.raises(export.ExportFailed, match="names cluster devices"):
        export._compare(model, want, want, {**_info(), "devices": ["/job:ps/task:0"]})


def test_a_model_keras_cannot_export_is_one_line(tmp_path):
    import keras

    class EagerOnly(keras.Model):
        def call(self, x):
            return x * float(np.asarray(x).sum())  # a symbolic tensor has no value

    with pytest.raises(export.ExportFailed) as err:
        export.export_and_check(EagerOnly(), str(tmp_path), 3, np.zeros((2, 3), "float32"))
    line = str(err.value)
    assert line.startswith("the model cannot be exported as a SavedModel (") and "\n" not in line
    assert os.listdir(tmp_path) == []  # nothing half-written left for a server


def test_an_export_of_a_step_already_there_replaces_it(tmp_path):
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stale").write_text("old")
    (tmp_path / ".7.partial1").mkdir()
    (tmp_path / ".7.partial1" / "saved_model.pb").write_text("new")
    export._replace(str(tmp_path / ".7.partial1"), str(tmp_path / "7"))
    assert sorted(os.listdir(tmp_path)) == ["7"]
    assert os.listdir(tmp_path / "7") == ["saved_model.pb"]
    shutil.rmtree(tmp_path / "7")
