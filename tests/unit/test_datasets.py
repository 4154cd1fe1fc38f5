"""Token datasets: bin and hdf5 give the batches of the same bytes; records, scans and one-line errors."""

from __future__ import annotations

import dataclasses
import json
import re

import h5py
import numpy as np
import pytest

from hpcpar.data import corpus as data, formats as datasets, tokenizer
from hpcpar.config.sections import DataConfig
from hpcpar.errors import ConfigError, DataError

T = 16
BYTES = np.random.default_rng(0).integers(0, 256, size=5000).astype(np.uint8)


def cfg(corpus, fmt="bin", **kw) -> DataConfig:
    return DataConfig(corpus=str(corpus), format=fmt, **kw)


def write_bin(path, tokens, dtype="uint16"):
    np.asarray(tokens).astype(dtype).tofile(path)
    return path


def write_h5(path, datasets_: dict):
    with h5py.File(path, "w") as f:
        for name, tokens in datasets_.items():
            f[name] = np.asarray(tokens)
    return path


@pytest.fixture
def three(tmp_path):
    """The same tokens as a text file, a bin file and an HDF5 dataset."""
    (tmp_path / "text.txt").write_bytes(BYTES.tobytes())
    write_bin(tmp_path / "tok.bin", BYTES)
    write_h5(tmp_path / "tok.h5", {"tokens": BYTES.astype(np.uint32)})
    return {"bytes": tmp_path / "text.txt", "bin": tmp_path / "tok.bin", "hdf5": tmp_path / "tok.h5"}


def test_every_format_gives_the_same_split_and_batches(three):
    loaded = {fmt: datasets.load(cfg(path, fmt, val_fraction=0.1), 256) for fmt, path in three.items()}
    ref = loaded["bytes"]
    for fmt, d in loaded.items():
        assert len(d.train) == 4500 and len(d.val) == 500, fmt
        for step in (0, 7):
            x, y = data.get_batch(d.train, 3, step, range(8), T)
            rx, ry = data.get_batch(ref.train, 3, step, range(8), T)
            assert x.dtype == np.int64 and np.array_equal(x, rx) and np.array_equal(y, ry), fmt
        assert np.array_equal(data.get_eval_batch(d.val, 3, 1, range(4), T)[0],
                              data.get_eval_batch(ref.val, 3, 1, range(4), T)[0])
    assert isinstance(loaded["bin"].train, np.memmap)            # mapped, not read
    assert isinstance(loaded["hdf5"].train, datasets.HDF5Tokens)  # read by hyperslab
    assert "bin" in loaded["bin"].description and "5,000 tokens" in loaded["bin"].description


def test_hdf5_tokens_index_like_numpy(tmp_path):
    arr = np.arange(100_000, dtype=np.uint32) * 7 % 50_000
    ds = h5py.File(write_h5(tmp_path / "a.h5", {"tokens": arr}), "r")["tokens"]
    tok = datasets.HDF5Tokens(ds)
    view = tok[1000:90_000]
    assert len(view) == 89_000 and len(tok[5:3]) == 0
    idx = np.array([[0, 1, 2], [88_999, 5, 5], [40_000, 40_001, 70_000]])
    assert np.array_equal(view[idx], arr[1000:90_000][idx]) and view[idx].dtype == np.uint32
    assert np.array_equal(np.asarray(view[:10]), arr[1000:1010])
    with pytest.raises(IndexError):
        view[np.array([89_000])]


def test_windows_batch_covers_the_sequence_once():
    tokens = np.arange(50)
    x, y = data.get_window_batch(tokens, [0, 1, 2, 3, 7], 10, 4)
    assert np.array_equal(x[2], np.arange(20, 30)) and np.array_equal(y[2], np.arange(21, 31))
    assert (x[4] == 0).all() and (y[4] == -100).all()           # past the last window: ignored
    xp, yp = data.get_window_batch(tokens, [0, 1, 2, 3, 7], 10, 4, positions=np.array([1, 8]))
    assert np.array_equal(xp, x[:, [1, 8]]) and np.array_equal(yp, y[:, [1, 8]])   # a cp rank's columns
    with pytest.raises(DataError, match="need 51 tokens"):
        data.get_window_batch(tokens, [0], 10, 5)


def test_prepared_records_replace_the_scan(tmp_path, monkeypatch):
    write_bin(tmp_path / "tokens.bin", BYTES)
    datasets.write_meta(str(tmp_path), {"tokens.bin": {"tokens": 5000, "dtype": "uint16", "max_id": 255}}, None)
    monkeypatch.setattr(datasets, "scan_range", lambda *a, **k: pytest.fail("scanned despite meta.json"))
    d = datasets.load(cfg(tmp_path), 256)
    assert d.sources[0].max_id == 255 and d.tokenizer is None
    with pytest.raises(DataError, match="holds token id 255, but model.vocab_size=200"):
        datasets.load(cfg(tmp_path), 200)


def test_without_records_the_ids_are_scanned_in_parts(tmp_path, monkeypatch):
    tokens = np.zeros(10_000, dtype=np.uint16)
    tokens[7777] = 300
    write_bin(tmp_path / "t.bin", tokens)
    monkeypatch.setattr(datasets, "SCAN_CHUNK", 1000)
    with pytest.raises(DataError, match="holds token id 300, but model.vocab_size=256; set model.vocab_size >= 301"):
        datasets.load(cfg(tmp_path / "t.bin"), 256)
    assert datasets.load(cfg(tmp_path / "t.bin"), 301).sources[0].max_id == 300
    mm = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")
    parts = [datasets.scan_range(mm, p, 3, chunk=1000) for p in range(3)]
    assert max(hi for _, hi in parts) == 300 and [hi for _, hi in parts].count(300) == 1   # chunk 7 on part 1
    assert datasets.scan_range(mm, 20, 30, chunk=1000) == (0, -1)                         # no chunk for this part


class Ranks:
    """A stand-in communicator: rank `rank` of `size`, all_reduce = max with the other parts' values."""

    def __init__(self, rank, size, others):
        self.rank, self.size, self.others = rank, size, others

    def all_reduce(self, a, op):
        assert op == "max"
        return np.maximum(a, self.others)


def test_scan_is_shared_over_ranks(tmp_path, monkeypatch):
    tokens = np.zeros(10_000, dtype=np.uint16)
    tokens[9500] = 999      # in chunk 9: rank 1 of 2 reads it, rank 0 never does
    write_bin(tmp_path / "t.bin", tokens)
    monkeypatch.setattr(datasets, "SCAN_CHUNK", 1000)
    other = np.array([0, 999], dtype=np.int64)     # what rank 1 found: (-min, max)
    with pytest.raises(DataError, match="token id 999"):
        datasets.load(cfg(tmp_path / "t.bin"), 256, comm=Ranks(0, 2, other))


def test_signed_hdf5_with_negative_ids(tmp_path):
    write_h5(tmp_path / "n.h5", {"tokens": np.array([1, 2, -3, 4] * 10, dtype=np.int32)})
    with pytest.raises(DataError, match="negative token id"):
        datasets.load(cfg(tmp_path / "n.h5", "hdf5"), 256)


def test_nanogpt_directory_and_hdf5_train_val(tmp_path):
    write_bin(tmp_path / "train.bin", BYTES[:4000])
    write_bin(tmp_path / "val.bin", BYTES[4000:])
    d = datasets.load(cfg(tmp_path), 256)
    assert len(d.train) == 4000 and np.array_equal(np.asarray(d.val), BYTES[4000:])
    write_h5(tmp_path / "tv.h5", {"train": BYTES[:4500], "val": BYTES[4500:]})
    d = datasets.load(cfg(tmp_path / "tv.h5", "hdf5"), 256)
    assert len(d.train) == 4500 and len(d.val) == 500
    (tmp_path / "only").mkdir()
    write_bin(tmp_path / "only" / "train.bin", BYTES)
    d = datasets.load(cfg(tmp_path / "only", val_fraction=0.1), 256)   # no val.bin: split like bytes
    assert len(d.train) == 4500


def test_tokenizer_beside_the_data_is_recorded_and_checked(tmp_path):
    write_bin(tmp_path / "tokens.bin", BYTES)
    (tmp_path / "tokenizer.json").write_text(tokenizer.BYTES_JSON)
    assert datasets.load(cfg(tmp_path), 256).tokenizer == tokenizer.BYTES_RECORD
    with pytest.raises(ConfigError, match="model.vocab_size=100 is smaller than the 256 ids of the tokenizer"):
        datasets.load(cfg(tmp_path), 100)


@pytest.mark.parametrize("setup, config, fragment", [
    (lambda p: (p / "odd.bin").write_bytes(b"\x01\x00\x02"), dict(corpus="odd.bin"),
     "is 3 bytes, not a whole number of uint16 tokens (2 bytes each): truncated"),
    (lambda p: (p / "e.bin").write_bytes(b""), dict(corpus="e.bin"), "is empty"),
    (lambda p: None, dict(corpus="nope.bin"), "does not exist"),
    (lambda p: None, dict(corpus=""), 'data.format="bin" needs data.corpus'),
    (lambda p: (p / "d").mkdir(), dict(corpus="d"), "holds neither tokens.bin nor train.bin"),
    (lambda p: (p / "x.h5").write_bytes(b"not hdf5"), dict(corpus="x.h5", format="hdf5"), "cannot read HDF5 file"),
    (lambda p: write_h5(p / "y.h5", {"other": BYTES}), dict(corpus="y.h5", format="hdf5"),
     "has no dataset 'tokens' (nor 'train'/'val'); it holds 'other'"),
    (lambda p: write_h5(p / "z.h5", {"tokens": np.zeros((4, 4), np.uint16)}), dict(corpus="z.h5", format="hdf5"),
     "must be 1-D integer tokens"),
    (lambda p: write_h5(p / "f.h5", {"tokens": np.zeros(8, np.float32)}), dict(corpus="f.h5", format="hdf5"),
     "must be 1-D integer tokens"),
])
def test_bad_token_files_are_one_line_errors(tmp_path, setup, config, fragment):
    setup(tmp_path)
    c = dataclasses.replace(cfg("", config.get("format", "bin")),
                            corpus=str(tmp_path / config["corpus"]) if config["corpus"] else "")
    with pytest.raises((DataError, ConfigError), match=re.escape(fragment)) as info:
        datasets.load(c, 256)
    assert "\n" not in str(info.value)


def test_records_that_no_longer_match_the_file(tmp_path):
    write_bin(tmp_path / "tokens.bin", BYTES)
    for entry, fragment in (({"tokens": 6000, "dtype": "uint16", "max_id": 255},
                             "holds 5,000 tokens but .*meta.json says 6,000: truncated or replaced"),
                            ({"tokens": 2500, "dtype": "uint32", "max_id": 255},
                             "is read as uint16 tokens but .*says uint32; set data.token_dtype=uint32")):
        datasets.write_meta(str(tmp_path), {"tokens.bin": entry}, None)
        with pytest.raises(DataError, match=fragment):
            datasets.load(cfg(tmp_path), 256)
    (tmp_path / "meta.json").write_text(json.dumps({"format": "something else"}))
    datasets.load(cfg(tmp_path), 256)           # not ours: ignored, the file is scanned
