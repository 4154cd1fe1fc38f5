"""Parameter initialisation as a pure function of (seed, global name, global shape).

Every rank generates the full global tensor from the same key and keeps its slice
(`Layout.take`), so a parameter's values never depend on the mesh.
"""

from __future__ import annotations

import zlib

import numpy as np


def normal(seed: int, name: str, shape: tuple, std: float) -> np.ndarray:
    """float64 N(0, std^2) array of the global `shape`, keyed by (seed, name)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.standard_normal(shape) * std
