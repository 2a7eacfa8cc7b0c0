"""Surviving faults: lost tasks and preemption (checkpoints: ``training.loop.survival.checkpoints``).

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

This module names faults (exception types, and the classification of
TensorFlow's errors into them). Acting on them is elsewhere, one concern
each: ``training/ps/rpc.py`` (fetching a step's results, riding out lost
workers and transient errors), ``training/ps/watchdog.py`` (no step for
``--stuck-timeout``), ``training/sync/preemption.py`` (SIGTERM under the sync
strategies) and ``training/noise.py`` (TensorFlow's log records).
"""

from __future__ import annotations

import errno
import os
import re
import sys

from tfdist import protocol
from tfdist.protocol import Exit
from tfdist.strategies.server import missing_tasks


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


def storage_fault(err: BaseException, what: str | None = None, member: str | None = None,
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
    who = f"{member} " if member else ""
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


def named_in_error(err: BaseException, cluster) -> list[str]:
    """Tasks (other than this one) that a TensorFlow error message names."""
    names = []
    for role, index in _TASK_IN_ERROR.findall(str(err)):
        name = f"{role}:{index}"
        if name != cluster.member_name and name not in names:
            names.append(name)
    return names


_TELLING = re.compile(
    r"Connection refused|Connection reset|failed to connect|Socket closed|recvmsg|"
    r"UNAVAILABLE|unavailable|heartbeat", re.IGNORECASE)


def telling_line(err: BaseException, limit: int = 120) -> str:
    """The line of a gRPC error that says what happened, not "Graph execution error:"."""
    for line in str(err).splitlines():
        line = line.strip()
        if _TELLING.search(line):
            line = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", line)
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return first_line(err, limit)


def task_lost(err: BaseException, cluster, doing: str, step: int | None = None,
              checkpoint_step: int | None = None) -> TaskLost:
    """One line for a gRPC error: which peers are gone, and what to do.

    Reachability is asked of every peer (a TCP connect), because the error
    text names whichever connection noticed first, not necessarily the task
    that died.
    """
    gone = missing_tasks(cluster)
    named = named_in_error(err, cluster)
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
        f"{cluster.member_name} {who} while {doing}{where} ({type(err).__name__}: "
        f"{telling_line(err)}); {resume}"
    )


def is_worker_failure(err: BaseException) -> bool:
    """The errors ClusterCoordinator treats as "worker lost, reschedule"."""
    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc

    return cc._is_worker_failure(err)  # pylint: disable=protected-access


class RpcFailed(TaskLost):
    """An RPC error that is not a lost worker outlived its retries (exit 75).

    A relaunch resumes from the checkpoint, as after a lost task.
    """
