"""Checkpoints: where they go, saving them, and resuming with fallback.

A corrupt or half-written checkpoint is skipped for the previous readable
one (with a warning); a checkpoint of another model, or nothing readable at
all, is refused: training from scratch over someone's run would destroy it.

The run directory also holds ``run.json``, the flags that define the run
(written by the chief before its first checkpoint; a resume with other
flags is refused), and ``.lock``, held by the chief for the whole run so
that a second job cannot write into the same directory. Weights that are
NaN or infinite are never saved.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import math
import os
import re
import tempfile

from tfdist import protocol
from tfdist.protocol import ConfigError
from tfdist.training.config import DEFINING_FLAGS
from tfdist.training.loop.survival.recovery import Diverged, first_line, storage_fault

# Checkpoints kept in a run directory (the newest, and two to fall back to).
KEEP = 3


class Checkpointer:
    """Saves the state at a step; only the chief's copy lands in ``--model-dir``.

    Other sync workers must save too (a save may need collectives), into a
    private temporary directory removed by ``close``.
    """

    def __init__(self, state, model_dir: str, is_chief: bool, member: str,
                 run_record: dict | None = None, on_saved=None):
        import tensorflow as tf

        self.state = state
        self.model_dir = model_dir
        self.member = member
        # The defining flags (RunPlan.defining_flags): the chief writes run.json
        # before its first save.
        self.run_record = run_record
        self._recorded = False
        self.chief_dir = os.path.join(model_dir, "checkpoints")
        self.private = not is_chief
        self.dir = self.chief_dir if is_chief else tempfile.mkdtemp(
            prefix=f"ckpt-{member.replace(':', '-')}-")
        self.manager = tf.train.CheckpointManager(state.checkpoint, self.dir, max_to_keep=KEEP)
        self.on_saved = on_saved
        self.saved_at: int | None = None

    def restore(self, model_name: str, total_steps: int | None = None,
                optimizer: str | None = None) -> int:
        """Resume from the chief's newest checkpoint: on a real cluster --model-dir is shared."""
        step = restore_latest(self.state, self.chief_dir, model_name, total_steps, optimizer)
        self.saved_at = step
        return step

    @property
    def resume_step(self) -> int | None:
        """Where a relaunch would resume, as far as this task knows: the
        chief's saves decide it; a task saving into a private directory
        (a multiworker worker) does not know the chief's newest (-1)."""
        return -1 if self.private else self.saved_at

    def save(self, step: int) -> str | None:
        """Save at ``step`` requested steps done (once per step); never non-finite weights.

        Every task checks the same (synchronised) weights, so under all-reduce
        they all stop at the same save instead of one waiting for the others.
        """
        if self.saved_at == step:
            return None
        bad = nonfinite_weights(self.state.model)
        if bad:
            raise Diverged(f"{bad} holds NaN or infinite values", step, self.saved_at,
                           self.model_dir)
        try:
            if not self.private and self.run_record is not None and not self._recorded:
                protocol.write_json_atomic(os.path.join(self.model_dir, RUN_RECORD),
                                           {"schema_version": 1, **self.run_record})
                self._recorded = True
            self.state.completed_steps.assign(step)
            # A sharded state saves whole: its slots gathered for the save's duration.
            with (contextlib.nullcontext() if self.state.sharded is None
                  else self.state.sharded.gathered()):
                path = self.manager.save(checkpoint_number=step)
        except Exception as err:  # pylint: disable=broad-except
            # A full or read-only disk: TensorFlow lists a checkpoint in the
            # index only once its files are complete, so the previous one
            # (saved_at) is still the newest listed; its half-written
            # successor (ckpt-N_temp) is never read, and a later save of the
            # same step writes over it.
            fault = storage_fault(err, f"save the checkpoint at step {step} in {self.dir!r}",
                                  self.member, self.resume_step)
            if fault is None:
                raise
            raise fault from None
        self.saved_at = step
        if self.on_saved is not None and not self.private:
            self.on_saved(step, path)
        return path

    def close(self) -> None:
        if self.private:
            import shutil

            shutil.rmtree(self.dir, ignore_errors=True)


def save_model(model, model_dir: str) -> str | None:
    """``model_dir/model.keras``, whole or not at all: saved beside it and renamed over,
    so a full disk leaves the previous file whole.

    Returns None when saved, or one line saying why Keras could not serialize the
    model (a subclass whose ``__init__`` takes layers and has no ``get_config``: the
    guides' GAN and distiller); ``fit`` never saves, so the run is not failed for it.
    """
    final = os.path.join(model_dir, "model.keras")
    partial = os.path.join(model_dir, f"model.tmp{os.getpid()}.keras")
    try:
        model.save(partial)
        os.replace(partial, final)
        return None
    except OSError:
        _unlink_quietly(partial)
        raise
    except Exception as err:  # pylint: disable=broad-except
        _unlink_quietly(partial)
        return f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def candidates(ckpt_dir: str) -> list[str]:
    """Checkpoint prefixes in ``ckpt_dir``, newest first.

    The ``checkpoint`` index lists what the manager kept; it is written
    (atomically) only after a checkpoint's files are complete, so its newest
    entry is the newest finished checkpoint. Without an index (killed while
    writing the very first one, or the index file itself lost), ``*.index``
    files are the evidence.
    """
    import tensorflow as tf

    try:
        state = tf.train.get_checkpoint_state(ckpt_dir)
    except Exception:  # pylint: disable=broad-except
        state = None
    if state is None and os.path.exists(os.path.join(ckpt_dir, "checkpoint")):
        # TF logs a parse error and returns None: as if there were nothing.
        print(f"warning: the checkpoint index {os.path.join(ckpt_dir, 'checkpoint')!r} is "
              "unreadable; looking at the checkpoint files instead", flush=True)
    if state is not None:
        # TF has already joined relative entries to ckpt_dir.
        listed = list(reversed(state.all_model_checkpoint_paths))
        latest = state.model_checkpoint_path
        if latest not in listed:
            listed.insert(0, latest)
        return listed
    return sorted(
        (p[: -len(".index")] for p in glob.glob(os.path.join(ckpt_dir, "ckpt-*.index"))),
        key=checkpoint_step, reverse=True,
    )


def checkpoint_step(prefix: str) -> int:
    m = re.search(r"-(\d+)$", prefix)
    return int(m.group(1)) if m else -1


def nonfinite_weights(model) -> str | None:
    """The name of the first weight holding NaN or inf, else None.

    One reduction per variable, on the variable's own device (a ps task
    sends back one boolean, not the values): cheap next to the save itself.
    """
    import tensorflow as tf

    for weight in model.weights:
        var = getattr(weight, "_value", weight)  # the tf.Variable behind a Keras variable
        with tf.device(var.device):
            finite = tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(var)))
        if not bool(finite):
            return f"weight {getattr(weight, 'path', None) or weight.name}"
    return None


def restore_latest(state, ckpt_dir: str, model_name: str, total_steps: int | None = None,
                   optimizer: str | None = None) -> int:
    """Resume from the newest readable checkpoint in ``ckpt_dir``; return its step.

    The step is the number of requested steps already done (``completed_steps``;
    ``global_step`` in checkpoints from before it existed). An unreadable
    checkpoint is skipped for the one before it, with a warning; a checkpoint
    of another model, or nothing readable at all, raises ConfigError: training
    from scratch over someone's run would destroy it silently.
    """
    import tensorflow as tf

    found = candidates(ckpt_dir)
    if not found:
        return 0
    unreadable: list[str] = []
    for path in found:
        try:
            keys = tf.train.load_checkpoint(path).get_variable_to_shape_map()
        except Exception as err:  # pylint: disable=broad-except
            unreadable.append(f"{os.path.basename(path)} ({first_line(err, 100)})")
            continue
        has_position = any(k.startswith("completed_steps/") for k in keys)
        root = state.checkpoint if has_position else tf.train.Checkpoint(
            model=state.model, optimizer=state.optimizer, global_step=state.global_step
        )
        try:
            root.restore(path).assert_existing_objects_matched()
        except (AssertionError, ValueError) as err:
            opt = f" --optimizer={optimizer}" if optimizer else ""
            raise ConfigError(
                f"checkpoint {path!r} does not match --task={model_name}{opt}: another "
                f"model or optimizer wrote it ({first_line(err, 100)}); resume with the flags "
                "that wrote it, or pass a fresh --model-dir to start a new run"
            ) from None
        except Exception as err:  # pylint: disable=broad-except
            # A truncated or corrupt data file: OpError (bad checksum),
            # IndexError ("Read less bytes than requested"), and more.
            unreadable.append(f"{os.path.basename(path)} ({first_line(err, 100)})")
            continue
        step = int((state.completed_steps if has_position else state.global_step).numpy())
        if unreadable:
            print(f"warning: skipped unreadable checkpoint(s) {'; '.join(unreadable)}; "
                  f"fell back to {path}", flush=True)
        of = f" of {total_steps}" if total_steps is not None else ""
        # Said at the start, because the default --model-dir (runs/<strategy>)
        # resumes whatever ran there before.
        print(f"resumed from {path} at step {step}{of} (global step "
              f"{int(state.global_step.numpy())}): continuing the run in "
              f"{os.path.dirname(ckpt_dir)!r}; pass a fresh --model-dir to start a new run",
              flush=True)
        return step
    raise ConfigError(
        f"no readable checkpoint in {ckpt_dir!r}: {'; '.join(unreadable)}; "
        "move the directory away to start from scratch, or pass a fresh --model-dir"
    )




# --- the run directory: its defining flags and its lock -------------------------

RUN_RECORD = "run.json"
LOCK = ".lock"


def has_checkpoints(ckpt_dir: str) -> bool:
    return (os.path.exists(os.path.join(ckpt_dir, "checkpoint"))
            or bool(glob.glob(os.path.join(ckpt_dir, "ckpt-*.index"))))


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# Recorded values no single flag sets, named by what sets them (the line must name
# flags that exist).
_RECORDED_AS = {"pipeline_stages": "the pipeline's stage count (the cluster's workers over "
                                   "--pipelines, or --stages)"}


def check_run_record(model_dir: str, flags: dict) -> None:
    """Refuse to resume a run whose defining flags differ from ``flags``.

    Reads only (no TensorFlow): called before anything starts. A run
    directory without checkpoints has nothing to resume; one with
    checkpoints but no ``run.json`` predates the record and is resumed
    unchecked (the restore still refuses another model or optimizer).
    """
    if not has_checkpoints(os.path.join(model_dir, "checkpoints")):
        return
    path = os.path.join(model_dir, RUN_RECORD)
    try:
        with open(path) as f:
            recorded = json.load(f)
        if not isinstance(recorded, dict):
            raise ValueError(f"a JSON {type(recorded).__name__}, not an object")
    except FileNotFoundError:
        return
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"the run record {path!r} is unreadable ({first_line(err, 100)}), so the flags its "
            "checkpoints were made with are unknown; restore it, delete it to resume unchecked, "
            "or pass a fresh --model-dir to start a new run"
        ) from None
    differ = []
    if "data_order" in flags:
        _check_data_order(model_dir, recorded.get("data_order", 1), flags["data_order"])
    for name in DEFINING_FLAGS:
        if name not in recorded:
            continue
        was, now = recorded[name], flags[name]
        same = (math.isclose(was, now, rel_tol=1e-12)
                if isinstance(was, (int, float)) and isinstance(now, (int, float))
                and not isinstance(was, bool) else was == now)
        if not same:
            differ.append(f"{_RECORDED_AS.get(name, '--' + name.replace('_', '-'))} was "
                          f"{_shown(was)}, now {_shown(now)}")
    if differ:
        raise ConfigError(
            f"--model-dir {model_dir!r} holds a run made with other flags, and resuming it would "
            f"mix two runs: {'; '.join(differ)}. Resume with the run's own flags (see "
            f"{RUN_RECORD} there), or pass a fresh --model-dir to start a new run"
        )


def _check_data_order(model_dir: str, was: int, now: int) -> None:
    """Refuse a run whose data was shuffled with another order (a record without
    ``data_order`` predates it: order 1): its remaining epochs would change."""
    if was == now:
        return
    old = " (where --seed values 256 apart gave the same order)" if was == 1 else ""
    raise ConfigError(
        f"--model-dir {model_dir!r} holds a run whose training data was shuffled with order "
        f"{was}{old}; this version shuffles with order {now} and cannot continue its epochs: "
        "finish it with the version that wrote it, or pass a fresh --model-dir to start a "
        "new run"
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """An exclusive lock on ``<model-dir>/.lock``, held by the chief for the whole run.

    ``flock`` is released by the kernel when its holder exits, however it
    exits, so a lock left by a dead process is simply taken over; the pid
    inside only names the holder for the refusal. The file itself stays:
    removing it would let two jobs lock two different files of that name.
    """

    def __init__(self, model_dir: str):
        self.path = os.path.join(model_dir, LOCK)
        self._fd: int | None = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read_pid(fd)
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(
                    f"--model-dir {model_dir!r} is in use by another job (pid "
                    f"{holder if holder is not None else 'unknown'} holds {self.path}); wait for "
                    "it to end, or pass another --model-dir"
                ) from None
            # A file system without locks (some network mounts): say so, go on.
            print(f"warning: cannot lock {self.path} ({err.strerror}); a second job on this "
                  "directory would not be detected", flush=True)
            return
        previous = _read_pid(fd)
        if previous is not None and previous != os.getpid() and not _pid_alive(previous):
            print(f"note: took over the lock {self.path} of pid {previous}, which is no "
                  "longer running", flush=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            # The pid goes with the lock, so the next run's chief only notes a
            # take-over from a holder that died holding it.
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except (OSError, ValueError):
        return None
