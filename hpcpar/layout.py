"""How a rank's local array maps onto a global tensor.

A `Layout` is a list of blocks; each block pairs a region of the local array with
the region of the global tensor it holds. A replicated tensor has one block
covering everything. A tensor split along a dim has one block. The fused attention
weight `c_attn` ([3C, C], rows [q; k; v]) split over tp has three blocks: rank r
holds rows r of q, r of k and r of v. Checkpoints and gradient-norm clipping read
layouts; they never need to know which layer produced them.

Pure Python: no MPI, no array module.
"""

from __future__ import annotations

from dataclasses import dataclass

Region = tuple  # tuple[slice, ...], one slice per dim


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
        covered = sum(_size(b.local) for b in self.blocks)
        return covered < _size(_full(self.local_shape))

    def take(self, global_array):
        """The local array cut out of a full global array (same array module)."""
        if self.is_replicated:
            return global_array.copy()
        padded = self.padded
        if len(self.blocks) == 1 and not padded:
            return global_array[self.blocks[0].glob].copy()
        xp = _module_of(global_array)
        out = (xp.zeros if padded else xp.empty)(self.local_shape, dtype=global_array.dtype)
        for b in self.blocks:
            out[b.local] = global_array[b.glob]
        return out

    def put(self, local_array, global_out) -> None:
        """Write this rank's blocks of `local_array` into `global_out` (in place)."""
        for b in self.blocks:
            global_out[b.glob] = local_array[b.local]

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


def _size(region: Region) -> int:
    size = 1
    for s in region:
        size *= s.stop - s.start
    return size


def _module_of(array):
    import importlib
    return importlib.import_module(type(array).__module__.split(".")[0])
