"""A worker rank's side of parameter-server training: push gradients, pull parameters (`ParameterClient`).

A step (clock c) on a worker rank: forward and backward of its micro-batches, gradients
accumulated locally (a tied copy's summed into its weight within the replica, as without
servers), and a *push* to every server (`wire`): its gradient elements in the server's range,
sent in pieces, one per gradient bucket, each as soon as the last micro-batch's backward has
completed its bucket (overlapping the rest of the backward), the header last. Every element has
one owner per replica: tp-split parameters on every tp rank, tp-replicated ones (LayerNorm,
biases) on tp rank 0, the embedding on the first stage (its tied head copy is not pushed). The
server answers with a *pull* of every parameter element the rank holds in its range, copies
included, so the rank's arrays become the server's (`Reply`: the header's figures). Index lists
are exchanged once (`ParameterClient` setup); per step only values travel, by point-to-point
messages on the job communicator, seen by the watchdog and the flight recorder like every other op.

A row-sparse parameter (`Parameter.sparse_grad`: an untied wte, with `sparse_rows`) leaves the
pieces and the dense pull (`RowRoutes`, `wire`): after the backward the rank pushes its
nonzero rows and names the rows its next step looks up (with tensor parallelism row 0 too, which
the vocabulary-parallel lookup reads for other ranks' ids), and the pull brings back those rows
only (every row at a sync point). The rows it is not sent keep older values, which is exact:
nothing on a worker reads them before they are pulled again (no optimizer here, the untied head
is a parameter of its own, and an evaluation or the run's end is a sync point; a preemption stop
is one too under synchronous servers, while under SSP and async a server other than server 0 may
answer the last pull before it learns of the stop, leaving rows stale on a worker that then saves
nothing of them: the servers hold the model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from hpcpar import backend
from hpcpar.parallel.ps.ownership import FlatSpace, row_runs, run_positions, server_ranges
from hpcpar.parallel.ps.wire import (
    BYE, DENSE, FLAG_SKIP, PULL_HEADER, PUSH_HEADER, TAG_PIECE, TAG_PULL, TAG_PUSH, TAG_ROW_IDS, TAG_ROW_VALUES,
    TAG_SETUP,
)
from hpcpar.runtime.comm import Communicator


@dataclass
class Reply:
    """What a worker rank learns from the servers after a push (the same on every rank of its replica)."""

    loss: float       # synchronous: mean over the global batch; else: over this replica's batch
    norm: float       # gradient norm before clipping (synchronous: global; else: this replica's)
    skipped: bool     # the update was not applied (a non-finite gradient or loss)
    staleness: int    # of this push (defined in the docstring of `server`)
    stop_at: int      # the step at which to stop for a preemption signal (-1: none)


class RowRoutes:
    """A row-sparse parameter's routes to the servers and its per-step row messages (module doc, `wire`).

    Args:
        name: the parameter's global name; param: the Parameter (`sparse_grad`), local [rows, C]
            (a tp rank's vocabulary shard under tp), each row consecutive in the flat space.
        space: the `FlatSpace`; ranges: the servers' ranges.

    Attributes:
        runs: per server, `ownership.row_runs` (local, at, count) of every local row.
        held: per server, the local rows with elements in its range; every: their local
            positions, back to back (what a dense push sends and a dense pull writes).
        table: int64 [V], global row (token id) -> local row, -1 outside this rank's shard.
        steps: per server and step, {"push_sparse", "push_dense", "pull_sparse", "pull_dense"}.
        bytes: {"pushed": the row messages' bytes sent, "pulled": the rows' bytes received}, in all.
    """

    def __init__(self, name: str, param, space: FlatSpace, ranges: list[tuple[int, int]]):
        idx = space.local_indices(name, param.layout)
        width = math.prod(space.shapes[name][1:])
        self.param, self.local_rows = param, idx.size // width
        self.runs = [row_runs(idx, width, lo, hi) for lo, hi in ranges]
        self.held = [np.flatnonzero(count) for _, _, count in self.runs]
        self.every = [run_positions(local, count, held) for (local, _, count), held in zip(self.runs, self.held)]
        heads = idx[::width]
        real = np.flatnonzero(heads >= 0)
        self.table = np.full(space.shapes[name][0], -1, dtype=np.int64)
        self.table[(heads[real] - space.offsets[name]) // width] = real
        self.wanted: list = [None] * len(ranges)   # per server: the rows this step's pull asked for (None: all)
        self.steps = {"push_sparse": 0, "push_dense": 0, "pull_sparse": 0, "pull_dense": 0}
        self.bytes = {"pushed": 0, "pulled": 0}

    def push(self, job: Communicator, servers: list[int], tokens) -> list:
        """Send each server holding some of the rows its row messages: the nonzero rows of `.grad`
        (every row in the range when that is not more bytes) and the rows of `tokens`, the global
        ids the next step looks up (None: unknown, every row). Returns the sends' handles."""
        xp = backend.array_module(self.param.grad)
        grad = self.param.grad.reshape(self.local_rows, -1)
        nonzero = backend.to_host(xp.flatnonzero(xp.any(grad != 0, axis=1))).astype(np.int64)
        wanted = None
        if tokens is not None:
            local = self.table[np.asarray(tokens).reshape(-1)]
            # A vocabulary-parallel lookup reads local row 0 for the ids other tp ranks own (and
            # multiplies it by 0): pulled too, so that no stale row is ever read.
            wanted = np.unique(np.where(local >= 0, local, 0))
        flat, item = self.param.grad.reshape(-1), self.param.grad.dtype.itemsize
        sends = []
        for s, rank in enumerate(servers):
            if not self.held[s].size:
                continue
            local, _, count = self.runs[s]
            rows = nonzero[count[nonzero] > 0]
            dense = 8 * rows.size + item * int(count[rows].sum()) >= item * self.every[s].size
            want = self.wanted[s] = None if wanted is None else wanted[count[wanted] > 0]
            head = [DENSE if dense else rows.size, DENSE if want is None else want.size]
            ids = np.concatenate([np.array(head, dtype=np.int64)] + ([] if dense else [rows])
                                 + ([] if want is None else [want]))
            values = flat[xp.asarray(self.every[s] if dense else run_positions(local, count, rows))]
            sends += [job.isend(ids, rank, TAG_ROW_IDS), job.isend(values, rank, TAG_ROW_VALUES)]
            self.steps["push_dense" if dense else "push_sparse"] += 1
            self.bytes["pushed"] += ids.nbytes + values.nbytes
        return sends

    def pull(self, s: int, values, rows: int) -> None:
        """Write server `s`'s pulled rows into `.data`: `values`, the rows this step asked for in
        order (`rows` their count), or every row in the range (`rows` = -1)."""
        if not self.held[s].size:
            return
        local, _, count = self.runs[s]
        at = self.every[s] if rows == DENSE else run_positions(local, count, self.wanted[s])
        self.param.data.reshape(-1)[backend.array_module(self.param.data).asarray(at)] = values[:at.size]
        self.steps["pull_dense" if rows == DENSE else "pull_sparse"] += 1
        self.bytes["pulled"] += at.size * values.itemsize


class ParameterClient:
    """A worker rank's side: the routes of its elements to the servers, push and pull.

    A push travels in *pieces*, one per group of parameters (`groups`, in push order) and server
    whose range holds elements of the group this rank owns, then the header [clock, loss, flags]
    (`TAG_PIECE` then `TAG_PUSH`). `push_ready(g)` sends the pieces of groups up to g as soon as
    their gradients are final, during the last micro-batch's backward (the trainer calls it from
    `DataParallel.on_bucket_ready`: a group is a gradient bucket); `exchange` sends the rest and
    the header, which is only known at the end. Every piece of one server has the same tag and
    goes in group order, so MPI's non-overtaking rule matches the k-th piece to the server's k-th
    posted receive: the server's buffer is [header | piece 0 | piece 1 ...], the message of the
    single push it replaces, filled in place.

    Args:
        named_params: (global name, Parameter) of this rank's parameters (a tied copy is named by
            the weight it mirrors through `tied_to`).
        space: the `FlatSpace` of the model's global tensors.
        job: the communicator over every rank, workers first, servers last.
        servers: the servers' ranks in `job`.
        replica: this rank's replica (its dp coordinate).
        owns: whether this rank pushes a parameter's gradient (one owner per element per replica).
        dtype: the parameters' dtype (the wire's).
        groups: lists of parameters in push order, together holding every pushed one (default:
            one group, the push in one piece).
        sparse_rows: an owned row-sparse parameter (`sparse_grad`, at most one: the untied wte)
            travels by rows (`RowRoutes`, `rows`; train.sparse_embedding = "auto"); False: dense.
    Collective with the servers' `ParameterServer` construction (the routes are sent there).
    """

    def __init__(self, named_params: list, space: FlatSpace, job: Communicator, servers: list[int], replica: int,
                 owns: Callable[[Any], bool], dtype, groups: list[list] | None = None, sparse_rows: bool = False):
        self.job, self.servers = job, servers
        ranges = server_ranges(space.total, len(servers))
        groups = groups if groups is not None else [[p for _, p in named_params]]
        group_of = {id(p): g for g, members in enumerate(groups) for p in members}
        rowed = [(n, p) for n, p in named_params if sparse_rows and getattr(p, "sparse_grad", False) and owns(p)]
        if len(rowed) > 1:
            raise ValueError(f"ParameterClient: one row-sparse parameter at most, not {[n for n, _ in rowed]}")
        self.rows = RowRoutes(*rowed[0], space, ranges) if rowed else None
        self.pull_parts: list[list] = [[] for _ in servers]   # per server: (param, local positions)
        pushed: list[list] = [[[] for _ in groups] for _ in servers]   # per server, group: (param, local positions)
        pull_at: list[list] = [[] for _ in servers]            # per server: positions in its range
        for name, p in named_params:
            if self.rows is not None and p is self.rows.param:
                continue   # its rows travel apart
            idx = space.local_indices(p.tied_to or name, p.layout)
            for s, (lo, hi) in enumerate(ranges):
                sel = np.nonzero((idx >= lo) & (idx < hi))[0]
                if not sel.size:
                    continue
                self.pull_parts[s].append((p, sel))
                pull_at[s].append(idx[sel] - lo)
                if owns(p):
                    if id(p) not in group_of:
                        raise ValueError(f"ParameterClient: pushed parameter {name} is in no group; "
                                         "groups must hold every parameter this rank owns")
                    pushed[s][group_of[id(p)]].append((p, sel, idx[sel] - lo))
        # Per group: its pieces as (server index, first element after the header, [(param, local positions)]).
        self.pieces: list[list] = [[] for _ in groups]
        self.piece_counts: list[int] = []   # per server
        self.push_bufs, self.pull_bufs = [], []
        for s, rank in enumerate(servers):
            at, push_at, sizes = PUSH_HEADER, [], []
            for g, parts in enumerate(pushed[s]):
                n = sum(sel.size for _, sel, _ in parts)
                if n:
                    self.pieces[g].append((s, at, [(p, sel) for p, sel, _ in parts]))
                    push_at.extend(pos for _, _, pos in parts)
                    sizes.append(n)
                    at += n
            self.piece_counts.append(len(sizes))
            push = np.concatenate(push_at) if push_at else np.zeros(0, np.int64)
            pull = np.concatenate(pull_at[s]) if pull_at[s] else np.zeros(0, np.int64)
            held = self.rows is not None and self.rows.held[s].size > 0
            job.send(np.array([replica, push.size, pull.size, len(sizes), self.rows.local_rows if held else 0],
                              dtype=np.int64), rank, TAG_SETUP)
            job.send(push, rank, TAG_SETUP)
            job.send(pull, rank, TAG_SETUP)
            job.send(np.array(sizes, dtype=np.int64), rank, TAG_SETUP)
            if held:   # per local row: (first position in the range, count)
                job.send(np.stack(self.rows.runs[s][1:]), rank, TAG_SETUP)
            self.push_bufs.append(np.zeros(PUSH_HEADER + push.size, dtype=dtype))
            # The pull: [header | dense elements | rows], room for every row (fewer come when sparse).
            self.pull_bufs.append(np.zeros(PULL_HEADER + pull.size + (self.rows.every[s].size if held else 0),
                                           dtype=dtype))
        self.groups = len(groups)
        self._next = 0       # the first group of this step's push not sent yet
        self._sends: list = []

    def push_ready(self, group: int) -> None:
        """The gradients of `group` (and of every group before it) are final on this rank: send
        their pieces not sent yet to every server (non-blocking)."""
        for g in range(self._next, group + 1):
            for s, at, parts in self.pieces[g]:
                buf, first = self.push_bufs[s], at
                for p, sel in parts:
                    np.take(p.grad.reshape(-1), sel, out=buf[at:at + sel.size])
                    at += sel.size
                self._sends.append(self.job.isend(buf[first:at], self.servers[s], TAG_PIECE))
        self._next = max(self._next, group + 1)
        if self._sends:
            self.job.progress()   # MPI moves the pieces in flight only inside MPI calls

    def exchange(self, clock: int, loss: float, flags: int, want=None) -> Reply:
        """Push this rank's gradients of step `clock` (`.grad` of its owned parameters: the pieces
        `push_ready` has not sent yet, the row-sparse parameter's rows, then the header with its
        loss sum and flags), wait for the pull and write the servers' parameters into `.data`.
        `want`: the global token ids this rank's next step looks up (int64; None: unknown), the
        row-sparse parameter's rows to pull."""
        pulls = [self.job.irecv(buf, rank, TAG_PULL) for buf, rank in zip(self.pull_bufs, self.servers)]
        self.push_ready(self.groups - 1)
        if self.rows is not None:
            self._sends += self.rows.push(self.job, self.servers, want)
        for buf, rank in zip(self.push_bufs, self.servers):
            buf[:PUSH_HEADER] = (clock, loss, flags)
            self._sends.append(self.job.isend(buf[:PUSH_HEADER], rank, TAG_PUSH))
        for h in self._sends:
            h.wait()
        self._sends, self._next = [], 0
        for s, (h, buf, parts) in enumerate(zip(pulls, self.pull_bufs, self.pull_parts)):
            h.wait()
            at = PULL_HEADER
            for p, sel in parts:
                p.data.reshape(-1)[sel] = buf[at:at + sel.size]
                at += sel.size
            if self.rows is not None:
                self.rows.pull(s, buf[at:], int(buf[PULL_HEADER - 1]))
        heads = np.stack([buf[:PULL_HEADER] for buf in self.pull_bufs])
        return Reply(loss=float(heads[0, 0]), norm=float(heads[0, 1]), skipped=bool(int(heads[0, 2]) & FLAG_SKIP),
                     staleness=int(heads[:, 3].max()), stop_at=int(heads[:, 4].max()))

    def bye(self) -> None:
        """Tell every server this rank's run has ended: an empty message for each of its posted
        piece receives (and row messages), then a header with clock BYE."""
        msg = np.array([BYE, 0.0, 0.0], dtype=self.push_bufs[0].dtype)
        for s, (count, rank) in enumerate(zip(self.piece_counts, self.servers)):
            for _ in range(count):
                self.job.send(msg[:0], rank, TAG_PIECE)
            if self.rows is not None and self.rows.held[s].size:
                self.job.send(np.zeros(2, dtype=np.int64), rank, TAG_ROW_IDS)
                self.job.send(msg[:0], rank, TAG_ROW_VALUES)
            self.job.send(msg, rank, TAG_PUSH)
