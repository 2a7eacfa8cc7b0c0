"""The parameter-server trainer: the chief schedules, workers compute, ps hold.

``train(n)`` schedules one closure of ``n`` steps on whichever worker is
free, keeping a bounded window of closures in flight and reading their
results as they complete (for progress and staleness); ``drain()`` waits
until every scheduled step is applied (the controller asks for it before a
checkpoint, an evaluation and the end).

Faults: a lost worker's closures are rerun by the coordinator on the others
(a closure may run twice: ``reexecuted_steps``); a stuck worker's (alive,
answering nothing for ``--stuck-timeout``) is scheduled again by us, since
no RPC of its fails (``stuck_workers`` in the results); a lost or stuck ps
task, or no worker left for ``--stuck-timeout``, ends the chief with one
line; a SIGTERM asks the controller to finish what was scheduled,
checkpoint and end with Preempted.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import signal
import threading
import time

import keras
import numpy as np
import tensorflow as tf
# Not exported by tf.distribute, but what the coordinator raises for a lost task.
from tensorflow.python.distribute.coordinator.cluster_coordinator import (
    ClosureAbortedError, ClosureInputError,
)

from tfdist import protocol
from tfdist.protocol import Exit
from tfdist.strategies.server import CallGuard, exit_now, peer_states, states_text
from tfdist.training import data
from tfdist.training.recovery import StallWatchdog, condense_tf_logs, fetch
from tfdist.training.sharding import ps_variable_bytes
from tfdist.training.step import make_step_fn, make_train_fn, metric_dict
from tfdist.training.sync_trainer import PEER_ERRORS
from tfdist.training.trainer import Trainer

# Besides gRPC errors, the coordinator wraps a lost task's errors in these.
PS_PEER_ERRORS = PEER_ERRORS + (ClosureInputError, ClosureAbortedError)


def staleness_stats(values) -> dict:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0, "histogram": {}}
    return {
        "count": int(arr.size),
        "mean": round(float(arr.mean()), 4),
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
        "max": int(arr.max()),
        # {staleness: how many updates}, for the benchmark's histogram.
        "histogram": {str(int(v)): int(c) for v, c in zip(*np.unique(arr, return_counts=True))},
    }


def variables_per_ps(model: keras.Model) -> dict[str, int]:
    """How many variables each ps task holds."""
    counts: collections.Counter = collections.Counter()
    for weight in model.weights:
        var = getattr(weight, "_value", weight)  # the tf.Variable behind a Keras variable
        spec = tf.DeviceSpec.from_string(var.device)
        counts[f"{spec.job}:{spec.task}"] += 1
    return dict(sorted(counts.items()))


def read_counts(steps_by_worker, timeout: float = 2.0) -> list[int] | None:
    """Each worker's step count, or None when ps:0 does not answer in time.

    The counts live on ps:0, so a slowed or lost worker cannot hold the read
    up; a lost ps could, and a daemon thread with a timeout keeps progress
    lines and the final results from waiting on it.
    """
    box: list = []

    def read():
        try:
            box.append([int(c) for c in steps_by_worker.numpy()])
        except Exception:  # pylint: disable=broad-except
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else None


class StopOnSigterm:
    """SIGTERM (a polite preemption) asks the chief to stop at the next drain.

    Whatever has been scheduled is finished and checkpointed before the run
    ends with Preempted, so a relaunch loses no step.
    """

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        if not self.requested:
            print("SIGTERM: finishing scheduled steps, then checkpointing and stopping",
                  flush=True)
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


class CoordinatedTrainer(Trainer):
    """What both parameter-server trainers share, on the chief.

    The workers' names, SIGTERM as a request to stop at the next drain, the
    stall watchdog, and the end: the servers stop on their own once the
    chief is gone (strategies.server).
    """

    peer_errors = PS_PEER_ERRORS
    # Seconds past --stuck-timeout before the stall watchdog acts: a trainer
    # that handles a stuck worker itself gets there first.
    stall_grace = 0.0

    def __init__(self, plan, bundle, task, state, checkpointer, start_step, train_metrics):
        super().__init__(plan, bundle, task, state, checkpointer, start_step, train_metrics)
        self.coordinator = bundle.coordinator
        self.workers = [f"{role}:{i}" for role, i, _ in self.cfg.tasks() if role == "worker"]
        condense_tf_logs()
        self.applied_before = int(self.state.global_step.numpy())
        # How long a lost or stuck task may hold the run up (--stuck-timeout).
        self.patience = self.config.stuck_timeout
        self._last: dict[str, float] = {}
        self._stall: StallWatchdog | None = None
        self._guard: CallGuard | None = None
        self._events = protocol.EventLog(self.cfg.task_name)
        self._sigterm: StopOnSigterm | None = None

    def listen_for_sigterm(self) -> None:
        """From here on a SIGTERM is a request to stop at the next drain,
        even one that arrives while the first closure runs."""
        self._sigterm = StopOnSigterm()

    def on_started(self) -> None:
        # With too few workers left the coordinator (or ps:0) waits without
        # a timeout of its own: the watchdog ends the chief with one line.
        self._stall = StallWatchdog(self.cfg, self.patience, grace=self.stall_grace)
        self._guard = CallGuard(self.cfg, self.patience)

    def stuck_peers(self) -> tuple[list[str], list[str]]:
        """(stuck or unreachable ps tasks, stuck workers), each "role:i (address)"."""
        states = peer_states(self.cfg)
        ps = [n for n, st in states.items() if n.startswith("ps:") and st != "ok"]
        workers = [n for n, st in states.items() if n.startswith("worker:") and st == "stuck"]
        return ps, workers

    def end_on_stuck_ps(self, ps: list[str], waited: float) -> None:
        """Every step reads and writes the ps tasks: with one stuck nothing
        moves, and any call of ours would wait on it (a hard exit, as the
        watchdog's)."""
        exit_now(Exit.TASK_LOST, (
            f"error: {self.cfg.task_name}: {', '.join(ps)} did not answer for {waited:.0f}s "
            f"(--stuck-timeout={self.patience:g}) while training at step {self.completed}: "
            f"a ps task that is stuck or cut off holds every step; {self._resume_text()}"))

    def saving(self, step: int):
        """Wait up to --stuck-timeout for every stuck peer to answer; then save,
        guarded, or end with one line.

        TensorFlow traces a new function for each save of a checkpoint spread
        over several tasks (``functional_saver.MultiDeviceSaver.save``) and
        registers it with every task of the cluster: a task that is alive but
        stuck never answers, and the chief then blocks inside that call,
        holding the GIL, so not even the stall watchdog's thread could end
        it. So the peers are probed first (a few milliseconds when all
        answer; a dead task refuses the connection and does not hold a save
        up), and a task that stops during the save itself is left to the
        guard, a child process that ends the chief with one line.
        """
        since, reported = time.monotonic(), False
        while True:
            states = peer_states(self.cfg)
            stuck = [name for name, state in states.items() if state == "stuck"]
            if not stuck:
                break
            waited = time.monotonic() - since
            if not reported:
                # A worker restarted meanwhile (launch.py --restart-tasks)
                # refuses connections while it starts: the save goes ahead.
                self.report_stuck([n.split(" ")[0] for n in stuck if n.startswith("worker:")])
                reported = True
            if waited >= self.patience:
                self._end_before_save(step, stuck, states, waited)
            if self._stall is not None:
                self._stall.progress()  # this wait ends itself
            time.sleep(1.0)
        if self._guard is None:
            return contextlib.nullcontext()
        return self._guard.guarded(f"the checkpoint save at step {step}", self._resume_text())

    def report_stuck(self, names: list[str]) -> None:
        """A typed record for whoever manages the cluster (``launch.py
        --restart-tasks`` restarts the task, as a liveness check would):
        TensorFlow's dispatch can stall once a worker is stuck (docs/reliability.md),
        and a restarted worker is one it knows how to recover from."""
        for name in names:
            self._events.emit(protocol.STUCK, self.completed, peer=name)

    def _resume_text(self) -> str:
        return (f"relaunch to resume from the checkpoint at step {self.checkpointer.saved_at}"
                if self.checkpointer.saved_at else "relaunch to start again")

    def _end_before_save(self, step, stuck, states, waited) -> None:
        ps = [name for name in stuck if name.startswith("ps:")]
        if ps:
            self.end_on_stuck_ps(ps, waited)
        exit_now(Exit.TASK_LOST, (
            f"error: {self.cfg.task_name}: the checkpoint at step {step} would wait "
            f"on a stuck task (TensorFlow registers each save with every task), and it did "
            f"not answer within {waited:.0f}s (--stuck-timeout={self.patience:g}); "
            f"{states_text(states)}; {self._resume_text()}"))

    def paused(self):
        return self._stall.paused() if self._stall is not None else super().paused()

    def stop_requested(self) -> bool:
        return self._sigterm is not None and self._sigterm.requested

    def metrics(self) -> dict[str, float]:
        return dict(self._last)

    def ps_variable_bytes(self) -> dict[str, int]:
        """Bytes of model variables and optimizer slots each ps task holds."""
        state = self.state
        return ps_variable_bytes(state.model.weights, state.optimizer.variables)

    def finish_worker(self) -> None:
        raise AssertionError(f"under {self.bundle.name} only the chief trains")

    def end_of_job(self) -> None:
        """Servers stop on their own once the chief is gone (strategies.server)."""

    def close(self, finished: bool) -> None:
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        if self._stall is not None:
            self._stall.stop()
        if self._sigterm is not None:
            self._sigterm.restore()
        self.checkpointer.close()


class Fetcher:
    """Runs fetches on a thread of its own, so the chief can stop waiting for
    results a stuck worker holds; the blocked thread is then abandoned (a
    daemon) and the next fetch gets a fresh one."""

    def __init__(self):
        self._start()

    def _start(self) -> None:
        requests: queue.Queue = queue.Queue()
        results: queue.Queue = queue.Queue()
        self._requests, self._results = requests, results

        def run():
            while True:
                fn = requests.get()
                try:
                    results.put((True, fn()))
                except BaseException as err:  # pylint: disable=broad-except
                    results.put((False, err))

        threading.Thread(target=run, name="ps-fetch", daemon=True).start()

    def submit(self, fn) -> None:
        self._requests.put(fn)

    def result(self, timeout: float):
        """The value (or the error) of the last ``submit``; ``queue.Empty`` past ``timeout``."""
        ok, value = self._results.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def abandon(self) -> None:
        self._start()


@dataclasses.dataclass
class StuckWorker:
    """A worker found stuck, and the call it held (``stuck_workers`` in results.json)."""

    worker: str  # "worker:1"
    at_step: int
    waited_seconds: float
    rerouted_steps: int
    remote: object = dataclasses.field(repr=False)  # the stuck call's RemoteValue
    count_at: int | None = None  # its steps_by_worker count when found stuck

    def record(self, count_now: int | None) -> dict:
        came_back = _is_ready(self.remote)
        after = (count_now - self.count_at if count_now is not None and self.count_at is not None
                 else None)
        return {"worker": self.worker, "at_step": self.at_step,
                "waited_seconds": round(self.waited_seconds, 1),
                "rerouted_steps": self.rerouted_steps, "came_back": came_back,
                "steps_after": after,
                # Its call ended (it answered again, or it was restarted and
                # the call rerun) and it ran steps after being found stuck.
                "outcome": "rejoined" if came_back and (after is None or after > 0)
                else "left out"}


def _is_ready(remote) -> bool:
    event = getattr(remote, "_status_available_event", None)
    return bool(event is not None and event.is_set())


class PsTrainer(CoordinatedTrainer):
    # The main thread reroutes a stuck worker's call, or gives up its
    # results, at --stuck-timeout, and probing the peers takes up to 4 s
    # more on a busy host; the watchdog is the fallback.
    stall_grace = 10.0

    def __init__(self, plan, bundle, task, state, checkpointer, start_step, train_metrics):
        super().__init__(plan, bundle, task, state, checkpointer, start_step, train_metrics)
        strategy = bundle.strategy
        # Steps each worker ran (the classic example's local_step), kept on
        # ps:0 rather than on the workers: reading a worker's own counter
        # waits on that worker, and a slowed one answered too late for any
        # progress line to carry every count. Created outside the strategy's
        # scope, so exactly where we say.
        with tf.device("/job:ps/replica:0/task:0/device:CPU:0"):
            self.steps_by_worker = tf.Variable(tf.zeros([len(self.workers)], tf.int64),
                                               trainable=False, name="steps_by_worker")
        # Every worker shuffles with its own seed (seed=None): see data._seed_tensor.
        dataset_fn = data.make_dataset_fn(
            task.task, plan.global_batch_size, seed=None,
            synthetic=self.config.synthetic_data, in_memory=plan.in_memory,
        )
        self._iterator = iter(self.coordinator.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(dataset_fn)
        ))
        self._train_fn = make_train_fn(
            strategy, make_step_fn(state, train_metrics, self.config.gradient_dtype), state,
            len(train_metrics.names),
            steps_by_worker=self.steps_by_worker,
        )
        # Enough closures in flight to keep every worker busy while we read results.
        self.max_in_flight = 4 * max(1, len(self.workers))
        self._pending: collections.deque = collections.deque()
        self._staleness: list[np.ndarray] = []
        self._stuck: list[StuckWorker] = []
        self._fetcher = Fetcher()
        self.unfetched_steps = 0
        self.listen_for_sigterm()

    def train(self, num_steps: int) -> None:
        while len(self._pending) >= self.max_in_flight:
            self._collect_one()
        remote = self.coordinator.schedule(
            self._train_fn, args=(self._iterator, tf.constant(num_steps)))
        self._pending.append((remote, num_steps))

    def drain(self) -> None:
        while self._pending:
            self._collect_one()
        if any(not _is_ready(s.remote) for s in self._stuck):
            # join() would wait for the stuck call too; every call we count
            # was fetched above, so only errors are left to ask about.
            self.coordinator.done()
        else:
            self.coordinator.join()

    def _collect_one(self) -> None:
        remote, n = self._pending[0]
        remote = self._wait_or_reroute(remote, n)
        result = self._fetch(remote, n)
        self._pending.popleft()
        if self._stall is not None:
            self._stall.progress()
        if result is None:  # applied, but its results stay on a stuck worker
            self.unfetched_steps += n
            self.completed += n
            return
        self._staleness.append(result["staleness"])
        self._last = metric_dict(result["loss"], self.metric_names, result["metrics"])
        self.completed += n

    def _fetch(self, remote, n: int):
        """The finished call's results, or None if a stuck worker holds them.

        A call is finished once its function returned on the worker (its
        updates are on the ps), but its outputs stay there until fetched: a
        worker stopped in between would hold the fetch, without a deadline,
        so it runs on a thread of its own. Past --stuck-timeout the peers are
        probed; with a worker stuck, the thread is left to it and the steps
        count as applied, without their loss and metrics.
        """
        deadline = time.monotonic() + self.patience
        self._fetcher.submit(lambda: fetch(remote, deadline, task=self.cfg.task_name))
        since = time.monotonic()
        while True:
            try:
                return self._fetcher.result(self.patience)
            except queue.Empty:
                pass
            waited = time.monotonic() - since
            ps, stuck = self.stuck_peers()
            if ps:
                self.end_on_stuck_ps(ps, waited)
            if stuck:
                self._fetcher.abandon()
                self.report_stuck([name.split(" ")[0] for name in stuck])
                print(f"warning: {self.cfg.task_name}: a finished call's results are held by "
                      f"{', '.join(stuck)}, which accepts connections but has answered nothing "
                      f"for {waited:.0f}s (--stuck-timeout={self.patience:g}); its {n} step(s) "
                      "are applied, their loss and metrics not counted", flush=True)
                return None

    def _wait_or_reroute(self, remote, n: int):
        """The oldest call's RemoteValue once it is ready, or its replacement's.

        A stopped worker fails no RPC, so the coordinator would wait on its
        call forever (and so would we: results are read in order). Past
        --stuck-timeout the peers are probed: a stuck worker's call is
        scheduled again (a new closure for the same number of steps, taken
        by a free worker: the stuck one's thread is blocked in its call), and
        the stuck call's own result, should it ever come, is ignored. Its
        steps, if it applies them, count as re-executed, as a lost worker's.
        """
        event = getattr(remote, "_status_available_event", None)
        if event is None:  # not TensorFlow's RemoteValueImpl: wait as before
            return remote
        since = time.monotonic()
        while not event.wait(0.25):
            waited = time.monotonic() - since
            if waited < self.patience:
                continue
            ps, stuck = self.stuck_peers()
            if ps:
                self.end_on_stuck_ps(ps, waited)
            known = {s.worker for s in self._stuck if not _is_ready(s.remote)}
            stuck = [name for name in stuck if name.split(" ")[0] not in known]
            out = known | {name.split(" ")[0] for name in stuck}
            # A worker already known stuck holds its one call: this one is elsewhere.
            if not stuck or len(out) >= len(self.workers):
                since = time.monotonic()  # nothing to route around: the watchdog decides
                continue
            remote = self._reroute(remote, n, stuck, waited)
            event = remote._status_available_event  # pylint: disable=protected-access
            since = time.monotonic()
        return remote

    def _reroute(self, remote, n: int, stuck: list[str], waited: float):
        counts = read_counts(self.steps_by_worker)
        names = [name.split(" ")[0] for name in stuck]
        self.report_stuck(names)
        for name in names:
            count = counts[self.workers.index(name)] if counts and name in self.workers else None
            self._stuck.append(StuckWorker(name, self.completed, waited, n, remote, count))
        print(f"warning: {self.cfg.task_name}: {', '.join(stuck)} accepts connections but has "
              f"answered nothing for {waited:.0f}s (--stuck-timeout={self.patience:g}); "
              f"rerunning its {n} step(s) from step {self.completed} on the other workers, "
              "which get all further steps until it answers again", flush=True)
        replacement = self.coordinator.schedule(
            self._train_fn, args=(self._iterator, tf.constant(n)))
        self._pending[0] = (replacement, n)
        if self._stall is not None:
            self._stall.progress()
        return replacement

    def progress_fields(self) -> tuple[str, dict]:
        counts = read_counts(self.steps_by_worker)
        recent = (np.concatenate(self._staleness[-self.max_in_flight:])
                  if self._staleness else [])
        stats = staleness_stats(recent)
        per_worker = dict(zip(self.workers, counts)) if counts else None
        text = (
            f" | global_step {int(self.state.global_step.numpy())} local_steps "
            + (" ".join(f"{w}={c}" for w, c in per_worker.items())
               if per_worker else "unavailable (ps:0 did not answer)")
            + f" | staleness mean {stats['mean']:.2f} max {stats['max']}"
        )
        fields = {"steps_per_worker": per_worker, "staleness_mean": stats["mean"],
                  "staleness_max": stats["max"]}
        return text, fields

    def result_fields(self, ran: int) -> dict:
        global_steps = int(self.state.global_step.numpy())
        applied = global_steps - self.applied_before
        counts = read_counts(self.steps_by_worker)
        all_staleness = np.concatenate(self._staleness) if self._staleness else np.zeros(0)
        return {
            "global_steps": global_steps,
            "scheduled_steps": ran,
            # Updates the ps applied in this run; more than scheduled when a lost
            # worker's closure had applied some of its steps before it was rerun.
            "applied_steps": applied,
            "reexecuted_steps": applied - ran,
            # Steps each worker ran in this run, counted when a scheduled call
            # finished (a lost worker's unfinished call counts for the worker
            # that reran it); None if ps:0 did not answer.
            "steps_per_worker": dict(zip(self.workers, counts)) if counts else None,
            "staleness": staleness_stats(all_staleness),
            "stuck_workers": [
                stuck.record(counts[self.workers.index(stuck.worker)] if counts else None)
                for stuck in self._stuck],
            "unfetched_steps": self.unfetched_steps,
            "variables_per_ps": variables_per_ps(self.state.model),
            "ps_variable_bytes": self.ps_variable_bytes(),
        }
