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

``ElasticPlan`` is the checked request (pure); ``launcher.membership`` holds the
supervisor hook and the record of each change (``membership`` in
results.json and outcome.json).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

from tfdist.options import TrainOptions
from tfdist.launcher.plan import LaunchError, tf_configs_at
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


def workers_text(n: int) -> str:
    return f"{n} worker" + ("" if n == 1 else "s")
