"""``--export DIR``: the trained model as a SavedModel a serving system loads, checked.

Keras 3's ``model.save`` writes only the ``.keras`` format; TF Serving,
TFLite's converter and ``tf.saved_model.load`` in another service read a
SavedModel. The chief exports one at the end of a run (and every
``--export-every`` steps) into ``DIR/<global step>/``, the numbered version
folders TF Serving's model server watches, with a ``serving_default``
signature whose inputs are named and typed like the model's inputs (a dict
input keeps its keys).

What is exported is the local copy (``training.loop.evaluation.local_copy``): a
model the task built outside any strategy, holding the trained weights read
once, a split variable joined whole (``training.sharding.full_weights``). The
SavedModel therefore holds plain variables, whatever the strategy: no
``MirroredVariable``, no shard, no ps placement, nothing naming the cluster.

The export is then checked by loading it back: a fresh Python process (no
``TF_CONFIG``, no GPU, none of the run's objects) runs :func:`_check_main`,
which imports TensorFlow only, ``tf.saved_model.load``s the folder, calls
``serving_default`` on a batch of the test split and returns the outputs; the
chief compares them with the local copy's own predictions. A separate process
is what a serving system is: a SavedModel that only works inside the process
that wrote it (a ``tf.py_function``, whose Python callback does not travel)
fails here, not in production. The record (``results.json`` ``export``):
``{path, signature: {inputs, outputs}, max_abs_diff, tolerance, seconds
(export and check), check_seconds (the reload alone), bytes}``. A model that cannot be exported, or whose reloaded predictions
differ beyond the tolerance, is :class:`ExportFailed`: one line, exit
``Exit.EXPORT`` (73), everything training wrote kept.

This module imports neither TensorFlow nor Keras at the top: the check
process loads this file alone and imports TensorFlow in it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

# Reloaded predictions may differ from Keras's by float rounding (the
# SavedModel's graph is optimised by Grappler, Keras's call runs through its
# own traced function): |got - want| <= ATOL + RTOL * |want|.
ATOL, RTOL = 1e-4, 1e-4
# Examples of the test split the check runs (the first ones).
CHECK_EXAMPLES = 256
# Seconds the check process may take (it imports TensorFlow: a few seconds).
CHECK_TIMEOUT = 300.0
SIGNATURE = "serving_default"
SINGLE = "__single__"  # the npz key of a model's one unnamed input


class ExportFailed(Exception):
    """The model could not be exported or its SavedModel does not serve what it
    predicts; ``str(err)`` is the one line (exit ``Exit.EXPORT``)."""


def check_export_flags(export: str | None, export_every: int | None) -> None:
    """``--export`` / ``--export-every`` on their own; ConfigError naming the first problem."""
    from tfdist.protocol import ConfigError

    if export_every is not None and export is None:
        raise ConfigError(f"--export-every {export_every} without --export DIR; pass --export "
                          "DIR (where the numbered SavedModel folders go) or drop --export-every")
    if export_every is not None and export_every < 1:
        raise ConfigError(f"--export-every={export_every} is not allowed; it must be a number "
                          "of steps greater than 0")
    if export is not None and not export.strip():
        raise ConfigError("--export is empty; pass a directory path (created if missing; "
                          "each export is a numbered folder in it)")
    if export is not None and os.path.exists(export) and not os.path.isdir(export):
        raise ConfigError(f"--export {export!r} exists and is not a directory; pass a "
                          "directory path (created if missing)")


class Exporter:
    """The chief's exports, each one written and checked (when they are due: the
    run's ``Schedule``).

    ``evaluator``: a callable returning the run's ``training.loop.evaluation.Evaluator``,
    whose local model is what is exported; ``task``: the task, whose test
    split's first examples the check runs.
    """

    def __init__(self, base_dir: str, evaluator, task=None):
        self.base_dir = os.path.abspath(base_dir)
        self._evaluator = evaluator
        self._task = task
        self._batch = None
        self.failed = False  # a periodic export failed: no more of them

    def periodic(self, model, step: int) -> dict | None:
        """A periodic export of ``model``'s current weights as version ``step``.

        A failure is one line and training goes on without further periodic
        exports; the final export decides the exit code.
        """
        if self.failed:
            return None
        try:
            return self.export(model, step)
        except ExportFailed as err:
            self.failed = True
            print(f"export at step {step} failed, training goes on without periodic exports: "
                  f"{err}", flush=True)
            return None

    def export(self, model, step: int) -> dict:
        """Export ``model``'s current weights (any strategy's) as version ``step``."""
        from tfdist.training.loop.evaluation import local_copy

        return self.export_local(local_copy(model, self._evaluator().local), step)

    def export_local(self, local, step: int) -> dict:
        """Export ``local`` (already holding the weights) as version ``step``."""
        if self._batch is None:
            self._batch = test_batch(self._task)
        record = export_and_check(local, self.base_dir, step, self._batch)
        print(f"exported SavedModel {record['path']} (serving_default: "
              f"{', '.join(record['signature']['inputs'])} -> "
              f"{', '.join(record['signature']['outputs'])}; {record['bytes']} bytes; reloaded "
              f"max |diff| {record['max_abs_diff']:.3g}; {record['seconds']:.1f}s)", flush=True)
        return record


def export_finished_run(config, checked, state, results: dict) -> tuple[dict, ExportFailed | None]:
    """A rerun of a finished run with ``--export``: export its final weights.

    The run's results are kept; their ``export`` record is the new one. So a
    run whose export failed exports once the cause is fixed, without
    training again. Returns (the results, the failure to raise once every
    task is done, or None).
    """
    from tfdist import protocol
    from tfdist.training.loop.evaluation import Evaluator

    evaluator = Evaluator(checked.task, checked.local_model)
    exporter = Exporter(config.export, lambda: evaluator, checked.task)
    try:
        record = exporter.export(state.model, int(state.global_step.numpy()))
    except ExportFailed as err:
        return results, err
    results = {**results, "export": record}
    protocol.write_json_atomic(os.path.join(config.model_dir, "results.json"), results)
    return results, None


def test_batch(task, n: int = CHECK_EXAMPLES):
    """The features of the first ``n`` examples of ``task``'s test split (a tensor or a dict)."""
    from tfdist.training.workload import data

    features, _ = next(iter(data.eval_dataset(task, n).take(1)))
    if isinstance(features, dict):
        return {k: np.asarray(v)[:n] for k, v in features.items()}
    return np.asarray(features)[:n]


def export_and_check(model, base_dir: str, step: int, features) -> dict:
    """Write ``model`` as ``base_dir/<step>/``, reload it elsewhere, compare; the record.

    Written beside, then renamed into place: TF Serving, which polls
    ``base_dir``, never sees a half-written version (it ignores folders whose
    name is not a number), and an export of a step already there replaces it.
    """
    started = time.perf_counter()
    os.makedirs(base_dir, exist_ok=True)
    final = os.path.join(base_dir, str(int(step)))
    partial = os.path.join(base_dir, f".{int(step)}.partial{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        _write(model, partial, features)
        want = _named_outputs(model(features, training=False))
        checking = time.perf_counter()
        got, info = _reload_and_call(partial, features)
        record = _compare(model, want, got, info)
        record["check_seconds"] = round(time.perf_counter() - checking, 3)
        _replace(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    record.update(path=final, bytes=_folder_bytes(final),
                  seconds=round(time.perf_counter() - started, 3))
    return {k: record[k] for k in ("path", "signature", "max_abs_diff", "tolerance", "seconds",
                                   "check_seconds", "bytes")}


def _write(model, path: str, features) -> None:
    signature = None
    if not _has_declared_inputs(model):
        # A subclassed model records no named inputs: take the names, shapes and
        # dtypes from the test split's features (the task contract names them).
        signature = [_spec_from_features(features)]
    try:
        model.export(path, format="tf_saved_model", verbose=False, input_signature=signature)
    except OSError:
        raise  # a full or read-only disk: the storage fault's line and exit code
    except Exception as err:  # pylint: disable=broad-except
        raise ExportFailed(
            f"the model cannot be exported as a SavedModel ({_first_line(err)}); every layer's "
            "call must be traceable by tf.function with a batch dimension of None. The "
            "training results, checkpoints and model.keras are kept") from None


def _has_declared_inputs(model) -> bool:
    try:
        return bool(model.inputs)
    except (AttributeError, ValueError):
        return False


def _spec_from_features(features):
    import tensorflow as tf

    def spec(value, name=None):
        value = np.asarray(value)
        return tf.TensorSpec((None, *value.shape[1:]), tf.as_dtype(value.dtype), name=name)

    if isinstance(features, dict):
        return {k: spec(v, k) for k, v in features.items()}
    return spec(features)


def _named_outputs(out) -> dict[str, np.ndarray]:
    """Keras's outputs under the names a signature gives them: a dict's own keys,
    else ``output_0``, ``output_1``, ... in flattening order (TensorFlow's rule)."""
    if isinstance(out, dict):
        return {k: np.asarray(v) for k, v in out.items()}
    import tensorflow as tf

    return {f"output_{i}": np.asarray(v) for i, v in enumerate(tf.nest.flatten(out))}


def _reload_and_call(path: str, features) -> tuple[dict, dict]:
    """Run :func:`_check_main` in a fresh process; (its outputs, what it saw)."""
    scratch = tempfile.mkdtemp(prefix="tfdist-export-check-")
    try:
        inputs = features if isinstance(features, dict) else {SINGLE: features}
        np.savez(os.path.join(scratch, "inputs.npz"), **inputs)
        env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "SHOWCASE_EVENTS")}
        env.update(CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
        cmd = [sys.executable, "-c", _CHECK_COMMAND, os.path.abspath(__file__), path, scratch]
        try:
            proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=CHECK_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            raise ExportFailed(f"loading the SavedModel back in a fresh process took more than "
                               f"{CHECK_TIMEOUT:g}s; the training results are kept") from None
        info_path = os.path.join(scratch, "info.json")
        if proc.returncode != 0 or not os.path.exists(info_path):
            raise ExportFailed(
                "the SavedModel was written but a fresh process cannot serve it "
                f"(tf.saved_model.load and {SIGNATURE}: {_error_line(proc.stderr)}); a layer "
                "that runs Python (tf.py_function, tf.numpy_function) works only in the "
                "process that traced it. The training results, checkpoints and model.keras "
                "are kept")
        with open(info_path) as f:
            info = json.load(f)
        with np.load(os.path.join(scratch, "outputs.npz")) as out:
            got = {k: out[k] for k in out.files}
        return got, info
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _compare(model, want: dict, got: dict, info: dict) -> dict:
    signature = info["signature"]
    expected = _model_inputs(model)
    if expected is not None:
        have = {k: v["dtype"] for k, v in signature["inputs"].items()}
        if have != expected:
            raise ExportFailed(f"the SavedModel's {SIGNATURE} inputs are {have}, the model's "
                               f"{expected}; the training results are kept")
    if info["devices"]:
        raise ExportFailed(f"the SavedModel names cluster devices ({', '.join(info['devices'])}); "
                           "a served model must not; the training results are kept")
    if sorted(want) != sorted(got):
        raise ExportFailed(f"the SavedModel's {SIGNATURE} returns {sorted(got)}, the model "
                           f"{sorted(want)}; the training results are kept")
    worst = 0.0
    for name, w in want.items():
        g = got[name]
        if g.shape != w.shape:
            raise ExportFailed(f"the reloaded SavedModel's output {name!r} has shape "
                               f"{list(g.shape)}, the model's {list(w.shape)}; the training "
                               "results are kept")
        diff = np.abs(g.astype(np.float64) - w.astype(np.float64))
        worst = max(worst, float(diff.max()) if diff.size else 0.0)
        bad = diff > ATOL + RTOL * np.abs(w.astype(np.float64))
        if not np.isfinite(diff).all() or bad.any():
            raise ExportFailed(
                f"the reloaded SavedModel's predictions differ from the trained model's: output "
                f"{name!r} by up to {float(np.nanmax(diff)):.3g} (tolerance {ATOL:g} + "
                f"{RTOL:g} x |value|, {int(bad.sum())} of {diff.size} values beyond it); the "
                "training results are kept")
    return {"signature": signature, "max_abs_diff": worst,
            "tolerance": {"atol": ATOL, "rtol": RTOL}}


def _model_inputs(model) -> dict[str, str] | None:
    """{input name: dtype} of a model with declared inputs (None: a subclassed one)."""
    if not _has_declared_inputs(model):
        return None
    from keras import tree

    struct = getattr(model, "_inputs_struct", None)
    if isinstance(struct, dict):
        return {k: str(v.dtype) for k, v in struct.items()}
    return {t.name: str(t.dtype) for t in tree.flatten(model.inputs)}


def _replace(partial: str, final: str) -> None:
    old = None
    if os.path.exists(final):
        old = f"{os.path.dirname(final)}/.{os.path.basename(final)}.old{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(partial, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _first_line(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [""])[0]
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _error_line(stderr: str) -> str:
    """The exception line of a child's traceback (its last line naming an error)."""
    lines = [l.strip() for l in (stderr or "").splitlines() if l.strip()]
    for line in reversed(lines):
        if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]:
            return line[:200]
    return (lines[-1][:200] if lines else "it exited without a word")


# --- the check process ----------------------------------------------------------
# `python -c _CHECK_COMMAND <this file> <savedmodel> <scratch dir>`: loads this file
# on its own (not the tfdist package) and runs _check_main.
_CHECK_COMMAND = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('tfdist_export_check', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module._check_main(sys.argv[2], sys.argv[3])\n"
)


def _check_main(path: str, scratch: str) -> None:
    """In the fresh process: load, call ``serving_default`` on the inputs, write what it saw."""
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    fn = loaded.signatures[SIGNATURE]
    _, specs = fn.structured_input_signature
    with np.load(os.path.join(scratch, "inputs.npz")) as data:
        arrays = {k: data[k] for k in data.files}
    if set(arrays) == {SINGLE}:
        if len(specs) != 1:
            raise SystemExit(f"{SIGNATURE} takes {sorted(specs)}, the test split gives one tensor")
        arrays = {next(iter(specs)): arrays[SINGLE]}
    if sorted(arrays) != sorted(specs):
        raise SystemExit(f"{SIGNATURE} takes {sorted(specs)}, the test split gives "
                         f"{sorted(arrays)}")
    feed = {k: tf.constant(v.astype(specs[k].dtype.as_numpy_dtype)) for k, v in arrays.items()}
    out = fn(**feed)
    np.savez(os.path.join(scratch, "outputs.npz"), **{k: v.numpy() for k, v in out.items()})

    def describe(spec):
        return {"dtype": spec.dtype.name,
                "shape": [None if d is None else int(d) for d in spec.shape.as_list()]}

    info = {
        "signature": {"inputs": {k: describe(s) for k, s in sorted(specs.items())},
                      "outputs": {k: describe(s) for k, s in sorted(fn.structured_outputs.items())}},
        "devices": sorted(_cluster_devices(path)),
    }
    with open(os.path.join(scratch, "info.json"), "w") as f:
        json.dump(info, f)


def _cluster_devices(path: str) -> set[str]:
    """Device strings naming a job (``/job:ps/...``) anywhere in the saved graph."""
    from tensorflow.core.protobuf import saved_model_pb2

    model = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        model.ParseFromString(f.read())
    found = set()
    for meta in model.meta_graphs:
        nodes = list(meta.graph_def.node)
        for fn in meta.graph_def.library.function:
            nodes.extend(fn.node_def)
        found.update(n.device for n in nodes if "/job:" in n.device)
    return found
