"""The Python API: ``fit`` and ``launch``, a typed ``Result``, one ``TfdistError``.

The commands are a thin layer over the same library calls: ``fit`` in one
process is ``tfdist-train`` (``tfdist.training.run``), ``fit(workers=N)`` and
``launch`` are ``tfdist-launch`` (``tfdist.launcher.job``). Every refusal the
commands print as one ``error:`` line is raised here as :class:`TfdistError`
with that line and the command's exit code; nothing here reads ``sys.argv``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from tfdist import protocol
from tfdist.protocol import ConfigError, Exit


class TfdistError(Exception):
    """A run that could not start or did not finish: the one line and the exit code
    the command line would have ended with (``protocol.Exit``)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.message = message
        self.exit_code = int(exit_code)


@dataclass(frozen=True)
class TaskOutcome:
    """One cluster task of a launched job, from the launcher's records."""

    task: str  # "chief:0", "worker:1", ...
    steps: int | None = None  # steps it ran (computing tasks)
    share: float | None = None  # its fraction of the job's steps
    peak_rss_bytes: int | None = None
    restarts: int = 0


@dataclass(frozen=True)
class Result:
    """What a finished run wrote: the results record, its paths and, launched, each task."""

    model_dir: str
    record: Mapping[str, Any]  # results.json, as written (protocol.Results)
    exit_code: int = Exit.OK
    tasks: tuple[TaskOutcome, ...] = ()  # empty in one process
    launch: Mapping[str, Any] | None = None  # launch/outcome.json, when launched

    @property
    def metrics(self) -> dict:
        """The task's compiled metrics on its whole test split, by Keras's names."""
        return dict(self.record.get("test_metrics") or {})

    @property
    def global_step(self) -> int:
        return int(self.record["global_steps"])

    @property
    def strategy(self) -> str:
        return str(self.record["strategy"])

    @property
    def paths(self) -> dict:
        d = self.model_dir
        return {"results": os.path.join(d, "results.json"), "model": os.path.join(d, "model.keras"),
                "checkpoints": os.path.join(d, "checkpoints"), "logs": os.path.join(d, "logs")}

    @classmethod
    def from_model_dir(cls, model_dir: str, exit_code: int = Exit.OK) -> "Result":
        """The records a run left in ``model_dir`` (the launcher's too, when it ran one)."""
        record = protocol.Results.load(os.path.join(model_dir, "results.json")).to_dict()
        outcome_path = os.path.join(model_dir, "launch", "outcome.json")
        if not os.path.exists(outcome_path):
            return cls(model_dir=model_dir, record=record, exit_code=exit_code)
        with open(outcome_path) as f:
            outcome = json.load(f)
        per_task, rss = outcome.get("per_task") or {}, outcome.get("peak_rss_bytes") or {}
        restarts = outcome.get("restarts_per_task") or {}
        tasks = tuple(TaskOutcome(task=name, steps=(per_task.get(name) or {}).get("steps"),
                                  share=(per_task.get(name) or {}).get("share"),
                                  peak_rss_bytes=rss.get(name), restarts=restarts.get(name, 0))
                      for name in sorted(set(per_task) | set(rss)))
        return cls(model_dir=model_dir, record=record, exit_code=exit_code, tasks=tasks,
                   launch=outcome)


def _train_config_fields() -> set[str]:
    from tfdist.training.config import TrainConfig

    return {f.name for f in dataclasses.fields(TrainConfig)} - {"cluster", "dry_run"}


def _check_options(options: Mapping[str, Any]) -> None:
    known = _train_config_fields()
    unknown = sorted(set(options) - known)
    if unknown:
        raise TfdistError(f"unknown option {unknown[0]!r}; fit and launch take the training "
                          f"options {', '.join(sorted(known))}", Exit.BAD_INPUT)


def _task_spec(task) -> str:
    """A task every process can import: a spec string, or where an object comes from."""
    if isinstance(task, (str, os.PathLike)):
        return os.fspath(task)
    if inspect.ismodule(task) and getattr(task, "__file__", None):
        return os.path.abspath(task.__file__)
    module = getattr(task, "__module__", None)
    name = getattr(task, "__qualname__", None)
    if (module and name and module != "__main__" and not module.startswith("_task_")
            and "<locals>" not in name and "." not in name):
        return f"{module}:{name}"
    raise TfdistError(
        f"the task {task!r} exists only in this process, and a cluster's worker processes "
        "cannot import it; pass a module or file instead: tfdist.fit('path/to/task.py', ...) "
        "or tfdist.fit('package.module:NAME', ...)", Exit.BAD_INPUT)


def _train_args(task: str | None, options: Mapping[str, Any]) -> tuple[str, ...]:
    """Training options as every task's ``tfdist-train`` flags."""
    args: list[str] = []
    if task is not None:
        args += ["--task", task]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if name == "task_options":
            for item in ([value] if isinstance(value, str) else value):
                args += ["--task-option", str(item)]
        elif isinstance(value, bool):
            args += [flag] if value else []
        elif value is not None:
            args += [flag, str(value)]
    return tuple(args)


def fit(task="mnist-cnn", strategy: str | None = None, *, workers: int = 0, ps: int = 0,
        chief: bool = False, model_dir: str | None = None, callbacks=None,
        **options) -> Result:
    """Train ``task`` and evaluate it; the run's :class:`Result`.

    ``task``: a built-in name, ``"package.module[:NAME]"``, ``"path/to/task.py"``, or (in
    one process) the task object itself. Without ``workers``, one process: ``strategy``
    ``none`` (default) or ``mirrored``. With ``workers=N`` (and ``ps=M``), a local cluster
    of real processes as ``tfdist-launch`` starts it (``strategy`` defaults to
    ``multiworker``, or ``ps`` with ps tasks). ``options``: the training options
    (``steps``, ``epochs``, ``seed``, ``global_batch_size``, ``task_options``, ...).
    ``callbacks``: Keras callbacks, as ``model.fit(callbacks=...)`` (one process; a
    cluster's tasks take them from the task's own ``callbacks()``).
    Raises :class:`TfdistError`.
    """
    _check_options(options)
    if callbacks is not None and workers:
        raise TfdistError("error: callbacks=[...] are objects of this process, which a "
                          "cluster's tasks cannot receive; give the task a callbacks() "
                          "method instead", Exit.BAD_INPUT)
    if callbacks is not None:
        task = _with_callbacks(task, list(callbacks), options)
    if workers:
        name = _task_spec(task)
        return launch(strategy or ("ps" if ps else "multiworker"), workers=workers, ps=ps,
                      chief=chief, task=name, model_dir=model_dir, **options)
    if ps or chief:
        raise TfdistError(f"ps={ps}, chief={chief} need a cluster: give workers=N too",
                          Exit.BAD_INPUT)
    return _fit_here(task, strategy or "none", model_dir, options)


class _TaskWithCallbacks:
    """A task whose ``callbacks()`` are the ones ``fit`` was given; the rest is the task's."""

    def __init__(self, task, callbacks: list, name: str):
        self._task, self._callbacks, self.__name__ = task, callbacks, name

    def __getattr__(self, name):
        return getattr(self._task, name)

    def callbacks(self):
        return self._callbacks


def _with_callbacks(task, callbacks: list, options: dict):
    if isinstance(task, (str, os.PathLike)):
        from tfdist.training.workload import tasks

        try:
            spec = tasks.parse_spec(os.fspath(task), tuple(options.get("task_options") or ()))
            loaded = tasks.load(spec, options.get("data_dir"))
        except ConfigError as err:
            raise TfdistError(f"error: {err}", Exit.BAD_INPUT) from None
        options.pop("task_options", None)  # the task is configured already
        return _TaskWithCallbacks(loaded, callbacks, os.fspath(task))
    return _TaskWithCallbacks(task, callbacks,
                              getattr(task, "__name__", None) or type(task).__name__)


def _fit_here(task, strategy: str, model_dir: str | None, options: dict) -> Result:
    from tfdist.strategies import kinds
    from tfdist.training.config import TrainConfig
    from tfdist.training.run import failure, run

    one_process = sorted(n for n, k in kinds.all_kinds().items() if k.single_process)
    if strategy not in one_process:
        raise TfdistError(
            f"strategy {strategy!r} in this process: it needs a cluster; use one of "
            f"{', '.join(one_process)}, or give workers=N for a local cluster", Exit.BAD_INPUT)
    if model_dir is None:
        model_dir = os.path.join("runs", strategy)
    obj = None if isinstance(task, (str, os.PathLike)) else task
    name = (os.fspath(task) if obj is None else
            getattr(task, "__name__", None) or type(task).__name__)
    try:
        record = run(TrainConfig(strategy=strategy, task=name, model_dir=model_dir,
                                 **{k: tuple(v) if k == "task_options" else v
                                    for k, v in options.items()}), task=obj)
    except (ConfigError, protocol.UsageError) as err:
        raise TfdistError(f"error: {err}", Exit.BAD_INPUT) from None
    except Exception as err:
        found = failure(err)
        if found is None:
            raise
        raise TfdistError(found.line, found.code) from None
    return Result(model_dir=model_dir, record=record)


def launch(strategy: str, *, workers: int = 2, ps: int = 0, chief: bool = False,
           task: str | None = None, model_dir: str | None = None, hosts: int = 0,
           link_rate: str | None = None, kill=(), preempt=(), hang=(), partition=(), slow=(),
           memory_limit=(), restart_tasks: bool = False, restart_delay: float = 2.0,
           max_restarts: int = 0, min_workers: int | None = None,
           rejoin_timeout: float | None = None, timeout: float = 3600.0, grace: float = 10.0,
           netns: str = "auto", engine: str = "local", address: str | None = None,
           ray_placement: str = "spread", **options) -> Result:
    """Run a simulated cluster of real processes on this machine, as ``tfdist-launch`` does.

    The launcher's features as typed arguments: ``hosts``/``link_rate`` (simulated hosts
    and shaped links), faults (``kill=["worker:1@step=100"]``, ``preempt``, ``hang``,
    ``partition``, ``slow``, ``memory_limit``) and recovery (``restart_tasks``,
    ``max_restarts``; ``min_workers``/``rejoin_timeout``: go on without a worker
    whose host is lost, and with it again when it is back); ``engine="ray"`` runs
    each task as a Ray actor (``address``: a running cluster, else a local instance;
    ``ray_placement``); ``options`` are every task's training options. Returns the
    chief's :class:`Result` with each task's outcome; raises :class:`TfdistError`.
    """
    from tfdist.launcher.config import LaunchRequest
    from tfdist.launcher.job import TaskCheckFailed, run_request
    from tfdist.launcher.plan import LaunchError

    _check_options(options)
    if model_dir is None:
        model_dir = os.path.join("runs", strategy)
    as_tuple = lambda v: (v,) if isinstance(v, str) else tuple(v)  # noqa: E731
    request = LaunchRequest(
        strategy=strategy, workers=workers, ps=ps, chief=chief, hosts=hosts,
        link_rate=link_rate, netns=netns, timeout=timeout, grace=grace,
        kill=as_tuple(kill), preempt=as_tuple(preempt), hang=as_tuple(hang),
        partition=as_tuple(partition), slow=as_tuple(slow), memory_limit=as_tuple(memory_limit),
        restart_tasks=restart_tasks, restart_delay=restart_delay, max_restarts=max_restarts,
        min_workers=min_workers, rejoin_timeout=rejoin_timeout,
        engine=engine, address=address, ray_placement=ray_placement,
        train_args=(*_train_args(None if task is None else _task_spec(task), options),
                    "--model-dir", model_dir))
    from tfdist.strategies import kinds

    if strategy not in kinds.names(include_auto=False):
        raise TfdistError(f"error: strategy {strategy!r} is not one the launcher runs; use one "
                          f"of {', '.join(kinds.names(include_auto=False))}", Exit.BAD_INPUT)
    try:
        code = run_request(request)
    except TaskCheckFailed as err:
        raise TfdistError(err.line, err.code) from None
    except LaunchError as err:
        raise TfdistError(f"error: {err}", Exit.BAD_INPUT) from None
    if code != Exit.OK:
        meaning = protocol.EXIT_MEANINGS.get(code, "the job failed")
        raise TfdistError(f"error: the {strategy} job in {model_dir} ended with exit code "
                          f"{int(code)} ({meaning}); its tasks' lines above say why", code)
    return Result.from_model_dir(model_dir, exit_code=code)


__all__ = ["fit", "launch", "Result", "TaskOutcome", "TfdistError"]
