"""Make sure MNIST is prepared (downloading it when online): ``python -m tfdist.cli.tools.prepare_data``.

The launcher runs this before it enters a network namespace, which has no
network. Bad input or no data: one ``error:`` line and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from tfdist.protocol import ConfigError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--data-dir", default=None,
                   help="a tfds data directory (default: TFDS_DATA_DIR or ~/tensorflow_datasets)")
    args = p.parse_args(argv)
    from tfdist.models.tfds_data import ensure_available

    try:
        ensure_available("mnist", args.data_dir or None)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
