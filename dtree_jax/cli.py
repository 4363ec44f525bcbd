"""The ``dtree-jax`` command line: ``demo``, ``convert``, ``generate``.

Each subcommand lives next to the code it drives: a module exposes ``add_cli(subparsers)`` which registers
its parser and sets ``func``.  Modules are imported lazily so ``dtree-jax --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that register subcommands, in help order.
_SUBCOMMAND_MODULES = ("dtree_jax.demo", "dtree_jax.convert", "dtree_jax.decode")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dtree-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # subcommand not built yet
                continue
            raise
        module.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
