"""What a run tells people (progress lines, TensorBoard) and programs (events).

The controller decides when; this module only says it.
"""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import dataclass

import keras
import tensorflow as tf

from tfdist import linux, protocol
from tfdist.training.loop.evaluation import Evaluator, split_metrics, weights_sha256

SUMMARY_KEYS = (
    "strategy", "task", "num_workers", "num_ps", "replicas_in_sync", "global_steps",
    "test_accuracy", "test_loss", "examples_per_sec", "wall_seconds", "weights_sha256",
)


def summary_line(results: dict) -> str:
    parts = []
    for key in SUMMARY_KEYS:
        value = results.get(key)
        if key == "test_accuracy" and value is None:
            continue  # a task without an accuracy metric: its metrics follow
        if isinstance(value, float):
            value = f"{value:.4f}" if key.startswith("test_") else f"{value:.1f}"
        parts.append(f"{key}={value}")
    for name, value in (results.get("test_metrics") or {}).items():
        if name != "accuracy":
            parts.append(f"test_{name}={value:.4f}")
    return "SUMMARY " + " ".join(parts)


def metrics_text(values: dict[str, float], prefix: str = "") -> str:
    return " ".join(f"{prefix}{k} {v:.4f}" for k, v in values.items())


class Throughput:
    """Steps/s and examples/s since the last report, and overall."""

    def __init__(self, examples_per_step: int, start_step: int):
        self.examples_per_step = examples_per_step
        self.start_time = self.last_time = time.perf_counter()
        self.start_step = self.last_step = start_step

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` spent on something else (evaluation) out of the rates."""
        self.start_time += seconds
        self.last_time += seconds

    def tick(self, step: int) -> tuple[float, float]:
        now = time.perf_counter()
        rate = (step - self.last_step) / max(now - self.last_time, 1e-9)
        self.last_time, self.last_step = now, step
        return rate, rate * self.examples_per_step

    def overall(self, step: int) -> tuple[float, float]:
        elapsed = max(time.perf_counter() - self.start_time, 1e-9)
        return elapsed, (step - self.start_step) * self.examples_per_step / elapsed


def flat_scalars(prefix: str, value) -> dict[str, float]:
    """TensorBoard scalars from a progress field: nested dicts become paths
    (``train/steps_per_worker/worker:0``); anything not a number is left out."""
    if isinstance(value, bool) or value is None:
        return {}
    if isinstance(value, (int, float)):
        return {prefix: value}
    if isinstance(value, dict):
        out: dict[str, float] = {}
        for key, sub in value.items():
            out.update(flat_scalars(f"{prefix}/{key}", sub))
        return out
    return {}


def run_hparams(plan) -> dict:
    """The run's hyperparameters for TensorBoard's HParams dashboard (scalars and strings)."""
    flags = {k: v for k, v in plan.defining_flags().items() if v is not None}
    return {
        **flags,
        "steps_per_execution": plan.steps_per_execution,
        "num_workers": plan.cluster.num_workers, "num_ps": plan.cluster.num_ps,
        "gradients_per_update": plan.gradients_per_update,
    }


class Reporter:
    """Progress lines and events on every task; TensorBoard on the chief only."""

    def __init__(self, plan, checked, member: str, is_chief: bool, start_step: int,
                 started: float | None = None, members=None):
        self.plan, self.checked = plan, checked
        self.member, self.is_chief = member, is_chief
        # The members that share each evaluation (training.loop.evaluation.EvalMembers),
        # or None: the chief evaluates alone.
        self.members = members
        self.total = plan.total_steps
        self.epoch_of = plan.schedule(start_step).epoch
        self.throughput = Throughput(plan.global_batch_size * plan.accumulation_steps, start_step)
        self.events = protocol.EventLog(member)
        self.writer = (
            tf.summary.create_file_writer(os.path.join(plan.config.model_dir, "logs"))
            if is_chief else None
        )
        # The eval curve's clock starts with the process's work, startup included.
        self.started = time.perf_counter() if started is None else started
        self.eval_seconds = 0.0
        self.curve: list[dict] = []  # test metrics against training time
        self._eval: Evaluator | None = None
        self._start_step = start_step
        # The validation split's curve ({"step", "epoch", "val_loss", "val_<metric>"...}).
        self.val_curve: list[dict] = []
        self._val: Evaluator | None = None

    def hparams(self, values: dict) -> None:
        """Record the run's hyperparameters once (the chief; TensorBoard's HParams tab)."""
        if self.writer is None:
            return
        from tensorboard.plugins.hparams import api as hp

        with self.writer.as_default():
            hp.hparams(values)

    def clock(self) -> float:
        """Seconds of this task's work so far, evaluations left out."""
        return time.perf_counter() - self.started - self.eval_seconds

    def steady_from(self, step: int) -> None:
        """Rates count from here: the first call (tracing, connecting) is startup."""
        self.rates_from(step)
        # resumed_from: the checkpoint's step this process started at (0: a fresh
        # run) and this process; the soak checks each relaunch against them (bench/soak.py).
        self.events.emit(protocol.STARTED, step, resumed_from=self._start_step, pid=os.getpid())

    def rates_from(self, step: int) -> None:
        """Rates count from here on (a trainer settled after its first call)."""
        self.throughput = Throughput(self.plan.global_batch_size * self.plan.accumulation_steps, step)

    def progress(self, step: int, scalars: dict, extra: str = "", fields: dict | None = None,
                 learning_rate: float | None = None) -> None:
        steps_per_sec, examples_per_sec = self.throughput.tick(step)
        elapsed = self.clock()
        done = step - self._start_step
        eta = (self.total - step) * elapsed / done if done > 0 else float("nan")
        text = metrics_text(scalars)
        lr = f" lr {learning_rate:.2e}" if learning_rate is not None else ""
        print(
            f"step {step}/{self.total} epoch {self.epoch_of(step)} {text}{lr} "
            f"steps/s {steps_per_sec:.1f} examples/s {examples_per_sec:.0f} "
            f"elapsed {elapsed:.0f}s eta {eta:.0f}s{extra}",
            flush=True,
        )
        self.events.emit(protocol.PROGRESS, step, total=self.total, steps_per_sec=steps_per_sec,
                         examples_per_sec=examples_per_sec, **scalars, **(fields or {}))
        if self.writer is not None:
            with self.writer.as_default(step=step):
                for key, value in scalars.items():
                    tf.summary.scalar(f"train/{key}", value)
                tf.summary.scalar("train/examples_per_sec", examples_per_sec)
                if learning_rate is not None:
                    tf.summary.scalar("train/learning_rate", learning_rate)
                for key, value in (fields or {}).items():
                    for name, number in flat_scalars(f"train/{key}", value).items():
                        tf.summary.scalar(name, number)

    def evaluator(self) -> Evaluator:
        """The task's loss and metrics on its test split (one, reused: no retracing)."""
        if self._eval is None:
            self._eval = Evaluator(self.checked.task, self.checked.local_model,
                                   members=self.members, member=self.member)
        return self._eval

    def prepare_evaluation(self) -> None:
        """The test split's evaluation prepared ahead (``Evaluator.prepare``), at a point
        every member sharing it reaches: its test function and all-reduce traced then,
        in the startup, not in the first evaluation."""
        if self.evaluates and self.checked.not_evaluated is None:
            self.evaluator().prepare()

    @property
    def evaluates(self) -> bool:
        """Whether this member takes part in evaluations: the chief, and every member
        sharing them (each must then evaluate when the others do)."""
        return self.is_chief or self.members is not None

    def evaluate(self, step: int, model) -> None:
        """Every test metric now; its time is left out of every rate and clock.

        Nothing for a model Keras's evaluate cannot run on (the end of the run says so).
        A member sharing the evaluation with the chief adds its batches and says nothing."""
        if self.checked.not_evaluated is not None:
            return
        t0, seconds = time.perf_counter(), self.clock()
        values = self.evaluator()(model)
        if self.is_chief:
            self._report_evaluation(step, values, seconds)
        spent = time.perf_counter() - t0
        self.eval_seconds += spent
        self.throughput.pause(spent)

    def _report_evaluation(self, step: int, values: dict, seconds: float) -> None:
        loss, metrics = split_metrics(values)
        self.add_point(step, metrics, seconds)
        print(f"eval step {step} {metrics_text(metrics, 'test_')} test_loss {loss:.4f} "
              f"at {self.curve[-1]['seconds']:.1f}s", flush=True)
        self.events.emit(protocol.EVAL, step, test_accuracy=metrics.get("accuracy"),
                         test_loss=loss, test_metrics=metrics)
        if self.writer is not None:
            with self.writer.as_default(step=step):
                for name, value in metrics.items():
                    tf.summary.scalar(f"test/{name}", value)
                tf.summary.scalar("test/loss", loss)

    def validate(self, step: int, model) -> dict[str, float]:
        """The validation split's loss and metrics now, as fit's ``val_*`` logs; a line,
        an event, TensorBoard's ``val/`` scalars; its time left out of every rate.
        Nothing (no ``val_*``) for a model Keras's evaluate cannot run on; nothing
        said by a member sharing the evaluation with the chief."""
        if self.checked.not_evaluated is not None:
            return {}
        t0 = time.perf_counter()
        if self._val is None:
            self._val = Evaluator(self.checked.task, self.checked.local_model,
                                  split="validation", members=self.members, member=self.member)
        values = {f"val_{k}": v for k, v in self._val(model).items()}
        if self.is_chief:
            self.val_curve.append({"step": step, "epoch": self.epoch_of(step),
                                   **{k: round(v, 5) for k, v in values.items()}})
            print(f"validation step {step} epoch {self.epoch_of(step)} "
                  + " ".join(f"{k} {v:.4f}" for k, v in values.items()), flush=True)
            self.events.emit(protocol.EVAL, step, validation=values)
            if self.writer is not None:
                with self.writer.as_default(step=step):
                    for name, value in values.items():
                        tf.summary.scalar(f"val/{name[4:]}", value)
        spent = time.perf_counter() - t0
        self.eval_seconds += spent
        self.throughput.pause(spent)
        return values

    def add_point(self, step: int, metrics: dict[str, float], seconds: float | None = None) -> None:
        seconds = self.clock() if seconds is None else seconds
        point = {"step": step, "seconds": round(seconds, 3),
                 "test_metrics": {k: round(v, 5) for k, v in metrics.items()}}
        if "accuracy" in metrics:
            point["test_accuracy"] = round(metrics["accuracy"], 5)
        self.curve.append(point)

    def checkpoint(self, step: int, path: str) -> None:
        """The line (and event) that ``launch.py --kill ...@step=N`` and the tests wait for."""
        print(f"checkpoint saved at step {step}: {path}", flush=True)
        self.events.emit(protocol.CHECKPOINT, step, path=path)

    def final(self, results: dict) -> None:
        if self.writer is not None:
            with self.writer.as_default(step=results["global_steps"]):
                for name, value in (results.get("test_metrics") or {}).items():
                    tf.summary.scalar(f"test/{name}", value)
                if results["test_loss"] is not None:  # None: not evaluated
                    tf.summary.scalar("test/loss", results["test_loss"])
            self.writer.close()
        print(summary_line(results), flush=True)
        self.events.emit(protocol.DONE, results["completed_steps"],
                         test_accuracy=results["test_accuracy"],
                         test_metrics=results.get("test_metrics"))


@dataclass(frozen=True)
class RunTimes:
    """The controller's clock for the record: seconds, and the steady state's steps and rate."""

    startup: float
    train: float
    wall: float
    steady_steps: int
    examples_per_sec: float


def results_record(plan, trainer, reporter, model, values: dict, specific: dict,
                   times: RunTimes, stopped_by: str | None = None,
                   train_metrics: dict | None = None,
                   not_evaluated: str | None = None) -> protocol.Results:
    """The chief's results record: the plan's settings, the trainer's counts and
    ``specific`` fields, the final evaluation ``values`` of ``model`` (the local copy;
    none when ``not_evaluated`` says why), the last training logs, the reporter's
    curves and ``times``."""
    loss, test_metrics = split_metrics(values)
    if not_evaluated is not None:
        loss = None
    ran = trainer.completed - trainer.start_step
    info, opt, config, cluster = trainer.task.info, plan.optimizer, plan.config, plan.cluster
    return protocol.Results(
        strategy=plan.kind.name,
        task=plan.task.name,
        optimizer=opt.name if opt.library else type(trainer.state.optimizer).__name__.lower(),
        learning_rate=opt.learning_rate if opt.library else _rate(trainer.state.optimizer),
        lr_schedule=opt.schedule if opt.library else "task's own",
        num_workers=len(plan.kind.training_members(cluster)),
        num_ps=cluster.num_ps,
        replicas_in_sync=plan.replicas,
        global_batch_size=plan.global_batch_size,
        steps_per_execution=plan.steps_per_execution,
        seed=config.seed,
        completed_steps=trainer.completed,
        steps_this_run=ran,
        resumed_from_step=trainer.start_step,
        startup_seconds=round(times.startup, 3),
        train_seconds=round(times.train, 3),
        steady_steps=times.steady_steps,
        examples_per_sec=times.examples_per_sec,
        wall_seconds=round(times.wall, 3),
        eval_curve=reporter.curve,
        eval_seconds=round(reporter.eval_seconds, 3),
        test_accuracy=test_metrics.get("accuracy"),
        test_loss=loss,
        test_metrics=test_metrics,
        train_examples=info.train_examples,
        test_examples=info.test_examples,
        weights_sha256=weights_sha256(model),
        tf_version=tf.__version__,
        keras_version=keras.__version__,
        # Linux reports ru_maxrss in KiB.
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        trainable_params=count_trainable(model),
        gradient_dtype=config.gradient_dtype,
        gradient_accumulation_steps=plan.accumulation_steps,
        membership=protocol.membership_from_env(),
        evaluation=reporter.evaluator().record if not_evaluated is None else None,
        extra=dict(info.extra_results, **validation_results(reporter.val_curve),
                   **({"stopped_by": stopped_by} if stopped_by else {}),
                   # The last training logs, as fit's History ends with them.
                   train_metrics={k: round(v, 6) for k, v in (train_metrics or {}).items()},
                   **({"not_evaluated": not_evaluated} if not_evaluated else {})),
        **specific,
    )


def validation_results(curve: list[dict]) -> dict:
    """The validation split's last ``val_*`` values and its curve, for results.json."""
    if not curve:
        return {}
    last = {k: v for k, v in curve[-1].items() if k.startswith("val_")}
    return {"val_metrics": last, "val_curve": curve}


def count_trainable(model) -> int:
    """Trainable parameters: the elements of every trainable weight (a split one counted once)."""
    return int(sum(math.prod(w.shape) for w in model.trainable_weights))


def _rate(optimizer) -> float | None:
    """A task's own optimizer's current rate, where it can be read as a number."""
    try:
        # Through NumPy: float() refuses a MirroredVariable (multiworker's rate).
        return float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    except Exception:  # pylint: disable=broad-except
        return None


def own_peak_rss() -> int:
    """This process's peak resident bytes so far (``VmHWM``); 0 without ``/proc``."""
    return linux.vm_hwm_bytes("self") or 0
