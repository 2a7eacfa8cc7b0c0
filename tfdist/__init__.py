"""tfdist: train any Keras 3 model under every TensorFlow 2 tf.distribute strategy.

The public API is small and lives here; everything else is an implementation
detail behind it::

    import tfdist

    result = tfdist.fit("mnist-logreg", strategy="none",
                        options=tfdist.TrainOptions(steps=200, model_dir="runs/a"))
    result = tfdist.fit("path/to/task.py", workers=2, ps=1,
                        options=tfdist.TrainOptions(steps=200, model_dir="runs/b"))
    print(result.metrics["accuracy"], result.global_step)

``fit`` runs one process (``none``, ``mirrored``) or, with ``workers=N``, a
local cluster of real processes as ``tfdist-launch`` starts it; ``launch``
takes the launcher's options as typed groups (``Cluster``: simulated hosts and
links; ``Faults``; ``Recovery``; ``Limits``). ``TrainOptions`` are train.py's
flags, typed. Both return a :class:`Result` and raise :class:`TfdistError`
(one line, starting ``error:``, and an exit code).
Importing this package imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

import os as _os
import sys as _sys

# From a source checkout the package's two top-level folders, strategies/ and
# models/ (where the project's layout keeps them), are imported as
# tfdist.strategies and tfdist.models; installed, setuptools maps them into
# tfdist/ and nothing is added. Exactly those two names are mapped: no other
# file or folder beside tfdist/ (launch.py, train.py, tests/) is ever
# importable as tfdist.<name>.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "strategies")) and _os.path.isfile(
        _os.path.join(_root, "strategies", "kinds.py")):
    from tfdist._checkout import CheckoutFolders as _CheckoutFolders

    if not any(isinstance(f, _CheckoutFolders) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _CheckoutFolders(_root, ("strategies", "models")))

__version__ = "0.2.0"
_API = ("fit", "launch", "Result", "MemberOutcome", "TfdistError", "TrainOptions", "Cluster",
        "Faults", "Recovery", "Limits", "Task")
__all__ = [*_API, "__version__"]


def __getattr__(name):
    # Lazy: `import tfdist` stays cheap and TensorFlow-free (the launcher,
    # the benchmark and every ps task import it before TensorFlow, if ever).
    if name in _API:
        from tfdist import api

        return getattr(api, name)
    raise AttributeError(f"module 'tfdist' has no attribute {name!r}")
