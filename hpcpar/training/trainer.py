"""`Trainer`: one rank's share of a run and its step loop.

`Trainer` holds this rank's mesh coordinates, pipeline stages, data-parallel state and data.
`train_step(step)` runs one global step (data -> pipeline schedule -> gradient sync -> the
update: clip and optimizer here, or a push to the parameter servers, `update.py`); `train()` is
the loop around it: step accounting, the skip policy for non-finite steps, evaluation / log /
checkpoint cadence, preemption, metrics records and the run summary. Benchmarks and tests run
the same loop with `train(steps=..., files=False, on_step=...)`; `hpcpar train` sets it up in
run.py.

Every rank builds the same global batch for step s (samples 0 .. dp*mbs*m - 1, see data/corpus.py) and
takes its dp share, so results do not depend on the mesh.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import hpcpar
from hpcpar import backend, metrics
from hpcpar.autograd.tensor import no_grad
from hpcpar.checkpoint.parts import load_parts, save_parts
from hpcpar.config.load import to_toml
from hpcpar.config.memory import estimate_memory
from hpcpar.config.sections import Config, TrainConfig
from hpcpar.config.validate import slow_ranks, validate
from hpcpar.data import balance, corpus, formats, packing, tokenizer
from hpcpar.errors import ConfigError, HpcparError
from hpcpar.launch.jobs import REQUEUE_STATUS  # checkpoint saved, requeue me: what the job templates test for
from hpcpar.optim.loss_scale import LossScaler
from hpcpar.optim.optimizers import SGD, AdamW, grad_norm_sq
from hpcpar.parallel.cp.attention import ContextParallel
from hpcpar.parallel.dp.clipping import norm_from_parts
from hpcpar.parallel.dp.compression.compressors import Compression
from hpcpar.parallel.dp.experts import ExpertDataParallel
from hpcpar.parallel.dp.outer import OuterConfig, OuterSync
from hpcpar.parallel.dp.sync import make_gradient_sync
from hpcpar.parallel.pp import schedules, simulate
from hpcpar.parallel.pp.executor import PipelineExecutor
from hpcpar.parallel.pp.stages import build_stages
from hpcpar.runtime import preemption
from hpcpar.runtime.comm import Communicator, mpi_world
from hpcpar.runtime.mesh import Mesh
from hpcpar.runtime.topology import Axis
from hpcpar.runtime.trace import Tracer
from hpcpar.state import SavedState, StoredState
from hpcpar.training import routing
from hpcpar.training.mfu import Peak, job_peak, model_flops_per_token
from hpcpar.training.report import StepLog, ps_text, sync_summary, traffic_summary
from hpcpar.training.resilience import PartnerSnapshots
from hpcpar.training.update import LocalUpdate, ServerUpdate, StepResult

log = logging.getLogger("hpcpar")

# Python's cycle collector looks at the young objects every 700 new containers by default; a step
# makes tens of thousands (tensors, closures, tuples) and those looks took about 3 % of a CPU step.
# The autograd graph holds no cycles (backward drops each node's closure and parents), so reference
# counting frees it: during training the collector runs a hundred times less often.
_GC_YOUNG_THRESHOLD = 70_000


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
    moe: dict          # the routing figures (`routing.figures`); {} without experts
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


class Trainer:
    """One rank's part of a training run on a (dp, tp, pp) mesh.

    Args:
        cfg: configuration (validated here for `comm`'s size).
        comm: mpi4py communicator spanning the run (default COMM_WORLD). With a parameter server
            (`ps.servers` = S, see `run.build`) the mesh is its first size - S ranks, and this rank
            pushes its gradients to the servers instead of averaging them over dp (`self.update`).
        tokens: the corpus as uint8 tokens, or a `formats.Dataset` (default: open `cfg.data`, see `formats.load`).
        available_memory_bytes: memory per rank to check the model against (None: no check).
    """

    def __init__(self, cfg: Config, comm=None, tokens: np.ndarray | None = None,
                 available_memory_bytes: int | None = None):
        comm = comm if comm is not None else mpi_world()
        self.cfg = cfg = validate(cfg, comm.Get_size(), available_memory_bytes)
        if cfg.run.backend != "auto":  # auto: what HPCPAR_BACKEND chose at import (default numpy)
            backend.use(cfg.run.backend)
        workers_comm = self._join_mesh(comm)
        self._build_stages()
        self.dp = self._build_gradient_sync()
        self.is_loss_reporter = (self.stages[-1].head and self.mesh.rank(Axis.TP) == 0)
        self.outer = self._build_outer_sync()
        self.scaler = self._build_loss_scaler()
        self.update = self._choose_update(comm, workers_comm)
        # Every rank of the job (workers and servers): checkpoints and parameter-server messages.
        self.job = self.update.job
        for stage in self.stages:
            stage.unit_hooks = self.dp.unit_hooks
        t = cfg.train
        every_rank = schedules.build(cfg.pipeline.schedule, cfg.mesh.pp, t.microbatches, cfg.pipeline.chunks)
        self.executor = PipelineExecutor(self.stages, self.mesh, every_rank[self.mesh.rank(Axis.PP)],
                                         microbatches=t.microbatches, tracer=self.tracer,
                                         in_order_safe=simulate.in_order_safe(every_rank, self.placement),
                                         placement=self.placement)
        self.dataset = (formats.load(cfg.data, cfg.model.vocab_size, self.mesh.world) if tokens is None
                        else formats.from_tokens(tokens, cfg.data.val_fraction))
        self.train_tokens, self.val_tokens = self.dataset.train, self.dataset.val
        self.global_batches = balance.GlobalBatches(self.dataset, cfg.data, t, cfg.model.block_size,
                                                    self.mesh.size(Axis.DP), self.mesh.rank(Axis.DP), self.cp.columns)
        self.tokens_per_step = self.mesh.size(Axis.DP) * t.micro_batch_size * t.microbatches * cfg.model.block_size
        self.step = 0  # the next step to run
        self.save_in_flight = None  # checkpoint.save.SaveHandle of an asynchronous save not yet committed
        self.base_comm, self.events = comm, []  # the MPI communicator it is built on; events for the next record
        self.snapshots = PartnerSnapshots.of(self)  # in-memory partner snapshots (training/resilience.py)

    def _join_mesh(self, comm) -> Any:
        """Build the workers' mesh over `comm` (with S servers: its first size - S ranks, split off
        collectively with the servers' `ServerRank`), this rank's device and its tracer. Returns
        the workers' mpi4py communicator with servers, else None."""
        cfg = self.cfg
        servers = cfg.ps.servers
        workers = comm.Get_size() - servers
        if servers and comm.Get_rank() >= workers:
            raise ConfigError(f"rank {comm.Get_rank()} is a parameter server (ps.servers={servers}); build it "
                              "with hpcpar.training.run.build")
        mesh_comm = comm.Split(0, comm.Get_rank()) if servers else comm   # collective with ServerRank's
        self.mesh = Mesh(dp=cfg.mesh.dp, tp=cfg.mesh.tp, pp=cfg.mesh.pp, comm=mesh_comm, cp=cfg.mesh.cp,
                         dp_replicate=cfg.mesh.dp_replicate, ep=cfg.mesh.ep)
        self.slow_ranks, self.rank_in_job, self.workers = slow_ranks(cfg), comm.Get_rank(), workers
        backend.select_device(self.mesh.node_comm.rank)
        backend.reuse_freed_host_memory()  # activations are host arrays on the CPU, and staging buffers on GPUs
        self.tracer = Tracer(enabled=cfg.pipeline.trace, rank=self.mesh.world.rank)
        return mesh_comm if servers else None

    def _build_stages(self) -> None:
        """This rank's pipeline stages (`stages`, their `named_parameters`), their `placement`,
        and the context parallelism they run under (`cp`: a rank holds the columns `cp.columns` gives)."""
        cfg = self.cfg
        self.cp = ContextParallel(self.mesh.comm(Axis.CP), cfg.mesh.cp_impl, tracer=self.tracer)
        # Where the virtual stages live: the loop, or ZB-V's V (first and last stage on pp rank 0).
        self.placement = schedules.placement(cfg.pipeline.schedule, cfg.mesh.pp, cfg.pipeline.chunks)
        self.stages = build_stages(cfg.model, self.mesh, chunks=cfg.pipeline.chunks, seed=cfg.train.seed,
                                   sequence_parallel=cfg.mesh.sequence_parallel, cp=self.cp,
                                   placement=self.placement, precision=cfg.train.precision)
        for stage in self.stages:
            stage.set_recompute(cfg.train.recompute, cfg.train.recompute_every)
        self.named_parameters = [(n, p) for s in self.stages for n, p in s.named_parameters()]
        self.expert_bias = routing.ExpertBias(cfg.model, self.stages)  # model.moe_expert_bias_rate

    def _build_gradient_sync(self):
        """The data-parallel gradient sync and optimizer of this rank's parameters (ZeRO stage,
        compression, experts' groups as configured)."""
        cfg, t = self.cfg, self.cfg.train
        # ZeRO-3 gathers the model unit by unit: the embedding, each block, the head of every chunk.
        # Under ZB-V the first and the last virtual stage (wte and the head's copy) share a rank.
        n_virtual = self.placement.stages
        units = [(c, name, params) for c, s in enumerate(self.stages) for name, params in s.fsdp_units()]
        compression = Compression(t.grad_compression, ratio=t.compression_ratio, rank=t.powersgd_rank,
                                  start_step=t.compression_start_step, error_feedback=t.error_feedback,
                                  block_size=t.int8_block_size, seed=t.seed)
        # With experts: dense weights averaged over dp, experts over the expert-data-parallel group.
        # With servers a replica keeps its gradients to itself (groups of one rank): they are pushed.
        alone = {"groups": (Communicator.local(),) * 3} if cfg.ps.servers else {}
        if t.sync != "step":  # local SGD / DiLoCo: every step inside the replica only (outer.py)
            inside = self.mesh.comm((Axis.DP_SHARD, Axis.CP))
            alone = {"groups": (inside, inside, Communicator.local())}
            if cfg.model.moe_experts:
                experts = self.mesh.comm(Axis.EDP_SHARD)
                alone["expert_groups"] = (experts, experts, Communicator.local())
        return (ExpertDataParallel if cfg.model.moe_experts else make_gradient_sync)(
            self.named_parameters, self.mesh, bucket_mb=t.bucket_mb,
            compression=compression, zero=t.zero, make_optimizer=optimizer_factory(t),
            sparse_embedding=t.sparse_embedding, prefetch=t.prefetch_units,
            units=units if t.zero == 3 else None, reshard_after_forward=t.reshard_after_forward,
            local_tied=self.placement.holder(0)[0] == self.placement.holder(n_virtual - 1)[0], **alone)

    def _build_outer_sync(self) -> OuterSync | None:
        """train.sync = "local" / "diloco": the replicas' outer synchronisation (outer.py; the shard
        group holds the same pieces without ZeRO-3 and experts), and which replica each world rank
        belongs to (each replica clips by its own gradient norm); None with train.sync = "step"."""
        t = self.cfg.train
        if t.sync == "step":
            return None
        self.replica_of_rank = np.array(self.mesh.world.all_gather_object(self.mesh.rank(Axis.DP_REPLICATE)))
        same = self.mesh.comm((Axis.DP_SHARD, Axis.CP)) if t.zero < 3 and not self.cfg.model.moe_experts else None
        return OuterSync(OuterConfig.of(t), self.dp.parameter_pieces(), self.mesh.comm(Axis.DP_REPLICATE),
                         self.cfg.model.n_layer, shards=same)

    def _choose_update(self, comm, workers_comm) -> LocalUpdate | ServerUpdate:
        """Where this rank's steps are updated: on the parameter servers (`ps.servers`), or here."""
        # The lambdas call `_agree` and `_bytes_sent` as they are at each step: benchmarks wrap them.
        if self.cfg.ps.servers:
            return ServerUpdate(self.cfg, comm, workers_comm, self.mesh, self.dp, self.named_parameters,
                                self.is_loss_reporter, lambda: self._bytes_sent(), lambda s: self.microbatches(s))
        return LocalUpdate(self.cfg.train, self.mesh, self.dp, self.scaler,
                           lambda *args: self._agree(*args), outer=self.outer)

    def _build_loss_scaler(self) -> LossScaler | None:
        """fp16: the loss scaler (dynamic unless train.loss_scale > 0); None: the loss is not scaled."""
        t = self.cfg.train
        if t.precision != "fp16":
            return None
        return LossScaler(t.loss_scale or t.initial_loss_scale, dynamic=t.loss_scale == 0,
                          window=t.loss_scale_window, growth=t.loss_scale_growth, backoff=t.loss_scale_backoff,
                          hysteresis=t.loss_scale_hysteresis, min_scale=t.min_loss_scale)

    def free(self) -> None:
        """Release the communicators this rank's part of the run created (collective)."""
        self.mesh.free()
        self.update.free()

    def mesh_text(self) -> str:
        """"dp=2 x tp=1 x pp=2" (with "cp=.. (ring)" after dp under context parallelism, the dp
        split under HSDP, the ZeRO stage when it is not 0 and the replicas' sync when not "step")."""
        cp = f" x cp={self.mesh.size(Axis.CP)} ({self.cfg.mesh.cp_impl})" if self.mesh.size(Axis.CP) > 1 else ""
        replicate = self.mesh.size(Axis.DP_REPLICATE)
        hsdp = f" ({replicate} replicate x {self.mesh.size(Axis.DP_SHARD)} shard)" if replicate > 1 else ""
        zero = f", zero={self.cfg.train.zero}" if self.cfg.train.zero else ""
        ep = f", ep={self.mesh.size(Axis.EP)}" if self.cfg.model.moe_experts else ""
        t = self.cfg.train
        sync = f", {t.sync} sync every {t.sync_every} steps" if t.sync != "step" else ""
        return (f"dp={self.mesh.size(Axis.DP)}{hsdp}{cp} x tp={self.mesh.size(Axis.TP)} "
                f"x pp={self.mesh.size(Axis.PP)}{zero}{ep}{sync}{ps_text(self.cfg)}")

    # -- data ------------------------------------------------------------------------------
    def sample_ids(self, step: int | None = None) -> list:
        """Global sample ids of this dp rank's micro-batches of training step `step`, one array of
        micro_batch_size ids per micro-batch, which also key its dropout masks; dealt by data.balance
        (data/balance.py); None: the sample-id order (corpus.microbatch_sample_ids), data.balance "none"'s."""
        return self.global_batches.sample_ids("train", step)

    def microbatches(self, step: int) -> list:
        """This dp rank's micro-batches of global step `step`: (x, y), int64 [B, T] each (and packed, the
        `Documents`: data/packing.py); under context parallelism only this rank's tokens, [B, T/cp]."""
        return self.global_batches.batches("train", step, self.sample_ids(step))

    def _global_mean_loss(self, losses: list, microbatches: int) -> float:
        """Mean loss over the global batch, the same float on every rank (one world all-reduce) from
        this rank's micro-batch `losses` (last stage, tp rank 0; [] elsewhere), `microbatches` per dp
        rank. Each cp rank's loss is the mean over its T/cp tokens (packed: weighted, data/balance.py)."""
        local = np.array([float(sum(losses)) if self.is_loss_reporter else 0.0])
        total = self.mesh.world.all_reduce(local, op="sum")
        return float(total[0]) / (self.mesh.size(Axis.DP) * self.mesh.size(Axis.CP) * microbatches)

    # -- one step ----------------------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        """Run global step `step`: forward/backward of every micro-batch through the pipeline
        schedule and gradient sync over dp, then the update (`self.update.finish_step`): here,
        the step's agreement (`_agree`: loss, gradient norm, preemption, bytes, one world
        collective), clipping and the optimizer update (none when the loss or gradient norm is not
        finite; under fp16 the loss is scaled by the `LossScaler`, and a non-finite norm is an
        overflow that backs the scale off); with parameter servers, a push and a pull. Collective.
        Afterwards `self.step` is `step + 1`: a skipped step's batch is passed over, not retried."""
        before = self._bytes_sent()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        losses = self._forward_backward(step, scale)
        result = self.update.finish_step(step, losses, before, scale)
        self.step = step + 1
        return result

    def _forward_backward(self, step: int, scale: float) -> list:
        """Every micro-batch of `step` forward and backward (the loss scaled by `scale`), gradients
        synchronised; returns this rank's micro-batch losses ([] off the last stage)."""
        t = self.cfg.train
        batches = self.microbatches(step)
        if self.cfg.model.dropout:  # masks are keyed by (seed, step, sample id), not by rank
            self.executor.rng_contexts = [(t.seed, step, list(ids)) for ids in self.sample_ids(step)]
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
        return losses

    def _agree(self, losses: list, norm_items: list, before: tuple[float, float]) -> _Agreement:
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
        m = self.cfg.model
        table = routing.table(self.stages, m, self.mesh.rank(Axis.TP)) if m.moe_experts else None
        if table is not None:
            row += list(table.reshape(-1))
        every = self._gather_step(np.array(row, dtype=np.float64))
        n = _Agreement.FIGURES
        batches = self.mesh.size(Axis.DP) * self.cfg.train.microbatches
        return _Agreement(
            loss=math.fsum(every[:, 0]) / (batches * self.mesh.size(Axis.CP)),
            norm=self._norm(every[:, 1]), stop=bool(every[:, 2].any()),
            means=every[:, 3:n].mean(axis=0), compressing=compressing,
            moe=(self.expert_bias.record_step(every[:, n:].sum(axis=0).reshape(table.shape), batches)
                 if table is not None else {}))

    def _norm(self, parts: np.ndarray) -> float:
        """The gradient norm from every rank's part (rank order); with train.sync = "local" / "diloco"
        this replica's, non-finite when any replica's is (all skip the step: they stay in step)."""
        if self.outer is None:
            return norm_from_parts(parts)
        norms = [norm_from_parts(parts[self.replica_of_rank == r]) for r in range(self.mesh.size(Axis.DP_REPLICATE))]
        mine = norms[self.mesh.rank(Axis.DP_REPLICATE)]
        return mine if all(math.isfinite(n) for n in norms) else math.inf

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

    def _bytes_sent(self) -> tuple[float, float]:
        """(bytes this rank has sent over all its communicators, of which for gradient sync) so far."""
        pushed = self.update.bytes_pushed()   # pushes to the parameter servers
        return (sum(c.bytes_sent_total() for c in self.mesh.communicators()) + pushed, self.dp.sync_bytes() + pushed)

    # -- evaluation ---------------------------------------------------------------------
    def evaluate(self, batches: int) -> float:
        """Mean validation loss over `batches` global batches (same float everywhere).

        Validation batch i holds the same sample ids as a training step's global batch
        (dp * micro_batch_size * microbatches), drawn from the validation stream, so the
        figure depends on the global batch, not on the mesh.
        """
        eval_batches = [b for i in range(batches) for b in self.global_batches.batches("val", i)]
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
            progress: the progress bar on rank 0 (default `run.progress`; else a line per `log_every`).
            on_step: called on every rank with each step's record (the metrics line's fields plus
                `cpu_time_s`, this process's CPU time in `train_step`).
            peak_flops: the FLOP/s of MFU (default `run.mfu_peak`'s; 0 reports MFU 0).
        """
        run = self.cfg.run
        end = self.cfg.train.steps if steps is None else self.step + steps
        first = self.step
        rank0 = self.mesh.world.rank == 0
        model_flops = model_flops_per_token(self.cfg)
        self.peak = peak = job_peak(self.cfg, self.mesh) if peak_flops is None else Peak(peak_flops)
        self._log_start(peak)
        draw = rank0 and (run.progress if progress is None else progress)
        out = StepLog(rank0, draw, os.path.join(run.dir, "metrics.jsonl") if files and rank0 else None, on_step,
                      run.log_every, end, self.step)
        state = _RunState()
        status = 0
        try:
            with _rarer_cycle_collection():
                while self.step < end:
                    stop = self._loop_step(end, files, state, out, model_flops, peak)
                    if stop:  # every rank agreed: one of them says so
                        if rank0:
                            log.warning("preemption signal received: saving a checkpoint at step %d and exiting "
                                        "with status %d (requeue and resume with checkpoint.resume=auto)",
                                        self.step, REQUEUE_STATUS)
                        status = REQUEUE_STATUS
                        break
        finally:
            out.close()
        self.update.close()
        if files:
            self._checkpoint(final=True)
        summary = {**self._summary(state, model_flops, peak), **self.update.run_report(self.step - first)}
        return RunResult(status, summary)

    def _log_start(self, peak: Peak) -> None:
        log.info("hpcpar %s: mesh %s on %d rank(s); %s; global batch %d tokens/step; "
                 "%.2fM non-embedding parameters; MFU against the %s",
                 hpcpar.__version__, self.mesh_text(), self.mesh.world.size,
                 corpus.corpus_description(self.cfg.data.corpus), self.tokens_per_step,
                 self.cfg.model.non_embedding_params() / 1e6, peak.text())
        warning = self.mesh.placement().warning()  # the same on every rank: said once
        if warning and self.mesh.world.rank == 0:
            log.warning(warning)

    def _loop_step(self, end: int, files: bool, state: _RunState, out: StepLog, model_flops: float,
                   peak: Peak) -> bool:
        """One step of `train`'s loop, up to `end`: the step, its accounting, evaluation, record
        and checkpoint when due. Returns whether a preemption signal stops the run after it."""
        run = self.cfg.run
        step = self.step
        start, cpu_start = time.perf_counter(), time.process_time()
        result = self.train_step(step)
        if self.snapshots is not None:  # its cost is the step's (timed with it)
            self.snapshots.after_step(self)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        self._account(step, result, elapsed, state)
        record = self._record(step, result, elapsed, model_flops, peak)
        if self.events:  # a failure survived before this step (training/resilience.py)
            record["events"], self.events = self.events, []
        if run.eval_every and (self.step % run.eval_every == 0 or self.step == end):
            state.val_loss = record["val_loss"] = self.evaluate(run.eval_batches)
        out.write(record, cpu, last=self.step == end)
        every = self.cfg.checkpoint.every
        if files and every and self.step % every == 0 and self.step < end:
            self._checkpoint()
        return result.stop

    def _record(self, step: int, result: StepResult, elapsed: float, model_flops: float, peak: Peak) -> dict:
        """The step's metrics record (a metrics.jsonl line's fields)."""
        tok_s = self.tokens_per_step / elapsed
        mfu = peak.mfu(tok_s * model_flops)
        record = {"step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                  "tokens_per_s": tok_s, "mfu": mfu, "step_time_s": elapsed, "skipped": result.skipped,
                  **result.traffic, **result.moe, **self.global_batches.figures(step)}
        if self.scaler is not None:
            record.update(loss_scale=result.loss_scale, overflow=result.overflow)
        if result.staleness is not None:
            record["staleness"] = result.staleness
        return record

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

    def _summary(self, state: _RunState, model_flops: float, peak: Peak) -> dict:
        """summary.json's content (collective: gathers every rank's peak memory). Throughput
        leaves out the first completed step (allocations, connections) when there are others."""
        cfg, mesh = self.cfg, self.mesh
        steady = state.step_times[1:] if len(state.step_times) > 1 else state.step_times
        tok_s = self.tokens_per_step * len(steady) / sum(steady) if steady else 0.0
        # Predicted with forward = B = W (a whole backward twice a forward).
        sim = simulate.simulate(schedules.build(cfg.pipeline.schedule, mesh.size(Axis.PP), cfg.train.microbatches,
                                              cfg.pipeline.chunks), t_forward=1.0, t_backward=1.0, t_weight=1.0,
                               placement=self.placement)
        peak_rss = mesh.world.all_gather_object(metrics.peak_rss_bytes())
        estimate = estimate_memory(cfg, mesh.size(Axis.DP), mesh.size(Axis.TP), mesh.size(Axis.PP),
                                   mesh.size(Axis.CP))
        return {
            "steps": self.step, "tokens_per_s": tok_s, "mfu_capped_steps": peak.capped,  # the steps' (read first)
            "mfu": peak.mfu(tok_s * model_flops), "gemm_peak_flops": peak.flops, "mfu_peak": peak.text(),
            "first_loss": state.first_loss, "final_loss": state.last_loss,
            "val_loss": state.val_loss, "mesh": {str(a): mesh.size(a) for a in (Axis.DP, Axis.TP, Axis.PP, Axis.CP)},
            "cp_impl": cfg.mesh.cp_impl, "zero": cfg.train.zero, "dp_replicate": mesh.size(Axis.DP_REPLICATE),
            "schedule": cfg.pipeline.schedule, "microbatches": cfg.train.microbatches,
            "pipeline_bubble_predicted": sim.bubble,
            "pipeline_bubble_measured": self.executor.measured_bubble(),
            "grad_compression": cfg.train.grad_compression, **traffic_summary(state.traffic),
            **sync_summary(cfg.train, mesh.size(Axis.DP_REPLICATE), state.traffic),
            "precision": cfg.train.precision, "activation_dtype": self.stages[0].activation_dtype,
            "loss_scale": self.scaler.scale if self.scaler is not None else None,
            "overflow_steps": self.scaler.overflows if self.scaler is not None else 0,
            "peak_memory_bytes_per_rank": peak_rss, "estimated_memory_bytes_per_rank": estimate,
            "run_dir": cfg.run.dir, "ep": mesh.size(Axis.EP), **state.moe,
        }

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
        catalogue = {n: v for part in world.all_gather_object(mine) for n, v in part.items()}
        out = {}
        for name in sorted(catalogue):
            shape, dtype = catalogue[name]
            full = np.zeros(shape, dtype=dtype)
            p = params.get(name)
            if p is not None and self._owns_blocks(p) and arrays[name] is not None:
                p.layout.put(backend.to_host(arrays[name]), full)
            out[name] = world.all_reduce(full, op="sum")
        return out

    # -- checkpoints (`Checkpointable`, hpcpar/state.py) ------------------------------------
    def checkpoint_state(self) -> SavedState:
        """What this rank saves: the run position and how to resume it (metadata), the model and
        optimizer state with the compressor's (`update`: this rank's gradient sync, or with
        parameter servers none but the optimizer step), the loss scale and the expert bias. Collective.

        Everything else that shapes the trajectory is a pure function of (seed, step): batch
        sampling and dropout masks are keyed by (seed, step, sample id) and the learning rate
        by step, so `step` is the data, RNG and schedule position.
        """
        t = self.cfg.train
        run = SavedState(meta={
            "step": self.step, "config": to_toml(self.cfg), "hpcpar_version": hpcpar.__version__,
            "mesh": {**{str(a): self.mesh.size(a) for a in (Axis.DP, Axis.TP, Axis.PP, Axis.CP)}, "zero": t.zero,
                     "dp_replicate": self.mesh.size(Axis.DP_REPLICATE)},
            "data_position": {"next_step": self.step, "seed": t.seed},
            "rng": {"kind": "counter-based: (seed, step, sample id)", "seed": t.seed, "next_step": self.step},
            "lr_schedule": {"next_step": self.step, "warmup": t.warmup, "total": t.steps},
            "tokenizer": self.dataset.tokenizer})
        scaler = [self.scaler.checkpoint_state()] if self.scaler is not None else []
        return SavedState.merged([run, self.update.checkpoint_state(), *scaler, self.expert_bias.checkpoint_state()])

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """A checkpoint whose tokenizer differs from the data's is refused (one line, on every
        rank of the job); then the parts (`checkpoint_state`'s), and unless weights only the run
        position."""
        def check():
            tokenizer.require_match(stored.meta.get("tokenizer"), self.dataset.tokenizer, f"checkpoint {stored.path}",
                                    f"data {self.cfg.data.corpus or '(default corpus)'}")
            packing.require_resumable(stored, self.cfg.data.packing)
        self.update.agree_on(check)
        for part in (self.update, self.expert_bias, *([self.scaler] if self.scaler is not None else [])):
            part.load_checkpoint_state(stored)
        if not stored.weights_only:
            stored.read({}, lambda _: setattr(self, "step", int(stored.meta["step"])))

    def save(self, directory: str, keep: int, async_save: bool = False):
        """Checkpoint this rank's `checkpoint_state` (collective).

        A save still in flight is committed first. Returns the committed `step-NNNNNNN` path,
        or with `async_save` a `checkpoint.save.SaveHandle` (also kept in `save_in_flight`): the
        rank files are written in a background thread and `finish_save()` commits them. With
        checkpoint.location = "node-local" every node keeps a full copy ("auto", which `hpcpar
        train` resolves when the run starts, is probed at each save here).
        """
        self.finish_save()
        c = self.cfg.checkpoint
        result = save_parts(directory, self.step, [self], self.job, keep=keep, async_save=async_save,
                            storage=c.format, location=c.location)
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
        checkpoint has it (see parallel/dp/compression/state.py); otherwise it starts afresh / is
        ignored, so a checkpoint loads with and without compression."""
        return load_parts(path, [self], self.job, weights_only)


def optimizer_factory(t: TrainConfig) -> Callable[[list], Any]:
    """train.optimizer's constructor over a list of objects with `.data`, `.grad`, `.no_decay`."""
    if t.optimizer == "adamw":
        return lambda params: AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                    weight_decay=t.weight_decay)
    return lambda params: SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)


@contextlib.contextmanager
def _rarer_cycle_collection() -> Iterator[None]:
    """Python's cycle collector visits the young objects every _GC_YOUNG_THRESHOLD new containers
    (at least) inside the block, and as before after it."""
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], _GC_YOUNG_THRESHOLD), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
