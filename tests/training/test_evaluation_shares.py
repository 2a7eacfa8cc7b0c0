"""An evaluation shared by several members: the arithmetic of the shares, and the
merged metric states equal one process's ``model.evaluate``.

The members here are threads of this process, each with its own local model;
their collective is a barrier that sums the vectors they hand it (the real one,
an all-reduce between processes, is tests/integration/test_shared_evaluation.py's).
"""

import math
import threading

import numpy as np
import pytest

from tfdist.training.loop import evaluation
from tfdist.training.loop.evaluation import EvalMembers, Evaluator
from tfdist.training.workload import data

from tests.training import eval_tasks


# --- the shares' arithmetic -----------------------------------------------------------

@pytest.mark.parametrize("examples", [1, 7, 999, 1000, 1001, 7777, 10_000, 60_001])
@pytest.mark.parametrize("batch_size", [1, 64, 1000])
@pytest.mark.parametrize("members", [1, 2, 3, 4, 7])
def test_every_example_is_evaluated_once(examples, batch_size, members):
    counts = evaluation.examples_per_member(examples, batch_size, members)
    assert sum(counts) == examples and len(counts) == members
    assert max(counts) <= math.ceil(examples / members) + batch_size
    # The ranges of batches are contiguous, disjoint and cover every batch once.
    batches = math.ceil(examples / batch_size)
    covered = []
    for rank in range(members):
        lo, hi = evaluation.batch_range(batches, members, rank)
        covered.extend(range(lo, hi))
        assert hi - lo <= math.ceil(batches / members)
    assert covered == list(range(batches))


def test_the_short_last_batch_is_the_last_members():
    assert evaluation.examples_per_member(7777, 1000, 2) == [4000, 3777]
    assert evaluation.examples_per_member(7777, 1000, 4) == [2000, 2000, 2000, 1777]
    # More members than batches: some add nothing.
    assert evaluation.examples_per_member(1500, 1000, 3) == [0, 1000, 500]


# --- the merged states ------------------------------------------------------------------

class Barrier:
    """Members' sum: each hands its vector, all get the total."""

    def __init__(self, n):
        self.vectors = [None] * n
        self.barrier = threading.Barrier(n)
        self.calls = 0

    def total_for(self, rank):
        def total(vector):
            self.vectors[rank] = np.array(vector)
            self.barrier.wait(timeout=120)
            out = np.sum(self.vectors, axis=0)
            self.barrier.wait(timeout=120)  # nobody overwrites a vector still being summed
            if rank == 0:
                self.calls += 1
            return out
        return total


def shared(task, model, n, split="test"):
    """Each member's evaluation of ``model``'s weights, run together: [(values, record)]."""
    names = tuple(f"worker:{i}" for i in range(n))
    barrier = Barrier(n)
    evaluators = [Evaluator(task, task.build_model(), split=split,
                            members=EvalMembers(names, rank, rank == 0, barrier.total_for(rank)))
                  for rank in range(n)]
    out = [None] * n
    errors = []

    def run(rank):
        try:
            out[rank] = (evaluators[rank](model), evaluators[rank].record)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)
            barrier.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    return out, barrier


def reference(task, model, split="test", batch_size=32):
    """One process's Keras evaluate, at another batch size than the shares'.

    Except each output's own loss (``cls_loss``): Keras weights it by the batch's
    static size, unknown (weight 1) once its function is retraced for a short
    batch, so Keras itself gives another figure at every batch size; it is
    compared with Keras's at the shares' batch size (1,000, the same batches).
    """
    def run(batch):
        return model.evaluate(data.eval_dataset(task, batch, split), verbose=0, return_dict=True)

    out, same_batches = run(batch_size), run(1000)
    return {k: same_batches[k] if k.endswith("_loss") else v for k, v in out.items()}


def assert_same(got, want):
    assert set(got) == set(want)
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("name,n", [("BINARY", 2), ("BINARY", 4), ("TWO_OUTPUTS", 3),
                                    ("SAMPLE_WEIGHTED", 2), ("OWN_TEST_STEP", 2)])
def test_shared_evaluation_equals_one_process(name, n):
    task = getattr(eval_tasks, name)
    model = task.build_model()
    out, barrier = shared(task, model, n)
    want = reference(task, model)
    for values, record in out:  # every member reads the same results
        assert_same(values, want)
    record = out[0][1]
    assert record["where"] == "members" and record["members"] == n
    counts = list(record["examples_per_member"].values())
    assert counts == evaluation.examples_per_member(7777, 1000, n) and sum(counts) == 7777
    # One collective for the pass, and one before it: the all-reduce traced and run on
    # zeros when the evaluation is prepared (Evaluator.prepare, ahead in a real run).
    assert barrier.calls == 2


def test_auc_comes_from_summed_confusion_counts():
    """Each member's own AUC differs from the whole split's; the merged one does not."""
    task = eval_tasks.BINARY
    model = task.build_model()
    out, _ = shared(task, model, 2)
    want = reference(task, model)
    halves = [model.evaluate(data.eval_dataset(task, 1000).skip(s).take(4), verbose=0,
                             return_dict=True)["auc"] for s in (0, 4)]
    assert out[0][0]["auc"] == pytest.approx(want["auc"], abs=1e-6)
    assert all(abs(h - want["auc"]) > 1e-4 for h in halves)


@pytest.mark.parametrize("name,why", [
    ("OWN_METRIC", "the metric 'largest_logit' (LargestLogit) keeps a state not known to be a sum"),
    ("OWN_NUMBERS", "the model's own test_step returns logs that are not its metrics' results"),
])
def test_what_cannot_be_merged_is_evaluated_on_the_chief_alone(name, why, capsys):
    task = getattr(eval_tasks, name)
    model = task.build_model()
    out, barrier = shared(task, model, 2)
    (chief, record), (worker, _) = out
    assert worker == {} and barrier.calls == 0
    assert record["where"] == "chief" and record["alone_because"].startswith(why)
    assert record["examples_per_member"] == {"worker:0": 7777}
    assert_same(chief, reference(task, model, batch_size=1000))
    said = [l for l in capsys.readouterr().out.splitlines() if "evaluated on the chief alone" in l]
    assert len(said) == 1 and why in said[0]


def test_a_validation_split_is_shared_too():
    task = eval_tasks.VALIDATED
    model = task.build_model()
    out, _ = shared(task, model, 2, split="validation")
    assert_same(out[0][0], reference(task, model, split="validation"))
    assert out[0][1]["examples_per_member"] == {"worker:0": 1000, "worker:1": 1222}
