"""Objects that must outlive the process's own teardown.

Two TensorFlow 2.21 behaviours make tearing a finished run down slower than
the run's last minute, so these objects are never destroyed at all and the
operating system frees their memory when the process ends:

- deleting a tf.data iterator that has run for a while can block up to 60 s:
  its autotune thread, woken by the cancellation, checks the cancelled flag
  before it is set (xla/tsl/framework/cancellation.cc runs the callbacks
  first) and sleeps again for its whole optimisation period (up to 60 s,
  tensorflow/core/framework/model.cc). At interpreter teardown that held
  multiworker tasks open for tens of seconds after the job was done;
- with remote tasks (a ps chief), freeing a traced function or a variable is
  one synchronous RPC per function or variable and task: seconds of RPCs to
  servers that are about to stop, after the results are written.
"""

from __future__ import annotations

import ctypes


def keep_alive_until_exit(obj) -> None:
    """Never run ``obj``'s destructor (CPython: one reference that is never dropped)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
