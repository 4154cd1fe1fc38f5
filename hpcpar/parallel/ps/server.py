"""A parameter server rank: its range of the parameters, the optimizer over it, and the loop that
answers the workers' pushes (`ParameterServer`; ps-lite, Li et al., OSDI'14; stale synchronous
parallel, Ho et al., NIPS'13).

Ranks. The last S ranks of the job are servers; the first W form the training mesh (dp x tp x pp)
exactly as without servers, and each dp coordinate is a *replica* (R = dp of them). Server s owns
range s of the flat parameter vector (`ownership`). Pushes arrive in any order: the server takes
them as they come (`Communicator.wait_any`) and answers each replica with a pull (`wire`).

Modes (`ps.mode`, `ps.staleness` = k):

- bounded, k = 0, synchronous: the server waits for every replica's push of clock c, adds the
  replicas' gradients in replica order, divides by R, clips by the global norm (its square summed
  over the servers with one all-gather among them), takes one optimizer step with the learning
  rate of step c and answers everyone. That is all-reduce data parallelism's arithmetic: the same
  losses as one process, in float64 to rounding.
- bounded, k > 0, stale synchronous parallel: a replica's push (once all its ranks' parts are
  in) joins the *open step*, the server's sum for the lowest step not yet taken; a push of an
  earlier step (a straggler's) joins it late. Once R - 1 replicas have pushed the open step's
  clock (one backup replica, as in synchronous SGD with backup workers), the server takes the
  step: the weighted mean of the pushes in it, clipped by its global norm (one all-gather among
  the servers), one optimizer step. A pull of step c is answered once step c is taken and the
  slowest replica has completed clock c + 1 - k, so no replica runs more than k steps ahead.
  Only the backup's gradient is late; a global batch's worth of gradient per AdamW step keeps
  the synchronous run's noise (AdamW is not additive: a step per push, tried first, cost more).
  A push is *late* by tau = the optimizer steps the server took between sending the parameters
  it was computed on and its arrival (0 for a fresh push); it enters the mean with weight
  `stale_weight ** tau` (1: as fresh; 0: dropped, as a backup worker's gradient is in
  synchronous SGD with backup workers, Chen et al. 2016). A late gradient feeds back the state
  of an earlier step, which an optimizer near its stability limit (AdamW at the default job's
  lr) turns into lost progress: docs/parallelism.md#parameter-server has the measurements.
- async: the same steps, every pull answered once its step is taken, without a bound.

The *staleness* of an applied push of clock c is c minus the clocks the slowest replica had
completed when its parameters were sent: 0 when synchronous, at most k under SSP. Every applied
push's staleness and lateness tau are recorded (`ParameterServer.staleness`, `.late`).

Sync points. A pull that precedes an evaluation, a checkpoint, the end of the run or a
preemption stop (`ownership.sync_points`) waits for every replica in every mode, so those see one
model. A preemption signal travels in the pushes; server 0 picks the step every replica can still
reach (`stop_at` in its pulls). When a worker's run ends it sends each server a push of empty
pieces with clock -1 (`wire.BYE`), and the server's loop ends once every worker has.

Row-sparse parameters (an untied wte, `client.RowRoutes`). A worker holding one pushes its
nonzero rows (or all of them, dense) in two row messages before its header, added into its
replica's gradient like a piece, and names the rows its next step looks up; its pull carries
those rows only, or every row when the step it leads to is a sync point (or follows a preemption
signal seen in a push: the stop is one) and when the wanted rows are not fewer bytes (`wire`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from hpcpar.layout import Layout
from hpcpar.parallel.ps.ownership import FlatSpace, run_positions, server_ranges
from hpcpar.parallel.ps.wire import (
    BYE, DENSE, FLAG_PREEMPT, FLAG_SKIP, PULL_HEADER, PUSH_HEADER, TAG_PIECE, TAG_PULL, TAG_PUSH, TAG_ROW_IDS,
    TAG_ROW_VALUES, TAG_SETUP,
)
from hpcpar.runtime.comm import Communicator
from hpcpar.state import SavedState, StoredState


class _Segment:
    """The part of one global tensor inside a server's range: what the optimizer updates (views
    into the server's flat arrays; `no_decay` as the parameter's)."""

    __slots__ = ("name", "lo", "hi", "data", "grad", "no_decay", "layout")

    def __init__(self, name: str, lo: int, hi: int, data, no_decay: bool, layout: Layout):
        self.name, self.lo, self.hi, self.data, self.grad = name, lo, hi, data, None
        self.no_decay, self.layout = no_decay, layout


class ParameterServer:
    """A server rank: its range of the flat parameter vector, the optimizer over it, the loop.

    Args:
        init: {global name: (full initial array, no_decay)} for every global tensor (the model as
            one process builds it; only this server's range is kept).
        job: the communicator over every rank; workers are ranks 0 .. workers - 1.
        servers: the communicator of the servers alone (the synchronous norm).
        workers: W, the worker ranks.
        make_optimizer: builds the optimizer over a list of objects with `.data`, `.grad`, `.no_decay`.
        mode: "bounded" or "async"; staleness: k (bounded).
        lr_at: the learning rate of a step.
        max_norm: gradient clipping (0: off) of the synchronous step.
        microbatches: per replica per step (the loss is a mean over them).
        stale_weight: SSP, async: a push tau optimizer steps late enters its step's mean with
            weight stale_weight ** tau (see the module docstring).
    Collective with every worker's `ParameterClient` (the routes arrive here).
    """

    def __init__(self, init: dict, job: Communicator, servers: Communicator, workers: int,
                 make_optimizer: Callable[[list], Any], mode: str, staleness: int,
                 lr_at: Callable[[int], float], max_norm: float, microbatches: int, stale_weight: float):
        self.job, self.server_comm, self.workers = job, servers, workers
        self.index = servers.rank
        self.space = FlatSpace({n: a.shape for n, (a, _) in init.items()})
        self.lo, self.hi = server_ranges(self.space.total, servers.size)[self.index]
        dtype = next(iter(init.values()))[0].dtype
        self.params = np.zeros(self.hi - self.lo, dtype=dtype)
        self.segments: list[_Segment] = []
        for name, first, last in self.space.pieces(self.lo, self.hi):
            array, no_decay = init[name]
            at = self.space.offsets[name] + first - self.lo
            view = self.params[at:at + last - first]
            view[...] = np.asarray(array).reshape(-1)[first:last]
            layout = Layout.replicated(self.space.shapes[name]).flat_range(first, last)
            self.segments.append(_Segment(name, at, at + last - first, view, no_decay, layout))
        self.optimizer = make_optimizer(self.segments)
        self.mode, self.staleness_bound = mode, staleness
        self.synchronous = mode == "bounded" and staleness == 0
        self.lr_at, self.max_norm, self.microbatches = lr_at, max_norm, microbatches
        self.stale_weight = stale_weight
        # Routes: what each worker rank pushes and pulls (positions in this range), its replica.
        self.replica_of, self.push_at, self.pull_at = [], [], []
        sizes = []   # per worker: the elements of each piece of its push, in order
        # Per worker holding a row-sparse parameter's rows in this range (else None): per local
        # row its (first position, count) here, and the positions of every row, back to back.
        self.runs: list = [None] * workers
        self.every_row: list = [None] * workers
        for w in range(workers):
            head = job.recv(np.zeros(5, dtype=np.int64), w, TAG_SETUP)
            self.replica_of.append(int(head[0]))
            self.push_at.append(job.recv(np.zeros(int(head[1]), dtype=np.int64), w, TAG_SETUP))
            self.pull_at.append(job.recv(np.zeros(int(head[2]), dtype=np.int64), w, TAG_SETUP))
            sizes.append(job.recv(np.zeros(int(head[3]), dtype=np.int64), w, TAG_SETUP))
            if head[4]:
                first, count = self.runs[w] = job.recv(np.zeros((2, int(head[4])), dtype=np.int64), w, TAG_SETUP)
                self.every_row[w] = run_positions(first, count, np.flatnonzero(count))
        self.replicas = max(self.replica_of) + 1
        self.members = [[w for w in range(workers) if self.replica_of[w] == r] for r in range(self.replicas)]
        self.push_bufs = [np.zeros(PUSH_HEADER + a.size, dtype=dtype) for a in self.push_at]
        # A push's pieces land in place in its buffer, [header | piece 0 | piece 1 ...] (views).
        self.piece_views = [[buf[PUSH_HEADER + end - n:PUSH_HEADER + end] for n, end in zip(counts, np.cumsum(counts))]
                            for buf, counts in zip(self.push_bufs, sizes)]
        self.piece_recvs: list[list] = [[] for _ in range(workers)]
        # Row messages: room for every row in the range (a sparse push fills a prefix); the
        # rows each worker's next pull brings (None: every row).
        self.row_bufs = [None if e is None else (np.zeros(2 + 2 * int(np.count_nonzero(r[1])), dtype=np.int64),
                                                 np.zeros(e.size, dtype=dtype))
                         for r, e in zip(self.runs, self.every_row)]
        self.row_recvs: list[list] = [[] for _ in range(workers)]
        self.wanted: list = [None] * workers
        self.pull_bufs = [np.zeros(PULL_HEADER + a.size + (0 if e is None else e.size), dtype=dtype)
                          for a, e in zip(self.pull_at, self.every_row)]
        self.grads = [np.zeros(self.hi - self.lo, dtype=dtype) for _ in range(self.replicas)]
        self.total = np.zeros(self.hi - self.lo, dtype=dtype)   # the summed pushes of the next step
        # SSP, async: the open step (its clock, replicas that pushed that clock, the weights of
        # the pushes summed in `total`); it is taken once `quorum` replicas have pushed its clock
        # (one backup). `sent[r]`: the open step when replica r was last sent the parameters.
        self.open = self.fresh = 0
        self.pending = 0.0
        self.sent = [0] * self.replicas
        self.quorum = max(1, self.replicas - 1)
        self.last_norm, self.last_skipped = 0.0, False           # SSP, async: the latest step's
        self.staleness: list[tuple[int, int, int]] = []   # (step, replica, staleness) of every applied push
        self.late: list[int] = []                          # SSP, async: tau of every applied push
        self.bytes_in = self.bytes_out = 0.0   # of this `serve`
        self.preempted = False                 # a push of this `serve` carried FLAG_PREEMPT

    # -- one replica's push ------------------------------------------------------------------------

    def _post(self, w: int):
        """Post the receives of worker `w`'s next push (its pieces, its row messages, its header);
        returns the header's handle: the push is in once it and `_take`'s wait for the rest complete."""
        self.piece_recvs[w] = [self.job.irecv(v, w, TAG_PIECE) for v in self.piece_views[w]]
        if self.row_bufs[w] is not None:
            ids, values = self.row_bufs[w]
            self.row_recvs[w] = [self.job.irecv(ids, w, TAG_ROW_IDS), self.job.irecv(values, w, TAG_ROW_VALUES)]
        return self.job.irecv(self.push_bufs[w][:PUSH_HEADER], w, TAG_PUSH)

    def _take(self, w: int) -> tuple[int, float, int]:
        """Worker `w`'s header is in: wait for its pieces and row messages (sent before it; a bye's
        are empty), add its pushed gradient into its replica's buffer; (clock, loss, flags)."""
        for h in self.piece_recvs[w] + self.row_recvs[w]:
            h.wait()
        self.piece_recvs[w], self.row_recvs[w] = [], []
        buf = self.push_bufs[w]
        clock, loss, flags = int(buf[0]), float(buf[1]), int(buf[2])
        if clock != BYE:
            # One owner per element per replica: positions are distinct within a replica.
            self.grads[self.replica_of[w]][self.push_at[w]] += buf[PUSH_HEADER:]
            self.bytes_in += buf.nbytes
            if self.row_bufs[w] is not None:
                self._take_rows(w)
        return clock, loss, flags

    def _take_rows(self, w: int) -> None:
        """Worker `w`'s row messages are in: add its pushed rows into its replica's buffer and
        keep the rows its next pull asks for (`wire`)."""
        ids, values = self.row_bufs[w]
        n_push, n_want = int(ids[0]), int(ids[1])
        pushed = max(n_push, 0)
        first, count = self.runs[w]
        at = self.every_row[w] if n_push == DENSE else run_positions(first, count, ids[2:2 + pushed])
        self.grads[self.replica_of[w]][at] += values[:at.size]
        self.wanted[w] = None if n_want == DENSE else ids[2 + pushed:2 + pushed + n_want].copy()
        self.bytes_in += 8 * (2 + pushed + max(n_want, 0)) + values[:at.size].nbytes

    def _step(self, grad, lr: float) -> None:
        for seg in self.segments:
            seg.grad = grad[seg.lo:seg.hi]
        self.optimizer.step(lr)

    def _clip_and_step(self, grad, lr: float, skip: bool) -> tuple[float, bool]:
        """The norm of `grad` over every server's range (one all-gather among the servers), then,
        unless it or `skip` says no, clip `grad` in place by it and take one optimizer step.
        Returns (norm, skipped)."""
        parts = self.server_comm.all_gather(np.array([float(np.dot(grad, grad))], dtype=np.float64))
        norm = math.sqrt(math.fsum(float(v) for v in parts))
        skipped = skip or not math.isfinite(norm)
        if not skipped:
            if self.max_norm > 0 and self.max_norm / (norm + 1e-6) < 1.0:
                grad *= self.max_norm / (norm + 1e-6)
            self._step(grad, lr)
        return norm, skipped

    def _apply_synchronous(self, clock: int, loss: float) -> tuple[float, float, bool]:
        """Every replica's push of `clock` is in: average (replica order), clip, one step."""
        total = self.total
        total[...] = self.grads[0]
        for g in self.grads[1:]:
            total += g
        total /= self.replicas
        mean_loss = loss / (self.replicas * self.microbatches)
        norm, skipped = self._clip_and_step(total, self.lr_at(clock), not math.isfinite(mean_loss))
        return mean_loss, norm, skipped

    def _apply_replica(self, r: int, clock: int, loss: float) -> tuple[float, float, bool]:
        """One replica's push of `clock` is in (SSP, async): add it to the open step's sum; once
        `quorum` replicas have pushed the open step's clock, take the step. Returns the replica's
        loss, and the norm and verdict of the latest step (a push whose loss is not finite is left
        out, and says so). The push weighs stale_weight ** tau, tau = the steps taken since the
        parameters it was computed on were sent (0: fresh, weight 1)."""
        mean_loss = loss / self.microbatches
        if not math.isfinite(mean_loss):
            return mean_loss, self.last_norm, True
        tau = self.open - self.sent[r]
        weight = self.stale_weight ** tau
        if weight == 1.0:
            self.total += self.grads[r]
        elif weight > 0.0:
            self.total += weight * self.grads[r]
        self.pending += weight
        self.late.append(tau)
        self.fresh += clock == self.open    # late pushes (clock < open) join the open step
        if self.fresh >= self.quorum:
            self._flush()
        return mean_loss, self.last_norm, self.last_skipped

    def _flush(self) -> None:
        """The open step: one optimizer step with the weighted mean of its pushes, clipped by its
        global norm as the synchronous step is (the learning rate of the step's number). Collective
        among the servers: each takes its u-th step from the same pushes' clocks."""
        self.total /= self.pending
        self.last_norm, self.last_skipped = self._clip_and_step(self.total, self.lr_at(self.optimizer.step_count),
                                                                False)
        self.total[...] = 0
        self.pending, self.fresh = 0.0, 0
        self.open += 1

    # -- the loop -------------------------------------------------------------------------------------

    def serve(self, start: int, end: int, points: set[int], at_point: Callable[[int], None]) -> tuple[int, bool]:
        """Answer pushes of steps start .. end - 1 until every worker has said bye. `points`: the
        sync points; `at_point(step)` runs (collectively, e.g. a checkpoint) once every replica has
        completed the steps before a sync point and been answered. Returns (the step the run
        ended at, whether a preemption stop ended it before `end`)."""
        self.staleness, self.late, self.bytes_in, self.bytes_out = [], [], 0.0, 0.0
        self.preempted = False
        # SSP, async: the open step. Every replica holds the parameters of `start` (a sync point).
        self.open, self.fresh, self.pending, self.sent = start, 0, 0.0, [start] * self.replicas
        self.total[...] = 0
        done = [start] * self.replicas           # steps each replica has completed (applied)
        arrived = [0] * self.replicas            # ranks of the replica whose current push is in
        loss = [0.0] * self.replicas
        flags = [0] * self.replicas
        read = [start] * self.replicas           # the slowest replica's done when r was last answered
        waiting: dict[int, tuple] = {}            # replica -> (clock, loss, norm, skipped, staleness) to answer
        sends: list = [None] * self.workers
        stop_at = -1
        byes = 0
        recvs = [self._post(w) for w in range(self.workers)]
        point = min((p for p in points if p > start), default=end)
        while byes < self.workers:
            self._answer(waiting, done, read, sends, recvs, points, stop_at)
            if not waiting and min(done) == point and point < end:
                at_point(point)
                point = min((p for p in points if p > point), default=end)
                continue
            w = self.job.wait_any(recvs)
            recvs[w] = None
            clock, w_loss, w_flags = self._take(w)
            if clock == BYE:
                byes += 1
                continue
            r = self.replica_of[w]
            arrived[r] += 1
            loss[r] += w_loss
            flags[r] |= w_flags
            self.preempted |= bool(w_flags & FLAG_PREEMPT)   # the stop is near: pull every row
            if w_flags & FLAG_PREEMPT and stop_at < 0 and self.index == 0:
                # The first step every replica can still stop at: a replica waiting for its pull
                # stops when it has it; one computing (or pushing) its step done[q] stops after it.
                stop_at = max(d + (0 if q in waiting else 1) for q, d in enumerate(done))
                points = points | {stop_at}
                point = min(point, stop_at)
            if arrived[r] < len(self.members[r]):
                continue
            if self.synchronous:
                if any(a < len(m) for a, m in zip(arrived, self.members)):
                    continue
                mean_loss, g_norm, skipped = self._apply_synchronous(clock, sum(loss))
                for q in range(self.replicas):
                    waiting[q] = (clock, mean_loss, g_norm, skipped, clock - read[q])
                    self.staleness.append((clock, q, clock - read[q]))
                    self._reset(q, done, arrived, loss, flags)
            else:
                mean_loss, r_norm, skipped = self._apply_replica(r, clock, loss[r])
                waiting[r] = (clock, mean_loss, r_norm, skipped, clock - read[r])
                self.staleness.append((clock, r, clock - read[r]))
                self._reset(r, done, arrived, loss, flags)
        for h in sends:
            if h is not None:
                h.wait()
        return min(done), min(done) < end

    def report(self, steps: int) -> dict:
        """This server's figures of the last `serve` (`steps` steps): range, bytes, staleness."""
        return {"rank": self.job.rank, "range": [self.lo, self.hi], "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "steps": steps, "staleness": [s for _, _, s in self.staleness],
                "late": self.late}

    def _reset(self, r: int, done: list, arrived: list, loss: list, flags: list) -> None:
        done[r] += 1
        arrived[r], loss[r], flags[r] = 0, 0.0, 0
        self.grads[r][...] = 0

    def _answer(self, waiting: dict, done: list, read: list, sends: list, recvs: list, points: set,
                stop_at: int) -> None:
        """Send the pulls whose condition holds: synchronous and before a sync point, once every
        replica has completed the step; SSP, once the slowest is within k; async, at once."""
        slowest = min(done)
        for r in sorted(waiting):
            clock, mean_loss, norm, skipped, staleness = waiting[r]
            nxt = clock + 1
            if self.synchronous or nxt in points or nxt == stop_at:
                ready = slowest >= nxt and (self.synchronous or self.open >= nxt)
            elif self.mode == "bounded":
                ready = self.open >= nxt and slowest >= nxt - self.staleness_bound
            else:
                ready = self.open >= nxt
            if not ready:
                continue
            del waiting[r]
            whole = nxt in points or nxt == stop_at or self.preempted   # every row of a row-sparse parameter
            read[r], self.sent[r] = slowest, self.open
            for w in self.members[r]:
                if sends[w] is not None:
                    sends[w].wait()
                buf = self.pull_bufs[w]
                end = PULL_HEADER + self.pull_at[w].size
                np.take(self.params, self.pull_at[w], out=buf[PULL_HEADER:end])
                rows, end = self._pull_rows(w, buf, end, whole)
                buf[:PULL_HEADER] = (mean_loss, norm, FLAG_SKIP if skipped else 0, staleness, stop_at, rows)
                self.bytes_out += buf[:end].nbytes
                recvs[w] = self._post(w)   # its next push, or its bye
                sends[w] = self.job.isend(buf[:end], w, TAG_PULL)

    def _pull_rows(self, w: int, buf, end: int, whole: bool) -> tuple[int, int]:
        """Put the row-sparse parameter's rows of worker `w`'s pull into `buf` from `end`: the
        rows it asked for, or every row (`whole`, or when they are not fewer). Returns (the pull
        header's rows: their count or DENSE, the message's end)."""
        if self.every_row[w] is None:
            return DENSE, end
        first, count = self.runs[w]
        wanted = self.wanted[w]
        if whole or wanted is None or int(count[wanted].sum()) >= self.every_row[w].size:
            rows, at = DENSE, self.every_row[w]
        else:
            rows, at = wanted.size, run_positions(first, count, wanted)
        np.take(self.params, at, out=buf[end:end + at.size])
        return rows, end + at.size

    # -- checkpoints (`Checkpointable`, hpcpar/state.py) ---------------------------------------------

    def checkpoint_state(self) -> SavedState:
        """{"model/<name>": (piece, flat-range layout), "optim/<name>/<state>": ...} of this range,
        and the optimizer step, which server 0 sends the workers (collective with their
        `ServerUpdate.checkpoint_state`): the stored metadata is worker rank 0's."""
        out = {}
        for seg in self.segments:
            out[f"model/{seg.name}"] = (seg.data, seg.layout)
            state = self.optimizer.state_of(seg)
            for k in self.optimizer.state_names:
                out[f"optim/{seg.name}/{k}"] = (state[k], seg.layout)
        self.job.broadcast_object(self.optimizer.step_count, root=self.workers)
        return SavedState(out, {"optimizer_step": self.optimizer.step_count})

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """This range of the parameters and, unless weights only, of the optimizer state at the
        checkpoint's optimizer step."""
        step_count = None if stored.weights_only else int(stored.meta["optimizer_step"])
        wanted = {}
        for seg in self.segments:
            wanted[f"model/{seg.name}"] = seg.layout
            if step_count is not None:
                wanted.update({f"optim/{seg.name}/{k}": seg.layout for k in self.optimizer.state_names})
        stored.read(wanted, lambda arrays: self._take_loaded(arrays, step_count))

    def _take_loaded(self, arrays: dict, step_count: int | None) -> None:
        for seg in self.segments:
            seg.data[...] = arrays[f"model/{seg.name}"]
            if step_count is None:
                continue
            for k, dst in self.optimizer.state_of(seg).items():
                dst[...] = arrays[f"optim/{seg.name}/{k}"]
        if step_count is not None:
            self.optimizer.step_count = int(step_count)
