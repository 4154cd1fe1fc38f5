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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from hpcpar.parallel.ps.ownership import FlatSpace, server_ranges
from hpcpar.parallel.ps.wire import BYE, FLAG_SKIP, PULL_HEADER, PUSH_HEADER, TAG_PIECE, TAG_PULL, TAG_PUSH, TAG_SETUP
from hpcpar.runtime.comm import Communicator


@dataclass
class Reply:
    """What a worker rank learns from the servers after a push (the same on every rank of its replica)."""

    loss: float       # synchronous: mean over the global batch; else: over this replica's batch
    norm: float       # gradient norm before clipping (synchronous: global; else: this replica's)
    skipped: bool     # the update was not applied (a non-finite gradient or loss)
    staleness: int    # of this push (defined in the docstring of `server`)
    stop_at: int      # the step at which to stop for a preemption signal (-1: none)


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
    Collective with the servers' `ParameterServer` construction (the routes are sent there).
    """

    def __init__(self, named_params: list, space: FlatSpace, job: Communicator, servers: list[int], replica: int,
                 owns: Callable[[Any], bool], dtype, groups: list[list] | None = None):
        self.job, self.servers = job, servers
        ranges = server_ranges(space.total, len(servers))
        groups = groups if groups is not None else [[p for _, p in named_params]]
        group_of = {id(p): g for g, members in enumerate(groups) for p in members}
        self.pull_parts: list[list] = [[] for _ in servers]   # per server: (param, local positions)
        pushed: list[list] = [[[] for _ in groups] for _ in servers]   # per server, group: (param, local positions)
        pull_at: list[list] = [[] for _ in servers]            # per server: positions in its range
        for name, p in named_params:
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
            job.send(np.array([replica, push.size, pull.size, len(sizes)], dtype=np.int64), rank, TAG_SETUP)
            job.send(push, rank, TAG_SETUP)
            job.send(pull, rank, TAG_SETUP)
            job.send(np.array(sizes, dtype=np.int64), rank, TAG_SETUP)
            self.push_bufs.append(np.zeros(PUSH_HEADER + push.size, dtype=dtype))
            self.pull_bufs.append(np.zeros(PULL_HEADER + pull.size, dtype=dtype))
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

    def exchange(self, clock: int, loss: float, flags: int) -> Reply:
        """Push this rank's gradients of step `clock` (`.grad` of its owned parameters: the pieces
        `push_ready` has not sent yet, then the header with its loss sum and flags), wait for the
        pull and write the servers' parameters into `.data`."""
        pulls = [self.job.irecv(buf, rank, TAG_PULL) for buf, rank in zip(self.pull_bufs, self.servers)]
        self.push_ready(self.groups - 1)
        for buf, rank in zip(self.push_bufs, self.servers):
            buf[:PUSH_HEADER] = (clock, loss, flags)
            self._sends.append(self.job.isend(buf[:PUSH_HEADER], rank, TAG_PUSH))
        for h in self._sends:
            h.wait()
        self._sends, self._next = [], 0
        for h, buf, parts in zip(pulls, self.pull_bufs, self.pull_parts):
            h.wait()
            at = PULL_HEADER
            for p, sel in parts:
                p.data.reshape(-1)[sel] = buf[at:at + sel.size]
                at += sel.size
        heads = np.stack([buf[:PULL_HEADER] for buf in self.pull_bufs])
        return Reply(loss=float(heads[0, 0]), norm=float(heads[0, 1]), skipped=bool(int(heads[0, 2]) & FLAG_SKIP),
                     staleness=int(heads[:, 3].max()), stop_at=int(heads[:, 4].max()))

    def bye(self) -> None:
        """Tell every server this rank's run has ended: an empty message for each of its posted
        piece receives, then a header with clock BYE."""
        msg = np.array([BYE, 0.0, 0.0], dtype=self.push_bufs[0].dtype)
        for count, rank in zip(self.piece_counts, self.servers):
            for _ in range(count):
                self.job.send(msg[:0], rank, TAG_PIECE)
            self.job.send(msg, rank, TAG_PUSH)
