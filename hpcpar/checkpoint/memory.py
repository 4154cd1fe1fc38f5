"""Checkpoints held in memory: one rank's state as a `Snapshot`, and loading a run from the
snapshots the ranks of a job hold, in any layout (`MemoryStored`).

A `Snapshot` is what `Checkpointable.checkpoint_state()` gave on one rank at one step, its arrays
copied to the host: global tensor name -> (local array, Layout), and the metadata. It packs into
one uint8 buffer (a JSON header, then the raw arrays back to back) to travel to a partner rank
or to a file, and unpacks from one.

`MemoryStored` is a `StoredState` (hpcpar/state.py) over the snapshots the ranks of a
communicator hold: their own, copies of their partners', or snapshots read from node-local files.
The parts of a run ask for the tensors they need in their layouts (`read`), exactly as from a
checkpoint on disk; `finish()` (collective) then moves every piece where it is needed:

1. every rank's catalogue (tensor name, dtype, the global region of each block it holds) is
   all-gathered; each region gets one source, the lowest rank holding it (replicas hold the same
   region: their copies are the same bits);
2. every rank's wants (name, the global region of each block of its layouts) are all-gathered;
3. each source cuts, for every rank in turn, the intersections of its blocks with that rank's
   wants, in one order every rank can compute, into one byte buffer per destination; one
   all-to-all-v moves them; each rank puts the pieces where its layouts say (flat ZeRO blocks
   and padded vocabulary rows as the disk loader does them: `checkpoint/load.py`).

So a run restored from memory takes the path of the global-tensor reshard, just without files:
a rank lost from a data-parallel group is replaced by its partner's copy, and the survivors may
hold the state in another layout than the one it was taken in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from hpcpar import backend
from hpcpar.errors import CheckpointError
from hpcpar.layout import Layout, bounds, intersect, is_flat, region_shape
from hpcpar.runtime.comm import Communicator
from hpcpar.state import SavedState

_HEADER = 8  # bytes of the header's length, little-endian


@dataclass
class Snapshot:
    """One rank's checkpointed state at one step, on the host.

    Attributes:
        owner: the rank (in the world it was taken on) whose state this is.
        step: the run's step (`meta["step"]`).
        meta: the state's metadata (JSON-able).
        tensors: global name -> (host array, Layout).
    """

    owner: int
    step: int
    meta: dict
    tensors: dict[str, tuple[np.ndarray, Layout]]

    @classmethod
    def take(cls, owner: int, state: SavedState) -> "Snapshot":
        """Copy `state` (live arrays, host or device) to the host."""
        tensors = {n: (np.array(backend.to_host(a), copy=True), layout) for n, (a, layout) in state.tensors.items()}
        return cls(owner, int(state.meta["step"]), state.meta, tensors)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a, _ in self.tensors.values())

    def pack(self) -> np.ndarray:
        """The snapshot as one uint8 buffer: header length, JSON header, arrays in header order."""
        return pack_state(self.owner, SavedState(self.tensors, self.meta))

    @classmethod
    def unpack(cls, buf: np.ndarray) -> "Snapshot":
        """The snapshot `pack` gave (arrays are copies: `buf` may be reused)."""
        size = int.from_bytes(buf[:_HEADER].tobytes(), "little")
        header = json.loads(buf[_HEADER:_HEADER + size].tobytes())
        at, tensors = _HEADER + size, {}
        for name, dtype, shape, layout in header["tensors"]:
            dt = np.dtype(dtype)
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            tensors[name] = (buf[at:at + n].view(dt).reshape(shape).copy(), Layout.from_json(layout))
            at += n
        return cls(int(header["owner"]), int(header["step"]), header["meta"], tensors)


def pack_state(owner: int, state: SavedState) -> np.ndarray:
    """`Snapshot.take(owner, state).pack()` in one copy: each live array (host or device) goes
    straight into the buffer."""
    names = sorted(state.tensors)
    arrays = [state.tensors[n][0] for n in names]
    header = json.dumps({"owner": owner, "step": int(state.meta["step"]), "meta": state.meta,
                         "tensors": [[n, np.dtype(a.dtype).str, list(a.shape), state.tensors[n][1].to_json()]
                                     for n, a in zip(names, arrays)]}).encode()
    out = np.empty(_HEADER + len(header) + sum(int(a.nbytes) for a in arrays), dtype=np.uint8)
    out[:_HEADER] = np.frombuffer(len(header).to_bytes(_HEADER, "little"), dtype=np.uint8)
    out[_HEADER:_HEADER + len(header)] = np.frombuffer(header, dtype=np.uint8)
    at = _HEADER + len(header)
    for a in arrays:
        raw = np.ascontiguousarray(backend.to_host(a)).reshape(-1).view(np.uint8)
        out[at:at + raw.size] = raw
        at += raw.size
    return out


def _dense(array: np.ndarray, block) -> np.ndarray:
    """A block's elements in the shape of its global region (a flat block's range reshaped)."""
    piece = array[block.local]
    return piece.reshape(region_shape(block.glob)) if is_flat(block) else piece


class MemoryStored:
    """A `StoredState` over the snapshots held by the ranks of `comm` (module docstring).

    Args:
        held: this rank's snapshots (possibly none), all of one step.
        comm: every rank that holds snapshots or loads (collective `finish`).
        meta: the checkpoint's metadata (a snapshot's: the same on every rank).
        path: what messages call it.
    """

    def __init__(self, held: list[Snapshot], comm: Communicator, meta: dict, path: str = "in-memory snapshots"):
        self.held, self.comm = held, comm
        self.path, self.meta, self.weights_only = path, meta, False
        self._asks: list[tuple[dict, Callable]] = []

    def read(self, wanted: Mapping[str, Layout], then: Callable[[dict[str, Any]], None]) -> None:
        self._asks.append((dict(wanted), then))

    def finish(self) -> None:
        """Move every asked-for piece from its source to its rank, then call each `then` in the
        order asked (collective over `comm`). Raises CheckpointError on every rank when a tensor
        asked for is held by no rank, or has another global shape."""
        comm = self.comm
        catalogue = [(s_i, name, array.dtype.str, tuple(layout.global_shape), [bounds(b.glob) for b in layout.blocks])
                     for s_i, snap in enumerate(self.held) for name, (array, layout) in sorted(snap.tensors.items())]
        catalogues = comm.all_gather_object(catalogue)
        sources: dict[str, list] = {}   # name -> [(region, rank, snapshot index, block index)]
        dtypes: dict[str, tuple[str, tuple]] = {}
        taken: set = set()
        for rank, entries in enumerate(catalogues):
            for s_i, name, dtype, shape, regions in entries:
                dtypes.setdefault(name, (dtype, shape))
                for b_i, region in enumerate(regions):
                    if (name, region) not in taken:
                        taken.add((name, region))
                        sources.setdefault(name, []).append((region, rank, s_i, b_i))
        # Every (name, layout) asked for, in ask order (a name may be asked twice, in two layouts).
        items = [(n, layout) for wanted, _ in self._asks for n, layout in sorted(wanted.items())]
        every_want = comm.all_gather_object([(n, tuple(layout.global_shape), [bounds(b.glob) for b in layout.blocks])
                                             for n, layout in items])
        missing = sorted({n for mine in every_want for n, _, _ in mine if n not in sources})
        if missing:
            raise CheckpointError(f"{self.path}: tensor {missing[0]} is held by no surviving rank "
                                  f"({len(missing)} tensor(s) missing)")
        for n, shape, _ in (w for mine in every_want for w in mine):
            if shape != dtypes[n][1]:
                raise CheckpointError(f"{self.path}: tensor {n} has global shape {list(dtypes[n][1])}, the run "
                                      f"asks for {list(shape)}")
        # Each source packs, destination by destination, the intersections in plan order.
        sends = [[] for _ in range(comm.size)]
        for dest, mine in enumerate(every_want):
            for name, _, regions in mine:
                for want in regions:
                    for region, rank, s_i, b_i in sources[name]:
                        part = intersect(want, region) if rank == comm.rank else None
                        if part is not None:
                            array, layout = self.held[s_i].tensors[name]
                            dense = _dense(array, layout.blocks[b_i])
                            src = tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(part, region))
                            sends[dest].append(np.ascontiguousarray(dense[src]).reshape(-1).view(np.uint8))
        counts = [sum(p.size for p in parts) for parts in sends]
        recv_counts = comm.all_to_all(np.array(counts, dtype=np.int64)).tolist()
        payload = np.concatenate([p for parts in sends for p in parts]) if any(counts) else np.zeros(0, np.uint8)
        received = np.array(comm.all_to_all_v(payload, counts, recv_counts), copy=True)
        offsets = np.concatenate([[0], np.cumsum(recv_counts)]).astype(np.int64)
        at = {r: int(offsets[r]) for r in range(comm.size)}
        # Assembled in `items` order, the order the sources packed this rank's pieces in.
        arrays = iter([self._assemble(layout, np.dtype(dtypes[n][0]), sources[n], received, at) for n, layout in items])
        for wanted, then in self._asks:
            then({n: next(arrays) for n in sorted(wanted)})

    @staticmethod
    def _assemble(layout: Layout, dtype: np.dtype, sources: list, received: np.ndarray, at: dict) -> np.ndarray:
        """This rank's local array of `name`, from the pieces in `received` (`at`: each source's
        read position, advanced), in the plan order of `finish`."""
        local = np.zeros(layout.local_shape, dtype=dtype)
        for block in layout.blocks:
            want = bounds(block.glob)
            target = np.zeros(region_shape(block.glob), dtype=dtype)
            for region, rank, _, _ in sources:
                part = intersect(want, region)
                if part is None:
                    continue
                n = int(np.prod([e - s for s, e in part], dtype=np.int64)) * dtype.itemsize
                piece = received[at[rank]:at[rank] + n].view(dtype).reshape([e - s for s, e in part])
                at[rank] += n
                target[tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(part, want))] = piece
            local[block.local] = target.reshape(local[block.local].shape)
        return local
