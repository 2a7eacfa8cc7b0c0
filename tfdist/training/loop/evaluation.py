"""The task's compiled loss and metrics on a whole split, and the weights' fingerprint.

Keras's ``evaluate`` on a local copy of the weights (a model outside any
strategy), in one of three ways:

- on one member (the chief) over the whole split;
- shared by a group of members the trainer gives (``EvalGroup``: its
  ``prepare`` and ``run_pass`` return the metrics' *states* (their variables:
  totals, counts, confusion counts) summed over the group, and every result is
  read from the sums, in one place whatever the group):
  - ``EvalMembers``, the members that train in lockstep: the split's batches
    (``batch_size`` each, the last one short) are cut into contiguous ranges,
    one per member (``batch_range``); each evaluates its range, then one
    collective sums the states;
  - ``EvalShards`` (``ps``): the batches cut into shards, each a closure a
    coordinator schedules on a worker, each shard's states merged once
    (``ShardMerge``).
  The batches are the ones a single member would evaluate, so the states are
  the same sums, added in another order.

What a pass needs before the first one (the sharing check, the test function
and the all-reduce traced) is prepared once, ahead (``Evaluator.prepare``).

A metric whose state is not known to be a sum over examples, or a model's own
``test_step`` whose logs are not its metrics' results (Keras's ``evaluate``
then returns the last batch's logs), is evaluated on the chief alone, said in
one line.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import keras
import numpy as np
import tensorflow as tf

from tfdist.training.workload import data


def local_copy(model: keras.Model, local: keras.Model) -> keras.Model:
    """``local`` (a model built outside any strategy) holding ``model``'s current weights.

    Evaluation, hashing and saving use it: it reads distributed or ps-hosted
    variables once, and Keras 3 cannot predict or save through a
    ParameterServerStrategy-scoped model.
    """
    from tfdist.training.sharding import full_weights

    local.set_weights(full_weights(model))
    return local


@dataclass(frozen=True)
class Summed:
    """A shared pass's outcome: every metric's state summed over the members (in
    ``local.metrics_variables``' order), the examples each member evaluated, and
    the fields the record adds for this kind (its terms: shards, seconds)."""

    states: list
    counts: dict
    terms: dict


class EvalGroup(Protocol):
    """The members that evaluate a split together (the contract ``Evaluator`` uses).

    ``where``: the record's word for them; ``refusal``: why they cannot, else None;
    ``prepare(evaluator)``: their share ready before the first pass (every member
    calls it at the same point); ``run_pass(evaluator)``: the states summed."""

    where: str
    is_chief: bool
    refusal: str | None

    def own_name(self, member: str) -> str: ...

    def prepare(self, evaluator: "Evaluator") -> None: ...

    def run_pass(self, evaluator: "Evaluator") -> Summed: ...


@dataclass(frozen=True)
class EvalMembers:
    """The members that evaluate a split together, and this member's place among them.

    ``total(vector)``: a float64 vector summed over the members (each counted
    once), one collective: every member calls it at the same points.
    """

    names: tuple[str, ...]
    rank: int
    is_chief: bool
    total: Callable
    refusal: str | None = None
    where = "members"

    def own_name(self, member: str) -> str:
        return self.names[self.rank]

    def prepare(self, evaluator: "Evaluator") -> None:
        """This member's range of batches, cached; the all-reduce traced and run on zeros."""
        batches = -(-evaluator.examples // evaluator.batch_size)
        lo, hi = batch_range(batches, len(self.names), self.rank)
        size = evaluator.batch_size
        # Skipped before batching: a sliced source skips without reading.
        shard = data.task_split(evaluator.task, evaluator.split).skip(lo * size).take(
            (hi - lo) * size)
        # Cached by the first pass, which reads the data as the chief alone's does.
        evaluator.dataset = shard.batch(size).prefetch(tf.data.AUTOTUNE).cache()
        evaluator.shard_examples = examples_per_member(
            evaluator.examples, size, len(self.names))[self.rank]
        variables = evaluator.local.metrics_variables
        self.total(np.zeros(sum(int(np.prod(v.shape)) for v in variables)
                            + 2 * len(self.names)))

    def run_pass(self, evaluator: "Evaluator") -> Summed:
        """This member's batches, then every metric's state, each member's examples and
        each member's seconds over its batches summed over the members (one collective)."""
        local, n = evaluator.local, len(self.names)
        started = time.perf_counter()
        if evaluator.shard_examples:
            local.evaluate(evaluator.dataset, verbose=0)
        else:  # more members than batches: this one adds nothing
            local.reset_metrics()
        batches_seconds = time.perf_counter() - started
        values = [np.asarray(keras.ops.convert_to_numpy(v), np.float64)
                  for v in local.metrics_variables]
        # Each member's examples and seconds over its batches, in its own slots.
        mine = np.zeros(2 * n)
        mine[self.rank], mine[n + self.rank] = evaluator.shard_examples, batches_seconds
        reducing = time.perf_counter()
        total = np.asarray(self.total(np.concatenate([v.ravel() for v in values] + [mine])))
        all_reduce_seconds = time.perf_counter() - reducing
        states, offset = [], 0
        for value in values:
            states.append(total[offset:offset + value.size].reshape(value.shape))
            offset += value.size
        counts = {name: int(round(c)) for name, c in zip(self.names, total[offset:offset + n])}
        # The slower member's batches bound the pass; the all-reduce waits for it.
        return Summed(states, counts, {
            "batch_seconds_per_member": {name: round(float(s), 3) for name, s in
                                         zip(self.names, total[offset + n:])},
            "all_reduce_seconds": round(all_reduce_seconds, 3)})


@dataclass(frozen=True)
class EvalShards:
    """The split cut into ``count`` shards of contiguous batches, each evaluated by one
    closure a coordinator schedules on a worker (``ps``, ``ps-sync``), on the chief's
    call: ``run(local, initial_states, split, batch_size, bounds)`` returns each
    closure's ``(shard, states, examples, worker[, seconds])`` as the coordinator
    returned it (``seconds``: the closure's own on its worker, when measured);
    ``ready(local, initial_states, split, batch_size)``, when given, prepares the
    workers' side ahead of the first pass.
    ``refusal``: why this model cannot be evaluated so (the chief does), else None."""

    count: int
    run: Callable
    refusal: str | None = None
    is_chief: bool = True
    ready: Callable | None = None
    where = "workers"

    def own_name(self, member: str) -> str:
        return member

    def prepare(self, evaluator: "Evaluator") -> None:
        evaluator.dataset = ()  # each shard is read on its worker
        if self.ready is not None and evaluator.examples:  # an empty split schedules nothing
            self.ready(evaluator.local, fresh_states(evaluator.local), evaluator.split,
                       evaluator.batch_size)

    def run_pass(self, evaluator: "Evaluator") -> Summed:
        """Every shard evaluated by a closure on a worker from the same initial metric
        states, each shard's states merged once; the shards made (at most one a batch)."""
        local = evaluator.local
        initial = fresh_states(local)
        batches = -(-evaluator.examples // evaluator.batch_size)
        count = min(self.count, batches)
        bounds = [batch_range(batches, count, s) for s in range(count)]
        merge, busy = ShardMerge(count), {}
        # The line an operator (and the test that kills a worker meanwhile) waits on.
        print(f"the {evaluator.split} split: {count} shards scheduled on the workers", flush=True)
        for shard, states, examples, worker, *seconds in self.run(
                local, initial, evaluator.split, evaluator.batch_size, bounds):
            if merge.add(shard, states, examples, worker) and seconds:
                busy[worker] = busy.get(worker, 0.0) + seconds[0]
        if merge.missing() or merge.examples != evaluator.examples:
            raise RuntimeError(f"the sharded evaluation merged {merge.examples} of "
                               f"{evaluator.examples} examples; shards missing: {merge.missing()}")
        # The shards made, and those asked when fewer were made; each worker's seconds in
        # its merged closures (the rest of the pass is the coordinator's dispatch and wait).
        return Summed(merge.states, dict(sorted(merge.per_worker.items())), {
            "shards": count, **({"shards_asked": self.count} if count != self.count else {}),
            **({"batch_seconds_per_member": {w: round(s, 3) for w, s in sorted(busy.items())}}
               if busy else {})})


def fresh_states(local) -> list:
    """``local``'s metric states reset, as values: what every shard starts from."""
    local.reset_metrics()
    return [keras.ops.convert_to_numpy(v) for v in local.metrics_variables]


class ShardMerge:
    """Each shard's metric states added once, whatever returns it how often: a closure
    the coordinator ran again after a lost worker, or a shard given twice, counts once."""

    def __init__(self, shards: int):
        self.shards = shards
        self.states: list[np.ndarray] | None = None
        self.merged: set[int] = set()
        self.examples = 0
        self.per_worker: dict[str, int] = {}

    def add(self, shard: int, states, examples: int, worker: str) -> bool:
        """Merge ``shard``'s states; False (nothing merged) when it was merged before."""
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard} is outside 0..{self.shards - 1}")
        if shard in self.merged:
            return False
        self.merged.add(shard)
        arrays = [np.asarray(v, np.float64) for v in states]
        self.states = arrays if self.states is None else [
            a + b for a, b in zip(self.states, arrays)]
        self.examples += int(examples)
        self.per_worker[worker] = self.per_worker.get(worker, 0) + int(examples)
        return True

    def missing(self) -> list[int]:
        return [s for s in range(self.shards) if s not in self.merged]


def batch_range(batches: int, members: int, rank: int) -> tuple[int, int]:
    """The batches ``[lo, hi)`` member ``rank`` of ``members`` evaluates: contiguous,
    disjoint, covering ``range(batches)``, sizes differing by at most one."""
    return rank * batches // members, (rank + 1) * batches // members


def examples_per_member(examples: int, batch_size: int, members: int) -> list[int]:
    """Examples each member evaluates when ``examples`` are cut into batches of
    ``batch_size`` (the last one short) and the batches by ``batch_range``:
    they sum to ``examples``, and each is at most ``ceil(examples / members)``
    plus one batch."""
    batches = -(-examples // batch_size)
    counts = []
    for rank in range(members):
        lo, hi = batch_range(batches, members, rank)
        counts.append(max(0, min(hi * batch_size, examples) - lo * batch_size))
    return counts


def leaf_metrics(metrics) -> list:
    """The metrics holding state: containers (Keras's ``CompileMetrics``) opened."""
    out = []
    for metric in metrics:
        inner = getattr(metric, "metrics", None)
        if isinstance(inner, (list, tuple)) and inner and all(
                isinstance(m, keras.metrics.Metric) for m in inner):
            out.extend(leaf_metrics(inner))
        else:
            out.append(metric)
    return out


def not_additive(metric) -> str | None:
    """Why ``metric``'s state cannot be summed over members; None when it can.

    Every Keras metric's variables are sums over examples (totals and counts,
    confusion counts and matrices: ``keras.metrics`` in 3.15, each checked); a
    metric of the user's own is only known to be one when it is a ``Sum`` or
    ``Mean`` with nothing but their ``total`` and ``count``.
    """
    cls = type(metric)
    if cls.__module__.startswith("keras."):
        return None
    if isinstance(metric, (keras.metrics.Sum, keras.metrics.Mean)) and all(
            v.name in ("total", "count") for v in metric.variables):
        return None
    return (f"the metric {metric.name!r} ({cls.__name__}) keeps a state not known to be a "
            "sum over examples")


def count_examples(ds) -> int:
    """Elements of an unbatched dataset: its cardinality, else counted once."""
    import tensorflow as tf

    n = int(ds.cardinality())
    if n >= 0:
        return n
    return int(ds.reduce(tf.constant(0, tf.int64), lambda c, _: c + 1))


class Evaluator:
    """The compiled loss and every compiled metric over the whole split, once.

    Keras's own ``evaluate`` on the local copy: metrics accumulate over every
    example (a short last batch counts exactly) and the loss is weighted by
    batch size. The split (or this member's shard of it) is cached after the
    first pass, and the traced test function is reused. ``record`` says how
    the last evaluation ran (results.json's ``evaluation``).
    """

    def __init__(self, task, local: keras.Model, batch_size: int = 1000, split: str = "test",
                 members: EvalGroup | None = None, member: str = "chief:0"):
        self.local, self.batch_size, self.split = local, batch_size, split
        self.members, self.member = members, member
        self.examples = count_examples(data.task_split(task, split))
        self.record: dict | None = None
        # Why the members cannot share this split (the chief evaluates it alone).
        self.alone_because: str | None = None
        self._said = False
        self.task, self.dataset = task, None
        self.shard_examples = 0  # this member's examples, when its group cuts the split
        # Seconds spent preparing (prepare()), for the record.
        self.prepared_seconds: float | None = None

    def prepare(self) -> None:
        """Everything a pass needs before its first one, done once: whether the members
        share the split, this member's dataset (its share, the group's ``prepare``:
        the all-reduce traced and run once on zeros), and Keras's test function traced
        on one batch. Not at construction, since ``local`` also serves a task Keras
        cannot evaluate (a GAN's weights saved and hashed). The trainer calls it at its
        first call, where every member is (so the collectives match), and counts it in
        the startup; else the first evaluation does, where every member also is. Its
        seconds are the record's ``prepared_seconds``, not its ``seconds``."""
        if self.dataset is not None:
            return
        started = time.perf_counter()
        members = self.members
        if members is not None:
            # The sharing check evaluates one batch: the test function is traced then.
            self.alone_because = members.refusal or self._sharing_refusal()
        if self.shared:
            members.prepare(self)
        else:
            self.dataset = data.eval_dataset(self.task, self.batch_size, self.split).cache()
            if members is None and self.evaluates:
                self._trace_test_function()
        self.prepared_seconds = round(time.perf_counter() - started, 3)

    def _trace_test_function(self) -> None:
        """Keras's test function traced on one batch (as the sharing check does)."""
        self.local.evaluate(data.eval_dataset(self.task, self.batch_size, self.split).take(1),
                            verbose=0)

    @property
    def shared(self) -> bool:
        """Whether the members evaluate this split together."""
        return self.members is not None and self.alone_because is None

    @property
    def evaluates(self) -> bool:
        """Whether this member takes part (every member when shared, else the chief)."""
        return self.shared or self.members is None or self.members.is_chief

    def _sharing_refusal(self) -> str | None:
        """Why the members cannot share the split; None when they can. The same
        answer on every member (the same model, one batch of the same split), so
        all of them reach the same collectives. Its evaluation of one batch also
        builds every metric, so every member's state has the same layout."""
        logs = self.local.evaluate(
            data.eval_dataset(self.task, self.batch_size, self.split).take(1),
            verbose=0, return_dict=True)
        for metric in leaf_metrics(self.local.metrics):
            why = not_additive(metric)
            if why is not None:
                return why
        if set(logs) != set(self.local.get_metrics_result()):
            return "the model's own test_step returns logs that are not its metrics' results"
        return None

    def __call__(self, model: keras.Model) -> dict[str, float]:
        """{"loss": ..., metric: ...} of ``model``'s current weights; {} on a member
        that takes no part (the chief evaluates alone)."""
        self.prepare()
        if not self.evaluates:
            return {}
        started = time.perf_counter()
        local_copy(model, self.local)
        if self.shared:
            summed = self.members.run_pass(self)
            out, counts, where, terms = (self._results_from(summed.states), summed.counts,
                                         self.members.where, summed.terms)
        else:
            self._say_alone()
            out = self.local.evaluate(self.dataset, verbose=0, return_dict=True)
            own = self.member if self.members is None else self.members.own_name(self.member)
            counts, where, terms = {own: self.examples}, "chief", {}
        self.record = {
            "split": self.split, "where": where, "members": len(counts),
            "batch_size": self.batch_size, "examples": self.examples,
            "examples_per_member": counts, **terms,
            "seconds": round(time.perf_counter() - started, 3),
            "prepared_seconds": self.prepared_seconds,
            **({"alone_because": self.alone_because} if self.alone_because else {})}
        return {name: float(value) for name, value in out.items()}

    def _results_from(self, states) -> dict:
        """The metrics' results from states summed over the members, assigned to the
        local model's metric variables first."""
        from keras.src.utils.python_utils import pythonify_logs

        for var, summed in zip(self.local.metrics_variables, states):
            var.assign(np.asarray(summed).astype(keras.backend.standardize_dtype(var.dtype)))
        return pythonify_logs(self.local.get_metrics_result())

    def _say_alone(self) -> None:
        if self.alone_because is not None and not self._said:
            self._said = True
            print(f"the {self.split} split is evaluated on the chief alone: "
                  f"{self.alone_because}", flush=True)


def split_metrics(values: dict[str, float]) -> tuple[float, dict[str, float]]:
    """(test loss, {metric: value}) from an evaluation's dict."""
    metrics = {k: v for k, v in values.items() if k != "loss"}
    return values.get("loss", math.nan), metrics


def weights_sha256(model: keras.Model) -> str:
    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(np.ascontiguousarray(w).tobytes())
    return digest.hexdigest()
