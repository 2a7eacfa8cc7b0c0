"""A full disk, and a run directory that turns read-only, in the middle of a run.

Real file systems, mounted for the test (root): a small tmpfs that the test
fills once the first checkpoint is on it, and an ext4 image that the test
makes read-only the way the kernel does after an I/O error
(``errors=remount-ro`` and ``trigger_fs_error``). A plain ``mount -o
remount,ro`` cannot be used mid-run: the kernel refuses it (EBUSY) while
any file on the mount is open for writing, and the chief holds two
(``.lock``, TensorBoard's event file) for the whole run.

Every run must end with one ``error:`` line naming the write, the path and
the cause, exit 74, never a traceback; the previous checkpoint stays the
newest listed and restorable; once the disk has room (or is writable)
again, the same command resumes from it and finishes with the exact total.
"""

import contextlib
import errno
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tfdist.launcher.recovery import restarter as restarters
from tfdist import protocol
from conftest import REPO, child_env, descendants_alive, launch_cmd, read_results
from tfdist.protocol import Exit
from tfdist.training.loop.survival.recovery import StorageFault, storage_cause, storage_fault

DATA = os.environ.get("TFDS_DATA_DIR")
STEPS, EVERY = 600, 200
# No progress lines (nor their TensorBoard scalars and events) between two
# checkpoints: the next write after the fault is the checkpoint at 2 x EVERY.
TRAIN = ["--model", "logreg", "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
         "--log-every", str(10 * STEPS), "--eval-every", "0", "--seed", "3",
         *(["--data-dir", DATA] if DATA else [])]


# --- classification: what Python and TensorFlow raise (pure) ------------------------------

def _op_error(cls_name, message):
    import tensorflow as tf

    return getattr(tf.errors, cls_name)(None, None, message)


# The messages TensorFlow 2.21 gave on a full and on a read-only tmpfs
# (CheckpointManager.save, file_io.atomic_write_string_to_file, tf.summary).
SAVE_FULL = ("{{function_node __wrapped__SaveV2_dtypes_4_device_/job:localhost/replica:0/task:0/"
             "device:CPU:0}} /m/checkpoints/ckpt-2_temp/part-00000-of-00001.data-00000-of-00001"
             ".tempstate15695432128797252810; No space left on device [Op:SaveV2]")
SAVE_RO = ("{{function_node __wrapped__SaveV2_dtypes_4_device_/job:localhost/replica:0/task:0/"
           "device:CPU:0}} /m/checkpoints/ckpt-2_temp; Read-only file system [Op:SaveV2]")
SUMMARY_FULL = ("{{function_node __wrapped__WriteSummary_device_/job:localhost/replica:0/task:0/"
                "device:CPU:0}} /m/logs/events.out.tfevents.1795541043.vm.16932.0.v2; No space "
                "left on device\n\tFailed to flush 11 events to /m/logs/events.out.tfevents")


@pytest.mark.parametrize("err,code,path", [
    (OSError(errno.ENOSPC, "No space left on device", "/m/results.json.tmp9"), errno.ENOSPC,
     "/m/results.json.tmp9"),
    (OSError(errno.EROFS, "Read-only file system", "/m/run.json.tmp9"), errno.EROFS,
     "/m/run.json.tmp9"),
    (OSError(errno.EACCES, "Permission denied", "/m/x"), errno.EACCES, "/m/x"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), errno.EDQUOT, None),
    (("ResourceExhaustedError", SAVE_FULL), errno.ENOSPC,
     "/m/checkpoints/ckpt-2_temp/part-00000-of-00001.data-00000-of-00001"
     ".tempstate15695432128797252810"),
    (("PermissionDeniedError", SAVE_RO), errno.EROFS, "/m/checkpoints/ckpt-2_temp"),
    (("PermissionDeniedError", SAVE_RO.replace(" /m/", " runs/m/")), errno.EROFS,
     "runs/m/checkpoints/ckpt-2_temp"),  # a relative --model-dir
    (("ResourceExhaustedError", SUMMARY_FULL), errno.ENOSPC,
     "/m/logs/events.out.tfevents.1795541043.vm.16932.0.v2"),
])
def test_storage_errors_are_classified_with_their_path(err, code, path):
    if isinstance(err, tuple):
        err = _op_error(*err)
    assert storage_cause(err) == (code, path)


@pytest.mark.parametrize("err", [
    OSError(errno.EIO, "Input/output error", "/m/x"),
    FileNotFoundError(errno.ENOENT, "No such file or directory", "/m/x"),
    ValueError("No space left on device"),  # the words alone, not an I/O error
    ("ResourceExhaustedError", "OOM when allocating tensor with shape[100000,100000]"),
    ("UnavailableError", "Socket closed"),
])
def test_other_errors_are_not_storage_faults(err):
    if isinstance(err, tuple):
        err = _op_error(*err)
    assert storage_cause(err) is None and storage_fault(err) is None


def test_a_wrapped_oserror_counts():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/m/model.tmp1.keras")
        except OSError as inner:
            raise RuntimeError("saving failed") from inner
    except RuntimeError as outer:
        assert storage_cause(outer) == (errno.ENOSPC, "/m/model.tmp1.keras")


@pytest.mark.parametrize("err,cause,fix", [
    (("ResourceExhaustedError", SAVE_FULL), protocol.NO_SPACE, "Free space on that file system"),
    (("PermissionDeniedError", SAVE_RO), protocol.READ_ONLY, "remount it read-write"),
    (OSError(errno.EACCES, "Permission denied", "/m/run.json"), protocol.NOT_PERMITTED,
     "write permission"),
])
def test_the_line_says_what_where_why_and_how_to_resume(err, cause, fix):
    if isinstance(err, tuple):
        err = _op_error(*err)
    fault = storage_fault(err, "save the checkpoint at step 400 in '/m/checkpoints'",
                          member="chief:0", checkpoint_step=200)
    line = str(fault)
    assert isinstance(fault, StorageFault) and "\n" not in line
    assert line.startswith("chief:0 could not save the checkpoint at step 400 in '/m/checkpoints'")
    assert cause in line and fix in line and type(err).__name__ in line
    assert "the checkpoint at step 200 is intact" in line
    assert "relaunch with the same --model-dir to resume from step 200" in line


@pytest.mark.parametrize("path,what", [
    ("/m/results.json.tmp7", "write the results record"),
    ("/m/model.tmp7.keras", "write the trained model"),
    ("/m/run.json.tmp7", "write the run record"),
    ("/m/logs/events.out.tfevents.1", "write TensorBoard logs"),
    ("/m/launch/events/worker-0.jsonl", "append a progress event"),
    ("/m/checkpoints/checkpoint.tmp3", "save a checkpoint"),
])
def test_the_write_is_told_from_its_path(path, what):
    line = str(storage_fault(OSError(errno.ENOSPC, "No space left on device", path)))
    assert line.startswith(f"could not {what}") and path in line
    assert "the newest checkpoint listed" in line  # the step is not known there


def test_a_worker_saving_privately_does_not_claim_its_own_save_as_the_resume_point(tmp_path):
    """Under multiworker, worker:1's saves go to a private directory: its
    step is not where a relaunch resumes (the chief's newest is)."""
    import types

    import tensorflow as tf

    from tfdist.training.loop.survival.checkpoints import Checkpointer

    state = types.SimpleNamespace(checkpoint=tf.train.Checkpoint(v=tf.Variable(1.0)))
    chief = Checkpointer(state, str(tmp_path), True, "worker:0")
    worker = Checkpointer(state, str(tmp_path), False, "worker:1")
    try:
        chief.saved_at = worker.saved_at = 400
        assert chief.resume_step == 400 and worker.resume_step == -1
        err = OSError(errno.ENOSPC, "No space left on device", "/m/checkpoints/ckpt-600")
        line = str(storage_fault(err, member="worker:1", checkpoint_step=worker.resume_step))
        assert "step 400" not in line and "resume from it" in line, line
    finally:
        worker.close()


def test_no_checkpoint_yet_says_start_again():
    line = str(storage_fault(OSError(errno.ENOSPC, "x", "/m/run.json"), checkpoint_step=0))
    assert "no checkpoint was saved yet" in line and "to start again" in line


def test_the_exit_code_is_documented_and_never_relaunched():
    from tfdist.launcher.recovery import faults

    assert Exit.STORAGE == 74 and Exit.STORAGE not in protocol.RELAUNCH
    assert Exit.STORAGE not in (Exit.PREEMPTED, Exit.TASK_LOST)
    assert "74 a write into --model-dir failed" in protocol.exit_epilog()
    assert not faults.should_relaunch(Exit.STORAGE, 0, 5)


def test_fault_exit_prints_one_line_and_returns_74(capsys):
    from tfdist.cli import train

    code = train.fault_exit(_op_error("ResourceExhaustedError", SUMMARY_FULL))
    err = capsys.readouterr().err
    assert code == Exit.STORAGE and err.count("\n") == 1 and err.startswith("error: could not "
                                                                             "write TensorBoard")
    assert train.fault_exit(ValueError("a bug")) is None


def test_the_restarter_leaves_a_task_that_exited_74_down():
    from tfdist.launcher.recovery import faults
    from tfdist.launcher.state import JobState, MemberView

    restarter = restarters.MemberRestarter(0.0, log=lambda _: None, clock=lambda: 0.0)
    state = JobState((MemberView("worker:1", 11, int(Exit.STORAGE), 1),
                      MemberView("worker:2", 12, int(Exit.FAILED), 1)), 0)
    restarter(state)  # each failed task's restart is due after the delay: the next poll
    assert [a.member for a in restarter(state)] == ["worker:2"]  # a crash is restarted, 74 not


@pytest.mark.parametrize("said,relaunches,cause,verdict", [
    ("error: chief:0 could not save the checkpoint at step 400 in '/m/checkpoints': "
     f"{protocol.NO_SPACE} (ResourceExhaustedError on '/m/x'); ...", True, protocol.NO_SPACE,
     "not relaunched under --max-restarts"),
    (f"error: could not write TensorBoard logs: {protocol.READ_ONLY} (...)", False,
     protocol.READ_ONLY, "not relaunched:"),
    ("", False, "the disk is full or read-only", "not relaunched:"),
])
def test_the_launcher_line_names_task_and_cause(said, relaunches, cause, verdict):
    from tfdist.launcher.supervisor import storage_line

    line = storage_line("worker:0", ["step 1", said, "more"], relaunches)
    assert line.startswith("[launch] worker:0 exited with code 74: a write into --model-dir "
                           f"failed, {cause}")
    assert verdict in line and "\n" not in line


# --- real file systems ---------------------------------------------------------------------

def _run(*cmd, check=True):
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


def _mount_or_skip(*args):
    if os.geteuid() != 0:
        pytest.skip("mounting a file system for the test needs root")
    proc = _run("mount", *args, check=False)
    if proc.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} is not permitted here: {proc.stderr.strip()}")


def _unmount(path):
    if _run("umount", str(path), check=False).returncode != 0:
        _run("umount", "-l", str(path), check=False)  # a process still in it: detach lazily


def _mounted(path) -> bool:
    with open("/proc/mounts") as f:
        return any(line.split()[1] == str(path) for line in f)


@pytest.fixture
def tmpfs(tmp_path):
    """A 16 MiB tmpfs, unmounted whatever happens."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    _mount_or_skip("-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt))
    try:
        yield mnt
    finally:
        _unmount(mnt)
        assert not _mounted(mnt)


class Ext4:
    """An ext4 image on a loop device that the kernel turns read-only on an error."""

    def __init__(self, image, mnt):
        self.image, self.mnt = image, mnt

    def mount(self):
        _mount_or_skip("-o", "loop,errors=remount-ro", str(self.image), str(self.mnt))

    def fail(self):
        """As after an I/O error: the kernel aborts the journal and refuses writes (EROFS)."""
        with open("/proc/mounts") as f:
            device = next(line.split()[0] for line in f if line.split()[1] == str(self.mnt))
        trigger = f"/sys/fs/ext4/{os.path.basename(device)}/trigger_fs_error"
        if not os.path.exists(trigger):
            pytest.skip(f"this kernel has no {trigger} to make ext4 read-only on demand")
        with open(trigger, "w") as f:
            f.write("test: read-only mid-run")
        with pytest.raises(OSError) as refused:
            open(self.mnt / "probe", "w").close()
        assert refused.value.errno == errno.EROFS

    def repair(self):
        """What an operator does: unmount, fsck, mount read-write again."""
        _unmount(self.mnt)
        fsck = _run("e2fsck", "-fy", str(self.image), check=False)
        assert fsck.returncode in (0, 1), fsck.stdout + fsck.stderr  # 1: errors corrected
        self.mount()


@pytest.fixture
def ext4(tmp_path):
    if shutil.which("mkfs.ext4") is None or shutil.which("e2fsck") is None:
        pytest.skip("mkfs.ext4 and e2fsck (e2fsprogs) are needed for a read-only ext4")
    image, mnt = tmp_path / "disk.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 * 2**20)
    _run("mkfs.ext4", "-q", "-F", str(image))
    disk = Ext4(image, mnt)
    disk.mount()
    try:
        yield disk
    finally:
        _unmount(mnt)  # mount -o loop frees its loop device on unmount
        assert not _mounted(mnt)


def fill(mnt) -> str:
    """Take every free byte of the file system at ``mnt``; the filler's path."""
    path = os.path.join(mnt, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        chunk = b"\0" * 2**20
        while True:
            try:
                os.write(fd, chunk)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 4096:
                    break
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)
    return path


@contextlib.contextmanager
def stopped(proc):
    """The process group stopped (SIGSTOP) while the fault is set up, so its
    next checkpoint cannot start before the fault is in place."""
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGCONT)


def listed_checkpoint(model_dir):
    """The newest checkpoint the index lists, and the step it restores (read in full)."""
    import tensorflow as tf

    state = tf.train.get_checkpoint_state(os.path.join(model_dir, "checkpoints"))
    assert state is not None, os.listdir(os.path.join(model_dir, "checkpoints"))
    reader = tf.train.load_checkpoint(state.model_checkpoint_path)
    for name in reader.get_variable_to_shape_map():
        reader.get_tensor(name)  # every tensor readable: nothing truncated
    step = int(reader.get_tensor("completed_steps/.ATTRIBUTES/VARIABLE_VALUE"))
    return os.path.basename(state.model_checkpoint_path), step


def train_cmd(model_dir):
    return [sys.executable, str(REPO / "train.py"), "--strategy=none", *TRAIN,
            "--model-dir", str(model_dir)]


def keep(mnt, name, p):
    """The run's output beside the mount (pytest keeps its last temporary directories)."""
    with open(os.path.join(os.path.dirname(mnt), f"{name}.log"), "w") as f:
        f.write(p.output + "\n")


def errors_in(lines, prefix=""):
    return [l for l in lines if l.startswith(f"{prefix}error:")]


def assert_failed_cleanly(p, code, cause, prefix=""):
    errors = errors_in(p.lines, prefix)
    assert code == Exit.STORAGE and len(errors) == 1, p.output[-4000:]
    assert "Traceback" not in p.output, p.output[-4000:]
    line = errors[0]
    assert cause in line, line
    assert f"could not save the checkpoint at step {2 * EVERY}" in line, line
    assert f"the checkpoint at step {EVERY} is intact" in line, line
    assert f"resume from step {EVERY}" in line, line
    return line


def assert_resumed(p, model_dir, prefix=""):
    assert p.wait(240) == 0, p.output[-4000:]
    assert any(re.match(rf"{re.escape(prefix)}resumed from \S+ckpt-{EVERY} at step {EVERY} "
                        rf"of {STEPS}", l) for l in p.lines), p.output[-4000:]
    r = read_results(model_dir)
    assert r["resumed_from_step"] == EVERY, r
    assert r["completed_steps"] == r["global_steps"] == STEPS, r
    assert r["steps_this_run"] == STEPS - EVERY, r
    assert listed_checkpoint(model_dir) == (f"ckpt-{STEPS}", STEPS)
    assert not any(n.endswith("_temp") for n in os.listdir(os.path.join(model_dir, "checkpoints")))


def _stop_at_first_checkpoint(p):
    p.wait_for_line(rf"^checkpoint saved at step {EVERY}:", 180)
    return stopped(p.proc)


@pytest.mark.timeout(420)
def test_none_full_disk_keeps_the_checkpoint_and_resumes(tmpfs, spawn):
    model_dir = tmpfs / "run"
    p = spawn(train_cmd(model_dir))
    with _stop_at_first_checkpoint(p):
        assert listed_checkpoint(model_dir) == (f"ckpt-{EVERY}", EVERY)
        filler = fill(tmpfs)
    code = p.wait(180)
    keep(tmpfs, "failed", p)
    line = assert_failed_cleanly(p, code, protocol.NO_SPACE)
    assert "ResourceExhaustedError" in line and "Free space on that file system" in line
    # The half-written successor is not the listed one; the previous is whole.
    assert listed_checkpoint(model_dir) == (f"ckpt-{EVERY}", EVERY)
    assert not os.path.exists(model_dir / "results.json")
    os.unlink(filler)
    assert_resumed(spawn(train_cmd(model_dir)), model_dir)
    assert descendants_alive(str(model_dir)) == []


# The long tier: make test keeps the full disk, whose fault takes the same path (CI time)
@pytest.mark.long
@pytest.mark.timeout(420)
def test_none_read_only_mid_run_keeps_the_checkpoint_and_resumes(ext4, spawn):
    model_dir = ext4.mnt / "run"
    p = spawn(train_cmd(model_dir))
    with _stop_at_first_checkpoint(p):
        assert listed_checkpoint(model_dir) == (f"ckpt-{EVERY}", EVERY)
        # On disk, as a checkpoint older than ext4's 5 s commit interval
        # would be: the journal abort below drops what is only in memory.
        os.sync()
        ext4.fail()
    code = p.wait(180)
    keep(ext4.mnt, "failed", p)
    line = assert_failed_cleanly(p, code, protocol.READ_ONLY)
    assert "PermissionDeniedError" in line and "remount it read-write" in line
    assert listed_checkpoint(model_dir) == (f"ckpt-{EVERY}", EVERY)
    ext4.repair()
    assert listed_checkpoint(model_dir) == (f"ckpt-{EVERY}", EVERY)
    assert_resumed(spawn(train_cmd(model_dir)), model_dir)
    assert descendants_alive(str(model_dir)) == []


def _launch(model_dir, *extra):
    return launch_cmd("multiworker", "--workers", "2", "--timeout", "200", "--grace", "3",
                      *extra, train_args=[*TRAIN, "--model-dir", str(model_dir)])


# The long tier: make test keeps the same fault in one process (CI time)
@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.timeout(480)
def test_multiworker_full_disk_is_not_relaunched_and_resumes(tmpfs, spawn):
    """The chief (worker:0) writes into --model-dir, worker:1 into a private
    temporary directory; the launcher's own files (events, outcome.json) are
    on the full disk too."""
    model_dir = tmpfs / "run"
    p = spawn(_launch(model_dir, "--max-restarts", "2"))
    p.wait_for_line(rf"^\[worker:0\] checkpoint saved at step {EVERY}:", 240)
    # The tasks run in the launcher's namespace: not stopped, the disk is
    # filled at once (milliseconds, against the seconds to the next save).
    filler = fill(tmpfs)
    assert listed_checkpoint(model_dir) == (f"ckpt-{EVERY}", EVERY), \
        "the next checkpoint was saved before the disk was full: the test proves nothing"
    code = p.wait(240)
    keep(tmpfs, "failed", p)
    assert code == Exit.STORAGE, p.output[-5000:]
    assert_failed_cleanly(p, code, protocol.NO_SPACE, prefix="[worker:0] ")
    lines = p.lines
    said = [l for l in lines if l.startswith("[launch] worker:0 exited with code 74")]
    assert len(said) == 1, p.output[-5000:]
    assert protocol.NO_SPACE in said[0] and "not relaunched under --max-restarts" in said[0]
    assert not any("relaunching the job" in l for l in lines), p.output[-5000:]
    assert any(l.startswith("[launch] warning: could not write") and "outcome.json" in l
               for l in lines), p.output[-5000:]
    assert "[launch] done: exit code 74" in lines, p.output[-5000:]
    assert listed_checkpoint(model_dir) == (f"ckpt-{EVERY}", EVERY)
    assert descendants_alive(str(model_dir)) == []

    os.unlink(filler)
    again = spawn(_launch(model_dir))
    assert_resumed(again, model_dir, prefix="[worker:0] ")
    assert protocol.LaunchOutcome.load(model_dir / "launch" / "outcome.json").exit_code == 0
    assert descendants_alive(str(model_dir)) == []


# --- TensorFlow itself, on a real full and read-only file system ---------------------------

SAVE_PROBE = """
import os, subprocess, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
from tfdist.training.loop.survival.recovery import storage_cause
d, mode = sys.argv[1], sys.argv[2]
ckpt = tf.train.Checkpoint(v=tf.Variable(tf.zeros([300, 300])))
manager = tf.train.CheckpointManager(ckpt, os.path.join(d, "checkpoints"), max_to_keep=3)
manager.save(checkpoint_number=1)
if mode == "full":
    fd = os.open(os.path.join(d, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"0" * 4096)
    except OSError:
        os.close(fd)
else:
    subprocess.run(["mount", "-o", "remount,ro", d], check=True)  # nothing open for writing
try:
    manager.save(checkpoint_number=2)
except Exception as err:
    print(type(err).__name__, storage_cause(err))
print(tf.train.latest_checkpoint(os.path.join(d, "checkpoints")))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,raised,code", [
    ("full", "ResourceExhaustedError", errno.ENOSPC),
    ("ro", "PermissionDeniedError", errno.EROFS),
])
def test_what_tensorflow_raises_is_classified(tmpfs, mode, raised, code):
    proc = subprocess.run([sys.executable, "-c", SAVE_PROBE, str(tmpfs), mode], cwd=REPO,
                          env=child_env(PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=100)
    out = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(out) == 2, proc.stdout + proc.stderr[-3000:]
    assert out[0].startswith(f"{raised} ({code}, '{tmpfs}/checkpoints/ckpt-2_temp"), out[0]
    assert out[1] == f"{tmpfs}/checkpoints/ckpt-1"  # the failed save is not listed
    if mode == "ro":
        _run("mount", "-o", "remount,rw", str(tmpfs))


@pytest.mark.timeout(180)
def test_launch_on_a_full_disk_is_one_line_and_starts_nothing(tmpfs, spawn):
    """The launcher's own first writes (each task's TF_CONFIG file) fail: one
    line, exit 74, no task started, no traceback."""
    model_dir = tmpfs / "run"
    model_dir.mkdir()
    fill(tmpfs)
    p = spawn(_launch(model_dir, "--max-restarts", "2"))
    code = p.wait(150)
    errors = [l for l in p.lines if l.startswith("[launch] error:")]
    assert code == Exit.STORAGE and len(errors) == 1, p.output[-3000:]
    assert "could not write the launch files" in errors[0] and "No space left" in errors[0]
    assert "nothing was started" in errors[0] and "Traceback" not in p.output
    assert not any(l.startswith("[worker:") for l in p.lines), p.output[-3000:]
    assert descendants_alive(str(model_dir)) == []


# --- parameter servers, and read-only under the launcher --------------------------------

def _launch_kind(kind, model_dir, *extra):
    cluster = ["--workers", "2", *(["--ps", "1"] if kind in ("ps", "ps-sync") else [])]
    return launch_cmd(kind, *cluster, "--timeout", "200", "--grace", "3", *extra,
                      train_args=[*TRAIN, "--model-dir", str(model_dir)])


def _chief_pid(model_dir) -> int:
    """The chief's process, told from the workers' by its TF_CONFIG."""
    from tfdist.linux import live_processes

    for pid, cmd, env in live_processes(environ=True):
        # The launcher starts each task as ``python -m tfdist.cli.train``.
        if str(model_dir) in cmd and "tfdist.cli.train" in cmd and env and any(
                e.startswith(b"TF_CONFIG=") and b'"type": "chief"' in e for e in env):
            return pid
    raise AssertionError(f"no chief process runs with {model_dir}")


@contextlib.contextmanager
def chief_stopped(model_dir):
    """The chief alone stopped while the fault is set up: under ps its steps
    are a few milliseconds, so the next checkpoint could otherwise be saved
    before the fault is in place; the ps and workers just wait for it."""
    pid = _chief_pid(model_dir)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def assert_not_relaunched(p, code, cause):
    assert code == Exit.STORAGE, p.output[-5000:]
    assert_failed_cleanly(p, code, cause, prefix="[chief:0] ")
    lines = p.lines
    said = [l for l in lines if l.startswith("[launch] chief:0 exited with code 74")]
    assert len(said) == 1, p.output[-5000:]
    assert cause in said[0] and "not relaunched under --max-restarts" in said[0], said[0]
    assert not any("relaunching the job" in l for l in lines), p.output[-5000:]
    assert "[launch] done: exit code 74" in lines, p.output[-5000:]


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.timeout(480)
@pytest.mark.parametrize("kind", ["ps", "ps-sync"])
def test_parameter_server_full_disk_is_not_relaunched_and_resumes(kind, tmpfs, spawn):
    """The chief saves, the ps task writes its shard: both on the full disk."""
    model_dir = tmpfs / "run"
    p = spawn(_launch_kind(kind, model_dir, "--max-restarts", "2"))
    p.wait_for_line(rf"^\[chief:0\] checkpoint saved at step {EVERY}:", 240)
    with chief_stopped(model_dir):
        assert listed_checkpoint(model_dir) == (f"ckpt-{EVERY}", EVERY)
        filler = fill(tmpfs)
    code = p.wait(240)
    keep(tmpfs, f"failed-{kind}", p)
    assert_not_relaunched(p, code, protocol.NO_SPACE)
    assert listed_checkpoint(model_dir) == (f"ckpt-{EVERY}", EVERY)
    assert descendants_alive(str(model_dir)) == []

    os.unlink(filler)
    again = spawn(_launch_kind(kind, model_dir))
    assert_resumed(again, model_dir, prefix="[chief:0] ")
    assert descendants_alive(str(model_dir)) == []


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_launched_ps_read_only_mid_run_is_not_relaunched_and_resumes(ext4, spawn):
    model_dir = ext4.mnt / "run"
    p = spawn(_launch_kind("ps", model_dir, "--max-restarts", "2"))
    p.wait_for_line(rf"^\[chief:0\] checkpoint saved at step {EVERY}:", 240)
    with chief_stopped(model_dir):
        assert listed_checkpoint(model_dir) == (f"ckpt-{EVERY}", EVERY)
        os.sync()  # the checkpoint on disk before the journal is aborted
        ext4.fail()
    code = p.wait(240)
    keep(ext4.mnt, "failed-ps-ro", p)
    assert_not_relaunched(p, code, protocol.READ_ONLY)
    assert listed_checkpoint(model_dir) == (f"ckpt-{EVERY}", EVERY)
    assert descendants_alive(str(model_dir)) == []

    ext4.repair()
    assert listed_checkpoint(model_dir) == (f"ckpt-{EVERY}", EVERY)
    again = spawn(_launch_kind("ps", model_dir))
    assert_resumed(again, model_dir, prefix="[chief:0] ")
    assert descendants_alive(str(model_dir)) == []
