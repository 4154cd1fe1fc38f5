"""Which parameter server owns which elements: the model's parameters as one flat vector, in ranges.

The model's global tensors (the checkpoint's names and shapes, `FlatSpace`) laid end to end in
name order form one flat vector of P elements; server s of S owns the contiguous range
`server_ranges(P, S)[s]`, about P/S elements: their values and their optimizer state.
`ownership_report` describes the ranges and an untied wte's rows (`hpcpar info --servers`); `sync_points` are the steps
before which every replica waits; `row_runs` and `run_positions` locate a row-sparse parameter's
rows (an untied wte) in a range. Pure arithmetic: no MPI, usable on a login node.
"""

from __future__ import annotations

import math

import numpy as np

from hpcpar.layout import Layout


def server_ranges(total: int, servers: int) -> list[tuple[int, int]]:
    """Balanced contiguous ranges [lo, hi) of a flat vector of `total` elements over `servers`."""
    return [(total * s // servers, total * (s + 1) // servers) for s in range(servers)]


class FlatSpace:
    """The global tensors end to end in name order: `offsets[name]`, `shapes[name]`, `total`."""

    def __init__(self, shapes: dict[str, tuple]):
        self.names = sorted(shapes)
        self.shapes = {n: tuple(int(d) for d in shapes[n]) for n in self.names}
        self.offsets: dict[str, int] = {}
        offset = 0
        for n in self.names:
            self.offsets[n] = offset
            offset += math.prod(self.shapes[n])
        self.total = offset

    def local_indices(self, name: str, layout: Layout) -> np.ndarray:
        """Flat offsets of the elements of a local array of global tensor `name` in `layout`,
        C order, int64 [local size]; -1 where the local array holds no global element (padding)."""
        shape = self.shapes[name]
        glob = np.arange(self.offsets[name], self.offsets[name] + math.prod(shape), dtype=np.int64).reshape(shape)
        out = np.full(tuple(layout.local_shape), -1, dtype=np.int64)
        for b in layout.blocks:
            out[b.local] = glob[b.glob].reshape(out[b.local].shape)
        return out.reshape(-1)

    def pieces(self, lo: int, hi: int) -> list[tuple[str, int, int]]:
        """(name, first, last + 1) flat element ranges of the tensors inside [lo, hi), in order."""
        out = []
        for n in self.names:
            a, size = self.offsets[n], math.prod(self.shapes[n])
            first, last = max(lo, a), min(hi, a + size)
            if first < last:
                out.append((n, first - a, last - a))
        return out


def row_runs(idx: np.ndarray, width: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each row of a local [rows, width] array lies in the range [lo, hi) of the flat vector.

    `idx`: the array's global flat offsets (`FlatSpace.local_indices`) of a layout that splits
    rows only: each local row a whole global row of `width` elements, consecutive (a padding row
    all -1). A row's elements inside the range are one run, which a range boundary may cut.
    Returns int64 [rows] each: `local`, the flat index in the local array of the run's first
    element; `at`, its position in the range (offset - lo); `count`, the run's length (0 where the
    row has no element in the range; local = at = 0 there)."""
    rows = idx.size // max(width, 1)
    grid = idx.reshape(rows, width) if rows * width == idx.size else None
    real = grid[:, 0] >= 0 if grid is not None else None
    if grid is None or np.any(grid[real] != grid[real, :1] + np.arange(width)) or np.any(grid[~real] >= 0):
        raise ValueError(f"row_runs: the local array's rows are not whole global rows of {width} elements "
                         "(a layout that splits columns?)")
    start = np.where(real, grid[:, 0], hi)   # a padding row: nothing in the range
    first, last = np.maximum(start, lo), np.minimum(start + width, hi)
    count = np.maximum(last - first, 0)
    has = count > 0
    return (np.where(has, np.arange(rows) * width + first - start, 0), np.where(has, first - lo, 0),
            count.astype(np.int64))


def run_positions(first: np.ndarray, count: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The positions of runs `rows` back to back, in the order given: first[r] .. first[r] +
    count[r] - 1 for each r, int64 [sum of count[rows]] (`row_runs`' local or at, and count)."""
    c = count[rows]
    ends = np.cumsum(c)
    return np.repeat(first[rows] - ends + c, c) + np.arange(int(ends[-1]) if c.size else 0, dtype=np.int64)


def ownership_report(shapes: dict[str, tuple], servers: int, first_rank: int, itemsize: int) -> str:
    """`hpcpar info --servers`: each server's range of the flat parameter vector, in elements,
    bytes and the tensors it starts and ends in."""
    space = FlatSpace(shapes)
    lines = [f"parameter servers: {servers} (ranks {first_rank}..{first_rank + servers - 1}) over {space.total:,} "
             f"parameters in {len(space.names)} tensors, laid end to end in name order"]
    for s, (lo, hi) in enumerate(server_ranges(space.total, servers)):
        pieces = space.pieces(lo, hi)
        (first, a, _), (last, _, b) = pieces[0], pieces[-1]
        lines.append(f"  server {s} (rank {first_rank + s}): [{lo:,}, {hi:,}), {hi - lo:,} elements, "
                     f"{(hi - lo) * itemsize / 2**20:.2f} MiB of parameters; {first}[{a}:] .. {last}[:{b}] "
                     f"({len(pieces)} tensor pieces)")
    wte = "transformer.wte.weight"
    if "lm_head.weight" in space.shapes and wte in space.shapes:   # untied: wte's gradient is row-sparse
        (v, c), at = space.shapes[wte], space.offsets[wte]
        lines.append(f"  untied {wte} [{v:,}, {c}] at [{at:,}, {at + v * c:,}): with train.sparse_embedding = "
                     f"\"auto\" a worker holding it pushes each server per step 8 (2 + k + k') + {itemsize} x {c} k "
                     f"bytes for its k touched rows there and pulls {itemsize} x {c} k' for the k' rows its next "
                     f"step looks up, instead of {itemsize} x its elements there each way (every row before an "
                     "evaluation, a checkpoint or the end)")
    return "\n".join(lines) + "\n"


def sync_points(start: int, end: int, every: int, eval_every: int) -> set[int]:
    """The steps before which every replica waits (`end`, checkpoint and evaluation steps)."""
    points = {end}
    for k in (every, eval_every):
        if k:
            points.update(range((start // k + 1) * k, end, k))
    return points
