"""Sharded HDF5 checkpoints of global tensors: atomic commit, integrity, reshard on load.

A checkpoint is a directory `step-NNNNNNN/` (format: docs/checkpoint-format.md):

    rank-00003.h5   the blocks rank 3 writes, dataset `<name>/block-<k>`, contiguous
    index.h5        one HDF5 virtual dataset per global tensor, stitched from the rank files,
                    with attributes `global_shape`, `dtype`, `sharding` (JSON: file, dataset,
                    global region of every block); root attribute `meta` (JSON)
    manifest.json   format, meta, per-file size, the tensor table with every block's extent
                    (file offset, a checksum per segment of ~1 MiB of rows); its own sha256

That is the default storage, `per_rank` (any h5py). With `storage="shared"` (parallel HDF5: h5py
built with MPI) there are no rank files: `index.h5` holds the global tensors themselves, one
chunked fletcher32 dataset per tensor, written through the mpio driver, every rank writing its
blocks into the global datasets with collective writes; the same attributes describe which rank
wrote which region. Either storage loads into any layout (reading needs no MPI-IO).

Rank files near the disk: HDF5 creates each block's dataset (metadata, space allocated, nothing
written); the bytes go from the caller's arrays to the file with `pwrite`, and the segments'
checksums are computed from the same arrays while the fsync waits for the disk; loads `pread`
segments straight into the destination array and check each while it is in cache, taking the
table and extents from the manifest (one
JSON file, not HDF5 attributes per tensor). The checksum (`_checksum`: per 4 KiB page the sum of
its 64-bit words, then crc32 of those sums) runs at memory speed and catches any flipped byte
and a misplaced page; a mismatch names the file, tensor, dataset and rows. The manifest is
checked against its own sha256, the index against the manifest's (its virtual-dataset maps and
JSON attributes live in HDF5's unchecksummed global heap), and the manifest's sizes catch
truncated and missing files; HDF5's own metadata is checksummed (file format 1.10: superblock
v3, object header v2), which `verify` reads. Format v1 rank files (chunked, fletcher32) and the
shared file are read through HDF5, which verifies their fletcher32 chunks.

Every tensor is stored under its global name and global shape; each global block is written
exactly once, by the lowest rank that holds it, and only that rank touches (copies, moves to
the host) its data. Arrays never travel over MPI: each rank writes its own file and reads what
it needs from any file; only small metadata is exchanged (pickled lower-case collectives, off
the hot path). Every failure is made collective: all ranks raise the same `CheckpointError`,
never one raising while the others wait.
"""

from __future__ import annotations

import collections
import datetime
import errno
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import threading
import zlib
from collections.abc import Collection
from dataclasses import dataclass
from math import prod
from typing import Any, Callable, Mapping

import h5py
import numpy as np

import hpcpar
from hpcpar.runtime.comm import Communicator
from hpcpar.errors import CheckpointError
from hpcpar.layout import Layout, is_flat

FORMAT = "hpcpar-checkpoint"
FORMAT_VERSION = 2  # 2: contiguous rank-file blocks with segment checksums; 1: chunked + fletcher32
READABLE_VERSIONS = (1, 2)
INDEX = "index.h5"
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{7,})$")
_TMP_PREFIX = ".tmp-step-"
# Shared-file chunks of about this many bytes: a chunk stays in the CPU cache while HDF5 gathers
# it and computes (or verifies) its fletcher32, which measured ~2x faster than 4 MiB chunks.
_CHUNK_BYTES = 1 << 20
# Rank-file checksum segments of about this many bytes (whole rows of dim 0): a segment is
# checksummed while it is in the CPU cache, right after it was read or before it is written
# (1 MiB: ~10% faster than 4 MiB, no slower than 256 KiB); a resharded read reads whole segments.
_SEGMENT_BYTES = 1 << 20
_PAGE = 4096  # the checksum sums 64-bit words per page: a misplaced page changes it
# HDF5 file format 1.10 (readable by HDF5 >= 1.10 tools): checksummed metadata everywhere.
_LIBVER = ("v110", "v110")
_CRC_ATTR = "crc32"  # shared file, v1: on blocks stored contiguous (scalars, empty): no fletcher32 there
PER_RANK, SHARED = "per_rank", "shared"
STORAGES = (PER_RANK, SHARED)  # checkpoint.format

Region = tuple  # tuple[tuple[int, int], ...]: (start, stop) per dim of the global tensor


def step_dir_name(step: int) -> str:
    """`step-NNNNNNN` (7 digits, more when the step needs them)."""
    return f"step-{step:07d}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.h5"


# ----------------------------------------------------------------------------------------
# Collective failure: every rank raises the same error.

def _collective(comm, fn: Callable[[], Any], share: bool = False, patient: bool = False) -> Any:
    """Run `fn` on every rank; if it fails anywhere, raise the same CheckpointError everywhere.
    Returns this rank's result, or with `share` every rank's (list by rank: small objects only),
    in the same all-gather. `patient`: the ranks finish `fn` far apart (it writes or reads data),
    so they first wait for each other without spinning (`_arrive`).

    Any exception (not only CheckpointError) is caught: a bug on one rank must not leave the
    others waiting in the next collective.
    """
    try:
        result, msg = fn(), None
    except CheckpointError as err:
        result, msg = None, str(err)
    except Exception as err:  # noqa: BLE001 - converted, re-raised on every rank below
        result, msg = None, _one_line(err)
    if patient:
        _arrive(comm)
    gathered = comm.all_gather_object((result if share else None, msg))
    failed = [(r, m) for r, (_, m) in enumerate(gathered) if m is not None]
    if failed:
        rank, first = failed[0]
        more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        prefix = f"rank {rank}: " if comm.size > 1 else ""
        raise CheckpointError(f"{prefix}{first}{more}")
    return [r for r, _ in gathered] if share else result


def _arrive(comm) -> None:
    """Wait until every rank got here without spinning: a blocking MPI collective busy-waits
    (~1/3 of a core, MPICH), taking the CPU from the ranks still writing or reading, where
    the non-blocking barrier's wait yields and then sleeps (3% of a core)."""
    comm.ibarrier().wait()


def _one_line(err: Exception) -> str:
    """`err` as one line; a full disk (which HDF5 reports inside a long multi-line text) says so."""
    text = " ".join(str(err).split())
    if getattr(err, "errno", None) == errno.ENOSPC or "errno = 28" in text:
        where = re.search(r"filename = '([^']+)'", text)
        path = getattr(err, "filename", None) or (where.group(1) if where else "the checkpoint")
        return (f"no space left on device writing {path}; free space or set checkpoint.dir to a file "
                "system with room")
    return f"{type(err).__name__}: {text}"


# ----------------------------------------------------------------------------------------
# Who writes what.

def _region(slices) -> Region:
    return tuple((s.start, s.stop) for s in slices)


def _volume(region: Region) -> int:
    return prod(b - a for a, b in region)


def _contains(outer: Region, inner: Region) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def _intersect(x: Region, y: Region) -> Region | None:
    out = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y))
    return out if all(a < b for a, b in out) else None  # a scalar () intersects itself


@dataclass(frozen=True)
class Extent:
    """Where a v2 rank-file block's bytes lie and how they are checked (held by the manifest)."""

    offset: int | None  # of the contiguous dataset's bytes in its file (None: an empty block)
    rows: int           # rows of dim 0 per checksum segment (a scalar is one row)
    checksums: str      # `_checksum` of every segment, 8 hex digits each (big-endian uint32)

    def to_json(self) -> dict:
        return {"offset": self.offset, "checksum_rows": self.rows, "checksums": self.checksums}


@dataclass(frozen=True)
class StoredBlock:
    """One block of a global tensor as stored: which rank file, which dataset, which region
    (and, for a v2 rank file, where its bytes are: `extent`)."""

    file: str
    dataset: str
    region: Region
    rank: int
    extent: Extent | None = None

    def to_json(self) -> dict:
        d = {"file": self.file, "dataset": self.dataset, "rank": self.rank, "region": [list(r) for r in self.region]}
        return {**d, **self.extent.to_json()} if self.extent is not None else d

    @classmethod
    def from_json(cls, d: dict) -> "StoredBlock":
        extent = Extent(d["offset"], int(d["checksum_rows"]), d["checksums"]) if "checksum_rows" in d else None
        return cls(d["file"], d["dataset"], tuple(tuple(r) for r in d["region"]), d["rank"], extent)


@dataclass(frozen=True)
class StoredTensor:
    shape: tuple
    dtype: str
    blocks: tuple  # tuple[StoredBlock, ...], disjoint, covering the tensor


def assign_writers(holdings: list[dict]) -> dict[str, StoredTensor]:
    """Decide which rank writes which global block (pure; every rank computes the same plan).

    Args:
        holdings: per rank, `{name: (global_shape, dtype_str, [global regions held])}`.
    Returns:
        `{name: StoredTensor}`: for each distinct region the lowest rank holding it writes it;
        a region inside a larger one already chosen is skipped (larger regions are chosen first).
    Raises:
        CheckpointError: ranks disagree on a tensor's shape or dtype, regions overlap without
        one containing the other, or the regions do not cover the global tensor.
    """
    owners: dict[str, dict[Region, int]] = {}
    kinds: dict[str, tuple] = {}
    for rank, held in enumerate(holdings):
        for name, (shape, dtype, regions) in held.items():
            kind = (tuple(shape), dtype)
            if kinds.setdefault(name, kind) != kind:
                raise CheckpointError(f"tensor {name}: ranks disagree on global shape/dtype "
                                      f"({kinds[name]} vs {kind} on rank {rank})")
            for region in regions:
                owners.setdefault(name, {}).setdefault(tuple(region), rank)
    plan = {}
    for name in sorted(owners):
        shape, dtype = kinds[name]
        chosen: list[tuple[Region, int]] = []
        for region, rank in sorted(owners[name].items(), key=lambda it: (-_volume(it[0]), it[1], it[0])):
            if any(_contains(c, region) for c, _ in chosen):
                continue
            if any(_intersect(c, region) is not None for c, _ in chosen):
                raise CheckpointError(f"tensor {name}: block {list(region)} of rank {rank} partly "
                                      "overlaps another rank's block; layouts must tile the tensor")
            chosen.append((region, rank))
        if sum(_volume(r) for r, _ in chosen) != prod(shape):
            raise CheckpointError(f"tensor {name}: the ranks' blocks do not cover the global shape "
                                  f"{list(shape)}; every element must be held by some rank")
        chosen.sort()
        blocks = tuple(StoredBlock(rank_file_name(rank), f"{name}/block-{k}", region, rank)
                       for k, (region, rank) in enumerate(chosen))
        plan[name] = StoredTensor(shape, dtype, blocks)
    return plan


# ----------------------------------------------------------------------------------------
# Files.

def _to_host(a) -> np.ndarray:
    try:
        from hpcpar.backend import to_host
    except ImportError:  # backend not present: NumPy only
        return np.asarray(a)
    return to_host(a)


def _chunks(shape: tuple, itemsize: int) -> tuple | None:
    """About `_CHUNK_BYTES` per chunk, keeping trailing dims whole; None = contiguous."""
    if not shape or prod(shape) == 0:
        return None  # HDF5 cannot chunk scalars or empty arrays; a crc32 attribute covers them
    chunk, budget = [1] * len(shape), max(1, _CHUNK_BYTES // itemsize)
    for d in reversed(range(len(shape))):
        chunk[d] = max(1, min(shape[d], budget))
        budget //= chunk[d]
        if chunk[d] < shape[d] or budget <= 1:
            break
    return tuple(chunk)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc32(data: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(data).tobytes())


def _segment_rows(shape: tuple, itemsize: int) -> int:
    """Rows of dim 0 per checksum segment: about `_SEGMENT_BYTES`, at least one, at most the
    block's (a scalar: 1)."""
    row = prod(shape[1:]) * itemsize
    return max(1, min(shape[0], _SEGMENT_BYTES // row)) if shape and row else 1


def _segments(shape: tuple, rows: int) -> int:
    """How many checksum segments a block of `shape` has (none when it is empty)."""
    return 0 if prod(shape) == 0 else -(-(shape[0] if shape else 1) // rows)


def _checksum(seg: np.ndarray) -> int:
    """Checksum of a C-contiguous array's bytes: per 4 KiB page (the last zero-padded to whole
    words) the sum mod 2**64 of its little-endian 64-bit words, then zlib.crc32 of those sums
    (little-endian uint64).

    A flipped byte changes its page's sum (any change within one 64-bit word does), and crc32
    over the sums catches a page moved or swapped; it runs at memory speed (~11 GB/s per core
    here, from cache) where crc32 or fletcher32 over the bytes ran at 1-2.5 GB/s.
    """
    b = seg.reshape(-1).view(np.uint8)
    full = b.size - b.size % _PAGE
    sums = b[:full].view("<u8").reshape(-1, _PAGE // 8).sum(axis=1, dtype=np.uint64)
    if full < b.size:
        tail = np.zeros(-(-(b.size - full) // 8), dtype="<u8")
        tail.view(np.uint8)[:b.size - full] = b[full:]
        sums = np.append(sums, tail.sum(dtype=np.uint64))
    return zlib.crc32(sums.astype("<u8", copy=False))


def _create_block(f: h5py.File, name: str, shape: tuple, dtype: np.dtype) -> h5py.Dataset:
    """A contiguous dataset whose file space is allocated now and never filled: its bytes are
    written with `pwrite` at `ds.id.get_offset()` (what HDF5 itself would do for a contiguous
    dataset of this dtype), which HDF5 reads back as the dataset's values."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    parent, _, leaf = name.rpartition("/")
    group = f.require_group(parent) if parent else f
    # Low-level: h5py's create_dataset makes scalar datasets allocate late (no offset yet).
    space = h5py.h5s.create_simple(shape) if shape else h5py.h5s.create(h5py.h5s.SCALAR)
    return h5py.Dataset(h5py.h5d.create(group.id, leaf.encode(), h5py.h5t.py_create(dtype), space, dcpl=dcpl))


def _segments_of(data: np.ndarray, rows: int):
    """`(first row, C-contiguous array of the segment's rows)` for every checksum segment of a
    block (any strides: a segment of a strided block is copied, one at a time)."""
    if data.size == 0:
        return
    by_rows = data.reshape(data.shape or (1,))
    for a in range(0, by_rows.shape[0], rows):
        yield a, np.ascontiguousarray(by_rows[a:a + rows])


def _pwrite_all(fd: int, buf: np.ndarray, offset: int) -> None:
    view = memoryview(buf.reshape(-1).view(np.uint8))
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _checksums(data: np.ndarray, rows: int) -> str:
    """The checksums of a block's segments, as `Extent.checksums` holds them (hex)."""
    sums = [_checksum(seg) for _, seg in _segments_of(data, rows)]
    return np.asarray(sums, dtype=">u4").tobytes().hex()


def _write_rank_file(path: str, items: list[tuple[StoredBlock, str, np.ndarray]]) -> tuple[dict, dict]:
    """Write `(block, tensor name, data)` items to one HDF5 file, fsync it once. Returns its
    manifest entry (`{"size"}`) and `{(file name, dataset): Extent}` of its blocks.

    HDF5 writes the metadata; the data goes from the caller's arrays straight to the file with
    `pwrite` (no copy of a C-contiguous block). The checksums are computed from the same arrays
    while the fsync waits for the disk (in a second thread: it releases the GIL, as NumPy's
    sums do), where the CPU would otherwise idle: ~20% of a save's time when computed before.
    """
    _check_space(path, sum(data.nbytes for _, _, data in items), len(items))
    with h5py.File(path, "w", libver=_LIBVER) as f:
        placed = []
        for block, name, data in items:
            ds = _create_block(f, block.dataset, data.shape, data.dtype)
            ds.attrs["tensor"] = name
            ds.attrs["global_region"] = json.dumps([list(r) for r in block.region])
            placed.append((block, ds.id.get_offset(), data, _segment_rows(data.shape, data.dtype.itemsize)))
    fd = os.open(path, os.O_WRONLY)
    try:
        for _, offset, data, rows in placed:
            row_bytes = data.nbytes // (data.shape[0] if data.shape else 1) if data.size else 0
            for a, seg in _segments_of(data, rows):
                _pwrite_all(fd, seg, offset + a * row_bytes)
        flushed = _Background(lambda: os.fsync(fd))
        try:
            extents = {(os.path.basename(path), block.dataset): Extent(offset, rows, _checksums(data, rows))
                       for block, offset, data, rows in placed}
        finally:
            flushed.result()
    finally:
        os.close(fd)
    return {"size": os.path.getsize(path)}, extents


def _check_space(path: str, nbytes: int, datasets: int) -> None:
    """HDF5 crashes the process (SIGSEGV at exit) after a write fails on a full disk: check first."""
    need = nbytes + 4096 * datasets + (64 << 10)  # + metadata
    st = os.statvfs(os.path.dirname(path))
    if st.f_bavail * st.f_frsize < need:
        raise CheckpointError(f"no space left on device for {path}: it needs about {need} bytes, "
                              f"{st.f_bavail * st.f_frsize} are free; free space or set checkpoint.dir "
                              "to a file system with room")


def _shared_plan(plan: dict[str, StoredTensor]) -> dict[str, StoredTensor]:
    """The same plan with every block stored in its global dataset of the shared file."""
    return {name: StoredTensor(t.shape, t.dtype, tuple(StoredBlock(INDEX, name, b.region, b.rank)
                                                       for b in t.blocks))
            for name, t in plan.items()}


def _fixed(text: str) -> np.bytes_:
    """`text` as a fixed-length string attribute. Variable-length strings live in HDF5's global
    heap, which has no checksum, and HDF5 (1.10) crashes on some corrupt heap entries (a flipped
    length): the shared file's attributes are read before anything can check them, so they are
    stored fixed-length, in the checksummed object header (or, past 64 KiB, in dense attribute
    storage, whose heap blocks are checksummed too). JSON text here is ASCII (json.dumps escapes)."""
    return np.bytes_(text.encode("ascii"))


def _text(value) -> str:
    """An attribute written by `_fixed` (bytes) or as a variable-length string (str) as str."""
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def _attrs_digest(meta_json: str, tensors: Mapping[str, tuple[str, str]]) -> str:
    """sha256 of the shared file's JSON attributes (root `meta`; per tensor `dtype`, `sharding`).

    The manifest keeps it where it keeps the per-rank index's whole-file sha256 (hashing the shared
    file would read all its data back): the tensor table and meta that load trusts must be the ones
    the manifest was written with, beyond HDF5's own checksums of the headers that hold them.
    """
    text = json.dumps([meta_json, sorted((name, *v) for name, v in tensors.items())])
    return hashlib.sha256(text.encode()).hexdigest()


def _write_shared(path: str, plan: dict[str, StoredTensor], items: list[tuple[StoredBlock, str, np.ndarray]],
                  meta_json: str, crcs: Mapping[str, int], mpi_comm) -> str:
    """Every rank: write the shared file through MPI-IO (collective); returns the attributes' digest.

    Creating datasets and attributes is collective in parallel HDF5 (every rank, same order, same
    values: the plan, the meta and the crc32s are the same everywhere). Data: per tensor, as many
    collective writes as the rank writing most of its blocks has; a rank with fewer blocks joins
    the remaining writes with an empty selection. HDF5 >= 1.10.2 computes fletcher32 in such
    collective writes, moving each chunk written by several ranks to one of them first.
    """
    mine: dict[str, list[tuple[StoredBlock, np.ndarray]]] = {}
    for b, name, data in items:
        mine.setdefault(name, []).append((b, np.ascontiguousarray(data)))
    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)
    attrs = {}
    with h5py.File(path, "w", driver="mpio", comm=mpi_comm, libver=_LIBVER) as f:
        f.attrs["format"] = _fixed(FORMAT)
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["storage"] = _fixed(SHARED)
        f.attrs["meta"] = _fixed(meta_json)
        for name, t in plan.items():
            dtype = np.dtype(t.dtype)
            chunks = _chunks(t.shape, dtype.itemsize)
            # No fill values: every element is written below (the plan covers the tensor), and parallel
            # HDF5 allocates chunks at creation, so filling them first would write (and checksum)
            # the whole file twice: a 256 MiB save measured 5.6 s with fill values, 0.9 s without.
            ds = f.create_dataset(name, shape=t.shape, dtype=dtype, chunks=chunks, fletcher32=chunks is not None,
                                  fill_time="never")
            attrs[name] = (t.dtype, json.dumps([b.to_json() for b in t.blocks]))
            ds.attrs["global_shape"] = np.asarray(t.shape, dtype=np.int64)
            ds.attrs["dtype"], ds.attrs["sharding"] = (_fixed(v) for v in attrs[name])
            if chunks is None:
                ds.attrs[_CRC_ATTR] = crcs[name]
        for name, t in plan.items():
            if prod(t.shape) == 0:
                continue
            rounds = max(collections.Counter(b.rank for b in t.blocks).values())
            blocks = mine.get(name, [])
            for i in range(rounds):
                _write_selection(f[name].id, *(blocks[i] if i < len(blocks) else (None, None)), dxpl)
        f.flush()  # MPI_File_sync on every rank: durable before the commit, on any file system
    return _attrs_digest(meta_json, attrs)


def _write_selection(ds, block: StoredBlock | None, data: np.ndarray | None, dxpl) -> None:
    """One collective write: `data` into `block.region` of `ds`, or (None) an empty selection."""
    fspace = ds.get_space()
    if block is None:
        fspace.select_none()
        mspace = h5py.h5s.create_simple((1,))
        mspace.select_none()
        data = np.zeros(1, dtype=ds.dtype)
    elif not block.region:  # a scalar
        mspace = h5py.h5s.create(h5py.h5s.SCALAR)
    else:
        fspace.select_hyperslab(tuple(s for s, _ in block.region), tuple(e - s for s, e in block.region))
        mspace = h5py.h5s.create_simple(data.shape)
    ds.write(mspace, fspace, data, dxpl=dxpl)


# The index of the last plan saved, without meta, as file bytes: a save with the same plan (every
# save of a training run) copies it and adds the meta instead of making every virtual dataset
# again (~20 ms for 16 tensors here, ~1 ms per tensor; the copy ~2 ms).
_INDEX_TEMPLATE: dict[tuple, bytes] = {}


def _index_bytes(plan: dict[str, StoredTensor], meta: dict) -> bytes:
    """The index file: a virtual dataset per tensor over the rank files (relative paths), root
    attributes `format`, `format_version` and `meta`."""
    key = tuple(plan.items())
    if key not in _INDEX_TEMPLATE:
        buf = io.BytesIO()
        with h5py.File(buf, "w", libver=_LIBVER) as f:
            f.attrs["format"] = FORMAT
            f.attrs["format_version"] = FORMAT_VERSION
            for name, t in plan.items():
                dtype = np.dtype(t.dtype)
                vlayout = h5py.VirtualLayout(shape=t.shape, dtype=dtype)
                for b in t.blocks:
                    shape = tuple(e - s for s, e in b.region)
                    vlayout[tuple(slice(s, e) for s, e in b.region) or ...] = \
                        h5py.VirtualSource(b.file, b.dataset, shape=shape, dtype=dtype)
                # A missing rank file reads as the fill value: NaN makes that visible for floats.
                fill = np.nan if dtype.kind in "fc" else 0
                ds = f.create_virtual_dataset(name, vlayout, fillvalue=fill)
                ds.attrs["global_shape"] = np.asarray(t.shape, dtype=np.int64)
                ds.attrs["dtype"] = t.dtype
                ds.attrs["sharding"] = json.dumps([b.to_json() for b in t.blocks])
        _INDEX_TEMPLATE.clear()
        _INDEX_TEMPLATE[key] = buf.getvalue()
    buf = io.BytesIO(_INDEX_TEMPLATE[key])
    with h5py.File(buf, "r+") as f:
        f.attrs["meta"] = json.dumps(meta)
    return buf.getvalue()


def _tensor_table(plan: dict[str, StoredTensor], extents: Mapping[tuple, Extent]) -> dict:
    """The manifest's tensor table: the plan, each rank-file block with its `Extent`."""
    return {name: {"shape": list(t.shape), "dtype": t.dtype,
                   "blocks": [dict(b.to_json(), **(extents[(b.file, b.dataset)].to_json()
                                                  if (b.file, b.dataset) in extents else {}))
                              for b in t.blocks]} for name, t in plan.items()}


def _manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's JSON text without its own `sha256` (format v2): what load trusts
    from it (tensor table, extents with their checksums, meta) is checked before use."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body).encode()).hexdigest()


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------
# Save.

class _Background:
    """`fn()` in a thread; `result()` joins it and returns (or raises) what it did."""

    def __init__(self, fn: Callable[[], Any]):
        self._out: list = [None, None]
        self._thread = threading.Thread(target=self._run, args=(fn,), name="hpcpar-ckpt", daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._out[0] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised by result()
            self._out[1] = err

    def join(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._out[1] is not None:
            raise self._out[1]
        return self._out[0]


class SaveHandle:
    """A save in flight: rank files written by a background thread; `.wait()` commits.

    `.wait()` is collective (every rank must call it, from the thread that does MPI): it joins
    the writer thread (rank files, and on one rank the index), then runs the commit (manifest,
    rename, `latest`, pruning).
    """

    def __init__(self, write: Callable[[], tuple[dict, dict]], commit: Callable[[Callable], str],
                 background: bool):
        self._write, self._commit, self._path = write, commit, None
        self._result: tuple[dict, dict] | None = None
        self._error: BaseException | None = None
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="hpcpar-ckpt-write", daemon=True)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        try:  # no MPI here: this may run in the background thread
            self._result = self._write()
        except BaseException as err:  # noqa: BLE001 - re-raised from wait() on the main thread
            self._error = err

    def _written(self) -> tuple[dict, dict]:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def done(self) -> bool:
        """True once the rank file of this rank is written (the commit still needs `.wait()`)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str:
        """Finish and commit the checkpoint (collective); returns the `step-NNNNNNN` path."""
        if self._path is None:
            self._path = self._commit(self._written)
        return self._path


def save(directory: str, step: int, tensors: Mapping[str, tuple[Any, Layout]], meta: dict,
         comm, keep: int | None = 3, async_save: bool = False, storage: str = PER_RANK):
    """Save a sharded checkpoint of global tensors (collective over `comm`).

    Args:
        directory: the run's checkpoint directory, shared by all ranks (created if missing).
        step: training step; the checkpoint becomes `<directory>/step-NNNNNNN`.
        tensors: global name (e.g. `model/transformer.wte.weight`,
            `optim/transformer.wte.weight/exp_avg`) -> `(local array, Layout)` on this rank.
            NumPy or CuPy arrays; `array.shape == layout.local_shape`.
        meta: JSON-able dict from the caller (config, mesh, rng/data/lr positions, ...). Must be
            the same on every rank; rank 0's copy is stored with `step`, `format_version`,
            `world_size`, `timestamp` and `hpcpar_version` added.
        comm: `hpcpar.runtime.comm.Communicator` over all ranks (e.g. `mesh.world`).
        keep: committed checkpoints to keep (older ones are deleted); None keeps all.
        async_save: copy the blocks this rank writes (only those) to host memory now, write the
            rank file in a background thread and return a `SaveHandle`; `handle.wait()`
            (collective, main thread) commits, and raises what failed on any rank.
        storage: "per_rank" (a file per writing rank + an index of virtual datasets) or "shared"
            (one file, `index.h5`, written collectively through MPI-IO over `comm`: needs h5py
            built with MPI; not with `async_save`, since MPI-IO cannot run in a background thread).
    Returns:
        The committed checkpoint's path, or a `SaveHandle` when `async_save`.
    """
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep={keep}: must keep at least 1 checkpoint (or None for all)")
    if storage not in STORAGES:
        raise CheckpointError(f"storage={storage!r}: expected one of {', '.join(STORAGES)}")
    if storage == SHARED and not h5py.get_config().mpi:
        raise CheckpointError("a shared-file checkpoint needs h5py built with MPI (parallel HDF5); this h5py is "
                              "not: see README, Parallel HDF5, or save per_rank")
    if storage == SHARED and async_save:
        raise CheckpointError("async_save needs per_rank storage: a shared-file save writes through "
                              "collective MPI-IO, which cannot run in a background thread")
    rank, world = comm.rank, comm.size
    directory = os.path.abspath(directory)
    # Collectives cost (an object all-gather through the watched Communicator took ~7 ms on the busy
    # shared 2-core machine, where a 64 MiB-per-rank save takes ~0.2 s): a save makes three
    # all-gathers (the last two after a non-spinning barrier, `_arrive`) and a barrier.

    def describe():
        """Shapes, dtypes and regions (no data is touched); rank 0 also makes the temporary
        directory, whose path goes with its answer."""
        held = {}
        for name, (array, layout) in tensors.items():
            if tuple(array.shape) != tuple(layout.local_shape):
                raise CheckpointError(f"tensor {name}: local array has shape {list(array.shape)} but its "
                                      f"layout says {list(layout.local_shape)}")
            held[name] = (tuple(layout.global_shape), np.dtype(array.dtype).str,
                          [_region(b.glob) for b in layout.blocks])
        if rank != 0:
            return held, None
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{_TMP_PREFIX}{step:07d}-{secrets.token_hex(4)}")
        os.mkdir(tmp)
        return held, tmp

    answers = _collective(comm, describe, share=True)
    holdings, tmp = [held for held, _ in answers], answers[0][1]
    try:  # the same input everywhere: it fails (or not) on every rank alike
        plan = assign_writers(holdings)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if storage == SHARED:
        plan = _shared_plan(plan)

    def snapshot():
        """The blocks this rank writes, cut from its arrays: host views (sync), private host
        copies (async: training goes on changing the arrays). A rank that writes none of a
        tensor's blocks copies nothing of it."""
        items = []
        for name, t in plan.items():
            if name not in tensors:
                continue
            array, layout = tensors[name]
            for b in t.blocks:
                if b.rank != rank:
                    continue
                # The writer of a region is a rank holding exactly that region (assign_writers); a
                # flat block (a ZeRO shard's piece) is reshaped to its region.
                src = next(lb for lb in layout.blocks if _region(lb.glob) == b.region)
                host = _to_host(array[src.local])  # a device array: a fresh host copy already
                if async_save and isinstance(array, np.ndarray):
                    host = np.array(host, copy=True)
                items.append((b, name, host.reshape(tuple(e - s for s, e in b.region))))
        return items

    try:
        items, failed = snapshot(), None
    except Exception as err:  # noqa: BLE001 - raised where the ranks next agree (the write's outcome)
        items, failed = [], err

    # Rank 0's meta, stamped now (the snapshot's time).
    stored_meta = dict(meta, step=step, format_version=FORMAT_VERSION, world_size=world,
                       hpcpar_version=hpcpar.__version__,
                       timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat())
    # The per-rank index depends on the plan only: the rank with the least data to write writes
    # it while the others write theirs (a dp replica that writes nothing, if there is one; rank 0
    # among equals, which needs no copy of the meta).
    load_of = collections.Counter()
    for t in plan.values():
        for b in t.blocks:
            load_of[b.rank] += _volume(b.region) * np.dtype(t.dtype).itemsize
    index_writer = min(range(world), key=lambda r: (load_of[r], r)) if storage == PER_RANK else 0
    if storage == SHARED or index_writer != 0:
        stored_meta = comm.broadcast_object(stored_meta if rank == 0 else None, root=0)

    def finish(file_table: dict, extents: Mapping[tuple, Extent]) -> str:
        """Rank 0, collectively checked: the manifest, rename, `latest`; then every rank prunes."""
        def work():
            if rank != 0:
                return None
            manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "storage": storage,
                        "meta": stored_meta, "files": file_table, "tensors": _tensor_table(plan, extents)}
            _write_json(os.path.join(tmp, MANIFEST), dict(manifest, sha256=_manifest_digest(manifest)))
            _fsync_path(tmp)
            final, doomed = _commit_dir(directory, tmp, step, keep)
            return final, doomed, _doomed_shards(doomed)

        final, doomed, shards = _collective(comm, work, share=True, patient=True)[0]
        _prune(doomed, shards, comm)
        return final

    if storage == SHARED:
        return _save_shared(os.path.join(tmp, INDEX), plan, items, failed, stored_meta, finish, comm)

    def write_index() -> dict:
        data = _index_bytes(plan, stored_meta)
        with open(os.path.join(tmp, INDEX), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def write() -> tuple[dict, dict]:
        if failed is not None:
            raise failed
        files, extents = {}, {}
        # The index writer writes it in a second thread, beside its own data: HDF5 and h5py hold
        # the GIL there while the data's pwrite, checksums and fsync release it.
        index = _Background(write_index) if rank == index_writer else None
        try:
            if items:
                files[rank_file_name(rank)], extents = _write_rank_file(os.path.join(tmp, rank_file_name(rank)), items)
        finally:
            if index is not None:  # joined whatever happens: a thread left inside h5py hangs the exit
                index.join()
        if index is not None:
            files[INDEX] = index.result()
        return files, extents

    def commit(written: Callable[[], tuple[dict, dict]]) -> str:
        parts = _collective(comm, written, share=True, patient=True)
        return finish({k: v for files, _ in parts for k, v in sorted(files.items())},
                      {k: v for _, extents in parts for k, v in extents.items()})

    handle = SaveHandle(write, commit, background=async_save)
    return handle if async_save else handle.wait()


def _save_shared(path: str, plan: dict[str, StoredTensor], items: list, failed: Exception | None, meta: dict,
                 finish: Callable[[dict, dict], str], comm) -> str:
    """`save` for storage="shared": the index file holds the data, written collectively (MPI-IO)."""
    # What every rank must write identically: rank 0's meta (`meta`), the crc32 of every unchunked block.
    crcs: dict[str, int] = {}
    for part in comm.all_gather_object({name: _crc32(data) for _, name, data in items
                                        if _chunks(data.shape, data.dtype.itemsize) is None}):
        crcs.update(part)
    nbytes = sum(prod(t.shape) * np.dtype(t.dtype).itemsize for t in plan.values())
    # The snapshot, the free-space check and the write fail together: a rank that raised before a
    # collective write would leave the others waiting in it.
    def check():
        if failed is not None:
            raise failed
        if comm.rank == 0:
            _check_space(path, nbytes, len(plan))

    _collective(comm, check)
    digest = _collective(comm, lambda: _write_shared(path, plan, items, json.dumps(meta), crcs, comm.io_comm()))
    if comm.rank == 0:
        _fsync_path(path)
    return finish({INDEX: {"size": os.path.getsize(path), "attrs_sha256": digest}}, {})


def _commit_dir(directory: str, tmp: str, step: int, keep: int | None) -> tuple[str, list[str]]:
    """Rank 0: rename tmp -> step-NNNNNNN, replace `latest`. Each step is durable first.
    Returns the checkpoint's path and the directories to delete (`_prune`)."""
    final = os.path.join(directory, step_dir_name(step))
    if os.path.exists(final):  # the same step saved again (e.g. after a resume): replace it
        os.rename(final, f"{tmp}-replaced")
    os.rename(tmp, final)
    _fsync_path(directory)
    pointer = os.path.join(directory, LATEST + ".tmp")
    with open(pointer, "w") as f:
        f.write(step_dir_name(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(directory, LATEST))
    _fsync_path(directory)
    # Every .tmp-* left now is from a killed save (or the replaced copy): delete it.
    doomed = [e for e in os.listdir(directory) if e.startswith(_TMP_PREFIX)]
    if keep is not None:
        # Oldest first by step; the checkpoint just committed is never deleted, even when newer
        # step numbers exist (a run resumed from an earlier checkpoint).
        others = [n for n in _step_dirs(directory) if n != step_dir_name(step)]
        doomed += others[:max(0, len(others) - (keep - 1))]
    return final, [os.path.join(directory, e) for e in doomed]


def _doomed_shards(doomed: list[str]) -> list[str]:
    """Rank 0, after the commit: empty the directories to prune of everything but their rank
    files (the bulk of their bytes, which the ranks delete together: `_prune`); returns those."""
    shards = []
    for d in doomed:
        for entry in os.scandir(d) if os.path.isdir(d) else ():
            if entry.name.startswith("rank-") and entry.is_file(follow_symlinks=False):
                shards.append(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass  # pruning never fails a committed save (what is left goes at the next one)
    return sorted(shards)


def _prune(doomed: list[str], shards: list[str], comm) -> None:
    """Delete the `doomed` directories (collective, after the commit): every rank unlinks its
    share of their rank files (freeing their space is what deleting costs, as truncating the
    file a plain NumPy save overwrites costs each rank) and then tries to remove each directory,
    which succeeds for whoever unlinks last; a barrier: every rank returns with the directory as
    the commit left it."""
    if not doomed:
        return
    for path in shards[comm.rank::comm.size]:
        try:
            os.unlink(path)
        except OSError:
            pass  # already gone
    for d in doomed:
        try:
            os.rmdir(d)
        except OSError:
            pass  # not empty yet: another rank still unlinks its share, and removes it after
    _arrive(comm)


def _step_dirs(directory: str) -> list[str]:
    """Committed `step-NNNNNNN` directories, oldest first."""
    names = [e for e in os.listdir(directory) if _STEP_DIR.match(e)
             and os.path.isdir(os.path.join(directory, e))]
    return sorted(names, key=lambda e: int(_STEP_DIR.match(e).group(1)))


def pointer(directory: str) -> str | None:
    """The name `latest` in `directory` holds ("step-0000200"), or None when it has none."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            return f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def latest(directory: str) -> str | None:
    """The checkpoint `latest` points to in `directory`; when the pointer is missing or names no
    committed checkpoint (deleted by hand, or a save killed between its rename and the pointer:
    a `step-NNNNNNN` directory is complete once it has its name), the newest committed one; None
    when there is none yet."""
    name = pointer(directory)
    if name is not None and _STEP_DIR.match(name) and os.path.isdir(os.path.join(directory, name)):
        return os.path.join(directory, name)
    steps = _step_dirs(directory) if os.path.isdir(directory) else []
    return os.path.join(directory, steps[-1]) if steps else None


# ----------------------------------------------------------------------------------------
# Load.

def _resolve(path: str) -> str:
    """A checkpoint directory: `path` itself when it has an index, else its `latest`."""
    if os.path.isfile(os.path.join(path, INDEX)):
        return path
    found = latest(path) if os.path.isdir(path) else None
    if found is None and _STEP_DIR.match(os.path.basename(os.path.normpath(path))) and os.path.isdir(path):
        raise CheckpointError(f"{os.path.join(path, INDEX)}: missing (incomplete or damaged checkpoint)")
    if found is None:
        raise CheckpointError(f"no checkpoint at {path}: expected a step-NNNNNNN directory with "
                              f"{INDEX}, or a directory with a '{LATEST}' pointer")
    return found


def _read_manifest(ckpt: str) -> dict:
    path = os.path.join(ckpt, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable manifest ({err}); the checkpoint is incomplete "
                              "or corrupt") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: format {manifest.get('format')} v{manifest.get('format_version')}, "
                              f"expected {FORMAT} v{' or v'.join(map(str, READABLE_VERSIONS))} (written by a "
                              "newer hpcpar? load it with that version)")
    if manifest["format_version"] >= 2 and manifest.get("sha256") != _manifest_digest(manifest):
        raise CheckpointError(f"{path}: its content differs from its sha256 (corrupt manifest)")
    return manifest


def _storage(manifest: dict) -> str:
    return manifest.get("storage", PER_RANK)  # checkpoints from before shared storage: per rank


def _check_index_file(path: str, manifest: dict) -> None:
    """index.h5 against the manifest: its sha256 (per_rank), or its size (shared)."""
    entry = manifest["files"].get(INDEX, {})
    try:
        if _storage(manifest) == SHARED:
            size = os.path.getsize(path)
            if size != entry.get("size"):
                raise CheckpointError(f"{path}: {size} bytes but the manifest says {entry.get('size')} "
                                      "(truncated or overwritten)")
        else:
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            if digest != entry.get("sha256"):
                raise CheckpointError(f"{path}: sha256 differs from the manifest (corrupt index)")
    except OSError as err:
        raise CheckpointError(f"{path}: unreadable index ({err.strerror})") from None


def _read_table(ckpt: str, manifest: dict) -> tuple[dict[str, StoredTensor], dict]:
    """The tensor table and meta that load uses. Format v2 per-rank files: from the manifest
    (checked against its sha256; one JSON file instead of HDF5 attributes per tensor, ~90x
    faster for 450 tensors), the index still checked against its sha256. The shared file and
    format v1: from index.h5's attributes (`_read_index`)."""
    if _storage(manifest) == SHARED or manifest["format_version"] < 2:
        return _read_index(ckpt, manifest)
    _check_index_file(os.path.join(ckpt, INDEX), manifest)
    try:
        table = {name: StoredTensor(tuple(t["shape"]), t["dtype"], tuple(StoredBlock.from_json(b) for b in t["blocks"]))
                 for name, t in manifest["tensors"].items()}
        return table, manifest["meta"]
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{os.path.join(ckpt, MANIFEST)}: unreadable tensor table ({err!r})") from None


def _read_index(ckpt: str, manifest: dict) -> tuple[dict[str, StoredTensor], dict]:
    """The tensor table and meta from index.h5's attributes, after checking them against the
    manifest: the whole file's sha256 (per_rank), or its size and the attributes' digest (shared)."""
    path = os.path.join(ckpt, INDEX)
    table, attrs = {}, {}
    entry = manifest["files"].get(INDEX, {})
    shared = _storage(manifest) == SHARED
    _check_index_file(path, manifest)
    try:
        with h5py.File(path, "r", locking=False) as f:
            meta_json = _text(f.attrs["meta"])

            def visit(name, obj):
                if isinstance(obj, h5py.Dataset):
                    attrs[name] = (_text(obj.attrs["dtype"]), _text(obj.attrs["sharding"]))
                    blocks = tuple(StoredBlock.from_json(b) for b in json.loads(attrs[name][1]))
                    table[name] = StoredTensor(tuple(int(n) for n in obj.attrs["global_shape"]),
                                               attrs[name][0], blocks)
            f.visititems(visit)
            meta = json.loads(meta_json)
    except (OSError, KeyError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path}: unreadable index ({err})") from None
    if shared and _attrs_digest(meta_json, attrs) != entry.get("attrs_sha256"):
        raise CheckpointError(f"{path}: its attributes (meta, sharding) differ from the manifest's digest "
                              "(corrupt index)")
    return table, meta


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
        if file not in self.open:
            path = self._checked(file, tensor)
            try:
                self.open[file] = h5py.File(path, "r", locking=False)
            except OSError as err:
                raise CheckpointError(f"{path}: unreadable shard file ({err}; needed for tensor "
                                      f"{tensor})") from None
        return self.open[file]

    def fd(self, file: str, tensor: str) -> int:
        if file not in self.fds:
            self.fds[file] = os.open(self._checked(file, tensor), os.O_RDONLY)
        return self.fds[file]

    def raw(self, b: StoredBlock, dtype: str, fd: int) -> "_RawBlock":
        """The v2 block `b` (its file opened by `fd`), for checked reads."""
        if (b.file, b.dataset) not in self.blocks:
            self.blocks[(b.file, b.dataset)] = _RawBlock(b, np.dtype(dtype), fd, os.fstat(fd).st_size)
        return self.blocks[(b.file, b.dataset)]

    def close(self) -> None:
        for f in self.open.values():
            f.close()
        for fd in self.fds.values():
            os.close(fd)


class _RawBlock:
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
        if self.seg_rows < 1 or len(self.sums) != _segments(self.shape, self.seg_rows) or \
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
        if _checksum(raw) != self.sums[k]:
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
    # Padding rows of a padded split (the vocabulary under tp) hold no stored element: zero.
    out = (np.zeros if layout.padded else np.empty)(layout.local_shape, dtype=np.dtype(t.dtype))
    for want in layout.blocks:
        want_glob = _region(want.glob)
        # A flat block (a ZeRO shard's piece) is read into an array of its region's shape first.
        flat = is_flat(want)
        target = np.empty(tuple(e - s for s, e in want_glob), dtype=out.dtype) if flat else out
        origin = tuple(slice(0, e - s) for s, e in want_glob) if flat else want.local
        for b in _sources(name, t):
            part = _intersect(want_glob, b.region)
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
                    block = _read_checked(ds)
                    target[dst] = block[src]
            except (OSError, KeyError, ValueError, TypeError, RuntimeError) as err:
                raise CheckpointError(f"{os.path.join(shards.ckpt, b.file)}: cannot read tensor {name} "
                                      f"(dataset {b.dataset}): corrupt data ({err}); run `hpcpar ckpt verify` "
                                      "on the checkpoint") from None
        if flat:  # its elements in C order (a local region with leading dims: the same order)
            out[want.local] = target.reshape(out[want.local].shape)
    return out


def _read_checked(ds: h5py.Dataset) -> np.ndarray:
    """A whole stored block of the shared file or a v1 rank file, its integrity verified
    (fletcher32 chunks, or the crc32 attribute)."""
    data = ds[()]
    if ds.chunks is None and _crc32(data) != int(ds.attrs[_CRC_ATTR]):
        raise ValueError("crc32 mismatch")
    return data


def load(path: str, wanted: Mapping[str, Layout], comm, all_names: Collection[str] | None = None,
         only_prefix: str = "") -> tuple[dict[str, np.ndarray], dict]:
    """Load the tensors this rank needs, in any layout (collective over `comm`).

    Args:
        path: a `step-NNNNNNN` directory, or its parent (then `latest` is used).
        wanted: global name -> the `Layout` this rank needs (any layout: resharded on load).
        comm: `hpcpar.runtime.comm.Communicator` over all ranks; errors anywhere raise on every rank.
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
        ckpt = _resolve(path)
        manifest = _read_manifest(ckpt)
        files = manifest["files"]
        table, meta = _read_table(ckpt, manifest)
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
            stored, expected = table[name].shape, tuple(layout.global_shape)
            if stored != expected:
                raise CheckpointError(f"tensor {name}: checkpoint {ckpt} has global shape {list(stored)}, "
                                      f"expected {list(expected)} (checkpoint of another model?)")
        shards = _Shards(ckpt, files)
        try:
            arrays = {name: _assemble(name, table[name], layout, shards) for name, layout in wanted.items()}
        finally:
            shards.close()
        return arrays, meta

    return _collective(comm, work, patient=True)


# ----------------------------------------------------------------------------------------
# Inspect, verify, export (one process).

def _sharding_summary(t: StoredTensor) -> str:
    cut = sorted({d for b in t.blocks for d, (s, e) in enumerate(b.region) if (s, e) != (0, t.shape[d])})
    ranks = sorted({b.rank for b in t.blocks})
    if not cut:
        return f"whole, rank {ranks[0]}"
    dims = ",".join(str(d) for d in cut)
    return f"{len(t.blocks)} blocks over dim {dims}, ranks {_ranges(ranks)}"


def _ranges(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1 \
        else ",".join(map(str, ranks))


def info(path: str) -> str:
    """Human-readable summary: step, meta, files, tensors with global shapes, dtypes and sharding."""
    ckpt = _resolve(path)
    manifest = _read_manifest(ckpt)
    table, meta = _read_table(ckpt, manifest)
    total = sum(v["size"] for v in manifest["files"].values())
    lines = [f"checkpoint {ckpt}",
             f"  step {meta.get('step')}  saved by {meta.get('world_size')} rank(s) at "
             f"{meta.get('timestamp')}  hpcpar {meta.get('hpcpar_version')}  format v{meta.get('format_version')}",
             f"  files: {len(manifest['files'])} ({total / 2**20:.1f} MiB), storage {_storage(manifest)}"]
    shown = {k: v for k, v in meta.items()
             if k not in ("step", "world_size", "timestamp", "hpcpar_version", "format_version")}
    for key, value in sorted(shown.items()):
        text = json.dumps(value) if not isinstance(value, str) else value
        if "\n" in text or len(text) > 100:
            text = f"<{len(text)} chars, {text.count(chr(10)) + 1} lines>"
        lines.append(f"  meta.{key}: {text}")
    width = max((len(n) for n in table), default=0)
    lines.append(f"  tensors: {len(table)}")
    for name, t in sorted(table.items()):
        lines.append(f"    {name:<{width}}  {str(list(t.shape)):<16} {np.dtype(t.dtype).name:<8} "
                     f"{_sharding_summary(t)}")
    return "\n".join(lines) + "\n"


def verify(path: str) -> list[str]:
    """Check a whole checkpoint; returns the problems found (one line each, naming the file).

    The manifest must match its sha256 (format v2); every file in it must exist with its recorded
    size; every block of every tensor is read back and checked (v2 rank files: every segment's
    checksum, and HDF5 must describe each block where the manifest says it is; fletcher32 chunks
    or crc32 otherwise), checking HDF5's metadata checksums on the way; the index must match its
    sha256, open, and list the manifest's tensors.
    """
    try:
        ckpt = _resolve(path)
        manifest = _read_manifest(ckpt)
        holds: dict[str, list[tuple[str, StoredBlock, str]]] = {}  # file -> [(tensor, block, dtype)]
        for name, t in manifest["tensors"].items():
            for b in t["blocks"]:
                holds.setdefault(b["file"], []).append((name, StoredBlock.from_json(b), t["dtype"]))
    except CheckpointError as err:
        return [str(err)]
    except (KeyError, TypeError, ValueError) as err:
        return [f"{os.path.join(path, MANIFEST)}: unreadable tensor table ({err!r})"]
    problems = []
    for file, entry in sorted(manifest["files"].items()):
        names = list(dict.fromkeys(n for n, _, _ in holds.get(file, []))) or ["the index"]
        what = f"{', '.join(names[:3])}{f' +{len(names) - 3} more' if len(names) > 3 else ''}"
        full = os.path.join(ckpt, file)
        if not os.path.exists(full):
            problems.append(f"{full}: missing (holds {what})")
        elif os.path.getsize(full) != entry["size"]:
            problems.append(f"{full}: {os.path.getsize(full)} bytes, manifest says {entry['size']} "
                            f"(truncated?; holds {what})")
        elif file == INDEX:
            try:
                table, _ = _read_index(ckpt, manifest)
                if sorted(table) != sorted(manifest["tensors"]):
                    problems.append(f"{full}: lists other tensors than the manifest (corrupt index)")
                elif _storage(manifest) == SHARED:  # the index holds the data: read all of it back
                    problems.extend(_verify_rank_file(full, [(n, StoredBlock(INDEX, n, (), -1), t.dtype)
                                                             for n, t in sorted(table.items())]))
            except CheckpointError as err:
                problems.append(str(err))
        else:
            problems.extend(_verify_rank_file(full, holds.get(file, [])))
    return problems


def _verify_rank_file(full: str, blocks: list[tuple[str, StoredBlock, str]]) -> list[str]:
    """Read every block of one file back, checking every checksum; the first failure per file is
    reported, naming the tensor and dataset (and for a v2 block the rows that fail)."""
    tensor = dataset = "?"
    fd = None
    try:
        with h5py.File(full, "r", locking=False) as f:
            for tensor, b, dtype in blocks:
                dataset = b.dataset
                ds = f[dataset]
                if b.extent is None:
                    _read_checked(ds)
                    continue
                if ds.chunks is not None or ds.id.get_offset() != b.extent.offset or \
                        ds.shape != tuple(e - s for s, e in b.region) or ds.dtype != np.dtype(dtype):
                    raise ValueError("HDF5 describes the block otherwise than the manifest (layout, offset, "
                                     "shape or dtype)")
                fd = os.open(full, os.O_RDONLY) if fd is None else fd
                _RawBlock(b, np.dtype(dtype), fd, os.fstat(fd).st_size).check()
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as err:
        return [f"{full}: corrupt: checksum or structure error reading tensor {tensor} (dataset {dataset}): {err}"]
    finally:
        if fd is not None:
            os.close(fd)
    return []


def as_dtype(arrays: dict, dtype: str | None) -> dict:
    """Every floating-point array of `arrays` in `dtype` (None: as they are); others unchanged."""
    if dtype is None:
        return arrays
    return {k: a.astype(dtype) if a.dtype.kind == "f" else a for k, a in arrays.items()}


def export(path: str, out_npz: str, dtype: str | None = None) -> list[str]:
    """Write every global tensor to one .npz (keys are the global names), floating-point ones in
    `dtype` when given. Returns the names."""
    if dtype == "bfloat16":  # np.savez writes it as raw 2-byte voids that np.load cannot type again
        raise CheckpointError("ckpt export --dtype bfloat16 needs --format safetensors (an .npz cannot record "
                              "bfloat16); or export --dtype float16 / float32 to .npz")
    ckpt = _resolve(path)
    table, _ = _read_table(ckpt, _read_manifest(ckpt))
    arrays, _ = load(ckpt, {name: Layout.replicated(t.shape) for name, t in table.items()}, Communicator.local())
    np.savez(out_npz, **as_dtype(arrays, dtype))
    return sorted(arrays)


def cli(action: str, path: str, out: str | None = None, dtype: str | None = None) -> int:
    """`hpcpar ckpt info|verify|export PATH [--out FILE.npz] [--dtype D]` (one process)."""
    if action == "info":
        print(info(path), end="")
    elif action == "verify":
        problems = verify(path)
        if problems:  # one line, whatever the number of problems
            raise CheckpointError("; ".join(problems))
        ckpt = _resolve(path)
        print(f"ok: {ckpt}: {len(_read_manifest(ckpt)['files'])} files match the manifest")
    elif action == "export":
        if not out:
            raise CheckpointError("ckpt export needs --out FILE.npz (where to write the global tensors)")
        names = export(path, out, dtype)
        print(f"wrote {len(names)} tensors to {out}" + (f" as {dtype}" if dtype else ""))
    else:
        raise CheckpointError(f"unknown ckpt action {action!r}; expected info, verify or export")
    return 0
