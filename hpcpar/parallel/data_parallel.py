"""Data parallelism: bucketed, overlapped gradient averaging over the mesh's dp axis; ZeRO-1.

Every dp rank holds the same parameters and computes gradients on its own samples of the
global batch; averaging the gradients over dp makes each replica take the step the whole
batch would give (PyTorch DDP, arXiv 2006.15704).

Buckets. The gradients live in a few flat buffers ("buckets", `bucket_mb` MiB each) filled
in *reverse* order of parameter registration, which is roughly the order backward completes
them; each parameter's `.grad` is a view of its slice of a bucket, so backward accumulates
straight into the buffer that goes on the wire. A grad hook counts each parameter's
contributions; once every parameter of a bucket has all `microbatches` of them (gradient
accumulation: only the last micro-batch triggers), the bucket's non-blocking reduction starts
while backward goes on with earlier layers. Buckets are launched strictly in index order
(a ready bucket waits for its predecessors), so every dp rank issues the same collectives in
the same order whatever its hook timing; `finish_backward` launches whatever is left (a
bucket whose parameters got no gradient is reduced as zeros) and waits for all of them.

Tied weights. The LM head on the last pipeline stage is a copy (`tied_to`) of the embedding
on the first. Both live in a separate final bucket: after backward their gradients are summed
over `mesh.embedding_comm`, then
averaged over dp like any bucket, so the two copies receive identical updates.

ZeRO-1 (arXiv 1910.02054). Buckets are padded to a multiple of dp. A reduce-scatter leaves
rank r with the averaged gradient of part r of every bucket; the optimizer holds state only
for that part and updates it as "segments" (the piece of each parameter that falls inside the
part, a flat view with the parameter's `no_decay`, so decay is masked per element); an
all-gather then hands every rank the updated parameters. Elementwise AdamW on segments is the
same arithmetic as on whole parameters, so results equal the unsharded optimizer's.

Wire compression (`wire_dtype` "float16" or "bfloat16"). A bucket is cast to 16 bits
(bfloat16, which NumPy lacks, as the upper half of a float32 with round-to-nearest-even, held
in uint16), exchanged with an all-to-all (each rank receives every rank's copy of its part),
summed in float32, and - unless ZeRO needs only the part - cast again and all-gathered: the
bytes of a ring all-reduce at half width, with fp32 accumulation. "float32" (the default)
means no compression: gradients travel in their own dtype (float64 stays float64).

Clipping. The global norm counts tp-split parameters on every tp rank (summed), tp-replicated
ones on tp rank 0 only, skips tied copies, sums pipeline stages, and under ZeRO sums the dp
parts; per-rank sums of squares are all-gathered and added in rank order, so the norm is the
same float on every rank.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from hpcpar import backend
from hpcpar.errors import CheckpointError, ConfigError
from hpcpar.mesh import Axis
from hpcpar.optim import AdamW, grad_norm_sq

WIRE_DTYPES = ("float32", "float16", "bfloat16")
_MIB = 1 << 20


# -- the bucket plan (pure) -------------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    """Where parameter `index` (position in the given list) lives in its bucket: [offset, offset+numel)."""

    name: str
    index: int
    offset: int
    numel: int


@dataclass(frozen=True)
class BucketPlan:
    """One flat gradient buffer: its slots, padded size (a multiple of `pad_to`) and dtype."""

    slots: tuple
    size: int
    dtype: str
    tied: bool = False

    @property
    def used(self) -> int:
        """Elements holding gradients (the rest is zero padding)."""
        return sum(s.numel for s in self.slots)


def plan_buckets(params: list[tuple[str, int, str]], bucket_bytes: int, pad_to: int = 1,
                 tied: Iterable[str] = ()) -> list[BucketPlan]:
    """Group parameters into flat buckets.

    Args:
        params: (name, numel, dtype) in registration order.
        bucket_bytes: a bucket is closed once it holds at least this many bytes (a larger
            parameter gets a bucket of its own).
        pad_to: every bucket's size is rounded up to a multiple of this (dp, for ZeRO's
            reduce-scatter and the compressed all-to-all).
        tied: names that go in one final bucket (sorted by name), not in the regular ones.

    Returns:
        Regular buckets in reverse registration order (a new bucket also starts where the
        dtype changes), then the tied bucket if any.
    """
    tied = set(tied)
    buckets: list[BucketPlan] = []
    current: list[Slot] = []
    offset, dtype = 0, None

    def close(slots: list[Slot], used: int, dt: str, is_tied: bool = False) -> None:
        if slots:
            buckets.append(BucketPlan(tuple(slots), -(-used // pad_to) * pad_to, dt, is_tied))

    for index in reversed(range(len(params))):
        name, numel, dt = params[index]
        if name in tied:
            continue
        if current and dt != dtype:
            close(current, offset, dtype)
            current, offset = [], 0
        dtype = dt
        current.append(Slot(name, index, offset, numel))
        offset += numel
        if offset * np.dtype(dt).itemsize >= bucket_bytes:
            close(current, offset, dtype)
            current, offset = [], 0
    close(current, offset, dtype)

    tied_params = sorted((name, i) for i, (name, _, _) in enumerate(params) if name in tied)
    if tied_params:
        dtypes = {params[i][2] for _, i in tied_params}
        if len(dtypes) > 1:
            raise ConfigError(f"tied weights {[n for n, _ in tied_params]} have different dtypes {sorted(dtypes)}; "
                              "tied copies must share one dtype")
        slots, offset = [], 0
        for name, i in tied_params:
            slots.append(Slot(name, i, offset, params[i][1]))
            offset += params[i][1]
        close(slots, offset, dtypes.pop(), is_tied=True)
    return buckets


# -- 16-bit wire formats ----------------------------------------------------------------------

def encode16(x, wire_dtype: str):
    """Float array -> uint16 array holding float16 or bfloat16 bits (round to nearest even)."""
    xp = backend.array_module(x)
    x32 = x.astype(xp.float32)
    if wire_dtype == "float16":
        return x32.astype(xp.float16).view(xp.uint16)
    u = x32.view(xp.uint32)
    # Round to nearest even on the 16 dropped bits: add 0x7FFF plus the lowest kept bit.
    rounded = u + (xp.uint32(0x7FFF) + ((u >> xp.uint32(16)) & xp.uint32(1)))
    bits = (rounded >> xp.uint32(16)).astype(xp.uint16)
    # A NaN's mantissa could carry into the sign bit: keep NaN a NaN so bad steps stay visible.
    return xp.where(xp.isnan(x32), xp.uint16(0x7FC0), bits)


def decode16(u16, wire_dtype: str):
    """uint16 array of float16 or bfloat16 bits -> float32 array."""
    xp = backend.array_module(u16)
    if wire_dtype == "float16":
        return u16.view(xp.float16).astype(xp.float32)
    return (u16.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)


# -- runtime ------------------------------------------------------------------------------------

class _Segment:
    """The piece of one parameter inside this rank's ZeRO part, seen by the optimizer as a
    parameter: flat `.data`/`.grad` views and the parameter's `no_decay`."""

    __slots__ = ("data", "grad", "no_decay", "param", "lo", "hi", "part_lo", "counted")

    def __init__(self, data, param, lo: int, hi: int, part_lo: int, counted: bool):
        self.data = data            # view of the bucket's part buffer
        self.grad = None            # view of the reduced gradient part (set each step)
        self.no_decay = bool(getattr(param, "no_decay", False))
        self.param = param
        self.lo, self.hi = lo, hi   # element range within the flattened parameter
        self.part_lo = part_lo      # start within the part buffer
        self.counted = counted      # counts toward the gradient norm on this rank


class _Bucket:
    """A plan plus its buffers and the state of this step's reduction."""

    def __init__(self, index: int, plan: BucketPlan, params: list, xp):
        self.index = index
        self.plan = plan
        self.params = [params[s.index] for s in plan.slots]
        self.grad = xp.zeros(plan.size, dtype=plan.dtype)   # flat gradient buffer
        self.views = [self.grad[s.offset:s.offset + s.numel].reshape(p.shape)
                      for s, p in zip(plan.slots, self.params)]
        self.ready = 0          # parameters with all their contributions this step
        self.handle = None      # the in-flight reduction
        self.part_grad = None   # ZeRO: this rank's averaged part after the reduction
        self.part_data = None   # ZeRO: this rank's part of the flat parameters
        self.segments: list[_Segment] = []


class DataParallel:
    """Keeps dp replicas identical: overlapped bucketed gradient averaging, optimizer, clipping.

    Args:
        named_params: (global name, Parameter) of every parameter on this rank (all its
            pipeline chunks), in registration order.
        mesh: the Mesh; uses `comm("dp")`, `comm("tp")`, `world` and `embedding_comm`.
        bucket_mb: bucket size in MiB.
        wire_dtype: "float32" (no compression), "float16" or "bfloat16".
        zero: 0 (replicated optimizer state) or 1 (state sharded over dp).
        make_optimizer: builds the optimizer from a list of objects with `.data`, `.grad`,
            `.no_decay` (the parameters, or under ZeRO this rank's segments).
        overlap: start reductions from grad hooks during backward (False: all in
            `finish_backward`, the no-overlap baseline for benchmarks).

    Per step: `begin_step(microbatches)`, backward of every micro-batch, `finish_backward()`,
    `clip_grad_norm(max_norm)`, `step(lr)`.

    Attributes:
        events: (kind, what, time.perf_counter()) appended during the step: ("grad_ready", name, t)
            when a parameter has all its contributions, ("bucket_start", i, t) when bucket i's
            reduction is launched. Cleared by `begin_step`.
        wait_s: seconds the last `finish_backward` spent (launching the rest and waiting).
    """

    def __init__(self, named_params: Iterable[tuple[str, Any]], mesh, bucket_mb: float = 25.0,
                 wire_dtype: str = "float32", zero: int = 0,
                 make_optimizer: Callable[[list], Any] = AdamW, overlap: bool = True):
        if wire_dtype not in WIRE_DTYPES:
            raise ConfigError(f"wire_dtype {wire_dtype!r} is not supported; choose one of {', '.join(WIRE_DTYPES)}")
        if zero not in (0, 1):
            raise ConfigError(f"zero={zero!r} is not a supported ZeRO stage; choose 0 or 1")
        if not bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        named = list(named_params)
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ConfigError("DataParallel was given a parameter name twice; pass each parameter once")
        self.names = names
        self.params = [p for _, p in named]
        self._name_of = {id(p): n for n, p in named}
        self.mesh = mesh
        self.zero = zero
        self.wire_dtype = wire_dtype
        self.overlap = overlap
        self.dp_comm = mesh.comm(Axis.DP)
        self.dp_size, self.dp_rank = self.dp_comm.size, self.dp_comm.rank
        self.embedding_comm = mesh.embedding_comm
        tp_rank = mesh.comm(Axis.TP).rank

        # Tied weights: copies (tied_to set) and the weights they mirror, here or on the peer stage.
        targets = {p.tied_to for p in self.params if getattr(p, "tied_to", None)}
        if self.embedding_comm is not None:
            for theirs in self.embedding_comm.all_gather_object(sorted(targets)):
                targets.update(theirs)
        tied = {n for n, p in named if getattr(p, "tied_to", None) or n in targets}

        plans = plan_buckets([(n, int(p.data.size), str(p.data.dtype)) for n, p in named],
                             int(bucket_mb * _MIB), self.dp_size, tied)
        xp = backend.array_module(*(p.data for p in self.params))
        self.buckets = [_Bucket(i, plan, self.params, xp) for i, plan in enumerate(plans)]
        self._n_regular = sum(1 for b in self.buckets if not b.plan.tied)
        self._where = {}  # id(param) -> bucket
        for b in self.buckets:
            for p in b.params:
                self._where[id(p)] = b
        if self.embedding_comm is not None:
            self._check_tied_match()

        # Which gradients count toward the norm on this rank (see module docstring).
        def counted(p) -> bool:
            if getattr(p, "tied_to", None):
                return False
            return tp_rank == 0 or not p.layout.is_replicated
        if zero:
            self._build_segments(xp, counted)
            self.optimizer = make_optimizer([s for b in self.buckets for s in b.segments])
            self._norm_items = [s for b in self.buckets for s in b.segments if s.counted]
        else:
            self.optimizer = make_optimizer(list(self.params))
            self._norm_items = [p for p in self.params if counted(p)] if self.dp_rank == 0 else []

        self._counts = {id(p): 0 for p in self.params}
        self._microbatches = 0
        self._next_launch = 0
        self._armed = False
        self.events: list[tuple[str, Any, float]] = []
        self.wait_s = 0.0
        self._attach_grads()
        for p in self.params:
            p.register_grad_hook(self._on_grad)

    # -- setup helpers ------------------------------------------------------------------------

    def _check_tied_match(self) -> None:
        tied = [b for b in self.buckets if b.plan.tied]
        mine = (tied[0].plan.size, tied[0].plan.dtype) if tied else (0, "")
        sizes = self.embedding_comm.all_gather_object(mine)
        if len(set(sizes)) != 1:
            raise ConfigError(f"tied weights differ between the first and last pipeline stage "
                              f"(size, dtype per rank: {sizes}); both copies must have the same local shape")

    def _build_segments(self, xp, counted: Callable[[Any], bool]) -> None:
        for b in self.buckets:
            part = b.plan.size // self.dp_size
            lo, hi = self.dp_rank * part, (self.dp_rank + 1) * part
            b.part_data = xp.zeros(part, dtype=b.plan.dtype)
            for s, p in zip(b.plan.slots, b.params):
                a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < z:
                    b.segments.append(_Segment(b.part_data[a - lo:z - lo], p, a - s.offset, z - s.offset,
                                               a - lo, counted(p)))
            self._refresh_part(b)

    def _refresh_part(self, b: _Bucket) -> None:
        """Copy this rank's part of the parameters into the part buffer (they may have been loaded)."""
        for seg in b.segments:
            seg.data[...] = seg.param.data.reshape(-1)[seg.lo:seg.hi]

    # -- the step -------------------------------------------------------------------------------

    def begin_step(self, microbatches: int = 1) -> None:
        """Zero the gradient buckets, point every `.grad` at its view, arm the hooks."""
        if microbatches < 1:
            raise ConfigError(f"microbatches must be >= 1, got {microbatches}")
        for b in self.buckets:
            b.grad.fill(0)
            b.ready, b.handle, b.part_grad = 0, None, None
        self._attach_grads()
        for k in self._counts:
            self._counts[k] = 0
        self._microbatches = microbatches
        self._next_launch = 0
        self._armed = True
        self.events = []

    def _attach_grads(self) -> None:
        """Point every parameter's `.grad` at its slice of its bucket (someone may have reset it)."""
        for b in self.buckets:
            for p, v in zip(b.params, b.views):
                p.grad = v

    def _on_grad(self, p) -> None:
        """Grad hook: one more contribution to `p`; launch buckets that became complete."""
        if not self._armed:
            return
        key = id(p)
        n = self._counts[key] + 1
        self._counts[key] = n
        if n > self._microbatches:
            raise RuntimeError(f"parameter {self._name_of[key]} received {n} gradients in a step "
                               f"of {self._microbatches} micro-batch(es); its bucket was already reduced. "
                               "Call begin_step(microbatches=...) with the number of backward passes")
        if n < self._microbatches:
            return
        self.events.append(("grad_ready", self._name_of[key], time.perf_counter()))
        b = self._where[key]
        b.ready += 1
        if self.overlap:
            while (self._next_launch < self._n_regular
                   and self.buckets[self._next_launch].ready == len(self.buckets[self._next_launch].params)):
                self._launch(self.buckets[self._next_launch])
                self._next_launch += 1
            if self._next_launch:
                self.dp_comm.progress()  # keeps the launched reductions moving during backward

    def _launch(self, b: _Bucket) -> None:
        """Start bucket `b`'s reduction over dp (nothing to do when dp == 1)."""
        self.events.append(("bucket_start", b.index, time.perf_counter()))
        if self.dp_size == 1:
            return
        if self.wire_dtype != "float32":
            wire = encode16(b.grad, self.wire_dtype).reshape(self.dp_size, -1)
            b.handle = self.dp_comm.iall_to_all(wire, dim=0)
        elif self.zero:
            b.handle = self.dp_comm.ireduce_scatter(b.grad, dim=0, op="avg")
        else:
            b.handle = self.dp_comm.iall_reduce(b.grad, op="avg")

    def _complete(self, b: _Bucket) -> None:
        """Wait for bucket `b`'s reduction; leave the average in `b.grad` (or `b.part_grad`)."""
        if self.dp_size == 1:
            b.part_grad = b.grad if self.zero else None
            return
        result = b.handle.wait()
        b.handle = None
        if self.wire_dtype != "float32":
            # result[r] = rank r's copy of my part (16-bit): sum in float32, average.
            part = decode16(result, self.wire_dtype).sum(axis=0)
            part /= self.dp_size
            if self.zero:
                b.part_grad = part.astype(b.plan.dtype)
                return
            full = self.dp_comm.all_gather(encode16(part, self.wire_dtype), dim=0)
            b.grad[...] = decode16(full, self.wire_dtype)
        elif self.zero:
            b.part_grad = result

    def finish_backward(self) -> None:
        """Launch the buckets not yet started (tied weights last, after summing them across
        stages), wait for every reduction. Afterwards, without ZeRO each `.grad` holds the
        dp-averaged gradient; with ZeRO the averaged part lives with the optimizer's segments."""
        if not self._armed:
            raise RuntimeError("finish_backward() without begin_step(); call begin_step(microbatches) first")
        t0 = time.perf_counter()
        while self._next_launch < self._n_regular:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        for b in self.buckets[self._n_regular:]:
            if self.embedding_comm is not None:
                self.embedding_comm.iall_reduce(b.grad, op="sum").wait()  # in place
            self._launch(b)
        for b in self.buckets:
            self._complete(b)
        if self.zero:
            for b in self.buckets:
                for seg in b.segments:
                    seg.grad = b.part_grad[seg.part_lo:seg.part_lo + (seg.hi - seg.lo)]
        self._armed = False
        self.wait_s = time.perf_counter() - t0

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm of the averaged gradients over the whole mesh (the same float on every
        rank); when `max_norm > 0` and the norm exceeds it, scale every gradient by
        `max_norm / (norm + 1e-6)` (as torch.nn.utils.clip_grad_norm_). Returns the norm before."""
        sq = np.array([grad_norm_sq(self._norm_items)], dtype=np.float64)
        parts = self.mesh.world.all_gather(sq)  # one value per rank, summed in rank order below
        norm = math.sqrt(math.fsum(float(v) for v in parts))
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                for b in self.buckets:
                    if self.zero:
                        b.part_grad *= coef
                    else:
                        b.grad *= coef
        return norm

    def step(self, lr: float | None = None) -> None:
        """Optimizer step with learning rate `lr`. ZeRO: update this rank's part, all-gather
        the parameters."""
        if not self.zero:
            self.optimizer.step(lr)
            return
        self.optimizer.step(lr)
        handles = [self.dp_comm.iall_gather(b.part_data, dim=0) for b in self.buckets]
        for b, h in zip(self.buckets, handles):
            full = h.wait()
            for s, p in zip(b.plan.slots, b.params):
                p.data[...] = full[s.offset:s.offset + s.numel].reshape(p.shape)

    # -- optimizer state for checkpoints ------------------------------------------------------------

    def optimizer_step_count(self) -> int:
        """Optimizer steps taken (AdamW's bias correction uses it); checkpoints save it."""
        return self.optimizer.step_count

    def state_names(self) -> tuple[str, ...]:
        """The optimizer's per-parameter state arrays ("exp_avg", "exp_avg_sq" for AdamW)."""
        return tuple(self.optimizer.state_names)

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """{parameter name: {state name: array of the parameter's local shape}} (copies).
        Under ZeRO the parts are all-gathered over dp first (collective over dp)."""
        names = self.state_names()
        out: dict[str, dict[str, Any]] = {n: {} for n in self.names}
        if not self.zero:
            for n, p in zip(self.names, self.params):
                st = self.optimizer.state_of(p)
                out[n] = {k: st[k].copy() for k in names}
            return out
        for b in self.buckets:
            for k in names:
                part = backend.array_module(b.part_data).zeros_like(b.part_data)
                for seg in b.segments:
                    part[seg.part_lo:seg.part_lo + (seg.hi - seg.lo)] = self.optimizer.state_of(seg)[k]
                full = self.dp_comm.all_gather(part, dim=0)
                for s, p in zip(b.plan.slots, b.params):
                    out[self.names[s.index]][k] = full[s.offset:s.offset + s.numel].reshape(p.shape).copy()
        return out

    def load_optimizer_state(self, state: dict[str, dict[str, Any]], step_count: int | None = None) -> None:
        """Copy state of the `optimizer_state()` structure in (each rank takes its ZeRO part).

        Call it after loading the parameters themselves: under ZeRO it also re-reads this rank's
        part of them (which `step` otherwise keeps up to date on its own)."""
        names = set(self.state_names())
        missing = sorted(set(self.names) - set(state))
        if missing:
            raise CheckpointError(f"optimizer state lacks parameters {missing[:3]}{'...' if len(missing) > 3 else ''}; "
                                  "load a checkpoint of the same model")
        for n, p in zip(self.names, self.params):
            if set(state[n]) != names:
                raise CheckpointError(f"optimizer state of {n} holds {sorted(state[n])}, expected {sorted(names)}")
            for k, v in state[n].items():
                if tuple(v.shape) != tuple(p.shape):
                    raise CheckpointError(f"optimizer state {k} of {n} has shape {tuple(v.shape)}, "
                                          f"expected the parameter's local shape {tuple(p.shape)}")
        xp = backend.array_module(*(p.data for p in self.params))
        if self.zero:
            for b in self.buckets:
                for seg in b.segments:
                    n = self._name_of[id(seg.param)]
                    for k, dst in self.optimizer.state_of(seg).items():
                        dst[...] = xp.asarray(state[n][k]).reshape(-1)[seg.lo:seg.hi]
        else:
            for n, p in zip(self.names, self.params):
                for k, dst in self.optimizer.state_of(p).items():
                    dst[...] = xp.asarray(state[n][k])
        if step_count is not None:
            self.optimizer.step_count = int(step_count)
        if self.zero:
            for b in self.buckets:
                self._refresh_part(b)
