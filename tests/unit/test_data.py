"""Byte corpus loading, splitting and layout-independent batch sampling."""

from __future__ import annotations

import os
import pathlib
import sysconfig

import numpy as np
import pytest

from hpcpar.data import corpus as data
from hpcpar.errors import DataError

T = 16


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=5000).astype(np.uint8)


# ---------------------------------------------------------------------------- corpus


def test_default_corpus_is_the_stdlib_source():
    tok = data.load_corpus()
    assert tok.dtype == np.uint8 and tok.ndim == 1
    assert 2**20 < len(tok) <= data.DEFAULT_CORPUS_CAP
    # Rebuild it independently: *.py under stdlib, no site-packages/tests, sorted relative paths.
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = sorted((p for p in root.rglob("*.py")
                    if p.is_file() and not skip & set(p.relative_to(root).parts[:-1])
                    and not any(part.startswith(".") for part in p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    expected = b"".join(p.read_bytes() + b"\n" for p in files)[:data.DEFAULT_CORPUS_CAP]
    assert tok.tobytes() == expected
    assert b"def " in tok[:100_000].tobytes()


def test_default_corpus_is_deterministic_and_cached(monkeypatch):
    first = data.load_corpus()
    assert data.load_corpus() is first  # cached per process
    assert not first.flags.writeable    # nobody can corrupt the shared cache
    monkeypatch.setattr(data, "_default_cache", None)
    again = data.load_corpus("")
    assert again is not first and np.array_equal(again, first)


def test_default_corpus_is_capped(monkeypatch):
    monkeypatch.setattr(data, "_default_cache", None)
    monkeypatch.setattr(data, "DEFAULT_CORPUS_CAP", 100_000)
    capped = data.load_corpus()
    monkeypatch.setattr(data, "_default_cache", None)
    monkeypatch.setattr(data, "DEFAULT_CORPUS_CAP", 16 * 2**20)
    assert len(capped) == 100_000
    assert np.array_equal(capped, data.load_corpus()[:100_000])


def test_text_file_is_read_as_bytes(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes("héllo\nworld".encode())
    tok = data.load_corpus(str(f))
    assert tok.tobytes() == "héllo\nworld".encode()
    assert data.load_corpus(f).tobytes() == tok.tobytes()  # PathLike too


def test_directory_is_read_recursively_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"BZ")
    (tmp_path / "b" / "a.txt").write_bytes(b"BA")
    (tmp_path / "a.txt").write_bytes(b"A")
    (tmp_path / "c.txt").write_bytes(b"C")
    (tmp_path / ".hidden").write_bytes(b"H")
    os.mkfifo(tmp_path / "pipe")  # not a regular file: skipped, and reading it would block
    tok = data.load_corpus(str(tmp_path))
    assert tok.tobytes() == b"A\nBA\nBZ\nC\n"


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        data.load_corpus(str(tmp_path / "nope.txt"))


def test_empty_file_and_empty_directory(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="no bytes"):
        data.load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="no bytes"):
        data.load_corpus(str(tmp_path / "d"))
    (tmp_path / "d" / "e.txt").write_bytes(b"")  # only empty files: still nothing to train on
    with pytest.raises(DataError, match="no bytes"):
        data.load_corpus(str(tmp_path / "d"))


def test_path_that_is_neither_file_nor_directory(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(DataError, match="neither a regular file nor a directory"):
        data.load_corpus(str(tmp_path / "pipe"))


def test_unreadable_file(tmp_path, monkeypatch):
    f = tmp_path / "t.txt"
    f.write_bytes(b"abc")

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(f))

    # Root reads through chmod 000, so simulate the failure where the module opens files.
    monkeypatch.setattr(data, "open", denied, raising=False)
    with pytest.raises(DataError, match="cannot read corpus file .*Permission denied"):
        data.load_corpus(str(f))


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read a mode-000 file")
def test_unreadable_file_by_mode(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"abc")
    f.chmod(0)
    with pytest.raises(DataError, match="cannot read"):
        data.load_corpus(str(f))


def test_non_utf8_names_are_reported_printably(tmp_path):
    bad = os.path.join(os.fsencode(tmp_path), b"bad\xff.txt")
    try:
        with open(bad, "wb") as f:
            f.write(b"text")
    except OSError:
        pytest.skip("file system refuses non-UTF-8 names")
    for path in (str(tmp_path), os.fsdecode(bad)):  # found in a directory, and given directly
        with pytest.raises(DataError, match="not valid UTF-8") as info:
            data.load_corpus(path)
        message = str(info.value)
        message.encode("utf-8")  # printable: no lone surrogates
        assert "bad\\udcff.txt" in message and "\n" not in message


def test_corpus_description(tmp_path):
    assert "standard library" in data.corpus_description("")
    f = tmp_path / "t.txt"
    f.write_bytes(b"abc")
    desc = data.corpus_description(str(f), data.load_corpus(str(f)))
    assert "t.txt" in desc and "3 bytes" in desc
    assert "directory" in data.corpus_description(str(tmp_path))


# ----------------------------------------------------------------------------- split


def test_split_is_contiguous_with_val_last(tokens):
    train, val = data.split(tokens, 0.1)
    assert len(val) == 500 and len(train) == 4500
    assert np.array_equal(np.concatenate([train, val]), tokens)
    train, val = data.split(tokens, 0.0)
    assert len(val) == 0 and np.array_equal(train, tokens)
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(DataError, match="val_fraction"):
            data.split(tokens, bad)


def test_split_too_short_for_block_size(tokens):
    train, val = data.split(tokens[:100], 0.1)  # 10 validation tokens
    with pytest.raises(DataError, match="validation split has 10 tokens"):
        data.get_eval_batch(val, 0, 0, range(2), T)
    with pytest.raises(DataError, match="training split has 90 tokens"):
        data.get_batch(train, 0, 0, range(2), 90)
    data.get_batch(train, 0, 0, range(2), 89)  # exactly block_size + 1 tokens is enough


# ---------------------------------------------------------------------------- batches


def offsets_of(tokens: np.ndarray, x: np.ndarray) -> list[int]:
    """The start offset of each row of x in tokens (random tokens: unique)."""
    windows = np.lib.stride_tricks.sliding_window_view(tokens, x.shape[1])
    found = []
    for row in x:
        (hits,) = np.nonzero((windows == row).all(axis=1))
        assert len(hits) == 1
        found.append(int(hits[0]))
    return found


def test_batch_shapes_dtypes_and_shift(tokens):
    x, y = data.get_batch(tokens, 3, 7, range(8), T)
    assert x.shape == y.shape == (8, T)
    assert x.dtype == y.dtype == np.int64
    assert x.flags.c_contiguous and y.flags.c_contiguous
    for row_x, row_y, o in zip(x, y, offsets_of(tokens, x)):
        assert np.array_equal(row_x, tokens[o:o + T])
        assert np.array_equal(row_y, tokens[o + 1:o + T + 1])


def test_sample_depends_only_on_seed_step_and_id(tokens):
    ids = [0, 1, 2, 3, 4, 5, 6, 7]
    x, y = data.get_batch(tokens, 11, 4, ids, T)
    data.get_batch(tokens, 11, 9, range(3), T)  # other calls in between change nothing
    for k in ids:
        xk, yk = data.get_batch(tokens, 11, 4, [k], T)
        assert np.array_equal(xk[0], x[k]) and np.array_equal(yk[0], y[k])
    xr, _ = data.get_batch(tokens, 11, 4, ids[::-1], T)
    assert np.array_equal(xr, x[::-1])
    xs, _ = data.get_batch(tokens, 11, 4, np.array([5, 100, 2]), T)
    assert np.array_equal(xs[0], x[5]) and np.array_equal(xs[2], x[2])
    assert np.array_equal(data.get_batch(tokens, 11, 4, ids, T)[0], x)  # deterministic


def test_samples_differ_across_steps_seeds_ids_and_streams(tokens):
    base = data.get_batch(tokens, 1, 1, range(8), T)[0]
    assert len(set(offsets_of(tokens, base))) > 1
    for other in (data.get_batch(tokens, 1, 2, range(8), T)[0],
                  data.get_batch(tokens, 2, 1, range(8), T)[0],
                  data.get_batch(tokens, 1, 1, range(8, 16), T)[0],
                  data.get_eval_batch(tokens, 1, 1, range(8), T)[0]):
        assert not np.array_equal(other, base)


def test_offsets_cover_the_whole_range_uniformly():
    # len - T = 4 possible starts; every one must appear, none past the end, roughly equally.
    tok = np.arange(T + 4, dtype=np.uint8)
    starts = np.concatenate([data.get_batch(tok, 5, s, range(1000), T)[0][:, 0] for s in range(8)])
    counts = np.bincount(starts, minlength=4)
    assert len(counts) == 4
    chi2 = float(((counts - 2000.0) ** 2 / 2000.0).sum())
    assert chi2 < 20.0  # 3 degrees of freedom: p < 2e-4 for a fair sampler
    edge = np.arange(T + 1, dtype=np.uint8)  # exactly one window fits
    x, y = data.get_batch(edge, 0, 0, range(5), T)
    assert (x == edge[:T]).all() and (y == edge[1:]).all()


def test_bad_batch_arguments(tokens):
    for args in ((-1, 0, range(2), T), (0, -1, range(2), T), (0, 0, [-1], T), (0, 0, range(2), 0)):
        with pytest.raises(DataError):
            data.get_batch(tokens, *args)


# ------------------------------------------------------------------- distributed rule


@pytest.mark.parametrize("dp,mbs,micro", [(1, 8, 1), (2, 2, 2), (4, 1, 2), (3, 2, 3)])
def test_microbatch_ids_partition_the_global_batch(dp, mbs, micro):
    ids = [list(data.microbatch_sample_ids(d, dp, mbs, j)) for d in range(dp) for j in range(micro)]
    flat = sorted(i for chunk in ids for i in chunk)
    assert flat == list(range(dp * mbs * micro))
    for d in range(dp):
        for j in range(micro):
            assert data.microbatch_sample_ids(d, dp, mbs, j) == range((j * dp + d) * mbs, (j * dp + d + 1) * mbs)


def test_global_batch_is_the_same_on_any_mesh(tokens):
    global_ids = range(8)
    reference = data.get_batch(tokens, 7, 3, global_ids, T)[0]
    for dp, mbs, micro in ((2, 2, 2), (4, 1, 2), (8, 1, 1), (1, 4, 2)):
        rows = {}
        for d in range(dp):
            for j in range(micro):
                ids = data.microbatch_sample_ids(d, dp, mbs, j)
                for k, row in zip(ids, data.get_batch(tokens, 7, 3, ids, T)[0]):
                    rows[k] = row
        assert np.array_equal(np.stack([rows[k] for k in global_ids]), reference)


def test_microbatch_ids_reject_bad_arguments():
    for args in ((2, 2, 1, 0), (-1, 2, 1, 0), (0, 0, 1, 0), (0, 2, 0, 0), (0, 2, 1, -1)):
        with pytest.raises(DataError):
            data.microbatch_sample_ids(*args)
