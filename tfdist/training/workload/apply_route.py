"""One route for ``optimizer.apply``: a model's own ``train_step`` hands its gradients
to the library's gradient path instead of updating the variables itself.

A ``train_step`` (Keras's guides) computes its gradients and calls
``self.optimizer.apply(grads, variables)`` or ``apply_gradients(zip(...))``
(Keras's ``apply_gradients`` calls ``apply``), once per optimizer it holds (a
GAN: ``d_optimizer``, then ``g_optimizer``). That call is the one place where
every strategy's own gradient path can take over, so while the library traces
a model's own step, ``ApplyRoute.routed`` replaces ``apply`` on every optimizer
the model holds (an instance attribute over the class's method) with a call to
the trainer's handler: ``handler(slot, optimizer, grads, variables)``, where
``slot`` counts the applies of one ``train_step`` call (0, 1, ...). The
handlers (``training.loop.step.DirectApply``, the ps-sync worker's in
``training.ps.own_step``) cast to ``--gradient-dtype``, accumulate N batches,
or queue the gradients on ps:0 for the K-of-N average; outside ``routed`` the
optimizers are Keras's own again (a checkpoint, a callback, ps:0's update see
the plain objects).

A ``train_step`` may also change a trained variable itself (``var.assign_sub(lr *
grad)``, ``assign``, ``assign_add``) with no optimizer. A handler that says
``routes_assigns`` (ps-sync's: each worker's change of a ps variable would be
one more update) has them routed too, as applies of ``DIRECT``: the delta is the
"gradient" (``assign_sub(d)``: ``d``; ``assign_add(d)``: ``-d``; ``assign(x)``:
the variable minus ``x``), and ``DIRECT.apply`` subtracts what it is given, so
ps:0 subtracts the mean of the K workers' deltas: the synchronous update.

A ``LossScaleOptimizer`` is routed as a whole (its ``apply`` receives the
scaled gradients the step made with its ``scale_loss``); its inner optimizer is
never routed, so when a handler calls ``original_apply`` the unscaling, the
finite check and the scale's update are Keras's.
"""

from __future__ import annotations

import contextlib
import threading


def optimizers_of(model, attrs=()) -> list:
    """``model.optimizer`` and the optimizers named by ``attrs`` (a GAN's
    ``d_optimizer``, ``g_optimizer``), each once, in that order."""
    found, seen = [], set()
    for attr in ("optimizer", *attrs):
        o = getattr(model, attr, None)
        if o is not None and id(o) not in seen:
            seen.add(id(o))
            found.append(o)
    return found


def optimizer_attrs(model) -> list[str]:
    """The model's attributes that hold a Keras optimizer other than ``model.optimizer``
    (a GAN's ``d_optimizer``, ``g_optimizer``): what its own ``train_step`` may apply."""
    import keras

    return [attr for attr, value in vars(model).items()
            if isinstance(value, keras.optimizers.Optimizer) and value is not model.optimizer
            and not attr.startswith("_")]


def original_apply(optimizer, grads, variables) -> None:
    """Keras's own ``apply`` of ``optimizer``'s class (never the routed one)."""
    type(optimizer).apply(optimizer, list(grads), list(variables))


class DirectUpdate:
    """The "optimizer" a routed change of a trained variable is applied with: its
    ``apply`` subtracts the given deltas (its own variables' plain ``assign_sub``)."""

    name = "direct_update"

    def apply(self, deltas, variables) -> None:
        for delta, variable in zip(deltas, variables):
            type(variable).assign_sub(variable, tf_cast(delta, variable.dtype))


DIRECT = DirectUpdate()
ASSIGNS = ("assign", "assign_add", "assign_sub")


def tf_cast(value, dtype):
    import tensorflow as tf

    return tf.cast(value, dtype)


# The route open in this thread (tf.distribute traces each replica of a MirroredStrategy
# in a thread of its own, each with its own route); and how many routes have patched
# each optimizer, so the last one to close restores it.
_local = threading.local()
_lock = threading.Lock()
_patched: dict[int, int] = {}


def _routed_apply(optimizer):
    def apply(grads, trainable_variables=None):
        route = getattr(_local, "route", None)
        if route is None or not any(o is optimizer for o in route.optimizers):
            # Not this thread's step (ps-sync's update on ps:0, traced beside it).
            return original_apply(optimizer, grads, trainable_variables
                                  if trainable_variables is not None
                                  else optimizer._trainable_variables)  # pylint: disable=protected-access
        if trainable_variables is None:  # as Keras: the variables it was built with
            trainable_variables = optimizer._trainable_variables  # pylint: disable=protected-access
        slot, route.slot = route.slot, route.slot + 1
        route.busy = True
        try:
            return route.handler(slot, optimizer, list(grads), list(trainable_variables))
        finally:
            route.busy = False
    return apply


def _routed_assign(variable, how: str):
    own = getattr(type(variable), how)

    def assign(value, *args, **kwargs):
        route = getattr(_local, "route", None)
        if route is None or not route.assigns or route.busy:
            return own(variable, value, *args, **kwargs)
        value = tf_cast(value, variable.dtype)
        delta = {"assign_sub": lambda: value, "assign_add": lambda: -value,
                 "assign": lambda: tf_cast(variable.value, variable.dtype) - value}[how]()
        slot, route.slot = route.slot, route.slot + 1
        route.handler(slot, DIRECT, [delta], [variable])
        return variable
    return assign


class ApplyRoute:
    """The optimizers a model's own ``train_step`` applies, routed to a handler while
    the step is traced in this thread (``routed``); ``slot`` counts the applies made
    since the last ``new_call`` (one ``train_step`` call)."""

    def __init__(self, model, attrs=(), assigns: bool = False):
        self.optimizers = optimizers_of(model, attrs)
        # With ``assigns``: the trained variables whose direct changes are routed.
        self.assigns = list(model.trainable_variables) if assigns else []
        self.slot = 0
        self.handler = None
        self.busy = False  # a handler's own update (Keras's apply) is not routed

    def new_call(self) -> None:
        """A ``train_step`` call begins: its first apply is slot 0."""
        self.slot = 0

    @contextlib.contextmanager
    def routed(self, handler):
        """While open, in this thread, ``apply``/``apply_gradients`` of every optimizer
        call ``handler(slot, optimizer, grads, variables)`` instead of updating."""
        self.handler = handler
        self.new_call()
        outer, _local.route = getattr(_local, "route", None), self
        with _lock:
            for o in self.optimizers:
                _patched[id(o)] = _patched.get(id(o), 0) + 1
                if _patched[id(o)] == 1:
                    o.apply = _routed_apply(o)  # an instance attribute over Keras's method
            for v in self.assigns:
                _patched[id(v)] = _patched.get(id(v), 0) + 1
                if _patched[id(v)] == 1:
                    for how in ASSIGNS:  # bypassing a tracking __setattr__
                        v.__dict__[how] = _routed_assign(v, how)
        try:
            yield self
        finally:
            _local.route = outer
            with _lock:
                for o in self.optimizers:
                    _patched[id(o)] -= 1
                    if not _patched[id(o)]:
                        del _patched[id(o)]
                        del o.apply
                for v in self.assigns:
                    _patched[id(v)] -= 1
                    if not _patched[id(v)]:
                        del _patched[id(v)]
                        for how in ASSIGNS:
                            del v.__dict__[how]


def record_applies(model, attrs, run) -> tuple[object, list]:
    """``run()``'s result and the applies it made, in order: ``[(optimizer, variables)]``;
    each apply still updates (Keras's own), as the step would without the route."""
    made = []

    def handler(_slot, optimizer, grads, variables):
        made.append((optimizer, variables))
        original_apply(optimizer, grads, variables)

    with ApplyRoute(model, attrs).routed(handler):
        return run(), made
