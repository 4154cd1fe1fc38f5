"""Threads per rank: when several ranks share a node's cores, give each its share.

Oversubscribed BLAS threads (every rank spawning one thread per core) make a
4-rank job on 2 cores many times slower. This runs before NumPy is imported and
only fills in variables the user did not set.
"""

from __future__ import annotations

import os

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
# Launchers that say how many ranks run on this node (MPICH hydra, Open MPI, Slurm, PALS).
_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE",
                    "PALS_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


def local_ranks() -> int:
    """Ranks on this node according to the launcher's environment (1 when not launched)."""
    for var in _LOCAL_SIZE_VARS:
        value = os.environ.get(var, "").split("(")[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_default_threads() -> int:
    """Set the BLAS/OpenMP thread variables to cores // local ranks where unset."""
    threads = max(1, cores() // local_ranks())
    if os.environ.get("OMP_NUM_THREADS", "").strip().isdigit():
        threads = int(os.environ["OMP_NUM_THREADS"])
    for var in _THREAD_VARS:
        if not os.environ.get(var, "").strip():  # unset or empty
            os.environ[var] = str(threads)
    return threads


def blas_threads() -> int:
    """The BLAS/OpenMP threads this process was given (after `set_default_threads`)."""
    value = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "1"
    return max(1, int(value)) if value.strip().isdigit() else 1
