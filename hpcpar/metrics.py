"""Numbers a run reports: model FLOPs, the machine's GEMM peak, MFU, memory, JSON lines.

MFU follows the PaLM paper (appendix B): FLOPs per token = 6 N + 12 L d T, with N the
non-embedding parameters, L layers, d the width and T the sequence length; MFU is the
achieved model FLOP/s over the peak. The peak is this machine's measured dense GEMM
rate: one rank per node times a square matmul with its BLAS threads, the best of several short
timings, while the node's other ranks wait; scaled to all the node's cores that is the node's
peak; nodes are summed (or the job's peak comes from elsewhere: training/mfu.py, run.mfu_peak).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np


def flops_per_token(n_params_non_embedding: int, n_layer: int, n_embd: int, block_size: int) -> float:
    """Training FLOPs per token (forward + backward): 6 N + 12 L d T."""
    return 6.0 * n_params_non_embedding + 12.0 * n_layer * n_embd * block_size


def measure_gemm_flops(dtype: str = "float32", n: int = 1024, seconds: float = 0.5, xp=np,
                       sync=lambda: None, matmul=None) -> float:
    """This process's dense matmul rate in FLOP/s for `dtype` ([n, n] @ [n, n]) with array module
    `xp` (NumPy; CuPy with `sync` waiting for the device, so the clock sees finished products) and
    `matmul` (default `a @ b`; on the CPU the engine passes the GEMM its ops use, `blas.matmul`)."""
    return gemm_rates(dtype, n, seconds, 1, xp, sync, matmul)[0]


def gemm_rates(dtype: str = "float32", n: int = 1024, seconds: float = 0.1, tries: int = 5, xp=np,
               sync=lambda: None, matmul=None) -> list[float]:
    """`tries` timings of `measure_gemm_flops`'s matmul, `seconds` each, after one warm-up
    product: each timing's FLOP/s, in order. Other work on the machine only slows a timing down,
    so the best is the peak and the spread says how busy the machine was."""
    matmul = matmul or (lambda x, y: x @ y)
    rng = np.random.default_rng(0)
    a = xp.asarray(rng.standard_normal((n, n)).astype(dtype))
    b = xp.asarray(rng.standard_normal((n, n)).astype(dtype))
    matmul(a, b)  # warm-up (thread pool, caches, GPU handles)
    sync()
    rates = []
    for _ in range(tries):
        reps, start = 0, time.perf_counter()
        while True:
            matmul(a, b)
            reps += 1
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                rates.append(2.0 * n ** 3 * reps / elapsed)
                break
    return rates


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def available_memory_bytes() -> int | None:
    """MemAvailable of this node (Linux), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class JsonLines:
    """Append-only metrics file: one JSON object per line, flushed as written. A last line cut
    short (a run killed while writing it) is dropped on opening, so that a resumed run's first
    record starts a line of its own."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        _drop_partial_last_line(path)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _drop_partial_last_line(path: str, chunk: int = 1 << 16) -> None:
    """Truncate `path` after its last newline (nothing to do when it ends with one or is missing)."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return
    with f:
        end = f.seek(0, os.SEEK_END)
        at = end
        while at > 0:
            start = max(0, at - chunk)
            f.seek(start)
            tail = f.read(at - start)
            newline = tail.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            at = start
        else:
            keep = 0
        if keep != end:
            f.truncate(keep)
