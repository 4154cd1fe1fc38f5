"""Flight recorder, timeout and monitor thread: a hang becomes a report and an abort.

Every `Communicator` operation is recorded here: the communicator's name and group
(its world ranks), the op's sequence number on that communicator (ranks of one
communicator number their ops identically, so equal numbers are the same
collective), the op, the array's shape and dtype, and start/end times. The last
`capacity` finished ops stay in a ring buffer next to the ops still pending.

A monitor thread per rank (a daemon, started by the first `Communicator`, waking
every TICK_S) watches the ops this rank is *waiting* on. Blocking ops are MPI's
blocking calls, which cannot be interrupted: when one has waited longer than
`timeout()` the monitor asks every rank for its recorder state over a communicator
of its own (`install()` duplicates COMM_WORLD for it; each monitor answers such
requests), prints one report naming the ranks that never arrived at the op (or
never answered) and the last ops of every rank, and aborts the job. A
`Handle.wait()` that times out gets the same report delivered and raises
`CommTimeout`. Without MPI_THREAD_MULTIPLE there is no monitor: every op is then
waited on by polling, which raises `CommTimeout` with this rank's view only.

Debug mode (`set_check_every(n)`, `run.debug_check_every`): every n collectives on a
communicator its ranks compare a hash of their op sequences before the next op is
issued, and a mismatch raises `OpSequenceMismatch` naming the first op that differs.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import os
import socket
import sys
import threading
import time
from typing import Any

from hpcpar.errors import ConfigError

DEFAULT_TIMEOUT_S = 600.0
TICK_S = 0.25          # how often the monitor looks at the pending ops and serves report requests
REPLY_WAIT_S = 3.0     # how long a timed-out rank waits for the other ranks' states
RECENT_OPS = 5         # finished ops per rank shown in a report
DETAILED_RANKS = 16    # ranks whose last ops a report lists; the others are summarised
# A Handle.wait() raises on its own this long after its timeout if no report was delivered by then
# (the monitor is not running or died); a later timed-out rank waits as long for a lower one to report.
DELIVERY_GRACE_S = 3 * REPLY_WAIT_S + 2.0
_ASK, _REPLY = 1, 2    # message tags on the watchdog communicator

_timeout_override: float | None = None
_check_every = 0


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


def _safe_timeout() -> float:
    """timeout() for the monitor thread: a bad $HPCPAR_TIMEOUT is reported where the main thread reads it."""
    try:
        return timeout()
    except ConfigError:
        return DEFAULT_TIMEOUT_S


def set_timeout(seconds: float | None) -> None:
    """Set the process-wide communication timeout in seconds (None: back to the environment)."""
    global _timeout_override
    if seconds is not None and not seconds > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {seconds!r}")
    _timeout_override = None if seconds is None else float(seconds)


def check_every() -> int:
    """Collectives between op-sequence checks (0: off)."""
    return _check_every


def set_check_every(n: int) -> None:
    """Turn the op-sequence check on (every `n` collectives per communicator) or off (0).

    Set it to the same value on every rank before the communicators are used.
    """
    global _check_every
    if n < 0:
        raise ValueError(f"check interval must be >= 0, got {n!r}")
    _check_every = int(n)


@dataclasses.dataclass(slots=True, eq=False)  # eq=False: records are compared and hashed by identity
class OpRecord:
    """One communication op. Times are time.monotonic(); `end` is None while it is pending.

    `group` lists the communicator's world ranks ("0,2"); `waiting` is when this rank began
    to wait for the op (None while it has not); `blocking` ops are waited on at once, inside MPI's
    blocking call or by polling (the monitor aborts on a timeout); the others are a Handle's, polled
    when waited on (the monitor delivers `report`).
    """

    comm: str
    seq: int
    op: str
    shape: tuple
    dtype: Any  # a dtype object; formatted only when described (str() costs more than the op)
    nbytes: int
    start: float
    end: float | None = None
    peer: int | None = None  # the other rank of a send/recv (rank in the communicator)
    group: str = ""
    blocking: bool = False
    waiting: float | None = None
    report: str | None = None

    def describe(self, now: float | None = None) -> str:
        peer = "" if self.peer is None else f" peer={self.peer}"
        now = time.monotonic() if now is None else now
        if self.end is not None:
            state = f"took {self.end - self.start:.6f}s"
        elif self.waiting is not None:
            state = f"waiting {now - self.waiting:.3f}s"
        else:
            state = f"in flight {now - self.start:.3f}s, not waited on yet"
        return f"{self.comm}#{self.seq} {self.op} {self.dtype}{list(self.shape)}{peer} ({state})"


class FlightRecorder:
    """Ring buffer of the last `capacity` finished ops plus every pending op.

    Recording is on every op's path, so it is kept cheap. It takes no lock: under the GIL each
    update below is one attribute, dict, set or deque operation, and the monitor thread reads
    copies made by single C-level calls (`list(deque)`, `list(set)`, `dict(dict)`), which no
    update can interleave with. A blocking op (`enter`/`leave`, the hot path of every blocking
    collective) is kept as a plain tuple, made into an `OpRecord` only when a snapshot or report
    needs one; ops waited on later (`begin`/`end`) are `OpRecord`s from the start, since their
    waiting time and report are filled in while they are pending.
    """

    def __init__(self, capacity: int = 64):
        # OpRecords, and (entry, end) pairs of blocking ops (see enter)
        self._done: collections.deque = collections.deque(maxlen=capacity)
        self._pending: set[OpRecord] = set()
        self._blocked: tuple | None = None  # the blocking op this process is in (see enter)
        self._issued: dict[tuple[str, str], int] = {}  # (comm, group) -> ops issued on it
        self.last_activity = time.monotonic()  # when an op last began or ended

    def begin(self, comm: str, seq: int, op: str, shape: tuple, dtype: Any, nbytes: int,
              peer: int | None = None, group: str = "", blocking: bool = False) -> OpRecord:
        self.last_activity = now = time.monotonic()
        record = OpRecord(comm, seq, op, shape, dtype, nbytes, now, None, peer, group, blocking,
                          now if blocking else None)
        self._pending.add(record)
        self._issued[(comm, group)] = seq + 1
        return record

    @staticmethod
    def waiting(record: OpRecord) -> None:
        """This rank now waits for `record` (from here on its time counts against the timeout)."""
        if record.waiting is None:
            record.waiting = time.monotonic()

    def end(self, record: OpRecord) -> None:
        record.end = self.last_activity = time.monotonic()
        self._pending.discard(record)
        self._done.append(record)

    def enter(self, comm: str, seq: int, op: str, shape: tuple, dtype: Any, nbytes: int,
              peer: int | None = None, group: str = "") -> tuple:
        """`begin(..., blocking=True)` for the blocking ops' hot path: the op this process is now
        blocked in, as a tuple (the entry `leave` takes). One at a time: blocking ops are issued
        by the thread that does MPI, which they block."""
        self.last_activity = now = time.monotonic()
        self._blocked = entry = (comm, seq, op, shape, dtype, nbytes, now, peer, group)
        self._issued[(comm, group)] = seq + 1
        return entry

    def leave(self, entry: tuple) -> None:
        """The blocking op `entry` (from `enter`) returned."""
        self._blocked = None
        self.last_activity = end = time.monotonic()
        self._done.append((entry, end))

    def abandon(self) -> int:
        """Forget the ops still pending (after a rank's failure: they ended in its error, and
        the run goes on without them, training/resilience.py); returns how many. Each is kept
        among the finished ops, so that a later report still shows it."""
        pending, self._pending = list(self._pending), set()
        blocked, self._blocked = self._blocked, None
        now = self.last_activity = time.monotonic()
        for r in sorted(pending, key=lambda r: r.start):
            r.end = now
            self._done.append(r)
        if blocked is not None:
            self._done.append((blocked, now))
        return len(pending) + (blocked is not None)

    def snapshot(self) -> dict[str, list[OpRecord]]:
        """Copies of the finished ops (oldest first) and the pending ops (oldest first)."""
        done, pending, blocked = list(self._done), list(self._pending), self._blocked
        pending = [dataclasses.replace(r) for r in pending] + ([_blocked_record(blocked)] if blocked else [])
        return {"done": [dataclasses.replace(r) if isinstance(r, OpRecord) else _blocked_record(*r) for r in done],
                "pending": sorted(pending, key=lambda r: r.start)}

    def overdue(self, limit: float) -> list[OpRecord]:
        """The pending ops this rank has waited on for over `limit` s, not yet reported: the
        records themselves (a blocking op's: a record made of its entry)."""
        now = time.monotonic()
        late = [r for r in list(self._pending)
                if r.waiting is not None and r.report is None and now - r.waiting > limit]
        blocked = self._blocked
        if blocked is not None and now - blocked[6] > limit:
            late.append(_blocked_record(blocked))
        return sorted(late, key=lambda r: r.waiting)

    def format(self, last: int = RECENT_OPS) -> str:
        """The last `last` finished ops and all pending ops, one per line."""
        snap = self.snapshot()
        now = time.monotonic()
        lines = [f"  done:    {r.describe(now)}" for r in snap["done"][-last:]]
        lines += [f"  pending: {r.describe(now)}" for r in snap["pending"]]
        return "\n".join(lines) if lines else "  (no communication recorded)"

    def state(self, rank: int, timed_out: bool) -> dict:
        """This rank's state for a watchdog report (plain, picklable data)."""
        snap = self.snapshot()
        now = time.monotonic()
        issued = dict(self._issued)
        idle = now - self.last_activity
        return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "timed_out": timed_out,
                "idle_s": idle, "issued": issued,
                "done": [r.describe(now) for r in snap["done"][-RECENT_OPS:]],
                "pending": [(r.describe(now), r.waiting is not None) for r in snap["pending"]]}

    def clear(self) -> None:
        self._done.clear()
        self._pending.clear()
        self._blocked = None
        self._issued.clear()


def _blocked_record(entry: tuple, end: float | None = None) -> OpRecord:
    """The OpRecord of a blocking op's entry (`FlightRecorder.enter`), `end` once it returned."""
    comm, seq, op, shape, dtype, nbytes, start, peer, group = entry
    return OpRecord(comm, seq, op, shape, dtype, nbytes, start, end, peer, group, True, start)


recorder = FlightRecorder()


class CommTimeout(TimeoutError):
    """A communication op waited longer than `timeout()` seconds (a peer never arrived).

    `report` is the watchdog's report across ranks when the monitor produced one.
    """

    def __init__(self, record: OpRecord, waited: float, report: str | None = None):
        self.record = record
        self.waited = waited
        super().__init__(report or (
            f"{_headline(record, waited)}; a peer rank never reached this op.\n"
            f"Recent communication on this rank:\n{recorder.format()}"))


class OpSequenceMismatch(RuntimeError):
    """Debug mode: the ranks of a communicator issued different sequences of collectives."""


def _headline(record: OpRecord, waited: float) -> str:
    return (f"{record.op} on communicator '{record.comm}' (op #{record.seq}, {record.dtype}{list(record.shape)}) "
            f"waited {waited:.1f}s, longer than the {_safe_timeout():g}s timeout (run.timeout / HPCPAR_TIMEOUT)")


# ---- reports ------------------------------------------------------------------------------

def _rank_state_line(state: dict) -> str:
    """What a rank is doing, in words, from its state."""
    waiting = [d for d, w in state["pending"] if w]
    if waiting:
        return f"waiting in {waiting[0]}"
    in_flight = f", {len(state['pending'])} op(s) in flight" if state["pending"] else ""
    return (f"stalled outside communication (compute or I/O): not waiting on any op{in_flight}, "
            f"last op began or ended {state['idle_s']:.1f}s ago")


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def lost_nodes(states: dict[int, dict | None], hosts: list[str] | None) -> list[str]:
    """Lines naming each node none of whose ranks answered (`hosts`: world rank -> host name, from
    `install()`): a node whose ranks all fail to answer at once is lost (its processes died, or it
    is cut off from the network), which says more than each rank's silence does."""
    if not hosts:
        return []
    silent: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        silent.setdefault(host, []).append(r)
    return [f"Node {host} (ranks {_ranges(ranks)}): none of its ranks answered; the node is lost "
            "(its processes died, or it is cut off from the network)"
            for host, ranks in silent.items()
            if all(r in states and states[r] is None for r in ranks)]


def format_report(record: OpRecord, waited: float, rank: int, states: dict[int, dict | None],
                  asked: bool, hosts: list[str] | None = None) -> str:
    """The watchdog report for `record`, timed out on world rank `rank`.

    `states` maps world rank -> `FlightRecorder.state()` (None: did not answer); `asked` says
    whether other ranks could be asked at all (`install()` was called); `hosts` (world rank ->
    host name, when known) names the node of each silent rank and each lost node. The ranks
    named, and this one, get their last ops listed (at most DETAILED_RANKS); the others are
    grouped by what they are doing.
    """
    lines = [f"{_headline(record, waited)} on rank {rank}."]
    lines += lost_nodes(states, hosts)

    def where(r: int) -> str:
        return f" ({hosts[r]})" if hosts and r < len(hosts) else ""
    members = [int(r) for r in record.group.split(",")] if record.group else [rank]
    named = []
    if record.peer is not None:
        peer = members[record.peer] if record.peer < len(members) else record.peer
        state = states.get(peer)
        what = _rank_state_line(state) if state else f"unresponsive (no reply within {REPLY_WAIT_S:g}s)"
        lines.append(f"Its peer for {record.comm}#{record.seq} {record.op}: rank {peer}{where(peer)}: {what}")
        named.append(peer)
    else:
        missing = []
        for m in members:
            if m not in states:
                continue
            state = states[m]
            if state is None:
                missing.append(f"rank {m}{where(m)}: unresponsive (no reply within {REPLY_WAIT_S:g}s: dead, "
                               "cut off, or stuck in code that holds the Python GIL)")
            elif state["issued"].get((record.comm, record.group), 0) <= record.seq:
                missing.append(f"rank {m}: {_rank_state_line(state)}")
            else:
                continue
            named.append(m)
        if missing:
            lines.append(f"Never arrived at {record.comm}#{record.seq} (communicator of world ranks "
                         f"{_ranges(members)}):")
            lines += [f"  {m}" for m in missing]
        elif asked:
            lines.append(f"Every rank of {record.comm} that answered has issued op #{record.seq}.")
    if not asked:
        lines.append("Other ranks were not asked (watchdog.install() was not called); this rank's view only.")
    detailed = sorted(states) if len(states) <= DETAILED_RANKS else sorted({rank, *named})[:DETAILED_RANKS]
    lines.append("Last ops of each rank (oldest first):")
    for r in detailed:
        state = states[r]
        if state is None:
            lines.append(f"  rank {r}{where(r)}: unresponsive")
            continue
        lines.append(f"  rank {r} ({state['host']}, pid {state['pid']}): {_rank_state_line(state)}")
        lines += [f"    done:    {d}" for d in state["done"]]
        lines += [f"    pending: {d}" for d, _ in state["pending"]]
    groups: dict[str, list[int]] = {}
    for r in sorted(set(states) - set(detailed)):  # the rest, by what they do (times left out)
        state = states[r]
        what = "unresponsive" if state is None else _rank_state_line(state).split(" (")[0]
        groups.setdefault(what, []).append(r)
    lines += [f"  ranks {_ranges(rs)}: {what}" for what, rs in groups.items()]
    return "\n".join(lines)


# ---- the monitor thread ---------------------------------------------------------------------

class _Monitor:
    """Watches this rank's waits; serves and gathers report requests on its own communicator."""

    def __init__(self) -> None:
        from mpi4py import MPI
        self.MPI = MPI
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.comm = None  # the watchdog communicator, once install() made it
        self.hosts: list[str] | None = None  # world rank -> host name, gathered by install()
        self._stop = threading.Event()
        self._replies: list = []  # isend requests of our answers, completed lazily
        self._asked_id = 0
        self._defer_until: float | None = None  # deferring to a lower rank's report until then
        self._thread = threading.Thread(target=self._run, name="hpcpar-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # before MPI_Finalize: no MPI call may race with it

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * TICK_S + 1)

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self._tick()
            except self.MPI.Exception:
                # A rank of the job failed (ULFM reports it here too): this monitor goes on watching
                # this rank's waits, and a timeout still aborts, with this rank's view only.
                self.comm, self._replies = None, []
            except Exception as err:  # noqa: BLE001 - a broken monitor must not take the job down
                os.write(2, f"[rank {self.rank}] hpcpar watchdog: monitor stopped ({type(err).__name__}: "
                            f"{err}); hangs will not be reported\n".encode())
                return

    def _tick(self) -> None:
        if self.comm is not None:
            self._serve()
        overdue = recorder.overdue(_safe_timeout())
        if overdue and (self._defer_until is None or time.monotonic() >= self._defer_until):
            self._timed_out(overdue)

    def _serve(self) -> None:
        """Answer every report request that has arrived with this rank's recorder state."""
        MPI = self.MPI
        status = MPI.Status()
        while self.comm.iprobe(MPI.ANY_SOURCE, _ASK, status):
            ask = self.comm.recv(source=status.Get_source(), tag=_ASK)
            late = bool(recorder.overdue(_safe_timeout()))
            answer = {"id": ask["id"], "state": recorder.state(self.rank, late)}
            self._replies.append(self.comm.isend(answer, dest=status.Get_source(), tag=_REPLY))
        self._replies = [r for r in self._replies if not r.Test()]

    def _gather(self) -> dict[int, dict | None]:
        """Every rank's state (None for those that do not answer within REPLY_WAIT_S)."""
        MPI = self.MPI
        states: dict[int, dict | None] = {self.rank: recorder.state(self.rank, True)}
        if self.comm is None:
            return states
        self._asked_id += 1
        others = [r for r in range(self.comm.Get_size()) if r != self.rank]
        sends = [self.comm.isend({"id": self._asked_id}, dest=r, tag=_ASK) for r in others]
        states.update({r: None for r in others})
        deadline = time.monotonic() + REPLY_WAIT_S
        status = MPI.Status()
        waiting = set(others)
        while waiting and time.monotonic() < deadline:
            self._serve()  # a rank gathering at the same time waits for our answer too
            while self.comm.iprobe(MPI.ANY_SOURCE, _REPLY, status):
                answer = self.comm.recv(source=status.Get_source(), tag=_REPLY)
                if answer["id"] == self._asked_id:
                    states[status.Get_source()] = answer["state"]
                    waiting.discard(status.Get_source())
            time.sleep(0.01)
        self._replies += sends  # requests to ranks that did not answer stay unmatched: never wait on them
        return states

    def _timed_out(self, overdue: list[OpRecord]) -> None:
        record = overdue[0]
        waited = time.monotonic() - record.waiting
        states = self._gather()
        # Every rank waiting for the same straggler times out at about the same time: the
        # lowest such rank reports; the others wait for its abort, and report only if none comes.
        lower = [r for r, s in states.items() if s and s["timed_out"] and r < self.rank]
        if lower and self._defer_until is None:
            self._defer_until = time.monotonic() + DELIVERY_GRACE_S
            return
        self._defer_until = None
        report = format_report(record, waited, self.rank, states, asked=self.comm is not None, hosts=self.hosts)
        if any(r.blocking for r in overdue):
            tagged = "".join(f"[rank {self.rank}] {line}\n" for line in report.splitlines())
            sys.stdout.flush()
            sys.stderr.flush()
            # Straight to fd 2: a replaced sys.stderr (e.g. pytest's capture) dies with the abort.
            os.write(2, (f"[rank {self.rank}] CommTimeout: " + tagged.removeprefix(f"[rank {self.rank}] ")
                         + f"[rank {self.rank}] hpcpar watchdog: aborting the job\n").encode())
            time.sleep(0.2)  # lets the launcher forward the report before it kills the job
            abort_job(1)
        for r in overdue:  # polling waits raise CommTimeout with it
            r.report = report


ABORT_GRACE_S = 10  # after this long in MPI_Abort, the process ends itself (SIGALRM)


def abort_job(status: int) -> None:
    """MPI_Abort on COMM_WORLD, and the end of this process even when that never returns.

    MPI_Abort asks the launcher to end every rank; on a node cut off from the network the launcher's
    daemon cannot reach its head and may wait for it for as long as TCP does (minutes): SIGALRM,
    whose default action ends the process and which no Python code can delay (the GIL may be
    held inside MPI_Abort), makes sure this rank at least is gone ABORT_GRACE_S later.
    """
    import signal

    from mpi4py import MPI
    if hasattr(signal, "alarm"):
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(status)


_monitor: _Monitor | None = None
_monitor_lock = threading.Lock()


def monitor() -> bool:
    """Start the monitor thread if MPI allows it (MPI_THREAD_MULTIPLE); whether one runs."""
    global _monitor
    if _monitor is None:
        with _monitor_lock:
            from mpi4py import MPI
            if _monitor is None and MPI.Query_thread() == MPI.THREAD_MULTIPLE:
                _monitor = _Monitor()
    return _monitor is not None


def install() -> None:
    """Collective over COMM_WORLD: give the monitor a communicator to ask the other ranks on.

    Without it a timeout still aborts the job, but the report has this rank's view only.
    """
    from mpi4py import MPI
    if monitor() and _monitor.comm is None and MPI.COMM_WORLD.Get_size() > 1:
        comm = MPI.COMM_WORLD.Dup()
        # Once, now: a report must name the node of a rank that no longer answers.
        _monitor.hosts = comm.allgather(socket.gethostname())
        _monitor.comm = comm
