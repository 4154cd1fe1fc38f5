"""Slurm and PBS job scripts for `hpcpar train`: `hpcpar job render`.

The templates (`hpcpar/launch/templates/{slurm,pbs}.sh.tmpl`) hold the shell logic that is
the same for every job: forward the pre-time-limit signal to the ranks, wait for them,
and requeue when they exit with `REQUEUE_STATUS`. This module fills in what varies:
scheduler directives, environment, launcher and the training command line, which sits
between the `# >>> launch` and `# <<< launch` markers as two lines (launcher, then program).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import string
from importlib import resources

from hpcpar.errors import HpcparError

# What every rank exits with after saving a checkpoint on SIGTERM/SIGUSR1 (EX_TEMPFAIL from
# sysexits.h): "checkpoint saved, please requeue". The templates test for this number.
REQUEUE_STATUS = 75

SCHEDULERS = ("slurm", "pbs")
VARIANTS = ("cpu", "gpu")
# mpiexec: MPICH hydra syntax (also Intel MPI); mpiexec-openmpi: Open MPI's mpiexec.
LAUNCHERS = {"slurm": ("srun", "mpiexec", "mpiexec-openmpi"), "pbs": ("mpiexec", "mpiexec-openmpi")}

_TIME = re.compile(r"^(\d+):([0-5]\d):([0-5]\d)$")
# Job, partition, queue and account names as schedulers accept them, and safe unquoted.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+=")


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """What a job script can vary; `None` means "the variant's default" (see `resolve`)."""

    nodes: int = 1
    ranks_per_node: int | None = None   # cpu: 4; gpu: gpus_per_node (one rank per GPU)
    cpus_per_task: int = 8              # cores per rank = OMP_NUM_THREADS
    gpus_per_node: int | None = None    # gpu variant only; default 4
    time: str = "01:00:00"              # wall-clock limit, HH:MM:SS
    partition: str = ""                 # Slurm partition / PBS queue; "" = site default
    account: str = ""                   # project to charge; "" = user default
    job_name: str = "hpcpar"
    launcher: str | None = None         # slurm: srun (default) or mpiexec; pbs: mpiexec
    signal_seconds: int = 300           # USR1 this many seconds before the time limit
    config: str = "run.toml"            # the TOML file `hpcpar train` reads
    overrides: tuple[str, ...] = ()     # extra `--set section.key=value`
    hpcpar: str = "hpcpar"              # how compute nodes run hpcpar, e.g. "python -m hpcpar"


FIELDS = tuple(f.name for f in dataclasses.fields(JobOptions))
DEFAULTS = JobOptions()


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HpcparError(f"job option {name} must be a positive integer, got {value!r}")
    return value


def _name(name: str, value: object, allow_empty: bool) -> str:
    if not isinstance(value, str) or not (_NAME.match(value) or (allow_empty and value == "")):
        raise HpcparError(f"job option {name} must be letters, digits, '_', '.' or '-'"
                          f" (starting with a letter or digit), got {value!r}")
    return value


def _time_seconds(time: str) -> int:
    """Seconds in an `HH:MM:SS` limit (hours may exceed 24); HpcparError if malformed or zero."""
    match = _TIME.match(time) if isinstance(time, str) else None
    if not match:
        raise HpcparError(f"job option time must be HH:MM:SS (e.g. 01:30:00), got {time!r}")
    hours, minutes, seconds = (int(g) for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total == 0:
        raise HpcparError("job option time must be longer than 00:00:00")
    return total


def resolve(scheduler: str, variant: str, options: dict[str, object]) -> JobOptions:
    """Check every option and fill in the variant's defaults; one-line HpcparError on the first bad one."""
    if scheduler not in SCHEDULERS:
        raise HpcparError(f"unknown scheduler {scheduler!r}: expected one of {', '.join(SCHEDULERS)}")
    if variant not in VARIANTS:
        raise HpcparError(f"unknown job variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    unknown = sorted(set(options) - set(FIELDS))
    if unknown:
        raise HpcparError(f"unknown job option {unknown[0]!r}: expected one of {', '.join(FIELDS)}")
    opts = dataclasses.replace(DEFAULTS, **options)

    for field in ("nodes", "cpus_per_task", "signal_seconds"):
        _positive_int(field, getattr(opts, field))
    if variant == "gpu":
        gpus = _positive_int("gpus_per_node", 4 if opts.gpus_per_node is None else opts.gpus_per_node)
        ranks = gpus if opts.ranks_per_node is None else _positive_int("ranks_per_node", opts.ranks_per_node)
        if ranks != gpus:
            raise HpcparError(f"the gpu variant runs one rank per GPU: ranks_per_node ({ranks}) must equal"
                              f" gpus_per_node ({gpus}), or leave ranks_per_node out")
    else:
        if opts.gpus_per_node is not None:
            raise HpcparError("job option gpus_per_node applies to the gpu variant only: use --variant gpu"
                              " or leave it out")
        gpus = None
        ranks = 4 if opts.ranks_per_node is None else _positive_int("ranks_per_node", opts.ranks_per_node)

    limit = _time_seconds(opts.time)
    if opts.signal_seconds >= limit:
        raise HpcparError(f"job option signal_seconds ({opts.signal_seconds}) must be less than the time"
                          f" limit {opts.time} ({limit} s)")
    _name("job_name", opts.job_name, allow_empty=False)
    _name("partition", opts.partition, allow_empty=True)
    _name("account", opts.account, allow_empty=True)

    launcher = LAUNCHERS[scheduler][0] if opts.launcher is None else opts.launcher
    if launcher not in LAUNCHERS[scheduler]:
        raise HpcparError(f"launcher {launcher!r} does not work with {scheduler}: expected one of"
                          f" {', '.join(LAUNCHERS[scheduler])}")

    if not isinstance(opts.config, str) or not opts.config.strip() or "\n" in opts.config:
        raise HpcparError(f"job option config must be a TOML file path, got {opts.config!r}")
    overrides = (opts.overrides,) if isinstance(opts.overrides, str) else tuple(opts.overrides)
    for item in overrides:
        if not isinstance(item, str) or not _OVERRIDE.match(item) or "\n" in item:
            raise HpcparError(f"job override must be SECTION.KEY=VALUE (e.g. train.steps=1000), got {item!r}")
        if item.startswith("checkpoint.resume="):
            raise HpcparError("job scripts always pass checkpoint.resume=auto so a requeued job continues:"
                              f" drop {item!r}")
    try:
        hpcpar_words = shlex.split(opts.hpcpar) if isinstance(opts.hpcpar, str) else []
    except ValueError:
        hpcpar_words = []
    if not hpcpar_words:
        raise HpcparError(f"job option hpcpar must be a command such as 'hpcpar' or 'python -m hpcpar',"
                          f" got {opts.hpcpar!r}")

    return dataclasses.replace(opts, ranks_per_node=ranks, gpus_per_node=gpus, launcher=launcher,
                               overrides=overrides, hpcpar=shlex.join(hpcpar_words))


def _directives(scheduler: str, variant: str, o: JobOptions) -> list[str]:
    if scheduler == "slurm":
        lines = [f"--job-name={o.job_name}", f"--nodes={o.nodes}", f"--ntasks-per-node={o.ranks_per_node}",
                 f"--cpus-per-task={o.cpus_per_task}"]
        if variant == "gpu":
            lines.append(f"--gpus-per-node={o.gpus_per_node}")
        lines.append(f"--time={o.time}")
        if o.partition:
            lines.append(f"--partition={o.partition}")
        if o.account:
            lines.append(f"--account={o.account}")
        # %x-%j: job name and id; append so a requeued run keeps one log.
        lines += ["--output=%x-%j.out", "--open-mode=append",
                  f"--signal=B:USR1@{o.signal_seconds}", "--requeue"]
        return [f"#SBATCH {line}" for line in lines]
    select = (f"select={o.nodes}:ncpus={o.ranks_per_node * o.cpus_per_task}:mpiprocs={o.ranks_per_node}"
              f":ompthreads={o.cpus_per_task}")
    if variant == "gpu":
        select += f":ngpus={o.gpus_per_node}"
    lines = [f"-N {o.job_name}", f"-l {select}", f"-l walltime={o.time}"]
    if o.partition:
        lines.append(f"-q {o.partition}")
    if o.account:
        lines.append(f"-A {o.account}")
    lines += ["-j oe", "-r y"]
    return [f"#PBS {line}" for line in lines]


def _environment(variant: str, o: JobOptions) -> list[str]:
    lines = [
        "# One BLAS/OpenMP thread per core of each rank.",
        f"export OMP_NUM_THREADS={o.cpus_per_task}",
        "# Parallel file systems (Lustre, GPFS) often lack the POSIX locks HDF5 asks for.",
        "export HDF5_USE_FILE_LOCKING=FALSE",
    ]
    if variant == "gpu":
        lines += ["# CuPy arrays and NCCL collectives; one rank per GPU.", "export HPCPAR_BACKEND=cupy"]
    return lines


def _exported(variant: str, o: JobOptions) -> list[str]:
    """The variables the script exports for the ranks: its environment lines' and the requeue
    marker's (HPCPAR_REQUEUE_MARKER, set by the templates)."""
    return [line.split()[1].split("=")[0] for line in _environment(variant, o) if line.startswith("export ")] + [
        "HPCPAR_REQUEUE_MARKER"]


def _launcher(scheduler: str, variant: str, o: JobOptions) -> list[str]:
    if o.launcher == "srun":
        # srun no longer inherits --cpus-per-task from sbatch (Slurm >= 22.05): say it again.
        # --kill-on-bad-exit: a rank that dies ends the step; by default (unless the site sets
        # KillOnBadExit) the others would wait for it until the time limit (seen on a 2-node Slurm
        # when a rank failed in MPI_Init).
        return ["srun", "--kill-on-bad-exit=1", "--cpu-bind=cores", f"--cpus-per-task={o.cpus_per_task}"]
    ranks = str(o.nodes * o.ranks_per_node)
    if o.launcher == "mpiexec-openmpi":
        # Open MPI: ranks_per_node per node (ppr), PE=cpus cores each, every rank bound to its cores.
        # Its mpiexec passes no variable to the ranks on other nodes unless -x names it.
        return ["mpiexec", "-n", ranks, "--map-by", f"ppr:{o.ranks_per_node}:node:PE={o.cpus_per_task}",
                "--bind-to", "core"] + [arg for name in _exported(variant, o) for arg in ("-x", name)]
    # MPICH hydra syntax (also Intel MPI): -ppn ranks per node, each bound to its own cores.
    return ["mpiexec", "-n", ranks, "-ppn", str(o.ranks_per_node), "-bind-to", f"core:{o.cpus_per_task}"]


def _program(o: JobOptions) -> list[str]:
    words = shlex.split(o.hpcpar) + ["train", o.config, "--set", "checkpoint.resume=auto"]
    for item in o.overrides:
        words += ["--set", item]
    return words


def _render_command(scheduler: str, variant: str, o: JobOptions) -> str:
    """The `hpcpar job render` command line that reproduces this script (non-defaults only)."""
    words = ["hpcpar", "job", "render", "--scheduler", scheduler, "--variant", variant]
    implied = {"ranks_per_node": o.gpus_per_node if variant == "gpu" else 4,
               "gpus_per_node": 4 if variant == "gpu" else None,
               "launcher": LAUNCHERS[scheduler][0]}
    for field in FIELDS:
        value = getattr(o, field)
        if value == implied.get(field, getattr(DEFAULTS, field)):
            continue
        flag = "--" + ("set" if field == "overrides" else field.replace("_", "-"))
        for item in (value if field == "overrides" else (value,)):
            words += [flag, str(item)]
    return shlex.join(words)


class _ScriptTemplate(string.Template):
    # '@{name}' placeholders: bash already uses '$' everywhere.
    delimiter = "@"


def render(scheduler: str, variant: str = "cpu", **options: object) -> str:
    """A complete job script for `scheduler` ("slurm" | "pbs") and `variant` ("cpu" | "gpu").

    `options` are `JobOptions` fields (nodes, ranks_per_node, cpus_per_task, gpus_per_node,
    time, partition, account, job_name, launcher, signal_seconds, config, overrides, hpcpar).
    Raises HpcparError naming the first bad option.
    """
    o = resolve(scheduler, variant, options)
    template = resources.files("hpcpar.launch").joinpath("templates", f"{scheduler}.sh.tmpl").read_text()
    return _ScriptTemplate(template).substitute(
        variant=variant,
        render_command=_render_command(scheduler, variant, o),
        directives="\n".join(_directives(scheduler, variant, o)),
        environment="\n".join(_environment(variant, o)),
        signal_seconds=o.signal_seconds,
        time=o.time,
        timer_seconds=_time_seconds(o.time) - o.signal_seconds,
        launcher=shlex.join(_launcher(scheduler, variant, o)),
        program=shlex.join(_program(o)),
    )
