"""Flight recorder and timeout for communication: a hang becomes an error.

Every `Communicator` operation is recorded here: the communicator's name, the op's
sequence number on that communicator (ranks of one communicator number their ops
identically, so equal numbers are the same collective), the op, the array's shape
and dtype, and start/end times. The last `capacity` finished ops stay in a ring
buffer next to the ops still pending. When a wait exceeds `timeout()` seconds the
communicator raises `CommTimeout`, whose message names the op and the recent
history; `recorder.snapshot()` gives the same data as plain records for tools
that want to compare ranks.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from typing import Any

from hpcpar.errors import ConfigError

DEFAULT_TIMEOUT_S = 600.0
_timeout_override: float | None = None


def timeout() -> float:
    """Seconds a communication op may wait: set_timeout(), else $HPCPAR_TIMEOUT, else 600."""
    if _timeout_override is not None:
        return _timeout_override
    raw = os.environ.get("HPCPAR_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(f"HPCPAR_TIMEOUT={raw!r} is not a positive number of seconds (e.g. 600)")
    return value


def set_timeout(seconds: float | None) -> None:
    """Set the process-wide communication timeout in seconds (None: back to the environment)."""
    global _timeout_override
    if seconds is not None and not seconds > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {seconds!r}")
    _timeout_override = None if seconds is None else float(seconds)


@dataclasses.dataclass
class OpRecord:
    """One communication op. `end` is None while it is pending. Times are time.monotonic()."""

    comm: str
    seq: int
    op: str
    shape: tuple
    dtype: Any  # a dtype object; formatted only when described (str() costs more than the op)
    nbytes: int
    start: float
    end: float | None = None
    peer: int | None = None  # the other rank of a send/recv

    def describe(self, now: float | None = None) -> str:
        peer = "" if self.peer is None else f" peer={self.peer}"
        if self.end is None:
            state = f"pending {((now or time.monotonic()) - self.start):.3f}s"
        else:
            state = f"took {self.end - self.start:.6f}s"
        return f"{self.comm}#{self.seq} {self.op} {self.dtype}{list(self.shape)}{peer} ({state})"


class FlightRecorder:
    """Ring buffer of the last `capacity` finished ops plus every pending op."""

    def __init__(self, capacity: int = 64):
        self._done: collections.deque[OpRecord] = collections.deque(maxlen=capacity)
        self._pending: dict[int, OpRecord] = {}
        self._lock = threading.Lock()  # ops may be waited on from a helper thread

    def begin(self, comm: str, seq: int, op: str, shape: tuple, dtype: Any, nbytes: int,
              peer: int | None = None) -> OpRecord:
        record = OpRecord(comm, seq, op, shape, dtype, nbytes, time.monotonic(), peer=peer)
        with self._lock:
            self._pending[id(record)] = record
        return record

    def end(self, record: OpRecord) -> None:
        record.end = time.monotonic()
        with self._lock:
            self._pending.pop(id(record), None)
            self._done.append(record)

    def snapshot(self) -> dict[str, list[OpRecord]]:
        """Copies of the finished ops (oldest first) and the pending ops (oldest first)."""
        with self._lock:
            done = [dataclasses.replace(r) for r in self._done]
            pending = sorted((dataclasses.replace(r) for r in self._pending.values()),
                             key=lambda r: r.start)
        return {"done": done, "pending": pending}

    def format(self, last: int = 5) -> str:
        """The last `last` finished ops and all pending ops, one per line."""
        snap = self.snapshot()
        now = time.monotonic()
        lines = [f"  done:    {r.describe(now)}" for r in snap["done"][-last:]]
        lines += [f"  pending: {r.describe(now)}" for r in snap["pending"]]
        return "\n".join(lines) if lines else "  (no communication recorded)"

    def clear(self) -> None:
        with self._lock:
            self._done.clear()
            self._pending.clear()


recorder = FlightRecorder()


class CommTimeout(TimeoutError):
    """A communication op waited longer than `timeout()` seconds (a peer never arrived)."""

    def __init__(self, record: OpRecord, waited: float):
        self.record = record
        self.waited = waited
        super().__init__(
            f"{record.op} on communicator '{record.comm}' (op #{record.seq}, "
            f"{record.dtype}{list(record.shape)}) waited {waited:.1f}s, longer than the "
            f"{timeout():g}s timeout (HPCPAR_TIMEOUT); a peer rank never reached this op.\n"
            f"Recent communication on this rank:\n{recorder.format()}")
