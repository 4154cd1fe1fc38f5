"""`hpcpar job render`: a Slurm or PBS script for `hpcpar train`, printed or written, on one process."""

from __future__ import annotations

import argparse
import os
import stat
import sys

from hpcpar.errors import HpcparError
from hpcpar.launch import jobs

HELP = "render a Slurm or PBS job script"


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="job_action", required=True, metavar="ACTION")
    r = actions.add_parser("render", help="fill in a job template and print it (or write --out)")
    d = jobs.DEFAULTS
    r.add_argument("--scheduler", required=True, choices=jobs.SCHEDULERS, help="batch system")
    r.add_argument("--variant", default="cpu", choices=jobs.VARIANTS,
                   help="cpu: NumPy ranks; gpu: one CuPy rank per GPU (default cpu)")
    r.add_argument("--nodes", type=int, help=f"nodes (default {d.nodes})")
    r.add_argument("--ranks-per-node", type=int, help="MPI ranks per node (cpu default 4; gpu: = GPUs)")
    r.add_argument("--cpus-per-task", type=int,
                   help=f"cores per rank, also OMP_NUM_THREADS (default {d.cpus_per_task})")
    r.add_argument("--gpus-per-node", type=int, help="GPUs per node, gpu variant (default 4)")
    r.add_argument("--time", help=f"wall-clock limit HH:MM:SS (default {d.time})")
    r.add_argument("--partition", "--queue", dest="partition",
                   help="Slurm partition or PBS queue (default: the site's)")
    r.add_argument("--account", help="account/project to charge (default: the user's)")
    r.add_argument("--job-name", help=f"job name (default {d.job_name})")
    r.add_argument("--launcher", help="slurm: srun (default), mpiexec (MPICH/Intel MPI syntax) or"
                   " mpiexec-openmpi; pbs: mpiexec (default) or mpiexec-openmpi")
    r.add_argument("--signal-seconds", type=int,
                   help=f"send USR1 this long before the time limit (default {d.signal_seconds})")
    r.add_argument("--config", help=f"TOML config the job trains with (default {d.config})")
    r.add_argument("--set", dest="overrides", action="append", metavar="SECTION.KEY=VALUE",
                   help="extra override for the training command (repeatable)")
    r.add_argument("--hpcpar", help="command that runs hpcpar on the compute nodes (default hpcpar)")
    r.add_argument("--out", help="write the script here (made executable) instead of printing it")


def one_process(args: argparse.Namespace) -> bool:
    return True


def check_run(o: jobs.JobOptions) -> None:
    """What can be checked here of the run the script starts (`jobs.JobOptions` o), so that a mistake
    does not wait in the queue first: the overrides' keys and types, and when the config file is here
    too (the job runs in the directory it is submitted from), every value and the mesh on the job's
    nodes x ranks_per_node ranks. Raises the one-line error `hpcpar train` would."""
    from hpcpar.config.load import load_config
    from hpcpar.config.validate import validate
    path = o.config if os.path.isfile(o.config) else None
    cfg = load_config(path, list(o.overrides))
    if path is not None:
        validate(cfg, o.nodes * o.ranks_per_node)


def run(args: argparse.Namespace) -> int:
    """Print the script, or write it to `args.out` and say so, once the run it starts passed
    `check_run`; warn (stderr) when the config file is not here to be checked."""
    options = {f: getattr(args, f) for f in jobs.FIELDS if getattr(args, f, None) is not None}
    script = jobs.render(args.scheduler, args.variant, **options)
    o = jobs.resolve(args.scheduler, args.variant, options)
    check_run(o)
    if not os.path.isfile(o.config):
        sys.stderr.write(f"hpcpar: warning: --config {o.config}: no such file here, so only the --set overrides were "
                         f"checked; the job runs `hpcpar train {o.config}` in the directory it is submitted from, "
                         "which must hold that file (or render again with --config YOUR.toml)\n")
    if not args.out:
        sys.stdout.write(script)
        return 0
    try:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(script)
    except OSError as err:
        raise HpcparError(f"cannot write job script {args.out}: {err.strerror}") from None
    # Executable like any script, for those who run it outside the scheduler too.
    os.chmod(args.out, os.stat(args.out).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    print(f"wrote {args.out}: a {args.scheduler} job of {o.nodes} node(s) x {o.ranks_per_node} rank(s), {o.time}, "
          f"running hpcpar train {o.config} (requeued on preemption); submit it with "
          f"{'sbatch' if args.scheduler == 'slurm' else 'qsub'} {args.out}")
    return 0
