"""Training through a lost rank or node: in-memory partner snapshots, shrink-and-continue with
ULFM, and a requeued run that resumes from the survivors' copies.

Levels, as SCR (LLNL's multilevel checkpointing) has them:

    memory       every `checkpoint.memory_every` = K steps each rank snapshots its own state
                 (`Trainer.checkpoint_state()`, copied to the host: checkpoint/memory.py) and sends
                 it to its partner, the rank with its place on the next node, with a non-blocking
                 send that completes while the next step runs; it keeps its own snapshot and its
                 partner's copy
    node-local   with `checkpoint.memory_dir`, every snapshot a rank holds is also written there
                 (a file per owner and step), for a requeued run
    shared       the checkpoints of `checkpoint.every`, as always

`PartnerSnapshots` does the first two after every step (`after_step`). Its host memory: two
snapshots' worth between exchanges (its own, its partner's), four from one exchange until a step
later (the previous and the new of each: the previous pair is dropped only once every rank is known
to hold the new one, so some step always survives complete).

`train_through_failures` runs `Trainer.train`, and with `run.on_failure = "shrink"` on an MPI
with ULFM (hpcpar/runtime/ulfm.py) it survives a failure: the first error on any survivor
revokes every communicator of the run, so every survivor stops wherever it waited; the survivors
shrink the world, gather which snapshots each holds, and agree on the newest step r for which
some survivor holds every rank's snapshot (partner copies stand in for the lost ranks). The
data-parallel groups (one dp coordinate: its tp, pp and cp ranks) all of whose ranks survived
form the new mesh: fewer replicas, tp, pp and cp whole, the same global batch (more
micro-batches per replica). A new `Trainer` on those ranks loads step r from the snapshots
through the global-tensor reshard (`checkpoint.memory.MemoryStored`), so the losses from r on
equal a run restored at step r from a checkpoint on the smaller mesh. Survivors outside the new
mesh serve their snapshots and leave. If no survivor holds some rank's snapshot (a node and its
partner node both lost), the run says so and the new mesh loads the last checkpoint on disk.

Without ULFM a failure ends the job as before; `resume_from_node_local` then lets the requeued
run start from the snapshots on node-local disks when they are newer than the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import signal
import socket
import sys
import time

import numpy as np

from hpcpar.checkpoint import directory
from hpcpar.checkpoint.memory import MemoryStored, Snapshot, pack_state
from hpcpar.config.sections import Config
from hpcpar.config.validate import validate
from hpcpar.errors import HpcparError
from hpcpar.runtime import ulfm, watchdog
from hpcpar.runtime.comm import Communicator
from hpcpar.runtime.topology import Axis

log = logging.getLogger("hpcpar")
_FILE = re.compile(r"^snap-w(\d+)-o(\d+)-s(\d+)\.bin$")


def partners(hosts: list[str]) -> list[int]:
    """partner[r]: the rank that keeps rank r's copy, the rank at r's place on the next node
    (ranks ordered by node, shifted by the largest node's rank count; on one node, the next rank)."""
    nodes: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        nodes.setdefault(h, []).append(r)
    order = [r for ranks in nodes.values() for r in ranks]
    shift = max(len(ranks) for ranks in nodes.values())
    shift = shift if len(nodes) > 1 else 1
    position = {r: i for i, r in enumerate(order)}
    return [order[(position[r] + shift) % len(order)] for r in range(len(hosts))]


def debug_failure(spec: str) -> tuple[set[int], int, str] | None:
    """`run.debug_fail_at` parsed: (ranks, step, "" or "exchange"), or None when unset."""
    if not spec:
        return None
    ranks, _, rest = spec.partition("@")
    step, _, phase = rest.partition("/")
    return {int(r) for r in ranks.split(",")}, int(step), phase


class PartnerSnapshots:
    """A rank's in-memory snapshots and its partner's copy (module docstring). Collective
    construction over the job; `after_step(trainer)` on every rank after every step."""

    def __init__(self, trainer):
        cfg, job = trainer.cfg, trainer.job
        self.job, self.every = job, cfg.checkpoint.memory_every
        self.hosts = job.all_gather_object(socket.gethostname())
        self.unit_of = job.all_gather_object(trainer.mesh.rank(Axis.DP))  # the data-parallel group of each rank
        self.partner = partners(self.hosts)
        self.source = self.partner.index(job.rank)      # whose copy this rank keeps
        self.own: dict[int, np.ndarray] = {}            # step -> this rank's snapshot, packed
        self.copies: dict[int, np.ndarray] = {}         # step -> the partner's snapshot received, packed
        self._exchange = None
        self._received = None  # the step whose exchange this rank finished; every rank has once a step passed
        self.fail = debug_failure(cfg.run.debug_fail_at)
        # The ranks a debug failure ends meet first, then die together: one that died early could
        # let another, still finishing the step, see the failure first and survive it.
        self._dying = job.split(int(job.rank in self.fail[0]), job.rank, "dying") if self.fail else None
        self.directory = _snapshot_dir(cfg) if cfg.checkpoint.memory_dir else None
        self.bytes = 0
        self.seconds = {"snapshot": 0.0, "exchange_wait": 0.0, "write": 0.0}

    @classmethod
    def of(cls, trainer) -> PartnerSnapshots | None:
        """The trainer's snapshots, or None when neither snapshots nor a failure policy nor a
        debug failure is configured."""
        cfg = trainer.cfg
        if cfg.checkpoint.memory_every or cfg.run.on_failure != "abort" or cfg.run.debug_fail_at:
            return cls(trainer)
        return None

    def after_step(self, trainer) -> None:
        """After a step: finish the exchange in flight (it ran behind the step), the debug
        failure due at the next step, then a new snapshot and its exchange when one is due."""
        if self._received is not None:
            # A step (and its world agreement) has passed since this rank received the copy of step
            # `_received`: every rank has received its copy of that step, so older ones can go.
            # Dropping them as soon as one's own copy arrived would leave no complete step when a
            # partner's last send never arrived (a rank dying with its bytes still on the wire).
            for held in (self.own, self.copies):
                for old in [s for s in held if s < self._received]:
                    del held[old]
            if self.directory is not None:
                self._prune_files(self._received)
            self._received = None
        if self._exchange is not None:
            self._finish_exchange()
        step = trainer.step
        if self.fail and self.job.rank in self.fail[0] and step == self.fail[1] and not self.fail[2]:
            self._dying.barrier()
            _die(f"run.debug_fail_at: rank {self.job.rank} ends at the start of step {step}")
        if self.every and step % self.every == 0:
            t0 = time.perf_counter()
            self.own[step] = pack_state(self.job.rank, trainer.checkpoint_state())
            self.seconds["snapshot"] += time.perf_counter() - t0
            self._start_exchange(step, self.own[step])
            if self.fail and self.job.rank in self.fail[0] and step == self.fail[1] and self.fail[2] == "exchange":
                self._dying.barrier()
                _die(f"run.debug_fail_at: rank {self.job.rank} ends during the partner exchange of step {step}")

    # -- the exchange -----------------------------------------------------------------------------
    def _start_exchange(self, step: int, packed: np.ndarray) -> None:
        if self.job.size == 1:
            self._exchange = (step, packed, None, None, None)
            return
        size = np.zeros(1, dtype=np.int64)
        for h in self.job.isend_irecv(np.array([packed.size], dtype=np.int64), self.partner[self.job.rank], size,
                                      self.source, send_tag=71, recv_tag=71):
            h.wait()
        incoming = np.empty(int(size[0]), dtype=np.uint8)
        sent, received = self.job.isend_irecv(packed, self.partner[self.job.rank], incoming, self.source,
                                              send_tag=72, recv_tag=72)
        self._exchange = (step, packed, incoming, sent, received)
        self.bytes = packed.size

    def _finish_exchange(self) -> None:
        step, packed, incoming, sent, received = self._exchange
        self._exchange = None
        t0 = time.perf_counter()
        if sent is not None:
            sent.wait()
            received.wait()
            self.copies[step] = incoming
        self.seconds["exchange_wait"] += time.perf_counter() - t0
        self._received = step
        if self.directory is not None:
            t0 = time.perf_counter()
            self._write(step, packed, incoming)
            self.seconds["write"] += time.perf_counter() - t0

    def _write(self, step: int, packed: np.ndarray, incoming: np.ndarray | None) -> None:
        """This rank's snapshot and its partner's copy into the node-local directory."""
        os.makedirs(self.directory, exist_ok=True)
        world = self.job.size
        for owner, data in ((self.job.rank, packed), (self.source, incoming)):
            if data is None:
                continue
            path = os.path.join(self.directory, f"snap-w{world}-o{owner:05d}-s{step:09d}.bin")
            tmp = path + f".tmp{os.getpid()}"
            data.tofile(tmp)
            os.replace(tmp, path)

    def _prune_files(self, step: int) -> None:
        """Remove this rank's files (its own and its partner's copy) older than `step`, which every
        rank has received (see `after_step`)."""
        for name in os.listdir(self.directory):
            m = _FILE.match(name)
            if m and int(m.group(2)) in (self.job.rank, self.source) and int(m.group(3)) < step:
                try:
                    os.remove(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass

    def holdings(self) -> dict[int, list[int]]:
        """{owner rank: [steps]} of the complete snapshots this rank holds."""
        out: dict[int, list[int]] = {self.job.rank: sorted(self.own)}
        if self.copies:
            out.setdefault(self.source, []).extend(sorted(self.copies))
        return out

    def held_at(self, step: int) -> list[Snapshot]:
        """The snapshots of `step` this rank holds (its own, its partner's copy), unpacked."""
        return [Snapshot.unpack(held[step]) for held in (self.own, self.copies) if step in held]

    def report(self) -> dict:
        """The summary's "snapshots" entry: cadence, bytes of one snapshot (this rank's), the
        host bytes held now, seconds spent per level."""
        held = sum(b.size for held in (self.own, self.copies) for b in held.values())
        return {"every": self.every, "bytes_per_snapshot": self.bytes, "bytes_held": held,
                "seconds": dict(self.seconds), "partner_of_rank": self.partner}


def _die(message: str) -> None:
    """End this process as a crash does (SIGKILL: a launcher with ULFM takes an exit status != 0
    for the job's end, a signal for a failure to survive)."""
    sys.stderr.write(f"hpcpar: {message} (unix time {time.time():.3f})\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _snapshot_dir(cfg: Config) -> str:
    """This run's folder under checkpoint.memory_dir (runs are told apart by their run.dir)."""
    key = hashlib.sha1(os.path.realpath(cfg.run.dir).encode()).hexdigest()[:12]
    return os.path.join(cfg.checkpoint.memory_dir, f"hpcpar-snapshots-{key}")


# -- shrink and continue ------------------------------------------------------------------------

def train_through_failures(trainer, tokens=None, **train_kwargs):
    """`trainer.train(**train_kwargs)`; with run.on_failure = "shrink" and ULFM, a failure is
    survived (module docstring) and training goes on on the new mesh. Returns (RunResult, the
    trainer that finished) on the ranks of the final mesh, (None, None) on a survivor the new mesh
    does not need."""
    classes = ulfm.failure_classes() if trainer.cfg.run.on_failure == "shrink" else set()
    failures: list[dict] = []
    while True:
        try:
            result = trainer.train(**train_kwargs)
        except BaseException as exc:  # noqa: BLE001 - a failure may surface as any wrapped error
            if not classes or not ulfm.is_failure(exc, classes):
                raise
            peak = getattr(trainer, "peak", None)
            trainer, event = recover(trainer, tokens)
            failures.append(event)
            if trainer is None:
                return None, None
            if peak is not None and "peak_flops" not in train_kwargs:  # not measured again: half a second
                train_kwargs["peak_flops"] = peak.flops
            trainer.events.append({"failure": event})
            continue
        if failures:
            result.summary["failures"] = failures
        if trainer.snapshots is not None:
            result.summary["snapshots"] = trainer.snapshots.report()
        return result, trainer


def recover(trainer, tokens=None):
    """After a failure: revoke, shrink, agree on the rollback step, build the smaller mesh and
    load it (module docstring). Returns (the new Trainer, or None on a rank it does not need; the
    event for metrics and summary). Collective over the survivors."""
    from hpcpar.training.trainer import Trainer  # the trainer module imports this one
    t0 = time.perf_counter()
    failed_at, old, snaps, cfg = trainer.step, trainer.job, trainer.snapshots, trainer.cfg
    base = _revoke_all(trainer)
    watchdog.recorder.abandon()  # the ops the failure ended stay pending otherwise, and would time out
    survivors = base.shrink()
    every = survivors.all_gather_object((old.rank, snaps.holdings() if snaps is not None else {}))
    alive = sorted(r for r, _ in every)
    lost = sorted(set(range(old.size)) - set(alive))
    unit_of = snaps.unit_of if snaps is not None else list(range(old.size))
    whole = sorted({unit_of[r] for r in alive} - {unit_of[r] for r in lost})
    keep = [r for r in alive if unit_of[r] in whole]
    hosts = snaps.hosts if snaps is not None else [""] * old.size
    lost_nodes = sorted({hosts[r] for r in lost} - {hosts[r] for r in alive} - {""})
    coverage: dict[int, set[int]] = {}
    for _, holdings in every:
        for owner, steps in holdings.items():
            for s in steps:
                coverage.setdefault(s, set()).add(owner)
    complete = [s for s, owners in coverage.items() if owners >= set(range(old.size))]
    step = max(complete) if complete else None
    event = {"failed_at_step": failed_at, "lost_ranks": lost, "lost_nodes": lost_nodes, "rollback_to": step,
             "source": "partner snapshots in memory", "survivors": len(alive), "ranks_kept": len(keep)}
    if not whole:
        raise HpcparError(f"rank(s) {lost} lost at step {failed_at}: no data-parallel group survived whole "
                          "(tp x pp x cp ranks of one dp coordinate), so no smaller mesh can go on; requeue the "
                          "job to resume from the last checkpoint")
    new_cfg = _smaller(cfg, len(whole), cfg.mesh.dp)
    disk = directory.latest(cfg.checkpoint_dir) if step is None else None
    if step is None:
        event["source"] = f"checkpoint {disk}" if disk else "none: a fresh start"
    if survivors.rank == 0:
        _say(failed_at, lost, lost_nodes, len(alive), len(keep), step, new_cfg.mesh.dp, disk, coverage, old.size)
    held = snaps.held_at(step) if (snaps is not None and step is not None) else []
    meta = next((m for m in survivors.all_gather_object(held[0].meta if held else None) if m), {})
    stored = MemoryStored(held, survivors, meta, f"partner snapshots of step {step}")
    mine = survivors.subset(old.rank in keep, old.rank)
    new = None
    if mine is not None:
        new = Trainer(new_cfg, mine, tokens=tokens)
        if step is not None:
            new.load_checkpoint_state(stored)
    if step is not None:
        stored.finish()
    # Every survivor past the exchange before any leaves: a rank that exits with its last bytes still
    # on the wire would be a failure of the ranks receiving them.
    survivors.barrier()
    if new is not None and disk:
        new.load(disk)
    event["mesh"] = new.mesh_text() if new is not None else None
    event["recovery_s"] = time.perf_counter() - t0  # from the first error seen here to the state loaded
    event["recovered_unix"] = time.time()
    if new is None:
        log.info("rank %d: not part of the smaller mesh; leaving", old.rank)
    return new, event


def _revoke_all(trainer) -> Communicator:
    """Revoke every communicator of `trainer`'s run (every survivor waiting in one then stops) and
    return the job's base communicator (to shrink)."""
    base = Communicator(trainer.base_comm, "job")
    for comm in [*trainer.mesh.communicators(), trainer.job, base]:
        comm.revoke()
    return base


def _say(failed_at, lost, lost_nodes, alive, kept, step, dp, disk, coverage, world) -> None:
    """The survivors' one line on what was lost and where the run goes on from."""
    lost_text = f"rank(s) {lost}" + (f" (node(s) {', '.join(lost_nodes)})" if lost_nodes else "")
    if step is not None:
        log.warning("failure at step %d: %s lost; %d survivor(s) roll back to the partner snapshots of step %d and "
                    "go on as dp=%d on %d rank(s)", failed_at, lost_text, alive, step, dp, kept)
        return
    held = set().union(*coverage.values()) if coverage else set()
    log.warning("failure at step %d: %s lost, and with them every in-memory copy of rank(s) %s (a node and its "
                "partner node both lost); falling back to %s and going on as dp=%d on %d rank(s)", failed_at,
                lost_text, sorted(set(range(world)) - held) or lost,
                f"the checkpoint on disk {disk}" if disk else "a fresh start (no checkpoint on disk)", dp, kept)


def split_batch(share: int, largest: int) -> tuple[int, int]:
    """A dp rank's `share` of sequences as (micro_batch_size, microbatches): the largest divisor of
    `share` not above `largest`, and the rest (elastic resume and the smaller mesh alike)."""
    size = max(d for d in range(1, min(share, largest) + 1) if share % d == 0)
    return size, share // size


def _smaller(cfg: Config, dp: int, old_dp: int) -> Config:
    """`cfg` for `dp` data-parallel groups instead of `old_dp`, the global batch kept (micro-batches
    per group grown) and HSDP's shard size kept where it divides. Raises HpcparError (one line)
    when the batch does not split."""
    m, t = cfg.mesh, cfg.train
    batch = old_dp * t.micro_batch_size * t.microbatches
    if batch % dp:
        raise HpcparError(f"a failure left {dp} whole data-parallel group(s) of {old_dp}, and the global batch of "
                          f"{batch} sequences does not split over {dp}; requeue the job to resume from the last "
                          "checkpoint")
    size, count = split_batch(batch // dp, t.micro_batch_size)
    shard = old_dp // m.dp_replicate
    replicate = dp // shard if dp % shard == 0 else 1
    new = dataclasses.replace(cfg, mesh=dataclasses.replace(m, dp=dp, dp_replicate=replicate),
                              train=dataclasses.replace(t, micro_batch_size=size, microbatches=count),
                              run=dataclasses.replace(cfg.run, debug_fail_at=""))
    world = dp * m.tp * m.pp * m.cp
    return validate(new, world)


# -- the requeued run ---------------------------------------------------------------------------

def resume_from_node_local(trainer) -> bool:
    """With checkpoint.memory_dir: load the newest step whose snapshots, on the node-local disks of
    this job's nodes, cover every rank of the run that wrote them, when that is newer than the last
    checkpoint on disk (collective; every rank reaches the same verdict). Returns whether it did."""
    cfg, job = trainer.cfg, trainer.job
    if not cfg.checkpoint.memory_dir:
        return False
    folder = _snapshot_dir(cfg)
    node = job.split_by_node()
    found = []
    if node.rank == 0 and os.path.isdir(folder):
        found = [(int(m.group(1)), int(m.group(2)), int(m.group(3))) for m in map(_FILE.match, os.listdir(folder))
                 if m]
    every = job.all_gather_object(found)
    coverage: dict[tuple[int, int], set[int]] = {}
    for files in every:
        for world, owner, step in files:
            coverage.setdefault((world, step), set()).add(owner)
    complete = [(step, world) for (world, step), owners in coverage.items() if owners >= set(range(world))]
    disk = directory.latest(cfg.checkpoint_dir)
    disk_step = int(os.path.basename(disk).split("-")[-1]) if disk else -1
    if not complete or max(complete)[0] <= disk_step:
        return False
    step, world = max(complete)
    held = [Snapshot.unpack(np.fromfile(os.path.join(folder, f"snap-w{w}-o{o:05d}-s{s:09d}.bin"), dtype=np.uint8))
            for w, o, s in found if (s, w) == (step, world)]
    meta = next(m for m in job.all_gather_object(held[0].meta if held else None) if m)
    stored = MemoryStored(held, job, meta, f"node-local snapshots of step {step} in {folder}")
    trainer.load_checkpoint_state(stored)
    stored.finish()
    if job.rank == 0:
        log.info("resumed from the partner snapshots of step %d on the nodes' disks (%s), %s", step, folder,
                 f"{step - disk_step} step(s) after the last checkpoint {disk}" if disk else "no checkpoint on disk")
    return True


def forget_node_local(cfg: Config, job: Communicator) -> None:
    """A fresh start (checkpoint.resume = ""): remove this run directory's snapshots from every
    node's checkpoint.memory_dir, so that a later resume cannot take an earlier run's (collective)."""
    if not cfg.checkpoint.memory_dir:
        return
    folder = _snapshot_dir(cfg)
    if job.split_by_node().rank == 0 and os.path.isdir(folder):
        for name in os.listdir(folder):
            if _FILE.match(name) or ".tmp" in name:
                try:
                    os.remove(os.path.join(folder, name))
                except FileNotFoundError:
                    pass
    job.barrier()


def ulfm_note(cfg: Config) -> str | None:
    """A line for the start of a run with run.on_failure = "shrink" on an MPI without ULFM."""
    if cfg.run.on_failure != "shrink" or ulfm.has_ulfm():
        return None
    return ("run.on_failure=\"shrink\": this MPI has no ULFM (it needs Open MPI 5 with mpirun --with-ft ulfm), so a "
            "lost rank ends the job" + ("; a requeued run resumes from the node-local partner snapshots"
                                        if cfg.checkpoint.memory_dir else ""))
