"""Failing together: work every rank runs, whose failure on any rank raises on every rank.

A rank that raises while the others go on into their next collective leaves them waiting there
until the watchdog ends the job. `agree` runs this rank's part of the work, then exchanges the
outcome in one all-gather that every rank reaches whether its work failed or not, so that either
every rank returns or every rank raises the same error. It raises in one of two ways:

- `error=SomeError` (checkpoints): every exception is caught, since a bug on one rank must not
  strand the others either, and every rank raises `SomeError("rank R: <one line> (and N other
  rank(s))")` for the lowest failing rank R (no "rank R: " on one process). An exception of that
  type keeps its text; any other is described in one line (`one_line`, or the caller's `describe`).
- `error=None` (user errors found on some ranks only, e.g. a check that parameter servers cannot
  make themselves): only `HpcparError`s are caught, and the lowest failing rank's error object is
  raised on every rank, type and text unchanged (it must pickle); any other exception propagates
  on its own rank with its traceback.

Works over any communicator with `rank`, `size`, `all_gather_object` and `ibarrier`
(`runtime.comm.Communicator`, `runtime.solo.SoloCommunicator`); imports no MPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from hpcpar.errors import HpcparError

if TYPE_CHECKING:
    from hpcpar.runtime.comm import Communicator
    from hpcpar.runtime.solo import SoloCommunicator


def one_line(err: BaseException) -> str:
    """`err` as one line: its type's name and its text, whitespace runs collapsed to one space."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def arrive(comm: Communicator | SoloCommunicator) -> None:
    """Wait until every rank got here without spinning: a blocking MPI collective busy-waits
    (~1/3 of a core, MPICH), taking the CPU from the ranks still writing or reading, where
    the non-blocking barrier's wait yields and then sleeps (3% of a core)."""
    comm.ibarrier().wait()


def agree(comm: Communicator | SoloCommunicator, work: Callable[[], Any] | None = None, *, share: bool = False,
          patient: bool = False, error: type[Exception] | None = None,
          describe: Callable[[BaseException], str] = one_line) -> Any:
    """Run `work` on this rank; if it failed on any rank of `comm`, raise on every rank (collective).

    Args:
        comm: the ranks that agree; every one calls `agree`, in the same order among its collectives.
        work: this rank's part; None when the rank has nothing to do but learn the verdict.
        share: return every rank's result (a list by rank; small picklable objects only), exchanged
            in the same all-gather; else this rank's result.
        patient: the ranks finish `work` far apart (it writes or reads data): they first wait for
            each other without spinning (`arrive`).
        error: the exception type every rank raises, built from the failing ranks' one-line texts;
            None: the lowest failing rank's `HpcparError` itself (see the module docstring).
        describe: with `error`, the one-line text of a caught exception not of that type.
    Returns:
        This rank's result of `work` (None without work), or every rank's with `share`.
    """
    caught = Exception if error is not None else HpcparError
    result, failure = None, None
    try:
        if work is not None:
            result = work()
    except caught as err:  # noqa: BLE001 - raised again on every rank below
        failure = err if error is None else str(err) if isinstance(err, error) else describe(err)
    if patient:
        arrive(comm)
    gathered = comm.all_gather_object((result if share else None, failure))
    failed = [(rank, f) for rank, (_, f) in enumerate(gathered) if f is not None]
    if failed:
        rank, first = failed[0]
        if error is None:
            raise first
        more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        prefix = f"rank {rank}: " if comm.size > 1 else ""
        raise error(f"{prefix}{first}{more}")
    return [r for r, _ in gathered] if share else result
