"""`hpcpar plan [CONFIG]`: choose the mesh and micro-batching for an allocation from a cost model."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import TYPE_CHECKING

from hpcpar.cli.options import add_config_args, check_output_file
from hpcpar.errors import ConfigError

if TYPE_CHECKING:
    from hpcpar.config.sections import Config

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
    """Print the best plans (rank 0), or `--calibrate` and store the figures."""
    check_output_file(args.out, "--out")
    from hpcpar.planner.hardware import load_hardware
    from hpcpar.planner.search import format_plans, plan, write_plan

    cfg = _load(args)
    if args.calibrate:
        return _calibrate(cfg, args)
    if (args.ranks is None) == (args.nodes is None):
        raise ConfigError("give the allocation as --ranks N or as --nodes N --gpus-per-node G (one of the two)")
    hw = load_hardware(args.hardware, args.calibration)
    if args.nodes is not None:
        if not args.gpus_per_node or args.gpus_per_node < 1 or args.nodes < 1:
            raise ConfigError("--nodes needs --gpus-per-node G, both >= 1")
        hw = dataclasses.replace(hw, ranks_per_node=args.gpus_per_node)
        world = args.nodes * args.gpus_per_node
    else:
        world = args.ranks
    if world < 1:
        raise ConfigError(f"--ranks={world} is invalid: use a positive number of ranks")
    if args.global_batch is not None and args.global_batch < 1:
        raise ConfigError(f"--global-batch={args.global_batch} is invalid: use a positive number of sequences")
    plans, why = plan(cfg, world, hw, top=max(1, args.top), global_batch=args.global_batch)
    print(format_plans(plans[:args.top], world, hw, why))
    if args.out:
        run_dir = plan_run_dir(args)
        write_plan(plans[0], args.out, run_dir)
        print(f"wrote {args.out}: hpcpar train {args.out} runs plan 1 on {world} ranks"
              + (f", in run directory {run_dir}" if run_dir else ""))
    return 0


def plan_run_dir(args: argparse.Namespace) -> str | None:
    """The run directory a plan written to --out trains in: runs/<--out's stem> (plan.toml:
    runs/plan), so that it never starts in another run's directory (runs/default, the main job's);
    None when the config or --set gives run.dir (kept as given)."""
    from hpcpar.config.load import given_keys
    if "run.dir" in given_keys(args.config, args.overrides):
        return None
    return os.path.join("runs", os.path.splitext(os.path.basename(args.out))[0] or "plan")


def _load(args: argparse.Namespace) -> Config:
    """The config to plan: the file and overrides, with --preset's model keys among the overrides."""
    from hpcpar.config.load import load_config
    from hpcpar.planner.search import MODEL_PRESETS

    overrides = list(args.overrides)
    if args.preset:
        if args.preset not in MODEL_PRESETS:
            raise ConfigError(f"--preset={args.preset!r} is not one of {', '.join(MODEL_PRESETS)}")
        overrides += [f"model.{k}={v}" for k, v in MODEL_PRESETS[args.preset].items()]
    cfg = load_config(args.config, overrides)
    if cfg.ps.servers:
        raise ConfigError(f"ps.servers={cfg.ps.servers}: hpcpar plan models all-reduce data parallelism, not parameter "
                          "servers; plan the workers' mesh with ps.servers=0 and --ranks set to the worker count")
    return cfg


def _calibrate(cfg: Config, args: argparse.Namespace) -> int:
    """Measure this machine with every rank of the job; rank 0 stores the figures."""
    from mpi4py import MPI

    from hpcpar.planner.hardware import save_hardware
    from hpcpar.training.calibrate import calibrate   # loads MPI, which planning with a preset must not

    hw = calibrate(cfg, MPI.COMM_WORLD)
    if MPI.COMM_WORLD.Get_rank() == 0:
        path = save_hardware(hw, args.calibration)
        print(f"calibrated {hw.ranks_per_node} ranks: GEMM {hw.peak_flops / 1e9:.1f} GFLOP/s per rank, "
              f"all-reduce alpha {hw.intra.alpha * 1e6:.1f} us, beta {hw.intra.beta / 1e9:.2f} GB/s; "
              f"block times for tp in {sorted(hw.layer_times)}; wrote {path}")
    return 0
