"""The checkpoint format: file names, the tensor table, checksums and digests, reading the table.

A checkpoint is a directory `step-NNNNNNN/` (format: docs/checkpoint-format.md):

    rank-00003.h5   the blocks rank 3 writes, dataset `<name>/block-<k>`, contiguous
    index.h5        one HDF5 virtual dataset per global tensor, stitched from the rank files,
                    with attributes `global_shape`, `dtype`, `sharding` (JSON: file, dataset,
                    global region of every block); root attribute `meta` (JSON)
    manifest.json   format, meta, per-file size, the tensor table with every block's extent
                    (file offset, a checksum per segment of ~1 MiB of rows); its own sha256

That is the default storage, `per_rank` (any h5py). With `storage="shared"` (parallel HDF5: h5py
built with MPI) there are no rank files: `index.h5` holds the global tensors themselves, one
chunked fletcher32 dataset per tensor (`chunk_shape`); the same attributes describe which rank
wrote which region. Either storage loads into any layout (reading needs no MPI-IO).

Every tensor is stored under its global name and global shape (`StoredTensor`), as disjoint
blocks covering it (`StoredBlock`: file, dataset, global region as `layout.Bounds`, writing rank,
and for a v2 rank-file block its `Extent`: where its bytes are and their checksums).

Integrity: a v2 rank-file block is checked per segment of whole rows of dim 0 (`segment_rows`)
with `checksum` (per 4 KiB page the sum of its 64-bit words, then crc32 of those sums), which runs
at memory speed and catches any flipped byte and a misplaced page. The manifest is checked against
its own sha256 (`manifest_digest`), the index against the manifest's (its virtual-dataset maps and
JSON attributes live in HDF5's unchecksummed global heap; for the shared file, the digest of its
attributes: `attrs_digest`), and the manifest's sizes catch truncated and missing files; HDF5's own
metadata is checksummed (file format 1.10: superblock v3, object header v2). Format v1 rank files
(chunked, fletcher32) and the shared file are read through HDF5, which verifies their fletcher32
chunks; their unchunked blocks (scalars, empty) carry a crc32 attribute (`CRC_ATTR`).

Checksums guard against corruption, not against a crafted checkpoint (anyone can recompute a
sha256): every file the manifest or the index names must resolve inside the checkpoint directory
(`read_manifest`, `read_index`: `data/untrusted.py`), and every tensor table is checked against
the sizes of the files that hold it before anything is allocated for it (`check_table`).
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from math import prod
from typing import Mapping

import h5py
import numpy as np

from hpcpar.data.untrusted import MiB, check_hdf5, contained, exact_int, parse_json, read_text
from hpcpar.errors import CheckpointError
from hpcpar.layout import Bounds, volume

FORMAT = "hpcpar-checkpoint"
FORMAT_VERSION = 2  # 2: contiguous rank-file blocks with segment checksums; 1: chunked + fletcher32
READABLE_VERSIONS = (1, 2)
INDEX = "index.h5"
MANIFEST = "manifest.json"
PER_RANK, SHARED = "per_rank", "shared"
STORAGES = (PER_RANK, SHARED)  # checkpoint.format
# HDF5 file format 1.10 (readable by HDF5 >= 1.10 tools): checksummed metadata everywhere.
LIBVER = ("v110", "v110")
CRC_ATTR = "crc32"  # shared file, v1: on blocks stored contiguous (scalars, empty): no fletcher32 there
# Shared-file chunks of about this many bytes: a chunk stays in the CPU cache while HDF5 gathers
# it and computes (or verifies) its fletcher32, which measured ~2x faster than 4 MiB chunks.
_CHUNK_BYTES = 1 << 20
# Rank-file checksum segments of about this many bytes (whole rows of dim 0): a segment is
# checksummed while it is in the CPU cache, right after it was read or before it is written
# (1 MiB: ~10% faster than 4 MiB, no slower than 256 KiB); a resharded read reads whole segments.
_SEGMENT_BYTES = 1 << 20
_PAGE = 4096  # the checksum sums 64-bit words per page: a misplaced page changes it
# The largest manifest read: one holds ~300 bytes per block, so this is ~3 million blocks (450
# tensors with AdamW state saved by ~2,000 ranks under ZeRO); a larger file is refused unread.
MANIFEST_LIMIT = 1024 * MiB


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.h5"


# ----------------------------------------------------------------------------------------
# The tensor table.

@dataclass(frozen=True)
class Extent:
    """Where a v2 rank-file block's bytes lie and how they are checked (held by the manifest)."""

    offset: int | None  # of the contiguous dataset's bytes in its file (None: an empty block)
    rows: int           # rows of dim 0 per checksum segment (a scalar is one row)
    checksums: str      # `checksum` of every segment, 8 hex digits each (big-endian uint32)

    def to_json(self) -> dict:
        return {"offset": self.offset, "checksum_rows": self.rows, "checksums": self.checksums}


@dataclass(frozen=True)
class StoredBlock:
    """One block of a global tensor as stored: which rank file, which dataset, which region
    (and, for a v2 rank file, where its bytes are: `extent`)."""

    file: str
    dataset: str
    region: Bounds
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


# ----------------------------------------------------------------------------------------
# Checksums, digests and chunking.

def chunk_shape(shape: tuple, itemsize: int) -> tuple | None:
    """A shared-file dataset's chunks: about `_CHUNK_BYTES` each, trailing dims whole; None = contiguous."""
    if not shape or prod(shape) == 0:
        return None  # HDF5 cannot chunk scalars or empty arrays; a crc32 attribute covers them
    chunk, budget = [1] * len(shape), max(1, _CHUNK_BYTES // itemsize)
    for d in reversed(range(len(shape))):
        chunk[d] = max(1, min(shape[d], budget))
        budget //= chunk[d]
        if chunk[d] < shape[d] or budget <= 1:
            break
    return tuple(chunk)


def crc32(data: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(data).tobytes())


def segment_rows(shape: tuple, itemsize: int) -> int:
    """Rows of dim 0 per checksum segment: about `_SEGMENT_BYTES`, at least one, at most the
    block's (a scalar: 1)."""
    row = prod(shape[1:]) * itemsize
    return max(1, min(shape[0], _SEGMENT_BYTES // row)) if shape and row else 1


def segment_count(shape: tuple, rows: int) -> int:
    """How many checksum segments a block of `shape` has (none when it is empty)."""
    return 0 if prod(shape) == 0 else -(-(shape[0] if shape else 1) // rows)


def checksum(seg: np.ndarray) -> int:
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


def fixed_string(text: str) -> np.bytes_:
    """`text` as a fixed-length string attribute. Variable-length strings live in HDF5's global
    heap, which has no checksum, and HDF5 (1.10) crashes on some corrupt heap entries (a flipped
    length): the shared file's attributes are read before anything can check them, so they are
    stored fixed-length, in the checksummed object header (or, past 64 KiB, in dense attribute
    storage, whose heap blocks are checksummed too). JSON text here is ASCII (json.dumps escapes)."""
    return np.bytes_(text.encode("ascii"))


def _attr_text(value) -> str:
    """An attribute written by `fixed_string` (bytes) or as a variable-length string (str) as str."""
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def attrs_digest(meta_json: str, tensors: Mapping[str, tuple[str, str]]) -> str:
    """sha256 of the shared file's JSON attributes (root `meta`; per tensor `dtype`, `sharding`).

    The manifest keeps it where it keeps the per-rank index's whole-file sha256 (hashing the shared
    file would read all its data back): the tensor table and meta that load trusts must be the ones
    the manifest was written with, beyond HDF5's own checksums of the headers that hold them.
    """
    text = json.dumps([meta_json, sorted((name, *v) for name, v in tensors.items())])
    return hashlib.sha256(text.encode()).hexdigest()


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's JSON text without its own `sha256` (format v2): what load trusts
    from it (tensor table, extents with their checksums, meta) is checked before use."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body).encode()).hexdigest()


# ----------------------------------------------------------------------------------------
# Reading the manifest and the tensor table.

def read_manifest(ckpt: str) -> dict:
    """The manifest of the checkpoint directory `ckpt`, checked against its format and its sha256,
    its structure, and every file it names contained in `ckpt` (`data.untrusted`)."""
    path = contained(ckpt, MANIFEST, f"{ckpt}: manifest", CheckpointError)
    try:
        text = read_text(path, MANIFEST_LIMIT, "checkpoint manifest", CheckpointError)
        manifest = parse_json(text, path, "checkpoint manifest", CheckpointError)
    except CheckpointError as err:
        raise CheckpointError(f"{err}; the checkpoint is incomplete or corrupt") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: not a checkpoint manifest (a JSON object expected)")
    version = manifest.get("format_version")
    if manifest.get("format") != FORMAT or not exact_int(version) or version not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: format {manifest.get('format')} v{version}, "
                              f"expected {FORMAT} v{' or v'.join(map(str, READABLE_VERSIONS))} (written by a "
                              "newer hpcpar? load it with that version)")
    if version >= 2 and manifest.get("sha256") != manifest_digest(manifest):
        raise CheckpointError(f"{path}: its content differs from its sha256 (corrupt manifest)")
    _check_manifest(ckpt, path, manifest)
    return manifest


def _check_manifest(ckpt: str, path: str, manifest: dict) -> None:
    """What every reader indexes without looking again: `meta` an object, `storage` known, `files`
    byte counts, `tensors` entries with their blocks; every file named (a `files` key, a block's
    `file`) contained in `ckpt`. A sha256 recomputed by whoever crafted the manifest passes
    `read_manifest`'s check: this one does not trust it."""
    def bad(entry: str, expected: str):
        return CheckpointError(f"{path}: {entry} is not {expected} (crafted or damaged manifest)")

    if not isinstance(manifest.get("meta"), dict):
        raise bad("meta", "a JSON object")
    if manifest.get("storage", PER_RANK) not in STORAGES:
        raise bad(f"storage {manifest.get('storage')!r}", f"one of {', '.join(STORAGES)}")
    files, tensors = manifest.get("files"), manifest.get("tensors")
    if not isinstance(files, dict) or not files:
        raise bad("files", "a JSON object of the checkpoint's files")
    for name, entry in files.items():
        contained(ckpt, name, f"{path}: file", CheckpointError)
        if not isinstance(entry, dict) or not exact_int(entry.get("size")) or entry["size"] < 0:
            raise bad(f"the size of {name}", "a byte count")
    if not isinstance(tensors, dict):
        raise bad("tensors", "a JSON object of the tensors")
    for name, t in tensors.items():
        if not isinstance(t, dict) or not isinstance(t.get("blocks"), list) or \
                not all(isinstance(b, dict) for b in t["blocks"]):
            raise bad(f"tensor {name}", "an object with a list of blocks")
        for b in t["blocks"]:
            if not isinstance(b.get("file"), str) or b["file"] not in files:
                contained(ckpt, b.get("file"), f"{path}: tensor {name}: block file", CheckpointError)
                raise bad(f"tensor {name}: block file {b.get('file')!r}", "one of the manifest's files")


def storage_of(manifest: dict) -> str:
    """PER_RANK or SHARED."""
    return manifest.get("storage", PER_RANK)  # checkpoints from before shared storage: per rank


def _check_index_file(path: str, manifest: dict) -> None:
    """index.h5 against the manifest: its size, and its sha256 (per_rank)."""
    entry = manifest["files"].get(INDEX, {})
    try:
        size = os.path.getsize(path)
        if size != entry.get("size"):
            raise CheckpointError(f"{path}: {size} bytes but the manifest says {entry.get('size')} "
                                  "(truncated or overwritten)")
        if storage_of(manifest) != SHARED:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for piece in iter(lambda: f.read(_CHUNK_BYTES), b""):
                    digest.update(piece)
            if digest.hexdigest() != entry.get("sha256"):
                raise CheckpointError(f"{path}: sha256 differs from the manifest (corrupt index)")
    except OSError as err:
        raise CheckpointError(f"{path}: unreadable index ({err.strerror})") from None


def manifest_table(ckpt: str, manifest: dict) -> dict[str, StoredTensor]:
    """The tensor table the manifest holds (every format), checked against the files (`check_table`)."""
    try:
        table = {name: StoredTensor(tuple(t["shape"]), t["dtype"], tuple(StoredBlock.from_json(b) for b in t["blocks"]))
                 for name, t in manifest["tensors"].items()}
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
        raise CheckpointError(f"{os.path.join(ckpt, MANIFEST)}: unreadable tensor table ({err!r})") from None
    check_table(os.path.join(ckpt, MANIFEST), table, manifest)
    return table


def read_table(ckpt: str, manifest: dict) -> tuple[dict[str, StoredTensor], dict]:
    """The tensor table and meta that load uses. Format v2 per-rank files: from the manifest
    (checked against its sha256; one JSON file instead of HDF5 attributes per tensor, ~90x
    faster for 450 tensors), the index still checked against its sha256. The shared file and
    format v1: from index.h5's attributes (`read_index`). Either is checked against the files
    (`check_table`) before anything is allocated for it."""
    if storage_of(manifest) == SHARED or manifest["format_version"] < 2:
        return read_index(ckpt, manifest)
    _check_index_file(contained(ckpt, INDEX, f"{ckpt}: index", CheckpointError), manifest)
    return manifest_table(ckpt, manifest), manifest["meta"]


def read_index(ckpt: str, manifest: dict) -> tuple[dict[str, StoredTensor], dict]:
    """The tensor table and meta from index.h5's attributes, after checking them against the
    manifest: the whole file's sha256 (per_rank), or its size and the attributes' digest (shared);
    its links and virtual-dataset sources contained in `ckpt` (`data.untrusted.check_hdf5`)."""
    path = contained(ckpt, INDEX, f"{ckpt}: index", CheckpointError)
    table, attrs = {}, {}
    entry = manifest["files"].get(INDEX, {})
    shared = storage_of(manifest) == SHARED
    _check_index_file(path, manifest)
    try:
        with h5py.File(path, "r", locking=False) as f:
            check_hdf5(f, ckpt, path, CheckpointError)
            meta_json = _attr_text(f.attrs["meta"])

            def visit(name, obj):
                if isinstance(obj, h5py.Dataset):
                    attrs[name] = (_attr_text(obj.attrs["dtype"]), _attr_text(obj.attrs["sharding"]))
                    blocks = tuple(StoredBlock.from_json(b) for b in json.loads(attrs[name][1]))
                    table[name] = StoredTensor(tuple(int(n) for n in obj.attrs["global_shape"]),
                                               attrs[name][0], blocks)
            f.visititems(visit)
            meta = json.loads(meta_json)
    except (OSError, KeyError, ValueError, RuntimeError, TypeError, AttributeError, RecursionError,
            OverflowError) as err:
        raise CheckpointError(f"{path}: unreadable index ({' '.join(str(err).split()) or type(err).__name__})") \
            from None
    if shared and attrs_digest(meta_json, attrs) != entry.get("attrs_sha256"):
        raise CheckpointError(f"{path}: its attributes (meta, sharding) differ from the manifest's digest "
                              "(corrupt index)")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: its meta attribute is not a JSON object (corrupt index)")
    check_table(path, table, manifest)
    return table, meta


# ----------------------------------------------------------------------------------------
# What a table claims, against the bytes that hold it.

def plain_dtype(text, what: str) -> np.dtype:
    """The NumPy dtype a table names, when it is plain numbers (bool, int, float, complex): bytes
    read from a file become nothing else (an object dtype would make pointers of them)."""
    try:
        dtype = np.dtype(text) if isinstance(text, str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.kind not in "biufc" or dtype.fields is not None or dtype.subdtype is not None:
        raise CheckpointError(f"{what}: dtype {text!r} is not a plain numeric dtype (crafted or damaged)")
    return dtype


def check_table(origin: str, table: dict[str, StoredTensor], manifest: dict) -> None:
    """Every tensor's dtype plain numbers and its shape non-negative integers; its blocks' regions
    inside it, as many elements as it has; and the bytes the blocks claim in each file at most the
    file's size in the manifest (which the readers check against the file before reading it). So
    no shape allocates more than the checkpoint holds. (Blocks that overlap leave elements no block
    covers: load zero-fills its arrays, so those read as zeros, never as uninitialized memory.)
    One-line CheckpointError naming the tensor."""
    sizes = {name: entry["size"] for name, entry in manifest["files"].items()}
    claimed = dict.fromkeys(sizes, 0)
    for name, t in table.items():
        what = f"{origin}: tensor {name}"
        itemsize = plain_dtype(t.dtype, what).itemsize
        if not all(exact_int(n) and n >= 0 for n in t.shape) or itemsize * prod(n for n in t.shape if n) >= 1 << 62:
            raise CheckpointError(f"{what}: shape {list(t.shape)} is not a list of sizes (crafted or damaged)")
        if not t.blocks:
            raise CheckpointError(f"{what}: no blocks (crafted or damaged)")
        regions = []
        for b in t.blocks:
            if b.file not in claimed:
                raise CheckpointError(f"{what}: block file {b.file!r} is not one of the manifest's files")
            if not exact_int(b.rank) or not isinstance(b.dataset, str):
                raise CheckpointError(f"{what}: a block's rank {b.rank!r} or dataset {b.dataset!r} is not one "
                                      "(crafted or damaged)")
            region = b.region
            if len(region) != len(t.shape) or not all(
                    len(r) == 2 and exact_int(r[0]) and exact_int(r[1]) and 0 <= r[0] <= r[1] <= n
                    for r, n in zip(region, t.shape)):
                raise CheckpointError(f"{what}: block region {[list(r) for r in region]} is not inside its "
                                      f"shape {list(t.shape)} (crafted or damaged)")
            regions.append(region)
            claimed[b.file] += volume(region) * itemsize
        if sum(volume(r) for r in regions) != prod(t.shape):  # overlaps: load zero-fills what none covers
            raise CheckpointError(f"{what}: its blocks hold {sum(volume(r) for r in regions)} elements, its "
                                  f"shape {list(t.shape)} {prod(t.shape)} (crafted or damaged)")
    for file, nbytes in claimed.items():
        if nbytes > sizes[file]:
            raise CheckpointError(f"{origin}: its tensors claim {nbytes} bytes in {file}, which holds "
                                  f"{sizes[file]} (crafted or damaged)")
