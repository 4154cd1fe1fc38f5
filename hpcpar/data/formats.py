"""Training data in its three formats: byte text, flat token files, HDF5 token datasets.

`load(data_config, vocab_size, comm)` opens what ``[data]`` names and returns a `Dataset`: the
training and validation token sequences, the tokenizer that made them and a description. The
sequences are 1-D and index like NumPy arrays (``len``, contiguous slices, integer-array
indexing), so `corpus.get_batch` samples from any of them the same way, and the same tokens give
the same batches, hence the same loss curve, whatever their format:

- ``bytes``: `corpus.load_corpus` (text as byte tokens, in memory);
- ``bin``: a flat file of uint16 or uint32 tokens (nanoGPT's train.bin layout), memory-mapped:
  a rank's batch reads the pages its own windows cover, nothing else;
- ``hdf5``: a 1-D integer dataset, read by hyperslab (`HDF5Tokens`): one read per window.

A single token sequence is split into training and validation exactly as a byte corpus is
(`corpus.split`, the tail held out); a directory with train.bin and val.bin (nanoGPT), or an HDF5
file with ``train`` and ``val`` datasets, brings its own split.

Token ids must be below ``model.vocab_size``. `hpcpar data prepare` records each file's token
count and largest id in ``meta.json`` beside it, so that check costs nothing at start (a file
whose size no longer matches its record is refused as truncated or replaced). Files without a
record (made by other tools) are scanned once at start, in chunks of `SCAN_CHUNK` tokens read
into one buffer, the chunks dealt out over the ranks and the largest id agreed by one
all-reduce: no rank ever holds the file. Errors are one line (`DataError`), the same on every
rank, before any training collective.

Document boundaries (`packing`): a corpus directory is one document per file, a single text
file one document; `hpcpar data prepare` writes beside its token file a document index,
`DOCS_FILE` (the start offset of each document as little-endian int64, named with its count and
the tokenizer's end-of-text id in meta.json), checked against its token file at start. Token
files without one stay one document, and ``data.packing = "documents"`` refuses them.

The tokenizer is the ``tokenizer.json`` beside the data (bytes for the byte format); its record
(`tokenizer.record`) goes into checkpoints so that `hpcpar sample` decodes with it and a resumed
or evaluated run refuses data of another tokenizer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from hpcpar.data import corpus, packing, tokenizer
from hpcpar.data.untrusted import MiB, check_hdf5, contained, exact_int, read_json
from hpcpar.errors import ConfigError, DataError

META = "meta.json"              # beside token files: format, tokenizer file, per-file count and largest id
META_FORMAT = "hpcpar-tokens"
TOKENIZER = "tokenizer.json"    # beside token files (the name meta.json gives, by default this one)
BIN_FILE = "tokens.bin"         # what `hpcpar data prepare` writes
HDF5_FILE = "tokens.h5"
HDF5_DATASET = "tokens"
DOCS_FILE = "documents.bin"     # beside the token file: its documents' start offsets, int64 little-endian
SCAN_CHUNK = 1 << 22            # tokens per read when scanning for the largest id (8-16 MiB)
META_LIMIT = 64 * MiB           # meta.json: a record per token file (a larger one is refused unread)
# Windows of a batch closer than this many tokens are read as one hyperslab.
_HDF5_MERGE_GAP = 4096


@dataclass
class Source:
    """One stored token sequence: where it is, and its largest id when a record gives it."""

    path: str
    name: str                   # the key in meta.json: file name, or "file/dataset" for HDF5
    tokens: Any                 # 1-D, NumPy-indexable (ndarray, memmap, HDF5Tokens)
    max_id: int | None = None   # from meta.json; None: scanned at start
    recorded: bool = False      # max_id is meta.json's claim, not a scan: `RecordedTokens` checks reads
    starts: Any = None          # its document index (int64 offsets from 0); None: no index


@dataclass
class Dataset:
    train: Any
    val: Any
    description: str
    tokenizer: dict | None                          # tokenizer.record(...); None when unknown
    sources: list = field(default_factory=list)     # [Source] whose ids are checked
    train_starts: Any = None                        # document start offsets into train (int64, from 0)
    val_starts: Any = None                          # ... into val; None: the data has no boundaries


class HDF5Tokens:
    """A 1-D HDF5 integer dataset (or a contiguous part of it) that indexes like a NumPy array.

    ``len``, contiguous slices (a view: nothing is read) and integer-array indexing (the batch
    windows): the indices are sorted, nearby ones grouped, and each group read as one hyperslab,
    so a batch of B windows costs about B small reads.
    """

    def __init__(self, dataset: h5py.Dataset, start: int = 0, stop: int | None = None):
        self.dataset, self.start = dataset, start
        self.stop = dataset.shape[0] if stop is None else stop
        self.dtype = dataset.dtype

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError("HDF5Tokens: only contiguous slices")
            return HDF5Tokens(self.dataset, self.start + start, self.start + max(start, stop))
        index = np.asarray(key)
        if index.dtype.kind not in "iu":
            raise IndexError(f"HDF5Tokens: integer indices expected, got {index.dtype}")
        flat = index.ravel().astype(np.int64)
        if flat.size == 0:
            return np.empty(index.shape, self.dtype)
        if flat.min() < 0 or flat.max() >= len(self):
            raise IndexError(f"index out of range for {len(self)} tokens")
        wanted, inverse = np.unique(flat, return_inverse=True)
        values = np.empty(len(wanted), self.dtype)
        cuts = np.flatnonzero(np.diff(wanted) > _HDF5_MERGE_GAP) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(wanted)]):
            first, last = int(wanted[lo]), int(wanted[hi - 1])
            span = self.read(self.start + first, self.start + last + 1)   # one hyperslab
            values[lo:hi] = span[wanted[lo:hi] - first]
        return values[inverse].reshape(index.shape)

    def __array__(self, dtype=None, copy=None):
        whole = self.read(self.start, self.stop)
        return whole if dtype is None else whole.astype(dtype)

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens [start, stop) of the dataset (into `out` when given); a read HDF5 refuses (a
        damaged chunk) is a one-line DataError naming the file and the range."""
        try:
            if out is None:
                return self.dataset[start:stop]
            self.dataset.read_direct(out, np.s_[start:stop])
            return out
        except (OSError, ValueError, TypeError, RuntimeError) as err:
            raise DataError(f"HDF5 file {self.dataset.file.filename!r}: cannot read tokens {start}-{stop - 1} of "
                            f"{self.dataset.name} ({' '.join(str(err).split())}); the file is damaged: prepare "
                            "it again") from None


class RecordedTokens:
    """A token sequence whose largest id is its meta.json record's claim (trusted, so that start-up
    reads nothing), checked where it is read instead: the windows of a batch (integer-array
    indexing) and a whole read. An id outside [0, `limit`) (model.vocab_size: the file changed
    since its record was written) is a one-line DataError naming the file, never an index error
    in the embedding or, under tp, a silent zero row. Slices are views, checked the same way."""

    def __init__(self, tokens, limit: int, source: Source):
        self.tokens, self.limit, self.source = tokens, limit, source
        self.dtype = tokens.dtype

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, key):
        if isinstance(key, slice):
            return RecordedTokens(self.tokens[key], self.limit, self.source)
        return self._checked(np.asarray(self.tokens[key]))

    def __array__(self, dtype=None, copy=None):
        whole = self._checked(np.array(self.tokens, copy=bool(copy)) if copy else np.asarray(self.tokens))
        return whole if dtype is None else whole.astype(dtype)

    def _checked(self, ids: np.ndarray) -> np.ndarray:
        if ids.size and (int(ids.max()) >= self.limit or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= self.limit else int(ids.min())
            raise DataError(f"{self.source.path!r} holds token id {bad}, outside model.vocab_size={self.limit}, "
                            f"though its meta.json record says the largest is {self.source.max_id}: the file "
                            "changed since it was prepared; prepare it again (or delete meta.json to have it "
                            "scanned at start)")
        return ids


# ----------------------------------------------------------------------------- opening


def load(cfg, vocab_size: int, comm=None) -> Dataset:
    """Open the data ``cfg`` (a ``[data]`` section) names and check its ids against `vocab_size`.

    `comm` (a Communicator over the job, or None in one process) shares the scan of token files
    that have no meta.json record; every rank must call this with the same arguments.
    """
    if cfg.format == "bytes":
        tokens, starts = corpus.load_documents(cfg.corpus)
        return from_tokens(tokens, cfg.val_fraction, starts, corpus.corpus_description(cfg.corpus, tokens))
    if not cfg.corpus:
        raise ConfigError(f"data.format=\"{cfg.format}\" needs data.corpus: a token file, or a directory from "
                          "`hpcpar data prepare`")
    path = cfg.corpus
    if not os.path.exists(path):
        raise DataError(f"data.corpus {path!r} does not exist; give a token file or a directory from "
                        "`hpcpar data prepare`")
    opener = _open_bin if cfg.format == "bin" else _open_hdf5
    sources, roles, where = opener(path, cfg.token_dtype)
    meta = _read_meta(where)
    for s in sources:
        _apply_record(s, meta, where, cfg.format)
        _read_index(s, meta, where, vocab_size)
    rec = _tokenizer_beside(where, meta)
    if rec is not None and rec["vocab_size"] > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the {rec['vocab_size']} ids of the "
                          f"tokenizer beside the data ({os.path.join(where, _tokenizer_name(meta))}); "
                          f"set model.vocab_size={rec['vocab_size']} (or more)")
    check_ids(sources, vocab_size, comm)
    by_role = {role: RecordedTokens(s.tokens, vocab_size, s) if s.recorded else s.tokens
               for role, s in zip(roles, sources)}
    starts = {role: s.starts for role, s in zip(roles, sources)}
    if "all" in by_role:
        train, val = corpus.split(by_role["all"], cfg.val_fraction)
        train_starts, val_starts = _split_index(starts["all"], len(by_role["all"]), cfg.val_fraction)
    elif "val" in by_role:
        train, val = by_role["train"], by_role["val"]
        train_starts, val_starts = starts["train"], starts["val"]
    else:
        train, val = corpus.split(by_role["train"], cfg.val_fraction)
        train_starts, val_starts = _split_index(starts["train"], len(by_role["train"]), cfg.val_fraction)
    if cfg.packing == "documents" and (train_starts is None or val_starts is None):
        bare = next(s.path for s in sources if s.starts is None)
        raise DataError(f"data.packing = \"documents\" needs document boundaries, but {bare!r} has no document "
                        f"index ({DOCS_FILE} from `hpcpar data prepare`); prepare it again, or set "
                        "data.packing = \"none\"")
    what = ", ".join(f"{s.path}{'[' + s.name.split('/')[-1] + ']' if cfg.format == 'hdf5' else ''}"
                     for s in sources)
    total = sum(len(s.tokens) for s in sources)
    description = (f"{cfg.format} {what!r} ({np.dtype(sources[0].tokens.dtype).name}, {total:,} tokens"
                   + (f", {tokenizer.describe(rec)}" if rec else "") + ")")
    return Dataset(train, val, description, rec, sources, train_starts, val_starts)


def from_tokens(tokens, val_fraction: float, starts: np.ndarray | None = None,
                description: str = "") -> Dataset:
    """A Dataset of byte tokens given in code (tests, benchmarks), with its documents' start
    offsets `starts` (int64, from 0; None: no boundaries). A Dataset is returned as it is."""
    if isinstance(tokens, Dataset):
        return tokens
    train, val = corpus.split(tokens, val_fraction)
    train_starts, val_starts = _split_index(starts, len(tokens), val_fraction)
    return Dataset(train, val, description or f"{len(tokens):,} tokens given in code", tokenizer.BYTES_RECORD,
                   train_starts=train_starts, val_starts=val_starts)


def _split_index(starts, n_tokens: int, val_fraction: float) -> tuple:
    """`packing.split_starts`, or (None, None) without an index."""
    return (None, None) if starts is None else packing.split_starts(starts, n_tokens, val_fraction)


def _open_bin(path: str, token_dtype: str) -> tuple[list[Source], list[str], str]:
    """(sources, their roles "all" | "train" | "val", the directory holding meta.json)."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, BIN_FILE)):
            files = [("all", os.path.join(path, BIN_FILE))]
        elif os.path.isfile(os.path.join(path, "train.bin")):
            files = [("train", os.path.join(path, "train.bin"))]
            if os.path.isfile(os.path.join(path, "val.bin")):
                files.append(("val", os.path.join(path, "val.bin")))
        else:
            raise DataError(f"directory {path!r} holds neither {BIN_FILE} nor train.bin; give a token file or "
                            "a directory from `hpcpar data prepare`")
        where = path
    else:
        files, where = [("all", path)], os.path.dirname(os.path.abspath(path))
    dtype = np.dtype(token_dtype)
    sources = []
    for _, file in files:
        try:
            size = os.path.getsize(file)
        except OSError as err:
            raise DataError(f"cannot read token file {file!r}: {err.strerror}") from None
        if size == 0:
            raise DataError(f"token file {file!r} is empty")
        if size % dtype.itemsize:
            raise DataError(f"token file {file!r} is {size} bytes, not a whole number of {dtype.name} tokens "
                            f"({dtype.itemsize} bytes each): truncated, or written with another data.token_dtype")
        try:
            tokens = np.memmap(file, dtype=dtype, mode="r")
        except OSError as err:
            raise DataError(f"cannot map token file {file!r}: {err.strerror or err}") from None
        sources.append(Source(file, os.path.basename(file), tokens))
    return sources, [role for role, _ in files], where


_open_files: dict[str, h5py.File] = {}   # HDF5 files stay open for the process (read-only)


def _open_hdf5(path: str, token_dtype: str) -> tuple[list[Source], list[str], str]:
    if os.path.isdir(path):
        file = os.path.join(path, HDF5_FILE)
        if not os.path.isfile(file):
            raise DataError(f"directory {path!r} holds no {HDF5_FILE}; give an HDF5 file or a directory from "
                            "`hpcpar data prepare --format hdf5`")
        where = path
    else:
        file, where = path, os.path.dirname(os.path.abspath(path))
    f = _open_files.get(file) or _open_checked(file)
    _open_files[file] = f
    if HDF5_DATASET in f:
        names = [("all", HDF5_DATASET)]
    elif "train" in f:
        names = [("train", "train")] + ([("val", "val")] if "val" in f else [])
    else:
        found = [n for n, obj in f.items() if isinstance(obj, h5py.Dataset)]
        raise DataError(f"HDF5 file {file!r} has no dataset {HDF5_DATASET!r} (nor 'train'/'val'); it holds "
                        f"{', '.join(map(repr, found)) or 'no datasets'}")
    sources = []
    for _, name in names:
        ds = f[name]
        if not isinstance(ds, h5py.Dataset) or ds.ndim != 1 or ds.dtype.kind not in "iu":
            raise DataError(f"HDF5 dataset {file!r}:{name} must be 1-D integer tokens, found "
                            f"{getattr(ds, 'shape', '?')} {getattr(ds, 'dtype', 'group')}")
        if ds.shape[0] == 0:
            raise DataError(f"HDF5 dataset {file!r}:{name} is empty")
        sources.append(Source(file, f"{os.path.basename(file)}/{name}", HDF5Tokens(ds)))
    return sources, [role for role, _ in names], where


def _open_checked(file: str) -> h5py.File:
    """The HDF5 token file, opened once its links and virtual sources stay in its directory."""
    try:
        f = h5py.File(file, "r", locking=False)
    except OSError as err:
        raise DataError(f"cannot read HDF5 file {file!r}: {' '.join(str(err).split())}") from None
    try:
        check_hdf5(f, os.path.dirname(os.path.abspath(file)), file, DataError)
    except DataError:
        f.close()
        raise
    return f


# --------------------------------------------------------------------------- meta.json


def _read_meta(where: str) -> dict | None:
    """meta.json beside the tokens (at most `META_LIMIT` bytes, inside `where`: `data.untrusted`),
    its records checked to be what `write_meta` writes; None when there is none, or it is someone
    else's."""
    path = os.path.join(where, META)
    if not os.path.isfile(path):
        return None
    contained(where, META, f"{where}: record", DataError)
    try:
        meta = read_json(path, META_LIMIT, "token record (meta.json)")
    except DataError as err:
        raise DataError(f"{err}; prepare the data again or remove it") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        return None   # someone else's meta.json: no records
    files, tok = meta.get("files", {}), meta.get("tokenizer")
    if tok is not None and not isinstance(tok, str) or not isinstance(files, dict):
        raise DataError(f"{path}: its tokenizer is not a file name or its files are not records (crafted or "
                        "damaged); prepare the data again")
    for name, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) or \
                not all(exact_int(entry.get(k)) and entry[k] >= 0 for k in ("tokens", "max_id")):
            raise DataError(f"{path}: the record of {name!r} is not {{tokens, dtype, max_id}} as counts (crafted "
                            "or damaged); prepare the data again")
    return meta


def _apply_record(s: Source, meta: dict | None, where: str, fmt: str) -> None:
    """Check `s` against its meta.json record (count, dtype) and take its largest id from it."""
    entry = (meta or {}).get("files", {}).get(s.name)
    if entry is None:
        return
    path = os.path.join(where, META)
    stored = np.dtype(s.tokens.dtype).name
    if entry.get("dtype") != stored:
        hint = f"; set data.token_dtype={entry.get('dtype')}" if fmt == "bin" else ""
        raise DataError(f"{s.path!r} is read as {stored} tokens but {path} says {entry.get('dtype')}{hint}")
    if entry.get("tokens") != len(s.tokens):
        raise DataError(f"{s.path!r} holds {len(s.tokens):,} tokens but {path} says {entry.get('tokens'):,}: "
                        "truncated or replaced since it was prepared; prepare it again")
    s.max_id, s.recorded = int(entry["max_id"]), True


def _read_index(s: Source, meta: dict | None, where: str, vocab_size: int) -> None:
    """The document index meta.json names for `s` (its record's "documents": {file, count}; the
    tokenizer's end-of-text id as meta.json's "eot_id"), checked against `s` (`packing.check_starts`)
    and read whole: one offset per document."""
    entry = (meta or {}).get("files", {}).get(s.name) or {}
    docs = entry.get("documents")
    if docs is None:
        return
    path = os.path.join(where, META)
    eot = meta.get("eot_id")
    if eot is not None and not (exact_int(eot) and 0 <= eot < vocab_size):
        raise DataError(f"{path}: end-of-text id {eot!r} is outside model.vocab_size={vocab_size} (crafted or "
                        "damaged, or another tokenizer's); prepare the data again")
    if not isinstance(docs, dict) or not exact_int(docs.get("count")) or docs["count"] < 1:
        raise DataError(f"{path}: the document index of {s.name!r} is not {{file, count}} (crafted or damaged); "
                        "prepare the data again")
    index = contained(where, docs.get("file"), f"{path}: document index", DataError)
    try:
        size = os.path.getsize(index)
    except OSError as err:
        raise DataError(f"cannot read document index {index!r}: {err.strerror}; prepare the data again") from None
    if size != 8 * docs["count"] or docs["count"] > len(s.tokens):
        raise DataError(f"document index {index!r} is {size} bytes, not the {docs['count']:,} offsets its record "
                        f"in {path} says (8 bytes each), or more than {s.path!r}'s tokens: it does not match its "
                        "token file; prepare the data again")
    s.starts = packing.check_starts(np.fromfile(index, dtype="<i8"), len(s.tokens), index)


def _tokenizer_name(meta: dict | None) -> str:
    return (meta or {}).get("tokenizer") or TOKENIZER


def _tokenizer_beside(where: str, meta: dict | None) -> dict | None:
    """The record of the tokenizer meta.json names (default tokenizer.json), which must lie in `where`."""
    path = contained(where, _tokenizer_name(meta), f"{os.path.join(where, META)}: tokenizer", DataError)
    return tokenizer.record(tokenizer.read(path)) if os.path.isfile(path) else None


def write_meta(where: str, files: dict, tokenizer_file: str | None, extra: dict | None = None) -> None:
    """meta.json: `files` maps a file name (or "file/dataset") to {tokens, dtype, max_id}."""
    meta = {"format": META_FORMAT, "version": 1, "tokenizer": tokenizer_file, "files": files, **(extra or {})}
    with open(os.path.join(where, META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


# --------------------------------------------------------------------------- id check


def scan_range(tokens, part: int = 0, parts: int = 1, chunk: int = SCAN_CHUNK) -> tuple[int, int]:
    """(smallest, largest) id over chunks part, part + parts, ... of `tokens`, read one chunk at a
    time into one buffer (a memory-map is read with plain file reads, so its pages never become
    this process's memory). (0, -1) when this part has no chunk."""
    n = len(tokens)
    buf = np.empty(min(chunk, n), dtype=tokens.dtype)
    lo, hi = None, None
    whole_map = (isinstance(tokens, np.memmap) and tokens.filename is not None
                 and tokens.offset + n * tokens.dtype.itemsize == os.path.getsize(tokens.filename))
    raw = open(tokens.filename, "rb") if whole_map else None
    try:
        for first in range(part * chunk, n, parts * chunk):
            size = min(chunk, n - first)
            view = buf[:size]
            if raw is not None:
                raw.seek(tokens.offset + first * tokens.dtype.itemsize)
                raw.readinto(memoryview(view).cast("B"))
            elif isinstance(tokens, HDF5Tokens):
                tokens.read(tokens.start + first, tokens.start + first + size, view)
            else:
                view[...] = tokens[first:first + size]
            a, b = int(view.min()), int(view.max())
            lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
    finally:
        if raw is not None:
            raw.close()
    return (0, -1) if lo is None else (lo, hi)


def check_ids(sources: list[Source], vocab_size: int, comm=None) -> None:
    """Every id of every source in [0, vocab_size): from meta.json records, else scanned (the
    chunks dealt out over `comm`'s ranks, the verdict agreed by one all-reduce)."""
    unknown = [s for s in sources if s.max_id is None]
    if unknown:
        part, parts = (comm.rank, comm.size) if comm is not None else (0, 1)
        local = []
        for s in unknown:
            lo, hi = scan_range(s.tokens, part, parts)
            local += [-lo if hi >= 0 else np.iinfo(np.int64).min, hi]
        found = np.array(local, dtype=np.int64)
        if comm is not None and comm.size > 1:
            found = comm.all_reduce(found, op="max")
        for k, s in enumerate(unknown):
            if -found[2 * k] < 0:
                raise DataError(f"{s.path!r} holds a negative token id ({-found[2 * k]}); token ids are >= 0")
            s.max_id = int(found[2 * k + 1])
    for s in sources:
        if s.max_id >= vocab_size:
            raise DataError(f"{s.path!r} holds token id {s.max_id}, but model.vocab_size={vocab_size}; set "
                            f"model.vocab_size >= {s.max_id + 1} (the tokenizer's size), or check data.token_dtype")
