"""`python -m train <command>`: data generation and drafter / verifier training."""

from __future__ import annotations

import argparse
import sys

from train import d2sd, datagen, diversed, drafter_cli, export, featurize, grpo, magpie, qtemp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    datagen.add_parser(sub)
    featurize.add_parser(sub)
    magpie.add_parser(sub)
    drafter_cli.add_parsers(sub)
    d2sd.add_parser(sub)
    diversed.add_parser(sub)
    export.add_parser(sub)
    qtemp.add_parser(sub)
    grpo.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
