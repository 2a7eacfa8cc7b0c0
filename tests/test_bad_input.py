"""Every bad input: exit code 2, one 'error:' line naming it, model dir untouched."""

import json
import os
import subprocess
import sys

import pytest

import train
from conftest import REPO, child_env


def tfc(cluster, task_type="worker", index=0):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


W2 = {"worker": ["localhost:2222", "localhost:2223"]}
PS_NO_CHIEF = {"worker": ["localhost:2222"], "ps": ["localhost:2223"]}
PS = {"chief": ["localhost:2221"], "worker": ["localhost:2222"], "ps": ["localhost:2223"]}

# (case id, TF_CONFIG or None, extra argv, words the message must contain)
CASES = [
    ("invalid-json", '{"cluster": {"worker": [', [], ["not valid JSON", '{"cluster"']),
    ("cluster-missing", json.dumps({"task": {"type": "worker", "index": 0}}), [], ["no 'cluster'", "expected"]),
    ("task-missing", json.dumps({"cluster": W2}), [], ["no 'task'", "expected"]),
    ("task-type-not-in-cluster", tfc(W2, "chief"), [], ["'chief'", "allowed: worker"]),
    ("index-out-of-range", tfc(W2, "worker", 2), [], ["index is 2", "0 to 1"]),
    # "1" is accepted, as TensorFlow's resolver accepts it (issue 18); "1.0" is not.
    ("index-not-int", tfc(W2, "worker", "1.0"), [], ["'1.0'", "integer"]),
    ("index-bool", tfc(W2, "worker", True), [], ["True", "integer"]),
    ("duplicate-address", tfc({"worker": ["localhost:2222", "localhost:2222"]}), [],
     ["'localhost:2222' is used twice", "own host:port"]),
    ("address-without-port", tfc({"worker": ["localhost"]}), [], ["'localhost'", "host:port"]),
    ("unknown-role", tfc({"worker": ["a:1"], "master": ["b:1"]}), [], ["'master'", "allowed roles"]),
    ("ps-without-ps-job", tfc(W2), ["--strategy=ps"], ["'ps' job", "multiworker"]),
    ("multiworker-with-ps-job", tfc(PS, "worker"), ["--strategy=multiworker"], ["1 ps task", "--strategy=ps"]),
    ("ps-without-chief", tfc(PS_NO_CHIEF, "worker"), ["--strategy=ps"], ["'chief'", "received roles"]),
    ("mirrored-with-cluster", tfc(W2), ["--strategy=mirrored"], ["2 tasks", "multiworker"]),
    ("unknown-strategy", None, ["--strategy=horovod"], ["'horovod'", "auto, none, mirrored, multiworker, ps"]),
    ("batch-not-divisible", tfc({"worker": ["a:1", "b:1", "c:1"]}), ["--strategy=multiworker", "--global-batch-size=128"],
     ["128", "3 replica", "multiple of 3"]),
    ("unknown-model", None, ["--model=resnet"], ["'resnet'", "cnn, logreg"]),
    ("unknown-lr-schedule", None, ["--lr-schedule=linear"], ["'linear'", "cosine, constant"]),
    ("zero-epochs", None, ["--epochs=0"], ["--epochs=0", "greater than 0"]),
    ("non-int-steps", None, ["--steps=ten"], ["'ten'", "--help"]),
    ("ps-shards-is-gone", None, ["--ps-shards=2"], ["--ps-shards", "--help"]),
    ("unknown-flag", None, ["--learning-rat=1"], ["--learning-rat", "--help"]),
]


@pytest.fixture
def model_dir(tmp_path):
    """An existing run directory: bad input must leave it exactly as it was."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "results.json").write_text('{"keep": true}\n')
    return d


def snapshot(d):
    return sorted((p.relative_to(d).as_posix(), p.read_bytes()) for p in d.rglob("*") if p.is_file())


@pytest.mark.parametrize("case,tf_config,argv,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case, tf_config, argv, words, model_dir, monkeypatch, capsys):
    before = snapshot(model_dir)
    fresh = model_dir.parent / "fresh"
    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    for target in (model_dir, fresh):
        code = train.main([*argv, "--model-dir", str(target), "--dry-run"])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2, err
        assert len(errors) == 1, err
        assert "Traceback" not in err
        for word in words:
            assert word in errors[0], f"{word!r} not in {errors[0]!r}"
    assert snapshot(model_dir) == before
    assert not fresh.exists()


def test_model_dir_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert train.main(["--model-dir", str(target)]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert target.read_text() == "x"


def test_missing_mnist_is_one_line_without_download(tmp_path):
    """A data dir without MNIST: a pointer to --data-dir, not minutes of retries."""
    empty = tmp_path / "no-data"
    empty.mkdir()
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--steps=1", "--data-dir", str(empty),
         "--model-dir", str(tmp_path / "m")],
        env=child_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "--data-dir" in errors[0] and str(empty) in errors[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "m").exists()


def test_subprocess_exit_code_and_clean_stderr(tmp_path):
    """End to end: the real exit status, and nothing but the error on stderr."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--strategy=ps", "--model-dir", str(tmp_path / "m")],
        env=child_env(tf_config=tfc(W2)), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: --strategy=ps needs a 'ps' job")
    assert not (tmp_path / "m").exists()
