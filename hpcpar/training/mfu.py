"""The two terms of model FLOPs utilisation: the model's FLOPs per token and the job's GEMM peak.

MFU = tokens/s x `model_flops_per_token` / `measure_peak` (the formula and the peak's rationale:
hpcpar/metrics.py). The peak is measured here, over the mesh, with the backend's own GEMM: on the
CPU `blas.matmul` with the node's BLAS threads, on GPUs CuPy's matmul.
"""

from __future__ import annotations

import numpy as np

from hpcpar import backend, metrics
from hpcpar import environment
from hpcpar.backend import blas
from hpcpar.config.sections import Config
from hpcpar.runtime.mesh import Mesh


def model_flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token of `cfg`'s model (`metrics.flops_per_token`)."""
    return metrics.flops_per_token(cfg.model.non_embedding_params(), cfg.model.n_layer, cfg.model.n_embd,
                                   cfg.model.block_size)


def measure_peak(mesh: Mesh, dtype: str) -> float:
    """The job's dense GEMM peak (FLOP/s), summed over nodes. Per node one rank times a matmul
    while the node's other ranks wait: on the CPU with its BLAS threads, scaled to the node's
    cores; on GPUs one device's rate times the GPUs the node's ranks use. Collective."""
    dtype = dtype if dtype in ("float32", "float64") else "float32"
    rate = 0.0
    mesh.world.ibarrier().wait()  # polling waits yield the core: the other ranks idle meanwhile
    if mesh.node_comm.rank == 0:
        if backend.name() == "cupy":
            xp = backend.xp
            gpus = min(mesh.node_comm.size, xp.cuda.runtime.getDeviceCount())
            rate = gpus * metrics.measure_gemm_flops(dtype, n=4096, seconds=0.3, xp=xp, sync=backend.synchronize)
        else:
            cores = environment.cores()
            rate = metrics.measure_gemm_flops(dtype, matmul=blas.matmul) * cores / min(environment.blas_threads(), cores)
    mesh.world.ibarrier().wait()
    return float(mesh.world.all_reduce(np.array([rate]), op="sum")[0])
