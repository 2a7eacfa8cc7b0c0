"""A run directory is never lost or mixed.

Divergence stops with its own exit code and keeps the last good checkpoint;
a resume with other defining flags, a second job on the same directory, a
damaged MNIST copy and a port already taken are each one ``error:`` line,
exit 2, nothing written; a finished run is not rewritten; workers that
cannot see the chief's checkpoints do not train on from other weights.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tfdist.launcher.plan import free_ports
from tfdist.cli import train
from conftest import REPO, child_env
from tfdist.protocol import Exit

DATA = os.environ.get("TFDS_DATA_DIR")
LOGREG = ("--strategy=none", "--model=logreg", "--optimizer=sgd", "--lr-schedule=constant",
          "--log-every=5")


def snapshot(d, skip=()):
    return sorted((p.relative_to(d).as_posix(), p.read_bytes()) for p in Path(d).rglob("*")
                  if p.is_file() and p.name not in skip)


def errors_of(err):
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error:")]


def main(capfd, *argv):
    """``train.main`` in this process: (exit code, stdout, stderr)."""
    code = train.main([*argv, *(["--data-dir", DATA] if DATA else [])])
    out, err = capfd.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 10-step logreg run (SGD, the default batch: 64 in one process), checkpointed at 5 and 10."""
    model_dir = tmp_path_factory.mktemp("finished") / "run"
    assert train.main([*LOGREG, "--steps=10", "--checkpoint-every=5", "--model-dir",
                       str(model_dir), *(["--data-dir", DATA] if DATA else [])]) == 0
    return model_dir


@pytest.fixture
def run_dir(finished, tmp_path):
    """A private copy of the finished run."""
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


# --- item 2: divergence -----------------------------------------------------------------

@pytest.mark.parametrize("log_every,what", [(2, "the loss is nan at step 2"),
                                            (10, "holds NaN or infinite values")])
def test_divergence_stops_with_its_own_code_and_keeps_the_last_good_checkpoint(
        tmp_path, capfd, log_every, what):
    """A rate of 1e38 gives finite weights after step 1 and NaN from step 2 on.

    With a progress line at step 2 the loss read there stops the run; without
    one, the weights check before the checkpoint at step 2 does.
    """
    model_dir = tmp_path / "div"
    code, out, err = main(capfd, "--strategy=none", "--model=logreg", "--optimizer=sgd",
                          "--learning-rate=1e38", "--lr-schedule=constant", "--steps=10",
                          f"--log-every={log_every}", "--checkpoint-every=1",
                          "--model-dir", str(model_dir))
    errors = errors_of(err)
    assert code == Exit.DIVERGED == 65, err
    assert len(errors) == 1 and what in errors[0], err
    assert "last good checkpoint (step 1)" in errors[0] and "fresh --model-dir" in errors[0]
    ckpt = model_dir / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("ckpt-*.index")) == ["ckpt-1.index"]
    assert not (model_dir / "results.json").exists()


# --- item 3: the run's defining flags ---------------------------------------------------

def test_the_chief_records_the_defining_flags(finished):
    record = json.loads((finished / "run.json").read_text())
    assert {k: record[k] for k in ("strategy", "task", "optimizer", "learning_rate",
                                   "lr_schedule", "global_batch_size", "seed", "total_steps")} == {
        "strategy": "none", "task": "mnist-logreg", "optimizer": "sgd", "learning_rate": 0.1,
        "lr_schedule": "constant", "global_batch_size": 64, "seed": 42, "total_steps": 10}


@pytest.mark.parametrize("argv,words", [
    (("--global-batch-size=32",), ("--global-batch-size was 64, now 32",)),
    # Adam -> SGD resumed with TF warnings only, SGD -> Adam blamed --model.
    (("--optimizer=adam",), ("--optimizer was sgd, now adam", "--learning-rate was 0.1, now 0.005")),
    (("--seed=7", "--lr-schedule=cosine"), ("--lr-schedule was constant, now cosine",
                                            "--seed was 42, now 7")),
    (("--strategy=mirrored", "--learning-rate=0.2"), ("--strategy was none, now mirrored",
                                                       "--learning-rate was 0.1, now 0.2")),
])
def test_resume_with_other_flags_names_each_and_touches_nothing(run_dir, capfd, argv, words):
    before = snapshot(run_dir)
    flags = [a for a in LOGREG if not any(a.split("=")[0] == b.split("=")[0] for b in argv)]
    code, out, err = main(capfd, *flags, *argv, "--steps=20", "--model-dir", str(run_dir))
    errors = errors_of(err)
    assert code == 2 and len(errors) == 1, err
    for word in (*words, "fresh --model-dir"):
        assert word in errors[0], errors[0]
    assert "does not match --model" not in errors[0]
    assert snapshot(run_dir) == before


def test_a_run_shuffled_with_the_older_order_is_refused(run_dir, capfd):
    """A record without ``data_order`` was written with order 1 (seeds 256 apart
    shared an order): its remaining epochs cannot be continued, said in one line."""
    record = json.loads((run_dir / "run.json").read_text())
    assert record["data_order"] == 2
    del record["data_order"]
    (run_dir / "run.json").write_text(json.dumps(record))
    before = snapshot(run_dir)
    code, out, err = main(capfd, *LOGREG, "--steps=20", "--model-dir", str(run_dir))
    errors = errors_of(err)
    assert code == 2 and len(errors) == 1, err
    assert "shuffled with order 1" in errors[0] and "fresh --model-dir" in errors[0], errors[0]
    assert snapshot(run_dir) == before


def test_unreadable_run_record_is_refused_not_ignored(run_dir, capfd):
    (run_dir / "run.json").write_text("{garbled")
    before = snapshot(run_dir)
    code, out, err = main(capfd, *LOGREG, "--steps=20", "--model-dir", str(run_dir))
    errors = errors_of(err)
    assert code == 2 and len(errors) == 1 and "run.json" in errors[0], err
    assert snapshot(run_dir) == before


# --- item 8: a finished run, and saying when a run resumes ------------------------------

def test_a_finished_run_is_kept_as_it_is(run_dir, capfd):
    before = snapshot(run_dir)
    code, out, err = main(capfd, *LOGREG, "--steps=10", "--model-dir", str(run_dir))
    assert code == 0, err
    assert "already complete (step 10 of 10)" in out
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps_this_run"] == 10 and results["examples_per_sec"] > 0
    assert snapshot(run_dir) == before  # results.json, logs and checkpoints untouched


def test_resuming_says_where_and_from_which_step(run_dir, capfd):
    code, out, err = main(capfd, *LOGREG, "--steps=15", "--model-dir", str(run_dir))
    assert code == 0, err
    (line,) = [l for l in out.splitlines() if l.startswith("resumed from")]
    assert "at step 10 of 15" in line and str(run_dir) in line and "fresh --model-dir" in line
    assert json.loads((run_dir / "results.json").read_text())["resumed_from_step"] == 10


# --- item 4: one job per run directory ----------------------------------------------------

HOLD = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(os.path.join(sys.argv[1], '.lock'), os.O_RDWR | os.O_CREAT)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "os.write(fd, str(os.getpid()).encode())\n"
    "print('locked', flush=True)\n"
    "time.sleep(120)\n"
)


def test_a_second_job_on_the_run_dir_is_refused_naming_the_holder(run_dir, capfd):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(run_dir)
        code, out, err = main(capfd, *LOGREG, "--steps=20", "--model-dir", str(run_dir))
        errors = errors_of(err)
        assert code == 2 and len(errors) == 1, err
        assert f"pid {holder.pid}" in errors[0] and "another --model-dir" in errors[0]
        assert snapshot(run_dir) == before
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_dead_process_is_taken_over_and_a_released_one_quietly(tmp_path, capfd):
    from tfdist.training.loop.survival.checkpoints import RunLock

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (tmp_path / ".lock").write_text(dead)
    lock = RunLock(str(tmp_path))
    assert f"pid {dead}, which is no longer running" in capfd.readouterr().out
    assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
    with pytest.raises(Exception, match=f"pid {os.getpid()}"):
        RunLock(str(tmp_path))  # a second holder, even in this process
    lock.release()
    capfd.readouterr()
    RunLock(str(tmp_path)).release()  # released, not left by a dead holder: no note
    assert "took over" not in capfd.readouterr().out
    assert (tmp_path / ".lock").read_text() == ""


# --- item 5: damaged MNIST ----------------------------------------------------------------

@pytest.fixture(scope="module")
def mnist_copy(tmp_path_factory):
    if not DATA:
        pytest.skip("needs a prepared MNIST (TFDS_DATA_DIR)")
    root = tmp_path_factory.mktemp("tfds")
    shutil.copytree(os.path.join(DATA, "mnist"), root / "mnist")
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return root


@pytest.mark.parametrize("split,damage", [("train", "truncate"), ("test", "flip"),
                                          ("test", "truncate"), ("train", "flip")])
def test_damaged_mnist_is_refused_before_training(mnist_copy, tmp_path, capfd, split, damage):
    data_dir = tmp_path / "tfds"
    shutil.copytree(mnist_copy, data_dir)
    (path,) = data_dir.glob(f"mnist/*/mnist-{split}.tfrecord-*")
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) - 1000]
    else:  # one flipped byte: same size, a record's checksum no longer matches
        raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    started = time.monotonic()
    code = train.main([*LOGREG, "--steps=5", "--data-dir", str(data_dir),
                       "--model-dir", str(tmp_path / "run")])
    out, err = capfd.readouterr()
    errors = errors_of(err)
    assert code == 2 and len(errors) == 1, err
    assert f"MNIST's {split} split" in errors[0] and "damaged" in errors[0], errors[0]
    assert not (tmp_path / "run").exists() and "step " not in out
    assert time.monotonic() - started < 30


# --- item 8: a port already taken ---------------------------------------------------------

@pytest.mark.parametrize("held_on", ["0.0.0.0", "127.0.0.1"])
def test_a_port_already_taken_is_one_line_naming_task_and_port(tmp_path, held_on):
    """TensorFlow listens on every interface: a port held on any of them fails it."""
    port, other = free_ports(2)
    with socket.socket() as held:
        held.bind((held_on, port))
        held.listen(1)
        tf_config = {"cluster": {"worker": [f"localhost:{other}", f"localhost:{port}"]},
                     "task": {"type": "worker", "index": 1}}
        proc = subprocess.run(
            [sys.executable, str(REPO / "train.py"), *LOGREG[1:], "--strategy=multiworker",
             "--steps=5", "--startup-timeout=20", "--model-dir", str(tmp_path / "run")],
            env=child_env(tf_config=tf_config), capture_output=True, text=True, timeout=120,
        )
    errors = errors_of(proc.stderr)
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert f"worker:1 cannot listen on port {port}" in errors[0]
    assert not (tmp_path / "run").exists()


# --- item 3: a worker that cannot see the chief's checkpoints -----------------------------

@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.timeout(240)
def test_workers_that_resume_from_different_steps_refuse_to_train(finished, tmp_path, spawn):
    """--model-dir not shared: the chief resumes at step 10, worker:1 finds nothing."""
    chief_dir, worker_dir = tmp_path / "chief", tmp_path / "worker"
    shutil.copytree(finished, chief_dir)
    # The finished run was --strategy=none; its record would refuse multiworker first.
    (chief_dir / "run.json").unlink()
    before = snapshot(chief_dir, skip=(".lock",))  # the chief writes its pid there
    ports = free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = [
        spawn([sys.executable, str(REPO / "train.py"), *LOGREG[1:], "--strategy=multiworker",
               "--steps=20", "--startup-timeout=150", "--model-dir", str(d),
               *(["--data-dir", DATA] if DATA else [])],
              env=child_env(tf_config={"cluster": cluster, "task": {"type": "worker", "index": i}}))
        for i, d in enumerate((chief_dir, worker_dir))
    ]
    for i, p in enumerate(procs):
        code = p.wait(200)
        errors = [l for l in p.lines if l.startswith("error:")]
        assert code == 2 and len(errors) == 1, p.output[-3000:]
        assert "worker:0 at step 10, worker:1 at step 0" in errors[0], errors[0]
        assert "shared" in errors[0] and "Traceback" not in p.output
        assert not any(l.startswith("step ") for l in p.lines)
    assert snapshot(chief_dir, skip=(".lock",)) == before
    assert not worker_dir.exists()
