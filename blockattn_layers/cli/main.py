"""``python -m blockattn_layers {demo,bench,info,verify-arch}``.

``demo`` trains a small click model on synthetic jagged histories (see :mod:`.demo`); ``bench``
hands every later argument to ``python -m blockattn_layers.bench`` (``bench --help`` lists
them); ``info`` prints versions, the device and the backend ``auto`` picks for typical inputs;
``verify-arch`` checks and times every kernel variant of this GPU (see :mod:`.verify_arch`).
"""
from __future__ import annotations

import argparse
import sys
from typing import Iterable, Optional

from . import demo

_DESCRIPTION = (
    "demo: train a small click model on synthetic jagged user histories; bench: time the attention "
    "backends (every later argument goes to python -m blockattn_layers.bench, see 'bench --help'); "
    "info: versions, device and the backend that backend='auto' picks for typical inputs; verify-arch: check "
    "every kernel variant of this GPU against the float64 reference and time it."
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m blockattn_layers", description=_DESCRIPTION)
    commands = p.add_subparsers(dest="command", required=True, metavar="{demo,bench,info,verify-arch}")
    demo.add_arguments(commands.add_parser("demo", help="train a click model on synthetic data and report",
                                           description=demo.DESCRIPTION))
    commands.add_parser("bench", help="benchmark the backends (args go to python -m blockattn_layers.bench)",
                        add_help=False)
    commands.add_parser("info", help="versions, device, and what backend='auto' picks")
    from .verify_arch import add_arguments as verify_arguments

    verify_arguments(commands.add_parser("verify-arch", help="check every kernel variant of this GPU against the "
                                         "float64 reference and time it; writes a report"))
    return p


def main(argv: Optional[Iterable[str]] = None) -> int:
    """Run one command; returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from ..bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = parser().parse_args(argv)
    if args.command == "info":
        from .info import run as run_info

        return run_info()
    if args.command == "verify-arch":
        from .verify_arch import run as run_verify

        return run_verify(args)
    return demo.run(args)
