"""Preemption: SIGTERM or SIGUSR1 (what Slurm/PBS send before the time limit) end the run
cleanly at the next step boundary.

The handler only sets a flag. Every step each rank puts its flag into the step's one world
collective (`training.trainer.Trainer._agree`; with a parameter server, into its push), so all ranks
agree on the same step even when only some of them were signalled; the training loop then
saves a checkpoint after that step and exits with `launch.jobs.REQUEUE_STATUS` (75).
"""

from __future__ import annotations

import signal

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
