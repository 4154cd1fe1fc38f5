"""`hpcpar plan [CONFIG]`: choose the mesh and micro-batching for an allocation from a cost model."""

from __future__ import annotations

import argparse

from hpcpar.cli.options import add_config_args, check_output_file

HELP = "choose the mesh and micro-batching for an allocation (cost model)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--preset", help="model preset instead of the config's model keys: "
                                    "gpt2-124m, gpt2-1.5b, 7b, 70b, 175b")
    p.add_argument("--ranks", type=int, help="ranks of the allocation (or --nodes and --gpus-per-node)")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--hardware", default="this", help="a100, h100, or this (the figures --calibrate stored)")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: the config's "
                                                     "dp x micro_batch_size x microbatches)")
    p.add_argument("--top", type=int, default=5, help="how many plans to print")
    p.add_argument("--out", help="write the best plan as a config `hpcpar train` runs as is")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (run under mpiexec with the ranks a job will use) and store it")
    p.add_argument("--calibration", help="calibration file (default: $HPCPAR_CALIBRATION or "
                                         "~/.cache/hpcpar/calibration.json)")


def one_process(args: argparse.Namespace) -> bool:
    return not args.calibrate      # --calibrate measures with every rank of the job


def run(args: argparse.Namespace) -> int:
    check_output_file(args.out, "--out")
    from hpcpar.planner import planner
    return planner.cli(args)
