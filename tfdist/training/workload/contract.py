"""What ``model.fit`` accepts, taken as fit takes it, or refused in one line.

The library is the ``fit`` of users whose strategy Keras 3's own ``fit``
cannot drive (keras-team/keras#20585, #18624), so a task written for
``model.fit`` must train here as it would there: this module holds the
pieces of that contract that are not the training step itself.

- ``as_dataset``: ``dataset(split)`` may return NumPy arrays (or dicts of
  them), ``(x, y)`` or ``(x, y, sample_weight)``, as ``fit(x, y, sample_weight)``.
- ``class_weights``: a task's ``class_weight`` (a ``{class: weight}``
  attribute), turned into each training example's sample weight exactly as
  Keras's ``data_adapter_utils.class_weight_to_sample_weights`` does.
- ``overrides``: whether the model has its own ``train_step``/``test_step``.
- ``check``: what the run's strategy cannot honour (it asks the strategy
  kind), refused in one ``ConfigError`` line naming the option and the
  strategy, before anything starts. Nothing is ignored silently.
"""

from __future__ import annotations

import contextlib

from typing import Any

from tfdist.protocol import ConfigError

# The optimizer options (keras.optimizers.Optimizer's constructor) this module
# knows of: each is honoured by Keras's own apply_gradients, or refused by a
# strategy kind (StrategyKind.optimizer_refusals).
OPTIMIZER_OPTIONS = ("gradient_accumulation_steps", "clipnorm", "clipvalue", "global_clipnorm",
                     "use_ema", "weight_decay", "loss_scale_factor")


def overrides(model, method: str) -> bool:
    """Whether ``model``'s class defines its own ``method`` (``train_step``,
    ``test_step``, ``predict_step``) rather than Keras's."""
    import keras

    own = getattr(type(model), method, None)
    return own is not None and own is not getattr(keras.Model, method)


def own_logic(model) -> bool:
    """Whether the model brings its own training logic (its own ``train_step`` or
    ``compute_loss``): then, as for ``fit``, ``compile()`` needs no loss."""
    return overrides(model, "train_step") or overrides(model, "compute_loss")


def compute_loss(model, x, y, y_pred, sample_weight=None, training=True):
    """``model.compute_loss``, called as Keras's own steps call it (``_compute_loss``):
    an override written without the ``training`` argument (the distillation
    example's) is called without it."""
    import inspect as pyinspect

    if "training" in pyinspect.signature(model.compute_loss).parameters:
        return model.compute_loss(x, y, y_pred, sample_weight, training=training)
    return model.compute_loss(x, y, y_pred, sample_weight)


@contextlib.contextmanager
def auto_jit_as_under_a_strategy():
    """While a task builds its model outside any strategy's scope (the local model the
    checks, the pipeline and evaluation read), Keras resolves ``compile(jit_compile=
    "auto")`` as it does for a model that has a distribution strategy: False (Keras
    3.15 ``Trainer._resolve_auto_jit_compile``: ``if self._distribute_strategy:
    return False``, GPUs or not), where outside a scope a GPU host would say True.
    An explicit ``jit_compile=True`` stays True. The trained model is built in the
    strategy's scope (``loop.state``) and resolves it there, as ``fit`` would."""
    import keras

    had = "_resolve_auto_jit_compile" in vars(keras.Model)
    original = vars(keras.Model).get("_resolve_auto_jit_compile")
    keras.Model._resolve_auto_jit_compile = lambda self: False
    try:
        yield
    finally:
        if had:
            keras.Model._resolve_auto_jit_compile = original
        else:
            del keras.Model._resolve_auto_jit_compile


def flat_logs(logs) -> dict:
    """A step's logs flattened as Keras flattens them for its callbacks and History
    (``keras.src.utils.python_utils.pythonify_logs``): keys sorted, a nested dict's
    entries (``compile_metrics`` -> ``mae``, ...) merged in under their own names.
    The values are left as they are (tensors, or Python numbers)."""
    out = {}
    for key, value in sorted((logs or {}).items()):
        if isinstance(value, dict):
            out.update(flat_logs(value))
        else:
            out[key] = value
    return out


def features_of(element):
    """The features of a training element: ``x`` of ``(x, y)``, ``(x, y, w)`` and
    ``(x,)``; the element itself when it is not a tuple (features only)."""
    return element[0] if isinstance(element, tuple) else element


def as_dataset(value: Any, what: str):
    """``value`` as a ``tf.data.Dataset`` of unbatched elements.

    A Dataset is kept as it is; NumPy arrays (a dict of them for named
    inputs), or a tuple ``(x, y)`` / ``(x, y, sample_weight)`` of them, are
    sliced along their first axis as ``fit(x, y)`` slices them. Anything
    else is returned as it is, for the caller's own one-line refusal.
    """
    import numpy as np
    import tensorflow as tf

    if isinstance(value, tf.data.Dataset):
        return value
    given = value
    if isinstance(value, list):
        value = tuple(value)
    leaves = tf.nest.flatten(value)
    if not leaves or not all(isinstance(v, (np.ndarray, tf.Tensor)) for v in leaves):
        return given
    sizes = {int(v.shape[0]) if len(v.shape) else None for v in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ConfigError(f"{what} returned arrays of different lengths "
                          f"({sorted(s for s in sizes if s is not None)}); every array "
                          "must hold one row per example")
    if isinstance(value, tuple) and len(value) == 1:
        value = value[0]
    return tf.data.Dataset.from_tensor_slices(value)


def class_weight_of(task) -> dict | None:
    """The task's ``class_weight`` ({class index: weight}), checked; None without one."""
    weights = getattr(task, "class_weight", None)
    if weights is None:
        return None
    if not isinstance(weights, dict) or not all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 0
            and isinstance(v, (int, float)) and not isinstance(v, bool)
            for k, v in weights.items()):
        raise ConfigError(f"class_weight is {weights!r}; give a dict of class index (an int "
                          ">= 0) to weight (a number), e.g. {0: 1.0, 1: 5.0}, as fit takes it")
    return dict(weights)


def class_weights(dataset, class_weight: dict):
    """``(x, y)`` elements as ``(x, y, sample_weight)``: each example's weight its class's.

    As Keras's ``class_weight_to_sample_weights`` (per example here, the data
    being unbatched): a label with a last axis of more than one is one-hot
    (its argmax is the class), otherwise it is rounded; classes not in the
    dict weigh 1.
    """
    import tensorflow as tf

    size = max(class_weight) + 1
    table = tf.constant([float(class_weight.get(i, 1.0)) for i in range(size)], tf.float32)

    def weigh(x, y, sample_weight=None):
        if sample_weight is not None:
            return x, y, sample_weight
        label = y
        if label.shape.rank and label.shape[-1] != 1:
            label = tf.argmax(label, axis=-1)
        label = tf.cast(tf.round(tf.cast(tf.reshape(label, []), tf.float32)), tf.int32)
        inside = tf.logical_and(label >= 0, label < size)
        weight = tf.where(inside, tf.gather(table, tf.clip_by_value(label, 0, size - 1)), 1.0)
        return x, y, weight

    return dataset.map(weigh)


def calls_itself(model):
    """A context in which every call of ``model`` (its ``call``, as ``model(x)`` makes
    it) is counted: it yields the list the calls are appended to."""
    import contextlib

    @contextlib.contextmanager
    def counting():
        calls, own = [], model.call

        def counted(*args, **kwargs):
            calls.append(1)
            return own(*args, **kwargs)

        # On the instance, which Keras's __call__ looks up; bypassing its __setattr__,
        # which would track the function as state.
        model.__dict__["call"] = counted
        try:
            yield calls
        finally:
            del model.__dict__["call"]

    return counting()


def probe_compute_loss(model, example) -> tuple[bool, bool]:
    """``model.compute_loss`` run once on ``example`` (a batch as the dataset yields
    it) with the model's own output as ``y_pred``: whether it calls the model again
    (the whole model's forward: ``self(x)``), and whether the model has losses of
    its own (regularizers, ``add_loss``) after that forward."""
    if example is None:
        return False, False
    parts = example if isinstance(example, tuple) else (example,)
    x, y = parts[0], parts[1] if len(parts) > 1 else None
    weight = parts[2] if len(parts) == 3 else None
    y_pred = model(x, training=False)
    own_losses = bool(model.losses)
    with calls_itself(model) as calls:
        compute_loss(model, x, y, y_pred, weight, training=False)
    model.reset_metrics()
    return bool(calls), own_losses


@contextlib.contextmanager
def own_losses_as(model, value):
    """A context in which ``model.losses`` is ``[value]`` (Keras's own
    ``_losses_override``, which ``Layer.losses`` returns when set): what
    ``super().compute_loss`` adds of the model's own losses is then ``value``."""
    model._losses_override = [value]  # pylint: disable=protected-access
    try:
        yield
    finally:
        model._losses_override = []  # pylint: disable=protected-access


def own_losses_weight(model, example, who: str = "") -> float:
    """How a model's own ``compute_loss`` counts the model's own losses (regularizers,
    ``add_loss``), probed on ``example`` with their sum set to 0, 1 and 2: the change
    of its loss per unit (1.0 when it calls ``super().compute_loss``, which adds them;
    0.0 when it leaves them out). ConfigError (one line) when the loss does not
    change in proportion (then no weight on each stage's own losses gives its loss)."""
    import numpy as np

    parts = example if isinstance(example, tuple) else (example,)
    x, y = parts[0], parts[1] if len(parts) > 1 else None
    weight = parts[2] if len(parts) == 3 else None
    y_pred = model(x, training=False)
    seen = []
    for value in (0.0, 1.0, 2.0):
        with own_losses_as(model, np.float32(value)):
            seen.append(float(compute_loss(model, x, y, y_pred, weight, training=False)))
    model.reset_metrics()
    slope = seen[1] - seen[0]
    if not np.isclose(seen[2] - seen[0], 2 * slope, rtol=1e-4, atol=1e-5):
        raise ConfigError(f"{who}the model overrides compute_loss and its loss does not change in "
                          f"proportion to the model's own losses (regularizers, add_loss: "
                          f"{seen[0]:.6g}, {seen[1]:.6g}, {seen[2]:.6g} at a sum of 0, 1, 2), "
                          "which the cut into stages cannot carry: each stage adds its own "
                          "layers' losses where it runs")
    return round(slope, 4)


def check(kind, checked, gradient_dtype: str = "float32") -> None:
    """Refuse, in one line, what the run's strategy cannot honour of the task's model.

    ``kind``: the strategy kind (it knows what it cannot do); ``checked``:
    the inspected task (``tasks.CheckedTask``).
    """
    model, task = checked.local_model, checked.task
    who = f"task {checked.spec.name!r}: "
    if getattr(model, "run_eagerly", False):
        raise ConfigError(f"{who}the model is compiled with run_eagerly=True; a distributed "
                          "step is always traced (tf.function), so compile without it "
                          "(debug eagerly with model.fit, then train here)")
    if getattr(task, "callbacks", None) is not None and kind.callbacks_refusal:
        raise ConfigError(f"{who}the task gives callbacks(), which {kind.name} cannot run: "
                          f"{kind.callbacks_refusal}; train it under another strategy, or "
                          "remove callbacks() from the task")
    opt = getattr(model, "optimizer", None)
    inner = getattr(opt, "inner_optimizer", None)
    for o in (opt, inner):
        if o is None:
            continue
        for option, why in kind.optimizer_refusals.items():
            value = _option(o, option)
            if value:
                raise ConfigError(
                    f"{who}the optimizer's {option}={value!r} cannot be honoured under "
                    f"{kind.name}: {why}; compile the model without it for this strategy")
    weighted = (isinstance(checked.example, tuple) and len(checked.example) == 3) or \
        class_weight_of(task) is not None
    if weighted and kind.sample_weight_refusal:
        raise ConfigError(f"{who}the task gives sample weights (or class_weight), which "
                          f"{kind.name} cannot honour: {kind.sample_weight_refusal}; train it "
                          "under another strategy, or drop the weights")
    if class_weight_of(task) is not None and len(getattr(model, "outputs", None) or [0]) > 1:
        raise ConfigError(f"{who}class_weight is given, but the model has several outputs; "
                          "as fit, it applies to one output only: give (x, y, sample_weight) "
                          "elements instead")


def accumulation_of(checked) -> tuple[int | None, bool]:
    """The task's optimizers' ``gradient_accumulation_steps`` (None without: the
    model's optimizer and, for a model's own ``train_step``, every other optimizer it
    applies, which must agree), and whether the model has its own ``train_step``.
    The library's step accumulates either way: a model's own step's applies are routed
    to it (``training.loop.step.DirectApply``)."""
    from tfdist.training.workload import apply_route

    model = checked.local_model
    found = {}
    for o in apply_route.optimizers_of(model, checked.own_optimizers):
        steps = None
        for one in with_inner(o):
            steps = steps or getattr(one, "gradient_accumulation_steps", None)
        found[o.name] = steps
    if len(set(found.values())) > 1:
        raise ConfigError(f"task {checked.spec.name!r}: the model's optimizers accumulate "
                          f"different numbers of batches ({found}); one update takes N batches "
                          "for every optimizer: give them the same gradient_accumulation_steps")
    return next(iter(found.values()), None), overrides(model, "train_step")


def steps_per_execution_of(checked) -> int | None:
    """The model's ``compile(steps_per_execution=N)`` (None when it is 1 or unset): the
    plan packs N steps into one call, as ``--steps-per-execution N`` does."""
    n = getattr(checked.local_model, "steps_per_execution", None)
    return int(n) if n and int(n) != 1 else None


def plan_facts(checked) -> dict:
    """What the plan takes of the inspected task (``plan.resolve``'s keywords)."""
    accumulation, own_step = accumulation_of(checked)
    return {"task_accumulation": accumulation, "own_train_step": own_step,
            "task_steps_per_execution": steps_per_execution_of(checked)}


def with_inner(optimizer) -> list:
    """The optimizer and, for a LossScaleOptimizer, the one it wraps (whose update
    and settings Keras uses): those of the two that exist."""
    return [o for o in (optimizer, getattr(optimizer, "inner_optimizer", None))
            if o is not None]


def _option(optimizer, option: str):
    if option == "gradient_accumulation_steps":
        return getattr(optimizer, "gradient_accumulation_steps", None)
    return getattr(optimizer, option, None)


def finish_training(model, optimizer) -> None:
    """What ``fit`` does to the weights once training ends: an optimizer with
    ``use_ema`` overwrites them with their moving averages
    (``finalize_variable_values``), which evaluation, the hash and
    ``model.keras`` then hold."""
    if getattr(optimizer, "use_ema", False) or getattr(
            getattr(optimizer, "inner_optimizer", None), "use_ema", False):
        optimizer.finalize_variable_values(model.trainable_variables)


# Every argument of keras.Model.compile and fit, and every step a model may
# override (Keras 3.15), and what the library does with it: "honoured ..."
# (as fit does), "mapped ..." (a flag or the task contract gives it) or
# "refused ..." (one line, exit 2). tests/training/test_fit_conformance.py
# lists Keras's own signatures against this table and docs/fit-conformance.md.
CONTRACT = {
    "compile": {
        "optimizer": "honoured: the task's own optimizer trains (a flag may replace it)",
        "loss": "honoured: Keras's CompileLoss, one or one per output; not needed by a "
                "model with its own train_step or compute_loss (as fit)",
        "loss_weights": "honoured: Keras's CompileLoss",
        "metrics": "honoured: Keras's CompileMetrics, named as fit names them",
        "weighted_metrics": "honoured: with the elements' or class_weight's sample weights",
        "run_eagerly": "refused: a distributed step is always traced",
        "steps_per_execution": "mapped: --steps-per-execution, which it sets unless the "
                               "flag gives another value (one line)",
        "jit_compile": "honoured: the replica's step compiled with XLA inside strategy.run "
                       "(none, mirrored), its forward and backward pass (multiworker: "
                       "the all-reduce and update outside XLA; ps, ps-sync: on the values "
                       "read from the ps), each stage's forward and backward (pipeline); "
                       "a model's own train_step compiled whole (none, mirrored) or each "
                       "call of its model on values (multiworker, ps, ps-sync)",
        "auto_scale_loss": "honoured: Keras's LossScaleOptimizer (under ps-sync the workers' "
                           "gradients are scaled by the scale of their step, ps:0 unscales "
                           "their average)",
    },
    "fit": {
        "x": "mapped: dataset(split) features (a Dataset, or NumPy arrays)",
        "y": "mapped: dataset(split) labels",
        "batch_size": "mapped: --global-batch-size",
        "epochs": "mapped: --epochs (or --steps)",
        "verbose": "mapped: progress lines every --log-every steps",
        "callbacks": "honoured: a task's callbacks() on the chief (multiworker: its stop "
                     "and learning rate reach every worker; ps, ps-sync: self.model is a "
                     "chief-side copy refreshed from the ps, its learning rate assigned to "
                     "the trained optimizer; pipeline: the model assembled from the "
                     "stages, its learning rate set on every stage's optimizer)",
        "validation_split": "refused: not offered (give a test split)",
        "validation_data": "mapped: the test split, evaluated every --eval-every steps",
        "shuffle": "honoured: every epoch reshuffled with --seed",
        "class_weight": "honoured: the task's class_weight attribute",
        "sample_weight": "honoured: (features, label, sample_weight) elements",
        "initial_epoch": "mapped: a run resumes from its last checkpoint",
        "steps_per_epoch": "mapped: --steps",
        "validation_steps": "mapped: the whole test split is evaluated",
        "validation_batch_size": "mapped: the evaluation batch is the library's",
        "validation_freq": "mapped: --eval-every",
    },
    "override": {
        "train_step": "honoured: called inside strategy.run, its logs flattened as fit "
                      "flattens them, features-only data, the other optimizers it applies "
                      "built and checkpointed, every optimizer's apply routed through the "
                      "library's gradient path (--gradient-dtype, accumulation, ps-sync's "
                      "K-of-N average); under pipeline the model trains placed (the none "
                      "loop, its weights and layers on the workers)",
        "test_step": "honoured: evaluation is Keras's evaluate on a local copy; a model Keras "
                     "cannot evaluate trains and is said not evaluated",
        "predict_step": "honoured: the saved model.keras keeps it",
        "compute_loss": "honoured: the library's step calls model.compute_loss, with or "
                        "without its training argument; under pipeline on the last stage's "
                        "output (one that calls the model itself: trained placed)",
        "compute_metrics": "honoured: called by a model's own train_step; evaluation uses it",
    },
}
