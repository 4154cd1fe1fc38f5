"""The MPI runtime: the only package whose modules import mpi4py at module level.

Communicators and their collectives (`comm`) with what moves their bytes (`transports`: MPI,
NCCL), how a rank waits for them (`waiting`) and what arrays travel as (`buffers`); the Cartesian
mesh (`mesh`) and its pure degree and placement arithmetic (`topology`); the watchdog and flight
recorder (`watchdog`), failing together (`failure`), preemption signals (`preemption`), one error
on every rank (`agreement`), the per-rank trace (`trace`). `solo` is a communicator of one process
that needs no MPI, for the one-process tools; `topology`, `agreement` and `solo` import no mpi4py.
"""
