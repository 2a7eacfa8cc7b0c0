"""What the launcher makes of a strategy kind's facts (pure).

A kind says which roles compute, which only serve, how many ps tasks it
needs and whether its updates wait for each other (``strategies/kinds.py``).
From those alone this module derives the launcher's and the soak's policy:
how many tasks of each role a simulated cluster gets, whose exit decides the
job, and which faults a job survives with every recovery flag on. A new kind
gets all three without a line here.
"""

from __future__ import annotations

from protocol import ConfigError
from strategies.kinds import StrategyKind

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


def decides(kind: StrategyKind, task: str) -> bool:
    """Whether ``task``'s exit decides the job's outcome (first failure wins).

    Serving tasks do not: they run until the chief is gone, and a lost
    serving worker's steps are rescheduled on the others. Every task of a
    kind without servers runs every step, so each one decides.
    """
    return task.partition(":")[0] not in kind.serving_roles


def survivable_faults(kind: StrategyKind) -> tuple[tuple[str, str], ...]:
    """The (action, task) faults a two-worker job of ``kind`` survives with the
    launcher's recovery flags on (``--restart-tasks`` where workers may rejoin,
    ``--max-restarts``); the soak draws from them.
    """
    if kind.single_process:
        return ()
    if kind.asynchronous:
        # A lost worker's steps go to the others and it is restarted; a lost
        # ps or chief ends the attempt, and the relaunch resumes.
        return (("kill", "worker:0"), ("kill", "worker:1"), ("preempt", "worker:1"),
                ("kill", "ps:0"), ("kill", "chief:0"), ("preempt", "chief:0"))
    if kind.aggregates_gradients:
        # With the default K = N a lost worker stalls every update until it
        # is back (--restart-tasks) or the chief gives up (exit 75) and a
        # relaunch resumes: the two recoveries shown to hold for this kind.
        return (("kill", "worker:1"), ("preempt", "chief:0"))
    # All-reduce: any lost or preempted worker ends the attempt; the
    # relaunch resumes from the checkpoint.
    return (("kill", "worker:0"), ("kill", "worker:1"),
            ("preempt", "worker:0"), ("preempt", "worker:1"))
