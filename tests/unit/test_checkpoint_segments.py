"""Format v2 rank files: contiguous blocks written and read near the disk, checked per segment
of rows (`checksum_rows`, `checksums`); reads that cut segments; format v1 still loads.

Segments are made 3 rows long here (`_SEGMENT_BYTES` patched) so small tensors have many."""

import json
import os

import h5py
import numpy as np
import pytest

from hpcpar.checkpoint import format as checkpoint_format
from hpcpar.checkpoint.format import INDEX, LIBVER, MANIFEST, checksum, chunk_shape, crc32
from hpcpar.checkpoint.load import load
from hpcpar.checkpoint.save import save as save_checkpoint
from hpcpar.checkpoint.tools import verify
from hpcpar.errors import CheckpointError
from hpcpar.layout import Layout
from hpcpar.runtime.comm import Communicator

COMM = Communicator.local()


@pytest.fixture
def small_segments(monkeypatch):
    monkeypatch.setattr(checkpoint_format, "_SEGMENT_BYTES", 3 * 8 * 8)  # 3 rows of a [*, 8] float64 block


def reference():
    rng = np.random.default_rng(11)
    return {
        "model/w": rng.standard_normal((20, 8)),                      # 7 segments of 3 rows (the last 2)
        "model/u": rng.standard_normal((7, 3, 4)).astype(np.float32),  # rows of 48 bytes: 4 per segment
        "model/v": rng.standard_normal(7).astype(np.float32),         # 1-D: a row is an element
        "optim/n": np.array(3, dtype=np.int64),                       # a scalar: one row
        "optim/e": np.zeros((0, 8)),                                  # empty: no segments
    }


def save(tmp_path, glob, **kw):
    return save_checkpoint(str(tmp_path), 1, {n: (a, Layout.replicated(a.shape)) for n, a in glob.items()}, {}, COMM, **kw)


def test_rank_file_blocks_are_contiguous_with_a_checksum_per_segment(tmp_path, small_segments):
    glob = reference()
    path = save(tmp_path, glob)
    with open(os.path.join(path, MANIFEST)) as f:
        tensors = json.load(f)["tensors"]
    with h5py.File(os.path.join(path, "rank-00000.h5"), "r") as f:
        for name, rows, segments in (("model/w", 3, 7), ("model/u", 4, 2), ("model/v", 7, 1), ("optim/n", 1, 1),
                                     ("optim/e", 1, 0)):
            ds, block = f[f"{name}/block-0"], tensors[name]["blocks"][0]
            assert ds.chunks is None and not ds.fletcher32 and ds.id.get_offset() == block["offset"]
            assert block["checksum_rows"] == rows and len(block["checksums"]) == 8 * segments, name
            assert np.array_equal(ds[()], glob[name])  # plain h5py reads what pwrite wrote


@pytest.mark.parametrize("name,dim,count,groups", [
    ("model/w", 0, 2, 1),   # rows 0-9, 10-19: cut segment 3 (rows 9-11)
    ("model/w", 0, 4, 1),   # 5 rows each
    ("model/w", 0, 2, 2),   # two groups of rows per rank
    ("model/w", 1, 2, 1),   # columns: every segment through scratch
    ("model/u", 1, 3, 1),
    ("model/u", 2, 2, 1),
    ("model/v", 0, 7, 1),
])
def test_reads_that_cut_segments_are_bitwise(tmp_path, small_segments, name, dim, count, groups):
    glob = reference()
    path = save(tmp_path, glob)
    for index in range(count):
        layout = Layout.split(glob[name].shape, dim, index, count, groups)
        got, _ = load(path, {name: layout}, COMM)
        assert np.array_equal(got[name], layout.take(glob[name])), (index, layout)


def test_flat_and_padded_layouts_and_strided_sources(tmp_path, small_segments):
    glob = reference()
    w = glob["model/w"]
    # Saved from strided arrays (Fortran order, a column window of a wider array): written a
    # segment at a time through a contiguous copy of the segment.
    wide = np.zeros((20, 12))
    wide[:, 2:10] = w
    path = save_checkpoint(str(tmp_path), 1, {"model/w": (wide[:, 2:10], Layout.replicated(w.shape)),
                                      "model/u": (np.asfortranarray(glob["model/u"]), Layout.replicated((7, 3, 4)))},
                   {}, COMM)
    whole = Layout.replicated(w.shape)
    for lay in (whole.flat_range(13, 150), whole.flat_range(0, 160), Layout.split_padded(w.shape, 0, 2, 3),
                Layout.split_padded(w.shape, 0, 2, 3).flat_range(5, 56)):
        got, _ = load(path, {"model/w": lay}, COMM)
        assert np.array_equal(got["model/w"], lay.take(w)), lay
    got, _ = load(path, {"model/u": Layout.replicated((7, 3, 4))}, COMM)
    assert np.array_equal(got["model/u"], glob["model/u"])


def flip(path, dataset, byte):
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset + byte)
        old = f.read(1)
        f.seek(offset + byte)
        f.write(bytes([old[0] ^ 0x01]))


def test_flipped_byte_names_the_rows_and_other_rows_still_load(tmp_path, small_segments):
    glob = reference()
    path = save(tmp_path, glob)
    rank_file = os.path.join(path, "rank-00000.h5")
    flip(rank_file, "model/w/block-0", 7 * 64 + 5)  # row 7: segment 2 (rows 6-8)
    with pytest.raises(CheckpointError, match=r"rank-00000\.h5: cannot read tensor model/w \(dataset "
                                              r"model/w/block-0\): corrupt data \(rows 6-8 of 20"):
        load(path, {"model/w": Layout.replicated((20, 8))}, COMM)
    # A layout that needs rows 0-4 only reads segments 0 and 1: unaffected.
    first = Layout.split((20, 8), 0, 0, 4)
    got, _ = load(path, {"model/w": first}, COMM)
    assert np.array_equal(got["model/w"], first.take(glob["model/w"]))
    problems = verify(path)
    assert len(problems) == 1 and "rank-00000.h5" in problems[0] and "model/w" in problems[0] \
        and "rows 6-8" in problems[0], problems


def test_checksum_catches_every_flipped_byte_and_a_swapped_page():
    data = np.random.default_rng(2).integers(0, 256, 3 * 4096 + 13, dtype=np.uint8)
    base = checksum(data)
    for i in range(0, data.size, 7):
        damaged = data.copy()
        damaged[i] ^= 0xFF
        assert checksum(damaged) != base, i
    swapped = np.concatenate([data[4096:8192], data[:4096], data[8192:]])
    assert checksum(swapped) != base
    assert checksum(data[1:]) != checksum(data[:-1])  # an unaligned start reads the same bytes


def downgrade_to_v1(path):
    """Rewrite a checkpoint's rank files as format v1 wrote them: chunked + fletcher32, crc32 on
    scalars and empty blocks; the manifest as v1 wrote it."""
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    for file in manifest["files"]:
        if file == INDEX:
            continue
        full = os.path.join(path, file)
        blocks = {}

        def keep(name, obj):  # returns None: visititems goes on
            if isinstance(obj, h5py.Dataset):
                blocks[name] = (obj[()], obj.attrs["tensor"], obj.attrs["global_region"])
        with h5py.File(full, "r") as f:
            f.visititems(keep)
        with h5py.File(full, "w", libver=LIBVER) as f:
            for name, (data, tensor, region) in blocks.items():
                chunks = chunk_shape(data.shape, data.dtype.itemsize)
                ds = f.create_dataset(name, data=data, chunks=chunks, fletcher32=chunks is not None)
                ds.attrs["tensor"], ds.attrs["global_region"] = tensor, region
                if chunks is None:
                    ds.attrs["crc32"] = crc32(data)
        manifest["files"][file]["size"] = os.path.getsize(full)
    for t in manifest["tensors"].values():  # v1 had no extents, and no sha256 of the manifest
        for b in t["blocks"]:
            for key in ("offset", "checksum_rows", "checksums"):
                del b[key]
    del manifest["sha256"]
    manifest["format_version"] = manifest["meta"]["format_version"] = 1
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)


def test_format_v1_checkpoints_still_load_and_verify(tmp_path):
    glob = reference()
    path = save(tmp_path, glob)
    downgrade_to_v1(path)
    with h5py.File(os.path.join(path, "rank-00000.h5"), "r") as f:
        assert f["model/w/block-0"].fletcher32
    wanted = {n: Layout.replicated(a.shape) for n, a in glob.items()}
    got, _ = load(path, wanted, COMM)
    assert all(got[n].dtype == a.dtype and np.array_equal(got[n], a) for n, a in glob.items())
    split = Layout.split((20, 8), 1, 1, 2)
    got, _ = load(path, {"model/w": split}, COMM)
    assert np.array_equal(got["model/w"], split.take(glob["model/w"]))
    assert verify(path) == []
    rank_file = os.path.join(path, "rank-00000.h5")
    with h5py.File(rank_file, "r") as f:
        offset = f["model/w/block-0"].id.get_chunk_info(0).byte_offset
    with open(rank_file, "r+b") as f:
        f.seek(offset + 9)
        old = f.read(1)
        f.seek(offset + 9)
        f.write(bytes([old[0] ^ 0x01]))
    with pytest.raises(CheckpointError, match=r"rank-00000\.h5: cannot read tensor model/w"):
        load(path, {"model/w": Layout.replicated((20, 8))}, COMM)
    assert len(verify(path)) == 1


def test_newer_format_is_refused_in_one_line(tmp_path):
    path = save(tmp_path, reference())
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    manifest["format_version"] = 3
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointError, match=r"format hpcpar-checkpoint v3, expected hpcpar-checkpoint v1 or v2") \
            as err:
        load(path, {}, COMM)
    assert "\n" not in str(err.value)


def test_saves_with_the_same_assignment_reuse_the_index_with_their_own_meta(tmp_path):
    """The index of an assignment already saved is copied with the new meta (`writers.index_bytes`)."""
    for step, seed in ((1, 3), (2, 4)):
        glob = {n: np.random.default_rng(seed).standard_normal(a.shape).astype(a.dtype) for n, a in reference().items()}
        path = save_checkpoint(str(tmp_path), step, {n: (a, Layout.replicated(a.shape)) for n, a in glob.items()},
                       {"seed": seed}, COMM, keep=None)
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        with h5py.File(os.path.join(path, INDEX), "r") as f:
            assert json.loads(f.attrs["meta"]) == manifest["meta"] and manifest["meta"]["seed"] == seed
            assert all(np.array_equal(f[n][()], a) for n, a in glob.items())
    assert verify(path) == []
