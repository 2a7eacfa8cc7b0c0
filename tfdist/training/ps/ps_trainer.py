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
import dataclasses
import queue
import threading
import time

import numpy as np
import tensorflow as tf

from tfdist.training.workload import data
from tfdist.training.ps.coordinated import CoordinatedTrainer, variables_per_ps
from tfdist.training.ps import read_ahead
from tfdist.training.ps.rpc import fetch
from tfdist.training.loop.step import make_step_fn, make_train_fn, xla_part


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
    """``ps`` on the chief: owns the closures scheduled on the workers and the in-flight
    window, fetching their results (loss, metrics, staleness) as they complete, the
    per-worker step counts and re-executed steps, and the rerouting of a stuck worker's
    call. What it shares with ``ps-sync`` is ``CoordinatedTrainer``'s."""

    # The main thread reroutes a stuck worker's call, or gives up its
    # results, at --stuck-timeout, and probing the peers takes up to 4 s
    # more on a busy host; the watchdog is the fallback.
    stall_grace = 10.0

    def __init__(self, *, plan, bundle, task, state, checkpointer, start_step, train_metrics):
        super().__init__(plan=plan, bundle=bundle, task=task, state=state,
                         checkpointer=checkpointer, start_step=start_step,
                         train_metrics=train_metrics)
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
        self.read_ahead = plan.read_ahead
        # jit_compile=True: XLA computes on the weights' values, read outside it.
        jit = xla_part(state.model, bundle.kind) == "values"
        sparse = read_ahead.sparse_layers(state.model) if self.read_ahead else []
        if sparse:
            print(f"warning: {self.cluster.member_name}: --read-ahead on reads the whole table "
                  f"of Embedding layer(s) {', '.join(sparse[:3])} every step, where a step "
                  "reads only the rows its batch touches", flush=True)
        if self.read_ahead:
            self._train_fn = read_ahead.make_read_ahead_train_fn(
                strategy, read_ahead.make_read_ahead_step_fn(
                    state, train_metrics, self.config.gradient_dtype, plan.accumulation_steps,
                    jit),
                state, len(train_metrics.names), self.steps_by_worker,
                batches_per_step=plan.accumulation_steps)
        else:
            # Accumulating N batches, the plain step would read the weights N times;
            # XLA reads none itself.
            once = (plan.accumulation_steps > 1 or jit) and not train_metrics.own_step
            step_fn = (read_ahead.make_read_once_step_fn(
                state, train_metrics, self.config.gradient_dtype, plan.accumulation_steps, jit)
                if once else make_step_fn(state, train_metrics, self.config.gradient_dtype,
                                          plan.accumulation_steps,
                                          xla_part(state.model, bundle.kind)))
            self._train_fn = make_train_fn(
                strategy, step_fn, state,
                len(train_metrics.names),
                steps_by_worker=self.steps_by_worker, batches_per_step=plan.accumulation_steps,
            )
        # Enough closures in flight to keep every worker busy while we read results.
        self.max_in_flight = 4 * max(1, len(self.workers))
        self._pending: collections.deque = collections.deque()
        self._staleness: list[np.ndarray] = []
        self._stuck: list[StuckWorker] = []
        self._fetcher = Fetcher()
        self.unfetched_steps = 0
        self.listen_for_sigterm()

    def train(self, num_steps: int) -> dict[str, float]:
        while len(self._pending) >= self.max_in_flight:
            self._collect_one()
        remote = self.coordinator.schedule(
            self._train_fn, args=(self._iterator, tf.constant(num_steps)))
        self._pending.append((remote, num_steps))
        return self._metrics()

    def drain(self) -> dict[str, float]:
        while self._pending:
            self._collect_one()
        if any(not _is_ready(s.remote) for s in self._stuck):
            # join() would wait for the stuck call too; every call we count
            # was fetched above, so only errors are left to ask about.
            self.coordinator.done()
        else:
            self.coordinator.join()
        return self._metrics()

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
        self._last = self.train_metrics.logs(result["loss"], result["metrics"])
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
        self._fetcher.submit(lambda: fetch(remote, deadline, member=self.cluster.member_name))
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
                print(f"warning: {self.cluster.member_name}: a finished call's results are held by "
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
        print(f"warning: {self.cluster.member_name}: {', '.join(stuck)} accepts connections but has "
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
            # Workers read each step's weights during the step before (staleness >= 1).
            "read_ahead": self.read_ahead,
            "stuck_workers": [
                stuck.record(counts[self.workers.index(stuck.worker)] if counts else None)
                for stuck in self._stuck],
            "unfetched_steps": self.unfetched_steps,
            "variables_per_ps": variables_per_ps(self.state.model),
            "ps_variable_bytes": self.ps_variable_bytes(),
        }
