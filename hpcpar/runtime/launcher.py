"""Was this process started by an MPI launcher? Read from the environment alone, without MPI.

On many clusters MPI_Init fails on a login node, where the one-process verbs (`hpcpar job render`,
`plan`, `ckpt`, `plot`, `data prepare`, `sample`) are run: they initialise MPI only when a launcher
started them (then rank 0 works and the other ranks wait for its exit status).
"""

from __future__ import annotations

import os

# What each launcher puts in its ranks' environment: MPICH's and Intel MPI's hydra (PMI_*), Open MPI
# (OMPI_COMM_WORLD_*), PMIx launchers such as `srun --mpi=pmix` and prterun (PMIX_RANK), Slurm's
# PMI-2 (`srun --mpi=pmi2`: PMI_RANK too), Cray PALS (PALS_RANKID), MVAPICH (MV2_COMM_WORLD_RANK).
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PALS_RANKID",
                      "MV2_COMM_WORLD_RANK")


def under_mpi_launcher() -> bool:
    """True when an MPI launcher started this process (mpiexec, mpirun, srun with an MPI plugin)."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)
