"""The evaluation under ps and ps-sync cut into shards (training.ps.sharded_eval):
each shard's metric states merged once, the merged results equal one process's
``model.evaluate``, and ``--eval-shards`` checked.

The shards here are evaluated in this process by the closures' own step
(``stateless_test_steps``) and handed to the chief's ``Evaluator`` as a
coordinator would return them, a retried one twice; the real coordinator is
tests/integration/test_sharded_evaluation.py's.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.protocol import ConfigError
from tfdist.training.loop.evaluation import Evaluator, EvalShards, ShardMerge
from tfdist.training.plan import eval_shards
from tfdist.training.ps.sharded_eval import (
    CoordinatedEvaluation, pack, unpack, refusal, stateless_test_steps,
)
from tfdist.training.workload import data

from tests.training import eval_tasks
from tests.training.test_evaluation_shares import assert_same, reference


# --- merging once -------------------------------------------------------------------------

def test_each_shard_is_merged_once_whoever_returns_it():
    merge = ShardMerge(3)
    assert merge.add(0, [np.array([1.0, 2.0]), np.array(3.0)], 10, "worker:0")
    assert merge.add(2, [np.array([1.0, 0.0]), np.array(1.0)], 7, "worker:1")
    # The coordinator ran shard 0 again after its worker was lost: not counted twice.
    assert not merge.add(0, [np.array([1.0, 2.0]), np.array(3.0)], 10, "worker:1")
    assert merge.missing() == [1]
    assert merge.add(1, [np.array([0.5, 0.5]), np.array(2.0)], 5, "worker:1")
    assert merge.missing() == []
    assert [v.tolist() for v in merge.states] == [[2.5, 2.5], 6.0]
    assert merge.examples == 22
    assert merge.per_worker == {"worker:0": 10, "worker:1": 12}
    with pytest.raises(ValueError):
        merge.add(3, [], 1, "worker:0")


def _shards_here(task, model, returned_twice=(), workers=2):
    """An ``EvalShards`` whose closures run in this process on ``model``'s weights, in
    the order a coordinator might return them (``returned_twice``: shards returned again)."""
    def run(local, initial, split, batch_size, bounds):
        values = [tf.convert_to_tensor(w.value) for w in model.weights]
        order = list(range(len(bounds)))[::-1] + list(returned_twice)
        for shard in order:
            lo, hi = bounds[shard]
            batches = data.task_split(task, split).skip(lo * batch_size).take(
                (hi - lo) * batch_size).batch(batch_size)
            states, examples = stateless_test_steps(local, values, [tf.constant(v) for v in initial],
                                                    batches)
            yield shard, [s.numpy() for s in states], int(examples), f"worker:{shard % workers}"

    return run


@pytest.mark.parametrize("name,shards", [("BINARY", 3), ("TWO_OUTPUTS", 8),
                                         ("SAMPLE_WEIGHTED", 5), ("OWN_TEST_STEP", 2)])
def test_merged_shards_equal_one_process(name, shards):
    task = getattr(eval_tasks, name)
    # Seeded: how far Keras's own-loss figure falls from the shards' (below) depends on
    # the weights; unseeded, reg_loss's gap passed 1e-3 in about one run of ten.
    keras.utils.set_random_seed(7)
    model = task.build_model()
    shards_here = EvalShards(shards, _shards_here(task, model, returned_twice=(1,)))
    evaluator = Evaluator(task, task.build_model(), members=shards_here)
    got, want = evaluator(model), reference(task, model)
    # Each output's own loss (cls_loss) is Keras's figure weighted by the batch's static
    # size, which differs between Keras's traced evaluate and a shard's batches (see
    # test_evaluation_shares.reference): compared to 1e-3; everything else to 1e-5.
    own = {k for k in want if k.endswith("_loss")}
    assert_same({k: v for k, v in got.items() if k not in own},
                {k: v for k, v in want.items() if k not in own})
    for name in own:
        assert got[name] == pytest.approx(want[name], rel=1e-3), name
    record = evaluator.record
    assert record["where"] == "workers" and record["shards"] == shards
    assert "shards_asked" not in record  # 7,777 examples make 8 batches: every shard made
    assert sum(record["examples_per_member"].values()) == record["examples"] == 7777


def test_the_record_says_the_shards_made_and_those_asked():
    """More shards asked than the split has batches: one shard per batch is made, and
    the record says both."""
    task = eval_tasks.BINARY
    model = task.build_model()
    evaluator = Evaluator(task, task.build_model(), members=EvalShards(
        20, _shards_here(task, model)))
    assert_same(evaluator(model), reference(task, model))
    record = evaluator.record
    assert record["shards"] == 8 and record["shards_asked"] == 20, record
    assert len(record["examples_per_member"]) == 2


def test_the_record_sums_each_workers_seconds_in_its_merged_shards():
    """Closures that report their own seconds: each worker's merged shards' seconds are
    summed in the record; a shard returned twice counts once."""
    task = eval_tasks.BINARY
    model = task.build_model()
    timed = _shards_here(task, model, returned_twice=(0,))

    def run(*args):
        for shard, states, examples, worker in timed(*args):
            yield shard, states, examples, worker, 0.25 + shard

    evaluator = Evaluator(task, task.build_model(), members=EvalShards(4, run))
    assert_same(evaluator(model), reference(task, model))
    # Shards 0 and 2 on worker:0, 1 and 3 on worker:1 (shard % 2); shard 0 returned twice.
    assert evaluator.record["batch_seconds_per_member"] == {"worker:0": 2.5, "worker:1": 4.5}


def test_the_workers_split_is_held_as_tensors_when_its_shapes_are_fixed():
    """The split a worker holds: its elements in memory when every one has the same
    shape (a shard's skip reads nothing), the task's own dataset otherwise."""
    from tfdist.training.ps.sharded_eval import whole_split

    task = eval_tasks.BINARY
    held = whole_split(task, "test")
    assert [int(x) for x in held.cardinality().numpy().reshape(-1)] == [7777]
    want = list(data.task_split(task, "test").skip(7000).take(3).as_numpy_iterator())
    got = list(held.skip(7000).take(3).as_numpy_iterator())
    assert len(got) == 3
    for a, b in zip(got, want):
        tf.nest.map_structure(np.testing.assert_array_equal, a, b)

    class Ragged:
        def dataset(self, split):
            return tf.data.Dataset.range(1, 4).map(lambda n: tf.ones([n]))

    ragged = whole_split(Ragged(), "test")
    assert [list(x) for x in ragged.as_numpy_iterator()] == [[1.0], [1.0, 1.0], [1.0] * 3]


def test_a_model_the_workers_cannot_map_is_evaluated_on_the_chief(capsys):
    task = eval_tasks.BINARY
    model = task.build_model()
    why = "the model's variables are split over the ps tasks (--shard-variables)"
    evaluator = Evaluator(task, task.build_model(), members=EvalShards(
        4, _shards_here(task, model), refusal=why))
    assert_same(evaluator(model), reference(task, model))
    assert evaluator.record["where"] == "chief"
    assert why in capsys.readouterr().out


def test_a_split_variable_is_refused_by_name():
    import keras

    small = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    assert refusal(small, small) is None
    assert "split over the ps tasks" in refusal(small, other)


# --- free workers (ps-sync) --------------------------------------------------------------

class _Remote:
    def __init__(self, log, value):
        self.log, self.value = log, value

    def fetch(self):
        self.log.append("fetch")
        return self.value


class _Coordinator:
    """What ``CoordinatedEvaluation.run`` asks of a ``ClusterCoordinator``, logged."""

    def __init__(self, log):
        self.log = log

    def create_per_worker_dataset(self, fn):
        return type("PerWorkerDataset", (), {"build": lambda self: ["a worker's split"]})()

    def schedule(self, fn, args):
        self.log.append("schedule")
        shard = int(args[1])
        return _Remote(self.log, pack([shard, 10 + shard, shard % 2, 0.5], [np.array([1.0])]))

    def join(self):
        raise AssertionError("join() also waits for a stuck worker's step closure")


def test_a_shards_result_is_one_tensor_that_unpacks_exactly():
    """One tensor a closure (the coordinator copies each returned tensor on its own round
    trip): float32 states, an AUC's confusion counts, int64 counts and the four numbers
    come back with their shapes, dtypes and values."""
    like = [np.zeros((200, 1), np.float32), np.zeros((), np.float32), np.zeros(3, np.int64)]
    states = [np.random.default_rng(0).random((200, 1)).astype(np.float32) * 1e4,
              np.float32(0.1), np.array([0, 7, 2 ** 40 + 3])]
    numbers, got = unpack(pack([tf.constant(4, tf.int64), 9_999, 1, 0.25], states), like)
    assert numbers == [4.0, 9999.0, 1.0, 0.25]
    for g, want, ref in zip(got, states, like):
        assert g.dtype == ref.dtype and g.shape == ref.shape
        np.testing.assert_array_equal(g, want)
    with pytest.raises(ValueError, match="returned 3 state values, expected 204"):
        unpack(pack([0, 0, 0, 0], [np.zeros(3)]), like)


def test_shards_are_scheduled_and_fetched_only_while_the_workers_are_free():
    """ps-sync: every shard is scheduled once the trainer's step closures have ended
    (``quiet`` entered), each fetched on its own, and the closures resume after the
    last (``quiet`` left), even when a fetch fails."""
    import contextlib

    log = []

    @contextlib.contextmanager
    def quiet():
        log.append("pause")
        try:
            yield
        finally:
            log.append("resume")

    task = eval_tasks.BINARY
    evaluation = CoordinatedEvaluation(_Coordinator(log), task.build_model(), task,
                                       ["worker:0", "worker:1"], quiet=quiet)
    local = task.build_model()
    got = list(evaluation.run(local, [np.zeros(1)], "test", 1000, [(0, 2), (2, 5), (5, 8)]))
    assert log == ["pause", *["schedule"] * 3, *["fetch"] * 3, "resume"]
    assert [(s, n, w, t) for s, _, n, w, t in got] == [
        (0, 10, "worker:0", 0.5), (1, 11, "worker:1", 0.5), (2, 12, "worker:0", 0.5)]

    def failing():
        raise RuntimeError("lost")

    log.clear()
    evaluation.coordinator.schedule = lambda fn, args: type(
        "Failed", (), {"fetch": staticmethod(failing)})()
    with pytest.raises(RuntimeError, match="lost"):
        list(evaluation.run(local, [np.zeros(1)], "test", 1000, [(0, 8)]))
    assert log == ["pause", "resume"]


# --- --eval-shards ---------------------------------------------------------------------------

def test_eval_shards_auto_is_five_per_worker():
    assert eval_shards("auto", 2) == 10
    assert eval_shards("auto", 4) == 20
    assert eval_shards("3", 2) == 3


@pytest.mark.parametrize("value", ["0", "-2", "x", "1.5", ""])
def test_eval_shards_refuses_what_is_not_a_positive_count_in_one_line(value):
    with pytest.raises(ConfigError) as refused:
        eval_shards(value, 2)
    line = str(refused.value)
    assert "--eval-shards" in line and "positive whole number" in line and "\n" not in line
