"""`python -m train <command>`: data generation and drafter / verifier training."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from train import datagen, featurize, magpie  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    datagen.add_parser(sub)
    featurize.add_parser(sub)
    magpie.add_parser(sub)
    try:
        from train import d2sd, diversed, drafters, export  # noqa: PLC0415
        drafters.add_parsers(sub)
        d2sd.add_parser(sub)
        diversed.add_parser(sub)
        export.add_parser(sub)
    except ImportError:
        pass
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
