"""Training: `Trainer` owns one rank's share of a run and its step loop; `main` is `hpcpar train`.

`Trainer` holds this rank's mesh coordinates, pipeline stages, data-parallel state and data.
`train_step(step)` runs one global step (data -> pipeline schedule -> gradient sync -> clip ->
optimizer); `train()` is the loop around it: step accounting, the skip policy for non-finite
steps, evaluation / log / checkpoint cadence, preemption, metrics JSON lines, the progress bar
and the run summary. Benchmarks and tests run the same loop with `train(steps=..., files=False,
on_step=...)`. `main` only sets up (logging, config, watchdog, run directory, rank table,
resume), calls `train()` and writes the summary and trace.

Every rank builds the same global batch for step s (samples 0 .. dp*mbs*m - 1, see data.py) and
takes its dp share, so results do not depend on the mesh.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

import hpcpar
from hpcpar import metrics
from hpcpar import backend
from hpcpar.backend import blas, threads
from hpcpar.checkpoint import checkpoint
from hpcpar.config import config
from hpcpar.data import corpus, formats, tokenizer
from hpcpar.runtime import preemption, watchdog
from hpcpar.runtime.comm import Communicator
from hpcpar.errors import ConfigError, HpcparError
from hpcpar.optim.loss_scale import LossScaler
from hpcpar.runtime.mesh import Axis, Mesh, resolve_degrees
from hpcpar.optim.optimizers import SGD, AdamW, grad_norm_sq, lr_at
from hpcpar.parallel.pp import pipeline, schedules
from hpcpar.parallel.dp.compression.compressors import Compression
from hpcpar.parallel.dp.clipping import clip_gradients, norm_from_parts, tp_replicated
from hpcpar.parallel.cp.attention import ContextParallel
from hpcpar.parallel.dp.data_parallel import DataParallel
from hpcpar.parallel.dp.experts import ExpertDataParallel
from hpcpar.parallel.ps.parameter_server import FLAG_PREEMPT, FlatSpace, ParameterClient, ParameterServer, sync_points
from hpcpar.autograd.tensor import no_grad

log = logging.getLogger("hpcpar")

# Exit status after a preemption signal: checkpoint saved, requeue me (EX_TEMPFAIL).
REQUEUE_STATUS = 75


@dataclass
class StepResult:
    loss: float          # mean loss over the global batch
    grad_norm: float     # global gradient norm before clipping
    lr: float
    skipped: bool        # NaN/Inf loss or gradient: no update was made
    bad_parameter: str   # first parameter with a non-finite gradient ("" if none)
    overflow: bool = False   # fp16: skipped because the loss scale overflowed (the scaler backed off)
    loss_scale: float = 1.0  # the loss scale this step's backward used
    moe: dict = field(default_factory=dict)  # mixture of experts: the step's routing figures (`Trainer._moe_figures`)
    stop: bool = False       # a preemption signal (on any rank) stops the run after this step
    staleness: int | None = None  # parameter server: the staleness of this replica's push (None without)
    traffic: dict = field(default_factory=dict)  # the step's bytes (`Trainer._traffic`)


@dataclass
class _Agreement:
    """What the step's one world collective settles (`Trainer._agree`), the same on every rank.

    A rank's row holds FIGURES values (its loss sum, its part of the squared gradient norm, its
    preemption flag, and its bytes: sent so far in the step, of which for gradient sync, that sync
    uncompressed, what the optimizer step will send), then its MoE routing table, if any."""

    FIGURES = 7

    loss: float        # the mean loss over the global batch: the reporters' sums added with fsum
    norm: float        # the global gradient norm, of the loss as scaled (`clipping.norm_from_parts`)
    stop: bool         # a preemption signal reached some rank (`preemption.requested`)
    means: Any         # [4] bytes, means over the ranks: sent, for gradients, uncompressed, by the optimizer step
    moe: dict          # the routing figures (`Trainer._moe_figures`); {} without experts
    compressing: bool  # the step's gradients were compressed (else "uncompressed" is what was sent)

    def bytes(self, stepped: bool) -> tuple[float, float, float]:
        """(bytes sent, for gradient sync, uncompressed) in the step, per rank: what was sent up to
        the agreement, plus, when the optimizer step was taken, what it sends (ZeRO's parameter
        all-gather, `DataParallel.step_bytes`; the uncompressed formula counts it already)."""
        sent, grad, plain, after = self.means
        after = after if stepped else 0.0
        return sent + after, grad + after, plain if self.compressing else grad + after


@dataclass
class RunResult:
    """What `Trainer.train` returns."""

    status: int      # process exit status: 0, or REQUEUE_STATUS when a preemption signal ended the run
    summary: dict    # summary.json's content (throughput from this rank's step times; rank 0 writes it)


@dataclass
class _RunState:
    """What the loop accumulates for the skip policy and the summary."""

    bad_in_a_row: int = 0                               # consecutive skipped steps
    step_times: list = field(default_factory=list)      # seconds of each completed (not skipped) step
    first_loss: float | None = None
    last_loss: float | None = None
    val_loss: float | None = None
    traffic: list = field(default_factory=list)         # each step's bytes (StepResult.traffic)
    moe: dict = field(default_factory=dict)             # the last step's routing figures (MoE models)


def build(cfg: config.Config, comm=None, tokens: np.ndarray | None = None,
          available_memory_bytes: int | None = None) -> "Trainer | ServerRank":
    """This rank's part of a run: a `Trainer`, or with `ps.servers = S` on the last S ranks of
    `comm` a `ServerRank` (same `train`, `save`, `load`). Collective; arguments as `Trainer`'s."""
    comm = comm if comm is not None else MPI.COMM_WORLD
    cfg = config.validate(cfg, comm.Get_size(), available_memory_bytes)
    if cfg.ps.servers and comm.Get_rank() >= comm.Get_size() - cfg.ps.servers:
        return ServerRank(cfg, comm)
    return Trainer(cfg, comm, tokens, available_memory_bytes)


class Trainer:
    """One rank's part of a training run on a (dp, tp, pp) mesh.

    Args:
        cfg: configuration (validated here for `comm`'s size).
        comm: mpi4py communicator spanning the run (default COMM_WORLD). With a parameter server
            (`ps.servers` = S, see `build`) the mesh is its first size - S ranks, and this rank
            pushes its gradients to the servers (`self.ps`) instead of averaging them over dp.
        tokens: the corpus as uint8 tokens (default: open `cfg.data`, see `datasets.load`).
        available_memory_bytes: memory per rank to check the model against (None: no check).
    """

    def __init__(self, cfg: config.Config, comm=None, tokens: np.ndarray | None = None,
                 available_memory_bytes: int | None = None):
        comm = comm if comm is not None else MPI.COMM_WORLD
        self.cfg = cfg = config.validate(cfg, comm.Get_size(), available_memory_bytes)
        if cfg.run.backend != "auto":  # auto: what HPCPAR_BACKEND chose at import (default numpy)
            backend.use(cfg.run.backend)
        servers = cfg.ps.servers
        workers = comm.Get_size() - servers
        if servers and comm.Get_rank() >= workers:
            raise ConfigError(f"rank {comm.Get_rank()} is a parameter server (ps.servers={servers}); build it "
                              "with hpcpar.training.trainer.build")
        mesh_comm = comm.Split(0, comm.Get_rank()) if servers else comm   # collective with ServerRank's
        self._workers_comm = mesh_comm if servers else None
        self.mesh = Mesh(dp=cfg.mesh.dp, tp=cfg.mesh.tp, pp=cfg.mesh.pp, comm=mesh_comm, cp=cfg.mesh.cp,
                         dp_replicate=cfg.mesh.dp_replicate, ep=cfg.mesh.ep)
        # Every rank of the job (workers and servers): checkpoints and parameter-server messages.
        self.job = Communicator(comm, "workers+servers") if servers else self.mesh.world
        self.slow_ranks, self.rank_in_job, self.workers = config.slow_ranks(cfg), comm.Get_rank(), workers
        backend.select_device(self.mesh.node_comm.rank)
        backend.reuse_freed_host_memory()  # activations are host arrays on the CPU, and staging buffers on GPUs
        self.tracer = pipeline.Tracer(enabled=cfg.pipeline.trace, rank=self.mesh.world.rank)
        # Context parallelism: this rank holds the tokens at `positions` of every sample (None: all).
        self.cp = ContextParallel(self.mesh.comm(Axis.CP), cfg.mesh.cp_impl, tracer=self.tracer)
        self.positions = self.cp.positions(cfg.model.block_size) if self.cp.size > 1 else None
        # Where the virtual stages live: the loop, or ZB-V's V (first and last stage on pp rank 0).
        self.placement = schedules.placement(cfg.pipeline.schedule, cfg.mesh.pp, cfg.pipeline.chunks)
        self.stages = pipeline.build_stages(cfg.model, self.mesh, chunks=cfg.pipeline.chunks,
                                            seed=cfg.train.seed,
                                            sequence_parallel=cfg.mesh.sequence_parallel, cp=self.cp,
                                            placement=self.placement, precision=cfg.train.precision)
        for stage in self.stages:
            stage.set_recompute(cfg.train.recompute, cfg.train.recompute_every)
        self.named_parameters = [(n, p) for s in self.stages for n, p in s.named_parameters()]
        t = cfg.train
        make_optimizer = _optimizer_factory(t)
        # ZeRO-3 gathers the model unit by unit: the embedding, each block, the head of every chunk.
        # Under ZB-V the first and the last virtual stage (wte and the head's copy) share a rank.
        n_virtual = self.placement.stages
        units = [(c, name, params) for c, s in enumerate(self.stages) for name, params in s.fsdp_units()]
        compression = Compression(t.grad_compression, ratio=t.compression_ratio, rank=t.powersgd_rank,
                                  start_step=t.compression_start_step, error_feedback=t.error_feedback,
                                  block_size=t.int8_block_size, seed=t.seed)
        # With experts: dense weights averaged over dp, experts over the expert-data-parallel group.
        # With servers a replica keeps its gradients to itself (groups of one rank): they are pushed.
        alone = {"groups": (Communicator.local(),) * 3} if servers else {}
        self.dp = (ExpertDataParallel if cfg.model.moe_experts else DataParallel)(
            self.named_parameters, self.mesh, bucket_mb=t.bucket_mb,
            compression=compression, zero=t.zero, make_optimizer=make_optimizer,
            units=units if t.zero == 3 else None, reshard_after_forward=t.reshard_after_forward,
            local_tied=self.placement.holder(0)[0] == self.placement.holder(n_virtual - 1)[0], **alone)
        # Under SSP and async the per-step figures stay within a replica (one dp coordinate's
        # ranks): they must not wait for other replicas running apart.
        apart = servers and not (cfg.ps.mode == "bounded" and cfg.ps.staleness == 0)
        self.step_comm = self.mesh.comm((Axis.PP, Axis.TP)) if apart else self.mesh.world
        self.ps = None
        if servers:
            tp_rank = self.mesh.rank(Axis.TP)
            # A push goes in pieces, one per gradient bucket, each sent when its bucket is complete
            # in the last micro-batch's backward; the sequence-parallel parameters (summed over tp
            # in `finish_backward`, after their buckets) form a last group of their own.
            late = [p for _, p in self.named_parameters if getattr(p, "sequence_parallel", False)
                    and self.mesh.size(Axis.TP) > 1]
            groups = [[p for p in b.params if all(p is not q for q in late)] for b in self.dp.buckets] + [late]
            self.ps = ParameterClient(
                self.named_parameters, FlatSpace(_global_shapes(self.named_parameters, self.mesh.world)), self.job,
                list(range(workers, comm.Get_size())), self.mesh.rank(Axis.DP),
                owns=lambda p: not p.tied_to and (tp_rank == 0 or not tp_replicated(p)),
                dtype=np.dtype(cfg.model.dtype), groups=groups)
            self.dp.on_bucket_ready(lambda bucket: self.ps.push_ready(bucket.index))
        for stage in self.stages:
            stage.unit_hooks = self.dp.unit_hooks
        every_rank = schedules.build(cfg.pipeline.schedule, cfg.mesh.pp, t.microbatches, cfg.pipeline.chunks)
        self.executor = pipeline.PipelineExecutor(self.stages, self.mesh, every_rank[self.mesh.rank(Axis.PP)],
                                                  microbatches=t.microbatches, tracer=self.tracer,
                                                  in_order_safe=schedules.in_order_safe(every_rank, self.placement),
                                                  placement=self.placement)
        self.dataset = (formats.load(cfg.data, cfg.model.vocab_size, self.mesh.world) if tokens is None
                        else formats.from_tokens(tokens, cfg.data.val_fraction))
        self.train_tokens, self.val_tokens = self.dataset.train, self.dataset.val
        self.is_loss_reporter = (self.stages[-1].head and self.mesh.rank(Axis.TP) == 0)
        self.tokens_per_step = self.mesh.size(Axis.DP) * t.micro_batch_size * t.microbatches * cfg.model.block_size
        self.step = 0  # the next step to run
        # fp16: the loss scaler (dynamic unless train.loss_scale > 0); None: the loss is not scaled.
        self.scaler = (LossScaler(t.loss_scale or t.initial_loss_scale, dynamic=t.loss_scale == 0,
                                  window=t.loss_scale_window, growth=t.loss_scale_growth,
                                  backoff=t.loss_scale_backoff, hysteresis=t.loss_scale_hysteresis,
                                  min_scale=t.min_loss_scale)
                       if t.precision == "fp16" else None)
        self.save_in_flight = None  # checkpoint.SaveHandle of an asynchronous save not yet committed

    def free(self) -> None:
        """Release the communicators this rank's part of the run created (collective)."""
        self.mesh.free()
        if self._workers_comm is not None:
            self._workers_comm.Free()

    def _mesh_text(self) -> str:
        """"dp=2 x tp=1 x pp=2" (with "cp=.. (ring)" after dp under context parallelism, the dp
        split under HSDP and the ZeRO stage when it is not 0)."""
        cp = f" x cp={self.mesh.size(Axis.CP)} ({self.cfg.mesh.cp_impl})" if self.mesh.size(Axis.CP) > 1 else ""
        replicate = self.mesh.size(Axis.DP_REPLICATE)
        hsdp = f" ({replicate} replicate x {self.mesh.size(Axis.DP_SHARD)} shard)" if replicate > 1 else ""
        zero = f", zero={self.cfg.train.zero}" if self.cfg.train.zero else ""
        ep = f", ep={self.mesh.size(Axis.EP)}" if self.cfg.model.moe_experts else ""
        return (f"dp={self.mesh.size(Axis.DP)}{hsdp}{cp} x tp={self.mesh.size(Axis.TP)} "
                f"x pp={self.mesh.size(Axis.PP)}{zero}{ep}{_ps_text(self.cfg)}")

    # -- data ------------------------------------------------------------------------------
    def sample_ids(self) -> list[range]:
        """Global sample ids of this dp rank's micro-batches, one range of micro_batch_size ids
        per micro-batch (see data.microbatch_sample_ids). The same ids serve every training step,
        its dropout masks and every evaluation batch: only the key (step or batch index) changes."""
        t = self.cfg.train
        dp, d = self.mesh.size(Axis.DP), self.mesh.rank(Axis.DP)
        return [corpus.microbatch_sample_ids(d, dp, t.micro_batch_size, j) for j in range(t.microbatches)]

    def microbatches(self, step: int) -> list:
        """This dp rank's micro-batches of global step `step`: (x, y), int64 [B, T] each; under
        context parallelism only this rank's tokens, [B, T/cp] (`self.positions`)."""
        t = self.cfg.train
        return [corpus.get_batch(self.train_tokens, t.seed, step, ids, self.cfg.model.block_size, self.positions)
                for ids in self.sample_ids()]

    def _global_mean_loss(self, losses: list, microbatches: int) -> float:
        """Mean loss over the global batch, the same float on every rank (one world all-reduce).

        `losses` are this rank's per-micro-batch losses (the executor returns them on the last
        stage's ranks, [] elsewhere; tp rank 0 reports them), `microbatches` how many each dp
        rank ran. Under context parallelism each cp rank's loss is the mean over its T/cp tokens
        of the micro-batch; every cp rank has as many, so their average is the whole mean.
        """
        local = np.array([float(sum(losses)) if self.is_loss_reporter else 0.0])
        total = self.mesh.world.all_reduce(local, op="sum")
        return float(total[0]) / (self.mesh.size(Axis.DP) * self.mesh.size(Axis.CP) * microbatches)

    # -- one step ----------------------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        """Run global step `step`: forward/backward of every micro-batch through the pipeline
        schedule, gradient sync over dp, the step's agreement (`_agree`: loss, gradient norm,
        preemption, bytes, one world collective), clipping and the optimizer update (none when
        the loss or gradient norm is not finite; under fp16 the loss is scaled by the
        `LossScaler`, and a non-finite norm is an overflow that backs the scale off). Collective.
        Afterwards `self.step` is `step + 1`: a skipped step's batch is passed over, not retried."""
        t = self.cfg.train
        before = self._bytes_sent()
        batches = self.microbatches(step)
        if self.cfg.model.dropout:  # masks are keyed by (seed, step, sample id), not by rank
            self.executor.rng_contexts = [(t.seed, step, list(ids)) for ids in self.sample_ids()]
        scale = self.scaler.scale if self.scaler is not None else 1.0
        self.executor.loss_scale = scale
        for stage in self.stages:  # aux losses get the main loss's gradient: the executor's scale / m
            for moe in stage.moe_layers():
                moe.loss_scale = scale / t.microbatches
        self.dp.begin_step(microbatches=t.microbatches, step=step)
        started = time.perf_counter()
        losses = self.executor.run(batches)
        if self._slowed(step):  # run.debug_slow_ranks: a straggler for study
            time.sleep((self.cfg.run.debug_slow_factor - 1) * (time.perf_counter() - started))
        self.dp.finish_backward()
        if self.ps is not None:
            result = self._exchange(step, losses)
            result.traffic = self._step_traffic(before)
            return result
        items, buffers = self.dp.norm_parts()
        agreed = self._agree(losses, items, before)
        loss, norm = agreed.loss, agreed.norm / scale
        lr = lr_at(step, t.lr, t.warmup, t.steps, t.min_lr)
        self.step = step + 1
        # The norm is the world's agreed figure: a non-finite one on any rank is an overflow everywhere.
        finite = math.isfinite(loss) and math.isfinite(norm)
        overflow = False
        if self.scaler is not None:
            # An overflow the scale can still back off from is the scaler's business, not a bad step.
            overflow = math.isfinite(loss) and not finite and not self.scaler.at_minimum
            self.scaler.update(not finite)
        bad = "" if finite or overflow else self._first_bad_parameter()
        if finite:
            clip_gradients(buffers, norm, t.grad_clip, scale)
            self.dp.step(lr)
        return StepResult(loss, norm, lr, not finite, bad, overflow=overflow, loss_scale=scale, moe=agreed.moe,
                          stop=agreed.stop, traffic=self._traffic(*agreed.bytes(stepped=finite)))

    def _agree(self, losses: list, norm_items: list, before: tuple[float, float]) -> "_Agreement":
        """Everything the world must agree on before the optimizer step, in one all-gather over
        the world (`_gather_step`) of a small float64 row per rank ([loss, norm², preemption flag,
        bytes ...] and the MoE routing table); every figure is then derived from the gathered rows
        in rank order, so every rank reaches bitwise the same verdict (`_Agreement`).

        `losses`: this rank's micro-batch losses (host floats, read once per step; [] off the last
        stage); `norm_items`: what this rank counts toward the gradient norm
        (`DataParallel.norm_parts`); `before`: `_bytes_sent()` at the start of the step."""
        total, grad = (now - then for now, then in zip(self._bytes_sent(), before))
        compressing = self.dp.compressing
        row = [float(sum(losses)) if self.is_loss_reporter else 0.0, grad_norm_sq(norm_items),
               float(preemption.requested()), total, grad, self.dp.uncompressed_bytes() if compressing else 0.0,
               self.dp.step_bytes()]
        table = self._moe_table() if self.cfg.model.moe_experts else None
        if table is not None:
            row += list(table.reshape(-1))
        every = self._gather_step(np.array(row, dtype=np.float64))
        n = _Agreement.FIGURES
        mesh = self.mesh
        return _Agreement(
            loss=math.fsum(every[:, 0]) / (mesh.size(Axis.DP) * mesh.size(Axis.CP) * self.cfg.train.microbatches),
            norm=norm_from_parts(every[:, 1]), stop=bool(every[:, 2].any()),
            means=every[:, 3:n].mean(axis=0), compressing=compressing,
            moe=self._moe_figures(every[:, n:].sum(axis=0).reshape(table.shape)) if table is not None else {})

    def _gather_step(self, row: np.ndarray) -> np.ndarray:
        """Every rank's `row` [k] as [world, k] in rank order: the step's one world collective."""
        return self.mesh.world.all_gather(row[None, :])

    def _slowed(self, step: int) -> bool:
        """Whether run.debug_slow_ranks slows this rank at `step` (a listed rank always; "random":
        the one worker rank drawn from (seed, step), the same draw on every rank)."""
        if self.cfg.run.debug_slow_factor == 1 or not self.slow_ranks:
            return False
        if self.slow_ranks == "random":
            draw = np.random.default_rng([self.cfg.train.seed, step, 0x510])
            return int(draw.integers(self.workers)) == self.rank_in_job
        return self.rank_in_job in self.slow_ranks

    def _exchange(self, step: int, losses: list) -> StepResult:
        """Parameter server: push this rank's gradients of `step`, pull the parameters (the
        servers average, clip and step). A preemption signal rides on the push."""
        t = self.cfg.train
        flags = FLAG_PREEMPT if preemption.requested() else 0
        local = float(sum(losses)) if self.is_loss_reporter else 0.0
        reply = self.ps.exchange(step, local, flags)
        self.step = step + 1
        lr = lr_at(step, t.lr, t.warmup, t.steps, t.min_lr)
        bad = self._first_bad_parameter() if reply.skipped else ""
        return StepResult(reply.loss, reply.norm, lr, reply.skipped, bad, stop=reply.stop_at == self.step,
                          staleness=reply.staleness)

    def _moe_table(self) -> np.ndarray:
        """This rank's routing figures of the step just run, per MoE layer [layers, E + 3]: tokens
        routed to each expert (before dropping), dropped assignments, assignments, aux (+ z) loss
        summed over its micro-batches; zeros on tp ranks other than 0 (tp ranks route identically)."""
        m = self.cfg.model
        layers = [i for i in range(m.n_layer) if m.is_moe(i)]
        table = np.zeros((len(layers), m.moe_experts + 3))
        for stage in self.stages:
            for moe in stage.moe_layers():
                row = table[layers.index(moe.index)]
                aux = backend.to_host(backend.xp.stack([a for _, _, _, a in moe.stats])) if moe.stats else []
                for (routed, dropped, assignments, _), loss in zip(moe.stats, aux):
                    row += np.concatenate([routed, [dropped, assignments, float(loss)]])
                moe.stats.clear()
        if self.mesh.rank(Axis.TP) != 0:
            table[...] = 0
        return table

    def _moe_figures(self, table: np.ndarray) -> dict:
        """The step's routing figures from the `_moe_table`s summed over the world: `moe_aux_loss`,
        the aux (+ z) losses of all MoE layers summed, mean over the global batch's micro-batches;
        `moe_load_imbalance`, max over mean tokens per expert (counted before dropping, over the
        global batch) of the worst MoE layer, `moe_layer_imbalance` the same per MoE layer;
        `moe_dropped_fraction`, the share of (token, expert) assignments dropped by the capacity limit."""
        m = self.cfg.model
        routed = table[:, :m.moe_experts]
        imbalance = routed.max(axis=1) / np.maximum(routed.mean(axis=1), 1e-300)
        batches = self.mesh.size(Axis.DP) * self.cfg.train.microbatches
        e = m.moe_experts
        return {"moe_aux_loss": float(table[:, e + 2].sum() / batches),
                "moe_load_imbalance": float(imbalance.max()),
                "moe_layer_imbalance": [float(v) for v in imbalance],
                "moe_dropped_fraction": float(table[:, e].sum() / max(table[:, e + 1].sum(), 1.0))}

    def _first_bad_parameter(self) -> str:
        """Name of the first parameter (in model order) whose gradient is not finite, on any rank
        (under ZeRO: in any rank's part)."""
        bad = self.dp.nonfinite_gradients()
        local = bad[0] if bad else ""
        names = [n for n in self.step_comm.all_gather_object(local) if n]
        return names[0] if names else "(loss only)"

    # -- evaluation ---------------------------------------------------------------------
    def evaluate(self, batches: int) -> float:
        """Mean validation loss over `batches` global batches (same float everywhere).

        Validation batch i holds the same sample ids as a training step's global batch
        (dp * micro_batch_size * microbatches), drawn from the validation stream, so the
        figure depends on the global batch, not on the mesh.
        """
        t = self.cfg.train
        eval_batches = [corpus.get_eval_batch(self.val_tokens, t.seed, i, ids, self.cfg.model.block_size,
                                            self.positions)
                        for i in range(batches) for ids in self.sample_ids()]
        return self._global_mean_loss(self.forward_losses(eval_batches), len(eval_batches))

    def forward_losses(self, batches: list) -> list:
        """Mean loss of each of this dp rank's micro-batches `batches` ((x, y) each, any number),
        forward only, in eval mode (collective). Returned on the loss-reporting ranks (the last
        stage's tp rank 0), [] elsewhere."""
        for stage in self.stages:
            stage.eval()
        try:
            with no_grad():
                return self.executor.run(batches, forward_only=True)
        finally:
            for stage in self.stages:
                stage.train()
            if self.dp.unit_hooks is not None:  # ZeRO-3: free a prefetched gather nobody used
                self.dp.unit_hooks.end_forward_only()

    # -- the loop -----------------------------------------------------------------------------
    def train(self, steps: int | None = None, *, files: bool = True, progress: bool | None = None,
              on_step: Callable[[dict], None] | None = None, peak_flops: float | None = None) -> RunResult:
        """Run steps from `self.step` on; collective. Returns the exit status and the run summary.

        Per step: `train_step`, the skip policy (a non-finite loss or gradient norm skips the
        update with a warning; `train.max_bad_steps` in a row raise HpcparError), evaluation every
        `run.eval_every` steps and after the last, a metrics record (a JSON line in
        <run.dir>/metrics.jsonl on rank 0), the progress bar or a log line every `run.log_every`
        steps, a checkpoint every `checkpoint.every` steps, and a check for a preemption signal
        on any rank (then save and stop with REQUEUE_STATUS). The run ends with a synchronous save.

        Args:
            steps: how many steps to run (default: up to `train.steps`, which alone sets the
                learning-rate schedule).
            files: write metrics.jsonl and checkpoints; False touches no file (benchmarks, tests).
            progress: draw the progress bar on rank 0 (default `run.progress`); without it rank 0
                logs every `run.log_every` steps.
            on_step: called on every rank with each step's record: the metrics line's fields plus
                `cpu_time_s`, this process's CPU time in `train_step`.
            peak_flops: the FLOP/s that MFU is relative to (default: the GEMM peak, measured here
                by one rank per node in about a second; 0 reports MFU 0).
        """
        cfg, t, run = self.cfg, self.cfg.train, self.cfg.run
        end = t.steps if steps is None else self.step + steps
        first = self.step
        rank0 = self.mesh.world.rank == 0
        model_flops = _model_flops_per_token(cfg)
        peak = _measure_peak(self.mesh, cfg.model.dtype) if peak_flops is None else peak_flops
        log.info("hpcpar %s: mesh %s on %d rank(s); %s; global batch %d tokens/step; "
                 "%.2fM non-embedding parameters; GEMM peak %.1f GFLOP/s",
                 hpcpar.__version__, self._mesh_text(), self.mesh.world.size, corpus.corpus_description(cfg.data.corpus),
                 self.tokens_per_step, self.cfg.model.non_embedding_params() / 1e6, peak / 1e9)
        draw = rank0 and (run.progress if progress is None else progress)
        writer = metrics.JsonLines(os.path.join(run.dir, "metrics.jsonl")) if files and rank0 else None
        bar = _Progress(draw, end, self.step)
        state = _RunState()
        status = 0
        gc_thresholds = gc.get_threshold()
        gc.set_threshold(max(gc_thresholds[0], _GC_YOUNG_THRESHOLD), *gc_thresholds[1:])
        try:
            while self.step < end:
                step = self.step
                start, cpu_start = time.perf_counter(), time.process_time()
                result = self.train_step(step)
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
                self._account(step, result, elapsed, state)
                tok_s = self.tokens_per_step / elapsed
                mfu = tok_s * model_flops / peak if peak else 0.0
                record = {"step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                          "tokens_per_s": tok_s, "mfu": mfu, "step_time_s": elapsed, "skipped": result.skipped,
                          **result.traffic, **result.moe}
                if self.scaler is not None:
                    record.update(loss_scale=result.loss_scale, overflow=result.overflow)
                if result.staleness is not None:
                    record["staleness"] = result.staleness
                if run.eval_every and (self.step % run.eval_every == 0 or self.step == end):
                    state.val_loss = record["val_loss"] = self.evaluate(run.eval_batches)
                if writer:
                    writer.write(record)
                if on_step:
                    on_step({**record, "cpu_time_s": cpu})
                scale = f" | scale {result.loss_scale:g}" if self.scaler is not None else ""
                extra = scale + _moe_text(result.moe)
                bar.update(f"loss {result.loss:.3f} | {tok_s:,.0f} tok/s | MFU {mfu:.1%}{extra}")
                if rank0 and not draw and (step % run.log_every == 0 or self.step == end):
                    log.info("step %5d | loss %.4f | lr %.2e | %8.0f tok/s | MFU %.1f%%%s%s", step, result.loss,
                             result.lr, tok_s, 100 * mfu,
                             f" | val {record['val_loss']:.4f}" if "val_loss" in record else "", extra)
                if files and cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < end:
                    self._checkpoint()
                if result.stop:  # every rank agreed: one of them says so
                    if rank0:
                        log.warning("preemption signal received: saving a checkpoint at step %d and exiting with "
                                    "status %d (requeue and resume with checkpoint.resume=auto)",
                                    self.step, REQUEUE_STATUS)
                    status = REQUEUE_STATUS
                    break
        finally:
            gc.set_threshold(*gc_thresholds)
            bar.close()
            if writer:
                writer.close()
        if self.ps is not None:
            self.ps.bye()
        if files:
            self._checkpoint(final=True)
        summary = self._summary(state, model_flops, peak)
        if self.ps is not None:
            summary["ps"] = _server_report(self.job.all_gather_object(None), self.step - first)
        return RunResult(status, summary)

    def _bytes_sent(self) -> tuple[float, float]:
        """(bytes this rank has sent over all its communicators, of which for gradient sync) so far."""
        pushed = self.job.bytes_sent_total() if self.ps is not None else 0.0   # pushes to the servers
        return (sum(c.bytes_sent_total() for c in self.mesh.communicators()) + pushed, self.dp.sync_bytes() + pushed)

    def _traffic(self, sent: float, grad: float, plain: float) -> dict:
        """A step's bytes, each the mean over ranks of what one rank sent in the step: `bytes_sent`
        (every collective and pipeline message), `grad_bytes_sent` (of which the gradient
        synchronisation, ZeRO's parameter all-gather included), what that synchronisation sends
        uncompressed (`grad_bytes_uncompressed`: `DataParallel.uncompressed_bytes`'s formula;
        during `compression_start_step`'s warm-up and without compression the same as sent), their
        ratio (`compression_ratio`) and whether the step was compressed (`grad_compressed`)."""
        return {"bytes_sent": float(sent), "grad_bytes_sent": float(grad), "grad_bytes_uncompressed": float(plain),
                "compression_ratio": float(grad / plain) if plain else 1.0, "grad_compressed": self.dp.compressing}

    def _step_traffic(self, before: tuple[float, float]) -> dict:
        """Parameter server: the step's bytes since `before` (`_traffic`), averaged over the replica's
        ranks (`step_comm`) by one small all-gather there (the servers do the step's agreement)."""
        total, grad = (now - then for now, then in zip(self._bytes_sent(), before))
        plain = self.dp.uncompressed_bytes() if self.dp.compressing else grad
        mean = self.step_comm.all_gather(np.array([total, grad, plain], dtype=np.float64)).reshape(-1, 3).mean(axis=0)
        return self._traffic(*mean)

    def _account(self, step: int, result: StepResult, elapsed: float, state: _RunState) -> None:
        """The skip policy and the summary's figures: a skipped step is warned about (naming the
        first bad parameter) and counted; `train.max_bad_steps` in a row raise HpcparError."""
        if result.traffic:
            state.traffic.append(result.traffic)
        if result.moe:
            state.moe = result.moe
        if result.overflow:
            log.info("step %d: fp16 gradients overflowed at loss scale %g; step skipped, scale now %g",
                     step, result.loss_scale, self.scaler.scale)
            return
        if not result.skipped:
            state.bad_in_a_row = 0
            state.step_times.append(elapsed)
            state.first_loss = result.loss if state.first_loss is None else state.first_loss
            state.last_loss = result.loss
            return
        state.bad_in_a_row += 1
        limit = self.cfg.train.max_bad_steps
        log.warning("step %d: non-finite %s (first bad parameter gradient: %s); step skipped (%d/%d)",
                    step, "loss" if not math.isfinite(result.loss) else "gradient norm",
                    result.bad_parameter, state.bad_in_a_row, limit)
        if state.bad_in_a_row >= limit:
            raise HpcparError(f"{state.bad_in_a_row} consecutive steps with a non-finite loss or gradient "
                              f"(last: step {step}, first bad parameter: {result.bad_parameter}); "
                              "lower train.lr, raise train.warmup or check the data")

    def _checkpoint(self, final: bool = False) -> None:
        """Checkpoint now into the configured directory. With checkpoint.async_save the rank files
        are written in the background while training goes on, and committed at the next save; the
        `final` save (end of the run, preemption) is synchronous, so the job never exits with a
        save in flight."""
        previous = self.finish_save()
        if previous:
            log.info("checkpoint: %s", previous)
        c = self.cfg.checkpoint
        result = self.save(self.cfg.checkpoint_dir, keep=c.keep, async_save=c.async_save and not final)
        if isinstance(result, str):
            log.info("checkpoint: %s", result)

    def _summary(self, state: _RunState, model_flops: float, peak: float) -> dict:
        """summary.json's content (collective: gathers every rank's peak memory). Throughput
        leaves out the first completed step (allocations, connections) when there are others."""
        cfg, mesh = self.cfg, self.mesh
        steady = state.step_times[1:] if len(state.step_times) > 1 else state.step_times
        tok_s = self.tokens_per_step * len(steady) / sum(steady) if steady else 0.0
        # Predicted with forward = B = W (a whole backward twice a forward).
        sim = schedules.simulate(schedules.build(cfg.pipeline.schedule, mesh.size(Axis.PP), cfg.train.microbatches,
                                               cfg.pipeline.chunks), t_forward=1.0, t_backward=1.0, t_weight=1.0,
                                placement=self.placement)
        peak_rss = mesh.world.all_gather_object(metrics.peak_rss_bytes())
        estimate = config.estimate_memory(cfg, mesh.size(Axis.DP), mesh.size(Axis.TP), mesh.size(Axis.PP),
                                          mesh.size(Axis.CP))
        return {
            "steps": self.step, "tokens_per_s": tok_s, "mfu": tok_s * model_flops / peak if peak else 0.0,
            "gemm_peak_flops": peak, "first_loss": state.first_loss, "final_loss": state.last_loss,
            "val_loss": state.val_loss, "mesh": {str(a): mesh.size(a) for a in (Axis.DP, Axis.TP, Axis.PP, Axis.CP)},
            "cp_impl": cfg.mesh.cp_impl, "zero": cfg.train.zero, "dp_replicate": mesh.size(Axis.DP_REPLICATE),
            "schedule": cfg.pipeline.schedule, "microbatches": cfg.train.microbatches,
            "pipeline_bubble_predicted": sim.bubble,
            "pipeline_bubble_measured": self.executor.measured_bubble(),
            "grad_compression": cfg.train.grad_compression, **self._traffic_summary(state),
            "precision": cfg.train.precision, "activation_dtype": self.stages[0].activation_dtype,
            "loss_scale": self.scaler.scale if self.scaler is not None else None,
            "overflow_steps": self.scaler.overflows if self.scaler is not None else 0,
            "peak_memory_bytes_per_rank": peak_rss, "estimated_memory_bytes_per_rank": estimate,
            "run_dir": cfg.run.dir, "ep": mesh.size(Axis.EP), **state.moe,
        }

    @staticmethod
    def _traffic_summary(state: _RunState) -> dict:
        """Bytes per step (means over ranks and over the steps after the compression warm-up, or
        over all steps when every one was a warm-up step) and the compression ratio."""
        steps = [t for t in state.traffic if t["grad_compressed"]] or state.traffic
        if not steps:
            return {"bytes_sent_per_step": None, "grad_bytes_sent_per_step": None,
                    "grad_bytes_uncompressed_per_step": None, "compression_ratio": None}
        mean = {k: sum(t[k] for t in steps) / len(steps) for k in ("bytes_sent", "grad_bytes_sent",
                                                                   "grad_bytes_uncompressed")}
        return {"bytes_sent_per_step": mean["bytes_sent"], "grad_bytes_sent_per_step": mean["grad_bytes_sent"],
                "grad_bytes_uncompressed_per_step": mean["grad_bytes_uncompressed"],
                "compression_ratio": (mean["grad_bytes_sent"] / mean["grad_bytes_uncompressed"]
                                      if mean["grad_bytes_uncompressed"] else 1.0)}

    # -- global views (tests, checkpoints) -------------------------------------------------
    def _owns_blocks(self, p) -> bool:
        """Whether this rank contributes `p`'s blocks to a global sum: one holder per element (an
        expert's: edp rank 0 of its ep rank, tp rank 0)."""
        if p.expert:
            return self.mesh.rank(Axis.EDP) == 0 and self.mesh.rank(Axis.TP) == 0
        if p.tied_to or self.mesh.rank(Axis.DP) != 0 or self.mesh.rank(Axis.CP) != 0:
            return False
        return p.layout.split_dim is not None or self.mesh.rank(Axis.TP) == 0

    def global_parameters(self) -> dict:
        """Every global parameter, full, on every rank (host float arrays). Collective."""
        return self._global_tensors(self.dp.full_parameters(), {n: p for n, p in self.named_parameters})

    def _global_tensors(self, arrays: dict, params: dict) -> dict:
        world = self.mesh.world
        mine = {n: (tuple(p.layout.global_shape), str(p.dtype)) for n, p in params.items() if not p.tied_to}
        catalogue = {}
        for part in world.all_gather_object(mine):
            catalogue.update(part)
        out = {}
        for name in sorted(catalogue):
            shape, dtype = catalogue[name]
            full = np.zeros(shape, dtype=dtype)
            p = params.get(name)
            if p is not None and self._owns_blocks(p) and arrays[name] is not None:
                p.layout.put(backend.to_host(arrays[name]), full)
            out[name] = world.all_reduce(full, op="sum")
        return out

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint_tensors(self) -> dict:
        """Global name -> (local array, layout) for the model and optimizer state (under ZeRO each
        rank gives its shards of both, flat ranges of the parameters, nothing gathered) and the
        gradient compressor's state (`compress/...`: residuals, PowerSGD's Q)."""
        tensors = self.dp.compression_tensors()
        if self.ps is not None:   # the servers hold the model and the optimizer state
            return tensors
        if self.cfg.train.zero:
            return {**self.dp.checkpoint_shards(), **tensors}
        # The optimizer's live arrays, not optimizer_state()'s copies: checkpoint.save copies (or
        # moves to the host) only the blocks this rank writes, and a dp replica writes none.
        state = {n: part.optimizer.state_of(p) for part in getattr(self.dp, "parts", (self.dp,))
                 for n, p in zip(part.names, part.params)}
        for name, p in self.named_parameters:
            key = p.tied_to or name
            tensors[f"model/{key}"] = (p.data, p.layout)
            for state_name, array in state.get(name, {}).items():
                tensors[f"optim/{key}/{state_name}"] = (array, p.layout)
        return tensors

    def save(self, directory: str, keep: int, async_save: bool = False):
        """Checkpoint the model, optimizer state and run position (collective).

        A save still in flight is committed first. Returns the committed `step-NNNNNNN` path,
        or with `async_save` a `checkpoint.SaveHandle` (also kept in `save_in_flight`): the
        rank files are written in a background thread and `finish_save()` commits them.
        Everything else that shapes the trajectory is a pure function of (seed, step): batch
        sampling and dropout masks are keyed by (seed, step, sample id) and the learning rate
        by step, so `step` is the data, RNG and schedule position.
        """
        self.finish_save()
        t = self.cfg.train
        steps_taken = (self.job.broadcast_object(None, root=self.mesh.world.size) if self.ps is not None
                       else self.dp.optimizer_step_count())   # parameter server: server 0's optimizer
        meta = {"step": self.step, "optimizer_step": steps_taken,
                "config": config.to_toml(self.cfg), "hpcpar_version": hpcpar.__version__,
                "mesh": {**{str(a): self.mesh.size(a) for a in (Axis.DP, Axis.TP, Axis.PP, Axis.CP)}, "zero": t.zero,
                         "dp_replicate": self.mesh.size(Axis.DP_REPLICATE)},
                "data_position": {"next_step": self.step, "seed": t.seed},
                "rng": {"kind": "counter-based: (seed, step, sample id)", "seed": t.seed, "next_step": self.step},
                "lr_schedule": {"next_step": self.step, "warmup": t.warmup, "total": t.steps},
                "tokenizer": self.dataset.tokenizer}
        if self.scaler is not None:
            meta["loss_scale"] = self.scaler.state_dict()
        tensors = self.checkpoint_tensors()
        compression = self.dp.compression_meta()
        if compression is not None:  # what a loader needs to map the compressor state back
            names = self.mesh.world.all_gather_object(sorted(n for n in tensors if n.startswith("compress/")))
            meta["compression"] = {**compression, "names": sorted(set().union(*names))}
        result = checkpoint.save(directory, self.step, tensors, meta, self.job, keep=keep, async_save=async_save,
                                 storage=self.cfg.checkpoint.format)
        self.save_in_flight = result if async_save else None
        return result

    def finish_save(self) -> str | None:
        """Commit the asynchronous save in flight, if any (collective); returns its path."""
        handle, self.save_in_flight = self.save_in_flight, None
        return handle.wait() if handle is not None else None

    def load(self, path: str, weights_only: bool = False) -> dict:
        """Load model and optimizer state from any layout's checkpoint; returns its meta.

        With `weights_only` (or from a checkpoint that holds only weights, e.g. `hpcpar ckpt
        import`'s) only the parameters are loaded: the optimizer starts fresh and `step` is kept.
        A checkpoint whose tokenizer differs from the data's is refused (one line). Gradient
        compressor state (residuals, PowerSGD's Q) is loaded when this run compresses and the
        checkpoint has it (see parallel/compression_state.py); otherwise it starts afresh / is
        ignored, so a checkpoint loads with and without compression."""
        _, meta = checkpoint.load(path, {}, self.job)

        def check():
            tokenizer.require_match(meta.get("tokenizer"), self.dataset.tokenizer, f"checkpoint {path}",
                                    f"data {self.cfg.data.corpus or '(default corpus)'}")
        if self.ps is not None:
            _agreed(self.job, check)   # the servers learn the verdict too
        else:
            check()
        weights_only = weights_only or bool(meta.get("weights_only"))
        wanted = {}

        def key_of(p, name):
            return p.tied_to or name
        if self.cfg.train.zero:  # this rank's shards (ZeRO 1/2: whole parameters, sharded state)
            wanted = self.dp.checkpoint_wanted(key_of, weights_only=weights_only)
        elif self.ps is not None:  # the weights; the servers load the optimizer state
            wanted = {f"model/{key_of(p, name)}": p.layout for name, p in self.named_parameters}
        else:
            for name, p in self.named_parameters:
                key = key_of(p, name)
                wanted[f"model/{key}"] = p.layout
                if not weights_only:
                    wanted.update({f"optim/{key}/{state}": p.layout for state in self.dp.state_names()})
        stored = meta.get("compression")
        if not weights_only:
            wanted.update(self.dp.compression_wanted(stored))
        all_names = set().union(*self.job.all_gather_object(set(wanted)))  # every stage's (and server's) tensors
        if not weights_only and stored:
            all_names |= set(stored["names"])  # loaded or not, they belong to the checkpoint
        arrays, meta = checkpoint.load(path, wanted, self.job, all_names=all_names,
                                       only_prefix="model/" if weights_only else "")
        if not weights_only:
            self.dp.load_compression(arrays, stored)
            if self.scaler is not None and "loss_scale" in meta:  # else: a fresh scaler (a run without fp16)
                self.scaler.load_state_dict(meta["loss_scale"])
        if self.cfg.train.zero:
            self.dp.load_checkpoint(arrays, key_of, None if weights_only else int(meta["optimizer_step"]),
                                    weights_only=weights_only)
            if not weights_only:
                self.step = int(meta["step"])
            return meta
        if weights_only or self.ps is not None:
            for name, p in self.named_parameters:
                p.data[...] = backend.to_device(arrays[f"model/{p.tied_to or name}"])
            if self.ps is not None and not weights_only:
                self.step = int(meta["step"])
            return meta
        state: dict = {}
        for name, p in self.named_parameters:
            key = p.tied_to or name
            p.data[...] = backend.to_device(arrays[f"model/{key}"])
            prefix = f"optim/{key}/"
            state[name] = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
        self.dp.load_optimizer_state(state, int(meta["optimizer_step"]))
        self.step = int(meta["step"])
        return meta


class ServerRank:
    """A parameter server's rank of a run (`ps.servers`; see hpcpar/parallel/ps/parameter_server.py):
    its range of the model and optimizer state, and the same `train`, `save`, `load` and `step` as
    a `Trainer`, so that the job's code treats every rank alike. Build it with `build`."""

    def __init__(self, cfg: config.Config, comm):
        self.cfg = cfg
        t, rank = cfg.train, comm.Get_rank()
        workers = comm.Get_size() - cfg.ps.servers
        self.server_comm = Communicator(comm.Split(1, rank), "servers")  # collective with the workers' Split
        self.job = Communicator(comm, "workers+servers")
        # The model as one process builds it (decision 5: the same values as any layout's slices).
        alone = Mesh(comm=MPI.COMM_SELF)
        stages = pipeline.build_stages(cfg.model, alone, chunks=1, seed=t.seed)
        init = {n: (backend.to_host(p.data), p.no_decay) for s in stages for n, p in s.named_parameters()
                if not p.tied_to}
        del stages
        alone.free()
        self.server = ParameterServer(init, self.job, self.server_comm, workers, _optimizer_factory(t),
                                      cfg.ps.mode, cfg.ps.staleness,
                                      lambda step: lr_at(step, t.lr, t.warmup, t.steps, t.min_lr), t.grad_clip,
                                      t.microbatches, cfg.ps.stale_weight)
        self.step = 0
        self.save_in_flight = None

    def free(self) -> None:
        """Release the servers' communicator (collective with the other servers)."""
        self.server_comm.free()

    def train(self, steps: int | None = None, *, files: bool = True, progress: bool | None = None,
              on_step: Callable[[dict], None] | None = None, peak_flops: float | None = None) -> RunResult:
        """Serve the workers' steps from `self.step` (collective with their `Trainer.train`, same arguments)."""
        c, first = self.cfg, self.step
        end = c.train.steps if steps is None else self.step + steps
        every = c.checkpoint.every if files else 0

        def at_point(step: int) -> None:
            self.step = step
            if every and step % every == 0:
                self._checkpoint()
        self.step, stopped = self.server.serve(first, end, sync_points(first, end, every, c.run.eval_every), at_point)
        if files:
            self._checkpoint(final=True)
        self.job.all_gather_object(self.server.report(self.step - first))
        return RunResult(REQUEUE_STATUS if stopped else 0, {})

    def _checkpoint(self, final: bool = False) -> None:
        self.finish_save()
        ck = self.cfg.checkpoint
        self.save(self.cfg.checkpoint_dir, keep=ck.keep, async_save=ck.async_save and not final)

    def save(self, directory: str, keep: int, async_save: bool = False):
        """This server's part of a checkpoint (collective with the workers' `Trainer.save`)."""
        self.finish_save()
        self.job.broadcast_object(self.server.optimizer.step_count, root=self.job.size - self.cfg.ps.servers)
        result = checkpoint.save(directory, self.step, self.server.checkpoint_tensors(), {"step": self.step},
                                 self.job, keep=keep, async_save=async_save, storage=self.cfg.checkpoint.format)
        self.save_in_flight = result if async_save else None
        return result

    finish_save = Trainer.finish_save   # the same rule: commit the asynchronous save in flight

    def load(self, path: str, weights_only: bool = False) -> dict:
        """This server's range of a checkpoint of any layout (collective with `Trainer.load`)."""
        _, meta = checkpoint.load(path, {}, self.job)
        _agreed(self.job, None)
        weights_only = weights_only or bool(meta.get("weights_only"))
        wanted = self.server.checkpoint_wanted(weights_only)
        all_names = set().union(*self.job.all_gather_object(set(wanted)))
        stored = meta.get("compression")
        if not weights_only and stored:
            all_names |= set(stored["names"])
        arrays, meta = checkpoint.load(path, wanted, self.job, all_names=all_names,
                                       only_prefix="model/" if weights_only else "")
        self.server.load_checkpoint(arrays, None if weights_only else int(meta["optimizer_step"]))
        if not weights_only:
            self.step = int(meta["step"])
        return meta


def _optimizer_factory(t: config.TrainConfig) -> Callable[[list], Any]:
    """train.optimizer's constructor over a list of objects with `.data`, `.grad`, `.no_decay`."""
    if t.optimizer == "adamw":
        return lambda params: AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                    weight_decay=t.weight_decay)
    return lambda params: SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)


def _global_shapes(named_parameters: list, world: Communicator) -> dict[str, tuple]:
    """{global name: global shape} of every parameter of the model, gathered over the mesh."""
    mine = {n: tuple(p.layout.global_shape) for n, p in named_parameters if not p.tied_to}
    shapes: dict[str, tuple] = {}
    for part in world.all_gather_object(mine):
        shapes.update(part)
    return shapes


def _agreed(job: Communicator, check: Callable[[], None] | None) -> None:
    """Run `check` (None: nothing to check on this rank) and raise its error on every rank of
    `job` when it failed on any: ranks that cannot check themselves (parameter servers) learn the verdict."""
    error = None
    if check is not None:
        try:
            check()
        except HpcparError as err:
            error = err
    errors = [e for e in job.all_gather_object(error) if e is not None]
    if errors:
        raise errors[0]


def _server_report(reports: list, steps: int) -> dict:
    """The summary's "ps" entry from every rank's report (workers give None): per server its range,
    bytes in and out per step, and the staleness and lateness (SSP, async) of every applied push, summarised."""
    servers = [r for r in reports if r is not None]
    stale = [s for r in servers[:1] for s in r["staleness"]]   # server 0 saw every push
    late = [s for r in servers[:1] for s in r["late"]]
    per_step = max(steps, 1)
    hist: dict[str, int] = {}
    for s in stale:
        hist[str(s)] = hist.get(str(s), 0) + 1
    return {"servers": [{"rank": r["rank"], "range": r["range"], "bytes_in_per_step": r["bytes_in"] / per_step,
                         "bytes_out_per_step": r["bytes_out"] / per_step} for r in servers],
            "staleness_max": max(stale, default=0), "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
            "staleness_histogram": hist, "pushes_applied": len(stale),
            "pushes_late": sum(1 for s in late if s > 0), "late_max": max(late, default=0)}


# ----------------------------------------------------------------------------------------
# hpcpar train
# ----------------------------------------------------------------------------------------
def main(config_path: str | None, overrides: list) -> int:
    """`hpcpar train`: set up, run `Trainer.train`, write the summary; returns the process exit
    status (0, or REQUEUE_STATUS after preemption)."""
    world = MPI.COMM_WORLD
    _setup_logging(world.rank)
    cfg = elastic_batch(config.load_config(config_path, overrides), world.Get_size(),
                        config.given_keys(config_path, overrides))
    trainer = build(cfg, world, available_memory_bytes=_agreed_memory_per_rank(world))
    cfg, job = trainer.cfg, trainer.job  # cfg: validated, mesh resolved; job: every rank
    if job.rank == 0:
        for doubt in config.doubts(cfg):
            log.warning("%s", doubt)
    watchdog.set_timeout(cfg.run.timeout)
    watchdog.set_check_every(cfg.run.debug_check_every)
    preemption.install()
    _prepare_run_dir(cfg, job)
    _log_ranks(cfg, job)
    _resume(trainer)
    if trainer.step >= cfg.train.steps:  # every rank loaded the same step: they all stop here
        if job.rank == 0:
            log.warning("the checkpoint is at step %d and train.steps=%d: nothing to train, no checkpoint or "
                        "summary written (raise train.steps to train on)", trainer.step, cfg.train.steps)
        return 0
    result = trainer.train()
    if cfg.pipeline.trace and isinstance(trainer, Trainer):   # the workers' pipeline timeline
        trainer.tracer.write_chrome_trace(os.path.join(cfg.run.dir, "trace.json"), trainer.mesh.world)
    if job.rank == 0:
        with open(os.path.join(cfg.run.dir, "summary.json"), "w") as f:
            json.dump(result.summary, f, indent=2, sort_keys=True)
        log.info("%s", _format_summary(result.summary))
        marker = os.environ.get("HPCPAR_REQUEUE_MARKER")
        if marker and result.status == REQUEUE_STATUS:
            # The job scripts' fallback for a launcher that loses the ranks' status (templates/).
            with open(marker, "w") as f:
                f.write(f"{REQUEUE_STATUS}\n")
    return result.status


def elastic_batch(cfg: config.Config, world_size: int, given: set[str]) -> config.Config:
    """Elastic resume: a job resumed on another number of ranks keeps the checkpoint's global batch.

    When `checkpoint.resume` finds a checkpoint, every mesh degree is auto (0) and neither
    train.micro_batch_size nor train.microbatches was given, the batch keys are derived from the
    checkpoint's global batch G = dp * micro_batch_size * microbatches and the dp this world
    resolves to: micro_batch_size the largest divisor of G / dp not above the saved one, and
    microbatches the rest. Samples are drawn by (seed, step, global sample id) (data.py), so
    the run goes on with the same samples in every step, and its losses are the uninterrupted
    run's up to the order of the sums. Anything else: `cfg` unchanged.
    """
    m, t = cfg.mesh, cfg.train
    if not cfg.checkpoint.resume or any((m.dp, m.tp, m.pp, m.cp)) or \
            given & {"train.micro_batch_size", "train.microbatches"}:
        return cfg
    path = checkpoint.latest(cfg.checkpoint_dir) if cfg.checkpoint.resume == "auto" else cfg.checkpoint.resume
    if not path or not os.path.isdir(path):
        return cfg
    _, meta = checkpoint.load(path, {}, Communicator.local())
    saved = config.loads(meta["config"], origin=f"config stored in {path}")
    batch = saved.mesh.dp * saved.train.micro_batch_size * saved.train.microbatches
    dp = resolve_degrees(world_size - cfg.ps.servers, m.dp, m.tp, m.pp, m.cp)[0]
    if dp * t.micro_batch_size * t.microbatches == batch:
        return cfg
    if batch % dp:
        raise ConfigError(f"elastic resume: the checkpoint's global batch of {batch} sequences does not split over "
                          f"dp={dp} ({world_size} ranks, mesh auto); resume on a number of ranks whose dp divides "
                          f"{batch}, or set mesh degrees and train.micro_batch_size/microbatches yourself")
    share = batch // dp
    size = max(d for d in range(1, min(share, saved.train.micro_batch_size) + 1) if share % d == 0)
    log.info("elastic resume: %d ranks (dp=%d) keep the checkpoint's global batch of %d sequences as "
             "micro_batch_size=%d x microbatches=%d", world_size, dp, batch, size, share // size)
    return dataclasses.replace(cfg, train=dataclasses.replace(t, micro_batch_size=size, microbatches=share // size))


def _setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s" if rank == 0 else f"[rank {rank}] %(message)s")


def _agreed_memory_per_rank(world: MPI.Comm) -> int | None:
    """The smallest share of node memory per rank over the job (None when unknown anywhere),
    agreed by one all-reduce before validation so that every rank reaches the same verdict."""
    available = metrics.available_memory_bytes()
    share = available // threads.local_ranks() if available is not None else -1
    agreed = int(Communicator(world, "world").all_reduce(np.array([share], dtype=np.int64), op="min")[0])
    return agreed if agreed >= 0 else None


def _prepare_run_dir(cfg: config.Config, world: Communicator) -> None:
    """Create the run and checkpoint directories and write config.toml (rank 0), so that a
    directory that cannot be used stops the job before its first step, not at its first save;
    every rank raises the same error."""
    problem = ""
    if world.rank == 0:
        for directory, what, key in ((cfg.run.dir, "run directory", "run.dir"),
                                     (cfg.checkpoint_dir, "checkpoint directory", "checkpoint.dir")):
            try:
                os.makedirs(directory, exist_ok=True)
                probe = os.path.join(directory, ".write-test")
                with open(probe, "w") as f:
                    f.write("ok")
                os.remove(probe)
                if key == "run.dir":
                    with open(os.path.join(directory, "config.toml"), "w") as f:
                        f.write(config.to_toml(cfg))
            except OSError as err:
                problem = f"{what} {directory!r} is not writable ({err.strerror}); set {key} to a writable directory"
                break
    problem = world.broadcast_object(problem, root=0)
    if problem:
        raise ConfigError(problem)


def _log_ranks(cfg: config.Config, world: Communicator) -> None:
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


def _resume(trainer: Trainer) -> None:
    """Load the checkpoint `checkpoint.resume` names: "" none, "auto" the newest in the
    checkpoint directory (if any), else a path."""
    cfg = trainer.cfg
    resume = cfg.checkpoint.resume
    path = checkpoint.latest(cfg.checkpoint_dir) if resume == "auto" else resume or None
    if path:
        if resume == "auto" and trainer.job.rank == 0:
            pointed = checkpoint.pointer(cfg.checkpoint_dir)
            if pointed != os.path.basename(path):  # `latest` missing or dangling: `checkpoint.latest` fell back
                log.warning("checkpoint.resume=auto: %s %s; resuming from the newest checkpoint there, %s",
                            os.path.join(cfg.checkpoint_dir, checkpoint.LATEST),
                            "is missing" if pointed is None else f"names {pointed!r}, which is not a checkpoint",
                            os.path.basename(path))
        trainer.load(path)
        log.info("resumed from %s at step %d", path, trainer.step)
    elif resume == "auto":
        log.info("checkpoint.resume=auto: no checkpoint in %s, starting fresh", cfg.checkpoint_dir)


class _Progress:
    """A progress bar on rank 0 (tqdm), silent elsewhere."""

    def __init__(self, enabled: bool, total: int, initial: int):
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=1.0)

    def update(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# Python's cycle collector looks at the young objects every 700 new containers by default; a step
# makes tens of thousands (tensors, closures, tuples) and those looks took about 3 % of a CPU step.
# The autograd graph holds no cycles (backward drops each node's closure and parents), so reference
# counting frees it: during training the collector runs a hundred times less often.
_GC_YOUNG_THRESHOLD = 70_000


def _model_flops_per_token(cfg: config.Config) -> float:
    return metrics.flops_per_token(cfg.model.non_embedding_params(), cfg.model.n_layer, cfg.model.n_embd,
                                   cfg.model.block_size)


def _measure_peak(mesh: Mesh, dtype: str) -> float:
    """The job's dense GEMM peak (FLOP/s), summed over nodes. Per node one rank times a matmul
    while the node's other ranks wait: on the CPU with its BLAS threads, scaled to the node's
    cores; on GPUs one device's rate times the GPUs the node's ranks use."""
    dtype = dtype if dtype in ("float32", "float64") else "float32"
    rate = 0.0
    mesh.world.ibarrier().wait()  # polling waits yield the core: the other ranks idle meanwhile
    if mesh.node_comm.rank == 0:
        if backend.name() == "cupy":
            xp = backend.xp
            gpus = min(mesh.node_comm.size, xp.cuda.runtime.getDeviceCount())
            rate = gpus * metrics.measure_gemm_flops(dtype, n=4096, seconds=0.3, xp=xp, sync=backend.synchronize)
        else:
            cores = threads.cores()
            rate = metrics.measure_gemm_flops(dtype, matmul=blas.matmul) * cores / min(threads.blas_threads(), cores)
    mesh.world.ibarrier().wait()
    return float(mesh.world.all_reduce(np.array([rate]), op="sum")[0])


def _traffic_line(s: dict) -> str:
    """The summary's line on bytes: gradient sync per rank per step, compressed vs uncompressed."""
    if s.get("grad_bytes_sent_per_step") is None:
        return "bytes sent       (no step)"
    mib = 2 ** 20
    kind = s.get("grad_compression", "none")
    return (f"bytes sent       {s['grad_bytes_sent_per_step'] / mib:.2f} MiB per rank per step for gradients"
            + (f" ({kind}: {s['compression_ratio']:.3f}x of {s['grad_bytes_uncompressed_per_step'] / mib:.2f} MiB "
               "uncompressed)" if kind != "none" else "")
            + f"; {s['bytes_sent_per_step'] / mib:.2f} MiB in all")


def _moe_text(moe: dict) -> str:
    """" | aux 0.0102 | load 1.31 | dropped 2.1%" for a mixture-of-experts step ("" without experts)."""
    if not moe:
        return ""
    return (f" | aux {moe['moe_aux_loss']:.4f} | load {moe['moe_load_imbalance']:.2f}"
            f" | dropped {moe['moe_dropped_fraction']:.1%}")


def _ps_text(cfg: config.Config) -> str:
    """", parameter server: 2 servers, synchronous" (or "SSP k=2, stale_weight 0", "async, ...");
    "" without servers."""
    ps = cfg.ps
    if not ps.servers:
        return ""
    mode = "async" if ps.mode == "async" else f"SSP k={ps.staleness}" if ps.staleness else "synchronous"
    if mode != "synchronous":
        mode += f", stale_weight {ps.stale_weight:g}"
    return f", parameter server: {ps.servers} server(s), {mode}"


def _ps_line(s: dict) -> list[str]:
    """The summary's parameter-server line ([] without servers)."""
    ps = s.get("ps")
    if not ps:
        return []
    mib = 2 ** 20
    per = "; ".join(f"rank {v['rank']} [{v['range'][0]}, {v['range'][1]}) in {v['bytes_in_per_step'] / mib:.2f} / "
                    f"out {v['bytes_out_per_step'] / mib:.2f} MiB per step" for v in ps["servers"])
    return [f"parameter server {per}; staleness max {ps['staleness_max']}, mean {ps['staleness_mean']:.2f} "
            f"over {ps['pushes_applied']} pushes, {ps['pushes_late']} late (by at most {ps['late_max']} steps)"]


def _format_summary(s: dict) -> str:
    """The summary as printed at the end of `hpcpar train`."""
    mem = ", ".join(f"{b / 2**20:.0f}" for b in s["peak_memory_bytes_per_rank"])
    estimate = s.get("estimated_memory_bytes_per_rank")
    measured = s["pipeline_bubble_measured"]
    lines = [
        "── summary ─────────────────────────────────────────────",
        f"steps            {s['steps']}",
        f"loss             {s['first_loss']:.4f} -> {s['final_loss']:.4f}" if s["final_loss"] is not None
        else "loss             (no completed step)",
        f"val loss         {s['val_loss']:.4f}" if s["val_loss"] is not None else "val loss         (not evaluated)",
        f"throughput       {s['tokens_per_s']:,.0f} tokens/s",
        f"MFU              {s['mfu']:.1%} of a measured GEMM peak of {s['gemm_peak_flops'] / 1e9:.1f} GFLOP/s",
        f"mesh             dp={s['mesh']['dp']}"
        + (f" x cp={s['mesh']['cp']} ({s.get('cp_impl', 'ring')})" if s["mesh"].get("cp", 1) > 1 else "")
        + f" x tp={s['mesh']['tp']} x pp={s['mesh']['pp']}"
        + (f" (dp_replicate={s['dp_replicate']})" if s.get("dp_replicate", 1) > 1 else "")
        + (f", zero={s['zero']}" if s.get("zero") else "")
        + (f", schedule {s['schedule']}" if s["mesh"]["pp"] > 1 else "")
        + f", {s['microbatches']} micro-batch{'es' if s['microbatches'] != 1 else ''}",
        _traffic_line(s),
        *_ps_line(s),
        *([f"precision        {s['precision']}: activations {s['activation_dtype']}, masters and optimizer state "
           "in model.dtype"
           + (f"; loss scale {s['loss_scale']:g}, {s['overflow_steps']} overflow step(s) skipped"
              if s.get("loss_scale") is not None else "")] if s.get("precision", "full") != "full" else []),
        *([f"experts          ep={s.get('ep', 1)}; last step: aux loss {s['moe_aux_loss']:.4f}, max/mean tokens "
           f"per expert {s['moe_load_imbalance']:.2f}, dropped {s['moe_dropped_fraction']:.1%} of assignments"]
          if "moe_aux_loss" in s else []),
        f"pipeline bubble  {s['pipeline_bubble_predicted']:.1%} predicted"
        + (f", {measured:.1%} measured" if measured is not None else ""),
        f"peak memory      {mem} MiB per rank (RSS)"
        + (f"; estimated for model state + activations: {estimate / 2**20:.1f} MiB (busiest rank)"
           if estimate else ""),
        f"run directory    {s['run_dir']}",
    ]
    return "\n".join(lines)
