"""The trainer of ``--strategy pipeline``: model parallelism, and hybrid with ``--pipelines``.

The chief is a client connected to the workers
(``StrategyKind.build``: ``experimental_connect_to_cluster``). It cuts the
task's model into S stages (``training.pipeline.stages``) and builds stage ``s`` of
copy ``p`` under ``tf.device`` of worker ``p*S + s``, with its own optimizer
built in the same scope: the stage's variables and optimizer slots live on
that task, and only activations and their gradients cross the network.

A step is one ``tf.function`` (GPipe): the global batch is split into
P x M micro-batches; each copy pushes its M micro-batches forward through
its stages, then backward in reverse order, each stage's gradients
accumulated on its own task. With ``P > 1`` each stage's accumulated
gradients are averaged over its P copies on the first copy's task and the
same average is applied by every copy's optimizer (identical weights and
slots, so the copies stay identical). One update per step: the same math as
one process at the same global batch (the mean over P x M equal micro-
batches is the batch mean), up to floating-point summation order.

Checkpoints hold copy 0's stages and optimizers (``stage_i``) and the step
counters; after a restore every other copy is set from copy 0.
"""

from __future__ import annotations

import math
import signal

import keras
import tensorflow as tf

from tfdist.training.workload import data

from tfdist.training.pipeline import stages as stage_cut
from tfdist.training.loop.state import make_optimizer
from tfdist.training.loop.step import metric_dict
from tfdist.training.loop.peers import PEER_ERRORS
from tfdist.training.loop.trainer import Trainer


def stage_device(worker: int) -> str:
    return f"/job:worker/replica:0/task:{worker}/device:CPU:0"


class StagedModel:
    """The stages of one copy seen as one model: the weights in the task's
    model's order (stage 0's first), for evaluation, hashing and the
    finite-weights check, which read ``weights`` only."""

    def __init__(self, models):
        self.stages = list(models)

    @property
    def weights(self):
        return [w for m in self.stages for w in m.weights]

    @property
    def trainable_weights(self):
        return [w for m in self.stages for w in m.trainable_weights]

    trainable_variables = trainable_weights

    @property
    def non_trainable_variables(self):
        return [w for m in self.stages for w in m.non_trainable_weights]

    def get_weights(self):
        return [w.numpy() for w in self.weights]


class PipelineState:
    """``training.loop.state.TrainState``'s fields, plus every copy's stages."""

    def __init__(self, copies, optimizers, devices, cut: str):
        self.copies, self.optimizers, self.devices, self.cut = copies, optimizers, devices, cut
        self.model = StagedModel(copies[0])
        self.optimizer = optimizers[0][0]
        # On the client (make_master_device_default=False keeps them local).
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        self.completed_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name="completed_steps")
        objects = {f"stage_{s}": tf.train.Checkpoint(model=m, optimizer=o)
                   for s, (m, o) in enumerate(zip(copies[0], optimizers[0]))}
        self.checkpoint = tf.train.Checkpoint(**objects, global_step=self.global_step,
                                              completed_steps=self.completed_steps)

    def sync_copies(self) -> None:
        """Every copy's weights and optimizer variables set from copy 0 (after a restore)."""
        for p in range(1, len(self.copies)):
            for s, (model, opt) in enumerate(zip(self.copies[p], self.optimizers[p])):
                for dst, src in zip(model.weights, self.copies[0][s].weights):
                    dst.assign(src)
                for dst, src in zip(opt.variables, self.optimizers[0][s].variables):
                    dst.assign(src)

    def bytes_per_task(self) -> tuple[dict, dict]:
        """({worker: bytes of its stage's weights}, {worker: weights + optimizer variables})."""
        params, state = {}, {}
        for row, opts, devs in zip(self.copies, self.optimizers, self.devices):
            for model, opt, (name, _) in zip(row, opts, devs):
                weights = sum(_nbytes(w) for w in model.weights)
                params[name] = weights
                state[name] = weights + sum(_nbytes(v) for v in opt.variables)
        return params, state


def _nbytes(v) -> int:
    return int(math.prod(v.shape)) * tf.as_dtype(v.dtype).size


def _optimizer(plan, task_model):
    o = plan.optimizer
    if o.library:
        return make_optimizer(o.name, o.learning_rate, o.schedule, plan.total_steps)
    own = task_model.optimizer
    return type(own).from_config(own.get_config())


def build_pipeline_state(plan, task, strategy) -> PipelineState:
    """The task's model, cut and placed: one stage per worker, per copy."""
    pp = plan.pipeline
    model = task.build_model()  # first after the seed: one process's initial weights
    local, cut = stage_cut.local_stages(task, model, pp, plan.task.name)
    copies, optimizers, devices = [], [], []
    for p in range(pp.pipelines):
        row, opts, devs = [], [], []
        for s in range(pp.stages):
            worker = pp.worker(p, s)
            device = stage_device(worker)
            with tf.device(device):
                stage = keras.models.clone_model(local[s])
                opt = _optimizer(plan, model)
                # Built here, so the slots land on the stage's task too.
                opt.build(stage.trainable_variables)
            stage.set_weights(local[s].get_weights())
            row.append(stage)
            opts.append(opt)
            devs.append((f"worker:{worker}", device))
        copies.append(row)
        optimizers.append(opts)
        devices.append(devs)
    return PipelineState(copies, optimizers, devices, cut)


def _split(structure, n: int) -> list:
    """``structure`` (a tensor, or a dict or tuple of them) as ``n`` equal micro-batches."""
    flat = tf.nest.flatten(structure)
    parts = [tf.split(t, n) for t in flat]
    return [tf.nest.pack_sequence_as(structure, [p[i] for p in parts]) for i in range(n)]


def make_pipeline_step(state: PipelineState, compile_loss, metrics, micro_batches: int):
    """``step(features, labels)``: one GPipe step over every copy; returns
    (mean loss, mean metric values) over the P x M micro-batches."""
    copies, optimizers, devices = state.copies, state.optimizers, state.devices
    P, S, M = len(copies), len(copies[0]), micro_batches

    def step(features, labels):
        xs, ys = _split(features, P * M), _split(labels, P * M)
        losses, values = [], []
        # tapes[p][m][s]: (tape, stage input, stage output, loss or None)
        tapes = [[[None] * S for _ in range(M)] for _ in range(P)]
        # Forwards: every micro-batch through every stage, on the stage's task.
        for m in range(M):
            for p in range(P):
                h = xs[p * M + m]
                for s in range(S):
                    with tf.device(devices[p][s][1]):
                        with tf.GradientTape() as tape:
                            if s > 0:
                                tape.watch(h)
                            out = copies[p][s](h, training=True)
                            loss = None
                            if s == S - 1:
                                y = ys[p * M + m]
                                loss = compile_loss(y, out)
                                losses.append(loss)
                                values.append(metrics.batch_values(y, out))
                                # The copy's batch mean is the mean of its M micro-batch means.
                                loss = loss / M
                            extra = copies[p][s].losses
                            if extra:  # a stage's own (regularization) losses, once per step
                                reg = tf.add_n([tf.reduce_sum(x) for x in extra]) / M
                                loss = reg if loss is None else loss + reg
                    tapes[p][m][s] = (tape, h, out, loss)
                    h = out
        # Backwards, in reverse: each stage's gradients summed on its own task.
        acc = [[None] * S for _ in range(P)]
        for m in reversed(range(M)):
            for p in range(P):
                g = None
                for s in reversed(range(S)):
                    tape, h, out, loss = tapes[p][m][s]
                    variables = copies[p][s].trainable_variables
                    sources = ([h] if s > 0 else []) + list(variables)
                    with tf.device(devices[p][s][1]):
                        if g is None:
                            grads = tape.gradient(loss, sources)
                        elif loss is None:
                            grads = tape.gradient(out, sources, output_gradients=g)
                        else:
                            grads = tape.gradient([out, loss], sources,
                                                  output_gradients=[g, tf.ones_like(loss)])
                        if s > 0:
                            g, grads = grads[0], grads[1:]
                        grads = [tf.zeros_like(v) if gr is None else gr
                                 for gr, v in zip(grads, variables)]
                        acc[p][s] = grads if acc[p][s] is None else [
                            a + b for a, b in zip(acc[p][s], grads)]
        # One update per stage: the copies' gradients averaged on copy 0's task.
        for s in range(S):
            with tf.device(devices[0][s][1]):
                mean = (acc[0][s] if P == 1 else
                        [tf.add_n(list(gs)) / P for gs in zip(*(acc[p][s] for p in range(P)))])
            for p in range(P):
                with tf.device(devices[p][s][1]):
                    optimizers[p][s].apply(mean, copies[p][s].trainable_variables)
        return tf.add_n(losses) / len(losses), tf.add_n(values) / len(values)

    return step


class PipelineTrainer(Trainer):
    """``pipeline`` on the chief: owns the model's stages placed on the workers (and their
    optimizers, per copy), the GPipe step over micro-batches, keeping the copies
    identical, and the per-worker parameter and optimizer bytes of the results."""

    peer_errors = PEER_ERRORS

    @staticmethod
    def build_state(plan, task, strategy, example=None):
        return build_pipeline_state(plan, task, strategy)

    def __init__(self, *, plan, bundle, task, state, checkpointer, start_step, train_metrics):
        super().__init__(plan=plan, bundle=bundle, task=task, state=state,
                         checkpointer=checkpointer, start_step=start_step,
                         train_metrics=train_metrics)
        pp = plan.pipeline
        state.sync_copies()  # the restored copy 0 everywhere
        dataset_fn = data.make_dataset_fn(
            task.task, plan.global_batch_size, seed=self.config.seed, start_step=start_step,
            synthetic=self.config.synthetic_data, in_memory=plan.in_memory)
        self._iterator = iter(bundle.strategy.distribute_datasets_from_function(dataset_fn))
        compile_loss = task.local_model._compile_loss  # pylint: disable=protected-access
        step = make_pipeline_step(state, compile_loss, train_metrics, pp.micro_batches)
        num_metrics = len(train_metrics.names)
        global_step = state.global_step

        @tf.function
        def train_fn(iterator, num_steps):
            loss_sum = tf.constant(0.0)
            metric_sum = tf.zeros([num_metrics], tf.float32)
            for _ in tf.range(num_steps):
                features, labels = next(iterator)
                loss, values = step(features, labels)
                with tf.control_dependencies([loss]):
                    global_step.assign_add(1)
                loss_sum += tf.cast(loss, tf.float32)
                metric_sum += values
            steps = tf.cast(num_steps, tf.float32)
            return {"loss": loss_sum / steps, "metrics": metric_sum / steps}

        self._train_fn = train_fn
        self._out = None
        # A polite preemption (SIGTERM) of the chief: the controller drains,
        # saves at the step reached and ends with exit 42 (Preempted); the
        # workers hold nothing the checkpoint lacks.
        self._preempted = False
        self._previous_sigterm = None
        try:
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread (a caller's own thread): no handler
            pass
        if self.is_chief:
            print(f"pipeline: {pp.pipelines} cop{'y' if pp.pipelines == 1 else 'ies'} x "
                  f"{pp.stages} stages, {pp.micro_batches} micro-batches per step "
                  f"(predicted bubble {pp.bubble():.0%}); {state.cut}", flush=True)

    def _on_sigterm(self, *_):
        self._preempted = True

    def stop_requested(self) -> bool:
        return self._preempted

    def train(self, num_steps: int) -> dict[str, float]:
        self._out = self._train_fn(self._iterator, tf.constant(num_steps))
        self.completed += num_steps
        return self._metrics()

    def drain(self) -> dict[str, float]:
        """Each call returns with its steps applied."""
        return self._metrics()

    def _metrics(self) -> dict[str, float]:
        if self._out is None:
            return {}
        return metric_dict(self._out["loss"], self.metric_names, self._out["metrics"])

    def result_fields(self, ran: int) -> dict:
        params, state_bytes = self.state.bytes_per_task()
        total = sum(b for name, b in params.items()
                    if name in {n for n, _ in self.state.devices[0]})
        return {
            "global_steps": int(self.state.global_step.numpy()),
            "steps_per_worker": {name: ran for name in self.bundle.kind.training_members(self.cluster)},
            "pipeline": {
                **self.plan.pipeline.describe(),
                "cut": self.state.cut,
                "parameter_bytes_per_task": params,
                "state_bytes_per_task": state_bytes,  # weights + optimizer slots
                "model_parameter_bytes": total,
            },
        }

    def close(self, finished: bool) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        self.checkpointer.close()
