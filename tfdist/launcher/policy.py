"""What the launcher makes of a strategy kind's facts (pure).

A kind says which roles compute, which only serve, how many ps tasks it
needs and whether its updates wait for each other (``strategies/kinds.py``).
From those alone this module derives the launcher's and the soak's policy:
how many tasks of each role a simulated cluster gets, whose exit decides the
job, and which faults a job survives with every recovery flag on. A new kind
gets all three without a line here.
"""

from __future__ import annotations

from tfdist.protocol import ConfigError
from tfdist.strategies.kinds import StrategyKind

MAX_PS = 64  # a bound on --ps for the kinds that take ps tasks


def has_coordinator(kind: StrategyKind) -> bool:
    """Whether the cluster always has a chief that only coordinates (it runs no steps)."""
    return not kind.single_process and "chief" not in kind.computing_roles


def max_ps(kind: StrategyKind) -> int:
    return MAX_PS if kind.min_ps else 0


def layout(kind: StrategyKind, workers: int, ps: int = 0, chief: bool = False) -> dict[str, int]:
    """Tasks per role for the launcher (``{}``: one process, no TF_CONFIG).

    ``chief`` adds a separate chief to a kind whose chief trains too; a kind
    with a coordinating chief always has one.
    """
    if workers < 1:
        raise ConfigError(f"--workers={workers}; at least 1 worker is needed")
    if kind.single_process:
        if workers != 1 or ps:
            raise ConfigError(
                f"--strategy {kind.name} is one process; received --workers={workers} "
                f"--ps={ps}; use --workers 1 --ps 0, or a multi-process strategy"
            )
        return {}
    if ps < kind.min_ps:
        raise ConfigError(f"--strategy {kind.name} needs --ps >= {kind.min_ps}, received --ps={ps}")
    if ps > max_ps(kind):
        if not kind.min_ps:
            raise ConfigError(
                f"--strategy {kind.name} takes no ps tasks, received --ps={ps}; use --ps 0")
        raise ConfigError(f"--strategy {kind.name} takes at most {MAX_PS} ps tasks, "
                          f"received --ps={ps}")
    coordinator = has_coordinator(kind)
    return {"chief": 1 if chief or coordinator else 0, "worker": workers, "ps": ps}


# The sidecar evaluator's role (``launch.py --evaluator``): a member outside the
# training cluster, as TensorFlow's TF_CONFIG and Kubeflow's TFJob keep it.
EVALUATOR = "evaluator"


def is_evaluator(member: str) -> bool:
    return member.partition(":")[0] == EVALUATOR


def decides(kind: StrategyKind, member: str) -> bool:
    """Whether ``task``'s exit decides the job's outcome (first failure wins).

    Serving tasks do not: they run until the chief is gone, and a lost
    serving worker's steps are rescheduled on the others. Every task of a
    kind without servers runs every step, so each one decides. The sidecar
    evaluator never does: nobody waits for it, so a lost one changes nothing.
    """
    return member.partition(":")[0] not in (*kind.serving_roles, EVALUATOR)


# How long a drawn --hang or --partition lasts (its +SECONDS), drawn uniformly.
# A hang stays below the 10 s heartbeat timeout of TensorFlow's coordination
# service, past which multiworker declares a silent worker lost
# (docs/reliability.md); shorter, every kind just waits for the task.
HANG_SECONDS = (3, 7)
# docs/reliability.md measured a worker's host cut off for 10 s under ps.
PARTITION_SECONDS = (4, 10)
LASTING_SECONDS = {"hang": HANG_SECONDS, "partition": PARTITION_SECONDS}


def soak_tasks(kind: StrategyKind) -> list[str]:
    """The tasks of the job the soak runs: two workers (one process for a
    single-process kind) and the kind's fewest ps tasks."""
    counts = layout(kind, 1 if kind.single_process else 2, kind.min_ps)
    return [f"{r}:{i}" for r, n in counts.items() for i in range(n)] or ["local:0"]


def survivable_faults(kind: StrategyKind, hosts: bool = False) -> tuple[tuple[str, str], ...]:
    """The (action, task) faults the soak's job of ``kind`` (``soak_tasks``)
    survives with the launcher's recovery flags on (``--restart-tasks`` where
    workers may rejoin, ``--max-restarts``); the soak draws from them.

    Actions: ``kill``, ``preempt``, ``hang`` (lifted after ``HANG_SECONDS``)
    and, with ``hosts`` (each worker alone on a simulated host),
    ``partition``, whose task names the worker whose host is cut off for
    ``PARTITION_SECONDS``. Only what docs/reliability.md shows the kind
    survives is listed.
    """
    computing = [t for t in soak_tasks(kind)
                 if kind.single_process or t.partition(":")[0] in kind.computing_roles]
    # A bounded hang: the task's peers wait for it, then training goes on.
    hangs = tuple(("hang", t) for t in computing)
    # A lost ps task cannot rejoin (its variables are gone): the chief exits
    # 75 and the relaunch resumes from the checkpoint.
    ps_loss = (("kill", "ps:0"),) if kind.min_ps else ()
    if kind.single_process:
        # One process: killed, the relaunch resumes from the checkpoint;
        # preempted, it saves where it stopped and the relaunch resumes there.
        return (("kill", "local:0"), ("preempt", "local:0"), *hangs)
    if kind.asynchronous:
        # A lost worker's steps go to the others and it is restarted; a lost
        # ps or chief ends the attempt, and the relaunch resumes. A worker's
        # host cut off: the worker quits and its closures run elsewhere
        # (measured under ps only, so only drawn for asynchronous kinds).
        cut = (("partition", "worker:1"),) if hosts else ()
        return (("kill", "worker:0"), ("kill", "worker:1"), ("preempt", "worker:1"),
                *ps_loss, ("kill", "chief:0"), ("preempt", "chief:0"), *hangs, *cut)
    if kind.aggregates_gradients:
        # With the default K = N a lost worker stalls every update until it
        # is back (--restart-tasks) or the chief gives up (exit 75) and a
        # relaunch resumes: the two recoveries shown to hold for this kind.
        return (("kill", "worker:1"), ("preempt", "chief:0"), *ps_loss, *hangs)
    # All-reduce: any lost or preempted worker ends the attempt; the
    # relaunch resumes from the checkpoint.
    return (("kill", "worker:0"), ("kill", "worker:1"),
            ("preempt", "worker:0"), ("preempt", "worker:1"), *hangs)
