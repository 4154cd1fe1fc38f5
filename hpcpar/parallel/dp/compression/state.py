"""Gradient compressors' state in checkpoints: error-feedback residuals and PowerSGD's Q, saved as
global tensors like every other tensor (docs/checkpoint-format.md), sharded like the buckets.

A compressor sees, per bucket, a flat array: the whole bucket, or under HSDP this rank's shard
of it (`starts[index]` is where that array begins in the bucket). Its pieces of parameters map to
the global tensors through `Layout.flat_range`, as ZeRO's optimizer state does:

    compress/residual/<name>        [g, *shape]: row k holds what rank k of the compression group
                                    (g ranks: dp x cp, or dp_replicate under HSDP) still owes, for
                                    the pieces of the parameter its arrays cover. Every rank's
                                    residual is its own, hence one row per rank.
    compress/owner_residual/<name>  [*shape]: int8's owner-side residual (two-phase, all-reduce
                                    case); the owners' parts tile the parameter once.
    compress/powersgd_q/<name>      [tp, b, r]: row t is tp rank t's warm-started Q of its local
                                    matrix `[a, b]` (the same on every dp rank).

Tied copies are skipped (the weight they mirror is saved; its state is the same bits), and so are
tp-replicated parameters on tp ranks other than 0 (the same bits too), except Q, whose rows are
per tp rank.

`CompressionState` is the gradient sync strategy's checkpointed part for all this
(`Checkpointable`, hpcpar/state.py); its metadata `compression` lists every rank's tensors.

Loading (`load_checkpoint_state`): with the same group size each rank takes its own row, so a resumed
run continues bitwise; with another group size every rank takes the mean of the stored rows (the
average residual, which is what error feedback pays back into the averaged gradient, is kept);
owner residuals load into any layout; Q loads when tp and the rank agree, else each matrix starts
from its initial Q again. What the checkpoint lacks (saved without compression, or by a
compressor that keeps no such state) starts at zero / the initial Q; a checkpoint's compressor
state is ignored when loading without compression.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from hpcpar import backend
from hpcpar.runtime.comm import Communicator
from hpcpar.layout import Block, Layout
from hpcpar.parallel.dp.compression.compressors import Compressor, accumulation_dtype
from hpcpar.state import SavedState, StoredState

RESIDUAL = "compress/residual/"
OWNER_RESIDUAL = "compress/owner_residual/"
POWERSGD_Q = "compress/powersgd_q/"


def _pieces(bucket, lo: int, hi: int) -> list[tuple[Any, int, int, int]]:
    """(param, a, z, at): elements [a, z) of the flattened param lie in bucket elements [lo, hi),
    starting at element `at` of that range."""
    out = []
    for s, p in zip(bucket.assignment.slots, bucket.params):
        a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < z:
            out.append((p, a - s.offset, z - s.offset, a - lo))
    return out


def with_rows(flat: Layout, row: int | None, rows: int) -> Layout:
    """`flat` (a flat range of a parameter) inside a tensor with a leading dim of `rows`: this
    rank holds row `row` (local shape unchanged), or with `row=None` all rows (local
    `[rows, *flat.local_shape]`, to average them)."""
    shape = (rows,) + tuple(flat.global_shape)
    if row is not None:
        return Layout(shape, flat.local_shape, tuple(Block(b.local, (slice(row, row + 1),) + b.glob)
                                                     for b in flat.blocks), 0)
    every = slice(0, rows)
    return Layout(shape, (rows,) + tuple(flat.local_shape),
                  tuple(Block((every,) + b.local, (every,) + b.glob) for b in flat.blocks), 0)


def q_layout(shape: tuple, tp_rank: int, tp_size: int) -> Layout:
    """A Q `[b, r]` as row `tp_rank` of `[tp, b, r]`."""
    whole = tuple(slice(0, n) for n in shape)
    return Layout((tp_size,) + tuple(shape), tuple(shape), (Block(whole, (slice(tp_rank, tp_rank + 1),) + whole),), 0)


class CompressionState:
    """Maps a compressor's state onto global tensors (module docstring).

    Args:
        compressor: the compressor (its `comm` is the compression group).
        buckets: the `Bucket`s, by index (assignments and parameters).
        starts: bucket index -> first bucket element of the compressor's array.
        key_of: a parameter's checkpoint name (a tied copy: the weight it mirrors).
        tp_comm: the tensor-parallel group (Q rows; replicated parameters saved by tp rank 0).
        world: every rank of the mesh (a save lists every rank's tensor names in the metadata).
    """

    def __init__(self, compressor: Compressor, buckets: list, starts: dict[int, int],
                 key_of: Callable[[Any], str], tp_comm: Communicator, world: Communicator):
        self.compressor, self.buckets, self.starts = compressor, buckets, starts
        self.key_of, self.tp, self.world = key_of, tp_comm, world
        self.group = compressor.comm

    def checkpoint_state(self) -> SavedState:
        """The committed state this rank saves (`compress/...`), and what a loader needs to map
        it back: the metadata `compression` (`_meta`, and the names of every rank's tensors:
        collective over the world). `Checkpointable`, hpcpar/state.py."""
        tensors = self._tensors()
        names = set().union(*self.world.all_gather_object(sorted(tensors)))
        return SavedState(tensors, {"compression": {**self._meta(), "names": sorted(names)}})

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """The checkpoint's compressor state, zeros (or the initial Q) for what it lacks; nothing
        with a weights-only load or from a checkpoint saved without compression."""
        saved = stored.meta.get("compression")
        if stored.weights_only or not saved:
            return
        stored.read(self._wanted(saved), lambda arrays: self._load(arrays, saved))

    def _saves(self, p) -> bool:
        return not getattr(p, "tied_to", None) and (self.tp.rank == 0 or not p.layout.is_replicated)

    def _matrices(self, index: int) -> list:
        return [p for p in self.buckets[index].params if len(p.shape) >= 2]

    def _keeps_owner(self) -> bool:
        return hasattr(self.compressor, "owner") and self.compressor.gathers

    def _residual_pieces(self, index: int, owner: bool) -> list[tuple[Any, int, int, int]]:
        size = self.compressor.specs[index].size
        if owner:  # this rank's part of the compressor's array
            n = size // self.group.size
            lo = self.starts[index] + self.group.rank * n
            return _pieces(self.buckets[index], lo, lo + n)
        return _pieces(self.buckets[index], self.starts[index], self.starts[index] + size)

    def _meta(self) -> dict:
        """What a loader needs to know about the saved state (besides the tensors' names)."""
        return {"kind": self.compressor.name, "group": self.group.size, "tp": self.tp.size,
                "rank": getattr(self.compressor, "rank", None)}

    def _tensors(self) -> dict[str, tuple[Any, Layout]]:
        """{global name: (local array, Layout)} of the committed state this rank saves."""
        state = self.compressor.state()
        g, k = self.group.size, self.group.rank
        out = {}
        for owner, prefix in ((False, RESIDUAL), (True, OWNER_RESIDUAL)):
            for index, array in state.get("owner_residual" if owner else "residual", {}).items():
                for p, a, z, at in self._residual_pieces(index, owner):
                    if self._saves(p):
                        flat = p.layout.flat_range(a, z)
                        out[prefix + self.key_of(p)] = (array[at:at + z - a], flat if owner else with_rows(flat, k, g))
        for (index, j), q in state.get("powersgd_q", {}).items():
            p = self._matrices(index)[j]
            if not getattr(p, "tied_to", None):
                out[POWERSGD_Q + self.key_of(p)] = (q, q_layout(tuple(q.shape), self.tp.rank, self.tp.size))
        return out

    def _wanted(self, stored: dict) -> dict[str, Layout]:
        """{name: Layout} this rank loads from a checkpoint whose compression meta is `stored`
        (its `_meta()` plus "names", every compressor tensor it holds)."""
        names, g_old = set(stored.get("names", ())), int(stored["group"])
        row = self.group.rank if g_old == self.group.size else None
        out = {}
        for index in self.compressor.specs:
            for p, a, z, _ in self._residual_pieces(index, owner=False):
                name = RESIDUAL + self.key_of(p)
                if name in names:
                    out[name] = with_rows(p.layout.flat_range(a, z), row, g_old)
            if self._keeps_owner():
                for p, a, z, _ in self._residual_pieces(index, owner=True):
                    if OWNER_RESIDUAL + self.key_of(p) in names:
                        out[OWNER_RESIDUAL + self.key_of(p)] = p.layout.flat_range(a, z)
            if stored.get("tp") == self.tp.size and stored.get("rank") == getattr(self.compressor, "rank", 0):
                for j, (p, (_, _, _, b, r)) in enumerate(zip(self._matrices(index),
                                                            getattr(self.compressor, "matrices", {}).get(index, []))):
                    if POWERSGD_Q + self.key_of(p) in names:
                        out[POWERSGD_Q + self.key_of(p)] = q_layout((b, r), self.tp.rank, self.tp.size)
        return out

    def _load(self, arrays: dict[str, np.ndarray], stored: dict) -> None:
        """Hand the compressor what `_wanted` asked for (host arrays), zeros for the rest."""
        state: dict[str, dict] = {"residual": {}, "owner_residual": {}, "powersgd_q": {}}
        for index, spec in self.compressor.specs.items():
            xp = backend.array_module(self.buckets[index].params[0].data)
            for owner, prefix in ((False, RESIDUAL), (True, OWNER_RESIDUAL)):
                if owner and not self._keeps_owner():
                    continue
                pieces = self._residual_pieces(index, owner)
                if not any(prefix + self.key_of(p) in arrays for p, _, _, _ in pieces):
                    continue
                dtype = accumulation_dtype(spec.dtype) if owner else np.dtype(spec.dtype)
                buf = np.zeros(spec.size // (self.group.size if owner else 1), dtype=dtype)
                for p, a, z, at in pieces:
                    got = arrays.get(prefix + self.key_of(p))
                    if got is not None:
                        buf[at:at + z - a] = got.mean(axis=0) if got.ndim == 2 and not owner else got
                state["owner_residual" if owner else "residual"][index] = xp.asarray(buf)
            for j, p in enumerate(self._matrices(index)):
                got = arrays.get(POWERSGD_Q + self.key_of(p))
                if got is not None:
                    state["powersgd_q"][(index, j)] = xp.asarray(got.astype(spec.dtype))
        self.compressor.load_state(state)
