"""`hpcpar train [CONFIG] [--set SECTION.KEY=VALUE ...]`: train a GPT on every rank of the job."""

from __future__ import annotations

import argparse

from hpcpar.cli.options import add_config_args

HELP = "train a GPT (run under mpiexec for several ranks)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)


def one_process(args: argparse.Namespace) -> bool:
    return False


def run(args: argparse.Namespace) -> int:
    from hpcpar.training.run import run_training
    return run_training(args.config, args.overrides)
