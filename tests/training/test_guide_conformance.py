"""Keras's guides to custom training (``guide_tasks``), trained by plain ``model.fit``
in this process and by the library under every strategy that can honour them:
the same figures within the conformance tolerances; what a strategy cannot
honour, one line.

docs/fit-conformance.md ("Your own training logic") is the table these tests hold.
"""

import functools
import json
import math
import os
import re

import pytest

from conftest import REPO, refused_line, tensorboard_tags
from tests.training.conformance import BATCH, CLUSTERS, EPOCHS, launched_results
from tests.training import guide_tasks

SPEC = str(REPO / "tests" / "training" / "guide_tasks.py") + ":"
SYNC_TOLERANCE, PS_TOLERANCE = 0.04, 0.06
# What each task is judged by: ("test", metric) on the test split (Keras's evaluate),
# ("train", log) the last training logs where Keras's evaluate cannot run.
JUDGED = {
    "FIRST": (("test", "mae"),),
    "LOWER_LEVEL": (("train", "mae"),),
    # class_2_share: 0.32 without the weights.
    "SAMPLE_WEIGHTS": (("test", "accuracy"), ("test", "class_2_share")),
    "OWN_TEST_STEP": (("test", "mae"),),
    "GAN": (("train", "d_loss"), ("train", "g_loss")),
    "GAN_JIT": (("train", "d_loss"), ("train", "g_loss")),
    "GAN_EVERY_OTHER": (("train", "d_loss"), ("train", "g_loss")),
    "DIRECT_UPDATE": (("test", "mae"),),
    "DISTILLATION": (("test", "sparse_categorical_accuracy"),),
    "FEATURES_ONLY": (("test", "mae"),),
}
# The GAN's losses move with every batch the two players see: the library's must
# lie within the range plain fit gives over these seeds, widened by the margin.
# Under asynchronous ps each worker's generator step meets a discriminator its
# peer may have moved meanwhile, and g_loss lands lower (measured 0.52-0.63 in
# nine launches and once under 0.50 in a long-tier run, against fit's 0.75-0.77:
# docs/fit-conformance.md): a margin of its own.
# Under ps-sync (2 workers, K = 2) g_loss landed at 0.629, 0.662, 0.655 in three launches:
# lower than multiworker's 0.693, though one worker gives none's logs (0.691 against
# 0.683): a margin of its own, which an untrained generator or a collapsed
# discriminator still lands far outside.
GAN_SEEDS, GAN_MARGIN, GAN_PS_MARGIN = (0, 1, 2), 0.1, 0.35
# pipeline trains the GAN placed (the none loop); with jit_compile=True each call of its
# models is one XLA function of the weights' values, not the step compiled whole as fit
# compiles it, and its logs are the uncompiled GAN's (measured d 0.744 / g 0.683, none's
# GAN 0.743 / 0.682): 0.001 above fit's XLA range widened by GAN_MARGIN.
GAN_MARGINS = {"ps": GAN_PS_MARGIN, "ps-sync": 0.2, "pipeline": 0.12}
# The logs each task's own train_step gives, as fit's History names them.
TRAIN_LOGS = {
    "FIRST": {"loss", "mae"},
    "LOWER_LEVEL": {"loss", "mae"},
    "SAMPLE_WEIGHTS": {"loss", "accuracy", "class_2_share"},
    "GAN": {"d_loss", "g_loss"},
    "GAN_JIT": {"d_loss", "g_loss"},
    "GAN_EVERY_OTHER": {"d_loss", "g_loss"},
    "DIRECT_UPDATE": {"loss", "mae"},
    "FEATURES_ONLY": {"loss", "mae"},
}
NOT_EVALUATED = {"LOWER_LEVEL": "No loss to compute", "GAN": "GANModel.call()",
                 "GAN_JIT": "GANModel.call()", "GAN_EVERY_OTHER": "EveryOtherGANModel.call()"}
# What ps-sync's own route was built for (applies that vary from step to step, a
# train_step that moves its variables itself): trained under none and ps-sync.
PS_SYNC_ONLY = ("GAN_EVERY_OTHER", "DIRECT_UPDATE")


@functools.lru_cache(maxsize=None)
def plain_fit(name: str, seed: int = 0) -> dict:
    return guide_tasks.plain_fit(getattr(guide_tasks, name), epochs=EPOCHS, batch_size=BATCH,
                                 seed=seed)


def gan_range(log: str, margin: float = GAN_MARGIN, name: str = "GAN") -> tuple[float, float]:
    values = [plain_fit(name, seed)["train"][log] for seed in GAN_SEEDS]
    return min(values) - margin, max(values) + margin


def _compare(name: str, got: dict, strategy: str) -> None:
    want = plain_fit(name)
    _record(name, strategy, got, want)
    train = got["train_metrics"]
    if name in TRAIN_LOGS:  # Keras's flattened names: compile_metrics -> mae
        assert set(train) == TRAIN_LOGS[name] == set(want["train"]), (train, want["train"])
    if name in NOT_EVALUATED:
        assert want["test"] is None and NOT_EVALUATED[name] in want["test_error"]
        assert NOT_EVALUATED[name] in got["not_evaluated"], got.get("not_evaluated")
        assert got["test_metrics"] == {} and got["test_loss"] is None
    else:
        assert "not_evaluated" not in got
        assert set(got["test_metrics"]) == set(want["test"]) - {"loss"}, (got, want)
    tolerance = PS_TOLERANCE if strategy == "ps" else SYNC_TOLERANCE
    for split, metric in JUDGED[name]:
        value = train[metric] if split == "train" else got["test_metrics"][metric]
        assert math.isfinite(value), (name, metric, value)
        if name.startswith("GAN"):
            # A Keras loss divides by the replicas in sync (the all-reduced gradients
            # then add up to the global batch's); the guide's trackers record it as
            # is, so fit under a MirroredStrategy of R replicas logs 1/R of it too.
            if strategy in ("mirrored", "multiworker"):
                value *= got["replicas_in_sync"]
            low, high = gan_range(metric, GAN_MARGINS.get(strategy, GAN_MARGIN), name)
            assert low <= value <= high, (name, metric, value, (low, high))
            continue
        assert abs(value - want[split][metric]) <= tolerance, (name, metric, value,
                                                               want[split][metric])


def _record(name: str, strategy: str, got: dict, want: dict) -> None:
    """With TFDIST_CONFORMANCE_RECORD=FILE, append each cell's figures (JSON lines)."""
    path = os.environ.get("TFDIST_CONFORMANCE_RECORD")
    if not path:
        return
    row = {"task": "guide:" + name, "strategy": strategy, "fit": want,
           "library": {"test": got["test_metrics"], "test_loss": got["test_loss"],
                       "train": got["train_metrics"]}}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _config(strategy, name, model_dir, **kw):
    from tfdist.training.config import TrainConfig

    return TrainConfig(strategy=strategy, task=SPEC + name, model_dir=str(model_dir),
                       **{"epochs": EPOCHS, "global_batch_size": BATCH, "log_every": 30, **kw})


IN_PROCESS = [pytest.param(s, n, marks=[] if s == "none" and n != "GAN_JIT" else [pytest.mark.long],
                           id=f"{s}-{n}")
              for s in ("none", "mirrored") for n in JUDGED
              if s == "none" or n not in PS_SYNC_ONLY]


@pytest.mark.parametrize("strategy,name", IN_PROCESS)
def test_the_guides_train_as_fit_in_one_process(tmp_path, capsys, strategy, name):
    from tfdist.training import run

    results = run.run(_config(strategy, name, tmp_path))
    _compare(name, results, strategy)
    out = capsys.readouterr().out
    if name in TRAIN_LOGS:
        # The progress lines carry the step's own logs under Keras's flattened names.
        line = [l for l in out.splitlines() if l.startswith("step 60/")][0]
        for log in TRAIN_LOGS[name]:
            assert re.search(rf" {log} [0-9.]+ ", line), line
        if name.startswith("GAN"):
            assert " loss " not in line, line  # it logs none: none is made up
        tags = tensorboard_tags(str(tmp_path / "logs"))["scalars"]
        assert {f"train/{log}" for log in TRAIN_LOGS[name]} <= tags, tags
    if name in NOT_EVALUATED:
        said = [l for l in out.splitlines() if l.startswith("not evaluated: ")]
        assert len(said) == 1 and NOT_EVALUATED[name] in said[0], said


# In the default tier: under ps-sync the first example, the GAN (each
# optimizer.apply one K-of-N average on ps:0, the GAN's two in order; its noise
# generator's state shared) and the GAN whose generator applies on even steps only
# (ps:0 follows the applies the workers announce), and the distiller under pipeline (its own compute_loss
# on the last stage's output; 29-40 s under shared load); every other cluster cell, the multiworker GAN
# among them, in the long tier (make test's budget).
FAST_CLUSTER = {("ps-sync", "FIRST"), ("ps-sync", "GAN"), ("ps-sync", "GAN_EVERY_OTHER"),
                ("pipeline", "DISTILLATION")}
CLUSTER = [pytest.param(s, n, marks=[pytest.mark.multiprocess]
                        + ([] if (s, n) in FAST_CLUSTER else [pytest.mark.long]),
                        id=f"{s}-{n}")
           for s in CLUSTERS for n in JUDGED
           # pipeline trains a model's own train_step placed (training.pipeline.placed);
           # it runs a model's own compute_loss on the last stage's output.
           if s == "ps-sync" or n not in PS_SYNC_ONLY]


@pytest.mark.parametrize("strategy,name", CLUSTER)
def test_the_guides_train_as_fit_on_a_cluster(tmp_path, spawn, strategy, name):
    results = launched_results(tmp_path, spawn, strategy, SPEC + name, log_every=30)
    _compare(name, results, strategy)


# --- refused in one line ---------------------------------------------------------------


def _checked(name):
    from tfdist.training.workload import tasks

    spec = tasks.parse_spec(SPEC + name)
    return tasks.inspect(spec, tasks.load(spec), steps_given=False)


def _pipeline_config(workers=2):
    import types

    return types.SimpleNamespace(cluster=types.SimpleNamespace(num_members=lambda role: workers),
                                 pipelines=1, stages=None)


@pytest.mark.parametrize("name", ["FIRST", "LOWER_LEVEL", "SAMPLE_WEIGHTS", "GAN",
                                  "FEATURES_ONLY"])
def test_a_guides_own_train_step_trains_placed_under_pipeline(name):
    """Every strategy takes the guides' own train_step; under pipeline the plan trains
    it placed, and the reason is the notice line's."""
    from tfdist.strategies import kinds
    from tfdist.training.pipeline import placed
    from tfdist.training.workload import contract

    checked = _checked(name)
    for kind in kinds.all_kinds().values():
        contract.check(kind, checked)
    why = placed.why_placed(kinds.get("pipeline"), checked, _pipeline_config())
    assert why == "its model overrides train_step, which the cut into stages cannot carry"
    assert placed.why_placed(kinds.get("ps-sync"), checked, _pipeline_config()) is None


def _own_loss_model(calls_itself: bool, regularized: bool, squares: bool = False):
    import keras

    class OwnLoss(keras.Model):
        def __init__(self):
            super().__init__()
            self.student = keras.Sequential([
                keras.Input((4,)),
                keras.layers.Dense(3, kernel_regularizer="l2" if regularized else None)])

        def call(self, x):
            return self.student(x)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                         allow_empty=False):
            again = self(x) if calls_itself else y_pred
            loss = keras.ops.mean(keras.ops.square(again - y_pred)) + keras.ops.mean(y_pred)
            if squares:  # the model's own losses counted otherwise than added
                loss = loss + keras.ops.square(keras.ops.sum(self.losses))
            return loss

    model = OwnLoss()
    model.compile(optimizer="adam")
    return model


@pytest.mark.parametrize("calls_itself,regularized,squares,says", [
    (True, False, False, "its model's compute_loss calls the model itself, which the cut "
                         "into stages cannot carry"),
    # The model's own losses: left out of its loss here (weight 0, as Keras leaves them).
    (False, True, False, None),
    (False, True, True, "its model overrides compute_loss and its loss does not change in "
                        "proportion to the model's own losses"),
    (False, False, False, None),  # y_pred alone: cut, on the last stage's output
])
def test_a_compute_loss_the_cut_cannot_carry_trains_placed(calls_itself, regularized,
                                                           squares, says):
    """A model's own compute_loss runs on the last stage's output; one that calls the
    whole model again, or counts the model's own losses (which each stage adds where
    it runs) other than in proportion, trains placed (probed once on the first
    example), with the reason its notice line gives."""
    import types

    import numpy as np

    from tfdist.strategies import kinds
    from tfdist.training.pipeline import placed
    from tfdist.training.workload import contract

    model = _own_loss_model(calls_itself, regularized, squares)
    checked = types.SimpleNamespace(
        local_model=model, task=types.SimpleNamespace(build_model=lambda: _own_loss_model(
            calls_itself, regularized, squares)), spec=types.SimpleNamespace(name="t"),
        example=(np.ones((1, 4), "float32"), np.zeros((1, 3), "float32")))
    for kind in kinds.all_kinds().values():
        contract.check(kind, checked)
    # One worker: the student is one layer, which cuts into one stage only.
    why = placed.why_placed(kinds.get("pipeline"), checked, _pipeline_config(workers=1))
    assert "call" not in model.__dict__  # the probe's counter is gone again
    assert model._losses_override == []  # the probe's override is gone again
    if says is None:
        assert why is None, why
        if regularized:  # its loss leaves them out: the stages add none of theirs
            assert contract.own_losses_weight(model, checked.example) == 0.0
        return
    assert why.startswith(says) and "\n" not in why, why


def test_a_compute_loss_calling_the_model_gives_the_stages_no_gradient():
    """Why such a model trains placed rather than cut (docs/fit-conformance.md): under
    the cut the model object a ``compute_loss`` runs on is the chief's copy, while the
    trained variables are the stages' (copies of the cut, as the trainer places them).
    Its ``self(x)`` term then has no gradient for any of them; its ``y_pred`` term has
    one for every one."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist.training.pipeline import pipeline_trainer, stages

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(3)])
    local, _ = stages.local_stages(object(), model, stages.PipelinePlan(2, 1, 1))
    placed = [keras.models.clone_model(s, clone_function=pipeline_trainer._clone_layer)
              for s in local]
    x = np.ones((2, 4), "float32")
    variables = [v for s in placed for v in s.trainable_variables]
    with tf.GradientTape(persistent=True) as tape:
        y_pred = placed[1](placed[0](x))
        again = model(x)  # what self(x) computes inside compute_loss
        on_itself = tf.reduce_mean(tf.square(again))
        on_y_pred = tf.reduce_mean(tf.square(y_pred))
    assert all(g is None for g in tape.gradient(on_itself, variables))
    assert all(g is not None for g in tape.gradient(on_y_pred, variables))


@pytest.mark.parametrize("body,says", [
    # Neither a loss nor training logic of its own: nothing to train with.
    ("def build_model():\n    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])\n"
     "    m.compile(optimizer='adam')\n    return m\n"
     "def dataset(split):\n    return np.zeros((5, 8), 'float32'), np.zeros(5, 'float32')\n",
     "compiled without a loss; pass loss=... to model.compile"),
    # Features only, for the library's own step (which needs labels).
    ("def build_model():\n    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])\n"
     "    m.compile(optimizer='adam', loss='mse')\n    return m\n"
     "def dataset(split):\n    return tf.data.Dataset.from_tensor_slices(np.zeros((5, 8), "
     "'float32'))\n",
     "yields single tensors, not (features, label) pairs"),
])
def test_what_no_step_can_train_is_one_line(tmp_path, capsys, body, says):
    path = tmp_path / "task.py"
    path.write_text("import keras\nimport numpy as np\nimport tensorflow as tf\n" + body)
    assert says in refused_line(["--task", str(path)], tmp_path, capsys)


# --- the GAN resumes exactly -------------------------------------------------------------


def test_a_resumed_gan_ends_with_the_weights_of_an_uninterrupted_run(tmp_path):
    """Both optimizers' slots, their step counts and the noise generator's state are
    in the checkpoint: 20 steps, then 20 more from the checkpoint, are 40 steps."""
    from tfdist.training import run

    whole = run.run(_config("none", "GAN", tmp_path / "whole", steps=40))
    first = run.run(_config("none", "GAN", tmp_path / "resumed", steps=20))
    resumed = run.run(_config("none", "GAN", tmp_path / "resumed", steps=40))
    assert resumed["resumed_from_step"] == 20 and resumed["completed_steps"] == 40
    assert first["weights_sha256"] != whole["weights_sha256"]
    assert resumed["weights_sha256"] == whole["weights_sha256"]
