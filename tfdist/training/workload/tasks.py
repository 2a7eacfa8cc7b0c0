"""Tasks: the model and data a run trains, given as ``--task SPEC``.

A task is any object (a module, an instance, a class) with:

- ``build_model()`` -> a Keras 3 model, already compiled with its optimizer,
  loss and metrics, exactly as for ``model.fit``. The library calls it inside
  the strategy's scope (that is what places the variables).
- ``dataset(split)`` -> for ``"train"`` and ``"test"``, a ``tf.data.Dataset``
  of **unbatched** ``(features, label)`` examples; ``features`` is a tensor
  or a dict of tensors named like the model's inputs.

Elements may also be ``(features, label, sample_weight)`` triples, and
``dataset(split)`` may return NumPy arrays (``(x, y)`` or ``(x, y, w)``) as
``fit`` takes them (``training.workload.contract``).

Optional: ``configure(**options)`` receives ``--task-option KEY=VALUE``
strings before anything else is called; ``extra_results()`` returns a dict
merged into ``results.json``; a ``"validation"`` split (a task without one
returns None or raises KeyError for it); a ``class_weight`` dict; a
``callbacks()`` method returning Keras callbacks (``training.loop.callbacks``).

``SPEC`` is a built-in name (``models.BUILTIN_TASKS``), an import path
``pkg.mod`` or ``pkg.mod:NAME``, or a file ``path/to/task.py`` (relative to
the current directory). ``parse_spec`` needs no TensorFlow; ``load`` imports
the task and ``inspect`` checks it (both import TensorFlow), each mistake
one :class:`TaskError` line naming the task.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect as pyinspect
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tfdist.models import BUILTIN_TASKS, MODEL_ALIASES
from tfdist.protocol import ConfigError

SPLITS = ("train", "test")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TaskError(ConfigError):
    """A task that cannot be trained; ``str(err)`` names it and says what is wrong."""


@runtime_checkable
class Task(Protocol):
    """The contract (see the module docstring); ``configure`` and ``extra_results`` optional."""

    def build_model(self) -> Any: ...

    def dataset(self, split: str) -> Any: ...


@dataclass(frozen=True)
class TaskSpec:
    """``--task`` and ``--task-option``, parsed and checked without importing anything."""

    text: str
    builtin: str | None = None  # a key of models.BUILTIN_TASKS
    module: str | None = None  # an import path
    path: str | None = None  # an absolute .py file path
    attr: str | None = None  # NAME in pkg.mod:NAME or file.py:NAME
    options: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        """What progress lines, results and run records call the task."""
        return self.builtin or self.text

    def option_dict(self) -> dict[str, str]:
        return dict(self.options)


def _err(text: str, what: str) -> TaskError:
    return TaskError(f"task {text!r}: {what}")


def parse_spec(text: str, options=()) -> TaskSpec:
    """Parse ``--task`` (and ``--task-option KEY=VALUE`` strings); no import happens."""
    text = (text or "").strip()
    parsed = tuple(_parse_option(text, o) for o in options)
    if not text:
        raise TaskError("--task is empty; give a built-in name ("
                        + ", ".join(BUILTIN_TASKS) + "), pkg.mod[:NAME] or path/to/task.py")
    name = MODEL_ALIASES.get(text, text)
    if name in BUILTIN_TASKS:
        return TaskSpec(text=name, builtin=name, options=parsed)
    target, _, attr = text.partition(":") if not _looks_like_windows_drive(text) else (text, "", "")
    if attr and not _NAME.match(attr):
        raise _err(text, f"{attr!r} after ':' is not a Python name; use pkg.mod:NAME or file.py:NAME")
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise _err(text, f"no such file {path!r}; pass an existing .py file (relative paths "
                             "start at the current directory), a module pkg.mod, or a built-in: "
                             + ", ".join(BUILTIN_TASKS))
        return TaskSpec(text=text, path=path, attr=attr or None, options=parsed)
    if not _MODULE.match(target):
        raise _err(text, "not a built-in task, an import path pkg.mod[:NAME] or a .py file; "
                         "built-in tasks: " + ", ".join(BUILTIN_TASKS))
    return TaskSpec(text=text, module=target, attr=attr or None, options=parsed)


def object_spec(task: Any, name: str) -> TaskSpec:
    """The spec of a task object handed over in Python (``train.train_task``)."""
    missing = [m for m in ("build_model", "dataset") if not callable(getattr(task, m, None))]
    if missing:
        raise _err(name, "it has no " + " and no ".join(f"{m}()" for m in missing))
    return TaskSpec(text=name)


def _looks_like_windows_drive(text: str) -> bool:
    return len(text) > 2 and text[1] == ":" and text[2] in "\\/"


def _parse_option(task: str, option: str) -> tuple[str, str]:
    key, eq, value = option.partition("=")
    if not eq or not _NAME.match(key.strip()):
        raise _err(task, f"--task-option {option!r} is not KEY=VALUE with KEY a Python name "
                         "(e.g. --task-option rows=100000)")
    return key.strip(), value


def static_sizes(spec: TaskSpec) -> tuple[int | None, int | None]:
    """(train, test) split sizes known without TensorFlow: built-ins with fixed data only."""
    entry = BUILTIN_TASKS.get(spec.builtin or "")
    if entry is None or spec.options:
        return None, None
    return entry.train_examples, entry.test_examples


def flags_set_optimizer(spec: TaskSpec) -> bool:
    """Whether the optimizer flags' defaults apply (the MNIST built-ins), or
    the task's own compiled optimizer trains unless a flag is given."""
    entry = BUILTIN_TASKS.get(spec.builtin or "")
    return entry is not None and entry.flags_set_optimizer


def per_replica_batch(spec: TaskSpec, default: int) -> int:
    """The default batch per replica: a built-in task's own, else ``default``."""
    entry = BUILTIN_TASKS.get(spec.builtin or "")
    return (entry.per_replica_batch or default) if entry is not None else default


def reads_tfds(spec: TaskSpec) -> bool:
    entry = BUILTIN_TASKS.get(spec.builtin or "")
    return entry is not None and entry.reads_tfds


# --- loading -------------------------------------------------------------------


def load(spec: TaskSpec, data_dir: str | None = None) -> Any:
    """Import the task and configure it; one TaskError line for any failure."""
    if spec.builtin:
        module_name, _, attr = BUILTIN_TASKS[spec.builtin].target.partition(":")
        obj = getattr(importlib.import_module(module_name), attr)
    else:
        module = _import(spec)
        obj = module
        if spec.attr:
            if not hasattr(module, spec.attr):
                raise _err(spec.text, f"the module has no {spec.attr!r}")
            obj = getattr(module, spec.attr)
        if not _has_contract(obj) and callable(obj) and not pyinspect.ismodule(obj):
            obj = _call(spec, obj, f"{spec.attr}()")  # a class or factory
    missing = [m for m in ("build_model", "dataset") if not callable(getattr(obj, m, None))]
    if missing:
        raise _err(spec.text, "it has no " + " and no ".join(f"{m}()" for m in missing)
                   + "; a task provides build_model() (a compiled Keras model) and "
                     "dataset(split) (unbatched (features, label) examples)")
    options = spec.option_dict()
    if spec.builtin and reads_tfds(spec):
        options.setdefault("data_dir", data_dir)
    if options:
        configure = getattr(obj, "configure", None)
        if not callable(configure):
            raise _err(spec.text, "--task-option given, but the task has no configure(**options)")
        _call(spec, configure, "configure()", **options)
    return obj


def _has_contract(obj) -> bool:
    return callable(getattr(obj, "build_model", None)) and callable(getattr(obj, "dataset", None))


def _import(spec: TaskSpec):
    try:
        if spec.path:
            # As `python task.py` would: the file's own folder first on the path,
            # so the packages beside it (a models/ of the user's own) import.
            folder = os.path.dirname(os.path.abspath(spec.path))
            if folder not in sys.path:
                sys.path.insert(0, folder)
            name = "_task_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(spec.path))[0])
            file_spec = importlib.util.spec_from_file_location(name, spec.path)
            module = importlib.util.module_from_spec(file_spec)
            # Registered before it runs: dataclasses and pickling look it up there.
            sys.modules[name] = module
            file_spec.loader.exec_module(module)
            return module
        return importlib.import_module(spec.module)
    except ModuleNotFoundError as err:
        if spec.module and err.name and spec.module.startswith(err.name):
            raise _err(spec.text, f"no module named {err.name!r} (is its folder on PYTHONPATH, "
                                  "or did you mean a file path/to/task.py?)") from None
        raise _err(spec.text, f"importing it failed: {_first_line(err)}") from None
    except Exception as err:  # the user's module raised while importing
        raise _err(spec.text, f"importing it failed: {_first_line(err)}") from None


def _checked_call(spec: TaskSpec, fn, what: str, *args):
    """``_call`` for the library's own checks: their ConfigError lines name the task."""
    try:
        return fn(*args)
    except ConfigError as err:
        raise _err(spec.text, str(err)) from None
    except Exception as err:
        raise _err(spec.text, f"{what} raised {_first_line(err)}") from None


def _call(spec: TaskSpec, fn, what: str, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ConfigError as err:
        raise TaskError(str(err)) if not str(err).startswith("task ") else err from None
    except Exception as err:
        raise _err(spec.text, f"{what} raised {_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    first = first if len(first) <= 200 else first[:197] + "..."
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


# --- inspection ------------------------------------------------------------------


@dataclass(frozen=True)
class TaskInfo:
    """What the run needs to know about a checked task."""

    name: str
    train_examples: int | None  # None: infinite or unknown (then --steps is required)
    test_examples: int
    metric_names: tuple[str, ...]
    extra_results: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CheckedTask:
    """A loaded task, what was learnt checking it, and a local compiled model
    (outside any strategy) whose metrics are built: evaluation and the train
    step's metric values use it."""

    spec: TaskSpec
    task: Any
    info: TaskInfo
    local_model: Any
    # The first training element as a batch of one: the state's model is
    # called on it before the optimizer is built (a subclassed model makes
    # its variables on its first call).
    example: Any = None
    # A model with its own train_step: the names of the logs it returns,
    # flattened as Keras flattens them ("loss" among them when it logs one).
    own_step_names: tuple[str, ...] | None = None
    # dataset("validation") gives a split: evaluated at every epoch end.
    has_validation: bool = False
    # The optimizers the model holds besides model.optimizer (a GAN's
    # d_optimizer, g_optimizer): {attribute: positions in trainable_variables
    # of the variables its own train_step applies it to}.
    own_optimizers: dict = field(default_factory=dict)
    # The applies one call of its own train_step makes, in order: ((attribute, positions
    # in trainable_variables), ...); ("optimizer", ...) is model.optimizer. Under ps-sync
    # each is one K-of-N update on ps:0 (training.ps.own_step).
    own_applies: tuple = ()
    # Why Keras's own evaluate cannot run on the model (no loss and no
    # test_step of its own); None when it can.
    not_evaluated: str | None = None


def inspect(spec: TaskSpec, task: Any, *, steps_given: bool) -> CheckedTask:
    """Build the model once and read one example of each split; TaskError on a mistake.

    Runs TensorFlow ops: under MultiWorkerMirroredStrategy call it only after
    the strategy exists (collectives are configured before the runtime starts).
    """
    import tensorflow as tf

    model = _compiled_model(spec, task)
    from tfdist.training.workload import contract

    own_step = contract.overrides(model, "train_step")
    class_weight = _checked_call(spec, contract.class_weight_of, "class_weight", task)
    sizes, first = _first_examples(spec, task, model, own_step, steps_given)
    has_validation = spec.builtin is None and _validation(spec, task, model, own_step)
    if class_weight is not None and own_step and not (
            isinstance(first["train"], tuple) and len(first["train"]) == 2):
        raise _err(spec.text, "class_weight is given, but dataset('train') does not yield "
                              "(features, label) pairs; as fit, give it with labels")
    if class_weight is not None and len(first["train"]) == 3:
        raise _err(spec.text, "class_weight is given and dataset('train') yields sample "
                              "weights too; as fit, give one or the other")
    # The element as the dataset yields it (a tuple, or features alone), as a batch of one.
    batch = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), first["train"])
    if class_weight is not None:
        batch = tf.nest.map_structure(lambda t: t[None], next(iter(contract.class_weights(
            tf.data.Dataset.from_tensors(tuple(first["train"])), class_weight))))
    if not own_step:
        _probe_library_step(spec, model, batch)
    # Keras's own names (cls_accuracy, reg_mae, ...), as model.fit logs them.
    compiled = model._compile_metrics
    names = tuple(compiled.result()) if compiled is not None and compiled.built else ()
    own_names, own_optimizers, own_applies = None, {}, ()
    if own_step:
        own_names, own_optimizers, own_applies = _own_step_names(spec, model, batch)
    test_batch = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), first["test"])
    not_evaluated = _evaluable(spec, model, test_batch)
    extra = _extra_results(spec, task)
    info = TaskInfo(spec.name, sizes["train"], sizes["test"],
                    names if own_names is None else own_names, extra)
    return CheckedTask(spec, task, info, model, example=batch, own_step_names=own_names,
                       has_validation=has_validation, own_optimizers=own_optimizers,
                       own_applies=own_applies, not_evaluated=not_evaluated)


def _compiled_model(spec: TaskSpec, task: Any):
    """``task.build_model()``, checked to be a Keras model compiled with an optimizer and
    a loss (or logic of its own that needs none)."""
    import keras

    from tfdist.training.workload import contract

    with contract.auto_jit_as_under_a_strategy():
        model = _call(spec, task.build_model, "build_model()")
    if not isinstance(model, keras.Model):
        raise _err(spec.text, f"build_model() returned {type(model).__name__}, not a keras.Model")
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
        raise _err(spec.text, "build_model() returned a model that is not compiled (no optimizer); "
                              "call model.compile(optimizer=..., loss=..., metrics=[...]) in it")
    if getattr(model, "_compile_loss", None) is None and not contract.own_logic(model):
        raise _err(spec.text, "build_model() returned a model compiled without a loss; pass "
                              "loss=... to model.compile (or give the model its own "
                              "train_step or compute_loss)")
    return model


def _first_examples(spec: TaskSpec, task: Any, model, own_step: bool,
                    steps_given: bool) -> tuple[dict, dict]:
    """Each split's size and first element, every split checked as the step will read it."""
    import tensorflow as tf

    from tfdist.training.workload import contract

    sizes = {}
    first = {}
    for split in SPLITS:
        ds = _call(spec, task.dataset, f"dataset({split!r})", split)
        ds = _checked_call(spec, contract.as_dataset, f"dataset({split!r})", ds,
                           f"dataset({split!r})")
        if not isinstance(ds, tf.data.Dataset):
            raise _err(spec.text, f"dataset({split!r}) returned {type(ds).__name__}, "
                                  "not a tf.data.Dataset, NumPy arrays or a tuple of them")
        if not own_step:  # the library's own step needs labels; a model's own, not
            _check_pair(spec, split, ds.element_spec)
        sizes[split] = _size(spec, split, ds, steps_given)
        try:
            first[split] = next(iter(ds.take(1)))
        except StopIteration:
            raise _err(spec.text, f"dataset({split!r}) is empty; it must hold examples") from None
        except Exception as err:
            raise _err(spec.text, f"reading dataset({split!r}) failed: {_first_line(err)}") from None
        if not own_step:  # a model's own step may read its data otherwise: it is probed
            _check_features(spec, split, first[split][0], model)
    return sizes, first


def _probe_library_step(spec: TaskSpec, model, batch) -> None:
    """Run the model, its compiled loss and metrics once on ``batch`` (as the library's
    own step will), then clear the metrics again."""
    from tfdist.training.workload import contract

    weight = batch[2] if len(batch) == 3 else None
    try:
        y_pred = model(batch[0], training=False)
        contract.compute_loss(model, batch[0], batch[1], y_pred, weight, training=False)
        model.compute_metrics(batch[0], batch[1], y_pred, weight)
    except Exception as err:
        raise _err(spec.text, "the model, its compiled loss or metrics fail on the first "
                              f"training example: {_first_line(err)}") from None
    model.reset_metrics()


def _extra_results(spec: TaskSpec, task: Any) -> dict:
    """``task.extra_results()`` if the task has it (a dict), else {}."""
    if not callable(getattr(task, "extra_results", None)):
        return {}
    extra = _call(spec, task.extra_results, "extra_results()") or {}
    if not isinstance(extra, dict):
        raise _err(spec.text, "extra_results() must return a dict")
    return extra


def _validation(spec, task, model, own_step: bool = False) -> bool:
    """Whether ``dataset("validation")`` gives a split (checked as the others are).

    Optional: a task without one returns None or raises KeyError, ValueError
    or NotImplementedError for a split it does not know.
    """
    import tensorflow as tf

    from tfdist.training.workload import contract

    try:
        ds = task.dataset("validation")
    except (KeyError, ValueError, NotImplementedError):
        return False
    except Exception as err:
        raise _err(spec.text, f"dataset('validation') raised {_first_line(err)}") from None
    if ds is None:
        return False
    ds = _checked_call(spec, contract.as_dataset, "dataset('validation')", ds,
                       "dataset('validation')")
    if not isinstance(ds, tf.data.Dataset):
        raise _err(spec.text, f"dataset('validation') returned {type(ds).__name__}, not a "
                              "tf.data.Dataset, NumPy arrays, or None (no validation split)")
    if not own_step:
        _check_pair(spec, "validation", ds.element_spec)
    try:
        element = next(iter(ds.take(1)))
    except StopIteration:
        raise _err(spec.text, "dataset('validation') is empty; return None for no "
                              "validation split") from None
    if not own_step:
        _check_features(spec, "validation", element[0], model)
    return True


def _own_step_names(spec, model, batch) -> tuple[tuple[str, ...], dict, tuple]:
    """The logs a model's own ``train_step`` returns, flattened as Keras flattens
    them, and the optimizers it applies besides ``model.optimizer``, from one step
    on the local model (whose weights evaluation overwrites anyway).

    The optimizers are the model's attributes that are Keras optimizers; each
    is built by that step with the variables it updates, whose positions in
    ``trainable_variables`` the state's model uses to build its own copy
    before training (``training.loop.state``). And the applies the step made, in
    order (``CheckedTask.own_applies``).
    """
    from tfdist.training.workload import apply_route, contract

    attrs = apply_route.optimizer_attrs(model)
    try:
        logs, applies = apply_route.record_applies(model, attrs,
                                                   lambda: model.train_step(batch))
    except Exception as err:
        raise _err(spec.text, "the model's own train_step fails on the first training "
                              f"example: {_first_line(err)}") from None
    if not isinstance(logs, dict):
        raise _err(spec.text, "the model's own train_step must return a dict of logs (as "
                              "Keras's does: return {m.name: m.result() for m in "
                              f"self.metrics}}); it returned {type(logs).__name__}")
    flat = contract.flat_logs(logs)
    bad = [k for k, v in flat.items()
           if not isinstance(v, (int, float)) and getattr(v, "shape", None) not in ((), [])]
    if bad:
        raise _err(spec.text, f"the model's own train_step returned non-scalar logs {bad}; "
                              "return one number per name")
    model.reset_metrics()
    position = {id(getattr(v, "_value", v)): i for i, v in enumerate(model.trainable_variables)}

    def positions(attr, variables):
        used = [position.get(id(getattr(v, "_value", v))) for v in variables]
        if None in used:
            raise _err(spec.text, f"the model's optimizer {attr!r} updates variables that are "
                                  "not the model's own trainable variables; keep every "
                                  "trained layer an attribute of the model")
        return tuple(used)

    # The variables each one's build (the step's first apply) was given.
    optimizers = {attr: positions(attr, getattr(getattr(model, attr), "_trainable_variables",
                                                None) or []) for attr in attrs}
    names = {id(getattr(model, attr)): attr for attr in ("optimizer", *attrs)}
    order = tuple((names[id(o)], positions(names[id(o)], variables)) for o, variables in applies)
    return tuple(flat), optimizers, order


def _evaluable(spec, model, batch) -> str | None:
    """None when Keras's own ``evaluate`` can run on the model; otherwise why not.

    A model of its own training logic may have no loss Keras's ``test_step``
    can compute (the guide's lower-level model, a GAN without ``call``):
    ``fit`` trains it, ``evaluate`` raises. One ``test_step`` on the local
    model, on the first test example, tells; a model's own ``test_step`` that
    fails is a mistake in it, refused in one line.
    """
    from tfdist.training.workload import contract

    if not (contract.own_logic(model) or contract.overrides(model, "test_step")):
        return None  # Keras's test_step with the compiled loss: checked above
    try:
        model.test_step(batch)
    except Exception as err:
        if contract.overrides(model, "test_step"):
            raise _err(spec.text, "the model's own test_step fails on the first test "
                                  f"example: {_first_line(err)}") from None
        return ("the model has no test_step of its own and Keras's evaluate cannot run on "
                f"it ({_first_line(err)})")
    finally:
        model.reset_metrics()
    return None


def _check_pair(spec, split, element_spec) -> None:
    if not (isinstance(element_spec, tuple) and len(element_spec) in (2, 3)):
        raise _err(spec.text, f"dataset({split!r}) yields {_describe(element_spec)}, not "
                              "(features, label) pairs or (features, label, sample_weight) "
                              "triples; map it to those")


def _size(spec, split, ds, steps_given: bool) -> int | None:
    import tensorflow as tf

    n = int(ds.cardinality())
    if n == 0:
        raise _err(spec.text, f"dataset({split!r}) is empty; it must hold examples")
    if n >= 0:
        return n
    if split == "test":
        if n == int(tf.data.INFINITE_CARDINALITY):
            raise _err(spec.text, "dataset('test') is infinite; the test split must end "
                                  "(evaluation reads it once)")
        # Unknown (a filter, say): count it once, evaluation reads it whole anyway.
        return int(ds.reduce(tf.constant(0, tf.int64), lambda c, _: c + 1))
    if not steps_given:
        what = "infinite" if n == int(tf.data.INFINITE_CARDINALITY) else "of unknown size"
        raise _err(spec.text, f"dataset('train') is {what}, so epochs cannot be counted; "
                              "pass --steps N")
    return None


def _check_features(spec, split, features, model) -> None:
    inputs = list(model.inputs) if getattr(model, "inputs", None) else []
    if not inputs:
        return  # a subclassed model without declared inputs: the forward pass checks
    if isinstance(features, dict):
        names = sorted(features)
        expected = sorted(_input_name(t) for t in inputs)
        if names != expected:
            raise _err(spec.text, f"dataset({split!r}) features are named {names}, the model's "
                                  f"inputs {expected}; name the features like the inputs")
        pairs = [(features[_input_name(t)], t) for t in inputs]
    else:
        if len(inputs) != 1:
            raise _err(spec.text, f"dataset({split!r}) features are one tensor, the model has "
                                  f"{len(inputs)} inputs; yield a dict named like the inputs")
        pairs = [(features, inputs[0])]
    for value, inp in pairs:
        _check_one(spec, split, value, inp)


def _input_name(tensor) -> str:
    return tensor.name.split(":")[0]


def _check_one(spec, split, value, inp) -> None:
    import tensorflow as tf

    want = tuple(inp.shape)[1:]
    got = tuple(value.shape)
    label = f"feature {_input_name(inp)!r}" if _input_name(inp) else "features"
    if len(got) == len(want) + 1 and _shapes_match(got[1:], want):
        raise _err(spec.text, f"dataset({split!r}) looks batched ({label} has shape {list(got)}, "
                              f"the model's input {list(want)} per example); return unbatched "
                              "examples: the library batches")
    if not _shapes_match(got, want):
        raise _err(spec.text, f"dataset({split!r}) {label} has shape {list(got)} per example, "
                              f"the model's input expects {['None' if d is None else d for d in want]}")
    have, need = tf.as_dtype(value.dtype), tf.as_dtype(inp.dtype)
    if have != need and not castable(have, need):
        raise _err(spec.text, f"dataset({split!r}) {label} is {have.name}, the model's input "
                              f"is {need.name}; cast it in dataset() or change the Input dtype")


def castable(have, need) -> bool:
    """Whether Keras itself casts a feature of dtype ``have`` to an input of ``need``
    when it calls the model: floats among floats, integers among integers,
    bool or integers to integers or floats."""
    if have.is_floating and need.is_floating:
        return True
    if (have.is_integer or have.is_bool) and (need.is_integer or need.is_floating):
        return True
    return False


def _shapes_match(got, want) -> bool:
    return len(got) == len(want) and all(w is None or g == w for g, w in zip(got, want))


def _describe(element_spec) -> str:
    if isinstance(element_spec, tuple):
        return f"tuples of {len(element_spec)}"
    if isinstance(element_spec, dict):
        return "dicts"
    return "single tensors"
