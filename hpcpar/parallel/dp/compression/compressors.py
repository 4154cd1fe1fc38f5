"""Gradient compression on the data-parallel wire: the compressor interface, error feedback, the
16-bit wire, int8 quantization and top-k sparsification (PowerSGD: hpcpar/parallel/dp/compression/powersgd.py).

A compressor decides how one gradient bucket (a flat array `[size]`, `size` a multiple of the
n ranks of its communicator; see hpcpar/parallel/dp/buckets.py) travels in fewer bytes. It serves
both places a bucket can end up:

- reduce-scatter (ZeRO 1/2): every rank needs only the average of its own part,
  `[rank * size/n, (rank + 1) * size/n)`;
- all-reduce: every rank needs the whole averaged bucket, and all ranks the same bytes of it,
  so that the replicas stay identical.

So the interface is a compressed reduce-scatter followed, for the all-reduce case only, by a
compressed all-gather:

    payload  = compress(index, grad)      local; called from a grad hook, so it must not block
    handle   = exchange(payload)          starts the non-blocking collective
    part     = decompress(index, handle.wait())    this rank's averaged part [size/n]
    whole    = all_gather(index, part)    all-reduce case: the whole average [size], same on all ranks

`index` is the bucket's index, constant from step to step, for the state compressors keep per
bucket. Before the first step `setup(specs)` tells the compressor its buckets (`BucketSpec`:
size, dtype, the parameters inside), and after a step whose update was applied `commit()`
adopts the state that step computed (a step skipped for a NaN/Inf gradient leaves the
compressor's state as it was). `CompressedReduction` in buckets.py calls these methods.

**Error feedback** (Seide et al. 2014; Karimireddy et al., arXiv 1901.09847): a compressor that
drops information keeps, per bucket, what it dropped (the residual `r`) and adds it to the next
step's gradient before compressing: `x = grad + r`, send `C(x)`, keep `r' = x - D(C(x))`. The
residual is computed so that `D(C(x)) + r' == x` exactly (bitwise: top-k's residual is `x` with
the sent entries zeroed; int8's `x - D(C(x))` is exact by Sterbenz's lemma, since a dequantized
value is within a factor 2 of the value it stands for or zero), so nothing is ever lost, only
delayed. `Residuals` keeps two buffers per bucket and swaps them on `commit()`.

The compressors (bytes sent per rank for a bucket of N elements of s bytes over n ranks, in
the all-reduce case; docs/parallelism.md has the whole table):

- `Wire16` ("fp16", "bf16"): cast to 16 bits, all-to-all of the rows, float32 sum, 16-bit
  all-gather: `2 (n-1)/n · 2 N` (half of the float32 ring all-reduce's `2 (n-1)/n · 4 N`).
- `Int8` ("int8"): blockwise absmax quantization (one float32 scale per `block_size` values),
  two compressed phases as 1-bit Adam and ZeRO++ do: an all-to-all of int8 rows + scales
  (rank j receives every rank's row j), dequantized and summed in float32 (or the bucket's wider
  dtype) in rank order; the owner re-quantizes its averaged part with a second, owner-side error
  feedback, and the part is all-gathered in int8: `2 (n-1)/n · N (1 + 4/b)`. Under ZeRO 1/2 the
  first phase only.
- `TopK` ("topk"): the k = ceil(ratio · N) largest-magnitude entries of `x` as (int32 index,
  value) pairs, all-gathered; every rank adds all ranks' pairs into a zero bucket in rank order
  (the same bits everywhere): `(n-1) · k (4 + s)`.
- `PowerSGD` ("powersgd", powersgd.py): rank-r factors of each matrix, two all-reduces.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np

from hpcpar import backend
from hpcpar.runtime.comm import Communicator
from hpcpar.runtime.transports import Handle
from hpcpar.errors import ConfigError

KINDS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
# The 16-bit wire's old key, train.grad_wire_dtype, names these kinds.
WIRE_DTYPE_KINDS = {"float32": "none", "float16": "fp16", "bfloat16": "bf16"}
_SCALE_BYTES = 4  # one float32 scale per int8 block


@dataclass(frozen=True)
class Compression:
    """What `train.grad_compression` and its knobs ask for (docs/config.md).

    Attributes:
        kind: one of `KINDS`.
        ratio: top-k: fraction of each bucket's entries sent, in (0, 1].
        rank: PowerSGD: rank of the factors (>= 1; min(rank, rows, columns) per matrix).
        start_step: steps before this one reduce uncompressed (warm-up, as PyTorch's hook).
        error_feedback: keep the residuals (int8, topk, powersgd; 16-bit wires have none).
        block_size: int8: values per float32 scale (>= 1).
        seed: PowerSGD's initial Q (the run's seed).
    """

    kind: str = "none"
    ratio: float = 0.01
    rank: int = 4
    start_step: int = 0
    error_feedback: bool = True
    block_size: int = 256
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"gradient compression {self.kind!r} is unknown; choose one of {', '.join(KINDS)}")
        if not 0 < self.ratio <= 1:
            raise ConfigError(f"compression ratio {self.ratio!r} is outside (0, 1]: it is the fraction of each "
                              "bucket's entries top-k sends")
        if isinstance(self.rank, bool) or self.rank < 1:
            raise ConfigError(f"PowerSGD rank {self.rank!r} must be >= 1")
        if isinstance(self.block_size, bool) or self.block_size < 1:
            raise ConfigError(f"int8 block size {self.block_size!r} must be >= 1")
        if self.start_step < 0:
            raise ConfigError(f"compression start step {self.start_step!r} must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def bucket_group(self, ndim: int, tp_split: bool) -> Hashable:
        """The bucket group of a parameter (`assign_buckets(groups=...)`): PowerSGD keeps matrices
        and vectors apart; int8 and top-k keep tp-split and tp-replicated parameters apart (their
        blocks and selections span parameters, and a replicated parameter must come out the same
        on every tp rank); the 16-bit wires work elementwise and need no groups."""
        if self.kind == "powersgd":
            return "matrix" if ndim >= 2 else "vector"
        if self.kind in ("int8", "topk"):
            return "tp_split" if tp_split else "tp_replicated"
        return None


@dataclass(frozen=True)
class SpecSlot:
    """A parameter (or a piece of one) inside a compressor's bucket array."""

    key: str       # the parameter's global name (a tied copy: the name of the weight it mirrors)
    offset: int    # first element in the bucket array
    numel: int
    shape: tuple   # the parameter's local shape (PowerSGD: whole parameters only)


@dataclass(frozen=True)
class BucketSpec:
    """What a compressor knows about bucket `index`: the flat array it is handed each step."""

    index: int
    size: int       # elements (a multiple of the communicator's size)
    dtype: str
    slots: tuple    # SpecSlot, in bucket order


class Residuals:
    """Error-feedback residuals per bucket, double-buffered: `add(index, grad)` returns grad plus
    the committed residual in the spare buffer, which the compressor then turns into this step's
    residual in place; `commit()` adopts this step's residuals (the old ones become spares), so a
    step that is not committed (skipped for a non-finite gradient) leaves them as they were."""

    def __init__(self):
        self.current: dict[int, Any] = {}
        self.pending: dict[int, Any] = {}
        self._spare: dict[int, Any] = {}

    def add(self, index: int, grad):
        buf = self.pending.pop(index, None)  # an uncommitted step's buffer is free again
        if buf is None:
            buf = self._spare.pop(index, None)
        if buf is None or buf.shape != grad.shape:
            buf = backend.array_module(grad).empty_like(grad)
        buf[...] = grad
        old = self.current.get(index)
        if old is not None:
            buf += old
        self.pending[index] = buf
        return buf

    def commit(self) -> None:
        for index, buf in self.pending.items():
            old = self.current.get(index)
            self.current[index] = buf
            if old is not None:
                self._spare[index] = old
        self.pending = {}

    def load(self, index: int, array) -> None:
        """Take a committed residual (from a checkpoint); any step in flight is dropped."""
        self.pending.pop(index, None)
        self.current[index] = array


class Compressor(ABC):
    """One bucket's compressed average over `comm` (see the module docstring for the protocol).

    Attributes:
        gathers: the caller will ask for the whole average (`all_gather`) after `decompress`
            (set by `CompressedReduction`; compressors whose exchange delivers everything keep it).
    """

    name = ""
    error_feedback = False

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.specs: dict[int, BucketSpec] = {}
        self.gathers = True

    def setup(self, specs: list[BucketSpec]) -> None:
        """The buckets this compressor will see (before the first `compress`)."""
        for spec in specs:
            if spec.size % self.comm.size:
                raise ConfigError(f"bucket {spec.index} of {spec.size} elements does not divide into "
                                  f"{self.comm.size} parts; pad the buckets to a multiple of the group")
        self.specs = {s.index: s for s in specs}

    @abstractmethod
    def compress(self, index: int, grad) -> Any:
        """Bucket `index`'s local gradient `[size]` -> what goes on the wire. Must not block."""

    @abstractmethod
    def exchange(self, payload: Any) -> Handle:
        """Start the non-blocking collective; the handle's `wait()` gives what this rank received."""

    @abstractmethod
    def decompress(self, index: int, received: Any):
        """What this rank received -> the average of its part of the bucket, `[size/n]`."""

    @abstractmethod
    def all_gather(self, index: int, part):
        """This rank's averaged part -> the whole averaged bucket `[size]`, bitwise the same on every rank."""

    def commit(self) -> None:
        """Adopt the state the last step computed (its update was applied)."""

    def state(self) -> dict[str, dict]:
        """The committed state, for checkpoints: {"residual": {index: array over the bucket},
        "owner_residual": {index: array over this rank's part}, "powersgd_q": {(index, j): Q of
        the bucket's j-th matrix}}
        (only the kinds this compressor keeps)."""
        return {}

    def load_state(self, state: dict[str, dict]) -> None:
        """Take state of `state()`'s structure (arrays of the right shapes; missing entries keep
        their current value, zero residuals or the initial Q)."""

    def _part(self, whole):
        n = whole.shape[0] // self.comm.size
        return whole[self.comm.rank * n:(self.comm.rank + 1) * n]


# -- the 16-bit wire ------------------------------------------------------------------------------

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


class Wire16(Compressor):
    """Gradients on the wire as float16 or bfloat16 bits, summed in float32 (no error feedback:
    the rounding is to nearest, about 1e-3 relative for float16 and 1e-2 for bfloat16)."""

    def __init__(self, comm: Communicator, wire_dtype: str):
        if wire_dtype not in ("float16", "bfloat16"):
            raise ConfigError(f"Wire16 carries float16 or bfloat16, not {wire_dtype!r}")
        super().__init__(comm)
        self.wire_dtype = wire_dtype
        self.name = "fp16" if wire_dtype == "float16" else "bf16"

    def compress(self, index: int, grad):
        return encode16(grad, self.wire_dtype).reshape(self.comm.size, -1)  # row r goes to rank r

    def exchange(self, payload) -> Handle:
        return self.comm.iall_to_all(payload, dim=0)

    def decompress(self, index: int, received):
        # received[r] = rank r's copy of my part (16-bit): sum in float32, average.
        part = decode16(received, self.wire_dtype).sum(axis=0)
        part /= self.comm.size
        return part

    def all_gather(self, index: int, part):
        return decode16(self.comm.all_gather(encode16(part, self.wire_dtype), dim=0), self.wire_dtype)


# -- int8: blockwise absmax quantization, two compressed phases ------------------------------------

def accumulation_dtype(dtype) -> np.dtype:
    """float32, or the gradient's dtype when it is wider: what int8 and 16-bit values are summed in."""
    return np.result_type(np.float32, np.dtype(dtype))


def int8_encode(x, block_size: int):
    """Rows `[rows, m]` -> (int8 `[rows, m]`, float32 scales `[rows, ceil(m / block_size)]`).

    Each block of `block_size` values along a row (the last one may be shorter) gets the scale
    absmax / 127 and the values `rint(x / scale)` (half to even, within [-127, 127]). A block of
    zeros (or of values below float32's smallest normal scale) sends zeros; a non-finite block
    sends a NaN or infinite scale, so that the average shows it (a NaN step is skipped)."""
    xp = backend.array_module(x)
    rows, m = x.shape
    nb = -(-m // block_size)
    pad = nb * block_size - m
    wide = xp.concatenate([x, xp.zeros((rows, pad), dtype=x.dtype)], axis=1) if pad else x
    blocks = wide.reshape(rows, nb, block_size)
    scales = (xp.abs(blocks).max(axis=2) / 127).astype(xp.float32)
    scales = xp.where(scales < np.finfo(np.float32).tiny, xp.float32(0), scales)  # NaN stays NaN
    usable = (scales > 0) & xp.isfinite(scales)
    dt = accumulation_dtype(x.dtype)
    y = blocks.astype(dt, copy=False) / xp.where(usable, scales, xp.float32(1)).astype(dt)[:, :, None]
    y = xp.where(usable[:, :, None], xp.clip(xp.rint(y), -127, 127), 0)
    q = y.astype(xp.int8).reshape(rows, nb * block_size)[:, :m]
    return xp.ascontiguousarray(q), scales


def int8_decode(q, scales, block_size: int, dtype):
    """(int8 `[rows, m]`, scales `[rows, nb]`) -> values `[rows, m]` in `dtype` (each an exact
    product `q * scale` in float64; rounded once to float32 otherwise)."""
    xp = backend.array_module(q)
    m = q.shape[1]
    return q.astype(dtype) * xp.repeat(scales.astype(dtype), block_size, axis=1)[:, :m]


def _pack(q, scales):
    """int8 `[rows, m]` + float32 `[rows, nb]` -> one uint8 message `[rows, m + 4 nb]`."""
    xp = backend.array_module(q)
    rows, m = q.shape
    out = xp.empty((rows, m + _SCALE_BYTES * scales.shape[1]), dtype=xp.uint8)
    out[:, :m] = q.view(xp.uint8)
    out[:, m:] = xp.ascontiguousarray(scales).view(xp.uint8).reshape(rows, -1)
    return out


def _unpack(message, m: int):
    """`_pack`'s inverse: uint8 `[rows, m + 4 nb]` -> (int8 `[rows, m]`, float32 `[rows, nb]`)."""
    xp = backend.array_module(message)
    return message[:, :m].view(xp.int8), xp.ascontiguousarray(message[:, m:]).view(xp.float32)


class Int8(Compressor):
    """int8 with blockwise absmax scales; error feedback on the worker and, in the all-reduce
    case, on the owner of each part (its re-quantization of the average)."""

    name = "int8"

    def __init__(self, comm: Communicator, block_size: int = 256, error_feedback: bool = True):
        super().__init__(comm)
        self.block_size = block_size
        self.error_feedback = error_feedback
        self.worker = Residuals()  # per bucket, [size]: what this rank's quantization dropped
        self.owner = Residuals()   # per bucket, [size/n]: what the re-quantization of my part dropped

    def compress(self, index: int, grad):
        x = self.worker.add(index, grad) if self.error_feedback else grad
        rows = x.reshape(self.comm.size, -1)  # row j goes to rank j
        q, scales = int8_encode(rows, self.block_size)
        if self.error_feedback:
            rows -= int8_decode(q, scales, self.block_size, x.dtype)  # x becomes the residual
        return _pack(q, scales)

    def exchange(self, payload) -> Handle:
        return self.comm.iall_to_all(payload, dim=0)

    def decompress(self, index: int, received):
        m = self.specs[index].size // self.comm.size
        q, scales = _unpack(received, m)
        dt = accumulation_dtype(self.specs[index].dtype)
        values = int8_decode(q, scales, self.block_size, dt)
        part = backend.array_module(values).zeros(m, dtype=dt)
        for row in values:  # in rank order: the same bits on every rank and in the reference
            part += row
        part /= self.comm.size
        return part

    def all_gather(self, index: int, part):
        y = self.owner.add(index, part) if self.error_feedback else part
        q, scales = int8_encode(y.reshape(1, -1), self.block_size)
        if self.error_feedback:
            y -= int8_decode(q, scales, self.block_size, y.dtype)[0]
        gathered = self.comm.all_gather(_pack(q, scales)[0], dim=0).reshape(self.comm.size, -1)
        q, scales = _unpack(gathered, part.shape[0])
        return int8_decode(q, scales, self.block_size, part.dtype).reshape(-1)

    def commit(self) -> None:
        self.worker.commit()
        self.owner.commit()

    def state(self) -> dict[str, dict]:
        return {"residual": dict(self.worker.current), "owner_residual": dict(self.owner.current)}

    def load_state(self, state: dict[str, dict]) -> None:
        for index, a in state.get("residual", {}).items():
            self.worker.load(index, a)
        for index, a in state.get("owner_residual", {}).items():
            self.owner.load(index, a)


# -- top-k: (index, value) pairs, all-gathered ----------------------------------------------------

def topk_count(size: int, ratio: float) -> int:
    """Entries top-k sends from a bucket of `size`: ceil(ratio * size), at least 1."""
    return max(1, min(size, math.ceil(ratio * size)))


def _topk_row_bytes(k: int, dtype) -> int:
    """Bytes of one rank's top-k message: k values, k int32 indices, padded to 8."""
    return -(-k * (np.dtype(dtype).itemsize + 4) // 8) * 8


def topk_select(x, k: int):
    """The positions (int32, ascending) of the `k` largest |x|."""
    xp = backend.array_module(x)
    if k >= x.size:
        return xp.arange(x.size, dtype=xp.int32)
    idx = xp.argpartition(xp.abs(x), x.size - k)[x.size - k:]
    return xp.sort(idx).astype(xp.int32)


class TopK(Compressor):
    """The k largest-magnitude entries of each bucket (plus its residual) as (index, value) pairs."""

    name = "topk"

    def __init__(self, comm: Communicator, ratio: float = 0.01, error_feedback: bool = True):
        super().__init__(comm)
        self.ratio = ratio
        self.error_feedback = error_feedback
        self.worker = Residuals()
        self._whole: dict[int, Any] = {}

    def setup(self, specs: list[BucketSpec]) -> None:
        super().setup(specs)
        for s in specs:
            if s.size >= 2 ** 31:
                raise ConfigError(f"top-k indexes bucket {s.index} of {s.size} elements with int32; "
                                  "use smaller buckets (train.bucket_mb)")

    def compress(self, index: int, grad):
        xp = backend.array_module(grad)
        x = self.worker.add(index, grad) if self.error_feedback else grad
        idx = topk_select(x, topk_count(x.size, self.ratio))
        values = x[idx]
        if not bool(xp.isfinite(x).all()):
            values[0] = xp.nan  # a non-finite gradient must reach the average (the step is skipped)
        if self.error_feedback:
            x[idx] = 0  # x becomes the residual: everything not sent
        # Values first, then indices, each row padded to 8 bytes: every array stays aligned.
        payload = xp.zeros(_topk_row_bytes(idx.size, values.dtype), dtype=xp.uint8)
        payload[:values.nbytes] = values.view(xp.uint8)
        payload[values.nbytes:values.nbytes + idx.nbytes] = idx.view(xp.uint8)
        return payload

    def exchange(self, payload) -> Handle:
        return self.comm.iall_gather(payload, dim=0)

    def decompress(self, index: int, received):
        spec = self.specs[index]
        xp = backend.array_module(received)
        k = topk_count(spec.size, self.ratio)
        rows = received.reshape(self.comm.size, -1)
        whole = xp.zeros(spec.size, dtype=spec.dtype)
        nv = k * whole.dtype.itemsize
        for row in rows:  # every rank adds the same pairs in the same (rank) order
            whole[row[nv:nv + 4 * k].view(xp.int32)] += row[:nv].view(whole.dtype)
        whole /= self.comm.size
        if self.gathers:
            self._whole[index] = whole
        return self._part(whole)

    def all_gather(self, index: int, part):
        return self._whole.pop(index)  # the exchange delivered every rank's pairs already

    def commit(self) -> None:
        self.worker.commit()

    def state(self) -> dict[str, dict]:
        return {"residual": dict(self.worker.current)}

    def load_state(self, state: dict[str, dict]) -> None:
        for index, a in state.get("residual", {}).items():
            self.worker.load(index, a)


def make_compressor(compression: Compression | str, comm: Communicator) -> Compressor | None:
    """The compressor `compression` asks for over `comm`; None for "none". A plain string is a
    kind (or one of the old wire dtypes, "float32", "float16", "bfloat16") with default knobs."""
    if isinstance(compression, str):
        compression = Compression(WIRE_DTYPE_KINDS.get(compression, compression))
    c = compression
    if c.kind == "none":
        return None
    if c.kind in ("fp16", "bf16"):
        return Wire16(comm, "float16" if c.kind == "fp16" else "bfloat16")
    if c.kind == "int8":
        return Int8(comm, c.block_size, c.error_feedback)
    if c.kind == "topk":
        return TopK(comm, c.ratio, c.error_feedback)
    from hpcpar.parallel.dp.compression.powersgd import PowerSGD  # one module per mechanism; it builds on this one
    return PowerSGD(comm, c.rank, c.error_feedback, c.seed)
