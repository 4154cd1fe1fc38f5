"""Preemption: SIGTERM or SIGUSR1 (what Slurm/PBS send before the time limit) end the run
cleanly at the next step boundary.

The handler only sets a flag. At each step boundary every rank contributes its flag to
one tiny all-reduce (max), so all ranks agree on the same step even when only some of
them were signalled; the training loop then saves a checkpoint and exits with
`train.REQUEUE_STATUS` (75).
"""

from __future__ import annotations

import signal

import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_requested = False


def _handler(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    global _requested
    _requested = True


def install() -> None:
    """Route SIGTERM and SIGUSR1 to the flag (main thread only, as Python requires)."""
    global _requested
    _requested = False
    for sig in SIGNALS:
        signal.signal(sig, _handler)


def requested() -> bool:
    """Whether this rank has been signalled."""
    return _requested


def agreed(world) -> bool:
    """Collective: True on every rank when any rank has been signalled."""
    flag = np.array([1 if _requested else 0], dtype=np.int32)
    return bool(world.all_reduce(flag, op="max")[0])
