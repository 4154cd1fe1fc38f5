"""The two terms of model FLOPs utilisation: the model's FLOPs per token and the job's peak.

MFU = tokens/s x `model_flops_per_token` / the job's peak (the formula and the measured peak's
rationale: hpcpar/metrics.py). `job_peak` chooses the peak as `run.mfu_peak` says and returns it
as a `Peak`, which names its source and computes each MFU, capped at 100 %:

    "auto"         the higher of "measure" and the calibration `hpcpar plan --calibrate` stored,
                   when it was made for this model.dtype with as many ranks per node as this job
                   has (CPU): both are GEMM rates other work can only have lowered
    "measure"      `measure_peak`: per node one rank takes the best of several short GEMM timings
                   with the backend's own GEMM (on the CPU `blas.matmul` with the node's BLAS
                   threads, on GPUs CuPy's matmul); summed over nodes
    "a100", "h100" the planner's vendor preset (dense 16-bit peak) per rank, times the ranks
    a number       FLOP/s per rank, times the ranks

A measured peak is only as good as the machine was idle while it was timed: timings that vary
by more than `DOUBTFUL_SPREAD` are warned about once, and an MFU above 100 % (a peak measured
low) is capped with one warning instead of printed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

from hpcpar import backend, metrics
from hpcpar import environment
from hpcpar.backend import blas
from hpcpar.config.sections import Config
from hpcpar.config.validate import mfu_peak_flops
from hpcpar.errors import HpcparError
from hpcpar.planner.hardware import PRESETS, calibration_path, load_hardware
from hpcpar.runtime.mesh import Mesh

log = logging.getLogger("hpcpar")

TRIES = 5                # GEMM timings per measurement; the best counts
DOUBTFUL_SPREAD = 0.7    # a measurement whose slowest timing is below this share of its best is doubtful


@dataclass
class Peak:
    """The job's peak FLOP/s that MFU is relative to, and where it came from.

    `source` names it ("measured GEMM", "calibrated", "h100 preset's", "given") and `detail` says
    how it was had, for the log and the summary (`text`); `speak`: this rank warns (rank 0 of a
    peak `job_peak` chose); `capped`: steps whose MFU was capped."""

    flops: float
    source: str = "given"
    detail: str = "Trainer.train(peak_flops=...)"
    speak: bool = False
    capped: int = 0

    def mfu(self, model_flops_per_s: float) -> float:
        """model FLOP/s over the peak, at most 1 (the first step above it is warned about); 0
        without a peak."""
        if not self.flops:
            return 0.0
        value = model_flops_per_s / self.flops
        if value <= 1.0:
            return value
        if not self.capped and self.speak:
            log.warning("MFU: the model computed %s, more than the %s of %s: that peak is too low (measured while "
                        "other work ran?); MFU is capped at 100%%. Set run.mfu_peak (a100, h100 or FLOP/s per rank) "
                        "or calibrate once with `hpcpar plan --calibrate`", flops_text(model_flops_per_s),
                        f"{self.source} peak", flops_text(self.flops))
        self.capped += 1
        return 1.0

    def text(self) -> str:
        """"measured GEMM peak, 246.7 GFLOP/s (best of 5 timings at start-up)"."""
        return f"{self.source} peak, {flops_text(self.flops)} ({self.detail})"


def flops_text(flops: float) -> str:
    """"246.7 GFLOP/s", "3956.0 TFLOP/s", "2.0 MFLOP/s"."""
    scale, unit = next((s, u) for s, u in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1.0, "")) if flops >= s or s == 1.0)
    return f"{flops / scale:.1f} {unit}FLOP/s"


def job_peak(cfg: Config, mesh: Mesh) -> Peak:
    """The job's peak as `run.mfu_peak` asks (the module docstring); collective over `mesh.world`."""
    choice, ranks, rank0 = cfg.run.mfu_peak, mesh.world.size, mesh.world.rank == 0
    given = mfu_peak_flops(choice)
    if given is not None:
        return Peak(given * ranks, "given", f"run.mfu_peak: {flops_text(given)} per rank x {ranks}", rank0)
    if choice in PRESETS:
        per_rank = PRESETS[choice].peak_flops
        return Peak(per_rank * ranks, f"{choice} preset's", f"{flops_text(per_rank)} per rank x {ranks}", rank0)
    measured = measure_peak(mesh, cfg.model.dtype)
    if choice == "auto":
        node_peak = mesh.world.broadcast_object(_calibrated_node_peak(cfg, mesh.node_comm.size) if rank0 else None)
        nodes = int(mesh.world.all_reduce(np.array([1 if mesh.node_comm.rank == 0 else 0]), op="sum")[0])
        if node_peak is not None and node_peak * nodes > measured:
            return Peak(node_peak * nodes, "calibrated", f"hpcpar plan --calibrate, {calibration_path()}; "
                        f"{flops_text(measured)} measured at start-up", rank0)
    return Peak(measured, "measured GEMM", f"best of {TRIES} timings at start-up", rank0)


def _calibrated_node_peak(cfg: Config, ranks_per_node: int) -> float | None:
    """A node's peak from the stored calibration (its per-rank GEMM rate, measured with every rank
    busy, times its ranks) when one exists for this run: the CPU backend, the same model.dtype
    and as many ranks per node; else None (an unreadable file too: "auto" then measures)."""
    if backend.name() != "numpy" or not os.path.isfile(calibration_path()):
        return None
    try:
        hw = load_hardware("this")
    except HpcparError:
        return None
    if hw.model.get("dtype") != cfg.model.dtype or hw.ranks_per_node != ranks_per_node or hw.peak_flops <= 0:
        return None
    return hw.peak_flops * hw.ranks_per_node


def model_flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token of `cfg`'s model (`metrics.flops_per_token`)."""
    return metrics.flops_per_token(cfg.model.non_embedding_params(), cfg.model.n_layer, cfg.model.n_embd,
                                   cfg.model.block_size)


def measure_peak(mesh: Mesh, dtype: str) -> float:
    """The job's dense GEMM peak (FLOP/s), summed over nodes. Per node one rank times a matmul
    `TRIES` times while the node's other ranks wait, and keeps the best (other work on the machine
    only ever slows a timing down): on the CPU with its BLAS threads, scaled to the node's cores;
    on GPUs one device's rate times the GPUs the node's ranks use. Timings that spread more than
    `DOUBTFUL_SPREAD` are warned about once (rank 0). Collective."""
    dtype = dtype if dtype in ("float32", "float64") else "float32"
    rates = [0.0]
    mesh.world.ibarrier().wait()  # polling waits yield the core: the other ranks idle meanwhile
    if mesh.node_comm.rank == 0:
        if backend.name() == "cupy":
            xp = backend.xp
            gpus = min(mesh.node_comm.size, xp.cuda.runtime.getDeviceCount())
            rates = [gpus * r for r in metrics.gemm_rates(dtype, n=4096, seconds=0.1, tries=TRIES, xp=xp,
                                                          sync=backend.synchronize)]
        else:
            cores = environment.cores()
            scale = cores / min(environment.blas_threads(), cores)
            rates = [scale * r for r in metrics.gemm_rates(dtype, seconds=0.1, tries=TRIES, matmul=blas.matmul)]
    mesh.world.ibarrier().wait()
    nodes = [r for r in mesh.world.all_gather_object(rates) if max(r) > 0]   # once, at start-up
    doubtful = [r for r in nodes if min(r) < DOUBTFUL_SPREAD * max(r)]
    if doubtful and mesh.world.rank == 0:
        log.warning("the GEMM peak measured at start-up varied from %s to %s over %d timings%s (other work on the "
                    "machine?); MFU is relative to the best. For a steady figure set run.mfu_peak (a100, h100 or "
                    "FLOP/s per rank) or calibrate once with `hpcpar plan --calibrate`", flops_text(min(doubtful[0])),
                    flops_text(max(doubtful[0])), len(doubtful[0]),
                    f" on {len(doubtful)} of {len(nodes)} nodes" if len(nodes) > 1 else "")
    return float(sum(max(r) for r in nodes))
