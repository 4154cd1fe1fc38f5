"""Tokenizers: bytes, a trained BPE, GPT-2's BPE from local files; identity (fingerprint) and errors."""

from __future__ import annotations

import builtins
import json

import numpy as np
import pytest

from hpcpar.data import tokenizer
from hpcpar.errors import DataError, HpcparError

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "so", "ta", "vi", "zé", "ün", " ", " ", "\n", ", ", ". "]
TEXT = "".join(np.random.default_rng(0).choice(_SYLLABLES, 4000))   # enough pairs to merge 300 ids


def test_bytes_round_trip_and_record():
    tok = tokenizer.ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode()) and tok.decode(ids) == TEXT
    assert tok.decode([0xC3]) == "\ufffd"           # a cut UTF-8 sequence decodes with a replacement
    rec = tokenizer.BYTES_RECORD
    assert rec["kind"] == "bytes" and rec["vocab_size"] == 256
    assert tokenizer.from_json(rec["json"]).encode("a") == [97]


def bpe(vocab_size=300):
    pytest.importorskip("tokenizers")
    return tokenizer.train_bpe(iter([TEXT] * 3), vocab_size)


def test_trained_bpe_encodes_every_text_and_round_trips():
    tok = bpe()
    assert tok.vocab_size == 300 and tok.kind == "bpe"
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT.encode()) / 2               # merges learned
    assert tok.decode(ids) == TEXT
    other = "never seen: 日本語 \x00\x7f"
    assert tok.decode(tok.encode(other)) == other         # the byte alphabet covers any text
    again = tokenizer.from_json(tok.to_json())
    assert again.encode(TEXT) == ids
    assert tokenizer.vocab_size(tok.to_json()) == 300


def test_bpe_vocabulary_below_the_byte_alphabet_is_refused():
    with pytest.raises(HpcparError, match="--vocab-size 100 is too small"):
        tokenizer.train_bpe(iter([TEXT]), 100)


def gpt2_files(tmp_path):
    """A GPT-2-format vocab.json / merges.txt (a small BPE trained here, plus <|endoftext|> last)."""
    tok = bpe(320)
    tok.tok.model.save(str(tmp_path))
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    vocab[tokenizer.GPT2_EOT] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")


def test_gpt2_tokenizer_from_local_files_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    vocab, merges = gpt2_files(tmp_path)
    ours = tokenizer.gpt2(vocab, merges)
    theirs = transformers.GPT2TokenizerFast.from_pretrained(str(tmp_path))   # the local vocab.json, merges.txt
    for text in (TEXT, " leading space\n\n\nblank lines", "tabs\tand  double  spaces", "<|endoftext|>after"):
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == text
    assert ours.vocab_size == len(theirs)
    # HF's tokenizer.json of the same files means the same tokenizer: same fingerprint.
    theirs.save_pretrained(str(tmp_path / "hf"))
    hf_json = (tmp_path / "hf" / "tokenizer.json").read_text()
    assert tokenizer.fingerprint(hf_json) == tokenizer.fingerprint(ours.to_json())
    assert tokenizer.fingerprint(hf_json) != tokenizer.fingerprint(tokenizer.BYTES_JSON)


def test_gpt2_needs_both_files(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(DataError, match="nothing is downloaded"):
        tokenizer.gpt2(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))


def test_missing_library_names_the_extra(monkeypatch):
    real = builtins.__import__

    def no_tokenizers(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    with pytest.raises(HpcparError, match=r"pip install 'hpcpar\[data\]'") as info:
        tokenizer.train_bpe(iter([TEXT]), 300)
    assert "\n" not in str(info.value)
    assert tokenizer.from_json(tokenizer.BYTES_JSON).decode([104, 105]) == "hi"   # bytes never need it


def test_read_rejects_what_is_not_a_tokenizer(tmp_path):
    for content, fragment in (("{", "not a tokenizer JSON file"), ("[1, 2]", "a JSON object expected"),
                              ('{"model": {}}', "no model vocabulary")):
        (tmp_path / "t.json").write_text(content)
        with pytest.raises(DataError, match=fragment):
            tokenizer.read(str(tmp_path / "t.json"))
    with pytest.raises(DataError, match="cannot read tokenizer"):
        tokenizer.read(str(tmp_path / "missing.json"))


def test_require_match():
    bpe_rec = tokenizer.record(bpe().to_json())
    tokenizer.require_match(bpe_rec, dict(bpe_rec), "a", "b")
    tokenizer.require_match(None, bpe_rec, "a", "b")           # unknown on one side: nothing to compare
    with pytest.raises(DataError, match="tokenizer mismatch: checkpoint X was made with the bpe tokenizer, 300 ids"
                                        ".* but data Y has the bytes tokenizer, 256 ids") as info:
        tokenizer.require_match(bpe_rec, tokenizer.BYTES_RECORD, "checkpoint X", "data Y")
    assert "\n" not in str(info.value)
