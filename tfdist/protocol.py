"""What the processes of a job tell each other and their callers; no TensorFlow.

``train.py`` writes it, the launcher and the benchmark (``bench/``, the soak too) read it:

- **exit codes**, each defined once, and which of them mean "relaunch me";
- **progress events**: one JSON object per line, appended to the file named
  by ``$SHOWCASE_EVENTS`` (the launcher sets one per task). Human-readable
  progress lines stay on stdout for people; programs read these instead;
- **the results record** (``results.json``), typed and versioned;
- **bad input**: ``ConfigError``, the one-line error every module raises
  (``strategies``, ``training``, the launcher and the benchmark import it
  from here, so none of them imports another for it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class Exit(IntEnum):
    OK = 0
    FAILED = 1  # an unexpected error: a bug, or a fault nobody handled
    BAD_INPUT = 2  # flags, TF_CONFIG, data or run directory: nothing was started
    PREEMPTED = 42  # SIGTERM: a checkpoint was saved at an agreed step (TF's own choice)
    DIVERGED = 65  # EX_DATAERR: the loss or weights became NaN/inf; the last good checkpoint is kept
    EXPORT = 73  # EX_CANTCREAT: --export could not write a SavedModel that serves what the model predicts; training's outputs kept
    STORAGE = 74  # EX_IOERR: a write into --model-dir failed, the disk full or read-only; not relaunched
    TASK_LOST = 75  # EX_TEMPFAIL: a peer was lost or never came, or RPCs kept failing
    TIMEOUT = 124  # the launcher stopped a job that ran past --timeout (as timeout(1))
    INTERRUPTED = 130  # Ctrl-C (SIGINT)
    TERMINATED = 143  # SIGTERM to the launcher: it stopped every task


# Codes after which relaunching the same command resumes from the checkpoint.
RELAUNCH = frozenset({Exit.PREEMPTED, Exit.TASK_LOST})

EXIT_MEANINGS = {
    Exit.OK: "success",
    Exit.FAILED: "unexpected error (a traceback says where)",
    Exit.BAD_INPUT: "bad input: one error line, nothing started or written",
    Exit.PREEMPTED: "preempted: checkpoint saved, relaunch to resume",
    Exit.DIVERGED: "training diverged (non-finite loss or weights): stopped, last good checkpoint kept",
    Exit.EXPORT: "--export failed: the model cannot be exported as a SavedModel, or the "
                 "reloaded SavedModel predicts otherwise; results.json, checkpoints and "
                 "model.keras are kept",
    Exit.STORAGE: "a write into --model-dir failed (disk full, read-only or not permitted): the "
                  "previous checkpoint is kept; free space or make it writable, then relaunch",
    Exit.TASK_LOST: ("a peer task was lost, stuck (alive, answering nothing) past "
                     "`--stuck-timeout`, never came, or its RPCs kept failing: relaunch to resume"),
    Exit.TIMEOUT: ("launcher: the job ran past the --timeout given (there is none by default) "
                   "and was stopped"),
    Exit.INTERRUPTED: "interrupted (Ctrl-C)",
    Exit.TERMINATED: "launcher: SIGTERM; every task was stopped",
}


def exit_epilog(codes=None) -> str:
    """The exit codes for ``--help``, one a line (``codes``: those the command may end with)."""
    import textwrap

    shown = {c: m for c, m in EXIT_MEANINGS.items() if codes is None or c in codes}
    return "exit codes:\n" + "\n".join(
        textwrap.fill(f"  {int(c):>3} {m.replace('`', '')}", width=79, subsequent_indent=" " * 6)
        for c, m in shown.items())


# Where a run writes when no --model-dir is given: train.py, launch.py and the
# Python API alike (the strategy as resolved: ``auto`` is named by what it chose).
def default_model_dir(strategy: str) -> str:
    return os.path.join("runs", strategy)


# Why a write into the run directory failed: ``train.py``'s ``error:`` line
# (exit STORAGE) names one of these, and the launcher repeats it.
NO_SPACE = "no space left on the device"
READ_ONLY = "the file system is read-only"
NOT_PERMITTED = "permission denied"
STORAGE_CAUSES = (NO_SPACE, READ_ONLY, NOT_PERMITTED)


# --- command lines -----------------------------------------------------------

class ConfigError(ValueError):
    """Bad user input. ``str(err)`` is the one line shown to the user (exit 2)."""


class UsageError(Exception):
    """A bad command line: the caller prints ``error: <it>`` and exits 2."""


# --- progress events ---------------------------------------------------------

EVENTS_ENV = "SHOWCASE_EVENTS"
# The launcher's elastic membership (``--min-workers``): the path of a JSON
# file it keeps current, a list of {"step", "workers", "why"} from step 0;
# the chief copies it into results.json (``membership``) when it writes them.
MEMBERSHIP_ENV = "TFDIST_MEMBERSHIP"


def membership_from_env() -> list | None:
    """The membership the launcher gave this task, or ``None`` (not elastic, or unreadable)."""
    path = os.environ.get(MEMBERSHIP_ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, list) else None

# Event kinds, in the order a run emits them.
STARTED = "started"  # the first step ran: every peer is connected; data: resumed_from, pid
PROGRESS = "progress"  # a progress line was printed (step = steps completed)
EVAL = "eval"
CHECKPOINT = "checkpoint"  # a checkpoint holding ``step`` completed steps is on disk
PREEMPTED = "preempted"  # step: the checkpoint saved; data: resumed_from, pid (this process)
LOST = "lost"
DIVERGED = "diverged"  # a non-finite loss or weights stopped the run (nothing saved after)
DONE = "done"  # this task finished its part (the chief: results written)
# A peer found alive but answering nothing for --stuck-timeout (data: peer,
# "worker:1"); a cluster manager (launch.py --restart-tasks) may restart it.
STUCK = "stuck"
EVENT_KINDS = (STARTED, PROGRESS, EVAL, CHECKPOINT, PREEMPTED, LOST, DIVERGED, DONE, STUCK)


@dataclass(frozen=True)
class Event:
    kind: str
    member: str  # "chief:0", "worker:1", ...
    step: int | None = None
    time: float = 0.0
    data: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, line: str) -> "Event":
        raw = json.loads(line)
        if not isinstance(raw, dict) or raw.get("kind") not in EVENT_KINDS:
            raise ValueError(f"not a progress event: {line[:120]!r}")
        # "task": the member's key in files written before it was named "member".
        member = raw.get("member", raw.get("task", ""))
        return cls(kind=raw["kind"], member=str(member), step=raw.get("step"),
                   time=float(raw.get("time", 0.0)), data=dict(raw.get("data") or {}))


class EventLog:
    """Appends this task's events to ``$SHOWCASE_EVENTS``; does nothing when unset."""

    def __init__(self, member: str, path: str | None = None):
        self.member = member
        self.path = path if path is not None else os.environ.get(EVENTS_ENV) or None

    def emit(self, kind: str, step: int | None = None, **data: Any) -> None:
        if self.path is None:
            return
        event = Event(kind, self.member, step, time.time(), _finite(data))
        # One write of one line with O_APPEND: readers never see half an event
        # from another writer, and a partial last line only while it is written.
        with open(self.path, "a") as f:
            f.write(event.to_json() + "\n")


def _finite(data: dict) -> dict:
    """JSON has no NaN or infinity: such a value is reported as None."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in data.items()}


class EventReader:
    """Reads the events appended to one file since the last call."""

    def __init__(self, path: str):
        self.path = path
        self._offset = 0
        self._partial = ""

    def read(self) -> list[Event]:
        try:
            with open(self.path) as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return []
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()  # "" after a complete line
        events = []
        for line in lines:
            if line.strip():
                try:
                    events.append(Event.from_json(line))
                except ValueError:
                    continue  # not ours: a reader must never die on a stray line
        return events


def events_path(launch_dir: str, member: str) -> str:
    return os.path.join(launch_dir, "events", f"{member.replace(':', '-')}.jsonl")


def read_all_events(path: str) -> list[Event]:
    return EventReader(path).read()


# --- the results record ---------------------------------------------------------

SCHEMA_VERSION = 1  # the launcher's outcome record
# results.json. 2: ``model`` is gone (it held the task's name, as ``task`` does); a
# version-1 record is read with its ``model`` as ``task`` where ``task`` is missing.
RESULTS_SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)


@dataclass(frozen=True)
class Results:
    """``results.json``: what one run of the chief did.

    Strategy-specific figures are ``None`` where they do not apply (the
    asynchronous ps ones under a synchronous strategy).
    """

    strategy: str
    optimizer: str
    learning_rate: float | None  # None: a task's own optimizer whose rate is not a number
    lr_schedule: str
    num_workers: int
    num_ps: int
    replicas_in_sync: int
    global_batch_size: int
    steps_per_execution: int
    seed: int
    global_steps: int  # the step counter in the model's variables
    completed_steps: int  # requested steps done, this run and before it
    steps_this_run: int
    resumed_from_step: int
    steps_per_worker: dict | None  # None: ps:0 did not answer when asked (ps)
    startup_seconds: float
    train_seconds: float
    steady_steps: int
    examples_per_sec: float
    wall_seconds: float
    eval_curve: list
    eval_seconds: float
    test_accuracy: float | None  # None for a task without an accuracy metric
    test_loss: float | None  # None: not evaluated (Keras's evaluate cannot run on the model)
    weights_sha256: str
    tf_version: str
    keras_version: str
    # multiworker: each step's all-reduce partly carried under the next
    # step's first layers (--carry-all-reduce; training.sync.carried).
    all_reduce_carried: bool | None = None
    # --carry-all-reduce auto: each step's time per step, and the choice.
    carry_trial: dict | None = None
    # Asynchronous parameter servers.
    scheduled_steps: int | None = None
    applied_steps: int | None = None
    reexecuted_steps: int | None = None
    staleness: dict | None = None
    # Workers read each step's weights during the step before it
    # (--read-ahead): every step but a call's first is at least 1 stale.
    read_ahead: bool | None = None
    variables_per_ps: dict | None = None
    # Synchronous parameter servers (ps-sync); this run's counts.
    replicas_to_aggregate: int | None = None  # K, gradients averaged per update
    aggregated_gradients: int | None = None  # = K x applied_steps
    stale_gradients_dropped: int | None = None  # computed on older weights, never applied
    # Accepted gradients whose worker saw the step move while computing
    # them: measured, and 0 by construction.
    stale_gradients_applied: int | None = None
    # Times the chief gave a worker the current step's token again after
    # an update waited REISSUE_AFTER seconds (ps-sync; 0 in a healthy run).
    tokens_reissued: int | None = None
    # {worker: {"accepted", "dropped", "skipped", "computed", "pending"}};
    # skipped: tokens already stale when taken (no gradient computed);
    # pending: computed but not yet looked at by the ps when the run ended.
    gradients_per_worker: dict | None = None
    update_interval: dict | None = None  # seconds between applied updates, on the ps
    # ps, ps-sync: workers found stuck (alive, answering nothing) for
    # --stuck-timeout: [{"worker", "at_step", "waited_seconds",
    # "rerouted_steps" (ps: the stuck call's steps rerun elsewhere),
    # "came_back" (its stuck call ended before the run did), "steps_after"
    # (steps it ran after being found stuck, the stuck call's included),
    # "outcome": "rejoined" | "left out"}]; [] when none was.
    stuck_workers: list | None = None
    # ps: steps applied by calls whose results (loss, metrics, staleness) a
    # worker that stopped right after the call held; counted, not reported.
    unfetched_steps: int | None = None
    # The task: its name, every compiled metric on the whole test split, the splits' sizes.
    task: str | None = None
    test_metrics: dict | None = None
    train_examples: int | None = None  # None: a streamed (infinite or unknown) split
    test_examples: int | None = None
    # Parameter servers: bytes of variables and optimizer slots each ps holds.
    ps_variable_bytes: dict | None = None
    # This process's (the chief's) peak resident memory in bytes; the launcher's
    # outcome.json has every task's (peak_rss_bytes there).
    peak_rss_bytes: int | None = None
    # Synchronous strategies: --shard-state (off: every worker holds the whole state),
    # and per worker the bytes of training state it holds at once ({"weights",
    # "gradients", "slots"}) beside its peak resident memory as of the last drain.
    shard_state: str | None = None
    state_bytes: dict | None = None
    peak_rss_bytes_per_worker: dict | None = None
    # What crosses the network each step: the trainable parameters (their
    # float32 weights are read) and the dtype gradients travel in
    # (--gradient-dtype); the bench's traffic model starts from them.
    trainable_params: int | None = None
    gradient_dtype: str | None = None
    # Batches per step whose gradients a replica sums before one update
    # (--gradient-accumulation-steps): examples per step are the global batch x this.
    gradient_accumulation_steps: int = 1
    # --export: the last SavedModel written and checked (training.loop.export):
    # {"path": DIR/<global step>, "signature": {"inputs", "outputs"}: {name:
    # {"dtype", "shape"}}, "max_abs_diff" (reloaded vs trained predictions on
    # a test batch), "tolerance", "seconds" (export and check), "check_seconds"
    # (the fresh process reloading it), "bytes"}.
    export: dict | None = None
    # --strategy pipeline: stages, micro-batches, copies, the cut, and each
    # worker's parameter and optimizer-state bytes (training.pipeline.pipeline_trainer).
    pipeline: dict | None = None
    # launch.py --min-workers: the cluster's size from step 0, each change
    # with the step it resumed from and why: [{"step", "workers", "why"}].
    membership: list | None = None
    # How the final evaluation ran (training.loop.evaluation): {"split", "where":
    # "members" (each training member evaluated its range of the split's batches,
    # the metrics' states summed), "workers" (ps: "shards" closures on the
    # workers, each merged once) or "chief", "members" (how many), "batch_size",
    # "examples", "examples_per_member": {member: examples}, "shards" made (and
    # "shards_asked" when fewer were made), "seconds" (the pass), "prepared_seconds"
    # (its preparation, ahead in the startup), "batch_seconds_per_member" and
    # "all_reduce_seconds" when shared, and "alone_because" when the members could
    # not share it}.
    evaluation: dict | None = None
    # The sidecar evaluator's history (training.sidecar): {"member", "split",
    # "examples", "evaluations": [{"step", "seconds", "val_<metric>"...}]}, added
    # by the evaluator after the chief's own write; None: no evaluator finished.
    sidecar_evaluation: dict | None = None
    # A task's extra_results(), written at the top level beside the fields above.
    extra: dict = field(default_factory=dict)
    schema_version: int = RESULTS_SCHEMA_VERSION

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        extra = out.pop("extra")
        # A task's own figures never replace the library's.
        out.update({k: v for k, v in extra.items() if k not in out})
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Results":
        version = data.get("schema_version")
        if version not in READABLE_SCHEMA_VERSIONS:
            raise ValueError(
                f"results schema_version {version!r}, this code reads "
                f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}"
            )
        if version == 1:  # its "model" held the task's name
            model = data.get("model")
            data = {k: v for k, v in data.items() if k != "model"}
            data["task"] = data.get("task") or model
        data = {**data, "schema_version": RESULTS_SCHEMA_VERSION}
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**{k: v for k, v in data.items() if k in names}, extra=extra)

    def write(self, path: str) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str) -> "Results":
        with open(path) as f:
            return cls.from_dict(json.load(f))


def write_json_atomic(path: str, data: dict) -> None:
    """Readers see the old file or the new one, never half of one."""
    text = json.dumps(data, indent=2, sort_keys=True, allow_nan=False)  # raises before any write
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
    except OSError:
        # A full disk: no half-written temporary file left beside the old one.
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@dataclass(frozen=True)
class LaunchOutcome:
    """``<model-dir>/launch/outcome.json``: what the launcher did to a job."""

    exit_code: int
    faults_fired: list
    task_restarts: int
    job_relaunches: int
    schema_version: int = SCHEMA_VERSION
    # Optional, added later (readers of older files get None): each computing
    # task's {"steps", "share", "steps_per_sec"} from its progress events;
    # under --hosts each task's host; under --link-rate the measured link;
    # the --slow flags applied; each fault fired ({"kind", "target",
    # "at_seconds", "at_step"; for a kill or preempt also the "attempt" and
    # "pid" it hit and, once known, "target_ran": the steps that process had
    # run; for a hang or partition "lift_after",
    # "lifted_at_seconds", "lifted_by": "schedule", "launcher cleanup" or
    # "task gone").
    per_task: dict | None = None
    hosts: dict | None = None
    link: dict | None = None
    slowed: list | None = None
    faults: list | None = None
    # Under --hosts: each host's bytes sent and received over the job (its
    # veth's counters at start and end, headers included) and per step of
    # the chief's final run, with its TCP retransmissions and its shapers'
    # drops over the job (launcher.machine.traffic.measured_record).
    traffic: dict | None = None
    # Each task's peak resident memory in bytes, the largest over its restarts
    # and the job's relaunches (launcher.machine.memory: sampled at every poll).
    peak_rss_bytes: dict | None = None
    # --memory-limit: each limited task's {"limit_bytes", "max_usage_bytes"} (the
    # most its memory cgroup was charged), and those the kernel's OOM killer
    # ended (how many times).
    memory_limits: dict | None = None
    oom_killed: dict | None = None
    # --restart-tasks: how many times each restarted task was restarted.
    restarts_per_task: dict | None = None
    # --min-workers: each formation of the cluster ({"step", "workers",
    # "why", "members", and after a change "last_step_before" (the last step
    # a task reported before it), "steps_redone_at_least" and
    # "first_step_after_seconds": from the loss or return to its first step).
    membership: list | None = None
    # --host-cpus: each simulated host's {"cores" (its budget), "members",
    # "cpu_seconds" (the CPU time its members used over the job),
    # "throttled_seconds" (how long its quota held them back)}.
    host_cpus: dict | None = None
    # Seconds from the launcher starting the members to the first one's first
    # step (its "started" event), the launcher's own CPU time over the job, and
    # the job's wall time (members started to the last attempt's end,
    # relaunches included).
    first_step_seconds: float | None = None
    launcher_cpu_seconds: float | None = None
    job_seconds: float | None = None
    # --evaluator: each sidecar evaluator's {"status": "finished", "failed",
    # "killed" or "stopped" (by the launcher, still running), "exit_code"} in
    # the last attempt; never part of the job's exit code.
    evaluators: dict | None = None

    def write(self, path: str) -> None:
        write_json_atomic(path, dataclasses.asdict(self))

    @classmethod
    def load(cls, path: str) -> "LaunchOutcome":
        with open(path) as f:
            data = json.load(f)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
