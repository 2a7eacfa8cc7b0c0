"""One task's part of a run: checked, then served, trained or skipped; its faults as exit codes.

The library behind ``tfdist-train`` (``tfdist.cli.train`` reads the flags)
and ``tfdist.fit`` in one process. Exit codes and their one lines
(``failure``): bad input 2, a lost peer task 75 (relaunch to resume), a
preemption 42 (checkpoint saved at an agreed step), a NaN or infinite loss
65 (the last good checkpoint kept), a full or read-only ``--model-dir`` 74,
an ``--export`` that fails 73 (training's outputs kept).
The chief holds ``<model-dir>/.lock`` while it runs.
"""

from __future__ import annotations

import json
import os
import sys
from typing import NamedTuple

from tfdist.protocol import ConfigError, Exit
from tfdist.strategies.factory import build_kind
from tfdist.training.workload import contract
from tfdist.training.workload import tasks
from tfdist.training.config import TrainConfig, check_model_dir
from tfdist.training.plan import RunPlan, RunRequest, request, resolve


class Failure(NamedTuple):
    """How a run that raised ends: its exit code and the one line that says why."""

    code: int
    line: str
    to_stderr: bool = True


def _physical_gpus() -> list[str]:
    import tensorflow as tf

    return [d.name for d in tf.config.list_physical_devices("GPU")]


def preflight(run_request: RunRequest, gpus: list[str] | None = None) -> RunPlan:
    """Everything that can be checked before a server starts; the run's plan.

    A built-in task's split sizes are known up front; a user's task is
    imported and inspected here (TensorFlow is imported for that, and to
    list GPUs when ``gpus`` is None). Writes nothing.
    """
    cluster, kind, spec = run_request.config.cluster, run_request.kind, run_request.task
    train_n, test_n = tasks.static_sizes(spec)
    facts, cut_checked = {}, False
    if train_n is None and kind.reads_data(cluster):
        checked = tasks.inspect(spec, tasks.load(spec, run_request.config.data_dir),
                                steps_given=run_request.config.steps is not None)
        contract.check(kind, checked, run_request.config.gradient_dtype)
        train_n, test_n = checked.info.train_examples, checked.info.test_examples
        facts = {**contract.plan_facts(checked),
                 "placed": _why_placed(kind, checked, run_request.config)}
        # Under a pipelined kind why_placed has cut a fresh build of the model as the
        # run will (its one line raised), or found the model trains placed.
        cut_checked = kind.pipelined and kind.trains_uncut_placed
    elif train_n is None:
        # A task that does not read data (a ps, a worker under ps) needs
        # no sizes; its steps are the chief's.
        run_request = run_request.with_config(_with_steps(run_request.config))
    if gpus is None:
        gpus = _physical_gpus()
    plan = resolve(run_request, gpus, train_examples=train_n, test_examples=test_n, **facts)
    check_task_dirs(plan)
    if kind.role(cluster) == "evaluator":
        # launch.py --evaluator: refused by the evaluator's own check, before any start.
        from tfdist.training import sidecar

        sidecar.check(plan)
    if plan.pipeline is not None and not cut_checked and kind.reads_data(cluster):
        # More stages than layers, bad --stages, a model that is not a chain:
        # one line now, not after every worker has started.
        from tfdist.training.pipeline.stages import check_cut

        check_cut(plan, tasks.load(spec, plan.config.data_dir))
    return plan


def _why_placed(kind, checked, config) -> str | None:
    """Why a pipelined kind trains the task's model placed, not cut (None: cut, or not
    pipelined): ``training.pipeline.placed.why_placed``."""
    if not kind.pipelined:
        return None
    from tfdist.training.pipeline.placed import why_placed

    return why_placed(kind, checked, config)


def _with_steps(config: TrainConfig) -> TrainConfig:
    import dataclasses

    return config if config.steps is not None else dataclasses.replace(config, steps=1)


def check_task_dirs(plan: RunPlan) -> None:
    """The chief's run directory is writable, and a resume keeps the run's defining flags."""
    cluster, kind = plan.cluster, plan.kind
    if cluster.is_chief:
        # The chief writes there; an unusable path fails now, not after TF starts.
        check_model_dir(plan.config.model_dir)
        if plan.config.export is not None:
            check_model_dir(plan.config.export, "--export")
    if kind.role(cluster) != "evaluator" and not kind.serves(cluster):
        from tfdist.training.loop.survival.checkpoints import check_run_record

        # A resume with other defining flags is refused by --dry-run too.
        check_run_record(plan.config.model_dir, plan.defining_flags())


def run(config: TrainConfig, as_command: bool = False, task=None) -> dict | None:
    """Run this member's part of the job; the chief returns the results dict.

    Raises ConfigError for bad input before anything is written.
    ``as_command``: the process ends right after (``python train.py``).
    ``task``: a task object to train instead of ``config.task`` (``tfdist.fit``
    in one process).

    The way in, each step once and in this order: the flags read into one
    request → the checks that need no runtime → the member's duty if it does
    not train (serve, or exit) → the strategy, the task inspected, one plan →
    the trainer, under the run lock.
    """
    run_request = request(config, task)
    config = run_request.config  # its run directory resolved
    if config.dry_run:
        # Bad flags are answered before TensorFlow is imported to list GPUs (seconds).
        check_without_runtime(run_request, task)
        print(json.dumps(preflight(run_request).describe(), indent=None, sort_keys=True),
              flush=True)
        return None
    gpus = prepare_process(run_request, task)
    if run_request.kind.role(config.cluster) == "evaluator":
        follow_checkpoints(run_request, task)
        return None
    if serve_or_skip(run_request):
        return None
    plan, bundle, checked, started_ok = build_and_plan(run_request, task, gpus)
    return train_locked(plan, bundle, checked, started_ok, as_command)


def prepare_process(run_request: RunRequest, task=None) -> list[str]:
    """Everything checked without starting TensorFlow's runtime (its start-up takes
    seconds): flags, the run directory and its record, this member's port, the data;
    then the process's environment and devices. Writes nothing; the GPUs to use."""
    config, kind, spec = run_request.config, run_request.kind, run_request.task
    cluster = config.cluster
    check_without_runtime(run_request, task)
    if not cluster.is_local and kind.role(cluster) != "evaluator":
        check_own_port(cluster)
    gpus = _physical_gpus() if kind.role(cluster) in kind.gpu_roles() else []
    for name, value in kind.process_env().items():
        os.environ.setdefault(name, value)

    from tfdist.strategies.devices import configure_devices

    if kind.reads_data(cluster) and task is None and tasks.reads_tfds(spec):
        # One clear line if the data is missing, truncated or corrupt (both
        # splits), read without starting the runtime.
        tasks.load(spec, config.data_dir).check_data()
    configure_devices(kind.gpu_roles(), cluster)
    return gpus


def check_without_runtime(run_request: RunRequest, task=None) -> None:
    """The plan's checks with no GPU listed, where they need no TensorFlow: a
    built-in task, whose split sizes are known up front (a user's task is
    imported and inspected by ``preflight`` itself)."""
    if task is None and tasks.static_sizes(run_request.task)[0] is not None:
        preflight(run_request, gpus=[])


def follow_checkpoints(run_request: RunRequest, task=None) -> None:
    """The evaluator's duty (``training.sidecar``): the task inspected in this process,
    outside any strategy, the run's plan resolved as every member resolves it, then
    each new checkpoint of ``--model-dir`` evaluated until the run's last."""
    from tfdist.training import sidecar

    config, spec = run_request.config, run_request.task
    checked = tasks.inspect(spec, task if task is not None else tasks.load(spec, config.data_dir),
                            steps_given=config.steps is not None)
    plan = resolve(run_request, [], train_examples=checked.info.train_examples,
                   test_examples=checked.info.test_examples, **contract.plan_facts(checked))
    sidecar.follow(plan, checked, config.startup_timeout)


def serve_or_skip(run_request: RunRequest) -> bool:
    """A member that only serves does its duty here (a ps, or a worker under ps,
    serves until the chief is gone); True when it did."""
    cluster, kind = run_request.config.cluster, run_request.kind
    if kind.serves(cluster):
        from tfdist.strategies.server import serve

        serve(cluster, startup_timeout=run_request.config.startup_timeout)
        return True
    return False


def build_and_plan(run_request: RunRequest, task, gpus: list[str]):
    """The strategy built, the task inspected under it, the one ``RunPlan``: (plan, the
    strategy bundle, the checked task, the start-up watchdog's ``done``)."""
    from tfdist.strategies.server import StartupWatchdog

    config, kind, spec = run_request.config, run_request.kind, run_request.task
    cluster = config.cluster
    watchdog = StartupWatchdog(cluster, config.startup_timeout,
                               "connect to every task and run the first step")
    # The strategy first: MultiWorkerMirroredStrategy configures collectives
    # before the runtime starts, and checking the task runs TensorFlow ops.
    kind.detect_stuck_after(cluster, config.stuck_timeout)
    bundle = build_kind(kind, cluster, all_reduce=config.all_reduce,
                        bucket_bytes=config.bucket_bytes)
    checked = tasks.inspect(spec, task if task is not None else tasks.load(spec, config.data_dir),
                            steps_given=config.steps is not None)
    contract.check(kind, checked, config.gradient_dtype)
    info = checked.info
    plan = resolve(run_request, gpus, train_examples=info.train_examples,
                   test_examples=info.test_examples, **contract.plan_facts(checked),
                   placed=_why_placed(kind, checked, config))
    check_task_dirs(plan)
    for note in (plan.strategy_note(), plan.batch_note()):
        if note:
            print(note, flush=True)
    if spec.builtin is None and plan.optimizer.library:
        opt = plan.optimizer
        print(f"task {spec.name}: training with --optimizer {opt.name} at {opt.learning_rate:g} "
              f"({opt.schedule}) instead of the optimizer it compiled, as the flags ask",
              flush=True)
    return plan, bundle, checked, watchdog.done


def train_locked(plan: RunPlan, bundle, checked, started_ok, as_command: bool) -> dict | None:
    """The trainer and its controller (``training.assemble``); the chief holds
    ``<model-dir>/.lock`` meanwhile (the first thing a run writes)."""
    from tfdist.training.assemble import train_and_evaluate
    from tfdist.training.loop.survival.checkpoints import RunLock

    lock = None
    if plan.cluster.is_chief:
        # The first thing written: a second job on this directory stops here.
        os.makedirs(plan.config.model_dir, exist_ok=True)
        lock = RunLock(plan.config.model_dir)
    try:
        return train_and_evaluate(plan, bundle, checked, started_ok, as_command=as_command)
    finally:
        if lock is not None:
            lock.release()


def check_own_port(cluster) -> None:
    """Refuse to start when this task's port is already taken on this host.

    TensorFlow's server listens on every interface, so a port held on any of
    them (by a second task started with the same TF_CONFIG, or anything
    else) fails it with a traceback that names no port. The probe binds the
    wildcard addresses as gRPC does (SO_REUSEADDR: a port in TIME_WAIT after
    a relaunch is free) and lets go at once.
    """
    import errno
    import socket

    port = int(cluster.address.rpartition(":")[2])
    probes = [(socket.AF_INET, "")]
    if socket.has_ipv6:
        probes.append((socket.AF_INET6, "::"))
    for family, wildcard in probes:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no such address family on this host
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((wildcard, port))
                sock.listen(1)
            except OSError as err:
                if err.errno == errno.EADDRNOTAVAIL:
                    continue  # IPv6 switched off: gRPC will not use it either
                why = ("already in use on this host (by another task started with the same "
                       "TF_CONFIG, or another program)" if err.errno == errno.EADDRINUSE
                       else f"not available ({err.strerror})")
                raise ConfigError(
                    f"{cluster.member_name} cannot listen on port {port} (its TF_CONFIG address "
                    f"{cluster.address}): the port is {why}; give every task its own TF_CONFIG "
                    "task and port, or free the port"
                ) from None


def failure(err: Exception) -> Failure | None:
    """The exit code and one line for a survived fault; None for anything else (a bug)."""
    from tfdist.training.loop.survival.recovery import (Diverged, Preempted, StorageFault, TaskLost,
                                   cluster_disagreement, storage_fault)

    disagreement = cluster_disagreement(err)
    if disagreement is not None:
        return Failure(Exit.BAD_INPUT, f"error: {disagreement}")
    from tfdist.training.loop.export import ExportFailed

    if isinstance(err, ExportFailed):
        return Failure(Exit.EXPORT, f"error: {err}")
    if isinstance(err, Diverged):
        return Failure(Exit.DIVERGED, f"error: {err}")
    if isinstance(err, TaskLost):
        return Failure(Exit.TASK_LOST, f"error: {err}")
    if isinstance(err, Preempted):
        return Failure(Exit.PREEMPTED, f"preempted: checkpoint saved at step {err.step}; exiting "
                       f"with code {int(Exit.PREEMPTED)} so the job is relaunched and resumes "
                       "there", to_stderr=False)
    # A write into --model-dir outside the training loop (the first TensorBoard
    # file, a progress event, the lock) on a full or read-only disk, too.
    storage = err if isinstance(err, StorageFault) else storage_fault(err)
    if storage is not None:
        return Failure(Exit.STORAGE, f"error: {storage}")
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(err, tf.errors.UnavailableError):
        # A peer lost before the training loop's own handling starts, e.g. a ps
        # ended while the variables are created on it (its memory limit): a
        # relaunch can succeed, as for a task lost while training.
        first = (str(err).strip().splitlines() or [""])[0][:200]
        return Failure(Exit.TASK_LOST, "error: a peer task became unreachable before training "
                       f"({type(err).__name__}: {first}); relaunch to resume from the last "
                       "checkpoint")
    return None
