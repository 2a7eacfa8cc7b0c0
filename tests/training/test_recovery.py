"""Checkpoint safety and fault messages, in this process (no cluster).

A kill during a checkpoint write leaves either nothing new in the index, or
files the index does not name; a corrupt checkpoint is skipped for the one
before it; a foreign one is refused. Each case is built on disk exactly.
"""

import os
from pathlib import Path

import pytest

from tfdist.cli import train
from tfdist.strategies import parse_tf_config
from tfdist.training.config import TrainConfig

DATA = os.environ.get("TFDS_DATA_DIR")


def _config(model_dir, steps, model="logreg", every=10):
    return TrainConfig(strategy="mirrored", task=f"mnist-{model}", steps=steps, log_every=10,
                       checkpoint_every=every, model_dir=str(model_dir), data_dir=DATA,
                       global_batch_size=128)


@pytest.fixture
def trained(tmp_path_factory):
    """A 30-step logreg run checkpointed at steps 10, 20 and 30."""
    def make():
        model_dir = tmp_path_factory.mktemp("run")
        train.run(_config(model_dir, 30))
        ckpt = model_dir / "checkpoints"
        assert {p.name for p in ckpt.glob("ckpt-*.index")} == {
            "ckpt-10.index", "ckpt-20.index", "ckpt-30.index"}
        return model_dir
    return make


def snapshot(d):
    return sorted((p.relative_to(d).as_posix(), p.read_bytes()) for p in Path(d).rglob("*")
                  if p.is_file())


def _data_file(model_dir, step):
    (path,) = (model_dir / "checkpoints").glob(f"ckpt-{step}.data-*")
    return path


def test_checkpoint_every_saves_and_announces(tmp_path, capsys):
    results = train.run(_config(tmp_path / "run", 25, every=10))
    out = capsys.readouterr().out
    saved = [l.split(":")[0] for l in out.splitlines() if l.startswith("checkpoint saved")]
    assert saved == ["checkpoint saved at step 10", "checkpoint saved at step 20",
                     "checkpoint saved at step 25"]
    assert results["global_steps"] == 25


def test_relative_model_dir_resumes(tmp_path, monkeypatch, capsys):
    """As typed on the command line (``--model-dir runs/x``), not only absolute."""
    monkeypatch.chdir(tmp_path)
    train.run(_config("runs/rel", 20))
    capsys.readouterr()
    results = train.run(_config("runs/rel", 30))
    assert "resumed from runs/rel/checkpoints/ckpt-20 at step 20" in capsys.readouterr().out
    assert results["resumed_from_step"] == 20 and results["global_steps"] == 30


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(trained, capsys):
    model_dir = trained()
    data = _data_file(model_dir, 30)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte: the stored checksum no longer matches
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    results = train.run(_config(model_dir, 40))
    out = capsys.readouterr().out
    assert "skipped unreadable checkpoint(s) ckpt-30" in out
    assert "fell back to" in out and out.count("resumed from") == 1
    assert results["resumed_from_step"] == 20 and results["global_steps"] == 40


def test_half_written_checkpoint_is_never_the_one_resumed(trained, capsys):
    """A kill mid-write leaves files the index does not name yet (TF writes it last)."""
    model_dir = trained()
    ckpt = model_dir / "checkpoints"
    index_before = (ckpt / "checkpoint").read_text()
    (ckpt / "ckpt-40.index").write_bytes(b"\x00" * 7)
    (ckpt / "ckpt-40.data-00000-of-00001").write_bytes(b"partial")
    capsys.readouterr()
    results = train.run(_config(model_dir, 35))
    out = capsys.readouterr().out
    assert "skipped" not in out
    assert results["resumed_from_step"] == 30 and results["global_steps"] == 35
    assert "ckpt-40" not in index_before


# The long tier: make test keeps the corrupt and the half-written checkpoint (CI time)
@pytest.mark.long
def test_truncated_checkpoint_without_index_is_skipped_with_a_warning(trained, capsys):
    model_dir = trained()
    ckpt = model_dir / "checkpoints"
    (ckpt / "checkpoint").write_text("model_checkpoint_path: {{{ garbled")
    data = _data_file(model_dir, 30)
    data.write_bytes(data.read_bytes()[:10])
    capsys.readouterr()
    results = train.run(_config(model_dir, 30))
    out = capsys.readouterr().out
    assert "checkpoint index" in out and "unreadable" in out
    assert "skipped unreadable checkpoint(s) ckpt-30" in out
    assert results["resumed_from_step"] == 20 and results["global_steps"] == 30


def test_no_readable_checkpoint_is_an_error_not_a_fresh_start(trained, capsys):
    model_dir = trained()
    for step in (10, 20, 30):
        _data_file(model_dir, step).write_bytes(b"")
    before = snapshot(model_dir)
    capsys.readouterr()
    code = train.main(["--strategy=mirrored", "--model=logreg", "--steps=40", "--global-batch-size=128",
                       "--model-dir", str(model_dir)])
    err = capsys.readouterr().err
    errors = [l for l in err.splitlines() if l.startswith("error:")]
    assert code == 2 and len(errors) == 1, err
    assert "no readable checkpoint" in errors[0] and "fresh --model-dir" in errors[0]
    assert snapshot(model_dir) == before


def test_foreign_checkpoint_is_refused_and_the_run_dir_left_alone(trained, capsys):
    model_dir = trained()
    # run.json names the flag before any checkpoint is read; a run directory
    # from before run.json existed is refused by the restore itself.
    for record, words in ((True, "--task was mnist-logreg, now mnist-cnn"),
                          (False, "does not match --task=mnist-cnn --optimizer=adam")):
        if not record:
            (model_dir / "run.json").unlink()
        before = snapshot(model_dir)
        capsys.readouterr()
        code = train.main(["--strategy=mirrored", "--model=cnn", "--steps=40", "--global-batch-size=128",
                           "--model-dir", str(model_dir)])
        err = capsys.readouterr().err
        errors = [l for l in err.splitlines() if l.startswith("error:")]
        assert code == 2 and len(errors) == 1, err
        assert words in errors[0] and "fresh --model-dir" in errors[0], errors[0]
        assert "Traceback" not in err
        assert snapshot(model_dir) == before


def test_task_lost_names_the_unreachable_task_in_one_line():
    from tfdist.launcher.plan import free_ports
    from tfdist.training.loop.survival.recovery import task_lost

    port0, port1 = free_ports(2)
    cluster = parse_tf_config(
        '{"cluster": {"worker": ["localhost:%d", "localhost:%d"]}, '
        '"task": {"type": "worker", "index": 0}}' % (port0, port1))
    grpc_text = (
        "Graph execution error:\n\nDetected at node while/adam/CollectiveReduceV2\n"
        "Collective ops is aborted by: recvmsg:Connection reset by peer\n"
        "Additional GRPC error information from remote target /job:worker/replica:0/task:1\n"
    )
    err = task_lost(RuntimeError(grpc_text), cluster, "training", step=616, checkpoint_step=600)
    message = str(err)
    assert "\n" not in message
    assert f"worker:0 lost worker:1 (localhost:{port1})" in message
    assert "at step 616" in message and "Connection reset by peer" in message
    assert "resume from the checkpoint at step 600" in message
