"""`hpcpar eval CHECKPOINT [--data PATH]`: loss and perplexity on held-out tokens, on any mesh."""

from __future__ import annotations

import argparse

from hpcpar.cli.options import check_output_file

HELP = "loss and perplexity of a checkpoint on held-out data (any mesh)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint directory (step-NNNNNNN), its parent (uses latest) or a run "
                                      "directory (its newest checkpoint)")
    p.add_argument("--data", help="text or token file or directory, as data.corpus (default: the data the checkpoint "
                                  "trained on; \"\": the built-in corpus)")
    p.add_argument("--format", choices=["bytes", "bin", "hdf5"], help="data format (default: from the path)")
    p.add_argument("--split", choices=["val", "all"], default="val",
                   help="val: the part training held out (default); all: every token")
    p.add_argument("--max-tokens", type=int, default=0, help="evaluate at most this many tokens (0 = all)")
    p.add_argument("--json", dest="json_out", help="also write the figures to this JSON file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override the checkpoint's config, e.g. --set mesh.tp=2 (repeatable)")


def one_process(args: argparse.Namespace) -> bool:
    return False


def run(args: argparse.Namespace) -> int:
    check_output_file(args.json_out, "--json")
    from hpcpar.training import evaluate
    return evaluate.evaluate_checkpoint(args.checkpoint, args.data, fmt=args.format, split=args.split,
                                        max_tokens=args.max_tokens, overrides=args.overrides,
                                        json_out=args.json_out)
