"""Surviving faults: lost tasks and preemption (checkpoints: ``training.checkpoints``).

What a fault looks like from inside a task, and what this module turns it into:

- a peer dies (multi-worker all-reduce, or a ps task / every worker under ps):
  TensorFlow raises a multi-screen gRPC error; ``task_lost`` turns it into a
  ``TaskLost`` whose message is one line naming the unreachable tasks, and
  ``train.py`` exits with ``Exit.TASK_LOST`` so a cluster manager relaunches;
- this task (or a peer, multi-worker) gets SIGTERM: ``PreemptionCheckpointHandler``
  agrees a step with every worker, each saves there, and ``Preempted`` ends
  the run with ``Exit.PREEMPTED``;
- a write into the run directory fails because its disk is full or it became
  read-only: ``storage_fault`` turns the OSError (or TensorFlow's OpError
  around one) into a ``StorageFault``, one line, and ``train.py`` exits with
  ``Exit.STORAGE``: a relaunch cannot help until someone frees space.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sys
import threading
import time

from tfdist import protocol
from tfdist.protocol import Exit
from tfdist.strategies.server import exit_now, missing_tasks, stuck_text


class TaskLost(Exception):
    """A peer task was lost; ``str(err)`` is the one line shown to the user."""


class Preempted(Exception):
    """A checkpoint was saved at an agreed step after a SIGTERM; end the run."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


class Diverged(Exception):
    """The loss or the weights became NaN or infinite; ``str(err)`` is the one line.

    Nothing is saved after it: the newest checkpoint is the last good one.
    """

    def __init__(self, what: str, step: int, checkpoint_step: int | None, model_dir: str):
        kept = (f"the last good checkpoint (step {checkpoint_step}) is kept in "
                f"{os.path.join(model_dir, 'checkpoints')!r}" if checkpoint_step
                else "no checkpoint was saved")
        super().__init__(
            f"training diverged: {what} at step {step}; stopped without saving these weights, "
            f"{kept}. Lower --learning-rate and start again with a fresh --model-dir"
        )
        self.step = step


def first_line(err: BaseException, limit: int = 160) -> str:
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    return first if len(first) <= limit else first[: limit - 3] + "..."


# --- a full or read-only run directory -------------------------------------------------

class StorageFault(Exception):
    """A write into the run directory failed for want of space or of write access.

    ``str(err)`` is the one line shown to the user (``Exit.STORAGE``). The
    checkpoint being written when it happened is never listed in the
    ``checkpoint`` index (TensorFlow writes the index last), so the previous
    one stays the newest a relaunch resumes from.
    """


# errno -> (the cause, in protocol's words; what the user does about it)
_STORAGE_ERRNOS = {
    errno.ENOSPC: (protocol.NO_SPACE, "free space on that file system"),
    errno.EDQUOT: (protocol.NO_SPACE, "free space under your disk quota (or raise it)"),
    errno.EROFS: (protocol.READ_ONLY, "make it writable again (remount it read-write; if the "
                                      "kernel made it read-only after an I/O error, fsck it "
                                      "first)"),
    errno.EACCES: (protocol.NOT_PERMITTED, "give this task write permission there"),
}


def _is_op_error(err: BaseException) -> bool:
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(err, tf.errors.OpError)


def storage_cause(err: BaseException | None) -> tuple[int, str | None] | None:
    """``(errno, path)`` when ``err`` is a write refused for want of space or of
    write access (``path`` None if the error names none), else None.

    Python raises ``OSError``. TensorFlow's file writes (checkpoints, the
    ``checkpoint`` index, TensorBoard events) raise an ``OpError`` whose
    message is ``<path>; <strerror>``; observed with TensorFlow 2.21 on a full
    tmpfs (``ResourceExhaustedError``: "…/ckpt-2_temp/part-….tempstate…; No
    space left on device [Op:SaveV2]") and on a read-only one
    (``PermissionDeniedError``: "…/ckpt-2_temp; Read-only file system").
    The class alone says nothing (``ResourceExhaustedError`` is also an
    out-of-memory tensor), so the C library's text decides. A wrapped error
    (``__cause__``/``__context__``) counts too.
    """
    for _ in range(5):
        if err is None or isinstance(err, StorageFault):
            return None
        if isinstance(err, OSError) and err.errno in _STORAGE_ERRNOS:
            return err.errno, (os.fsdecode(err.filename) if err.filename is not None else None)
        if _is_op_error(err):
            text = str(err)
            for code in _STORAGE_ERRNOS:
                reason = os.strerror(code)
                if reason not in text:
                    continue
                named = re.search(r"([^\s;{}]+); " + re.escape(reason), text)
                return code, named.group(1) if named else None
        err = err.__cause__ or err.__context__
    return None


def _written(path: str | None) -> str:
    """What the run was writing, from the path TensorFlow or Python named."""
    if path is None:
        return "write into the run directory"
    name, parts = os.path.basename(path), path.split(os.sep)
    if name.startswith("results.json"):
        return f"write the results record {path!r}"
    if ".keras" in name:
        return f"write the trained model {path!r}"
    if name.startswith("run.json"):
        return f"write the run record {path!r}"
    if "logs" in parts:
        return f"write TensorBoard logs ({path!r})"
    if "events" in parts:
        return f"append a progress event to {path!r}"
    if "checkpoints" in parts or name.startswith("checkpoint") or name.startswith("ckpt-"):
        return f"save a checkpoint ({path!r})"
    return f"write {path!r}"


def storage_fault(err: BaseException, what: str | None = None, task: str | None = None,
                  checkpoint_step: int | None = -1) -> StorageFault | None:
    """The ``StorageFault`` for ``err``, else None (not a full or read-only disk).

    ``what``: what was being written (default: told from the path in the
    error); ``checkpoint_step``: the newest checkpoint saved before it
    (0 or None: none yet; -1: unknown here).
    """
    cause = storage_cause(err)
    if cause is None:
        return None
    code, path = cause
    why, fix = _STORAGE_ERRNOS[code]
    what = what or _written(path)
    who = f"{task} " if task else ""
    where = f" on {path!r}" if path and path not in what else ""
    if checkpoint_step == -1:
        kept = "the newest checkpoint listed in the run directory's checkpoint index is intact"
        resume = "resume from it"
    elif checkpoint_step:
        kept = f"the checkpoint at step {checkpoint_step} is intact"
        resume = f"resume from step {checkpoint_step}"
    else:
        kept, resume = "no checkpoint was saved yet", "start again"
    return StorageFault(
        f"{who}could not {what}: {why} ({type(err).__name__}{where}); {kept}. {fix[0].upper()}"
        f"{fix[1:]}, then relaunch with the same --model-dir to {resume} (exit "
        f"{int(Exit.STORAGE)}: a relaunch alone would fail again)"
    )


# --- tasks that disagree on the cluster -------------------------------------------

_GROUP_SIZE = re.compile(r"(Device \S+ is joining a group with size ?\d+, but that group has "
                         r"size \d+)")


def cluster_disagreement(err: BaseException) -> str | None:
    """The ``error:`` text when TensorFlow found tasks with different clusters, else None.

    Each task only sees its own TF_CONFIG, so this surfaces at the first
    collective, in TensorFlow's words (the group sizes differ).
    """
    found = _GROUP_SIZE.search(str(err))
    if found is None:
        return None
    return (f"the tasks disagree on the cluster: TensorFlow says \"{found.group(1)}\"; give "
            "every task the same TF_CONFIG \"cluster\" (only \"task\" differs)")


# --- lost tasks ---------------------------------------------------------------

_TASK_IN_ERROR = re.compile(r"/job:(chief|worker|ps)/replica:\d+/task:(\d+)")


def named_in_error(err: BaseException, cfg) -> list[str]:
    """Tasks (other than this one) that a TensorFlow error message names."""
    names = []
    for role, index in _TASK_IN_ERROR.findall(str(err)):
        name = f"{role}:{index}"
        if name != cfg.task_name and name not in names:
            names.append(name)
    return names


_TELLING = re.compile(
    r"Connection refused|Connection reset|failed to connect|Socket closed|recvmsg|"
    r"UNAVAILABLE|unavailable|heartbeat", re.IGNORECASE)


def _telling_line(err: BaseException, limit: int = 120) -> str:
    """The line of a gRPC error that says what happened, not "Graph execution error:"."""
    for line in str(err).splitlines():
        line = line.strip()
        if _TELLING.search(line):
            line = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", line)
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return first_line(err, limit)


def task_lost(err: BaseException, cfg, doing: str, step: int | None = None,
              checkpoint_step: int | None = None) -> TaskLost:
    """One line for a gRPC error: which peers are gone, and what to do.

    Reachability is asked of every peer (a TCP connect), because the error
    text names whichever connection noticed first, not necessarily the task
    that died.
    """
    gone = missing_tasks(cfg)
    named = named_in_error(err, cfg)
    if gone:
        who = "lost " + ", ".join(gone)
    elif named:
        who = f"lost contact with {', '.join(named)}"
    else:
        who = "a peer failed"
    where = f" at step {step}" if step is not None else ""
    resume = (
        f"relaunch the same command to resume from the checkpoint at step {checkpoint_step}"
        if checkpoint_step else "relaunch the same command to start again"
    )
    return TaskLost(
        f"{cfg.task_name} {who} while {doing}{where} ({type(err).__name__}: "
        f"{_telling_line(err)}); {resume}"
    )


def is_worker_failure(err: BaseException) -> bool:
    """The errors ClusterCoordinator treats as "worker lost, reschedule"."""
    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc

    return cc._is_worker_failure(err)  # pylint: disable=protected-access


class RpcFailed(TaskLost):
    """An RPC error that is not a lost worker outlived its retries (exit 75).

    A relaunch resumes from the checkpoint, as after a lost task.
    """


# An error on the chief's schedule/fetch path that TensorFlow does not take
# for a lost worker, but that a retry may cure: gRPC INTERNAL (status 13,
# e.g. "Unable to parse request" while copying a finished closure's outputs)
# and UNKNOWN. Retried TRANSIENT_RETRIES times, waiting TRANSIENT_BACKOFF s,
# then twice that, ...; then the chief ends with one line and exit 75.
TRANSIENT_RETRIES = 3
TRANSIENT_BACKOFF = 0.5


def is_transient(err: BaseException) -> bool:
    import tensorflow as tf

    return isinstance(err, (tf.errors.InternalError, tf.errors.UnknownError))


def fetch(remote, deadline: float, retry_every: float = 0.2, *, task: str = "chief",
          retries: int = TRANSIENT_RETRIES, backoff: float = TRANSIENT_BACKOFF,
          sleep=time.sleep, log=None, worker_failure=None, transient=None):
    """``remote.fetch()``, riding out the loss of the worker that ran it, and
    a few transient RPC errors.

    The coordinator puts a lost worker's closure back on the queue and runs it
    elsewhere, but ``RemoteValue.fetch`` can still raise: the closure may have
    finished, and the copy of its outputs from the dead worker fails. The
    rerun sets fresh outputs on the same RemoteValue, so fetching again works.

    Any other error that ``transient`` accepts (``is_transient``) is retried
    ``retries`` times with a doubling ``backoff``, each retry logged in one
    line: a failed copy of the outputs is tried afresh (``RemoteValue.get``
    copies again until one copy succeeds). Past that, ``RpcFailed``: one line,
    exit 75, never a traceback. ``worker_failure``/``transient``/``sleep``/
    ``log`` are for tests.
    """
    worker_failure = worker_failure or is_worker_failure
    transient = transient or is_transient
    log = log or (lambda line: print(line, flush=True))
    failures = 0
    while True:
        try:
            return remote.fetch()
        except Exception as err:  # pylint: disable=broad-except
            if worker_failure(err):
                if time.monotonic() > deadline:
                    raise
                sleep(retry_every)
                continue
            if not transient(err):
                raise
            failures += 1
            what = f"{type(err).__name__}: {_telling_line(err)}"
            if failures > retries:
                raise RpcFailed(
                    f"{task}: fetching a finished step's results failed {failures} times "
                    f"({what}), not a lost worker; relaunch the same command to resume "
                    "from the newest checkpoint") from None
            wait = backoff * 2 ** (failures - 1)
            log(f"warning: {task}: fetching a step's results failed ({what}); "
                f"retry {failures} of {retries} in {wait:g}s")
            sleep(wait)


class StallWatchdog:
    """Ends the chief with one line if no step completes for ``timeout`` s
    (``--stuck-timeout``), naming the stuck and the unreachable tasks.

    With every worker gone, or a worker or ps task alive but stopped, the
    coordinator and ps:0 wait inside calls that have no timeout of their
    own. ``grace`` more seconds leave a trainer that handles a stall itself
    (ps: rerunning a stuck worker's steps elsewhere) the first move.
    Paused while the chief does work of its own (``paused()``: evaluating).
    """

    def __init__(self, cfg, timeout: float, exit_code: int = Exit.TASK_LOST,
                 grace: float = 0.0):
        self.cfg, self.timeout, self.exit_code = cfg, timeout, exit_code
        self.grace = grace
        self._last = time.monotonic()
        self._paused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="StallWatchdog", daemon=True)
        self._thread.start()

    def progress(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.progress()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            if not self._paused and time.monotonic() - self._last > self.timeout + self.grace:
                # The main thread is blocked inside TensorFlow: only a hard exit ends it.
                exit_now(self.exit_code, (
                    f"error: {self.cfg.task_name}: no training step completed for "
                    f"{self.timeout:g}s (--stuck-timeout); {stuck_text(self.cfg)}. "
                    "Restart or replace the stuck or lost tasks, or relaunch the job to "
                    "resume from its checkpoint"
                ))


class _OneLine(logging.Filter):
    """Clips TensorFlow's multi-screen gRPC log records to their first line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "tf_function_save" in message:
            # Saving ps-held variables retraces TF's internal save function
            # every time; the retracing warning is about TF, not this program.
            return False
        if "\n" in message or len(message) > 300:
            record.msg, record.args = first_line(Exception(message), 300), None
        return True


def condense_tf_logs() -> None:
    import tensorflow as tf

    logger = tf.get_logger()
    if not any(isinstance(f, _OneLine) for f in logger.filters):
        logger.addFilter(_OneLine())
    if logger.handlers:
        logger.propagate = False  # else the root logger prints every record again


# --- preemption -----------------------------------------------------------------

def preemption_handler(strategy, save, step_now):
    """A PreemptionCheckpointHandler that saves with ``save`` and raises Preempted.

    (None off the main thread, where no SIGTERM handler can be installed.)

    On SIGTERM to any worker, every worker saves at the same agreed call and
    then ``Preempted`` ends the run, so none is left waiting in a collective.
    TensorFlow restores its call counter from its own checkpoint manager; we
    give it an empty private directory so every worker counts from 0 in every
    run and they agree on the call number (ours restore from the chief's).
    """
    import tempfile

    import tensorflow as tf

    if threading.current_thread() is not threading.main_thread():
        return None  # signal handlers can only be installed from the main thread
    quiet_watcher_deaths()
    counter_dir = tempfile.mkdtemp(prefix="preemption-")
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(), counter_dir, max_to_keep=1)

    def exit_fn():
        raise Preempted(step_now())

    config = tf.distribute.experimental.TerminationConfig(
        exit_fn=exit_fn, save_fn=save, grace_period=0,
    )
    handler = tf.distribute.experimental.PreemptionCheckpointHandler(
        getattr(strategy, "cluster_resolver", None), manager, termination_config=config,
    )
    return _Handler(handler, counter_dir)


def _from_failure_handling(tb) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(os.path.join("failure_handling",
                                                                "failure_handling.py")):
            return True
        tb = tb.tb_next
    return False


def quiet_watcher_deaths() -> None:
    """TensorFlow's preemption watcher threads die with a traceback when the
    coordination service's host is gone (a peer lost, or this task stopped
    and continued after its peers gave up on it); the task's own error line
    says what happened, so such a death is one warning line."""
    previous = threading.excepthook
    if getattr(previous, "quiet_watcher_deaths", False):
        return

    def hook(args):
        import tensorflow as tf

        if isinstance(args.exc_value, tf.errors.OpError) and _from_failure_handling(
                args.exc_traceback):
            print(f"warning: TensorFlow's preemption watcher stopped: "
                  f"{type(args.exc_value).__name__}: {first_line(args.exc_value)}", flush=True)
            return
        previous(args)

    hook.quiet_watcher_deaths = True
    threading.excepthook = hook


class _Handler:
    """``run`` without the deprecation warning TF's own save path triggers.

    (The handler reads its deprecated ``total_run_calls`` when it saves.)
    """

    def __init__(self, handler, counter_dir: str):
        self.handler, self.counter_dir = handler, counter_dir

    def run(self, fn, *args):
        from tensorflow.python.util import deprecation

        with deprecation.silence():
            return self.handler.run(fn, *args)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the handler's watcher threads after a normal end of training.

        TF leaves that to ``__del__``, which never runs while the watcher
        thread holds the handler; the thread then dies with a traceback when
        the coordination service's host (the chief) exits first. Bounded, in
        case a peer is already gone.
        """
        def stop():
            try:
                self.handler._stop_cluster_wise_termination_watcher_thread()  # pylint: disable=protected-access
                self.handler._stop_poll_termination_signal_thread()  # pylint: disable=protected-access
            except Exception:  # pylint: disable=broad-except
                pass

        stopper = threading.Thread(target=stop, daemon=True)
        stopper.start()
        stopper.join(timeout)
