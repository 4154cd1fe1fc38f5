"""Waiting for an op: inside MPI's blocking call, or by polling that yields the core.

`mpi_waits_block` is the policy: blocking ops on host arrays wait in MPI's blocking calls (the
watchdog's monitor thread watches them) unless this node runs more ranks than cores. Everything
else, non-blocking ops (`Handle.wait()`), GPU ops and blocking ops where ranks share cores, is
completed by `wait_for`, one polling loop that yields the core to the ranks sharing it and raises
`watchdog.CommTimeout` when the monitor reports a timeout (or, without a monitor, past the
timeout on its own); blocking ops that poll use the same loop through `wait_blocked`, recorded
as blocked-in like an op in MPI's own blocking call. `wait_any` polls several ops and completes
the first that finishes.
"""

from __future__ import annotations

import os
import time

from hpcpar import environment
from hpcpar.errors import ConfigError
from hpcpar.runtime import watchdog

# Polling. MPI moves data only inside MPI calls, so while a transfer can still be
# running the loop calls Test() back to back, yielding the core every few polls
# (ranks that share cores would otherwise starve the peer they wait for; MPICH's
# own blocking wait yields too), and reading the clock only every _POLLS_PER_CLOCK
# polls: whatever the loop does between two Test() calls delays a large transfer
# (a 1 MiB all-reduce over 4 ranks on 2 cores took 10% longer with a clock read
# every 4 polls). That phase lasts _SPIN_S, or longer for big
# messages (bytes / _SPIN_BYTES_PER_S). A wait beyond it means a peer is late:
# the loop then sleeps between polls, from _FIRST_SLEEP_S doubling up to
# _MAX_SLEEP_S, to give the core away. bench/allreduce.py measures the cost.
_POLLS_PER_YIELD = 4
_POLLS_PER_CLOCK = 64
_SPIN_S = 5e-3
_SPIN_BYTES_PER_S = 2.5e8
_FIRST_SLEEP_S = 1e-6
_MAX_SLEEP_S = 1e-3


def mpi_waits_block() -> bool:
    """Whether blocking ops may wait inside MPI's blocking calls (given a monitor to watch them).

    `HPCPAR_MPI_WAIT=block|poll` decides; unset or `auto`: block, unless this node runs more ranks
    than it has cores (`threads.local_ranks()` against this process's cores). Then every op polls
    in `wait_for`, which yields the core: some MPIs' blocking waits spin through their time slice
    without yielding (Debian's MPICH 4.0 with UCX: a 4-rank barrier on 2 cores took 8 ms, and the
    parallel test suite ran 10x slower than with polling), and a rank spinning there holds the core
    that the peer it waits for needs.
    """
    choice = os.environ.get("HPCPAR_MPI_WAIT", "auto").strip().lower() or "auto"
    if choice not in ("auto", "block", "poll"):
        raise ConfigError(f"HPCPAR_MPI_WAIT={choice!r} is not a wait mode; use auto, block or poll")
    if choice != "auto":
        return choice == "block"
    return environment.local_ranks() <= environment.cores()


def wait_for(request, record: watchdog.OpRecord, watched: bool) -> None:
    """Poll `request.Test()` until done; raise CommTimeout when the watchdog reports a timeout.

    The monitor thread delivers its report (`record.report`); with no monitor, or none
    delivered, this raises on its own past the timeout (plus a grace period when a monitor
    thread watches this rank's waits: `watched`).
    """
    test = request.Test
    if not test():
        watchdog.recorder.waiting(record)
        _poll(test, record.waiting, record.nbytes, watched, record)
    watchdog.recorder.end(record)


def wait_blocked(request, entry: tuple) -> None:
    """Poll `request.Test()` until done for a blocking op recorded as blocked-in (`entry`, from
    `recorder.enter`; the caller `leave`s it): the cheapest record, for the blocking ops that poll
    where ranks share cores. The monitor turns its timeout into a report and an abort, as for an
    op blocked in MPI's own call; should none come (the monitor died), this raises CommTimeout on
    its own past the timeout plus the delivery grace."""
    test = request.Test
    if not test():
        _poll(test, entry[6], entry[5], True, None, entry)


def _poll(test, since: float, nbytes: int, watched: bool, record: watchdog.OpRecord | None,
          entry: tuple | None = None) -> None:
    """The polling loop of `wait_for` and `wait_blocked`: call `test` until it returns True (see
    the constants above for the cadence). An op waited for since `since` (time.monotonic()) with
    `nbytes` to move; its `record` (an OpRecord, whose delivered report ends the wait) or, for a
    blocked-in op, its recorder `entry`."""
    spin_until = since + max(_SPIN_S, nbytes / _SPIN_BYTES_PER_S)
    limit = None  # read once the spinning is over: most waits end before
    delay = _FIRST_SLEEP_S
    polls = 0
    yield_core = os.sched_yield
    while not test():
        polls += 1
        if polls % _POLLS_PER_YIELD:
            continue
        if limit is None:  # spinning
            if polls % _POLLS_PER_CLOCK or time.monotonic() < spin_until:
                yield_core()
                continue
            limit = watchdog.timeout() + (watchdog.DELIVERY_GRACE_S if watched else 0.0)
        now = time.monotonic()
        report = None if record is None else record.report
        if report is not None or now - since > limit:
            if record is None:
                record = watchdog._blocked_record(entry)
            error = watchdog.CommTimeout(record, now - since, report)
            record.report = str(error)  # reported: the monitor leaves it alone from now on
            raise error
        time.sleep(delay)
        delay = min(2 * delay, _MAX_SLEEP_S)


def wait_any(handles: list) -> int:
    """Complete whichever of `handles` (non-blocking host ops of one communicator; None entries
    are skipped) finishes first and return its index: a server's loop over its clients' messages.
    Polls as `wait_for` does and raises `watchdog.CommTimeout` on the oldest op when none finishes
    within the timeout (the monitor sees them all as waiting meanwhile)."""
    live = [(i, h) for i, h in enumerate(handles) if h is not None]
    if not live:
        raise ValueError("wait_any needs at least one handle")
    for i, h in live:
        if h.request is None:   # done already (or nothing to poll): complete it
            h.wait()
            return i
    since = time.monotonic()
    records = [h.record for _, h in live]
    delay, polls, spinning = _FIRST_SLEEP_S, 0, True
    try:
        while True:
            for i, h in live:
                if h.request.Test():
                    h.wait()
                    return i
            polls += 1
            if polls == 1:
                for r in records:
                    watchdog.recorder.waiting(r)
            if polls % _POLLS_PER_YIELD:
                continue
            if spinning:
                if polls % _POLLS_PER_CLOCK or time.monotonic() < since + _SPIN_S:
                    os.sched_yield()
                    continue
                spinning = False
            now = time.monotonic()
            reported = next((r for r in records if r.report is not None), None)
            if reported is not None or now - since > watchdog.timeout():
                record = reported or min(records, key=lambda r: r.start)
                error = watchdog.CommTimeout(record, now - since, record.report)
                record.report = str(error)
                raise error
            time.sleep(delay)
            delay = min(2 * delay, _MAX_SLEEP_S)
    finally:
        for r in records:   # the ones still pending are not waited for any more
            if r.end is None:
                r.waiting = None
