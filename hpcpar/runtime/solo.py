"""A communicator of one process that needs no MPI: rank 0 of 1.

The one-process verbs (`hpcpar ckpt info|verify|export|import`, `hpcpar sample`) load and save
checkpoints with the same collective code a job runs, over this stand-in for
`runtime.comm.Communicator.local()`. It implements the part of the Communicator interface that
code uses (rank, size, object collectives, barriers, splits), where with one rank every collective
returns its input at once, and imports no mpi4py: the verbs run where MPI cannot start (a login
node).
"""

from __future__ import annotations

from typing import Any


class _Completed:
    """A non-blocking op that completed as it started (what every op of a lone rank does)."""

    def wait(self) -> None:
        return None


class SoloCommunicator:
    """This process alone, without MPI: `rank` 0 of `size` 1."""

    rank = 0
    size = 1
    name = "solo"

    def __repr__(self) -> str:
        return "SoloCommunicator(rank 0 of 1)"

    def all_gather_object(self, obj: Any) -> list:
        """[obj]: every rank's object, in rank order."""
        return [obj]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """`obj`: the root's object (this process is the root)."""
        if root != 0:
            raise ValueError(f"broadcast_object: root {root} is not a rank of a 1-rank communicator")
        return obj

    def ibarrier(self) -> _Completed:
        """A barrier of one rank: complete at once."""
        return _Completed()

    def barrier(self) -> None:
        """A barrier of one rank: returns at once."""

    def io_comm(self):
        """Collective file I/O through a library (parallel HDF5: shared-file checkpoints) needs an MPI
        communicator, which this one has not."""
        raise RuntimeError("a communicator without MPI cannot do MPI-IO (shared-file checkpoints); "
                           "save per_rank, or use runtime.comm.Communicator.local()")

    def split(self, color: int, key: int = 0, name: str | None = None) -> SoloCommunicator:
        """This process alone again (a split of one rank)."""
        return SoloCommunicator()

    def split_by_node(self) -> SoloCommunicator:
        """The ranks on this node: this process alone (itself)."""
        return self

    def free(self) -> None:
        """Nothing to release."""
