"""`hpcpar plot RUN... --out FILE`: loss curves of one or more runs, on one process."""

from __future__ import annotations

import argparse

from hpcpar.cli.options import check_output_file

HELP = "draw loss curves of one or more runs to a PNG"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run directories (each holds metrics.jsonl)")
    p.add_argument("--out", default="loss.png", help="image to write, in an existing directory; its suffix names "
                                                      "the format (.png, .pdf, .svg, ...)")


def one_process(args: argparse.Namespace) -> bool:
    return True


def run(args: argparse.Namespace) -> int:
    check_output_file(args.out, "--out")
    from hpcpar.training import plot
    return plot.plot_runs(args.runs, args.out)
