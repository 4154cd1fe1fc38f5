"""How a rank's local array maps onto a global tensor.

A `Layout` is a list of blocks; each block pairs a region of the local array with
the region of the global tensor it holds. A replicated tensor has one block
covering everything. A tensor split along a dim has one block. The fused attention
weight `c_attn` ([3C, C], rows [q; k; v]) split over tp has three blocks: rank r
holds rows r of q, r of k and r of v. Checkpoints and gradient-norm clipping read
layouts; they never need to know which layer produced them.

ZeRO shards a parameter's *flattened* local array: `layout.flat_range(lo, hi)` is the layout of
elements [lo, hi) of it, a 1-D local array whose blocks are *flat blocks*: a contiguous range of
the local array (one slice) holding a rectangular global region in C order. A flat range of an
[R, C] tensor is at most 3 rectangles (a partial first row, whole rows, a partial last row).
`take`, `put` and checkpoints reshape a flat block's elements to its region.

Region arithmetic (`bounds`, `volume`, `contains`, `intersect`) works on `Bounds`, a region as
(start, stop) per dim: hashable and JSON-able, the form checkpoints record regions in.

Pure Python: no MPI, no array module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Region = tuple  # tuple[slice, ...], one slice per dim
Bounds = tuple  # tuple[tuple[int, int], ...]: a region as (start, stop) per dim


@dataclass(frozen=True)
class Block:
    """One region of the local array (`local`) and where it sits in the global tensor (`glob`)."""

    local: Region
    glob: Region


def _full(shape) -> Region:
    return tuple(slice(0, n) for n in shape)


def _replace(region: Region, dim: int, s: slice) -> Region:
    r = list(region)
    r[dim] = s
    return tuple(r)


@dataclass(frozen=True)
class Layout:
    """Local shard <-> global tensor map.

    Attributes:
        global_shape: shape of the global tensor (what a 1-process model holds).
        local_shape: shape of this rank's array.
        blocks: regions of the local array and the global regions they hold.
        split_dim: the dim split across ranks, or None when replicated.
    """

    global_shape: tuple
    local_shape: tuple
    blocks: tuple
    split_dim: int | None = None

    @classmethod
    def replicated(cls, shape) -> "Layout":
        shape = tuple(shape)
        return cls(shape, shape, (Block(_full(shape), _full(shape)),), None)

    @classmethod
    def split(cls, shape, dim: int, index: int, count: int, groups: int = 1) -> "Layout":
        """Split `dim` into `count` equal parts and keep part `index`.

        With `groups > 1` the dim is first cut into `groups` equal groups (e.g. q, k, v)
        and each group is split; the local array holds part `index` of every group,
        concatenated in group order.
        """
        shape = tuple(shape)
        dim = dim % len(shape)
        if shape[dim] % (groups * count):
            raise ValueError(f"dim {dim} of size {shape[dim]} does not split into "
                             f"{groups} group(s) x {count} parts")
        group = shape[dim] // groups
        part = group // count
        local_shape = tuple(part * groups if d == dim else n for d, n in enumerate(shape))
        blocks = tuple(
            Block(_replace(_full(local_shape), dim, slice(g * part, (g + 1) * part)),
                  _replace(_full(shape), dim, slice(g * group + index * part,
                                                    g * group + (index + 1) * part)))
            for g in range(groups))
        return cls(shape, local_shape, blocks, dim if count > 1 else None)

    @classmethod
    def split_padded(cls, shape, dim: int, index: int, count: int) -> "Layout":
        """Split `dim` into `count` parts of ceil(n / count) and keep part `index`, padded.

        The global tensor keeps its true size n; the local array always has ceil(n / count)
        along `dim`, and its rows past global row n belong to no global element: padding, zero
        from `take`, never saved or loaded. Megatron pads the vocabulary like this so that any tp
        splits it; since the global shape does not grow, checkpoints stay independent of tp.
        When `count` divides n this is `split(shape, dim, index, count)`.
        """
        shape = tuple(shape)
        dim = dim % len(shape)
        n = shape[dim]
        part = -(-n // count)
        lo, hi = min(index * part, n), min((index + 1) * part, n)
        local_shape = tuple(part if d == dim else m for d, m in enumerate(shape))
        blocks = () if hi == lo else (
            Block(_replace(_full(local_shape), dim, slice(0, hi - lo)), _replace(_full(shape), dim, slice(lo, hi))),)
        return cls(shape, local_shape, blocks, dim if count > 1 else None)

    @property
    def is_replicated(self) -> bool:
        return self.split_dim is None and self.local_shape == self.global_shape

    @property
    def padded(self) -> bool:
        """Whether part of the local array holds no global element (see `split_padded`)."""
        covered = sum(math.prod(region_shape(b.local)) for b in self.blocks)
        return covered < math.prod(self.local_shape)

    def take(self, global_array):
        """The local array cut out of a full global array (same array module)."""
        if self.is_replicated:
            return global_array.copy()
        padded = self.padded
        if len(self.blocks) == 1 and not padded and not is_flat(self.blocks[0]):
            return global_array[self.blocks[0].glob].copy()
        xp = _module_of(global_array)
        out = (xp.zeros if padded else xp.empty)(self.local_shape, dtype=global_array.dtype)
        for b in self.blocks:
            out[b.local] = global_array[b.glob].reshape(out[b.local].shape)
        return out

    def put(self, local_array, global_out) -> None:
        """Write this rank's blocks of `local_array` into `global_out` (in place)."""
        for b in self.blocks:
            global_out[b.glob] = local_array[b.local].reshape(region_shape(b.glob))

    def flat_range(self, lo: int, hi: int) -> "Layout":
        """The layout of elements [lo, hi) of this layout's local array flattened in C order (a
        ZeRO shard of a parameter): local shape `(hi - lo,)`, one flat block per rectangular
        piece of the global tensor, in local order."""
        n = math.prod(self.local_shape)
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"flat range [{lo}, {hi}) is outside a local array of {n} elements")
        blocks = []
        for piece in _flat_pieces(tuple(self.local_shape), lo, hi):
            for b in self.blocks:
                overlap = intersect(bounds(piece), bounds(b.local))
                if overlap is None:
                    continue
                inner = tuple(slice(s, e) for s, e in overlap)
                for part in _contiguous_parts(inner, tuple(self.local_shape)):
                    start = _flat_index(part, tuple(self.local_shape)) - lo
                    glob = tuple(slice(g.start + p.start - q.start, g.start + p.stop - q.start)
                                 for p, q, g in zip(part, b.local, b.glob))
                    blocks.append(Block((slice(start, start + math.prod(region_shape(part))),), glob))
        blocks.sort(key=lambda b: b.local[0].start)
        return Layout(tuple(self.global_shape), (hi - lo,), tuple(blocks), None)

    def to_json(self) -> dict:
        """Plain-data form (for checkpoint attributes and metadata exchange)."""
        return {
            "global_shape": list(self.global_shape),
            "local_shape": list(self.local_shape),
            "split_dim": self.split_dim,
            "blocks": [[[[s.start, s.stop] for s in b.local], [[s.start, s.stop] for s in b.glob]]
                       for b in self.blocks],
        }

    @classmethod
    def from_json(cls, d: dict) -> "Layout":
        def region(r):
            return tuple(slice(a, b) for a, b in r)
        return cls(tuple(d["global_shape"]), tuple(d["local_shape"]),
                   tuple(Block(region(lo), region(gl)) for lo, gl in d["blocks"]),
                   d["split_dim"])


def region_shape(region: Region) -> tuple:
    """The shape of a region: (stop - start) per dim."""
    return tuple(s.stop - s.start for s in region)


def is_flat(block: Block) -> bool:
    """A flat block: a range of a 1-D local array holding a global region of more dims."""
    return len(block.local) != len(block.glob)


def bounds(region: Region) -> Bounds:
    """`region` as (start, stop) per dim."""
    return tuple((s.start, s.stop) for s in region)


def volume(region: Bounds) -> int:
    """How many elements `region` holds."""
    return math.prod(b - a for a, b in region)


def contains(outer: Bounds, inner: Bounds) -> bool:
    """Whether every element of `inner` lies in `outer`."""
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def intersect(x: Bounds, y: Bounds) -> Bounds | None:
    """The elements `x` and `y` share, or None when they share none (a scalar () intersects itself)."""
    out = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y))
    return out if all(a < b for a, b in out) else None


def _flat_index(region: Region, shape: tuple) -> int:
    """Flat (C order) index of a region's first element in an array of `shape`."""
    index = 0
    for s, n in zip(region, shape):
        index = index * n + s.start
    return index


def _contiguous_parts(region: Region, shape: tuple) -> list:
    """`region` cut into pieces that are contiguous in C order: after the first dim with more than
    one index, every dim must be whole; otherwise split along that dim, one index at a time."""
    for d, (s, n) in enumerate(zip(region, shape)):
        if s.stop - s.start > 1:
            if all(t.start == 0 and t.stop == m for t, m in zip(region[d + 1:], shape[d + 1:])):
                return [region]
            return [part for i in range(s.start, s.stop)
                    for part in _contiguous_parts(region[:d] + (slice(i, i + 1),) + region[d + 1:], shape)]
    return [region]


def _flat_pieces(shape: tuple, lo: int, hi: int) -> list:
    """Flat elements [lo, hi) of an array of `shape` as rectangles contiguous in C order, in order:
    for 2-D a partial first row, the whole rows, a partial last row (at most 3)."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [(slice(lo, hi),)]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return [(slice(first, first + 1),) + r for r in _flat_pieces(shape[1:], lo - first * inner, hi - first * inner)]
    pieces = []
    if lo % inner:
        pieces += _flat_pieces(shape, lo, (first + 1) * inner)
        first += 1
    whole_end = hi // inner
    if whole_end > first:
        pieces.append((slice(first, whole_end),) + tuple(slice(0, n) for n in shape[1:]))
    if hi % inner:
        pieces += _flat_pieces(shape, whole_end * inner, hi)
    return pieces


def _module_of(array):
    import importlib
    return importlib.import_module(type(array).__module__.split(".")[0])
