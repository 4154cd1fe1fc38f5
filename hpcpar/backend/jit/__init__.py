"""Numba-compiled loops for the CPU kernels and the kernel threads (the `fast` extra).

    kernels     the elementwise and row loops of the CPU kernels' blocks (backend/cpu/)
    attention   causal attention per (sample, head), one GIL-free call per run of them
    pool        the kernel threads' compiled side: spinning waits and compiled tasks (kernel_pool)

Each is imported on first use through `load`, the one place that decides whether compiled code is
used at all.
"""

from __future__ import annotations

import importlib
import os


def load(name: str):
    """hpcpar.backend.jit.`name`, or None: compiled code turned off (HPCPAR_JIT=0), or Numba not
    installed."""
    if os.environ.get("HPCPAR_JIT", "1").strip() == "0":
        return None
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError:
        return None
