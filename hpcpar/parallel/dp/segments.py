"""Segments: this rank's shard of the parameters as the optimizer sees it, and the optimizer state
kept per segment (the sharded strategies, ZeRO-1/2 and FSDP).

A sharded strategy keeps the parameters of a group of them back to back in one flat buffer
(a ZeRO-1/2 gradient bucket, an FSDP unit) and gives rank r of the n ranks of the shard group the
elements `[r * size/n, (r + 1) * size/n)` of it, its *part* (`size` is padded to a multiple of n).
The optimizer never sees a whole parameter: it sees a `Segment` for every parameter overlapping
the part, the overlapping piece as an object with flat `.data` (a view of the part buffer), flat
`.grad` (a view of the reduced gradient part) and the parameter's `.no_decay`, so decoupled
weight decay stays masked per element. Elementwise AdamW (or SGD) on segments is the same
arithmetic as on whole parameters, so results equal the unsharded optimizer's bit for bit.

Every segment is a flat range of its parameter's local array, so checkpoints save it as it is,
with the layout `param.layout.flat_range(lo, hi)`: no rank ever holds another rank's state.
`ShardedState` is what the sharded strategies share on top of that, their checkpointed tensors
included. `gather_state` (whole-parameter state, all-gathered) and `load_state` (its inverse) are
`zero.ZeroOptimizer`'s in-memory views, for tests; checkpoints never gather.
"""

from __future__ import annotations

from typing import Any

from hpcpar import backend
from hpcpar.parallel.dp.clipping import counts_toward_norm, tp_replicated
from hpcpar.state import key_of


class Segment:
    """The piece of one parameter inside this rank's part, seen by the optimizer as a
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


def gather_state(groups: list[tuple[list, Any, list]], optimizer, state_names: tuple[str, ...],
                 comm) -> dict[str, dict[str, Any]]:
    """{parameter name: {state name: array of the parameter's local shape}} (copies), gathered
    over the shard group `comm` (collective: one all-gather per flat buffer and state name, in
    that order). `groups`: per flat buffer, ([(slot, param)], this rank's part buffer, its
    segments)."""
    out: dict[str, dict[str, Any]] = {}
    for slots, part, segments in groups:
        for k in state_names:
            mine = backend.array_module(part).zeros_like(part)
            for seg in segments:
                mine[seg.part_lo:seg.part_lo + (seg.hi - seg.lo)] = optimizer.state_of(seg)[k]
            full = comm.all_gather(mine, dim=0)
            for s, p in slots:
                out.setdefault(s.name, {})[k] = full[s.offset:s.offset + s.numel].reshape(p.shape).copy()
    return out


def load_state(segments: list[Segment], optimizer, state: dict[str, dict[str, Any]]) -> None:
    """Take each segment's piece of whole-parameter state (the structure `gather_state` gives,
    already checked) into the optimizer."""
    for seg in segments:
        xp = backend.array_module(seg.data)
        for k, dst in optimizer.state_of(seg).items():
            dst[...] = xp.asarray(state[seg.name][k]).reshape(-1)[seg.lo:seg.hi]


class ShardedState:
    """The optimizer-state side shared by the sharded strategies (`zero.ZeRO`, `fsdp.FSDP`):
    norms, non-finite checks, state and checkpoints go by segment.

    Mixed into a `data_parallel.DataParallel` subclass, which sets `segments` and `optimizer`
    and gives `_parameter_pieces()` (what of the parameters a checkpoint load fills on this rank).
    """

    segments: list[Segment]

    def _sharded_norm_items(self) -> list[Segment]:
        """Every rank of the shard group counts its own part, in segment order; replicas are
        identical after the average, so replica 0 counts for all of them."""
        return [s for s in self.segments if counts_toward_norm(s.param, self.tp_rank)] if self.replica == 0 else []

    def _named_grads(self) -> list[tuple[str, Any]]:
        return [(s.name, s.grad) for s in self.segments]

    def _tp_partial_grads(self) -> list:
        return [s.grad for s in self.segments if getattr(s.param, "tp_partial_grad", False)]

    def _parameter_pieces(self) -> list[tuple[Any, str, Any, Any]]:
        """(param, name, layout, array) of each piece of parameter data this rank loads."""
        raise NotImplementedError

    def _saved_segments(self) -> list[Segment]:
        """The segments this rank writes: replica 0 only (HSDP), no tied copies (the weight they
        mirror is saved), tp-replicated parameters from tp rank 0 only."""
        if self.replica != 0:
            return []
        return [s for s in self.segments if not getattr(s.param, "tied_to", None)
                and (self.tp_rank == 0 or not tp_replicated(s.param))]

    def _saved_tensors(self) -> dict[str, tuple[Any, Any]]:
        """{"model/<name>": (piece, layout), "optim/<name>/<state>": (piece, layout)} for this
        rank's segments, each a flat range of its parameter (`Layout.flat_range`): the shards of
        the shard group tile every tensor once, replica 0 writes them (HSDP). Nothing is gathered."""
        out = {}
        names = self.state_names()
        for seg in self._saved_segments():
            layout = seg.layout
            out[f"model/{seg.name}"] = (seg.data, layout)
            state = self.optimizer.state_of(seg)
            for k in names:
                out[f"optim/{seg.name}/{k}"] = (state[k], layout)
        return out

    def _wanted_tensors(self, weights_only: bool) -> dict[str, Any]:
        """This rank's pieces of the parameters (`_parameter_pieces`) and its shards of the
        optimizer state (a tied copy's from the weight it mirrors)."""
        out = {f"model/{key_of(p, n)}": layout for p, n, layout, _ in self._parameter_pieces()}
        if not weights_only:
            for seg in self.segments:
                key = key_of(seg.param, seg.name)
                for k in self.state_names():
                    out[f"optim/{key}/{k}"] = seg.layout
        return out

    def _take_tensors(self, arrays: dict[str, Any], step_count: int | None) -> None:
        for p, n, _, data in self._parameter_pieces():
            data[...] = backend.array_module(data).asarray(arrays[f"model/{key_of(p, n)}"])
        if step_count is None:
            return
        for seg in self.segments:
            key = key_of(seg.param, seg.name)
            xp = backend.array_module(seg.data)
            for k, dst in self.optimizer.state_of(seg).items():
                dst[...] = xp.asarray(arrays[f"optim/{key}/{k}"])
        self.optimizer.step_count = int(step_count)
