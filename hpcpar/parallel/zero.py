"""ZeRO-1: optimizer state sharded over the dp ranks (arXiv 1910.02054, stage 1).

Every dp replica holds all parameters, but the optimizer's state (AdamW's two moments: twice
the parameters) is split: rank r owns part r of every gradient bucket (hpcpar/parallel/buckets.py),
the elements `[r * size/dp, (r + 1) * size/dp)` of the flat `[size]` bucket (`size` is padded to
a multiple of dp), and keeps optimizer state for those elements only, 1/dp of the total.

Per step: a reduce-scatter has left each rank the averaged gradient of its part of every
bucket (`bucket.part`, `[size/dp]`); the optimizer updates this rank's part of the parameters,
held in a flat buffer `Part.data` of shape `[size/dp]`; a non-blocking all-gather per bucket then
returns the whole updated bucket `[size]` to every rank, which copies it into the parameters.

The optimizer never sees a whole parameter. It sees *segments*: for each parameter that
overlaps this rank's part, the overlapping piece, as an object with flat `.data` (a view of
`Part.data`), `.grad` (a view of `bucket.part`, set after each reduction) and the parameter's
`.no_decay`, so decoupled weight decay stays masked per element. Elementwise AdamW (or SGD) on
segments is the same arithmetic as on whole parameters, so results equal the unsharded
optimizer's bit for bit.

Checkpoints hold each parameter's whole state: `state` all-gathers the parts per bucket and
cuts them into parameters; `load_state` takes that structure and keeps this rank's part.
"""

from __future__ import annotations

from typing import Any, Callable

from hpcpar import backend
from hpcpar.comm import Communicator
from hpcpar.parallel.buckets import Bucket


class Segment:
    """The piece of one parameter inside this rank's ZeRO part, seen by the optimizer as a
    parameter: flat `.data`/`.grad` views and the parameter's `no_decay`."""

    __slots__ = ("data", "grad", "no_decay", "param", "name", "lo", "hi", "part_lo")

    def __init__(self, data, param, name: str, lo: int, hi: int, part_lo: int):
        self.data = data            # view of the part buffer
        self.grad = None            # view of the reduced gradient part (set each step)
        self.no_decay = bool(getattr(param, "no_decay", False))
        self.param = param
        self.name = name            # the parameter's global name (checkpoint key)
        self.lo, self.hi = lo, hi   # element range within the flattened parameter
        self.part_lo = part_lo      # start within the part buffer


class Part:
    """This rank's part of one bucket: elements [lo, hi) of the flat bucket.

    Attributes:
        bucket: the Bucket.
        data: `[hi - lo]`, this rank's part of the flattened parameters (what the optimizer updates).
        segments: the parameters' pieces inside [lo, hi), in slot order.
    """

    def __init__(self, bucket: Bucket, rank: int, size: int, xp):
        n = bucket.plan.size // size
        self.bucket = bucket
        self.lo, self.hi = rank * n, (rank + 1) * n
        self.data = xp.zeros(n, dtype=bucket.plan.dtype)
        self.segments: list[Segment] = []
        for s, p in zip(bucket.plan.slots, bucket.params):
            a, z = max(self.lo, s.offset), min(self.hi, s.offset + s.numel)
            if a < z:
                self.segments.append(Segment(self.data[a - self.lo:z - self.lo], p, s.name,
                                             a - s.offset, z - s.offset, a - self.lo))
        self.refresh()

    def refresh(self) -> None:
        """Copy this rank's part of the parameters into `data` (they may have been loaded)."""
        for seg in self.segments:
            seg.data[...] = seg.param.data.reshape(-1)[seg.lo:seg.hi]


class ZeroOptimizer:
    """An optimizer over this rank's parts of `buckets`, plus the all-gather of the parameters.

    Args:
        buckets: the gradient buckets (sizes multiples of `comm.size`), reduced by reduce-scatter.
        comm: the dp communicator.
        make_optimizer: builds the optimizer from the list of segments.

    Per step, after the reduction: `attach_grads()`, then (after clipping) `step(lr)`.
    """

    def __init__(self, buckets: list[Bucket], comm: Communicator, make_optimizer: Callable[[list], Any]):
        self.comm = comm
        xp = backend.array_module(*(p.data for b in buckets for p in b.params))
        self.parts = [Part(b, comm.rank, comm.size, xp) for b in buckets]
        self.segments = [s for part in self.parts for s in part.segments]
        self.optimizer = make_optimizer(self.segments)

    def attach_grads(self) -> None:
        """Point every segment's `.grad` at its piece of its bucket's reduced part."""
        for part in self.parts:
            for seg in part.segments:
                seg.grad = part.bucket.part[seg.part_lo:seg.part_lo + (seg.hi - seg.lo)]

    def step(self, lr: float | None = None) -> None:
        """Update this rank's part, then all-gather every bucket's parts into the parameters."""
        self.optimizer.step(lr)
        # All gathers are started before the first wait, so they overlap each other.
        handles = [self.comm.iall_gather(part.data, dim=0) for part in self.parts]
        for part, h in zip(self.parts, handles):
            full = h.wait()
            b = part.bucket
            for s, p in zip(b.plan.slots, b.params):
                p.data[...] = full[s.offset:s.offset + s.numel].reshape(p.shape)

    def state(self, state_names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        """{parameter name: {state name: array of the parameter's local shape}}, gathered over
        dp (collective: one all-gather per bucket and state name, in that order)."""
        out: dict[str, dict[str, Any]] = {}
        for part in self.parts:
            b = part.bucket
            for k in state_names:
                mine = backend.array_module(part.data).zeros_like(part.data)
                for seg in part.segments:
                    mine[seg.part_lo:seg.part_lo + (seg.hi - seg.lo)] = self.optimizer.state_of(seg)[k]
                full = self.comm.all_gather(mine, dim=0)
                for s, p in zip(b.plan.slots, b.params):
                    out.setdefault(s.name, {})[k] = full[s.offset:s.offset + s.numel].reshape(p.shape).copy()
        return out

    def load_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Take this rank's part of whole-parameter state (the structure of `state`, already
        checked), and re-read this rank's part of the parameters (loaded before this call)."""
        for part in self.parts:
            xp = backend.array_module(part.data)
            for seg in part.segments:
                for k, dst in self.optimizer.state_of(seg).items():
                    dst[...] = xp.asarray(state[seg.name][k]).reshape(-1)[seg.lo:seg.hi]
        for part in self.parts:
            part.refresh()
