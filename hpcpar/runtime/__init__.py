"""The MPI runtime: the only package that imports mpi4py at module level.

Communicators and their collectives (`comm`) with what moves their bytes (`transports`: MPI,
NCCL), how a rank waits for them (`waiting`) and what arrays travel as (`buffers`); the Cartesian
mesh (`mesh`), pure degree and placement arithmetic (`topology`), the watchdog and flight
recorder, failing together, preemption signals, agreement (one error on every rank) and the
per-rank trace.
"""
