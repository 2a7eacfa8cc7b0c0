"""A task's mistakes are caught before anything starts: one line naming the task, exit 2.

Each case writes a small task file and asks ``train.py --dry-run`` (in this
process) for its plan; a few go through the real command and the launcher's
pre-flight too (``test_task_mistakes_stop_the_command_and_the_launcher``).
"""

import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, child_env, launch_cmd

HEAD = """
import keras, numpy as np, tensorflow as tf
def _model(compile=True, **kw):
    x = keras.Input((4,), name="x")
    m = keras.Model(x, keras.layers.Dense(3)(x))
    if compile:
        m.compile(optimizer="adam", **({"loss": "sparse_categorical_crossentropy"} | kw))
    return m
def _pairs(n=10):
    return tf.data.Dataset.from_tensor_slices((np.zeros((n, 4), "float32"), np.zeros(n, "int64")))
"""

GOOD_MODEL = "def build_model():\n    return _model()\n"
GOOD_DATA = "def dataset(split):\n    return _pairs()\n"

# (case, task file body or None for a spec given as is, --task spec, what the line must say)
CASES = [
    ("missing file", None, "no/such/task.py", "no such file"),
    ("missing module", None, "no_such_module_xyz", "no module named 'no_such_module_xyz'"),
    ("bad spec", None, "a b", "not a built-in task"),
    ("import raises", "raise RuntimeError('boom at import')\n", None,
     "importing it failed: RuntimeError: boom at import"),
    ("syntax error", "def build_model(:\n", None, "importing it failed: SyntaxError"),
    ("no build_model", GOOD_DATA, None, "has no build_model()"),
    ("no dataset", GOOD_MODEL, None, "has no dataset()"),
    ("missing NAME", GOOD_MODEL + GOOD_DATA, ":Nope", "the module has no 'Nope'"),
    ("build_model raises", "def build_model():\n    raise ValueError('bad width')\n" + GOOD_DATA,
     None, "build_model() raised ValueError: bad width"),
    ("not a model", "def build_model():\n    return 3\n" + GOOD_DATA, None,
     "returned int, not a keras.Model"),
    ("not compiled", "def build_model():\n    return _model(compile=False)\n" + GOOD_DATA, None,
     "not compiled"),
    ("no loss", "def build_model():\n    m = _model(compile=False)\n    m.compile(optimizer='adam')\n"
     "    return m\n" + GOOD_DATA, None, "compiled without a loss"),
    ("batched", GOOD_MODEL + "def dataset(split):\n    return _pairs().batch(4)\n", None,
     "looks batched"),
    ("not a pair", GOOD_MODEL + "def dataset(split):\n    return _pairs().map(lambda x, y: x)\n",
     None, "not (features, label) pairs"),
    # (features, label, sample_weight) triples are what fit takes; four are not.
    ("four", GOOD_MODEL + "def dataset(split):\n    return _pairs().map(lambda x, y: (x, y, y, y))\n",
     None, "yields tuples of 4"),
    ("feature names", GOOD_MODEL
     + "def dataset(split):\n    return _pairs().map(lambda x, y: ({'z': x}, y))\n",
     None, "features are named ['z'], the model's inputs ['x']"),
    ("shape", GOOD_MODEL + "def dataset(split):\n    return _pairs().map(lambda x, y: (x[:3], y))\n",
     None, "has shape [3] per example"),
    ("dtype", GOOD_MODEL
     + "def dataset(split):\n    return _pairs().map(lambda x, y: (tf.strings.as_string(x), y))\n",
     None, "is string, the model's input is float32"),
    ("empty split", GOOD_MODEL + "def dataset(split):\n    return _pairs().take(0)\n", None,
     "is empty"),
    ("infinite train", GOOD_MODEL
     + "def dataset(split):\n    return _pairs().repeat() if split == 'train' else _pairs()\n",
     None, "dataset('train') is infinite, so epochs cannot be counted; pass --steps N"),
    ("infinite test", GOOD_MODEL
     + "def dataset(split):\n    return _pairs().repeat() if split == 'test' else _pairs()\n",
     None, "dataset('test') is infinite"),
    ("not a dataset", GOOD_MODEL + "def dataset(split):\n    return [1, 2]\n", None,
     "returned list, not a tf.data.Dataset"),
    ("dataset raises", GOOD_MODEL
     + "def dataset(split):\n    if split == 'test':\n        raise KeyError('no test')\n"
       "    return _pairs()\n", None, "dataset('test') raised KeyError"),
    ("loss fails", "def build_model():\n    return _model(loss='mse')\n"
     + "def dataset(split):\n    return _pairs().map(lambda x, y: (x, tf.zeros([5])))\n",
     None, "fail on the first training example"),
    ("option without configure", GOOD_MODEL + GOOD_DATA, "+opt",
     "--task-option given, but the task has no configure"),
]


def _spec(tmp_path, name, body, spec):
    if body is None:
        return spec
    path = tmp_path / f"task_{name.replace(' ', '_')}.py"
    path.write_text(HEAD + textwrap.dedent(body))
    return str(path) + (spec if spec and spec.startswith(":") else "")


@pytest.mark.parametrize("name,body,spec,says", CASES, ids=[c[0] for c in CASES])
def test_a_bad_task_is_one_line_and_exit_2(tmp_path, capsys, name, body, spec, says):
    from tfdist.cli import train

    run_dir = tmp_path / "run"
    extra = ["--task-option", "k=v"] if spec == "+opt" else []
    code = train.main(["--task", _spec(tmp_path, name, body, spec), *extra, "--dry-run",
                       "--model-dir", str(run_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: task '"), err
    assert says in err[0]
    assert not run_dir.exists()


def test_task_mistakes_stop_the_command_and_the_launcher(tmp_path):
    """The real command (after the strategy starts) and the launcher's pre-flight check."""
    body = GOOD_MODEL + "def dataset(split):\n    return _pairs().batch(4)\n"
    spec = _spec(tmp_path, "batched_cmd", body, None)
    run_dir = tmp_path / "run"
    env = child_env()
    cmd = subprocess.run([sys.executable, str(REPO / "train.py"), "--task", spec,
                          "--model-dir", str(run_dir)], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    lines = [l for l in cmd.stderr.splitlines() if l.startswith("error:")]
    assert cmd.returncode == 2 and len(lines) == 1 and "looks batched" in lines[0], cmd.stderr
    assert "Traceback" not in cmd.stderr
    launch = subprocess.run(launch_cmd("ps", "--workers", "2", "--ps", "1",
                                       train_args=["--task", spec, "--model-dir", str(run_dir)]),
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    out = launch.stdout + launch.stderr
    assert launch.returncode == 2, out
    assert "looks batched" in out and "Traceback" not in out
    assert not run_dir.exists()


def test_a_good_user_task_plans_from_its_split_size(tmp_path, capsys):
    import json

    from tfdist.cli import train

    path = tmp_path / "good_task.py"
    path.write_text(HEAD + GOOD_MODEL + "def dataset(split):\n    return _pairs(1000)\n")
    assert train.main(["--task", str(path), "--dry-run", "--global-batch-size", "100",
                       "--epochs", "3", "--model-dir", str(tmp_path / "run")]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["train_examples"] == 1000 and plan["total_steps"] == 30
    assert plan["training_task"] == str(path)
