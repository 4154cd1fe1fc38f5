"""`hpcpar data prepare`: text files -> a token file, its tokenizer and its record, in one directory.

    hpcpar data prepare TEXT... --out DIR [--tokenizer bytes|bpe|gpt2] [--vocab-size N]
                        [--vocab vocab.json --merges merges.txt] [--format bin|hdf5]

writes ``DIR/tokens.bin`` (flat uint16/uint32 tokens, nanoGPT's layout) or ``DIR/tokens.h5``
(dataset ``tokens``), ``DIR/tokenizer.json``, ``DIR/documents.bin`` (the document index: where
each input file, and each document after the tokenizer's end-of-text token when it has one,
starts in the tokens; int64 little-endian) and ``DIR/meta.json`` (token count, dtype and largest
id: what `formats.load` checks instead of scanning; the index's count and the end-of-text id). Train on it with
``--set data.format=bin --set data.corpus=DIR``.

The text is what ``data.format = "bytes"`` would read from the same paths: one path is read as
is; several paths, or a directory (its regular, non-hidden files in sorted order), are
documents each followed by ``"\\n"``. So the byte tokenizer writes exactly the byte corpus, and a
token file trains to the same loss curve as its text. A BPE encodes each document on its own,
read in pieces of about `PIECE_BYTES` cut where its pre-tokenizer splits anyway (`_cut`), so the
ids are those of the whole document while memory stays bounded whatever the corpus (pieces are
decoded as UTF-8, invalid bytes replaced); a progress bar counts the bytes.

One process: started under mpiexec, rank 0 alone runs it and the other ranks wait (`cli`).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator, Sequence

import h5py
import numpy as np

from hpcpar.data import corpus, formats, tokenizer
from hpcpar.errors import DataError, HpcparError

PIECE_BYTES = 4 << 20       # text read and encoded at a time
_BATCH_PIECES = 8           # pieces encoded together (the BPE library encodes a batch in parallel)
_SEPARATOR = b"\n"          # after each document when there are several (as corpus.load_corpus)


def input_files(paths: Sequence[str]) -> tuple[list[str], bool]:
    """The files to read, in order, and whether each is followed by the document separator
    (False only for a single file given directly, as `corpus.load_corpus` reads it)."""
    if not paths:
        raise DataError("data prepare needs at least one text file or directory")
    files = []
    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except OSError as err:
            raise DataError(f"input {path!r} does not exist or cannot be read ({err.strerror}); "
                            "give text files or directories") from None
        if stat.S_ISDIR(mode):
            files += corpus._regular_files(path)
        elif stat.S_ISREG(mode):
            files.append(path)
        else:
            raise DataError(f"input {path!r} is neither a regular file nor a directory")
    separate = not (len(paths) == 1 and len(files) == 1 and not os.path.isdir(paths[0]))
    return files, separate


_WHITESPACE = b" \t\r\n\x0b\x0c"


def _cut(block: bytes) -> int:
    """Where to end a piece: at the last point where an ASCII non-space byte is followed by a
    space, tab or newline. GPT-2's pre-tokenizer (byte-level BPE) never joins text across such
    a point (its pieces are letters, digits or punctuation with at most one space before them,
    or runs of whitespace), so encoding in pieces gives exactly the ids of encoding whole. A
    piece without such a point is cut before an incomplete UTF-8 sequence."""
    for i in range(len(block) - 1, 0, -1):
        if block[i] in _WHITESPACE and block[i - 1] < 0x80 and block[i - 1] not in _WHITESPACE:
            return i
    for back in range(1, min(4, len(block)) + 1):
        lead = block[-back]
        if lead & 0xC0 != 0x80:  # the first byte of the last character
            need = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            return len(block) if back >= need or back == len(block) else len(block) - back
    return len(block)


def _pieces(path: str, separator: bytes) -> Iterator[bytes]:
    """The file's bytes, then `separator`, in pieces of about PIECE_BYTES (see `_cut`)."""
    try:
        f = open(path, "rb")
    except OSError as err:
        raise DataError(f"cannot read {path!r}: {err.strerror}") from None
    carry, ready = b"", None
    with f:
        while True:
            block = f.read(PIECE_BYTES)
            if not block:
                break
            block = carry + block
            cut = _cut(block)
            carry = block[cut:]
            if ready is not None:
                yield ready
            ready = block[:cut]
    last = (ready or b"") + carry + separator   # the separator ends the document's last piece
    if last:
        yield last


def _documents(files: list[str], separate: bool) -> Iterator[list[bytes]]:
    for path in files:
        yield list(_pieces(path, _SEPARATOR if separate else b""))


def _texts(files: list[str], separate: bool) -> Iterator[str]:
    """Every piece as text (for BPE training)."""
    for path in files:
        for piece in _pieces(path, _SEPARATOR if separate else b""):
            yield piece.decode("utf-8", errors="replace")


class _Writer:
    """Appends token arrays to DIR/tokens.bin or DIR/tokens.h5; counts them and tracks the largest id."""

    def __init__(self, out: str, fmt: str, dtype: np.dtype, eot_id: int | None = None):
        self.fmt, self.dtype, self.count, self.max_id = fmt, dtype, 0, -1
        self.eot_id = eot_id
        self.starts = [0]   # document start offsets: each input file's first token, and after each end-of-text
        self.final = os.path.join(out, formats.BIN_FILE if fmt == "bin" else formats.HDF5_FILE)
        self.tmp = self.final + ".partial"
        if fmt == "bin":
            self.f = open(self.tmp, "wb")
        else:
            self.f = h5py.File(self.tmp, "w")
            self.ds = self.f.create_dataset(formats.HDF5_DATASET, shape=(0,), maxshape=(None,), dtype=dtype,
                                            chunks=(1 << 16,))

    def write(self, ids) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            return
        top = int(ids.max())
        if top > np.iinfo(self.dtype).max:
            raise HpcparError(f"token id {top} does not fit --token-dtype {self.dtype.name}; use uint32")
        self.max_id = max(self.max_id, top)
        if self.eot_id is not None:
            self.starts += (self.count + np.flatnonzero(ids == self.eot_id) + 1).tolist()
        arr = ids.astype(self.dtype)
        if self.fmt == "bin":
            arr.tofile(self.f)
        else:
            self.ds.resize((self.count + arr.size,))
            self.ds[self.count:] = arr
        self.count += arr.size

    def begin_document(self) -> None:
        """The next token written starts a document."""
        if self.count > self.starts[-1]:
            self.starts.append(self.count)

    def document_index(self, out: str) -> dict:
        """Write DIR/documents.bin; its record for meta.json."""
        starts = np.unique(np.array(self.starts, dtype=np.int64))
        starts = starts[starts < self.count]
        starts.astype("<i8").tofile(os.path.join(out, formats.DOCS_FILE))
        return {"file": formats.DOCS_FILE, "count": int(starts.size)}

    def close(self, ok: bool) -> None:
        self.f.close()
        if ok:
            os.replace(self.tmp, self.final)
        elif os.path.exists(self.tmp):
            os.remove(self.tmp)


def prepare(inputs: Sequence[str], out: str, kind: str = "bytes", vocab_size: int = 0, vocab: str = "",
            merges: str = "", fmt: str = "bin", token_dtype: str = "auto", progress: bool = True) -> dict:
    """Tokenize `inputs` into `out` (see the module docstring); returns meta.json's content plus
    "path" (the token file) and "seconds"."""
    if kind not in tokenizer.KINDS:
        raise HpcparError(f"--tokenizer {kind!r} is not one of {', '.join(tokenizer.KINDS)}")
    if kind == "bpe" and not vocab_size:
        raise HpcparError("--tokenizer bpe needs --vocab-size N (e.g. 4096): the BPE is trained to that many ids")
    if kind != "bpe" and vocab_size:
        raise HpcparError(f"--vocab-size applies to --tokenizer bpe (the size it trains to); the {kind} tokenizer's "
                          "vocabulary is fixed: drop --vocab-size")
    if kind == "gpt2" and not (vocab and merges):
        raise HpcparError("--tokenizer gpt2 needs --vocab vocab.json and --merges merges.txt (a local copy of "
                          "GPT-2's tokenizer files; nothing is downloaded)")
    if fmt not in ("bin", "hdf5"):
        raise HpcparError(f"--format {fmt!r} is not one of bin, hdf5")
    files, separate = input_files(inputs)
    total = sum(os.path.getsize(f) for f in files) + (len(files) if separate else 0)
    if total == 0:
        raise DataError(f"the inputs ({', '.join(inputs)}) hold no text")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as err:
        raise DataError(f"cannot create output directory {out!r}: {err.strerror}") from None
    start = time.perf_counter()
    if kind == "bytes":
        tok = tokenizer.ByteTokenizer()
    elif kind == "gpt2":
        tok = tokenizer.gpt2(vocab, merges)
    else:
        tok = tokenizer.train_bpe(_texts(files, separate), vocab_size, progress=progress)
    if token_dtype == "auto":
        token_dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    if token_dtype not in ("uint16", "uint32"):
        raise HpcparError(f"--token-dtype {token_dtype!r} is not one of auto, uint16, uint32")
    eot_id = tok.tok.token_to_id(tokenizer.GPT2_EOT) if kind != "bytes" else None
    writer = _Writer(out, fmt, np.dtype(token_dtype), eot_id)
    ok = False
    try:
        from tqdm import tqdm
        with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress,
                  mininterval=0.5) as bar:
            for pieces in _documents(files, separate):
                writer.begin_document()
                for k in range(0, len(pieces), _BATCH_PIECES):
                    group = pieces[k:k + _BATCH_PIECES]
                    if kind == "bytes":
                        for piece in group:
                            writer.write(np.frombuffer(piece, dtype=np.uint8))
                    else:
                        for ids in tok.encode_batch([p.decode("utf-8", errors="replace") for p in group]):
                            writer.write(ids)
                    bar.update(sum(len(p) for p in group))
        ok = writer.count > 0
    finally:
        writer.close(ok)
    if not ok:
        raise DataError(f"the inputs ({', '.join(inputs)}) gave no tokens")
    with open(os.path.join(out, formats.TOKENIZER), "w", encoding="utf-8") as f:
        f.write(tok.to_json())
    key = os.path.basename(writer.final) + (f"/{formats.HDF5_DATASET}" if fmt == "hdf5" else "")
    files_meta = {key: {"tokens": writer.count, "dtype": token_dtype, "max_id": writer.max_id,
                        "documents": writer.document_index(out)}}
    extra = {"eot_id": eot_id, "tokenizer_kind": tok.kind, "vocab_size": tok.vocab_size, "data_format": fmt,
             "sources": [os.path.abspath(p) for p in inputs], "documents": len(files),
             "separator": _SEPARATOR.decode() if separate else ""}
    formats.write_meta(out, files_meta, formats.TOKENIZER, extra)
    return {**files_meta[key], **extra, "path": writer.final, "seconds": time.perf_counter() - start}
