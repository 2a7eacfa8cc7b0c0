"""The evaluation shared by the workers of a real multiworker cluster: each
evaluates its range of the test split's batches and one all-reduce sums the
metrics' states; results.json's metrics equal one process's Keras ``evaluate``
of the saved ``model.keras``.

Every test split here is not a multiple of the evaluation's batch (1,000).
"""

import math

import pytest

from conftest import REPO, descendants_alive, launch_cmd, read_results
from tfdist.training.loop.evaluation import examples_per_member

pytestmark = pytest.mark.multiprocess

TASKS = str(REPO / "tests" / "training" / "eval_tasks.py")


def evaluate_saved(model_dir, dataset, batch_size=32, custom_objects=None):
    """``keras.models.load_model(model.keras).evaluate(...)`` in this process."""
    import keras

    model = keras.models.load_model(f"{model_dir}/model.keras", custom_objects=custom_objects)
    return model.evaluate(dataset.batch(batch_size), verbose=0, return_dict=True)


def assert_equal_to_one_process(results, want):
    got = {"loss": results["test_loss"], **results["test_metrics"]}
    assert set(got) == set(want), (got, want)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def assert_shared(results, workers, examples, batch_size=1000):
    record = results["evaluation"]
    assert record["where"] == "members" and record["members"] == workers, record
    counts = record["examples_per_member"]
    assert sum(counts.values()) == examples == record["examples"]
    assert list(counts.values()) == examples_per_member(examples, batch_size, workers)
    assert max(counts.values()) <= math.ceil(examples / workers) + batch_size


def run(spawn, tmp_path, task, workers, *train_args, timeout=240, strategy="multiworker",
        launch_args=()):
    model_dir = str(tmp_path / "run")
    p = spawn(launch_cmd(strategy, "--workers", str(workers), *launch_args,
                         "--timeout", str(timeout),
                         train_args=["--task", task, "--log-every", "10", "--model-dir",
                                     model_dir, *train_args]))
    assert p.wait(timeout + 20) == 0, p.output
    assert descendants_alive(model_dir) == []
    return model_dir, read_results(model_dir), p


@pytest.mark.timeout(300)
def test_two_workers_share_the_evaluation_and_match_one_process(tmp_path, spawn):
    """AUC and accuracy of 7,777 test examples: 4,000 on worker:0, 3,777 on worker:1
    (the short batch), also at the --eval-every point."""
    from tests.training import eval_tasks

    model_dir, results, p = run(spawn, tmp_path, f"{TASKS}:BINARY", 2, "--steps", "20",
                                "--eval-every", "10")
    assert_shared(results, 2, 7777)
    assert_equal_to_one_process(results, evaluate_saved(model_dir,
                                                        eval_tasks.BINARY.dataset("test")))
    assert [point["step"] for point in results["eval_curve"]] == [10, 20]
    # Only the chief says it.
    assert sum(1 for line in p.lines if " eval step 10 " in line) == 1


# The long tier: the default tier keeps the two-worker test above (CI time).
@pytest.mark.long
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name,workers", [("TWO_OUTPUTS", 4), ("SAMPLE_WEIGHTED", 2)])
def test_several_outputs_and_sample_weights_match_one_process(tmp_path, spawn, name, workers):
    from tests.training import eval_tasks

    model_dir, results, _ = run(spawn, tmp_path, f"{TASKS}:{name}", workers, "--steps", "20",
                                timeout=360)
    assert_shared(results, workers, 7777)
    want = evaluate_saved(model_dir, getattr(eval_tasks, name).dataset("test"))
    # Each output's own loss: Keras weights it by the batch's static size (weight 1
    # once retraced for a short batch), so it depends on the batching in Keras
    # itself; compared at the library's evaluation batch, the same batches.
    same_batches = evaluate_saved(model_dir, getattr(eval_tasks, name).dataset("test"), 1000)
    want = {k: same_batches[k] if k.endswith("_loss") and k != "loss" else v
            for k, v in want.items()}
    assert_equal_to_one_process(results, want)


@pytest.mark.long
@pytest.mark.timeout(400)
def test_a_metric_that_cannot_be_summed_is_evaluated_on_the_chief(tmp_path, spawn):
    from tests.training import eval_tasks

    model_dir, results, p = run(spawn, tmp_path, f"{TASKS}:OWN_METRIC", 2, "--steps", "20")
    record = results["evaluation"]
    assert record["where"] == "chief" and record["examples_per_member"] == {"worker:0": 7777}
    assert "largest_logit" in record["alone_because"]
    said = [line for line in p.lines if "evaluated on the chief alone" in line]
    assert len(said) == 1 and said[0].startswith("[worker:0]")
    want = evaluate_saved(model_dir, eval_tasks.OWN_METRIC.dataset("test"), 1000,
                          {"LargestLogit": eval_tasks.LargestLogit})
    assert_equal_to_one_process(results, want)


@pytest.mark.long
@pytest.mark.timeout(500)
def test_the_validation_split_given_to_callbacks_is_shared(tmp_path, spawn):
    """Two epochs of 4,000 (32 steps of 128 each): the validation split (2,222) at each end."""
    from tests.training import eval_tasks

    model_dir, results, _ = run(spawn, tmp_path, f"{TASKS}:VALIDATED", 2, "--epochs", "2",
                                timeout=420)
    assert [point["epoch"] for point in results["val_curve"]] == [1, 2]
    want = evaluate_saved(model_dir, eval_tasks.VALIDATED.dataset("validation"))
    for name, value in want.items():
        assert results["val_metrics"][f"val_{name}"] == pytest.approx(value, abs=2e-5), name
    assert_shared(results, 2, 7777)


BUILTINS = [
    ("mnist-cnn", (), 10_000),
    ("ctr", ("--task-option", "rows=100000", "--task-option", "test_size=12345"), 12_345),
]


@pytest.mark.long
@pytest.mark.timeout(700)
@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("task,options,examples", BUILTINS)
def test_builtin_tasks_match_one_process(tmp_path, spawn, task, options, examples, workers):
    model_dir, results, _ = run(spawn, tmp_path, task, workers, "--steps", "30", *options,
                                timeout=640)
    assert_shared(results, workers, examples)
    assert_equal_to_one_process(results, evaluate_saved(model_dir, _test_split(task, options)))


def _test_split(task, options):
    from tfdist.training.workload import tasks

    spec = tasks.parse_spec(task, [o for o in options if o != "--task-option"])
    return tasks.load(spec).dataset("test")


@pytest.mark.long
@pytest.mark.timeout(700)
@pytest.mark.parametrize("strategy,task,options,examples", [
    *(("ps", *builtin) for builtin in BUILTINS), ("ps-sync", *BUILTINS[0])])
def test_under_ps_the_chiefs_evaluation_matches_one_process(tmp_path, spawn, strategy, task,
                                                            options, examples):
    """Under ps and ps-sync the split is cut into 5 x 2 shards the coordinator schedules
    on the workers (training.ps.sharded_eval), each merged once on the chief, and the
    figures are one process's."""
    model_dir, results, _ = run(spawn, tmp_path, task, 2, "--steps", "30", *options,
                                timeout=640, strategy=strategy, launch_args=("--ps", "1"))
    assert_sharded(results, examples, shards=10)
    assert_equal_to_one_process(results, evaluate_saved(model_dir, _test_split(task, options)))


def assert_sharded(results, examples, shards):
    record = results["evaluation"]
    assert record["where"] == "workers" and record["shards"] == shards, record
    assert record["examples"] == examples == sum(record["examples_per_member"].values())
    assert set(record["examples_per_member"]) <= {"worker:0", "worker:1"}


@pytest.mark.long
@pytest.mark.timeout(700)
@pytest.mark.parametrize("strategy,name,shards", [
    ("ps", "BINARY", "auto"), ("ps", "TWO_OUTPUTS", "3"), ("ps", "SAMPLE_WEIGHTED", "7"),
    ("ps-sync", "TWO_OUTPUTS", "3"), ("ps-sync", "SAMPLE_WEIGHTED", "7")])
def test_under_ps_the_workers_evaluate_shards_as_one_process(tmp_path, spawn, strategy, name,
                                                             shards):
    """7,777 examples in 8 batches cut into shards, at the --eval-every point too."""
    from tests.training import eval_tasks

    model_dir, results, _ = run(spawn, tmp_path, f"{TASKS}:{name}", 2, "--steps", "20",
                                "--eval-every", "10", "--eval-shards", shards, timeout=640,
                                strategy=strategy, launch_args=("--ps", "1"))
    asked = 10 if shards == "auto" else int(shards)
    assert_sharded(results, 7777, shards=min(asked, 8))
    assert results["evaluation"].get("shards_asked") == (asked if asked > 8 else None)
    want = evaluate_saved(model_dir, getattr(eval_tasks, name).dataset("test"))
    # Each output's own loss is Keras's batch-size-weighted figure (see above): compared
    # with Keras's at the library's batch, to 1e-3 (a shard's batches have no static size).
    same_batches = evaluate_saved(model_dir, getattr(eval_tasks, name).dataset("test"), 1000)
    own = {k for k in want if k.endswith("_loss")}
    want = {k: same_batches[k] if k in own else v for k, v in want.items()}
    assert_equal_to_one_process(
        {**results, "test_metrics": {k: v for k, v in results["test_metrics"].items()
                                     if k not in own}},
        {k: v for k, v in want.items() if k not in own})
    for k in own:
        assert results["test_metrics"][k] == pytest.approx(want[k], rel=1e-3), k
    assert [point["step"] for point in results["eval_curve"]] == [10, 20]


# The long tier: ~160 s on a loaded 2-core host (the slowed worker's start-up).
@pytest.mark.long
@pytest.mark.timeout(300)
def test_under_ps_sync_with_a_backup_worker_the_workers_evaluate_shards_as_one_process(
        tmp_path, spawn):
    """ps-sync, K = 1 of 2 (worker:1 slowed: the backup, its step closure often still
    computing or waiting when the chief stops for an evaluation): the step closures end
    and the shards run on the workers, at the --eval-every point and at the end, each
    merged once, the figures one process's; training then resumes with no token lost
    (every update applied, K = 1 gradient each)."""
    from tests.training import eval_tasks

    model_dir, results, p = run(spawn, tmp_path, f"{TASKS}:BINARY", 2, "--steps", "20",
                                "--eval-every", "10", "--replicas-to-aggregate", "1",
                                timeout=260, strategy="ps-sync",
                                launch_args=("--ps", "1", "--slow", "worker:1=0.5"))
    assert_sharded(results, 7777, shards=8)  # auto asks 5 x 2; 8 batches make 8 shards
    assert_equal_to_one_process(results, evaluate_saved(model_dir,
                                                        eval_tasks.BINARY.dataset("test")))
    assert [point["step"] for point in results["eval_curve"]] == [10, 20]
    assert results["global_steps"] == results["applied_steps"] == 20
    assert results["aggregated_gradients"] == 20 and results["stale_gradients_applied"] == 0
    assert results["stuck_workers"] == []
    said = [line for line in p.lines if "shards scheduled on the workers" in line]
    assert len(said) == 2 and all(line.startswith("[chief:0]") for line in said), p.output


@pytest.mark.long
@pytest.mark.timeout(500)
def test_under_ps_sync_the_validation_split_is_evaluated_in_shards(tmp_path, spawn):
    """Two epochs of 4,000: the validation split (2,222) at each end, in shards on the
    workers, as one process's; the final evaluation too."""
    from tests.training import eval_tasks

    model_dir, results, p = run(spawn, tmp_path, f"{TASKS}:VALIDATED", 2, "--epochs", "2",
                                timeout=420, strategy="ps-sync", launch_args=("--ps", "1"))
    assert [point["epoch"] for point in results["val_curve"]] == [1, 2]
    want = evaluate_saved(model_dir, eval_tasks.VALIDATED.dataset("validation"))
    for name, value in want.items():
        assert results["val_metrics"][f"val_{name}"] == pytest.approx(value, abs=2e-5), name
    assert any("the validation split: " in line and "shards scheduled on the workers" in line
               for line in p.lines), p.output
    assert_sharded(results, 7777, shards=8)  # auto asks 5 x 2; 8 batches make 8
