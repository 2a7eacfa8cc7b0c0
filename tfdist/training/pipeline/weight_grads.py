"""A stage's matrix products differentiated for micro-batches: the transposed
weight made once per step, the weight gradient once per step from every
micro-batch's rows.

TensorFlow differentiates ``y = x @ W`` per micro-batch as ``dx = dy @ Wᵀ``
(a product against the transposed weight) and ``dW = xᵀ @ dy`` (a full
weight-sized matrix, then summed over the micro-batches). On a CPU both cost
far more for 32-row micro-batches than for the batch they come from: timed on
one thread with oneDNN, 8 × 32 rows against one 2048 × 2048 weight, the input
gradient 43 ms against 28 ms for the same product with a transposed copy of
the weight made beforehand (4.4 ms), and the weight gradient 36.5 ms against
21.5 ms for one product of the 256 rows. So while a stage's backward is
traced inside ``recording``, the gradient of every ``MatMul`` that reads one
of the stage's variables directly (``ReadVariableOp``, no transposes: a
Dense layer's kernel) is made as:

- ``dx`` against the transpose of the weight, made once per step and
  copied (``Snapshot``) so that Grappler does not fold the transpose back
  into the product;
- ``dW``, when deferring, left out of the tape's answer (it returns None for
  that input) and kept as the pair (``x``, ``dy``); ``weight_gradients``
  makes it once per step as ``concat(x)ᵀ @ concat(dy)`` over every
  micro-batch. Otherwise it is in the tape's answer per micro-batch, as
  TensorFlow would make it, and summed with the stage's other gradients.

The same sums in another order: the same update up to the rounding of float
sums. Any other product (transposed operands, a weight cast to another dtype,
a batched product) keeps TensorFlow's own gradient.

The override replaces the ``MatMul`` entry of TensorFlow's gradient registry
only while ``recording`` is active (a tape looks its gradient functions up by
op type there, with no public hook) and puts the original back on the way
out.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops  # the gradient registry

_OP = "MatMul"


class WeightGrads:
    """One stage's deferred weight gradients and transposed weights for one traced
    step. ``defer``: the weight gradients once per step from every micro-batch's rows
    (which keeps each micro-batch's layer inputs until the step's end, as GPipe does
    anyway); otherwise once per micro-batch, summed as made. ``transpose``: the
    input gradients against a transposed copy of the weight, made once per step;
    otherwise as TensorFlow makes them. (``PipelinePlan`` decides both.)"""

    def __init__(self, variables, defer: bool, transpose: bool = True):
        graph = tf.compat.v1.get_default_graph()
        self.variables = list(variables)
        self.defer, self.transpose = defer, transpose
        # A variable's handle as the traced step sees it (its capture), which is the
        # input of every ReadVariableOp of it in the step.
        self._index = {graph.capture(v.handle).ref(): i
                       for i, v in enumerate(self.variables)}
        self._transposed = {}
        self._rows = {}  # variable index: [(x, dy) per product]
        self._new = []  # what the slot being traced made: its end waits for them

    def _variable(self, op):
        w = op.inputs[1]
        if (w.op.type != "ReadVariableOp" or op.get_attr("transpose_a")
                or op.get_attr("transpose_b") or len(w.shape) != 2):
            return None
        return self._index.get(w.op.inputs[0].ref())

    def gradient(self, op, grad, original):
        i = self._variable(op)
        if i is None:
            return original(op, grad)
        skip = getattr(op, "skip_input_indices", None) or ()
        x, w = op.inputs
        if 0 in skip:
            dx = None
        elif self.transpose:
            dx = tf.matmul(grad, self._transpose(i, w))
        else:
            dx = tf.matmul(grad, w, transpose_b=True)
        if 1 in skip:
            return dx, None
        if not self.defer:
            # In the tape's answer: the stage sums it over the micro-batches with
            # its other gradients, holding one weight-sized sum per variable.
            return dx, tf.matmul(x, grad, transpose_a=True)
        self._rows.setdefault(i, []).append((x, grad))
        self._new.append(grad)
        return dx, None

    def pending(self) -> list:
        """The tensors made by the products' gradients since the last call (those
        the tape's answer does not hold)."""
        new, self._new = self._new, []
        return new

    def _transpose(self, i, w):
        if i not in self._transposed:
            self._transposed[i] = tf.raw_ops.Snapshot(input=tf.transpose(w))
        return self._transposed[i]

    def weight_gradients(self, grads: list) -> list:
        """``grads`` (the tape's sums per variable, None where it had none) with the
        deferred products' weight gradients added; zeros for a variable nothing reached."""
        out = []
        for i, (g, v) in enumerate(zip(grads, self.variables)):
            parts = [] if g is None else [g]
            rows = self._rows.get(i)
            if rows:
                xs = tf.concat([x for x, _ in rows], 0)
                dys = tf.concat([dy for _, dy in rows], 0)
                parts.append(tf.matmul(xs, dys, transpose_a=True))
            out.append(tf.add_n(parts) if parts else tf.zeros_like(v))
        return out


@contextlib.contextmanager
def recording(weight_grads: WeightGrads):
    """While active, tapes differentiate ``MatMul`` through ``weight_grads``."""
    registry = tf_ops._gradient_registry._registry  # pylint: disable=protected-access
    entry = registry[_OP]
    original = entry["type"]
    entry["type"] = lambda op, grad: weight_grads.gradient(op, grad, original)
    try:
        yield weight_grads
    finally:
        entry["type"] = original
