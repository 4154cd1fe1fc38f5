"""Loading a checkpoint into any layout: each rank reads the stored blocks its layout overlaps.

Every tensor is stored under its global name and shape, so a rank asking for any `Layout` of it
(other tp/pp/dp degrees, ZeRO flat shards, a padded vocabulary) gets its local array assembled
from the stored blocks that overlap it (`_assemble`); nothing travels over MPI but the verdict.
v2 rank-file blocks are read with `pread`, a checksum segment at a time, straight into the
destination array where whole rows fit and checked while in cache (`RawBlock`), taking the table
and extents from the manifest; the shared file and v1 rank files are read through HDF5, which
verifies their fletcher32 chunks (`read_checked`: unchunked blocks against their crc32).
A failure on any rank raises the same CheckpointError, naming the file and tensor, on all.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from math import prod
from typing import TYPE_CHECKING, Mapping

import h5py
import numpy as np

from hpcpar.checkpoint.collective import collective
from hpcpar.checkpoint.directory import resolve
from hpcpar.checkpoint.format import (CRC_ATTR, INDEX, StoredBlock, StoredTensor, checksum, crc32, read_manifest,
                                      read_table, segment_count)
from hpcpar.data.untrusted import check_hdf5
from hpcpar.errors import CheckpointError
from hpcpar.layout import Layout, bounds, intersect, is_flat

if TYPE_CHECKING:
    from hpcpar.runtime.comm import Communicator
    from hpcpar.runtime.solo import SoloCommunicator


def _sources(name: str, t: StoredTensor) -> tuple:
    """The stored blocks to read `name` from: a shared file's global dataset is read as one block."""
    if t.blocks and t.blocks[0].file == INDEX:
        return (StoredBlock(INDEX, name, tuple((0, n) for n in t.shape), -1),)
    return t.blocks


class _Shards:
    """Open rank files on demand, after checking each against the manifest's size: through HDF5
    (chunked blocks: the shared file, format v1) or as a plain file descriptor (v2 blocks)."""

    def __init__(self, ckpt: str, files: dict):
        self.ckpt, self.files, self.open, self.fds, self.blocks = ckpt, files, {}, {}, {}

    def _checked(self, file: str, tensor: str) -> str:
        path = os.path.join(self.ckpt, file)
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: shard file missing (needed for tensor {tensor})")
        size, expected = os.path.getsize(path), self.files.get(file, {}).get("size")
        if expected is not None and size != expected:
            raise CheckpointError(f"{path}: {size} bytes but the manifest says {expected} "
                                  f"(truncated or overwritten; needed for tensor {tensor})")
        return path

    def get(self, file: str, tensor: str) -> h5py.File:
        """The file opened through HDF5, once its links and virtual sources are known to stay in the
        checkpoint directory (`check_hdf5`: a dataset name could be an external link)."""
        if file not in self.open:
            path = self._checked(file, tensor)
            try:
                f = h5py.File(path, "r", locking=False)
            except OSError as err:
                raise CheckpointError(f"{path}: unreadable shard file ({err}; needed for tensor "
                                      f"{tensor})") from None
            try:
                check_hdf5(f, self.ckpt, path, CheckpointError)
            except CheckpointError:
                f.close()
                raise
            self.open[file] = f
        return self.open[file]

    def fd(self, file: str, tensor: str) -> int:
        if file not in self.fds:
            path = self._checked(file, tensor)
            try:
                self.fds[file] = os.open(path, os.O_RDONLY)
            except OSError as err:
                raise CheckpointError(f"{path}: unreadable shard file ({err.strerror}; needed for tensor "
                                      f"{tensor})") from None
        return self.fds[file]

    def raw(self, b: StoredBlock, dtype: str, fd: int) -> "RawBlock":
        """The v2 block `b` (its file opened by `fd`), for checked reads."""
        if (b.file, b.dataset) not in self.blocks:
            self.blocks[(b.file, b.dataset)] = RawBlock(b, np.dtype(dtype), fd, os.fstat(fd).st_size)
        return self.blocks[(b.file, b.dataset)]

    def close(self) -> None:
        for f in self.open.values():
            f.close()
        for fd in self.fds.values():
            os.close(fd)


class RawBlock:
    """A v2 rank-file block: the contiguous bytes of its region's C-order array at
    `extent.offset`, read with `pread` a checksum segment (`extent.rows` rows of dim 0) at a
    time, each segment checked against the manifest's checksum."""

    def __init__(self, b: StoredBlock, dtype: np.dtype, fd: int, file_size: int):
        self.fd, self.dtype, self.shape = fd, dtype, tuple(e - s for s, e in b.region)
        self.rows = self.shape[0] if self.shape else 1  # a scalar is one row
        self.seg_rows, self.offset = b.extent.rows, b.extent.offset
        self.sums = np.frombuffer(bytes.fromhex(b.extent.checksums), dtype=">u4").astype(np.int64)
        nbytes = prod(self.shape) * dtype.itemsize
        self.row_bytes = nbytes // self.rows if self.rows else 0
        if self.seg_rows < 1 or len(self.sums) != segment_count(self.shape, self.seg_rows) or \
                (nbytes and (self.offset is None or not 0 <= self.offset <= file_size - nbytes)):
            raise ValueError("its extent in the manifest does not fit its shape or its file")

    def _segment(self, k: int, buf: np.ndarray) -> None:
        """Read segment `k` into the C-contiguous `buf` (its rows' shape) and check it."""
        raw = buf.reshape(-1).view(np.uint8)
        view, pos = memoryview(raw), self.offset + k * self.seg_rows * self.row_bytes
        while view:
            n = os.preadv(self.fd, [view], pos)
            if n == 0:
                raise ValueError("the file ends inside it")
            view, pos = view[n:], pos + n
        if checksum(raw) != self.sums[k]:
            a = k * self.seg_rows
            z = min(a + self.seg_rows, self.rows)
            raise ValueError(f"rows {a}-{z - 1} of {self.rows} (checksum segment {k}) fail their checksum")

    def _scratch(self, rows: int) -> np.ndarray:
        return np.empty((rows,) + self.shape[1:], dtype=self.dtype)

    def read(self, src: tuple, out: np.ndarray) -> None:
        """`out[...] = block[src]`, every segment it touches checked. Segments wholly inside a
        C-contiguous `out` that takes whole rows are read straight into it; the others (the
        edges of a row range, a column selection) through a scratch segment."""
        if out.dtype != self.dtype:
            raise ValueError(f"stored as {self.dtype}, asked for {out.dtype}")
        if not self.shape:  # a scalar: one row of one element
            src, out = (slice(0, 1),), out.reshape(1)
        r0, r1 = src[0].start, src[0].stop
        rest = src[1:]
        whole = out.flags.c_contiguous and all(
            s.start == 0 and s.stop == n for s, n in zip(rest, self.shape[1:]))
        for k in range(r0 // self.seg_rows, -(-r1 // self.seg_rows)):
            a, z = k * self.seg_rows, min((k + 1) * self.seg_rows, self.rows)
            if whole and r0 <= a and z <= r1:
                self._segment(k, out[a - r0:z - r0])
                continue
            seg = self._scratch(z - a)
            self._segment(k, seg)
            lo, hi = max(a, r0), min(z, r1)
            out[lo - r0:hi - r0] = seg[(slice(lo - a, hi - a),) + rest]

    def check(self) -> None:
        """Read every segment back (through a scratch segment) and check it."""
        for k in range(len(self.sums)):
            a = k * self.seg_rows
            self._segment(k, self._scratch(min(self.seg_rows, self.rows - a)))


def _assemble(name: str, t: StoredTensor, layout: Layout, shards: _Shards) -> np.ndarray:
    """Build this rank's local array for `layout` from the stored blocks it overlaps."""
    # Padding rows of a padded split (the vocabulary under tp) hold no stored element: zero. Zeros
    # everywhere (calloc: fresh pages cost no more than np.empty's): elements that the blocks of a
    # crafted table leave uncovered (overlapping blocks: `format.check_table`) read as zeros.
    out = np.zeros(layout.local_shape, dtype=np.dtype(t.dtype))
    for want in layout.blocks:
        want_glob = bounds(want.glob)
        # A flat block (a ZeRO shard's piece) is read into an array of its region's shape first.
        flat = is_flat(want)
        target = np.zeros(tuple(e - s for s, e in want_glob), dtype=out.dtype) if flat else out
        origin = tuple(slice(0, e - s) for s, e in want_glob) if flat else want.local
        for b in _sources(name, t):
            part = intersect(want_glob, b.region)
            if part is None:
                continue
            opened = shards.fd(b.file, name) if b.extent is not None else shards.get(b.file, name)
            src = tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(part, b.region))
            dst = tuple(slice(lo.start + s - g, lo.start + e - g)
                        for lo, (s, e), (g, _) in zip(origin, part, want_glob))
            try:
                if b.extent is not None:  # v2 rank file: raw reads, every segment checked
                    shards.raw(b, t.dtype, opened).read(src, target[dst + (Ellipsis,)])
                    continue
                ds = opened[b.dataset]
                if ds.chunks is not None:  # fletcher32 (shared file, v1): HDF5 verifies every chunk
                    ds.read_direct(target, source_sel=src, dest_sel=dst)
                else:  # scalar or empty (shared file, v1): read whole, checked against its crc32
                    block = read_checked(ds, tuple(e - s for s, e in b.region))
                    target[dst] = block[src]
            except (OSError, KeyError, ValueError, TypeError, RuntimeError, OverflowError) as err:
                raise CheckpointError(f"{os.path.join(shards.ckpt, b.file)}: cannot read tensor {name} "
                                      f"(dataset {b.dataset}): corrupt data ({err}); run `hpcpar ckpt verify` "
                                      "on the checkpoint") from None
        if flat:  # its elements in C order (a local region with leading dims: the same order)
            out[want.local] = target.reshape(out[want.local].shape)
    return out


def read_checked(ds: h5py.Dataset, shape: tuple) -> np.ndarray:
    """A whole stored block of the shared file or a v1 rank file, of the `shape` the table gives
    (HDF5's own shape of it must be that: checked before anything is allocated), its integrity
    verified (fletcher32 chunks, or the crc32 attribute)."""
    if ds.shape != shape:
        raise ValueError(f"HDF5 gives it shape {list(ds.shape or ())}, the table {list(shape)}")
    data = ds[()]
    if ds.chunks is None and crc32(data) != int(ds.attrs[CRC_ATTR]):
        raise ValueError("crc32 mismatch")
    return data


def load(path: str, wanted: Mapping[str, Layout], comm: Communicator | SoloCommunicator,
         all_names: Collection[str] | None = None, only_prefix: str = "") -> tuple[dict[str, np.ndarray], dict]:
    """Load the tensors this rank needs, in any layout (collective over `comm`).

    Args:
        path: a `step-NNNNNNN` directory, or its parent (then `latest` is used).
        wanted: global name -> the `Layout` this rank needs (any layout: resharded on load).
        comm: the Communicator over all ranks (one process: `SoloCommunicator()`); errors anywhere
            raise on every rank.
        all_names: when given, the names the whole job holds (every rank's `wanted` together):
            the checkpoint must hold exactly these, so a checkpoint of a larger model is refused
            instead of loading its first layers silently.
        only_prefix: compare `all_names` with the checkpoint's names that start with this (e.g.
            "model/": the weights, whether or not the checkpoint also holds optimizer state).
    Returns:
        `({name: NumPy array of layout.local_shape, stored dtype}, meta)`.
    Raises:
        CheckpointError: missing tensor, other global shape, missing/truncated/corrupt shard
        (naming the file and tensor) — on every rank.
    """
    def work():
        ckpt = resolve(path)
        manifest = read_manifest(ckpt)
        table, meta = read_table(ckpt, manifest)
        _check_names(ckpt, table, wanted, all_names, only_prefix)
        shards = _Shards(ckpt, manifest["files"])
        try:
            arrays = {name: _assemble(name, table[name], layout, shards) for name, layout in wanted.items()}
        finally:
            shards.close()
        return arrays, meta

    return collective(comm, work, patient=True)


def _check_names(ckpt: str, table: dict[str, StoredTensor], wanted: Mapping[str, Layout],
                 all_names: Collection[str] | None, only_prefix: str) -> None:
    """The checkpoint holds the model asked for: every wanted tensor with its global shape, and
    (with `all_names`) no tensor under `only_prefix` the job does not hold."""
    stored = {n for n in table if n.startswith(only_prefix)}
    if all_names is not None and stored != set(all_names):
        extra, missing = sorted(stored - set(all_names)), sorted(set(all_names) - stored)
        raise CheckpointError(f"checkpoint {ckpt} holds {len(stored)} tensors, this model "
                              f"{len(set(all_names))} (checkpoint of another model?); "
                              + (f"not in this model: {', '.join(extra[:3])}" if extra else
                                 f"missing: {', '.join(missing[:3])}"))
    for name, layout in wanted.items():
        if name not in table:
            raise CheckpointError(f"tensor {name} is not in checkpoint {ckpt} (it holds "
                                  f"{len(table)} tensors; checkpoint of another model?)")
        shape, expected = table[name].shape, tuple(layout.global_shape)
        if shape != expected:
            raise CheckpointError(f"tensor {name}: checkpoint {ckpt} has global shape {list(shape)}, "
                                  f"expected {list(expected)} (checkpoint of another model?)")
