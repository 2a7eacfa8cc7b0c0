"""Cutting a model into pipeline stages (``training.pipeline.stages``), the pipeline
kind's facts, and the pipeline's bad inputs, refused before anything starts."""

import itertools
import json
import random

import pytest

from tfdist.launcher import plan as launch_plan
from tfdist.launcher import policy
from tfdist.protocol import ConfigError
from tfdist.strategies import kinds
from tfdist.strategies.tf_config import parse_tf_config
from tfdist.training.pipeline import stages
from tfdist.training.config import TrainConfig
from tfdist.training.plan import resolve

# mnist-mlp's layers: Rescaling, Flatten, four ~200k Dense layers, a head.
MLP_PARAMS = [0, 0, 200_960, 197_376, 196_864, 197_376, 7_690]


def _brute_force(params, s):
    best = None
    for cut in itertools.combinations(range(1, len(params)), s - 1):
        edges = [0, *cut, len(params)]
        worst = max(sum(params[a:b]) for a, b in zip(edges, edges[1:]))
        best = worst if best is None else min(best, worst)
    return best


def _worst(params, bounds):
    return max(sum(params[a:b]) for a, b in stages.ranges(bounds, len(params)))


def test_balance_cuts_the_mlp_into_nearly_equal_stages():
    assert stages.balance(MLP_PARAMS, 2) == (4,)
    assert stages.balance(MLP_PARAMS, 4) == (3, 4, 5)
    total = sum(MLP_PARAMS)
    for s in (2, 4):
        shares = [sum(MLP_PARAMS[a:b]) / total
                  for a, b in stages.ranges(stages.balance(MLP_PARAMS, s), len(MLP_PARAMS))]
        assert all(abs(share - 1 / s) < 0.1 / s for share in shares), shares


def test_balance_is_optimal_and_every_stage_holds_a_layer():
    rng = random.Random(0)
    for _ in range(200):
        params = [rng.choice([0, 1, 5, 100, 1000]) for _ in range(rng.randint(1, 8))]
        s = rng.randint(1, len(params))
        bounds = stages.balance(params, s)
        assert len(bounds) == s - 1 and list(bounds) == sorted(set(bounds))
        assert all(a < b for a, b in stages.ranges(bounds, len(params)))
        assert _worst(params, bounds) == _brute_force(params, s)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ConfigError, match="cannot cut a chain of 3 layer"):
        stages.balance([0, 0, 10], 4)


@pytest.mark.parametrize("text", ["0,2", "3,2", "2,2", "a", "1,,2", "-1"])
def test_bad_stage_boundaries_are_refused(text):
    with pytest.raises(ConfigError, match="--stages .* is not a list of layer indices"):
        stages.parse_boundaries(text)


def test_make_plan_checks_workers_stages_and_batch():
    pp = stages.make_plan(4, 4, 2, None, 64)
    assert (pp.stages, pp.micro_batches, pp.pipelines) == (2, 4, 2)
    assert [pp.worker(p, s) for p in range(2) for s in range(2)] == [0, 1, 2, 3]
    assert pp.bubble() == pytest.approx(1 / 5)
    assert stages.make_plan(3, 1, 1, "2,4", 64).boundaries == (2, 4)
    with pytest.raises(ConfigError, match="--pipelines 2 needs P x S workers"):
        stages.make_plan(3, 1, 2, None, 64)
    with pytest.raises(ConfigError, match="--pipelines 2 needs P x S workers"):
        stages.make_plan(1, 1, 2, None, 64)
    with pytest.raises(ConfigError, match="makes 3 stages, but 2 worker"):
        stages.make_plan(2, 1, 1, "2,4", 64)
    with pytest.raises(ConfigError, match="does not split into 2 pipeline copies x 3 micro"):
        stages.make_plan(4, 3, 2, None, 64)


def _cluster(workers, ps=0, member=("chief", 0)):
    cluster = {"chief": ["localhost:1"], "worker": [f"localhost:{10 + i}" for i in range(workers)]}
    if ps:
        cluster["ps"] = ["localhost:2"]
    return parse_tf_config(json.dumps({"cluster": cluster,
                                       "task": {"type": member[0], "index": member[1]}}))


def test_the_pipeline_kind_lays_out_a_client_and_serving_workers():
    kind = kinds.get("pipeline")
    assert kind.pipelined and kind.trainer in kinds.LOOPS
    assert policy.layout(kind, 4) == {"chief": 1, "worker": 4, "ps": 0}
    assert launch_plan.member_names(kind, 2) == ["chief:0", "worker:0", "worker:1"]
    assert not policy.decides(kind, "worker:1") and policy.decides(kind, "chief:0")
    cluster = _cluster(2)
    assert kind.reads_data(cluster) and not kind.serves(cluster)
    assert kind.serves(_cluster(2, member=("worker", 1)))
    # --strategy auto never cuts a model on its own.
    assert kinds.resolve("auto", cluster).name != "pipeline"
    with pytest.raises(ConfigError, match="takes no 'ps' job"):
        kinds.resolve("pipeline", _cluster(2, ps=1))
    with pytest.raises(ConfigError, match="takes no ps tasks"):
        policy.layout(kind, 2, ps=1)
    no_chief = parse_tf_config(json.dumps({"cluster": {"worker": ["localhost:1"]},
                                           "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ConfigError, match="needs a 'chief' task"):
        kinds.resolve("pipeline", no_chief)


def _resolve(workers=2, **flags):
    config = TrainConfig(strategy=flags.pop("strategy", "pipeline"), task="mnist-mlp",
                         steps=10, cluster=_cluster(workers), **flags)
    return resolve(config, [], train_examples=60_000, test_examples=10_000)


def test_the_plan_resolves_the_pipeline_and_its_batch():
    plan = _resolve(4, micro_batches=4, pipelines=2)
    assert plan.pipeline.stages == 2 and plan.replicas == 2
    assert plan.global_batch_size == 128  # 64 per copy, TensorFlow's convention
    assert plan.describe()["pipeline"]["predicted_bubble"] == 0.2
    assert plan.defining_flags()["pipeline_stages"] == 2
    with pytest.raises(ConfigError, match="does not split into 1 pipeline copies x 5"):
        _resolve(2, micro_batches=5)


@pytest.mark.parametrize("flags", [{"micro_batches": 4}, {"pipelines": 2}, {"stages": "3"},
                                   {"schedule": "1f1b"}])
def test_pipeline_flags_are_refused_under_other_strategies(flags):
    config = TrainConfig(strategy="mirrored", task="mnist-mlp", steps=10, **flags)
    with pytest.raises(ConfigError, match="does not; drop the flag.* --strategy pipeline"):
        resolve(config, [], train_examples=60_000, test_examples=10_000)


def in_flight(slots: list[tuple[str, int]]) -> int:
    """The most micro-batches whose activations a stage holds at once (forwarded,
    not yet backwarded) under ``slots`` (pure)."""
    held = most = 0
    for kind, _ in slots:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "dataflow"])
@pytest.mark.parametrize("S, M", [(1, 1), (2, 2), (2, 8), (3, 4), (4, 8)])
def test_every_stage_runs_each_forward_then_its_backward_once(schedule, S, M):
    for s in range(S):
        slots = stages.schedule_slots(schedule, S, M, s)
        assert sorted(slots) == sorted([("F", m) for m in range(M)] + [("B", m) for m in range(M)])
        assert all(slots.index(("F", m)) < slots.index(("B", m)) for m in range(M))
        # GPipe holds every micro-batch's activations; 1F1B at most S - s of them.
        # (dataflow is traced in GPipe's order and holds at most as many)
        assert in_flight(slots) == (min(S - s, M) if schedule == "1f1b" else M)
    if schedule == "1f1b":  # the last stage alternates from the start
        assert stages.schedule_slots("1f1b", S, M, S - 1)[:2] == [("F", 0), ("B", 0)]


def test_the_schedule_is_checked_and_1f1b_needs_as_many_micro_batches_as_stages():
    assert _resolve(2, micro_batches=2).pipeline.schedule == "dataflow"
    assert _resolve(2, micro_batches=2, schedule="1f1b").pipeline.describe()["schedule"] == "1f1b"
    with pytest.raises(ConfigError, match="--schedule 1f1b with --micro-batches 1 under 2 stages"):
        _resolve(2, schedule="1f1b")
    with pytest.raises(ConfigError,
                       match="unknown --schedule 'pipedream'; allowed: gpipe, 1f1b, dataflow"):
        TrainConfig(strategy="pipeline", schedule="pipedream").validate()


def test_only_dataflow_runs_slots_unchained_and_only_1f1b_makes_weight_gradients_per_micro_batch():
    plans = {name: stages.PipelinePlan(2, 8, 1, schedule=name)
             for name in ("gpipe", "1f1b", "dataflow")}
    assert {n: p.chained for n, p in plans.items()} == {
        "gpipe": True, "1f1b": True, "dataflow": False}
    assert {n: p.defers_weight_gradients for n, p in plans.items()} == {
        "gpipe": True, "1f1b": False, "dataflow": True}
    # One micro-batch has nothing to gather; a transposed copy pays from three products.
    assert not stages.PipelinePlan(2, 1, 1).defers_weight_gradients
    assert [stages.PipelinePlan(2, m, 1).transposes_weights for m in (1, 2, 3, 8)] == [
        False, False, True, True]
    # Traced in GPipe's order: the same sums in the same order as GPipe.
    assert plans["dataflow"].slots(0) == plans["gpipe"].slots(0)


# --- cutting Keras models (builds small models locally) --------------------------


class _Task:
    def __init__(self, build, provide=None):
        self.build_model, self._provide = build, provide
        if provide is not None:
            self.stages = provide


def _dense_chain(functional):
    import keras

    layers = [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(8),
              keras.layers.Dense(3)]
    if not functional:
        return keras.Sequential([keras.Input((4,)), *layers])
    x = inp = keras.Input((4,))
    for layer in layers:
        x = layer(x)
    return keras.Model(inp, x)


@pytest.mark.parametrize("functional", [False, True])
def test_a_chain_is_cut_into_stages_that_compute_the_model(functional):
    import numpy as np

    model = _dense_chain(functional)
    pp = stages.make_plan(2, 1, 1, "2", 64)
    local, cut = stages.local_stages(_Task(lambda: model), model, pp)
    assert len(local) == 2 and "stage 0: layers 0-1" in cut and "stage 1: layers 2-2" in cut
    x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    np.testing.assert_allclose(local[1](local[0](x)), model(x), rtol=1e-6)
    whole = [w.shape for w in model.weights]
    assert [w.shape for m in local for w in m.weights] == whole


def test_a_functional_graph_is_cut_at_its_layer_calls_carrying_what_later_stages_read():
    """A residual model with two outputs, the second made early: each cut carries every
    tensor a later call reads (or that is an output), and the last stage gives the
    model's outputs in their structure."""
    import keras
    import numpy as np

    inp = keras.Input((4,), name="x")
    h = keras.layers.Dense(4, name="h")(inp)
    aux = keras.layers.Dense(1, name="aux")(h)
    g = keras.layers.Dense(4, name="g")(h)
    out = keras.layers.Dense(2, name="out")(keras.layers.Add()([inp, g, h]))
    model = keras.Model(inp, {"aux": aux, "out": out})
    local, cut = stages.local_stages(_Task(lambda: model), model,
                                     stages.make_plan(3, 1, 1, "2,3", 64))
    # Several tensors cross each cut (aux, an output made early, among them); the
    # start line says how many.
    import re

    crossing = [int(n) for n in re.findall(r"(\d+) tensor\(s\) on", cut)]
    assert len(local) == 3 and len(crossing) == 2 and min(crossing) >= 2, cut
    x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    got, want = local[2](local[1](local[0](x))), model(x)
    assert sorted(got) == ["aux", "out"]
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6)
    # The stages hold the model's own variables, each once.
    staged = [id(w) for m in local for w in m.weights]
    assert sorted(staged) == sorted(id(w) for w in model.weights)


def test_a_subclassed_model_is_traced_into_a_graph_of_layer_calls_and_cut():
    import keras
    import numpy as np

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.a, self.b = keras.layers.Dense(8), keras.layers.Dense(3)

        def call(self, x, training=False):
            h = self.a(x)
            return self.b(keras.ops.relu(h) + h)  # Keras ops between layers

    model = Net()  # not built: its variables are made by the trace
    x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    local, cut = stages.local_stages(_Task(lambda: model), model,
                                     stages.make_plan(2, 1, 1, None, 64), example=(x[:1],))
    assert "stage 1" in cut and len(local) == 2
    np.testing.assert_allclose(local[1](local[0](x)), model(x), rtol=1e-6)


def test_a_model_whose_call_cannot_be_traced_cannot_be_cut_saying_how_to_provide_stages():
    """The cut's own line (CannotCut): under pipeline such a model trains placed
    (tests/training/test_placed.py); a task's stages() cuts it."""
    import keras
    import numpy as np
    import tensorflow as tf

    class Eager(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(3)

        def call(self, x):
            return self.a(tf.math.cumsum(x, axis=1))  # a TensorFlow op: no Keras node

    class Shared(keras.Model):
        def __init__(self):
            super().__init__()
            self.a, self.b = keras.layers.Dense(4), keras.layers.Dense(2)

        def call(self, x):
            return self.b(self.a(self.a(x)))  # one layer's weights used twice

    example = (np.ones((1, 4), "float32"),)
    pp = stages.make_plan(2, 1, 1, None, 64)
    for model, says in ((Eager(), "its call could not be traced"),
                        (Shared(), "its layer 'dense")):
        with pytest.raises(stages.CannotCut, match=f"{says}.*provide stages: .*stages\\(\\)") as err:
            stages.local_stages(_Task(lambda m=model: m), model, pp, example=example)
        assert "\n" not in str(err.value) and isinstance(err.value, ConfigError)


def test_a_task_may_provide_its_own_stages():
    import keras

    def two():
        return [keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)]),
                keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])]

    def whole():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(3)])

    model = whole()
    pp = stages.make_plan(2, 1, 1, None, 64)
    local, cut = stages.local_stages(_Task(whole, two), model, pp)
    assert "from the task's stages()" in cut
    # They start from build_model()'s (seeded) weights.
    for got, want in zip([w for m in local for w in m.get_weights()], model.get_weights()):
        assert (got == want).all()
    with pytest.raises(ConfigError, match="stages\\(\\) returned 2 models, but the cluster has 3"):
        stages.local_stages(_Task(whole, two), model, stages.make_plan(3, 1, 1, None, 64))


def test_train_refuses_more_stages_than_layers_in_one_line(monkeypatch, capsys, tmp_path):
    from tfdist.cli import train

    tf_config = {"cluster": {"chief": ["localhost:1"],
                             "worker": [f"localhost:{10 + i}" for i in range(4)]},
                 "task": {"type": "chief", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    # mnist-logreg is Rescaling, Flatten, Dense: 3 layers for 4 stages.
    code = train.main(["--strategy", "pipeline", "--task", "mnist-logreg", "--check-only",
                       "--model-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: task mnist-logreg: cannot cut its 3 layer(s) into 4 stages")


def test_resuming_with_another_stage_count_names_flags_that_exist(tmp_path):
    # The stage count is recorded, but set by --workers/--pipelines/--stages: the
    # refusal must name those, not a flag no command has.
    from tfdist.cli import train as train_cli
    from tfdist.protocol import ConfigError
    from tfdist.training.loop.survival import checkpoints

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "checkpoint").write_text("")
    (tmp_path / checkpoints.RUN_RECORD).write_text('{"pipeline_stages": 2}')
    with pytest.raises(ConfigError) as got:
        checkpoints.check_run_record(str(tmp_path), {"pipeline_stages": 3})
    line = str(got.value)
    assert "was 2, now 3" in line and "stage count" in line, line
    # Every flag the line names is one `train.py --help` lists.
    import contextlib
    import io

    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        train_cli.parse_args(["--help"])
    named = {w.strip("(),;/.") for w in line.split() if w.lstrip("(").startswith("--")}
    assert {"--pipelines", "--stages"} <= named, line
    for flag in named:
        assert flag in help_text.getvalue(), (flag, line)


def test_an_unbalanced_cut_is_said_at_the_start_and_a_balanced_one_is_not():
    # dense-chain's cut into two (4.7 M | 8.4 M): stage 0 waits for stage 1.
    note = stages.imbalance([4_722_688, 8_413_194])
    assert note.startswith("stage 0 holds 36% of the parameters against stage 1's 64%")
    assert "--stages" in note
    # Four stages: the lightest and the heaviest are named, wherever they are.
    assert stages.imbalance([4_200_000, 524_800, 4_200_000, 4_200_000]).startswith(
        "stage 1 holds 4% of the parameters against stage 0's")
    # Five wide layers (8.9 M | 8.4 M), one stage, no weights: nothing to say.
    assert stages.imbalance([8_919_040, 8_413_194]) == ""
    assert stages.imbalance([10]) == ""
    assert stages.imbalance([0, 0]) == ""
