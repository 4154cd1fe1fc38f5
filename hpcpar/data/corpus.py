"""Byte corpus and deterministic batches.

Tokens are bytes (vocabulary 256). A corpus is a text file, a directory of text
files, or — by default — the Python standard library's source on this machine:
real text nobody here wrote, present wherever Python is.

Sampling follows decision 5 of the design: sample ``k`` of step ``s`` is a pure
function of ``(seed, s, k)``, so the global batch of a step is the same bytes on
any mesh. The global batch of step ``s`` is samples
``0 .. dp * micro_batch_size * microbatches - 1``; dp rank ``d``'s micro-batch
``j`` holds samples ``(j*dp + d)*mbs ... (j*dp + d + 1)*mbs - 1``
(:func:`microbatch_sample_ids`).
"""

from __future__ import annotations

import os
import stat
import sys
import sysconfig
from collections.abc import Iterable, Sequence

import numpy as np

from hpcpar.backend.splitmix import hash_keys
from hpcpar.errors import DataError

VOCAB_SIZE = 256
# The default corpus is the first DEFAULT_CORPUS_CAP bytes of the stdlib source in sorted
# relative-path order, so loading stays fast (CPython 3.11's is about 12 MB, under the cap).
DEFAULT_CORPUS_CAP = 16 * 2**20
# Directory names never read for the default corpus: installed packages and test suites
# (tests are repetitive fixtures, not representative source).
_DEFAULT_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# Separator written after each file of a directory corpus, so documents do not run together.
_DOC_SEPARATOR = b"\n"

_default_cache: tuple[np.ndarray, np.ndarray] | None = None


def _printable(path: str | bytes) -> str:
    """The path as a quoted, printable string (undecodable bytes shown as escapes)."""
    return repr(os.fsdecode(path))


def _check_utf8_name(path: str) -> None:
    """Reject names that are not valid UTF-8: their sort order and display vary by locale."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(f"corpus path {_printable(path)} is not valid UTF-8; "
                        "rename it to a UTF-8 name or move it out of the corpus") from None


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"cannot read corpus file {_printable(path)}: {e.strerror or e}; "
                        "check that it exists and is readable") from None


def _regular_files(root: str, excluded_dirs: frozenset[str] = frozenset(),
                   suffix: str = "", skip_hidden: bool = True) -> list[str]:
    """Regular files under ``root`` (recursive), sorted by their '/'-joined relative path.

    Symbolic links to directories are not followed (no cycles); links to regular
    files are read. Sockets, FIFOs and devices are skipped.
    """
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise_walk_error):
        dirnames[:] = [d for d in dirnames
                       if d not in excluded_dirs and not (skip_hidden and d.startswith("."))]
        for name in filenames:
            if (skip_hidden and name.startswith(".")) or not name.endswith(suffix):
                continue
            full = os.path.join(dirpath, name)
            _check_utf8_name(full)
            try:
                if not stat.S_ISREG(os.stat(full).st_mode):
                    continue
            except OSError:  # a dangling link: nothing to read
                continue
            found.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    found.sort()
    return [full for _, full in found]


def _raise_walk_error(e: OSError) -> None:
    raise DataError(f"cannot list corpus directory {_printable(e.filename or '')}: "
                    f"{e.strerror or e}; check its permissions")


def _concat(files: Iterable[str], cap: int | None = None) -> tuple[bytes, np.ndarray]:
    """Each file's bytes followed by the separator, stopping once ``cap`` bytes are read; and the
    documents' start offsets (one document per file: its bytes and separator), int64, from 0."""
    parts: list[bytes] = []
    starts = [0]
    for full in files:
        parts.append(_read_file(full))
        parts.append(_DOC_SEPARATOR)
        starts.append(starts[-1] + len(parts[-2]) + len(_DOC_SEPARATOR))
        if cap is not None and starts[-1] >= cap:
            break
    data = b"".join(parts)
    data = data[:cap] if cap is not None else data
    offsets = np.array(starts, dtype=np.int64)
    return data, offsets[offsets < max(len(data), 1)]


def _stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _load_default() -> tuple[np.ndarray, np.ndarray]:
    global _default_cache
    if _default_cache is None:
        root = _stdlib_dir()
        files = _regular_files(root, _DEFAULT_EXCLUDED_DIRS, suffix=".py")
        data, starts = _concat(files, DEFAULT_CORPUS_CAP)
        if len(data) == len(files) * len(_DOC_SEPARATOR):
            raise DataError(f"the default corpus is empty: no Python source under {_printable(root)}; "
                            "set data.path to a text file or directory")
        starts.flags.writeable = False
        _default_cache = np.frombuffer(data, dtype=np.uint8), starts  # read-only: the cache is shared
    return _default_cache


def load_corpus(path: str | os.PathLike = "") -> np.ndarray:
    """Load a corpus as byte tokens (`load_documents` without the document starts)."""
    return load_documents(path)[0]


def load_documents(path: str | os.PathLike = "") -> tuple[np.ndarray, np.ndarray]:
    """Load a corpus as byte tokens, with its documents' start offsets.

    Args:
        path: a text file (read as is), a directory (every regular, non-hidden file
            below it, recursively, in sorted relative-path order, each followed by
            ``b"\\n"``), or ``""`` for the default corpus: the ``*.py`` files of the
            standard library (``sysconfig.get_paths()["stdlib"]``) without
            site-packages, ``__pycache__`` and test directories, read the same way
            and capped at ``DEFAULT_CORPUS_CAP`` bytes. The default is cached per process.

    Returns:
        A read-only ``uint8`` array ``[N]``, and the sorted int64 start offsets of its documents
        (from 0): one document per file of a directory (its bytes and separator), a single file
        is one document.

    Raises:
        DataError: missing path, a path that is neither file nor directory, an
            unreadable file, a name that is not valid UTF-8, or no bytes at all.
    """
    path = os.fspath(path)
    if path == "":
        return _load_default()
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    _check_utf8_name(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DataError(f"corpus path {_printable(path)} does not exist; "
                        "give a text file, a directory of text files, or \"\" for the default") from None
    except OSError as e:
        raise DataError(f"cannot access corpus path {_printable(path)}: {e.strerror or e}") from None
    if stat.S_ISREG(mode):
        data, starts = _read_file(path), np.zeros(1, dtype=np.int64)
        empty = len(data) == 0
    elif stat.S_ISDIR(mode):
        files = _regular_files(path)
        data, starts = _concat(files)
        empty = len(data) == len(files) * len(_DOC_SEPARATOR)
    else:
        raise DataError(f"corpus path {_printable(path)} is neither a regular file nor a directory")
    if empty:
        raise DataError(f"corpus path {_printable(path)} holds no bytes; give a non-empty text file or directory")
    return np.frombuffer(data, dtype=np.uint8), starts


def corpus_description(path: str | os.PathLike = "", tokens: np.ndarray | None = None) -> str:
    """A short line for logs naming the corpus (and its size when ``tokens`` is given)."""
    path = os.fspath(path)
    if path == "":
        what = (f"Python {sys.version.split()[0]} standard library source "
                f"({_printable(_stdlib_dir())}, *.py, sorted)")
    elif os.path.isdir(path):
        what = f"directory {_printable(path)}"
    else:
        what = f"file {_printable(path)}"
    if tokens is not None:
        what += f", {len(tokens):,} bytes"
    return what


def split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous split: ``(tokens[:n - v], tokens[n - v:])`` with ``v = floor(n * val_fraction)``."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(len(tokens) * val_fraction)
    return tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]


# ---------------------------------------------------------------------------------------
# Sampling. A counter-based hash (SplitMix64, chained over the key words: `splitmix.hash_keys`)
# gives each sample's offset as a pure function of its key, vectorised over the batch: over
# 10x cheaper than seeding a numpy Generator per sample, with the same independence from
# the mesh, from which other samples are requested and from call order.
_TRAIN_STREAM = 0
_EVAL_STREAM = 1


def _check_nonneg(name: str, value: int) -> int:
    if int(value) != value or value < 0:
        raise DataError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def _gather(tokens: np.ndarray, key: Sequence[int], sample_ids: Iterable[int], block_size: int,
            what: str, positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    block_size = _check_nonneg("block_size", block_size)
    if block_size == 0:
        raise DataError("block_size must be at least 1")
    if len(tokens) < block_size + 1:
        raise DataError(f"the {what} split has {len(tokens)} tokens, fewer than block_size + 1 = "
                        f"{block_size + 1}; use a larger corpus, a smaller block_size or another val_fraction")
    ks = np.asarray(sample_ids if isinstance(sample_ids, np.ndarray) else list(sample_ids), dtype=np.int64)
    if ks.ndim != 1 or (ks.size and ks.min() < 0):
        raise DataError(f"sample_ids must be non-negative integers, got {sample_ids!r}")
    starts = _starts(len(tokens), key, ks, block_size)
    if positions is None:
        window = tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int64)  # [B, T+1]
        return np.ascontiguousarray(window[:, :-1]), np.ascontiguousarray(window[:, 1:])
    at = starts[:, None] + np.asarray(positions, dtype=np.int64)[None, :]           # [B, n]: my tokens only
    return tokens[at].astype(np.int64), tokens[at + 1].astype(np.int64)


def _starts(n_tokens: int, key: Sequence[int], ks: np.ndarray, block_size: int) -> np.ndarray:
    """Window start offsets [len(ks)], int64, uniform in [0, n_tokens - T - 1]; the modulo bias
    (about n_tokens / 2**64) is negligible."""
    return (hash_keys(key, ks) % np.uint64(n_tokens - block_size)).astype(np.int64)


def window_starts(n_tokens: int, seed: int, index: int, sample_ids: Iterable[int], block_size: int,
                  stream: int = _TRAIN_STREAM) -> np.ndarray:
    """Where the windows of `get_batch` (stream 0, `index` the step) or `get_eval_batch` (stream 1,
    `index` the batch) begin in a split of `n_tokens` tokens: int64 [len(sample_ids)]."""
    ks = np.asarray(sample_ids if isinstance(sample_ids, np.ndarray) else list(sample_ids), dtype=np.int64)
    return _starts(n_tokens, (seed, stream, index), ks, block_size)


def get_batch(tokens: np.ndarray, seed: int, step: int, sample_ids: Iterable[int],
              block_size: int, positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Training samples ``sample_ids`` of step ``step``.

    Returns:
        ``(x, y)``, int64 ``[len(sample_ids), block_size]``, ``y`` is ``x`` shifted by one.
        Row i depends only on ``(seed, step, sample_ids[i])``. With ``positions`` (indices into
        ``[0, block_size)``, a context-parallel rank's tokens) only those columns are built:
        ``[len(sample_ids), len(positions)]``, exactly those columns of the whole batch.
    """
    key = (_check_nonneg("seed", seed), _TRAIN_STREAM, _check_nonneg("step", step))
    return _gather(tokens, key, sample_ids, block_size, "training", positions)


def get_eval_batch(tokens: np.ndarray, seed: int, index: int, sample_ids: Iterable[int],
                   block_size: int, positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Validation batch ``index``: like :func:`get_batch` but from a stream disjoint from training's."""
    key = (_check_nonneg("seed", seed), _EVAL_STREAM, _check_nonneg("index", index))
    return _gather(tokens, key, sample_ids, block_size, "validation", positions)


def microbatch_sample_ids(dp_rank: int, dp: int, micro_batch_size: int, microbatch: int) -> range:
    """Global sample ids of dp rank ``dp_rank``'s micro-batch ``microbatch``.

    ``(j*dp + d)*mbs ... (j*dp + d + 1)*mbs - 1``: the union over ranks and micro-batches
    is ``0 .. dp*mbs*microbatches - 1``, whatever the mesh.
    """
    if dp < 1 or not 0 <= dp_rank < dp:
        raise DataError(f"dp_rank must be in [0, dp) with dp >= 1, got dp_rank={dp_rank}, dp={dp}")
    if micro_batch_size < 1 or microbatch < 0:
        raise DataError(f"need micro_batch_size >= 1 and microbatch >= 0, "
                        f"got {micro_batch_size} and {microbatch}")
    start = (microbatch * dp + dp_rank) * micro_batch_size
    return range(start, start + micro_batch_size)


def get_window_batch(tokens: np.ndarray, sample_ids: Iterable[int], block_size: int,
                     windows: int, positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Whole-sequence evaluation: sample k is window k, ``x = tokens[k*T : (k+1)*T]`` and ``y``
    the next tokens, so windows 0 .. `windows` - 1 cover the sequence once. Samples past the
    last window (the remainder of the last global batch) are padding: x = 0, y = -100, which
    the loss ignores. With ``positions`` (indices into ``[0, block_size)``, a context-parallel
    rank's tokens) only those columns are returned.

    Returns:
        ``(x, y)``, int64 ``[len(sample_ids), block_size]`` (``len(positions)`` columns).
    """
    block_size = _check_nonneg("block_size", block_size)
    if block_size == 0 or windows * block_size + 1 > len(tokens):
        raise DataError(f"{windows} windows of {block_size} tokens need {windows * block_size + 1} tokens, "
                        f"the sequence has {len(tokens)}")
    ks = np.asarray(list(sample_ids), dtype=np.int64)
    real = ks < windows
    x = np.zeros((len(ks), block_size), dtype=np.int64)
    y = np.full((len(ks), block_size), -100, dtype=np.int64)
    if real.any():
        at = ks[real, None] * block_size + np.arange(block_size + 1)
        window = tokens[at].astype(np.int64)
        x[real], y[real] = window[:, :-1], window[:, 1:]
    if positions is not None:
        cols = np.asarray(positions, dtype=np.int64)
        return np.ascontiguousarray(x[:, cols]), np.ascontiguousarray(y[:, cols])
    return x, y
