"""Where a worker's step update is made: on this rank, or on the parameter servers.

A `Trainer` chooses one of two classes once, in its constructor, and asks it the same questions
where the two kinds of run differ: how a step ends after the backward (`finish_step`), what a
checkpoint gets from this rank and how it is read back (each is the `Checkpointable` part of the
model and optimizer state, hpcpar/state.py), and how the run ends.

- `LocalUpdate` (no parameter server): the optimizer state lives on this rank (the
  `DataParallel`'s optimizer; under ZeRO its shard). The world agrees on the step's figures in
  one collective (`Trainer._agree`), then every rank clips its gradients and steps.
- `ServerUpdate` (`ps.servers` = S): the servers, the job's last S ranks, hold the model's
  master copy and the optimizer state (hpcpar/parallel/ps). This worker pushes its gradients and
  pulls the updated parameters; the servers average, clip and step.

`StepResult` is what a step reports, either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcpar import backend
from hpcpar.config.sections import Config, TrainConfig
from hpcpar.optim.optimizers import lr_at
from hpcpar.parallel.dp.clipping import clip_gradients, counts_toward_norm
from hpcpar.parallel.dp.outer import OuterSync, check_resumable, replica_view, saved_by_replica
from hpcpar.parallel.ps.client import ParameterClient
from hpcpar.parallel.ps.ownership import FlatSpace
from hpcpar.parallel.ps.wire import FLAG_PREEMPT
from hpcpar.runtime import preemption
from hpcpar.runtime.agreement import agree
from hpcpar.runtime.comm import Communicator
from hpcpar.runtime.mesh import Mesh
from hpcpar.runtime.topology import Axis
from hpcpar.state import SavedState, StoredState, key_of
from hpcpar.training.report import server_summary


@dataclass
class StepResult:
    loss: float          # mean loss over the global batch
    grad_norm: float     # global gradient norm before clipping
    lr: float
    skipped: bool        # NaN/Inf loss or gradient: no update was made
    bad_parameter: str   # first parameter with a non-finite gradient ("" if none)
    overflow: bool = False   # fp16: skipped because the loss scale overflowed (the scaler backed off)
    loss_scale: float = 1.0  # the loss scale this step's backward used
    moe: dict = field(default_factory=dict)  # mixture of experts: the step's routing figures (`routing.figures`)
    stop: bool = False       # a preemption signal (on any rank) stops the run after this step
    staleness: int | None = None  # parameter server: the staleness of this replica's push (None without)
    traffic: dict = field(default_factory=dict)  # the step's bytes (`traffic_record`)


class LocalUpdate:
    """No parameter server: the world agrees, then this rank clips and steps its own optimizer.

    Args:
        train: the run's train section (learning-rate schedule, clipping).
        mesh: the workers' mesh (its world is the job).
        dp: this rank's `DataParallel` (or `ExpertDataParallel`), which owns the optimizer.
        scaler: the fp16 `LossScaler`, or None.
        agree: the step's agreement, `Trainer._agree`'s signature: (losses, norm items, bytes
            before) -> an agreement with `loss`, `norm`, `stop`, `moe` and `bytes(stepped)`.
    """

    def __init__(self, train: TrainConfig, mesh: Mesh, dp, scaler, agree: Callable[[list, list, tuple], Any],
                 outer: OuterSync | None = None):
        self.train, self.dp, self.scaler = train, dp, scaler
        self.agree = agree
        self.outer = outer
        self.replica_comm = mesh.comm(Axis.DP_REPLICATE)
        self.job = mesh.world        # every rank of the run: checkpoints
        self.step_comm = mesh.world  # the ranks that agree on a step's figures

    def finish_step(self, step: int, losses: list, before: tuple[float, float], scale: float) -> StepResult:
        """After the backward of `step`: the step's agreement, then clipping and the optimizer
        update (none when the loss or gradient norm is not finite; under fp16 a non-finite norm is
        an overflow that backs the `LossScaler` off). `losses`: this rank's micro-batch losses;
        `before`: the bytes sent at the start of the step; `scale`: the loss scale its backward used."""
        t = self.train
        items, buffers = self.dp.norm_parts()
        agreed = self.agree(losses, items, before)
        loss, norm = agreed.loss, agreed.norm / scale
        lr = lr_at(step, t.lr, t.warmup, t.steps, t.min_lr)
        # The norm is the world's agreed figure: a non-finite one on any rank is an overflow everywhere.
        finite = math.isfinite(loss) and math.isfinite(norm)
        overflow = False
        if self.scaler is not None:
            # An overflow the scale can still back off from is the scaler's business, not a bad step.
            overflow = math.isfinite(loss) and not finite and not self.scaler.at_minimum
            self.scaler.update(not finite)
        bad = "" if finite or overflow else first_bad_parameter(self.dp, self.step_comm)
        if finite:
            clip_gradients(buffers, norm, t.grad_clip, scale)
            self.dp.step(lr)
        traffic = traffic_record(*agreed.bytes(stepped=finite), compressed=self.dp.compressing)
        if self.outer is not None:  # the replicas' synchronisation, on its own wire (counted apart)
            sent = self.replica_comm.bytes_sent_total()
            self.outer.after_step(step)
            traffic["outer_bytes_sent"] = self.replica_comm.bytes_sent_total() - sent
        return StepResult(loss, norm, lr, not finite, bad, overflow=overflow, loss_scale=scale, moe=agreed.moe,
                          stop=agreed.stop, traffic=traffic)

    def bytes_pushed(self) -> float:
        """Bytes pushed to parameter servers: none."""
        return 0.0

    def checkpoint_state(self) -> SavedState:
        """The model and optimizer state, which this rank's gradient sync holds (whole, or under
        ZeRO its shards) with the compressor's state and the optimizer step; with train.sync =
        "local" / "diloco" each replica's (`outer.saved_by_replica`) and the outer state."""
        if self.outer is None:
            return self.dp.checkpoint_state()
        mine = saved_by_replica(self.dp.checkpoint_state(), self.replica_comm.rank, self.replica_comm.size)
        return SavedState.merged([mine, self.outer.checkpoint_state()])

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """The model and optimizer state (with train.sync = "local" / "diloco" this replica's, then
        the outer state); a checkpoint of diverged replicas is refused by a run that cannot take them."""
        if self.outer is None:
            check_resumable(stored, "step", 1, 1)
            self.dp.load_checkpoint_state(stored)
            return
        check_resumable(stored, self.outer.cfg.mode, self.replica_comm.size, self.outer.cfg.fragments)
        self.dp.load_checkpoint_state(replica_view(stored, self.replica_comm.rank, self.replica_comm.size))
        self.outer.load_checkpoint_state(stored)

    def agree_on(self, check: Callable[[], None]) -> None:
        """Run a check of the checkpoint that every worker makes alike (no server waits for it)."""
        check()

    def close(self) -> None:
        """The workers' last step is done: nothing to tell anyone, and no replicas' reduction
        (train.sync_delay) left running past the run, into buffers about to be freed."""
        if self.outer is not None:
            self.outer.complete_in_flight()

    def run_report(self, steps: int) -> dict:
        """The summary's entries of this kind of run: none."""
        return {}

    def free(self) -> None:
        """Nothing of its own to release; a replicas' reduction still in flight completes first."""
        self.close()


class ServerUpdate:
    """With parameter servers: push this rank's gradients, pull the parameters the servers stepped.

    Args:
        cfg: the run's configuration.
        comm: the mpi4py communicator of the whole job (workers first, servers last).
        workers_comm: the workers' mpi4py communicator (`Split` from `comm`), released by `free`.
        mesh: the workers' mesh over `workers_comm`.
        dp: this rank's `DataParallel`, whose buckets make the push's pieces (groups of one rank:
            a replica keeps its gradients to itself).
        named_parameters: (global name, Parameter) of this rank's stages.
        is_loss_reporter: whether this rank's micro-batch losses count (last stage, tp rank 0).
        bytes_sent: `Trainer._bytes_sent`: (bytes sent so far, of which for gradients).
        batches: `Trainer.microbatches`: a step's micro-batches on this rank, (x, y[, documents]);
            x holds the token ids whose wte rows the step looks up, which an untied wte's pull
            brings (train.sparse_embedding = "auto", `ParameterClient`'s sparse_rows).
    Collective with the servers' construction (the push routes are sent to them).
    """

    def __init__(self, cfg: Config, comm, workers_comm, mesh: Mesh, dp, named_parameters: list,
                 is_loss_reporter: bool, bytes_sent: Callable[[], tuple[float, float]],
                 batches: Callable[[int], list] | None = None):
        self.train, self.dp, self.named_parameters, self.batches = cfg.train, dp, named_parameters, batches
        self.is_loss_reporter, self.bytes_sent, self.workers_comm = is_loss_reporter, bytes_sent, workers_comm
        self.job = Communicator(comm, "workers+servers")  # every rank of the job: checkpoints, pushes
        self.workers = workers_comm.Get_size()
        # Under SSP and async the per-step figures stay within a replica (one dp coordinate's
        # ranks): they must not wait for other replicas running apart.
        apart = not (cfg.ps.mode == "bounded" and cfg.ps.staleness == 0)
        self.step_comm = mesh.comm((Axis.PP, Axis.TP)) if apart else mesh.world
        tp_rank = mesh.rank(Axis.TP)
        # A push goes in pieces, one per gradient bucket, each sent when its bucket is complete
        # in the last micro-batch's backward; the sequence-parallel parameters (summed over tp
        # in `finish_backward`, after their buckets) form a last group of their own.
        late = [p for _, p in named_parameters if getattr(p, "sequence_parallel", False) and mesh.size(Axis.TP) > 1]
        groups = [[p for p in b.params if all(p is not q for q in late)] for b in dp.buckets] + [late]
        self.client = ParameterClient(
            named_parameters, FlatSpace(_global_shapes(named_parameters, mesh.world)), self.job,
            list(range(self.workers, comm.Get_size())), mesh.rank(Axis.DP),
            owns=lambda p: counts_toward_norm(p, tp_rank),
            dtype=np.dtype(cfg.model.dtype), groups=groups, sparse_rows=cfg.train.sparse_embedding == "auto")
        dp.on_bucket_ready(lambda bucket: self.client.push_ready(bucket.index))

    def finish_step(self, step: int, losses: list, before: tuple[float, float], scale: float) -> StepResult:
        """After the backward of `step`: push the rest of this rank's gradients (a preemption
        signal rides on the push) and pull the parameters. `scale` is 1: the servers keep no loss scale."""
        t = self.train
        flags = FLAG_PREEMPT if preemption.requested() else 0
        reply = self.client.exchange(step, float(sum(losses)) if self.is_loss_reporter else 0.0, flags,
                                     want=self._tokens(step + 1))
        lr = lr_at(step, t.lr, t.warmup, t.steps, t.min_lr)
        bad = first_bad_parameter(self.dp, self.step_comm) if reply.skipped else ""
        return StepResult(reply.loss, reply.norm, lr, reply.skipped, bad, stop=reply.stop_at == step + 1,
                          staleness=reply.staleness, traffic=self._traffic_since(before))

    def _tokens(self, step: int):
        """The token ids this rank's micro-batches of `step` look up, int64, when it holds a row-sparse
        parameter and `step` is one of the run's (None otherwise: every row is pulled)."""
        if self.client.rows is None or self.batches is None or step >= self.train.steps:
            return None
        return np.concatenate([backend.to_host(b[0]).reshape(-1) for b in self.batches(step)]).astype(np.int64)

    def _traffic_since(self, before: tuple[float, float]) -> dict:
        """The step's bytes since `before` (`traffic_record`), averaged over the replica's ranks
        (`step_comm`) by one small all-gather there (the servers do the step's agreement)."""
        total, grad = (now - then for now, then in zip(self.bytes_sent(), before))
        plain = self.dp.uncompressed_bytes() if self.dp.compressing else grad
        mean = self.step_comm.all_gather(np.array([total, grad, plain], dtype=np.float64)).reshape(-1, 3).mean(axis=0)
        return traffic_record(*mean, compressed=self.dp.compressing)

    def bytes_pushed(self) -> float:
        """Bytes this rank has sent to the servers so far."""
        return self.job.bytes_sent_total()

    def checkpoint_state(self) -> SavedState:
        """No tensors: the servers hold the model and the optimizer state. The optimizer step for
        the metadata, from server 0 (collective with `ParameterServer.checkpoint_state`)."""
        return SavedState(meta={"optimizer_step": self.job.broadcast_object(None, root=self.workers)})

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """The weights (whatever `weights_only`), to start from the servers' values; the servers
        load the optimizer state."""
        params = self.named_parameters

        def take(arrays: dict) -> None:
            for name, p in params:
                p.data[...] = backend.to_device(arrays[f"model/{key_of(p, name)}"])
        stored.read({f"model/{key_of(p, name)}": p.layout for name, p in params}, take)

    def agree_on(self, check: Callable[[], None]) -> None:
        """Run a check of the checkpoint and raise its error on every rank of the job when it failed
        on any: the servers cannot check themselves and learn the verdict (`ServerRank.load`)."""
        agree(self.job, check)

    def close(self) -> None:
        """The workers' last step is done: tell the servers."""
        self.client.bye()

    def run_report(self, steps: int) -> dict:
        """The summary's "ps" entry over `steps` steps (collective with `ServerRank.train`'s report)."""
        return {"ps": server_summary(self.job.all_gather_object(None), steps)}

    def free(self) -> None:
        """Release the workers' communicator (collective over the workers)."""
        self.workers_comm.Free()


def traffic_record(sent: float, grad: float, plain: float, compressed: bool) -> dict:
    """A step's bytes, each the mean over ranks of what one rank sent in the step: `bytes_sent`
    (every collective and pipeline message), `grad_bytes_sent` (of which the gradient
    synchronisation, ZeRO's parameter all-gather included), what that synchronisation sends
    uncompressed (`grad_bytes_uncompressed`: `DataParallel.uncompressed_bytes`'s formula;
    during `compression_start_step`'s warm-up and without compression the same as sent), their
    ratio (`compression_ratio`) and whether the step was compressed (`grad_compressed`)."""
    return {"bytes_sent": float(sent), "grad_bytes_sent": float(grad), "grad_bytes_uncompressed": float(plain),
            "compression_ratio": float(grad / plain) if plain else 1.0, "grad_compressed": compressed}


def first_bad_parameter(dp, comm: Communicator) -> str:
    """Name of the first parameter (in model order) whose gradient is not finite, on any rank of
    `comm` (under ZeRO: in any rank's part); "(loss only)" when every gradient is finite."""
    bad = dp.nonfinite_gradients()
    local = bad[0] if bad else ""
    names = [n for n in comm.all_gather_object(local) if n]
    return names[0] if names else "(loss only)"


def _global_shapes(named_parameters: list, world: Communicator) -> dict[str, tuple]:
    """{global name: global shape} of every parameter of the model, gathered over the mesh."""
    mine = {n: tuple(p.layout.global_shape) for n, p in named_parameters if not p.tied_to}
    shapes: dict[str, tuple] = {}
    for part in world.all_gather_object(mine):
        shapes.update(part)
    return shapes
