"""The sidecar evaluator: a member outside the training cluster that follows its checkpoints.

TF_CONFIG's ``evaluator`` task (TensorFlow's parameter-server tutorial,
Kubeflow's TFJob; ``launch.py --evaluator`` starts one) runs ``train.py`` as
this: it reads ``--model-dir``, never writes to the cluster, and nobody waits
for it. Each new checkpoint is restored into a local copy of the task's model
and evaluated over the whole split in this process (``Evaluator``, exact as
one ``model.evaluate``). Keras 3 dropped tf_keras's ``SidecarEvaluator``; this
is its place, as that one did: when several checkpoints appeared during one
evaluation only the newest is evaluated next, so a slow evaluator falls behind
by skipping, never by queueing.

It evaluates the task's ``validation`` split when it has one, else the test
split, and writes ``val_*`` scalars to TensorBoard (``<model-dir>/logs/eval``)
at each checkpoint's step. It ends after the final checkpoint: the one at the
run's last step, or the one the chief's results record (written after this
evaluator started) names as its last. Its history then goes into the run's
``results.json`` (``Results.sidecar_evaluation``), written whole, after the chief's
own last write; an evaluator killed before that changes nothing of the run.
"""

from __future__ import annotations

import os
import time

from tfdist import protocol
from tfdist.protocol import ConfigError

# How often the run directory is looked at: a checkpoint takes seconds to train
# and to evaluate; a second's delay is noise next to it.
POLL_SECONDS = 0.5


def refusal(plan) -> str | None:
    """Why this run's checkpoints cannot be followed here; None when they can."""
    if plan.pipeline is not None:
        return ("a pipeline's checkpoint holds its stages, not the task's model; evaluate "
                "after training (the chief does) or train under another strategy")
    return None


class Sidecar:
    """Follows one run directory's checkpoints and evaluates each newest one."""

    def __init__(self, plan, checked, timeout: float):
        from tfdist.training.loop.evaluation import Evaluator

        self.plan, self.checked, self.timeout = plan, checked, timeout
        self.model_dir = plan.config.model_dir
        self.ckpt_dir = os.path.join(self.model_dir, "checkpoints")
        self.member = plan.cluster.member_name
        self.split = "validation" if checked.has_validation else "test"
        self.evaluator = Evaluator(checked.task, checked.local_model, split=self.split,
                                   member=self.member)
        self.events = protocol.EventLog(self.member)
        self.history: list[dict] = []
        self.started = time.time()
        self._writer = None
        self._built = None
        self._failures: dict[str, int] = {}

    def run(self) -> dict:
        """Evaluate until the final checkpoint; the record added to results.json."""
        from tfdist.training.loop.survival.checkpoints import candidates, checkpoint_step

        done_step, deadline = None, time.monotonic() + self.timeout
        print(f"{self.member}: following {self.ckpt_dir!r}: the {self.split} split of each "
              f"new checkpoint, until step {self.plan.total_steps}", flush=True)
        while True:
            paths = candidates(self.ckpt_dir) if os.path.isdir(self.ckpt_dir) else []
            newest = paths[0] if paths else None
            if newest is not None and checkpoint_step(newest) != done_step:
                why = self._evaluate(newest)
                if why is None:
                    done_step = checkpoint_step(newest)
                    continue
                self._unreadable(newest, why)
            if done_step is not None and self._finished(done_step):
                break
            if done_step is None and time.monotonic() > deadline:
                raise ConfigError(
                    f"{self.member}: no checkpoint appeared in {self.ckpt_dir!r} within "
                    f"{self.timeout:g} s (--startup-timeout); start the evaluator with the "
                    "training job's --model-dir, or give it a longer --startup-timeout")
            time.sleep(POLL_SECONDS)
        if self._writer is not None:
            self._writer.close()
        return self._record()

    def _finished(self, step: int) -> bool:
        """The run's last checkpoint is evaluated: its final step, or the step the
        chief's results record (written since this evaluator started) ends at."""
        if step >= self.plan.total_steps:
            return True
        path = os.path.join(self.model_dir, "results.json")
        if not _written_since(path, self.started):
            return False
        done = _completed_steps(path)
        return done is not None and done <= step

    def _unreadable(self, path: str, why: str) -> None:
        """A checkpoint that went away while it was read (the chief keeps the newest
        few) is passed over: the next look finds a newer one. One that stays the
        newest and still cannot be read is another model's: one line, exit 2."""
        self._failures[path] = self._failures.get(path, 0) + 1
        if self._failures[path] >= 3:
            raise ConfigError(
                f"{self.member}: checkpoint {path!r} cannot be read into --task="
                f"{self.plan.task.name} ({why}); give the evaluator the flags the training "
                "job was started with")

    def _evaluate(self, path: str) -> str | None:
        """Restore and evaluate one checkpoint; why it could not be read, else None."""
        import tensorflow as tf

        from tfdist.training.loop.survival.recovery import first_line

        state = self._state()
        try:
            state.checkpoint.restore(path).expect_partial()
        except (tf.errors.OpError, ValueError, OSError) as err:
            return first_line(err, 120)
        step = int(state.completed_steps.numpy())
        model = state.model
        started = time.perf_counter()
        values = {f"val_{k}": v for k, v in self.evaluator(model).items()}
        seconds = round(time.perf_counter() - started, 3)
        self.history.append({"step": step, "seconds": seconds,
                             **{k: round(v, 6) for k, v in values.items()}})
        print(f"{self.member}: checkpoint step {step} "
              + " ".join(f"{k} {v:.4f}" for k, v in values.items()), flush=True)
        self.events.emit(protocol.EVAL, step, validation=values)
        self._scalars(step, values)
        return None

    def _state(self):
        """The training state as the trainers build it (``loop.state.build_state``),
        here outside any strategy: the same checkpoint layout (split layers
        included, each read whole), restored into it and copied to the local model."""
        if self._built is None:
            import tensorflow as tf

            from tfdist.training.loop.state import build_state

            self._built = build_state(self.plan, self.checked.task, tf.distribute.get_strategy(),
                                      example=self.checked.example,
                                      own_optimizers=self.checked.own_optimizers)
        return self._built

    def _scalars(self, step: int, values: dict) -> None:
        import tensorflow as tf

        if self._writer is None:
            self._writer = tf.summary.create_file_writer(
                os.path.join(self.model_dir, "logs", "eval"))
        with self._writer.as_default(step=step):
            for name, value in values.items():
                tf.summary.scalar(name, value)
        self._writer.flush()

    def _record(self) -> dict:
        return {"member": self.member, "split": self.split,
                "examples": self.evaluator.examples, "evaluations": self.history}


def check(plan) -> None:
    """ConfigError (one line) when ``plan``'s checkpoints cannot be followed here."""
    why = refusal(plan)
    if why is not None:
        raise ConfigError(f"{plan.cluster.member_name}: the sidecar evaluator cannot follow "
                          f"this run: {why}")


def follow(plan, checked, timeout: float) -> dict:
    """Run the sidecar on ``plan``'s run directory; add its record to results.json."""
    check(plan)
    sidecar = Sidecar(plan, checked, timeout)
    record = sidecar.run()
    add_to_results(plan.config.model_dir, record)
    return record


def _written_since(path: str, since: float) -> bool:
    try:
        return os.path.getmtime(path) >= since
    except OSError:
        return False


def _completed_steps(path: str) -> int | None:
    try:
        return protocol.Results.load(path).completed_steps
    except (OSError, ValueError, TypeError):
        return None  # not written yet, or being replaced


def add_to_results(model_dir: str, record: dict) -> None:
    """The evaluator's history into the run's results.json, once the chief wrote the
    record of the step last evaluated (a record of an earlier, shorter run of the
    directory is the chief's to replace). This runs after the final checkpoint, so
    the chief's last write is done or near; a record not there within a minute is
    left alone."""
    import dataclasses

    path = os.path.join(model_dir, "results.json")
    last = record["evaluations"][-1]["step"]
    deadline = time.monotonic() + 60
    while _completed_steps(path) != last:
        if time.monotonic() > deadline:
            print(f"{record['member']}: no results.json of step {last} in {model_dir!r} to add "
                  "the evaluation history to; it is in this member's output above", flush=True)
            return
        time.sleep(POLL_SECONDS)
    results = protocol.Results.load(path)
    dataclasses.replace(results, sidecar_evaluation=record).write(path)
