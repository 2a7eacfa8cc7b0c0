"""The Python API: ``fit`` and ``launch``, a typed ``Result``, one ``TfdistError``.

The commands are a thin layer over the same library calls: ``fit`` in one
process is ``tfdist-train`` (``tfdist.training.run``), ``fit(workers=N)`` and
``launch`` are ``tfdist-launch`` (``tfdist.launcher.job``). Their options are
the commands' flags as typed groups (``TrainOptions``: train.py's; ``Cluster``,
``Faults``, ``Recovery``, ``Limits``: launch.py's), declared once
(``tfdist.flags``): the same names, the same defaults. Every refusal the
commands print as one ``error:`` line is raised here as :class:`TfdistError`
with that line and the command's exit code; nothing here reads ``sys.argv``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from tfdist import protocol
from tfdist.protocol import ConfigError, Exit

if TYPE_CHECKING:  # the groups' modules load when a run starts: `import tfdist` stays cheap
    from tfdist.launcher.config import Cluster, Faults, Limits, Recovery
    from tfdist.options import TrainOptions


class TfdistError(Exception):
    """A run that could not start or did not finish: the one line and the exit code
    the command line would have ended with (``protocol.Exit``). Every message starts
    with ``error: ``, as the commands' lines do."""

    PREFIX = "error: "

    def __init__(self, message: str, exit_code: int):
        message = message if message.startswith(self.PREFIX) else self.PREFIX + message
        super().__init__(message)
        self.message = message
        self.exit_code = int(exit_code)


@dataclass(frozen=True)
class MemberOutcome:
    """One cluster member of a launched job, from the launcher's records."""

    member: str  # "chief:0", "worker:1", ...
    steps: int | None = None  # steps it ran (computing tasks)
    share: float | None = None  # its fraction of the job's steps
    peak_rss_bytes: int | None = None
    restarts: int = 0


@dataclass(frozen=True)
class Result:
    """What a finished run wrote: the results record, its paths and, launched, each member."""

    model_dir: str
    record: Mapping[str, Any]  # results.json, as written (protocol.Results)
    exit_code: int = Exit.OK
    members: tuple[MemberOutcome, ...] = ()  # empty in one process
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
        members = tuple(MemberOutcome(member=name, steps=(per_task.get(name) or {}).get("steps"),
                                  share=(per_task.get(name) or {}).get("share"),
                                  peak_rss_bytes=rss.get(name), restarts=restarts.get(name, 0))
                      for name in sorted(set(per_task) | set(rss)))
        return cls(model_dir=model_dir, record=record, exit_code=exit_code, members=members,
                   launch=outcome)


def _typed(value, cls, name: str):
    """``value`` as the typed group ``cls`` (None: its defaults); TfdistError otherwise."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TfdistError(f"{name}= takes a tfdist.{cls.__name__}(...), not "
                          f"{type(value).__name__}; e.g. {name}=tfdist.{cls.__name__}("
                          f"{next(iter(dataclasses.fields(cls))).name}=...)", Exit.BAD_INPUT)
    return value


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


def fit(task="mnist-cnn", strategy: str = "auto", *, workers: int = 0, ps: int = 0,
        chief: bool = False, options: TrainOptions | None = None, callbacks=None) -> Result:
    """Train ``task`` and evaluate it; the run's :class:`Result`.

    ``task``: a built-in name, ``"package.module[:NAME]"``, ``"path/to/task.py"``, or (in
    one process) the task object itself. Without ``workers``, one process; with
    ``workers=N`` (and ``ps=M``, ``chief=True``), a local cluster of real processes as
    ``tfdist-launch`` starts it. ``strategy``: as ``train.py --strategy``; ``auto`` picks
    as train.py does (ps with ps tasks, multiworker with several workers, else
    mirrored) and says which in one line. ``options``: a :class:`TrainOptions`, the
    training options (``steps``, ``epochs``, ``seed``, ``model_dir``: default
    ``runs/<strategy>``, ...), each one of ``train.py``'s flags.
    ``callbacks``: Keras callbacks, as ``model.fit(callbacks=...)``, in place of the task's
    ``callbacks()``; with ``workers=N`` they are pickled and run on the cluster's chief
    (``--callbacks-file``), so each must be picklable and importable there.
    Raises :class:`TfdistError`.
    """
    from tfdist.launcher.config import Cluster
    from tfdist.options import TrainOptions

    options = _typed(options, TrainOptions, "options")
    if workers:
        spec, cluster = _task_spec(task), Cluster(workers=workers, ps=ps, chief=chief)
        if callbacks is None:
            return launch(strategy, spec, cluster=cluster, options=options)
        return _launch_with_callbacks(strategy, spec, cluster, options, list(callbacks))
    if callbacks is not None:
        task, options = _with_callbacks(task, list(callbacks), options)
    if ps or chief:
        raise TfdistError(f"ps={ps}, chief={chief} need a cluster: give workers=N too",
                          Exit.BAD_INPUT)
    return _fit_here(task, strategy, options)


def _launch_with_callbacks(strategy, spec, cluster, options, callbacks: list) -> Result:
    """``launch`` with ``callbacks`` pickled for the chief (``--callbacks-file``), in a
    directory of this process's that is removed when the job ends."""
    import shutil
    import tempfile

    from tfdist.training.loop.callbacks import ship

    directory = tempfile.mkdtemp(prefix="tfdist-callbacks-")
    try:
        try:
            path = ship(callbacks, directory)
        except ConfigError as err:
            raise TfdistError(str(err), Exit.BAD_INPUT) from None
        return launch(strategy, spec, cluster=cluster,
                      options=dataclasses.replace(options, callbacks_file=path))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class _TaskWithCallbacks:
    """A task whose ``callbacks()`` are the ones ``fit`` was given; the rest is the task's."""

    def __init__(self, task, callbacks: list, name: str):
        self._task, self._callbacks, self.__name__ = task, callbacks, name

    def __getattr__(self, name):
        return getattr(self._task, name)

    def callbacks(self):
        return self._callbacks


def _with_callbacks(task, callbacks: list, options):
    """The task with ``callbacks`` as its own, and the options left to apply."""
    if isinstance(task, (str, os.PathLike)):
        from tfdist.training.workload import tasks

        try:
            spec = tasks.parse_spec(os.fspath(task), tuple(options.task_options))
            loaded = tasks.load(spec, options.data_dir)
        except ConfigError as err:
            raise TfdistError(str(err), Exit.BAD_INPUT) from None
        # The task is configured already.
        return (_TaskWithCallbacks(loaded, callbacks, os.fspath(task)),
                dataclasses.replace(options, task_options=()))
    return _TaskWithCallbacks(task, callbacks,
                              getattr(task, "__name__", None) or type(task).__name__), options


def _fit_here(task, strategy: str, options) -> Result:
    from tfdist.strategies import kinds
    from tfdist.strategies.tf_config import LOCAL
    from tfdist.training.config import TrainConfig
    from tfdist.training.run import failure, run

    one_process = sorted(n for n, k in kinds.all_kinds().items() if k.single_process)
    try:
        kind = kinds.resolve(strategy, LOCAL) if strategy in kinds.names() else None
    except ConfigError:
        kind = None
    if kind is None or not kind.single_process:
        raise TfdistError(
            f"strategy {strategy!r} in this process: it needs a cluster or is not known; use "
            f"auto or one of {', '.join(one_process)}, or give workers=N for a local cluster",
            Exit.BAD_INPUT)
    # The one rule (protocol.default_model_dir), as train.py resolves it; ``auto`` stays
    # auto so the run itself says, once, what it chose.
    model_dir = options.model_dir or protocol.default_model_dir(kind.name)
    obj = None if isinstance(task, (str, os.PathLike)) else task
    name = (os.fspath(task) if obj is None else
            getattr(task, "__name__", None) or type(task).__name__)
    try:
        record = run(TrainConfig.from_options(options, strategy=strategy, task=name,
                                              model_dir=model_dir), task=obj)
    except (ConfigError, protocol.UsageError) as err:
        raise TfdistError(str(err), Exit.BAD_INPUT) from None
    except Exception as err:
        found = failure(err)
        if found is None:
            raise
        raise TfdistError(found.line, found.code) from None
    return Result(model_dir=model_dir, record=record)


def launch(strategy: str = "auto", task=None, *, cluster: Cluster | None = None,
           faults: Faults | None = None, recovery: Recovery | None = None,
           limits: Limits | None = None, options: TrainOptions | None = None) -> Result:
    """Run a simulated cluster of real processes on this machine, as ``tfdist-launch`` does.

    Each argument is one typed group, the same fields as ``launch.py``'s flags:
    ``cluster``: a :class:`Cluster` (``workers``, ``ps``, ``chief``, simulated ``hosts``
    and their ``link_rate``, ``engine="ray"``, ...); ``faults``: :class:`Faults`
    (``kill=("worker:1@step=100",)``, ``preempt``, ``hang``, ``partition``, ``slow``,
    ``memory_limit``); ``recovery``: :class:`Recovery` (``restart_tasks``,
    ``max_restarts``, ``min_workers``/``rejoin_timeout``: go on without a worker whose host
    is lost, and with it again when it is back, ...); ``limits``: :class:`Limits` (``timeout``: none unless given,
    ``grace``); ``options``: :class:`TrainOptions`, every task's training options
    (``model_dir`` default ``runs/<strategy>``). ``strategy`` ``auto`` picks as
    ``train.py`` does and says which. Returns the chief's :class:`Result` with each
    task's outcome; raises :class:`TfdistError`.
    """
    from tfdist.launcher.config import Cluster, Faults, LaunchRequest, Limits, MemberArgs, Recovery
    from tfdist.launcher.checks import MemberCheckFailed
    from tfdist.launcher.job import choose_kind, run_request
    from tfdist.launcher.plan import LaunchError
    from tfdist.options import TrainOptions

    options = _typed(options, TrainOptions, "options")
    request = LaunchRequest(
        strategy=strategy, cluster=_typed(cluster, Cluster, "cluster"),
        faults=_typed(faults, Faults, "faults"), recovery=_typed(recovery, Recovery, "recovery"),
        limits=_typed(limits, Limits, "limits"),
        member=MemberArgs(task=None if task is None else _task_spec(task), options=options))
    try:
        kind = choose_kind(request)
        code = run_request(request)
    except MemberCheckFailed as err:
        raise TfdistError(err.line, err.code) from None
    except (LaunchError, ConfigError) as err:
        raise TfdistError(str(err), Exit.BAD_INPUT) from None
    model_dir = options.model_dir or protocol.default_model_dir(kind.name)
    if code != Exit.OK:
        meaning = protocol.EXIT_MEANINGS.get(code, "the job failed")
        raise TfdistError(f"the {kind.name} job in {model_dir} ended with exit code "
                          f"{int(code)} ({meaning}); its tasks' lines above say why", code)
    return Result.from_model_dir(model_dir, exit_code=code)


def __getattr__(name):
    # The typed groups, imported when first named (tfdist/__init__.py exports them).
    if name in ("Cluster", "Faults", "Recovery", "Limits"):
        from tfdist.launcher import config

        return getattr(config, name)
    if name == "TrainOptions":
        from tfdist.options import TrainOptions

        return TrainOptions
    if name == "Task":
        # The task contract (build_model(), dataset(split); configure() optional), to
        # type a task of yours against; TensorFlow-free.
        from tfdist.training.workload.tasks import Task

        return Task
    raise AttributeError(f"module 'tfdist.api' has no attribute {name!r}")


__all__ = ["fit", "launch", "Result", "MemberOutcome", "TfdistError", "Cluster", "Faults",
           "Recovery", "Limits", "TrainOptions", "Task"]
