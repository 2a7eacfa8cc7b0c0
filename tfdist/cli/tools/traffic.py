"""``python -m tfdist.cli.tools.traffic MODEL_DIR --params N``: a run's measured bytes per step on
each simulated host's link against the traffic model (``launcher/machine/traffic.py``)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tfdist.launcher.machine.traffic import DTYPE_BYTES, compare


def main(argv=None) -> int:
    """``python -m tfdist.cli.tools.traffic MODEL_DIR --params N``: measured vs the model."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("model_dir")
    p.add_argument("--params", type=int, required=True, help="trainable parameters (cnn: 225034)")
    p.add_argument("--gradient-dtype", default="float32", choices=sorted(DTYPE_BYTES),
                   help="what the run's gradients crossed the network as")
    args = p.parse_args(argv)
    path = os.path.join(args.model_dir, "launch", "outcome.json")
    try:
        with open(path) as f:
            record = json.load(f).get("traffic")
    except (OSError, ValueError) as err:
        print(f"error: cannot read {path} ({getattr(err, 'strerror', None) or err}); pass the "
              "--model-dir of a finished launch.py run", file=sys.stderr)
        return 2
    if not record or not record.get("steps"):
        print(f"error: {args.model_dir}/launch/outcome.json has no traffic per step "
              "(run launch.py with --hosts N)")
        return 2
    for name, c in compare(record, args.params, args.gradient_dtype).items():
        ratio = lambda m, e: f"{m / e:.2f}x" if e else "-"  # noqa: E731
        print(f"{name}: sent {c['tx']:,} B/step (model {c['tx_model']:,}, "
              f"{ratio(c['tx'], c['tx_model'])}), received {c['rx']:,} "
              f"(model {c['rx_model']:,}, {ratio(c['rx'], c['rx_model'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
