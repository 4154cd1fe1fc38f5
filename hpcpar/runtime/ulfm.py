"""ULFM (User-Level Failure Mitigation, the MPI Forum's fault-tolerance proposal): knowing that
a rank died, and making a working communicator of the survivors.

With ULFM (Open MPI 5 launched with `mpirun --with-ft ulfm`), an operation that involves a dead
rank raises `MPI.Exception` with error class MPI_ERR_PROC_FAILED on the survivors instead of
hanging (mpi4py's communicators return errors; every hpcpar communicator inherits that). A
survivor may instead be waiting on a communicator the dead rank is not in, with a survivor that
already gave up: so whoever learns of a failure revokes every communicator it belongs to
(`revoke`), and an operation on a revoked communicator raises MPI_ERR_REVOKED everywhere. Then
`shrink` gives the survivors a new communicator (MPI_Comm_shrink), on which ordinary collectives
work again.

Without ULFM (the MPICH wheel, Debian's MPICH and Open MPI 4, Open MPI 5 without `--with-ft
ulfm`) a dead rank ends the job: the launcher kills the others (`has_ulfm` tells which).
Pitfalls found on this project's machines (../shared/notes/cluster.md): pickled (lower-case)
collectives run on a hidden duplicate communicator that a revoke does not reach, and
MPI_Finalize after a failure can hang.
"""

from __future__ import annotations

import os
from typing import Iterable

from mpi4py import MPI

# Error classes of a failure (MPI_ERR_PROC_FAILED, _PENDING, MPI_ERR_REVOKED); mpi4py names them
# where the library defines them (MPICH gives the same number as MPI_ERR_UNKNOWN: never a failure).
_FAILURE_NAMES = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")


def has_ulfm() -> bool:
    """Whether this MPI reports a rank's failure to the survivors (and can revoke and shrink)."""
    if "Open MPI" in MPI.Get_library_version():
        # Open MPI 5 accepts MPI_Comm_revoke always, but only `--with-ft ulfm` keeps the job alive.
        if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes", "on"):
            return False
    probe = MPI.COMM_SELF.Dup()
    try:
        probe.Revoke()
    except (NotImplementedError, MPI.Exception):
        return False
    finally:
        probe.Free()
    return True


def failure_classes() -> set[int]:
    """The error classes that mean a rank failed or a communicator was revoked (none without ULFM)."""
    if not has_ulfm():
        return set()
    return {getattr(MPI, n) for n in _FAILURE_NAMES if hasattr(MPI, n)} - {MPI.ERR_UNKNOWN}


def is_failure(exc: BaseException, classes: set[int]) -> bool:
    """Whether `exc` (or an exception it was raised from) is an MPI error of `classes`."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in classes:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def revoke(comms: Iterable[MPI.Comm]) -> None:
    """Revoke every communicator in `comms` (a survivor blocked on one of them then gets
    MPI_ERR_REVOKED); a communicator already revoked or freed is skipped."""
    for comm in comms:
        if comm == MPI.COMM_NULL or comm in (MPI.COMM_SELF,):
            continue
        try:
            comm.Revoke()
        except MPI.Exception:
            pass


def shrink(comm: MPI.Comm) -> MPI.Comm:
    """The survivors of `comm` (revoked or not) as a new communicator, ranks in their old order;
    collective over the survivors."""
    return comm.Shrink()
