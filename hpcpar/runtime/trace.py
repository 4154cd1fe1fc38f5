"""A per-rank timeline of spans, merged into one Chrome trace (open in Perfetto or chrome://tracing).

`Tracer.record(name, category, start, end, tid, args)` keeps one span (tid: the timeline row, a
model chunk, or a named row such as context parallelism's); start and end are
`time.perf_counter()` readings. Callers test `tracer.enabled` once and then skip the clock
reads and records entirely, so a disabled tracer costs nothing per event.

`write_chrome_trace(path, comm)` is collective over `comm`: every rank's spans are gathered to
rank 0 (pickled: this runs once, off the hot path), shifted onto one wall-clock axis (each rank
measures the offset from its perf_counter to time.time() when created; good to the clock sync of
the nodes), and written as Trace Event Format JSON: complete events ("ph": "X") with pid = the
rank, tid = the model chunk, timestamps in microseconds from the earliest event.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


class Tracer:
    """Spans recorded on one rank.

    Args:
        rank: this process's rank in the communicator the trace will be gathered over (pid).
        enabled: whether callers should record anything (a disabled tracer still writes a
            valid, empty trace).
        label: the process name shown in the viewer, e.g. "rank 3 (pp 1, dp 0, tp 1)".
    """

    def __init__(self, rank: int, enabled: bool = True, label: str | None = None):
        self.rank = rank
        self.enabled = enabled
        self.label = label if label is not None else f"rank {rank}"
        self.events: list[tuple[str, str, float, float, int, dict]] = []
        self.thread_names: dict[int, str] = {}  # tid -> row name in the viewer (default "chunk <tid>")
        self._wall_offset = time.time() - time.perf_counter()

    def record(self, name: str, category: str, start: float, end: float, tid: int = 0,
               args: dict | None = None) -> None:
        """One span [start, end] (perf_counter seconds) on thread row `tid`."""
        self.events.append((name, category, start, end, tid, args or {}))

    def chrome_events(self) -> list[dict[str, Any]]:
        """This rank's spans as Trace Event Format dicts, times in wall-clock microseconds."""
        out: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                                      "args": {"name": self.label}},
                                     {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
                                      "args": {"sort_index": self.rank}}]
        for tid in sorted({e[4] for e in self.events}):
            out.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                        "args": {"name": self.thread_names.get(tid, f"chunk {tid}")}})
        for name, category, start, end, tid, args in self.events:
            out.append({"name": name, "cat": category, "ph": "X", "pid": self.rank, "tid": tid,
                        "ts": (start + self._wall_offset) * 1e6, "dur": (end - start) * 1e6, "args": args})
        return out

    def write_chrome_trace(self, path: str | os.PathLike, comm) -> None:
        """Gather every rank's spans to rank 0 of `comm` (a `hpcpar.runtime.comm.Communicator`;
        collective) and write them there as one JSON file, atomically."""
        gathered = comm.all_gather_object(self.chrome_events())
        if comm.rank != 0:
            return
        events = [e for rank_events in gathered for e in rank_events]
        origin = min((e["ts"] for e in events if e["ph"] == "X"), default=0.0)
        for e in events:
            if e["ph"] == "X":
                e["ts"] -= origin
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)
