"""--export on clusters of real processes: the chief's SavedModel holds plain,
whole variables (no MirroredVariable, no shard, no ps placement) and serves
what the trained model predicts.

- ``ps`` with 2 ps and every table and kernel split (``--variable-partitioner
  fixed``): the 300,000-row embedding is exported as one [300000, 8] variable;
- ``ps-sync``, the same;
- ``multiworker`` through ``tfdist.fit(workers=2,
  options=TrainOptions(export=..., export_every=15))``.

All in the long tier (``make test-long``); ``make test`` exports in one process
(tests/training/test_export.py).
"""

import numpy as np
import pytest

from conftest import REPO, launch_cmd, read_results

SAMPLES = str(REPO / "tests" / "training" / "sample_tasks.py")
pytestmark = pytest.mark.multiprocess


def _served_equals_trained(run, record, features, input_name):
    """Load the export as a serving process would; compare with model.keras."""
    import keras
    import tensorflow as tf

    loaded = tf.saved_model.load(record["path"])
    served = loaded.signatures["serving_default"](**{input_name: tf.constant(features)})
    trained = keras.saving.load_model(run / "model.keras").predict_on_batch(features)
    np.testing.assert_allclose(served["output_0"].numpy(), trained, atol=1e-4)
    return {v.name: v.shape.as_list() for v in loaded.variables}


def _sharded_ps_export(tmp_path, spawn, strategy):
    run, out = tmp_path / "run", tmp_path / "export"
    p = spawn(launch_cmd(strategy, "--workers", "2", "--ps", "2", "--timeout", "400",
                         train_args=["--task", SAMPLES + ":BIG_EMBEDDING", "--steps", "30",
                                     "--log-every", "10", "--variable-partitioner", "fixed",
                                     "--model-dir", str(run), "--export", str(out)]))
    assert p.wait(timeout=450) == 0, p.output
    r = read_results(run)
    # Trained split: the table's shards on both ps.
    assert sorted(r["ps_variable_bytes"]) == ["ps:0", "ps:1"]
    assert min(r["ps_variable_bytes"].values()) > 300_000 * 8 * 4 * 0.45
    record = r["export"]
    assert record["path"] == str(out / str(r["global_steps"]))
    assert [x.name for x in out.iterdir()] == [str(r["global_steps"])]
    assert record["signature"]["inputs"] == {"id": {"dtype": "int32", "shape": [None]}}
    assert record["max_abs_diff"] <= 1e-4 and record["bytes"] > 300_000 * 8 * 4
    assert any(l.startswith("[chief:0] exported SavedModel ") for l in p.lines), p.output
    ids = np.arange(0, 1000, 7, dtype="int32")
    variables = _served_equals_trained(run, record, ids, "id")
    # Exported whole: one table, one kernel; no shard and no ps left in the graph.
    assert sorted(variables.values()) == [[1], [8, 1], [300_000, 8]], variables
    assert not any("shard" in name for name in variables), variables


# Long tier: each export's check starts a fresh TensorFlow process (about 6 s of
# CPU), and tests/training/test_export.py already exports in every `make test`.
@pytest.mark.long
@pytest.mark.timeout(600)
def test_ps_with_a_table_split_over_two_ps_exports_it_whole(tmp_path, spawn):
    _sharded_ps_export(tmp_path, spawn, "ps")


@pytest.mark.long
@pytest.mark.timeout(600)
def test_ps_sync_with_a_table_split_over_two_ps_exports_it_whole(tmp_path, spawn):
    _sharded_ps_export(tmp_path, spawn, "ps-sync")


@pytest.mark.long
@pytest.mark.timeout(600)
def test_multiworker_exports_every_n_steps_through_fit_with_workers(tmp_path, capfd):
    import tfdist

    run, out = tmp_path / "run", tmp_path / "export"
    result = tfdist.fit(SAMPLES + ":REGRESSION", workers=2, strategy="multiworker",
                        options=tfdist.TrainOptions(steps=40, log_every=20, model_dir=str(run),
                                                    export=str(out), export_every=15))
    record = result.record["export"]
    assert result.strategy == "multiworker" and record["path"] == str(out / "40")
    assert result.record["global_steps"] == 40
    assert record["signature"] == {
        "inputs": {"x": {"dtype": "float32", "shape": [None, 6]}},
        "outputs": {"output_0": {"dtype": "float32", "shape": [None, 1]}}}
    # The chief's exports only, every 15 steps (at the first call past 15 and
    # 30) and at the end; worker:1 wrote none of its own.
    assert sorted(x.name for x in out.iterdir()) == ["15", "30", "40"]
    lines = capfd.readouterr().out.splitlines()
    assert sum(l.startswith("[worker:0] exported SavedModel ") for l in lines) == 3, lines
    assert not any("exported SavedModel" in l for l in lines if l.startswith("[worker:1]"))
    x = np.random.default_rng(0).normal(size=(50, 6)).astype("float32")
    variables = _served_equals_trained(run, record, x, "x")
    assert sorted(variables.values()) == sorted([[6, 16], [16], [16, 1], [1]]), variables
