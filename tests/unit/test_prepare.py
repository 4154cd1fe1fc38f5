"""`hpcpar data prepare`: text -> token files that hold what the byte corpus holds, or its BPE ids."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from hpcpar.data import corpus as data, formats as datasets, prepare, tokenizer
from hpcpar.config.sections import DataConfig
from hpcpar.errors import DataError, HpcparError

_WORDS = ["alpha", "beta", "gamma", "délta", "\n", "\n\n", "  ", "\t", "epsilon ", "zeta.", "η,", " theta"]


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "text"
    (root / "sub").mkdir(parents=True)
    for i in range(3):
        (root / f"f{i}.txt").write_text(" ".join(rng.choice(_WORDS, 2000)))
    (root / "sub" / "g.txt").write_text("héllo wörld\n" * 200)
    (root / ".hidden").write_text("never read")
    return root


def tokens_of(out) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    [(name, entry)] = meta["files"].items()
    if name.endswith(".bin"):
        return np.fromfile(out / name, dtype=entry["dtype"])
    with h5py.File(out / name.split("/")[0]) as f:
        return f[name.split("/")[1]][()]


def test_bytes_hold_exactly_the_byte_corpus(corpus, tmp_path):
    out = tmp_path / "out"
    info = prepare.prepare([str(corpus)], str(out), progress=False)
    expected = data.load_corpus(str(corpus))                     # each file + "\n", sorted, no hidden
    assert np.array_equal(tokens_of(out), expected) and info["tokens"] == len(expected)
    assert info["max_id"] == int(expected.max()) and info["dtype"] == "uint16"
    assert (out / "tokenizer.json").read_text() == tokenizer.BYTES_JSON
    one = corpus / "f0.txt"                                      # one file: read as is, no separator
    prepare.prepare([str(one)], str(tmp_path / "one"), progress=False)
    assert tokens_of(tmp_path / "one").astype(np.uint8).tobytes() == one.read_bytes()
    two = [str(corpus / "f1.txt"), str(corpus / "f0.txt")]      # several files: in the order given
    prepare.prepare(two, str(tmp_path / "two"), progress=False)
    assert tokens_of(tmp_path / "two").astype(np.uint8).tobytes() == \
        (corpus / "f1.txt").read_bytes() + b"\n" + (corpus / "f0.txt").read_bytes() + b"\n"


def test_hdf5_output_and_the_record_make_loading_scan_free(corpus, tmp_path, monkeypatch):
    prepare.prepare([str(corpus)], str(tmp_path / "b"), progress=False)
    prepare.prepare([str(corpus)], str(tmp_path / "h"), fmt="hdf5", progress=False)
    assert np.array_equal(tokens_of(tmp_path / "b"), tokens_of(tmp_path / "h"))
    monkeypatch.setattr(datasets, "scan_range", lambda *a, **k: pytest.fail("scanned a prepared file"))
    for fmt, where in (("bin", "b"), ("hdf5", "h")):
        d = datasets.load(DataConfig(corpus=str(tmp_path / where), format=fmt), 256)
        assert d.tokenizer == tokenizer.BYTES_RECORD and d.sources[0].max_id == tokens_of(tmp_path / "b").max()


def test_progress_bar_counts_bytes(corpus, tmp_path, capsys):
    prepare.prepare([str(corpus)], str(tmp_path / "p"), progress=True)
    assert "tokenizing" in capsys.readouterr().err


def test_bpe_in_pieces_equals_bpe_of_the_whole_text(corpus, tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    documents = [p.read_text() + "\n" for p in sorted(corpus.rglob("*.txt"))]   # encoded one by one
    monkeypatch.setattr(prepare, "PIECE_BYTES", 97)              # many cuts, at blank lines and in words
    info = prepare.prepare([str(corpus)], str(tmp_path / "bpe"), kind="bpe", vocab_size=300, progress=False)
    tok = tokenizer.load(str(tmp_path / "bpe" / "tokenizer.json"))
    assert tok.vocab_size == info["vocab_size"] <= 300 and info["tokenizer_kind"] == "bpe"
    ids = tokens_of(tmp_path / "bpe")
    assert ids.tolist() == [i for doc in documents for i in tok.encode(doc)]
    assert tok.decode(ids.tolist()) == "".join(documents)


def test_cut_only_where_the_pre_tokenizer_splits():
    assert prepare._cut(b"ab cd\n\n  ef") == 5                  # before the last whitespace run
    assert prepare._cut("a\u00a0 b".encode()) == 5               # after a Unicode space: no cut there
    assert prepare._cut("é b".encode()) == 4                     # nor after a non-ASCII letter
    assert prepare._cut("xé".encode()[:2]) == 1                  # no space at all: an incomplete character waits
    assert prepare._cut("xé".encode()) == 3
    assert prepare._cut(b"\n\n\n") == 3


def test_gpt2_from_local_files_gives_transformers_ids(corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    trained = tokenizer.train_bpe(iter([(corpus / "f0.txt").read_text()]), 280)
    trained.tok.model.save(str(tmp_path))
    info = prepare.prepare([str(corpus / "f1.txt")], str(tmp_path / "g"), kind="gpt2",
                           vocab=str(tmp_path / "vocab.json"), merges=str(tmp_path / "merges.txt"), progress=False)
    hf = transformers.GPT2TokenizerFast.from_pretrained(str(tmp_path))
    assert tokens_of(tmp_path / "g").tolist() == hf((corpus / "f1.txt").read_text())["input_ids"]
    assert info["tokenizer_kind"] in ("bpe", "gpt2")


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(kind="bpe"), "--tokenizer bpe needs --vocab-size N"),
    (dict(kind="gpt2"), "--tokenizer gpt2 needs --vocab vocab.json and --merges merges.txt"),
    (dict(kind="sentencepiece"), "--tokenizer 'sentencepiece' is not one of bytes, bpe, gpt2"),
    (dict(fmt="parquet"), "--format 'parquet' is not one of bin, hdf5"),
    (dict(kind="bytes", vocab_size=100), "--vocab-size applies to --tokenizer bpe"),
])
def test_bad_arguments(corpus, tmp_path, kwargs, fragment):
    with pytest.raises(HpcparError, match=fragment):
        prepare.prepare([str(corpus)], str(tmp_path / "x"), progress=False, **kwargs)


def test_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare.prepare([str(tmp_path / "nope")], str(tmp_path / "x"), progress=False)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="hold no text"):
        prepare.prepare([str(tmp_path / "empty.txt")], str(tmp_path / "x"), progress=False)
    assert not (tmp_path / "x" / "tokens.bin").exists()
    writer = prepare._Writer(str(tmp_path), "bin", np.dtype("uint16"))
    with pytest.raises(HpcparError, match="token id 70000 does not fit --token-dtype uint16; use uint32"):
        writer.write([1, 70000])
    writer.close(ok=False)
    assert not list(tmp_path.glob("*.partial"))
