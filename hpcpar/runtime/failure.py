"""Fail together: no rank is left hanging when another one fails.

`install()` replaces the exception hooks: an uncaught exception on any rank prints
that rank's traceback, every line tagged `[rank N]`, and calls MPI_Abort, which
ends every rank of the job. User errors (`HpcparError`: bad config, flags, paths)
are different: they are usually found by every rank at once (validation runs
everywhere before the first collective) and should be printed once, not N times.
`report_user_error` checks whether every rank has the same complaint with a
barrier that may time out, on a communicator of its own.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

from mpi4py import MPI

from hpcpar.errors import user_error_text
from hpcpar.runtime import watchdog

USER_ERROR_WAIT_S = 5.0  # how long a user error waits for the other ranks to report theirs

_error_comm: MPI.Comm | None = None


def _rank() -> int:
    return MPI.COMM_WORLD.Get_rank()


def _world_size() -> int:
    return MPI.COMM_WORLD.Get_size()


def _tagged(text: str) -> str:
    prefix = f"[rank {_rank()}] "
    return "".join(prefix + line + "\n" for line in text.rstrip("\n").splitlines())


ABORT_DELAY_S = 0.2  # lets the launcher forward what this rank printed before it kills the job


def _abort(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_DELAY_S)
    watchdog.abort_job(status)


def _excepthook(exc_type, exc, tb) -> None:
    if isinstance(exc, watchdog.CommTimeout):
        # Its report names the op, the ranks that never came and every rank's last ops: the
        # Python traceback of where this rank waited would only bury it.
        text = f"CommTimeout: {exc}\nhpcpar watchdog: aborting the job"
    else:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(_tagged(text))
    sys.stderr.flush()
    if _world_size() > 1:
        _abort(1)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    # A dead helper thread (e.g. one overlapping communication) would leave its peers
    # waiting forever: treat it like an uncaught exception in the main thread.
    if args.exc_type is SystemExit:
        return
    _excepthook(args.exc_type, args.exc_value, args.exc_traceback)


def install() -> None:
    """Abort the whole job on any uncaught exception (its traceback always shown), and let the
    watchdog ask every rank for its state (collective: duplicates COMM_WORLD)."""
    global _error_comm
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook
    if _error_comm is None and _world_size() > 1:
        _error_comm = MPI.COMM_WORLD.Dup()
    watchdog.install()  # a timed-out op is then reported with every rank's state


def _everyone_arrives(timeout_s: float) -> bool:
    """An Ibarrier on the error communicator: did every rank reach it within `timeout_s`? (Not
    after a rank failed, ULFM's error: then this rank reports alone.)"""
    try:
        request = _error_comm.Ibarrier()
        deadline = time.monotonic() + timeout_s
        while not request.Test():
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-3)
    except MPI.Exception:
        return False
    return True


def report_user_error(err: BaseException, debug: bool = False) -> None:
    """Print a user error once: `hpcpar: error: <msg>`.

    When every rank reports an error within USER_ERROR_WAIT_S seconds (validation
    errors are found everywhere), rank 0 prints the message and this returns, so
    the caller can exit with status 2 on every rank. Otherwise only this rank has
    the error: it prints `hpcpar: error (rank N): <msg>` and aborts the job with
    status 2, since its peers would wait for it forever. `debug` adds the traceback.
    """
    if _world_size() == 1:
        sys.stderr.write(user_error_text(err, debug))
        sys.stderr.flush()
        return
    details = "".join(traceback.format_exception(type(err), err, err.__traceback__)) if debug else ""
    if _error_comm is not None and _everyone_arrives(USER_ERROR_WAIT_S):
        if _rank() == 0:
            sys.stderr.write(_tagged(details) if details else "")
            sys.stderr.write(f"hpcpar: error: {err}\n")
            sys.stderr.flush()
        return
    sys.stderr.write(_tagged(details) if details else "")
    sys.stderr.write(f"hpcpar: error (rank {_rank()}): {err}\n")
    _abort(2)
