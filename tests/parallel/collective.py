"""Helpers for tests that run on every rank (importable from the tests in this folder)."""

import numpy as np
from mpi4py import MPI

from hpcpar import backend

WORLD = MPI.COMM_WORLD


def collective_assert(ok: bool, what: str) -> None:
    """Every rank reaches the same verdict (no rank left waiting in a later collective)."""
    failed = [(r, m) for r, m in enumerate(WORLD.allgather(None if ok else what)) if m]
    assert not failed, f"failed on ranks {[r for r, _ in failed]}: {failed[0][1]}"


def host(a) -> np.ndarray:
    """`a` (a NumPy or CuPy array, or anything np.asarray takes) as a NumPy array: the explicit
    copy to host where an array of the model's backend meets NumPy (CuPy refuses implicit ones)."""
    return backend.to_host(a)
