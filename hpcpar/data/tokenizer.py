"""Tokenizers: bytes (built in), or a byte-level BPE of the `tokenizers` library, each one JSON file.

Three kinds, one interface (`encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`):

- ``bytes``: the UTF-8 bytes of the text, 256 ids (what ``data.format = "bytes"`` trains on); its
  file is hpcpar's own two-key JSON, `BYTES_JSON`;
- ``bpe``: a byte-level BPE trained on the corpus by HuggingFace `tokenizers` (`train_bpe`);
- ``gpt2``: GPT-2's byte-level BPE, built from its vocab.json and merges.txt given locally
  (`gpt2`; nothing is downloaded).

The BPE kinds are stored as the `tokenizers` library's JSON (`Tokenizer.to_str()`, the
``tokenizer.json`` of a HuggingFace model directory). Encoding and decoding them needs that
library (``pip install 'hpcpar[data]'``); training on token files does not, and bytes never do.

A tokenizer's identity, `fingerprint`, is what makes an id mean a piece of text: the id -> token
table and the merges, read from the JSON with the standard library, so the tokenizer recorded in
a checkpoint and the one beside a data directory compare without `tokenizers` installed, and
whichever program wrote the JSON (a HuggingFace ``tokenizer.json`` of GPT-2 and the one built here
from vocab.json + merges.txt have the same fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from typing import Protocol

from hpcpar.data.untrusted import MiB, exact_int, read_text
from hpcpar.errors import DataError, HpcparError

LIMIT = 256 * MiB   # the largest tokenizer file read (the largest published ones are ~35 MB)
_MAX_ID = 1 << 31   # token ids fit int32 (uint32 token files)
_SPARSE = 2         # a tokenizer's largest id + 1 is at most this many times its tokens (+ 256)
BYTES_JSON = json.dumps({"hpcpar_tokenizer": "bytes", "vocab_size": 256})
KINDS = ("bytes", "bpe", "gpt2")
# GPT-2's end-of-text token: in its vocab.json, and a special (never split) token of its tokenizer.
GPT2_EOT = "<|endoftext|>"


class Tokenizer(Protocol):
    kind: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def to_json(self) -> str: ...


class ByteTokenizer:
    """Text <-> its UTF-8 bytes; invalid UTF-8 decodes with replacement characters."""

    kind = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return BYTES_JSON


class BPETokenizer:
    """A `tokenizers.Tokenizer` (byte-level BPE) behind the same interface."""

    def __init__(self, tok, kind: str = "bpe"):
        self.tok, self.kind = tok, kind
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tok.to_str()


def library(feature: str):
    """The `tokenizers` module, or a one-line error naming the extra that installs it."""
    try:
        import tokenizers
    except ImportError:
        raise HpcparError(f"{feature} needs the `tokenizers` package, which is not installed; "
                          "pip install 'hpcpar[data]' (or pip install tokenizers)") from None
    return tokenizers


def _byte_level(tok, lib):
    """GPT-2's byte-level pipeline: bytes mapped to printable symbols, GPT-2's split regex."""
    tok.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = lib.decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterator[str], vocab_size: int, length: int | None = None,
              progress: bool = False) -> BPETokenizer:
    """A byte-level BPE with `vocab_size` ids trained on `texts` (the 256 byte symbols first, so
    any text encodes). `length`: how many texts, for the trainer's progress bar."""
    if vocab_size < 256:
        raise HpcparError(f"--vocab-size {vocab_size} is too small: a byte-level BPE starts from the "
                          "256 byte symbols; use >= 256 (or --tokenizer bytes)")
    lib = library("--tokenizer bpe")
    tok = _byte_level(lib.Tokenizer(lib.models.BPE()), lib)
    trainer = lib.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=progress,
                                      initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return BPETokenizer(tok, "bpe")


def gpt2(vocab_json: str, merges_txt: str) -> BPETokenizer:
    """GPT-2's BPE from its local vocab.json and merges.txt (as HuggingFace's GPT2TokenizerFast)."""
    lib = library("--tokenizer gpt2")
    for path in (vocab_json, merges_txt):
        if not os.path.isfile(path):
            raise DataError(f"GPT-2 tokenizer file {path!r} does not exist; give --vocab vocab.json and "
                            "--merges merges.txt from a local GPT-2 (nothing is downloaded)")
    try:
        model = lib.models.BPE.from_file(vocab_json, merges_txt)
    except Exception as err:  # noqa: BLE001 - the library raises plain Exceptions for bad files
        raise DataError(f"cannot read GPT-2 tokenizer files {vocab_json!r}, {merges_txt!r}: "
                        f"{' '.join(str(err).split())}") from None
    tok = _byte_level(lib.Tokenizer(model), lib)
    if GPT2_EOT in tok.get_vocab():
        tok.add_special_tokens([GPT2_EOT])
    return BPETokenizer(tok, "gpt2")


def from_json(text: str, origin: str = "tokenizer") -> Tokenizer:
    """The tokenizer a JSON text describes (bytes, or a `tokenizers` BPE: needs the library)."""
    obj = _parse(text, origin)
    if obj.get("hpcpar_tokenizer") == "bytes":
        return ByteTokenizer()
    lib = library(f"decoding with the BPE tokenizer of {origin}")
    try:
        tok = lib.Tokenizer.from_str(text)
    except Exception as err:  # noqa: BLE001
        raise DataError(f"{origin}: not a tokenizer the `tokenizers` library reads "
                        f"({' '.join(str(err).split())})") from None
    return BPETokenizer(tok, _kind(obj))


def read(path: str) -> str:
    """A tokenizer file's JSON text (at most `LIMIT` bytes; checked to be a tokenizer)."""
    text = read_text(path, LIMIT, "tokenizer")  # "cannot read tokenizer <path>: <reason>", or too large
    _table(_parse(text, path), path)
    return text


def load(path: str) -> Tokenizer:
    return from_json(read(path), path)


# -------------------------------------------------------------------------- identity


def _parse(text: str, origin: str) -> dict:
    try:
        obj = json.loads(text)
    except ValueError as err:
        raise DataError(f"{origin}: not a tokenizer JSON file ({err})") from None
    except RecursionError:
        raise DataError(f"{origin}: not a tokenizer JSON file (nested too deep)") from None
    if not isinstance(obj, dict):
        raise DataError(f"{origin}: not a tokenizer JSON file (a JSON object expected)")
    return obj


def _kind(obj: dict) -> str:
    if obj.get("hpcpar_tokenizer") == "bytes":
        return "bytes"
    model = obj.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    return "gpt2" if isinstance(vocab, dict) and GPT2_EOT in vocab and len(vocab) == 50257 else "bpe"


def _table(obj: dict, origin: str) -> dict:
    """The tokenizer's meaning: model type, sorted (id, token) pairs, merges as "a b" strings.

    Ids are integers in [0, 2**31); the ids a tokenizer claims (its largest + 1, what a model's
    vocabulary must hold) may exceed the tokens it defines at most twice over (`_SPARSE`): a file
    that claims more than it holds is refused by name (DataError), never sized from."""
    if obj.get("hpcpar_tokenizer") == "bytes":
        return {"type": "bytes", "vocab_size": 256}
    model = obj.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict):
        raise DataError(f"{origin}: not a tokenizer JSON file (no model vocabulary); give a "
                        "tokenizer.json written by `hpcpar data prepare` or the `tokenizers` library")
    pairs = [(i, tok, "model.vocab") for tok, i in model["vocab"].items()]
    added = obj.get("added_tokens") or []
    if not isinstance(added, list) or not all(isinstance(a, dict) for a in added):
        raise DataError(f"{origin}: its added_tokens are not a list of tokens (crafted or damaged tokenizer)")
    pairs += [(a.get("id"), a.get("content"), "added_tokens") for a in added]
    ids = {}
    for i, tok, where in pairs:
        if not exact_int(i) or not 0 <= i < _MAX_ID or not isinstance(tok, str):
            raise DataError(f"{origin}: {where} gives {json.dumps(tok)[:40]} the id {json.dumps(i)[:40]}; ids are "
                            f"integers in [0, {_MAX_ID}) (crafted or damaged tokenizer)")
        ids[i] = tok
    if ids and max(ids) + 1 > _SPARSE * len(ids) + 256:
        raise DataError(f"{origin}: claims {max(ids) + 1} ids but defines {len(ids)} tokens; a tokenizer's ids "
                        "are (nearly) consecutive (crafted or damaged tokenizer)")
    merges = model.get("merges") or []
    if not isinstance(merges, list) or not all(
            isinstance(m, str) or isinstance(m, list) and all(isinstance(p, str) for p in m) for m in merges):
        raise DataError(f"{origin}: model.merges is not a list of pairs of strings (crafted or damaged tokenizer)")
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return {"type": model.get("type"), "vocab": sorted(ids.items()), "merges": merges}


def _fingerprint(table: dict) -> str:
    return hashlib.sha256(json.dumps(table, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def _ids(table: dict) -> int:
    return table["vocab_size"] if table["type"] == "bytes" else max((i for i, _ in table["vocab"]), default=-1) + 1


def fingerprint(text: str) -> str:
    """sha256 of what the tokenizer means (see the module docstring), hex."""
    return _fingerprint(_table(_parse(text, "tokenizer"), "tokenizer"))


def vocab_size(text: str) -> int:
    """Number of ids the tokenizer uses: largest id + 1."""
    return _ids(_table(_parse(text, "tokenizer"), "tokenizer"))


def record(text: str) -> dict:
    """What checkpoints store of a tokenizer: kind, ids, fingerprint and the JSON itself."""
    obj = _parse(text, "tokenizer")
    table = _table(obj, "tokenizer")
    return {"kind": _kind(obj), "vocab_size": _ids(table), "fingerprint": _fingerprint(table), "json": text}


BYTES_RECORD = record(BYTES_JSON)


def describe(rec: dict) -> str:
    return f"{rec['kind']} tokenizer, {rec['vocab_size']} ids, fingerprint {rec['fingerprint'][:12]}"


def require_match(expected: dict | None, found: dict | None, expected_where: str, found_where: str) -> None:
    """Raise a one-line DataError when both tokenizers are known and differ."""
    if expected is None or found is None or expected["fingerprint"] == found["fingerprint"]:
        return
    raise DataError(f"tokenizer mismatch: {expected_where} was made with the {describe(expected)}, "
                    f"but {found_where} has the {describe(found)}; use data and tokenizers of the "
                    "checkpoint's tokenizer (its JSON is in the checkpoint's metadata)")
