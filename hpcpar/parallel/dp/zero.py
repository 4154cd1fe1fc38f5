"""ZeRO-1 and ZeRO-2: optimizer state (and ZeRO-2's gradients) sharded over the dp ranks
(arXiv 1910.02054, stages 1 and 2).

Every dp replica holds all parameters, but the optimizer's state (AdamW's two moments: twice
the parameters) is split: rank r owns part r of every gradient bucket (hpcpar/parallel/dp/buckets.py),
the elements `[r * size/n, (r + 1) * size/n)` of the flat `[size]` bucket (`size` is padded to
a multiple of n, the ranks of the shard group: dp x cp, or with HSDP dp_shard x cp), and keeps
optimizer state for those elements only, 1/n of the total.

Parameters live in one flat buffer per bucket, laid out like its gradients (`Part.flat`; every
`p.data` is a view of it). Per step: a reduce-scatter has left each rank the averaged gradient of
its part of every bucket (`bucket.part`, `[size/n]`); the optimizer updates this rank's part of
the parameters in place (`Part.data`, a view `flat[lo:hi]`, so no copy of the parameters is
kept); a non-blocking all-gather per bucket then fills every rank's whole `flat` with the
updated parts. ZeRO-2 is the same optimizer: only the bucket manager differs (it drops each
full gradient buffer once reduced, buckets.py).

The optimizer never sees a whole parameter. It sees *segments*: for each parameter that
overlaps this rank's part, the overlapping piece, as an object with flat `.data` (a view of
`Part.data`), `.grad` (a view of `bucket.part`, set after each reduction) and the parameter's
`.no_decay`, so decoupled weight decay stays masked per element. Elementwise AdamW (or SGD) on
segments is the same arithmetic as on whole parameters, so results equal the unsharded
optimizer's bit for bit.

Checkpoints: every segment is a flat range of its parameter's local array, so it is saved as it
is, with the layout `param.layout.flat_range(lo, hi)` (`shard_tensors`): no rank ever holds
another rank's state. `state` (all-gathered whole-parameter state, for tests and tools) and
`load_state` (its inverse) remain.
"""

from __future__ import annotations

from typing import Any, Callable

from hpcpar import backend
from hpcpar.runtime.comm import Communicator, bytes_sent
from hpcpar.parallel.dp.buckets import Bucket


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

    @property
    def layout(self):
        """Where this piece sits in the global tensor: a flat range of the parameter's layout."""
        return self.param.layout.flat_range(self.lo, self.hi)


def segments_of(slots, params, lo: int, hi: int, data) -> list[Segment]:
    """The pieces of the parameters of `slots` (name, offset, numel; with `params` alongside)
    inside elements [lo, hi) of a flat buffer, `data` being those elements."""
    out = []
    for s, p in zip(slots, params):
        a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < z:
            out.append(Segment(data[a - lo:z - lo], p, s.name, a - s.offset, z - s.offset, a - lo))
    return out


class Part:
    """This rank's part of one bucket: elements [lo, hi) of the flat bucket.

    Attributes:
        bucket: the Bucket.
        flat: `[size]`, the bucket's parameters back to back (every `p.data` is a view of it).
        data: `flat[lo:hi]`, this rank's part of the parameters (what the optimizer updates).
        segments: the parameters' pieces inside [lo, hi), in slot order.
    """

    def __init__(self, bucket: Bucket, rank: int, size: int, xp):
        n = bucket.plan.size // size
        self.bucket = bucket
        self.lo, self.hi = rank * n, (rank + 1) * n
        self.flat = xp.zeros(bucket.plan.size, dtype=bucket.plan.dtype)
        for s, p in zip(bucket.plan.slots, bucket.params):  # the parameters move into the flat buffer
            view = self.flat[s.offset:s.offset + s.numel].reshape(p.shape)
            view[...] = p.data
            p.data = view
        self.data = self.flat[self.lo:self.hi]
        self.segments = segments_of(bucket.plan.slots, bucket.params, self.lo, self.hi, self.data)


class ZeroOptimizer:
    """An optimizer over this rank's parts of `buckets`, plus the all-gather of the parameters.

    Args:
        buckets: the gradient buckets (sizes multiples of `comm.size`), reduced by reduce-scatter.
        comm: the shard group (dp x cp; with HSDP dp_shard x cp).
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
        """Update this rank's part in place, then all-gather every bucket's parts into its flat
        parameter buffer (all started before the first wait, so they overlap each other)."""
        self.optimizer.step(lr)
        if self.comm.size == 1:
            return  # the part is the whole flat buffer, updated in place
        # The part is sent from a copy: MPI's send and receive buffers must not overlap.
        handles = [self.comm.iall_gather(part.data.copy(), dim=0, out=part.flat) for part in self.parts]
        for h in handles:
            h.wait()

    def step_bytes(self) -> float:
        """Bytes `step` sends from this rank: the all-gather of every updated part, counted by
        `comm.bytes_sent`'s formula as the communicator counts it (known before the step)."""
        if self.comm.size == 1:
            return 0.0
        return sum(bytes_sent("all_gather", part.data.nbytes, self.comm.size) for part in self.parts)

    def gather_parameters(self) -> None:
        """All-gather every bucket's parts into the parameters (after loading parts; collective)."""
        if self.comm.size > 1:
            for h in [self.comm.iall_gather(part.data.copy(), dim=0, out=part.flat) for part in self.parts]:
                h.wait()

    def state(self, state_names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        """{parameter name: {state name: array of the parameter's local shape}}, gathered over
        the shard group (collective: one all-gather per bucket and state name, in that order).
        For tests and tools; checkpoints save the shards (`shard_tensors`)."""
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
        checked). The parameters themselves are loaded whole beforehand (views of the flat
        buffers: nothing to re-read)."""
        for part in self.parts:
            xp = backend.array_module(part.data)
            for seg in part.segments:
                for k, dst in self.optimizer.state_of(seg).items():
                    dst[...] = xp.asarray(state[seg.name][k]).reshape(-1)[seg.lo:seg.hi]
