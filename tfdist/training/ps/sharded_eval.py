"""The evaluation under ``ps`` and ``ps-sync``: shards scheduled on the workers.

tf_keras's ``pss_evaluation_shards``, which Keras 3 dropped, done with the
chief's ``ClusterCoordinator``: the split's batches are cut into S contiguous
shards (``--eval-shards``); each is one closure the coordinator schedules on a
free worker. A closure reads the model's weights from the ps tasks once and
runs the chief's local model's own ``test_step`` on each of its shard's
batches inside a ``keras.StatelessScope`` mapping the local model's weights to
those values and its metrics' variables to fresh states, so nothing is
assigned on the worker: the closure returns its shard's id, the metric states,
its example count and its worker's index, and the chief merges each shard
once (``training.loop.evaluation.ShardMerge``).

Exactly once: every worker holds its own iterator of each shard, made afresh
for each evaluation. A closure whose worker is lost is run again by the
coordinator on another worker, from that worker's untouched iterator of the
same shard; a restarted worker's iterators are made again by the coordinator.

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


class CoordinatedEvaluation:
    """The shards' closures for one trainer: ``model`` (the strategy's, its weights on the
    ps tasks) read by the workers, ``workers`` their names in the coordinator's order;
    ``quiet()``: a context in which no other closure holds a worker (the module docstring)."""

    def __init__(self, coordinator, model: keras.Model, task, workers: list[str],
                 quiet=contextlib.nullcontext):
        self.coordinator, self.model, self.task = coordinator, model, task
        self.workers, self.quiet = workers, quiet
        self._datasets: dict[tuple, object] = {}
        self._functions: dict[int, object] = {}

    def shards(self, count: int, local: keras.Model, why_not: str | None = None) -> EvalShards:
        """``why_not``: the trainer's reason the workers cannot evaluate (the chief does)."""
        return EvalShards(count, self.run, refusal=why_not or refusal(self.model, local))

    def _dataset(self, split: str, batch_size: int, lo: int, hi: int):
        """Shard ``[lo, hi)``'s batches as a dataset on every worker, made once."""
        key = (split, batch_size, lo, hi)
        if key not in self._datasets:
            task = self.task

            def shard():
                # Skipped before batching: a sliced source skips without reading.
                return data.task_split(task, split).skip(lo * batch_size).take(
                    (hi - lo) * batch_size).batch(batch_size)

            self._datasets[key] = self.coordinator.create_per_worker_dataset(shard)
        return self._datasets[key]

    def _function(self, local: keras.Model, initial: list):
        """The closure: one shard's batches through ``local``'s ``test_step`` on the
        ps-held weights, from ``initial`` metric states (traced once per local model)."""
        if id(local) in self._functions:
            return self._functions[id(local)]
        model = self.model
        start = [tf.constant(v) for v in initial]

        @tf.function
        def evaluate_shard(iterator, shard):
            # The weights read from the ps tasks once per shard: the chief evaluates
            # between steps, so they do not change meanwhile.
            values = [tf.convert_to_tensor(w.value) for w in model.weights]
            states, examples = stateless_test_steps(local, values, list(start), iterator)
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            return shard, states, examples, tf.cast(worker, tf.int64)

        self._functions[id(local)] = evaluate_shard
        return evaluate_shard

    def run(self, local: keras.Model, initial: list, split: str, batch_size: int,
            bounds: list[tuple[int, int]]):
        """Every shard scheduled once the workers are free, then each closure's result
        as it returned: (shard, states, examples, worker name). Each fetched on its own,
        not by ``join()``, which would also wait for a closure the trainer left running
        (a stuck worker's step under ``ps-sync``)."""
        function = self._function(local, initial)
        with self.quiet():
            remotes = []
            for shard, (lo, hi) in enumerate(bounds):
                iterator = iter(self._dataset(split, batch_size, lo, hi))
                remotes.append(self.coordinator.schedule(
                    function, args=(iterator, tf.constant(shard, tf.int64))))
            results = [remote.fetch() for remote in remotes]
        for shard, states, examples, worker in results:
            yield (int(shard), [np.asarray(v) for v in states], int(examples),
                   self.workers[int(worker)])
