"""What the launcher's environment says, read before NumPy (or MPI) is loaded.

Two questions, answered from environment variables alone, so this module imports nothing but `os`
and must stay so (its callers run it before NumPy loads its BLAS):

- Was this process started by an MPI launcher (`under_mpi_launcher`)? On many clusters MPI_Init
  fails on a login node, where the one-process verbs (`hpcpar job render`, `plan`, `ckpt`, `plot`,
  `data prepare`, `sample`) are run: they initialise MPI only when a launcher started them.
- How many threads may each rank compute on (`set_default_threads`)? Oversubscribed BLAS threads
  (every rank spawning one thread per core) make a 4-rank job on 2 cores many times slower: when
  several ranks share a node's cores, each gets its share, filled in only where the user set none.
"""

from __future__ import annotations

import os

# What each launcher puts in its ranks' environment: MPICH's and Intel MPI's hydra (PMI_*), Open MPI
# (OMPI_COMM_WORLD_*), PMIx launchers such as `srun --mpi=pmix` and prterun (PMIX_RANK), Slurm's
# PMI-2 (`srun --mpi=pmi2`: PMI_RANK too), Cray PALS (PALS_RANKID), MVAPICH (MV2_COMM_WORLD_RANK).
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PALS_RANKID",
                      "MV2_COMM_WORLD_RANK")
# Launchers that say how many ranks run on this node (MPICH hydra, Open MPI, Slurm, PALS, MVAPICH).
_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE",
                    "PALS_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def under_mpi_launcher() -> bool:
    """True when an MPI launcher started this process (mpiexec, mpirun, srun with an MPI plugin)."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


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
