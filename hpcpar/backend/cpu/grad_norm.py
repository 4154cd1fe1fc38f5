"""A gradient's share of the global gradient norm on the CPU: the sum of its squares, in float64."""

from __future__ import annotations

import numpy as np

from hpcpar.backend.cpu.blocks import compiled_loops


def sum_of_squares(a) -> float:
    """The sum of the squares of a's elements, accumulated in float64 (a gradient norm's share):
    without a float64 copy of `a` when the compiled loops are there."""
    flat = a.reshape(-1)
    jit = compiled_loops()
    if jit is not None and flat.dtype in (np.float32, np.float64):
        return float(jit.sum_of_squares(flat))
    flat = flat.astype(np.float64, copy=False)
    return float(np.dot(flat, flat))

