"""`dflash convert`: read a drafter in any layout (hub, released, speculators) and write it in another (default: hub).
The options and the writing are `dflash export`'s (`cli.export`)."""

from __future__ import annotations

import argparse

from .export import add_output_arguments, write_layout


def add_convert_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `dflash convert`."""
    from ..interop import LAYOUTS

    parser.add_argument("source", help="a drafter folder (or Hub repo id) in any layout; detected from config.json")
    parser.add_argument("--layout", default="hub", choices=LAYOUTS, help="the layout to write")
    add_output_arguments(parser)
    return parser


def run_convert(args: argparse.Namespace) -> int:
    """`dflash convert`."""
    return write_layout(args.source, args.layout, args, "Converted", "convert")
