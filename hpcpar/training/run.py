"""`hpcpar train`'s run around the loop: this rank's part of it, and the set-up and the end.

`build` makes this rank's part of a run: a `Trainer`, or on the job's last `ps.servers` ranks a
`ServerRank`. `run_training` is the whole of `hpcpar train` on one rank: logging, the config
(with `elastic_batch` when a job resumes on another number of ranks), validation against the
node's memory, the watchdog and preemption handler, the run directory and its rank table, the
resume, then `train()`, and at the end the summary, the trace and the requeue marker. Before
anything reads the checkpoint to resume, `checkpoint.location` is resolved and, on node-local
disks, that checkpoint copied onto every node (`checkpoint.replicate.start_of_run`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys

import numpy as np

from hpcpar import metrics
from hpcpar import environment
from hpcpar.checkpoint import directory
from hpcpar.checkpoint.load import load as read_checkpoint
from hpcpar.checkpoint.replicate import AUTO, LOCATIONS, NODE_LOCAL, start_of_run
from hpcpar.config.load import given_keys, load_config, loads, to_toml
from hpcpar.config.sections import Config
from hpcpar.config.validate import doubts, validate
from hpcpar.errors import ConfigError
from hpcpar.runtime import preemption, watchdog
from hpcpar.runtime.comm import Communicator, mpi_world
from hpcpar.runtime.topology import resolve_degrees
from hpcpar.training import resilience, rundir
from hpcpar.training.report import format_summary, setup_console
from hpcpar.training.server_rank import ServerRank
from hpcpar.launch.jobs import REQUEUE_STATUS
from hpcpar.training.trainer import RunResult, Trainer

log = logging.getLogger("hpcpar")


def build(cfg: Config, comm=None, tokens: np.ndarray | None = None,
          available_memory_bytes: int | None = None) -> Trainer | ServerRank:
    """This rank's part of a run: a `Trainer`, or with `ps.servers = S` on the last S ranks of
    `comm` a `ServerRank` (same `train`, `save`, `load`). Collective; arguments as `Trainer`'s."""
    comm = comm if comm is not None else mpi_world()
    cfg = validate(cfg, comm.Get_size(), available_memory_bytes)
    if cfg.ps.servers and comm.Get_rank() >= comm.Get_size() - cfg.ps.servers:
        return ServerRank(cfg, comm)
    return Trainer(cfg, comm, tokens, available_memory_bytes)


def run_training(config_path: str | None, overrides: list) -> int:
    """`hpcpar train` on this rank: set up, run `train()`, write the summary; returns the process
    exit status (0, or REQUEUE_STATUS after preemption)."""
    world = mpi_world()
    _setup_logging(world.rank)
    job = Communicator(world, "world")
    cfg = checkpoint_location(load_config(config_path, overrides), job)
    cfg = elastic_batch(cfg, world.Get_size(), given_keys(config_path, overrides))
    rank = build(cfg, world, available_memory_bytes=_agreed_memory_per_rank(job))
    cfg, job = rank.cfg, rank.job  # cfg: validated, mesh resolved; job: every rank
    if job.rank == 0:
        for doubt in doubts(cfg):
            log.warning("%s", doubt)
    watchdog.set_timeout(cfg.run.timeout)
    watchdog.set_check_every(cfg.run.debug_check_every)
    preemption.install()
    _prepare_run_dir(cfg, job)
    _log_ranks(cfg, job)
    if job.rank == 0:
        log.info("checkpoint storage: %s (%s)%s", cfg.checkpoint.location, cfg.checkpoint_dir,
                 ": every node keeps a full copy, replicated over MPI" if cfg.checkpoint.location == NODE_LOCAL else "")
    note = resilience.ulfm_note(cfg)
    if note and job.rank == 0:
        log.warning("%s", note)
    if isinstance(rank, Trainer) and not cfg.checkpoint.resume:
        resilience.forget_node_local(cfg, job)  # a fresh start: no earlier run's snapshots to resume from
    if not (isinstance(rank, Trainer) and cfg.checkpoint.resume == "auto" and resilience.resume_from_node_local(rank)):
        _resume(rank)
    if rank.step >= cfg.train.steps:  # every rank loaded the same step: they all stop here
        if job.rank == 0:
            log.warning("the checkpoint is at step %d and train.steps=%d: nothing to train, no checkpoint or "
                        "summary written (raise train.steps to train on)", rank.step, cfg.train.steps)
        return 0
    result, rank = resilience.train_through_failures(rank) if isinstance(rank, Trainer) else (rank.train(), rank)
    if result is None:  # a survivor the smaller mesh does not need
        _leave(0)
    _write_results(rank, result)
    if result.summary.get("failures"):
        # MPI_Finalize after a failure can hang (../shared/notes/cluster.md): meet, then leave.
        rank.job.barrier()
        _leave(result.status)
    return result.status


def _leave(status: int) -> None:
    """End this process now (after a failure survived: no MPI_Finalize), its output flushed."""
    for handler in logging.getLogger("hpcpar").handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def checkpoint_location(cfg: Config, world: Communicator, node_comm: Communicator | None = None) -> Config:
    """`cfg` with checkpoint.location resolved (collective over `world`, before anything reads
    the checkpoint to resume): "auto" probed on the checkpoint directory, and on node-local disks
    the checkpoint `checkpoint.resume` names copied onto every node that lacks it, so that every
    rank then finds the same one (`replicate.start_of_run`; `node_comm`: default by shared memory).
    A value outside the choices, or node-local with a shared file, is left for `validate` to name."""
    c = cfg.checkpoint
    if c.location not in LOCATIONS or (c.location == NODE_LOCAL and c.format == "shared"):
        return cfg
    # A shared file on node-local disks is refused below: nothing is copied for it first.
    location = start_of_run(cfg.checkpoint_dir, c.resume if c.format != "shared" else "", c.location, world,
                            node_comm)
    if location == NODE_LOCAL and c.format == "shared":  # "auto" probed; the verdict is the same on every rank
        raise ConfigError(f"checkpoint.location=\"auto\" found checkpoint.dir {cfg.checkpoint_dir!r} to be each "
                          "node's own disk, and checkpoint.format=\"shared\" writes one file through MPI-IO, which "
                          "needs one filesystem every node sees; use checkpoint.format=\"per_rank\" or a shared "
                          "checkpoint.dir")
    if c.location == AUTO and location == NODE_LOCAL and world.rank == 0:
        log.info("checkpoint.location=auto: %s is each node's own disk; every node keeps a full copy of each "
                 "checkpoint", cfg.checkpoint_dir)
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, location=location))


def elastic_batch(cfg: Config, world_size: int, given: set[str]) -> Config:
    """Elastic resume: a job resumed on another number of ranks keeps the checkpoint's global batch.

    When `checkpoint.resume` finds a checkpoint, every mesh degree is auto (0) and neither
    train.micro_batch_size nor train.microbatches was given, the batch keys are derived from the
    checkpoint's global batch G = dp * micro_batch_size * microbatches and the dp this world
    resolves to: micro_batch_size the largest divisor of G / dp not above the saved one, and
    microbatches the rest. Samples are drawn by (seed, step, global sample id) (data/corpus.py), so
    the run goes on with the same samples in every step, and its losses are the uninterrupted
    run's up to the order of the sums. Anything else: `cfg` unchanged.
    """
    m, t = cfg.mesh, cfg.train
    if not cfg.checkpoint.resume or any((m.dp, m.tp, m.pp, m.cp)) or \
            given & {"train.micro_batch_size", "train.microbatches"}:
        return cfg
    path = directory.latest(cfg.checkpoint_dir) if cfg.checkpoint.resume == "auto" else cfg.checkpoint.resume
    if not path or not os.path.isdir(path):
        return cfg
    _, meta = read_checkpoint(path, {}, Communicator.local())
    saved = loads(meta["config"], origin=f"config stored in {path}")
    batch = saved.mesh.dp * saved.train.micro_batch_size * saved.train.microbatches
    dp = resolve_degrees(world_size - cfg.ps.servers, m.dp, m.tp, m.pp, m.cp)[0]
    if dp * t.micro_batch_size * t.microbatches == batch:
        return cfg
    if batch % dp:
        raise ConfigError(f"elastic resume: the checkpoint's global batch of {batch} sequences does not split over "
                          f"dp={dp} ({world_size} ranks, mesh auto); resume on a number of ranks whose dp divides "
                          f"{batch}, or set mesh degrees and train.micro_batch_size/microbatches yourself")
    share = batch // dp
    size = resilience.split_batch(share, saved.train.micro_batch_size)[0]
    log.info("elastic resume: %d ranks (dp=%d) keep the checkpoint's global batch of %d sequences as "
             "micro_batch_size=%d x microbatches=%d", world_size, dp, batch, size, share // size)
    return dataclasses.replace(cfg, train=dataclasses.replace(t, micro_batch_size=size, microbatches=share // size))


def _setup_logging(rank: int) -> None:
    setup_console(rank)   # rank 0's lines on stdout, warnings and errors on stderr


def _agreed_memory_per_rank(world: Communicator) -> int | None:
    """The smallest share of node memory per rank over the job (None when unknown anywhere),
    agreed by one all-reduce before validation so that every rank reaches the same verdict."""
    available = metrics.available_memory_bytes()
    share = available // environment.local_ranks() if available is not None else -1
    agreed = int(world.all_reduce(np.array([share], dtype=np.int64), op="min")[0])
    return agreed if agreed >= 0 else None


def _prepare_run_dir(cfg: Config, world: Communicator) -> None:
    """Claim the run directory (`rundir.claim`: a fresh start never overwrites another run), create
    the run and checkpoint directories and write config.toml (rank 0), so that a directory that
    cannot be used stops the job before its first step, not at its first save; every rank raises
    the same error."""
    rundir.claim(cfg, world)
    problem = ""
    if world.rank == 0:
        for path, what, key in ((cfg.run.dir, "run directory", "run.dir"),
                                (cfg.checkpoint_dir, "checkpoint directory", "checkpoint.dir")):
            try:
                os.makedirs(path, exist_ok=True)
                probe = os.path.join(path, ".write-test")
                with open(probe, "w") as f:
                    f.write("ok")
                os.remove(probe)
                if key == "run.dir":
                    with open(os.path.join(path, "config.toml"), "w") as f:
                        f.write(to_toml(cfg))
            except OSError as err:
                problem = f"{what} {path!r} is not writable ({err.strerror}); set {key} to a writable directory"
                break
    problem = world.broadcast_object(problem, root=0)
    if problem:
        raise ConfigError(problem)


def _log_ranks(cfg: Config, world: Communicator) -> None:
    """Write <run.dir>/ranks.json (rank -> host, pid, role: worker or parameter server) and log it
    for small jobs: a launcher that reports a dead process by its PID (MPICH's hydra after a
    SIGKILL) then tells which rank died, and what it was."""
    where = world.all_gather_object((socket.gethostname(), os.getpid()))  # once, at startup
    first_server = len(where) - cfg.ps.servers

    def role(r: int) -> str:
        return "server" if r >= first_server else "worker"
    if world.rank == 0:
        with open(os.path.join(cfg.run.dir, "ranks.json"), "w") as f:
            json.dump({str(r): {"host": h, "pid": p, "role": role(r)} for r, (h, p) in enumerate(where)}, f, indent=1)
        if 1 < len(where) <= 16:
            log.info("ranks (rank:pid@host%s): %s", ", s = parameter server" if cfg.ps.servers else "",
                     ", ".join(f"{r}:{p}@{h}{'(s)' if role(r) == 'server' else ''}" for r, (h, p) in enumerate(where)))


def _resume(rank: Trainer | ServerRank) -> None:
    """Load the checkpoint `checkpoint.resume` names: "" none, "auto" the newest in the
    checkpoint directory (if any), else a path."""
    cfg = rank.cfg
    resume = cfg.checkpoint.resume
    path = directory.latest(cfg.checkpoint_dir) if resume == "auto" else resume or None
    if path:
        if resume == "auto" and rank.job.rank == 0:
            pointed = directory.pointer(cfg.checkpoint_dir)
            if pointed != os.path.basename(path):  # `latest` missing or dangling: `directory.latest` fell back
                log.warning("checkpoint.resume=auto: %s %s; resuming from the newest checkpoint there, %s",
                            os.path.join(cfg.checkpoint_dir, directory.LATEST),
                            "is missing" if pointed is None else f"names {pointed!r}, which is not a checkpoint",
                            os.path.basename(path))
        rank.load(path)
        log.info("resumed from %s at step %d", path, rank.step)
    elif resume == "auto":
        log.info("checkpoint.resume=auto: no checkpoint in %s, starting fresh", cfg.checkpoint_dir)


def _write_results(rank: Trainer | ServerRank, result: RunResult) -> None:
    """The run's files at its end: the workers' pipeline trace (trace.json, with pipeline.trace),
    and on rank 0 summary.json, the summary in the log, and the requeue marker after a preemption."""
    cfg, job = rank.cfg, rank.job
    if cfg.pipeline.trace and isinstance(rank, Trainer):   # the workers' pipeline timeline
        rank.tracer.write_chrome_trace(os.path.join(cfg.run.dir, "trace.json"), rank.mesh.world)
    if job.rank != 0:
        return
    with open(os.path.join(cfg.run.dir, "summary.json"), "w") as f:
        json.dump(result.summary, f, indent=2, sort_keys=True)
    log.info("%s", format_summary(result.summary))
    marker = os.environ.get("HPCPAR_REQUEUE_MARKER")
    if marker and result.status == REQUEUE_STATUS:
        # The job scripts' fallback for a launcher that loses the ranks' status (templates/).
        with open(marker, "w") as f:
            f.write(f"{REQUEUE_STATUS}\n")
