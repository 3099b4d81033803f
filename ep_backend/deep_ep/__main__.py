"""``python -m ep_backend.deep_ep --shim-path``: print the folder that makes spawned workers
import ep's facade as ``deep_ep`` (put it on ``PYTHONPATH``)."""

from __future__ import annotations

import argparse

from .install import shim_path


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m ep_backend.deep_ep", description=__doc__)
    parser.add_argument("--shim-path", action="store_true", help="print the shim folder")
    args = parser.parse_args()
    if args.shim_path:
        print(shim_path())
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
