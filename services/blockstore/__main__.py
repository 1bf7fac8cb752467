"""``python -m services.blockstore``: the same as ``pdserve blockstore``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pdserve.commands.blockstore import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m services.blockstore")
    add_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(
        level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run(args)
    except ValueError as exc:
        print(f"pdserve blockstore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
