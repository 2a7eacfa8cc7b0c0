"""Elastic membership: a worker lost for good costs its share, not the job.

``--min-workers M`` makes the launcher own which workers form the cluster.
When a worker's host stays unreachable for ``--rejoin-timeout`` seconds
(``--partition`` for good), the job is stopped and re-formed with the
survivors, if at least M remain: each survivor gets a new TF_CONFIG naming
only the members, the global batch stays the one decided at launch (each
replica's share grows), the data is sharded over the members by
TensorFlow's input context, and training resumes from the newest
checkpoint, so the step count is exact (the steps since that checkpoint are
redone, and counted). When the lost host is reachable again the job is
preempted (every worker saves at one agreed step) and re-formed with it, up
to the original workers, never more. A worker whose process fails while
its host is reachable is left out the same way, after ``--max-restarts``
relaunches with it (at once with ``--shrink-at-once``), and not taken back.
Below M the job stops, exit 75, with one line.

The global batch is one that every size from M to N divides, decided once
before anything starts (``batch_divisors``, ``check_batch``,
``choose_batch``: pure; ``launcher.job.pin_elastic_batch`` passes it to
every formation), so a cluster re-formed before any checkpoint recorded
the batch never chooses its own.

``ElasticPlan`` is the checked request (pure); ``Membership`` is the
supervisor hook and the record of each change (``membership`` in
results.json and outcome.json).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from dataclasses import dataclass

from tfdist import protocol
from tfdist.options import TrainOptions
from tfdist.launcher.plan import LaunchError, tf_configs_at
from tfdist.launcher.state import JobState, RestartMember, SignalMember
from tfdist.protocol import Exit
from tfdist.strategies import kinds
from tfdist.strategies.kinds import StrategyKind
from tfdist.strategies.tf_config import ClusterConfig

ROLE = "worker"  # the role whose tasks may leave and rejoin
DEFAULT_REJOIN_TIMEOUT = 20.0


def is_elastic(kind: StrategyKind) -> bool:
    """Whether a job of ``kind`` can go on with fewer workers (pure): several
    processes whose workers each train on their share of the data; not a
    model cut into stages, one per worker (each stage is needed)."""
    return not kind.single_process and not kind.pipelined and ROLE in kind.computing_roles


def ray_able() -> str:
    """The strategies whose jobs re-form on the Ray nodes left: every worker runs every
    step, nothing else in the cluster (the engine places the members anew each time)."""
    return "|".join(n for n, k in kinds.all_kinds().items() if is_elastic(k) and k.trainer == "sync")


@dataclass(frozen=True)
class ElasticPlan:
    min_workers: int
    rejoin_timeout: float = DEFAULT_REJOIN_TIMEOUT
    # A worker whose process fails while its host is reachable: the job is
    # relaunched with it this many times (--max-restarts), then goes on without
    # it; at once with --shrink-at-once.
    max_restarts: int = 0
    at_once: bool = False


def plan_elastic(kind: StrategyKind, workers: int, min_workers: int | None,
                 rejoin_timeout: float | None, engine: str = "local",
                 hosts: int = 2, max_restarts: int = 0,
                 at_once: bool = False) -> ElasticPlan | None:
    """``--min-workers``/``--rejoin-timeout``/``--shrink-at-once`` checked against the
    job (pure; LaunchError)."""
    if min_workers is None and at_once:
        raise LaunchError("--shrink-at-once goes on without a worker whose process failed; "
                          "it needs --min-workers M: add it, or drop --shrink-at-once")
    if min_workers is None:
        if rejoin_timeout is not None:
            raise LaunchError(f"--rejoin-timeout={rejoin_timeout:g} is how long a lost worker "
                              "may take to come back before the job goes on without it; it "
                              "needs --min-workers M: add it, or drop --rejoin-timeout")
        return None
    if not is_elastic(kind):
        able = "|".join(n for n, k in kinds.all_kinds().items() if is_elastic(k))
        raise LaunchError(f"--min-workers goes on without a lost worker under --strategy "
                          f"{able}, received --strategy {kind.name}, which "
                          + ("is one process" if kind.single_process else
                             "needs every worker (each holds a stage of the model)")
                          + "; drop --min-workers")
    if engine != "local" and not (engine == "ray" and kind.trainer == "sync"):
        raise LaunchError(f"--min-workers with --engine {engine} goes on without a lost node "
                          f"under --strategy {ray_able()} only, received --strategy {kind.name}; "
                          "drop --min-workers or use --engine local")
    if workers < 2:
        raise LaunchError(f"--min-workers={min_workers} with --workers={workers}: a job of one "
                          "worker has nobody to go on without; use --workers 2 or more")
    if not 1 <= min_workers <= workers:
        raise LaunchError(f"--min-workers={min_workers} is not allowed with --workers={workers}; "
                          f"use 1..{workers} (the fewest workers the job may go on with)")
    timeout = DEFAULT_REJOIN_TIMEOUT if rejoin_timeout is None else rejoin_timeout
    if not 0 < timeout < math.inf:
        raise LaunchError(f"--rejoin-timeout={timeout:g} is not allowed; use a positive, "
                          "finite number of seconds")
    if not hosts and engine == "local":
        raise LaunchError("--min-workers goes on without a worker whose host is lost; on this "
                          "machine hosts are simulated: add --hosts N (each worker on its own "
                          "host), or drop --min-workers")
    if at_once and (engine != "local" or kind.asynchronous):
        # Asynchronous workers leave and rejoin the running job (no re-formation);
        # on Ray a lost actor is a lost node.
        able = "|".join(n for n, k in kinds.all_kinds().items()
                        if is_elastic(k) and not k.asynchronous)
        raise LaunchError(f"--shrink-at-once re-forms a job without a worker whose process "
                          f"failed, on the local engine under --strategy {able} only, "
                          f"received --strategy {kind.name} --engine {engine}; drop "
                          "--shrink-at-once")
    return ElasticPlan(min_workers, float(timeout), max_restarts, at_once)


def member_configs(tf_configs: dict[str, dict | None], members: list[str]) -> dict[str, dict]:
    """Each member's TF_CONFIG for a cluster of only ``members`` (keyed by the
    launcher's names; the k-th member worker is ``worker:k`` inside; pure)."""
    addresses: dict[str, str] = {}
    for name in members:
        role, _, index = name.partition(":")
        addresses[name] = tf_configs[name]["cluster"][role][int(index)]
    renamed: dict[str, str] = {}
    counts: dict[str, int] = {}
    for name in members:
        role = name.partition(":")[0]
        renamed[name] = f"{role}:{counts.get(role, 0)}"
        counts[role] = counts.get(role, 0) + 1
    inner = tf_configs_at({renamed[n]: addresses[n] for n in members})
    return {n: inner[renamed[n]] for n in members}


def aggregate(options: TrainOptions, workers: int) -> tuple[TrainOptions, str | None]:
    """ps-sync's K at ``workers`` workers: K = min(K, workers) (pure).

    Without ``--replicas-to-aggregate`` K is every worker, so it follows the
    size by itself. Returns the options and, when K was lowered, the line
    saying so.
    """
    k = options.replicas_to_aggregate
    if k is None or k <= workers:
        return options, None
    return (dataclasses.replace(options, replicas_to_aggregate=workers),
            f"--replicas-to-aggregate={k} is more than the {workers} workers "
            f"left: K = {workers} at this size (K = min(K, workers))")


def global_batch(model_dir: str, options: TrainOptions) -> int | None:
    """The global batch every formation keeps: the options' (the launcher pins one
    at launch), else the one the run recorded (``run.json``; ``--program``)."""
    if options.global_batch_size is not None:
        value = options.global_batch_size
        return value if value > 0 else None
    try:
        with open(os.path.join(model_dir, "run.json")) as f:
            value = json.load(f).get("global_batch_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


# --- the one global batch of every formation ---------------------------------------

def batch_divisors(kind: StrategyKind, roles: dict[str, int], sizes: range,
                   k: int | None = None) -> dict[int, int]:
    """What the global batch must divide by at each size (pure): at ``n``
    workers, the kind's replicas in sync (one per worker's CPU), and under a
    kind that averages K gradients per update, K = min(K, n) (every worker
    without ``--replicas-to-aggregate``).

    ``roles``: the cluster's tasks per role, as planned; ``k``: the
    ``--replicas-to-aggregate`` given, or ``None``.
    """
    out = {}
    for n in sizes:
        counts = {**roles, ROLE: n}
        cluster = ClusterConfig(roles={r: tuple(f"{r}-{i}:0" for i in range(c))
                                       for r, c in counts.items() if c}, task_type=ROLE)
        per_update = (min(k, n) if k else n) if kind.aggregates_gradients else 1
        out[n] = math.lcm(kind.replicas(cluster, 0), per_update)
    return out


def _near(batch: int, unit: int) -> list[int]:
    """The multiples of ``unit`` next to ``batch``: below (if any) and above."""
    below = batch // unit * unit
    return [m for m in (below, below + unit) if m > 0 and m != batch] or [unit]


def check_batch(batch: int, divisors: dict[int, int]) -> None:
    """A given global batch that some size of the elastic job cannot divide is
    refused (pure; LaunchError naming those sizes and batches that work)."""
    bad = [n for n, d in divisors.items() if batch % d]
    if batch <= 0 or not bad:
        return  # a non-positive batch is the task's own check to refuse
    unit = math.lcm(*divisors.values())
    sizes = " or ".join(str(n) for n in bad)
    low, high = min(divisors), max(divisors)
    raise LaunchError(
        f"--global-batch-size={batch} does not divide over {sizes} workers, and an elastic "
        f"job trains every formation ({low} to {high} workers: --min-workers to --workers) "
        f"with one global batch; use a multiple of {unit}, e.g. "
        f"{' or '.join(str(m) for m in _near(batch, unit))}, or leave it out for the "
        "launcher to choose one")


def choose_batch(default: int, divisors: dict[int, int]) -> int:
    """The global batch an elastic job trains with when none is given (pure): the
    multiple of every size's divisor nearest ``default`` (the full cluster's
    own choice), the larger on a tie."""
    unit = math.lcm(*divisors.values())
    below = default // unit * unit
    if below == 0:
        return unit
    return below if default - below < below + unit - default else below + unit


def batch_line(batch: int, divisors: dict[int, int]) -> str:
    """The launcher's one line stating the batch every formation keeps (pure)."""
    sizes = sorted(divisors, reverse=True)
    each = ", ".join(f"{batch // divisors[n]} at {n}" for n in sizes)
    return (f"[launch] elastic: global batch {batch} for every formation, {sizes[-1]} to "
            f"{sizes[0]} workers (each replica's share: {each}); --global-batch-size sets "
            "another")


def _workers(n: int) -> str:
    return f"{n} worker" + ("" if n == 1 else "s")


class Membership:
    """Which workers form the cluster, each change and why; a supervisor hook.

    Each poll it reads the tasks' progress events (the newest checkpoint, the
    last step, the first step of each formation) and the simulated hosts'
    links (``links_down``: a callable, the live supervisor's set). A member
    whose host has been down for ``rejoin_timeout`` ends the attempt (every
    task SIGKILLed: the survivors are blocked in a collective); a lost
    worker whose host is up again preempts the job (SIGTERM: every worker
    saves at one agreed step), and ``after_attempt`` re-forms the cluster.
    """

    def __init__(self, plan: ElasticPlan, names: list[str], host_of: dict[str, int],
                 tf_configs: dict, event_paths=(), log=print, clock=time.monotonic,
                 record_path: str | None = None, live: bool = False):
        self.plan, self.log, self.clock = plan, log, clock
        self.record_path = record_path  # the file the chief copies into results.json
        # ps: workers leave and rejoin the running cluster (the coordinator
        # reschedules a gone worker's steps), no re-formation.
        self.live = live
        # Who is told to save and stop when a worker comes back: the
        # coordinator if the cluster has one (ps-sync's chief), else a worker
        # (multiworker's workers agree on the step among themselves).
        self.saver = next((n for n in names if n.partition(":")[0] == "chief"), None)
        self.all_names = list(names)
        self.workers = [n for n in names if n.partition(":")[0] == ROLE]
        self.members = list(self.workers)
        self.host_of, self.tf_configs = dict(host_of), tf_configs
        self.readers = [protocol.EventReader(p) for p in event_paths]
        self.links_down = lambda: set()
        self.history: list[dict] = [{"step": 0, "workers": len(self.workers),
                                     "why": "start", "members": list(self.workers)}]
        self.checkpoint = 0  # newest checkpoint seen (steps it holds)
        self.last_step = 0  # newest step any task reported
        self.down_since: dict[str, float] = {}
        self.lost: list[str] = []  # members given up on in this attempt
        self.growing: list[str] = []  # workers coming back: the preemption was ours
        self.started = False  # the current formation ran its first step
        self.changed_at: float | None = None  # wall time of the loss or return
        self.short_since: float | None = None  # ps: fewer than M workers since
        self.back_seen: float | None = None  # a left worker's host first seen up again
        # A worker whose process failed first while its host was reachable (and
        # its exit code), in this attempt; each worker's such failures; the
        # workers the job went on without for them (never grown back).
        self.failed: tuple[str, int] | None = None
        self.failures: dict[str, int] = {}
        self.dropped: list[str] = []
        self._write()

    # --- what the supervisor starts ------------------------------------------------

    @property
    def names(self) -> list[str]:
        if self.live:
            return list(self.all_names)  # a left worker is started again by the hook
        return [n for n in self.all_names if n.partition(":")[0] != ROLE or n in self.members]

    def configs(self) -> dict[str, dict]:
        keep = [n for n in self.all_names if n in self.names]
        return member_configs(self.tf_configs, keep)

    def env(self) -> dict[str, str]:
        """What every task is told: where the membership is kept."""
        return {protocol.MEMBERSHIP_ENV: self.record_path} if self.record_path else {}

    def _write(self) -> None:
        if self.record_path is None:
            return
        try:
            protocol.write_json_atomic(self.record_path, self.record())
        except OSError as err:
            self.log(f"[launch] warning: could not write {self.record_path} "
                     f"({err.strerror or err}); results.json will have no membership")

    def record(self) -> list[dict]:
        return [{k: v for k, v in h.items() if k in ("step", "workers", "why")}
                for h in self.history]

    def new_attempt(self, links_down) -> None:
        self.links_down = links_down
        self.down_since, self.lost, self.growing, self.started = {}, [], [], False
        self.back_seen, self.failed = None, None

    # --- the hook --------------------------------------------------------------------

    def _read(self) -> None:
        for reader in self.readers:
            for event in reader.read():
                if not isinstance(event.step, int):
                    continue
                if event.kind in (protocol.CHECKPOINT, protocol.PREEMPTED):
                    self.checkpoint = max(self.checkpoint, event.step)
                if event.kind in (protocol.PROGRESS, protocol.CHECKPOINT, protocol.STARTED):
                    self.last_step = max(self.last_step, event.step)
                if event.kind == protocol.STARTED and not self.started:
                    self.started = True
                    if self.changed_at is not None and len(self.history) > 1:
                        self._first_step(self.history[-1], event)

    def _first_step(self, entry: dict, event: protocol.Event) -> None:
        """The new formation's first step: when, and the step it really resumed
        from (a checkpoint being written when the tasks were stopped is not
        listed, so the one before it is restored)."""
        entry["first_step_after_seconds"] = round(event.time - self.changed_at, 1)
        resumed = event.data.get("resumed_from")
        if self.live or not isinstance(resumed, int) or resumed == entry["step"]:
            return
        entry["step"] = resumed
        if "last_step_before" in entry:
            entry["steps_redone_at_least"] = max(0, entry["last_step_before"] - resumed)
        self._write()

    def __call__(self, state: JobState) -> list:
        self._read()
        down = self.links_down()
        now = self.clock()
        if self.live:
            return self._live(state, down, now)
        for name in self.members:
            if self.host_of.get(name) in down:
                self.down_since.setdefault(name, now)
            else:
                self.down_since.pop(name, None)
        self._note_failure(state, down)
        if self.down_since and not self.lost:
            failed = any(t.exit_code not in (None, 0) for t in state.members)
            waited = now - min(self.down_since.values())
            if failed or waited >= self.plan.rejoin_timeout:
                # The survivors are blocked in (or have left) a collective with
                # the lost one: nothing is saved by waiting; end the attempt.
                self.lost = sorted(self.down_since, key=self.all_names.index)
                self.changed_at = time.time() - waited
                self.log(f"[launch] {', '.join(self.lost)} unreachable for {waited:.0f} s"
                         + (" and the others' all-reduce failed" if failed else "")
                         + ": stopping this formation of the cluster to re-form it")
                return [SignalMember(t.name, signal.SIGKILL, pid=t.pid)
                        for t in state.members if t.running]
            return []
        back = [w for w in self.workers if w not in self.members and w not in self.dropped
                and self.host_of.get(w) not in down]
        if back and self.back_seen is None:
            self.back_seen = time.time()  # the return, which the grow-back is timed from
        if back and self.started and not self.growing and not self.down_since:
            first = next((t for t in state.members if t.running and (
                t.name == self.saver if self.saver else t.name in self.members)), None)
            if first is not None:
                self.growing = back
                self.changed_at = self.back_seen
                self.log(f"[launch] {', '.join(back)}: host reachable again; SIGTERM to "
                         f"{first.name}: the job checkpoints where it is and stops (exit 42), "
                         f"then re-forms with {_workers(len(self.members) + len(back))}")
                return [SignalMember(first.name, signal.SIGTERM, group=False, pid=first.pid)]
        return []

    def _note_failure(self, state: JobState, down: set) -> None:
        """The first member to fail in this attempt while its host is reachable: the
        one whose loss ended it (the others then report the lost peer, exit 75,
        or are stopped), preferring a code other than 75 when several end at once."""
        if self.failed is not None or self.down_since:
            return
        ended = [(t.name, t.exit_code) for t in state.members if t.name in self.members
                 and t.exit_code not in (None, 0, Exit.PREEMPTED)
                 and self.host_of.get(t.name) not in down]
        if ended:
            self.failed = next((e for e in ended if e[1] != Exit.TASK_LOST), ended[0])

    def _live(self, state: JobState, down: set, now: float) -> list:
        """ps: a worker whose host is gone leaves the running job (its steps go
        to the others), and is started again, same TF_CONFIG, once its host
        is back; fewer than M workers for ``rejoin_timeout`` ends the job."""
        if self.lost:
            return []  # the job is being stopped
        actions: list = []
        for name in list(self.members):
            view = state.member(name)
            host = self.host_of.get(name)
            if host not in down:
                self.down_since.pop(name, None)
                continue
            since = self.down_since.setdefault(name, now)
            ended = view is None or not view.running
            if not ended and now - since < self.plan.rejoin_timeout:
                continue
            if not ended:
                actions.append(SignalMember(name, signal.SIGKILL, pid=view.pid))
            self.members.remove(name)
            self.changed_at = time.time()
            self._live_change(f"{name} left (host{host} unreachable"
                              + (", its task ended)" if ended else
                                 f" for {now - since:.0f} s)"), "going on with")
        for name in self.workers:
            if name in self.members or self.host_of.get(name) in down:
                continue
            view = state.member(name)
            if view is not None and view.running:
                continue
            self.members = [w for w in self.workers if w in self.members or w == name]
            self.changed_at = time.time()
            actions.append(RestartMember(name, note="its host is reachable again"))
            self._live_change(f"{name} back (host{self.host_of.get(name)} reachable again)",
                              "growing back to")
        if len(self.members) >= self.plan.min_workers:
            self.short_since = None
        elif self.short_since is None:
            self.short_since = now
        elif now - self.short_since >= self.plan.rejoin_timeout:
            self.lost = [w for w in self.workers if w not in self.members]
            self.log(f"[launch] {len(self.members)} worker(s) left for "
                     f"{self.plan.rejoin_timeout:g} s (--rejoin-timeout), below --min-workers="
                     f"{self.plan.min_workers}; stopping (exit {int(Exit.TASK_LOST)}): run the "
                     "same command when capacity is back to resume from the newest checkpoint")
            actions += [SignalMember(t.name, signal.SIGKILL, pid=t.pid)
                        for t in state.members if t.running]
        return actions

    def _live_change(self, why: str, verb: str) -> None:
        self.history.append({"step": self.last_step, "workers": len(self.members), "why": why,
                             "members": list(self.members)})
        self._write()
        self.log(f"[launch] {why}: {verb} {_workers(len(self.members))} at step {self.last_step}")

    # --- between attempts --------------------------------------------------------------

    def after_attempt(self, code: int, wait_links) -> int | None:
        """After an attempt ended with ``code``: ``None`` to re-form (the members
        changed), else the code to go on with as before (relaunch or end).

        ``wait_links(seconds)`` keeps the fault schedule running (a partition
        lifted when due) while a lost member's host may still come back.
        """
        self._read()
        if self.live:
            return Exit.TASK_LOST if self.lost else code
        if code == Exit.PREEMPTED and self.growing:
            back = self.growing
            self.members = [w for w in self.workers if w in self.members or w in back]
            hosts = ", ".join(f"host{self.host_of[w]}" for w in back)
            why = f"{', '.join(back)} back ({hosts} reachable again)"
            self._change(why, back=True)
            return None
        if code == Exit.OK:
            return code
        if not self.lost:
            return code if code == Exit.PREEMPTED else self._after_failure(code)
        down_for = self.clock() - min(self.down_since.values())
        if down_for < self.plan.rejoin_timeout:
            wait_links(self.plan.rejoin_timeout - down_for)
        down = self.links_down()
        gone = [w for w in self.lost if self.host_of.get(w) in down]
        if not gone:
            return code  # back in time: relaunched as any lost task is (--max-restarts)
        survivors = [w for w in self.members if w not in gone]
        hosts = ", ".join(f"host{self.host_of[w]}" for w in gone)
        if len(survivors) < self.plan.min_workers:
            self.log(f"[launch] {', '.join(gone)} lost for good ({hosts} unreachable for "
                     f"{self.plan.rejoin_timeout:g} s): {len(survivors)} worker(s) left, below "
                     f"--min-workers={self.plan.min_workers}; stopping (exit "
                     f"{int(Exit.TASK_LOST)}): run the same command when capacity is back to "
                     "resume from the newest checkpoint")
            return Exit.TASK_LOST
        self.members = survivors
        self._change(f"{', '.join(gone)} lost for good ({hosts} unreachable for "
                     f"{self.plan.rejoin_timeout:g} s)", back=False)
        return None

    def _after_failure(self, code: int) -> int | None:
        """A worker failed with its host reachable: relaunched with it (the code, for
        --max-restarts) until it has failed more than --max-restarts times (once,
        with --shrink-at-once); then re-formed without it (``None``), if M remain."""
        if self.failed is None:
            return code
        name, exit_code = self.failed
        count = self.failures[name] = self.failures.get(name, 0) + 1
        if not self.plan.at_once and count <= self.plan.max_restarts:
            return code
        survivors = [w for w in self.members if w != name]
        why = (f"{name} failed {count} time(s) with its host reachable (last exit "
               f"{exit_code}" + (", --shrink-at-once)" if self.plan.at_once else
                                 f", --max-restarts={self.plan.max_restarts})"))
        if len(survivors) < self.plan.min_workers:
            self.log(f"[launch] {why}: {len(survivors)} worker(s) left without it, below "
                     f"--min-workers={self.plan.min_workers}: the job cannot go on without "
                     f"it (exit {code})")
            return code
        self.members = survivors
        self.dropped.append(name)
        self._change(why, back=False)
        return None

    def _change(self, why: str, back: bool) -> None:
        redone = max(0, self.last_step - self.checkpoint)
        entry = {"step": self.checkpoint, "workers": len(self.members), "why": why,
                 "members": list(self.members), "last_step_before": self.last_step,
                 "steps_redone_at_least": redone}
        self.history.append(entry)
        self._write()
        self.log(f"[launch] {why}: {'growing back to' if back else 'continuing with'} "
                 f"{_workers(len(self.members))} from step {self.checkpoint}"
                 + (f" (steps {self.checkpoint}-{self.last_step} redone)" if redone else ""))
        self.last_step = self.checkpoint
