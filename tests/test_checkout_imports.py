"""A checkout imports as the installed package does: ``tfdist.strategies`` and
``tfdist.models`` come from the top-level folders, and nothing else beside
``tfdist/`` (``launch.py``, ``train.py``, ``tests/``, ...) becomes ``tfdist.<name>``."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# -S: no site-packages, so no editable install's finder: the checkout's own mapping alone.
PROBE = r"""
import importlib, importlib.util, json, os, sys
root = sys.argv[1]
sys.path.insert(0, root)
import tfdist
found = {}
for entry in sorted(os.listdir(root)):
    stem = entry[:-3] if entry.endswith(".py") else entry
    if stem.isidentifier() and stem != "tfdist":
        spec = importlib.util.find_spec("tfdist." + stem)
        found[stem] = spec.origin if spec is not None else None
try:
    importlib.import_module("tfdist.launch")
    launch_module = True
except ModuleNotFoundError:
    launch_module = False
import tfdist.strategies.kinds
print(json.dumps({"found": found, "launch_module": launch_module,
                  "launch_is_function": callable(tfdist.launch) and not isinstance(tfdist.launch, type(os)),
                  "kinds": tfdist.strategies.kinds.__file__}))
"""


def _probe() -> dict:
    out = subprocess.run([sys.executable, "-S", "-c", PROBE, str(REPO)], capture_output=True,
                         text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_only_strategies_and_models_become_tfdist_names_from_a_checkout():
    probe = _probe()
    mapped = {name: origin for name, origin in probe["found"].items() if origin is not None}
    assert mapped["strategies"] == str(REPO / "strategies" / "__init__.py")
    assert mapped["models"] == str(REPO / "models" / "__init__.py")
    # Anything else found is tfdist's own (tfdist/bench is a package of its own, bench.py is not it).
    strays = {name: origin for name, origin in mapped.items()
              if name not in ("strategies", "models") and not origin.startswith(str(REPO / "tfdist") + "/")}
    assert strays == {}
    assert "launch" in probe["found"] and probe["found"]["launch"] is None
    assert probe["kinds"] == str(REPO / "strategies" / "kinds.py")


def test_import_tfdist_launch_never_yields_the_top_level_launch_py():
    probe = _probe()
    assert probe["launch_module"] is False and probe["launch_is_function"] is True
