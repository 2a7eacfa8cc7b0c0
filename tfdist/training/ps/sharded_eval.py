"""The evaluation under ``ps`` and ``ps-sync``: shards scheduled on the workers.

tf_keras's ``pss_evaluation_shards``, which Keras 3 dropped, done with the
chief's ``ClusterCoordinator``: the split's batches are cut into S contiguous
shards (``--eval-shards``); each is one closure the coordinator schedules on a
free worker. A closure reads the model's weights from the ps tasks once and
runs the chief's local model's own ``test_step`` on each of its shard's
batches inside a ``keras.StatelessScope`` mapping the local model's weights to
those values and its metrics' variables to fresh states, so nothing is
assigned on the worker: the closure returns its shard's id, the metric states,
its example count, its worker's index and its seconds, packed in one tensor
(``pack``), and the chief merges each shard once
(``training.loop.evaluation.ShardMerge``).

Exactly once: every worker holds the whole split (one dataset per worker, its
elements read and decoded once, on the worker, when it is made), and a
closure reads its shard from it by the shard's bounds, given as tensors: it
keeps no iterator, so a closure whose worker is lost is run again by the
coordinator on another worker from the start of the same shard, and a
restarted worker's dataset is made again by the coordinator.

Prepared ahead (``prepare``, at the run's first call, counted in the startup
as every other member's evaluation is): the datasets made on the workers, the
closure traced, and a shard of one batch run on each worker (the function
registered, its graph optimized and its kernels made there), so an
evaluation's seconds are its shards' batches and their dispatch.

Free workers: a worker's thread runs one closure at a time, so a shard waits
behind whatever closure the trainer has on that thread. Under ``ps`` the
controller's drain ended them; ``ps-sync``'s step closures wait on ps:0 for the
next update's token, which only the chief's next update gives, so its trainer
ends them for the evaluation and resumes them after it (``quiet``,
``PsSyncTrainer.workers_free``).
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

from tfdist.training.loop.evaluation import EvalShards
from tfdist.training.workload import data


def refusal(model: keras.Model, local: keras.Model) -> str | None:
    """Why the workers cannot evaluate ``model`` through the local copy: a variable split
    over the ps tasks has no one value to map a local weight to."""
    if len(model.weights) != len(local.weights) or any(
            tuple(a.shape) != tuple(b.shape) for a, b in zip(model.weights, local.weights)):
        return "the model's variables are split over the ps tasks (--shard-variables)"
    return None


def stateless_test_steps(local: keras.Model, values: list, states: list, batches):
    """``local``'s own ``test_step`` on each of ``batches`` with its weights read as
    ``values`` and its metrics' variables as ``states``, assigning nothing: the
    metric states after the last batch, and the examples seen."""
    weights, variables = local.weights, local.metrics_variables
    examples = tf.constant(0, tf.int64)
    for batch in batches:
        mapping = [*zip(weights, values), *zip(variables, states)]
        with keras.StatelessScope(state_mapping=mapping) as scope:
            local.test_step(batch)
        states = [tf.convert_to_tensor(scope.get_current_value(v)) for v in variables]
        examples += tf.cast(tf.shape(tf.nest.flatten(batch)[0])[0], tf.int64)
    return states, examples


def pack(numbers: list, states: list) -> tf.Tensor:
    """A closure's result as one float64 vector: the coordinator copies each tensor a
    closure returns to the chief on its own, one after another, before that worker gets
    its next closure (the MNIST CNN's shard returned 8). float64 holds every float32
    state and every count below 2**53 exactly."""
    parts = [tf.stack([tf.cast(n, tf.float64) for n in numbers])]
    parts += [tf.reshape(tf.cast(v, tf.float64), [-1]) for v in states]
    return tf.concat(parts, axis=0)


def unpack(packed, like: list) -> tuple[list[float], list[np.ndarray]]:
    """``pack``'s four numbers and the states, shaped and typed as ``like``'s arrays."""
    flat, like = np.asarray(packed), [np.asarray(ref) for ref in like]
    expected = sum(ref.size for ref in like)
    if flat.size != 4 + expected:
        raise ValueError(f"a shard returned {flat.size - 4} state values, expected {expected}")
    numbers, at, states = [float(x) for x in flat[:4]], 4, []
    for ref in like:
        states.append(flat[at:at + ref.size].reshape(ref.shape).astype(ref.dtype))
        at += ref.size
    return numbers, states


def whole_split(task, split: str):
    """``split``'s elements as one dataset made on a worker: read and decoded there once,
    held in its memory (a dataset of tensors, which skips without reading) when every
    element has one fixed shape; else the task's own dataset, which a shard's skip reads."""
    ds = data.task_split(task, split)
    specs = tf.nest.flatten(ds.element_spec)
    if not all(isinstance(s, tf.TensorSpec) and s.shape.is_fully_defined() for s in specs):
        return ds
    # The whole split in one batch: computed when the dataset is made on the worker.
    return tf.data.Dataset.from_tensor_slices(ds.batch(1 << 30).get_single_element())


class CoordinatedEvaluation:
    """The shards' closures for one trainer: ``model`` (the strategy's, its weights on the
    ps tasks) read by the workers, ``workers`` their names in the coordinator's order;
    ``quiet()``: a context in which no other closure holds a worker (the module docstring)."""

    # Rounds of one warm-up shard per worker scheduled ahead until each worker ran one.
    # A worker still making its dataset lets the others take a round's closures.
    WARM_ROUNDS = 8

    def __init__(self, coordinator, model: keras.Model, task, workers: list[str],
                 quiet=contextlib.nullcontext):
        self.coordinator, self.model, self.task = coordinator, model, task
        self.workers, self.quiet = workers, quiet
        self._datasets: dict[str, object] = {}
        self._functions: dict[tuple, object] = {}

    def shards(self, count: int, local: keras.Model, why_not: str | None = None) -> EvalShards:
        """``why_not``: the trainer's reason the workers cannot evaluate (the chief does)."""
        return EvalShards(count, self.run, refusal=why_not or refusal(self.model, local),
                          ready=self.prepare)

    def _dataset(self, split: str):
        """``split`` on every worker (``whole_split``), made once: the coordinator's
        values, one per worker, that a scheduled closure receives its own of."""
        if split not in self._datasets:
            task = self.task
            per_worker = self.coordinator.create_per_worker_dataset(
                lambda: whole_split(task, split))
            self._datasets[split] = per_worker.build()
        return self._datasets[split]

    def _function(self, local: keras.Model, initial: list, batch_size: int):
        """The closure: shard ``[lo, hi)``'s batches of a worker's split through
        ``local``'s ``test_step`` on the ps-held weights, from ``initial`` metric
        states (traced once per local model)."""
        key = (id(local), batch_size)
        if key in self._functions:
            return self._functions[key]
        model = self.model
        start = [tf.constant(v) for v in initial]

        @tf.function
        def evaluate_shard(dataset, shard, lo, hi):
            began = tf.timestamp()
            # The weights read from the ps tasks once per shard: the chief evaluates
            # between steps, so they do not change meanwhile.
            values = [tf.convert_to_tensor(w.value) for w in model.weights]
            # Skipped before batching: the split's tensors skip without reading.
            # An iterator, read by the closure's own loop (the loop of test_step's).
            batches = iter(dataset.skip(lo * batch_size).take((hi - lo) * batch_size).batch(
                batch_size))
            states, examples = stateless_test_steps(local, values, list(start), batches)
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            with tf.control_dependencies([*states, examples]):
                # The closure's own seconds on its worker (the record's terms).
                seconds = tf.timestamp() - began
            return pack([shard, examples, worker, seconds], states)

        self._functions[key] = evaluate_shard
        return evaluate_shard

    def _schedule(self, function, split: str, shard: int, lo: int, hi: int):
        return self.coordinator.schedule(function, args=(
            self._dataset(split), *(tf.constant(v, tf.int64) for v in (shard, lo, hi))))

    def prepare(self, local: keras.Model, initial: list, split: str, batch_size: int) -> None:
        """Before the first evaluation: the split made on every worker, the closure
        traced, and a shard of the first batch run on each worker (its kernels made
        there, as the chief alone's preparation evaluates one batch), in rounds of
        one per worker until each has run one, ``WARM_ROUNDS`` at most: the
        coordinator picks the worker. Their states are not merged."""
        function = self._function(local, initial, batch_size)
        warmed: set[int] = set()
        with self.quiet():
            for _ in range(self.WARM_ROUNDS):
                remotes = [self._schedule(function, split, -1, 0, 1) for _ in self.workers]
                warmed.update(int(unpack(remote.fetch(), initial)[0][2]) for remote in remotes)
                if len(warmed) == len(self.workers):
                    break

    def run(self, local: keras.Model, initial: list, split: str, batch_size: int,
            bounds: list[tuple[int, int]]):
        """Every shard scheduled once the workers are free, then each closure's result
        as it returned: (shard, states, examples, worker name, the closure's seconds on
        its worker). Each fetched on its own,
        not by ``join()``, which would also wait for a closure the trainer left running
        (a stuck worker's step under ``ps-sync``)."""
        function = self._function(local, initial, batch_size)
        with self.quiet():
            remotes = [self._schedule(function, split, shard, lo, hi)
                       for shard, (lo, hi) in enumerate(bounds)]
            results = [remote.fetch() for remote in remotes]
        for packed in results:
            (shard, examples, worker, seconds), states = unpack(packed, initial)
            yield int(shard), states, int(examples), self.workers[int(worker)], float(seconds)
