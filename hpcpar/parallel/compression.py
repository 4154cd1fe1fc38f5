"""Gradient compression on the data-parallel wire: the compressor interface and the 16-bit wire.

A compressor decides how one gradient bucket (a flat array `[size]`, `size` a multiple of dp;
see hpcpar/parallel/buckets.py) travels over the dp communicator in fewer bytes. It serves
both places a bucket can end up:

- reduce-scatter (ZeRO): every rank needs only the average of its own part,
  `[rank * size/dp, (rank + 1) * size/dp)`;
- all-reduce: every rank needs the whole averaged bucket, and all ranks the same bytes of it,
  so that the replicas stay identical.

So the interface is a compressed reduce-scatter followed, for the all-reduce case only, by a
compressed all-gather:

    payload  = compress(index, grad)      local; called from a grad hook, so it must not block
    handle   = exchange(payload)          starts the non-blocking collective(s)
    part     = decompress(index, handle.wait())    this rank's averaged part, float32 [size/dp]
    whole    = all_gather(index, part)    all-reduce case: the whole average [size], same on all ranks

`index` is the bucket's index, constant from step to step, for compressors that keep state per
bucket (error-feedback residuals, PowerSGD's warm-started factors). `CompressedReduction` in
buckets.py is what calls these methods, in this order, for every bucket.

The 16-bit wire (`Wire16`, `wire_dtype` "float16" or "bfloat16"): the bucket is cast to 16
bits (bfloat16, which NumPy lacks, as the upper half of a float32 with round-to-nearest-even,
held in uint16) and viewed as `[dp, size/dp]`; an all-to-all hands rank r every rank's row r
(`[dp, size/dp]` received), which it decodes and sums in float32 and divides by dp; for the
all-reduce case the averaged part is cast to 16 bits again and all-gathered. That is the
traffic of a ring all-reduce at half width, with float32 accumulation; every rank decodes the
same gathered bytes, so replicas stay identical.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from hpcpar import backend
from hpcpar.comm import Communicator, Handle
from hpcpar.errors import ConfigError

WIRE_DTYPES = ("float32", "float16", "bfloat16")  # "float32": no compression (gradients keep their dtype)


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


class Compressor(ABC):
    """One bucket's compressed average over `comm` (see the module docstring for the protocol)."""

    def __init__(self, comm: Communicator):
        self.comm = comm

    @abstractmethod
    def compress(self, index: int, grad) -> Any:
        """Bucket `index`'s local gradient `[size]` -> what goes on the wire. Must not block."""

    @abstractmethod
    def exchange(self, payload: Any) -> Handle:
        """Start the non-blocking collective; the handle's `wait()` gives what this rank received."""

    @abstractmethod
    def decompress(self, index: int, received: Any):
        """What this rank received -> the average of its part of the bucket, float32 `[size/dp]`."""

    @abstractmethod
    def all_gather(self, index: int, part):
        """This rank's averaged part -> the whole averaged bucket `[size]`, bitwise the same on every rank."""


class Wire16(Compressor):
    """Gradients on the wire as float16 or bfloat16 bits, summed in float32."""

    def __init__(self, comm: Communicator, wire_dtype: str):
        if wire_dtype not in ("float16", "bfloat16"):
            raise ConfigError(f"Wire16 carries float16 or bfloat16, not {wire_dtype!r}")
        super().__init__(comm)
        self.wire_dtype = wire_dtype

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


def make_compressor(wire_dtype: str, comm: Communicator) -> Compressor | None:
    """The compressor for `wire_dtype` over `comm`; None for "float32" (no compression)."""
    if wire_dtype not in WIRE_DTYPES:
        raise ConfigError(f"wire_dtype {wire_dtype!r} is not supported; choose one of {', '.join(WIRE_DTYPES)}")
    return None if wire_dtype == "float32" else Wire16(comm, wire_dtype)
