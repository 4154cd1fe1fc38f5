"""Checkpoint format, integrity and commit protocol in one process (comm = COMM_SELF)."""

import json
import os

import h5py
import numpy as np
import pytest

from hpcpar.checkpoint import load as loading
from hpcpar.checkpoint.directory import latest, pointer
from hpcpar.checkpoint.format import FORMAT_VERSION, INDEX, MANIFEST
from hpcpar.checkpoint.load import load
from hpcpar.checkpoint.save import save
from hpcpar.checkpoint.tools import info, verify
from hpcpar.checkpoint.writers import assign_writers
from hpcpar.cli.ckpt import checkpoint_tool
from hpcpar.errors import CheckpointError
from hpcpar.layout import Layout, bounds
from hpcpar.runtime.comm import Communicator

COMM = Communicator.local()


def reference(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "model/transformer.wte.weight": rng.standard_normal((16, 8)),
        "model/transformer.h.0.attn.c_attn.weight": rng.standard_normal((24, 8)),  # [3C, C]
        "model/transformer.ln_f.bias": rng.standard_normal(8).astype(np.float32),
        "optim/transformer.wte.weight/exp_avg": rng.standard_normal((16, 8)),
        "optim/step": np.array(7, dtype=np.int64),
    }


def replicated(glob):
    return {name: (a, Layout.replicated(a.shape)) for name, a in glob.items()}


def save_ref(tmp_path, step=1, seed=0, **kw):
    glob = reference(seed)
    path = save(str(tmp_path), step, replicated(glob), {"note": "unit", "mesh": {"dp": 1}}, COMM, **kw)
    return glob, path


def test_round_trip_replicated_and_meta(tmp_path):
    glob, path = save_ref(tmp_path, step=12)
    assert path == str(tmp_path / "step-0000012")
    got, meta = load(str(tmp_path), {n: Layout.replicated(a.shape) for n, a in glob.items()}, COMM)
    for name, a in glob.items():
        assert got[name].dtype == a.dtype
        assert np.array_equal(got[name], a), name
    assert meta["step"] == 12 and meta["note"] == "unit" and meta["mesh"] == {"dp": 1}
    assert meta["world_size"] == 1 and meta["format_version"] == FORMAT_VERSION and meta["timestamp"]


@pytest.mark.parametrize("dim,count,groups", [(0, 2, 1), (1, 4, 1), (0, 2, 3), (1, 2, 1)])
def test_load_any_split(tmp_path, dim, count, groups):
    glob, path = save_ref(tmp_path)
    name = "model/transformer.h.0.attn.c_attn.weight"
    for index in range(count):
        layout = Layout.split(glob[name].shape, dim, index, count, groups)
        got, _ = load(path, {name: layout}, COMM)
        assert np.array_equal(got[name], layout.take(glob[name]))


def test_flat_shards_save_and_load_any_layout(tmp_path):
    """ZeRO shards (flat ranges of a parameter, `Layout.flat_range`) written by "ranks" of a
    partition give the global tensor; any layout, flat or not, loads from it and back."""
    glob = reference(3)["model/transformer.h.0.attn.c_attn.weight"]  # [24, 8]
    name = "model/transformer.h.0.attn.c_attn.weight"
    parent = Layout.split(glob.shape, 0, 1, 2, groups=3)  # a tp rank's q, k, v rows: [12, 8]
    cuts = [0, 13, 50, 51, 96]  # four "dp ranks", ranges that cut rows
    shards = [parent.flat_range(lo, hi) for lo, hi in zip(cuts, cuts[1:])]
    holdings = [{name: (glob.shape, glob.dtype.str, [tuple((s.start, s.stop) for s in b.glob) for b in lay.blocks])}
                for lay in shards]
    holdings.append({name: (glob.shape, glob.dtype.str, [tuple((s.start, s.stop) for s in b.glob)
                                                        for b in Layout.split(glob.shape, 0, 0, 2, groups=3).blocks])})
    assert assign_writers(holdings)[name].blocks  # tiles the tensor; no partial overlap
    other = Layout.split(glob.shape, 0, 0, 2, groups=3)
    whole = {name: (glob, Layout.replicated(glob.shape))}
    path = save(str(tmp_path / "a"), 1, whole, {}, COMM)
    for lay in shards:
        got, _ = load(path, {name: lay}, COMM)
        assert np.array_equal(got[name], lay.take(glob))
    # Saved from flat blocks (one process holds them all: a flat range of the whole tensor cut
    # into q, k and v pieces), it reads back as the global tensor.
    flat = Layout.split(glob.shape, 0, 0, 1, groups=3).flat_range(0, glob.size)
    assert len(flat.blocks) == 3
    path2 = save(str(tmp_path / "b"), 1, {name: (flat.take(glob), flat)}, {}, COMM)
    got, _ = load(path2, {name: other}, COMM)
    assert np.array_equal(got[name], other.take(glob))


def test_index_reads_global_tensors_with_plain_h5py(tmp_path):
    glob, path = save_ref(tmp_path)
    with h5py.File(os.path.join(path, INDEX), "r") as f:
        for name, a in glob.items():
            ds = f[name]
            assert ds.is_virtual
            assert np.array_equal(ds[()], a)
            assert tuple(ds.attrs["global_shape"]) == a.shape
            assert ds.attrs["dtype"] == a.dtype.str
            blocks = json.loads(ds.attrs["sharding"])
            assert blocks[0]["file"] == "rank-00000.h5"
        assert json.loads(f.attrs["meta"])["note"] == "unit"
    with h5py.File(os.path.join(path, "rank-00000.h5"), "r") as f:
        # Format v2: contiguous (plain h5py reads the block) where the manifest says, with one
        # checksum per ~1 MiB of rows.
        ds = f["model/transformer.wte.weight/block-0"]
        assert ds.chunks is None and np.array_equal(ds[()], glob["model/transformer.wte.weight"])
        offset = ds.id.get_offset()
    with open(os.path.join(path, MANIFEST)) as f:
        block = json.load(f)["tensors"]["model/transformer.wte.weight"]["blocks"][0]
    assert block["offset"] == offset and block["checksum_rows"] == 16 and len(block["checksums"]) == 8


def test_latest_keep_and_stale_tmp_cleanup(tmp_path):
    stale = tmp_path / ".tmp-step-0000002-deadbeef"
    stale.mkdir()
    (stale / "rank-00000.h5").write_bytes(b"partial")
    assert latest(str(tmp_path)) is None
    for step in (1, 2, 3, 4, 5):
        save_ref(tmp_path, step=step, seed=step, keep=3)
        assert latest(str(tmp_path)) == str(tmp_path / f"step-{step:07d}")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-0000003", "step-0000004", "step-0000005"]
    got, meta = load(str(tmp_path), {"optim/step": Layout.replicated(())}, COMM)
    assert meta["step"] == 5


def test_latest_without_a_usable_pointer_is_the_newest_committed_step(tmp_path):
    for step in (2, 10):
        save_ref(tmp_path, step=step, seed=step)
    (tmp_path / ".tmp-step-0000011-deadbeef").mkdir()  # a killed save is never a candidate
    (tmp_path / "latest").write_text("step-0009999\n")   # names a step that is gone
    assert pointer(str(tmp_path)) == "step-0009999"
    assert latest(str(tmp_path)) == str(tmp_path / "step-0000010")
    (tmp_path / "latest").unlink()                      # lost (or a save killed before writing it)
    assert pointer(str(tmp_path)) is None
    assert latest(str(tmp_path)) == str(tmp_path / "step-0000010")
    (tmp_path / "latest").write_text("step-0000002\n")  # a valid pointer wins over newer steps
    assert latest(str(tmp_path)) == str(tmp_path / "step-0000002")


def test_resave_same_step_and_older_step_kept(tmp_path):
    save_ref(tmp_path, step=5, seed=1, keep=1)
    glob, path = save_ref(tmp_path, step=5, seed=2, keep=1)  # replaced in place
    got, _ = load(path, {"model/transformer.wte.weight": Layout.replicated((16, 8))}, COMM)
    assert np.array_equal(got["model/transformer.wte.weight"], glob["model/transformer.wte.weight"])
    save_ref(tmp_path, step=3, seed=3, keep=1)  # resumed from an older step: the new one survives
    assert latest(str(tmp_path)) == str(tmp_path / "step-0000003")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-0000003"]


def test_async_save_snapshots_arrays(tmp_path):
    glob = reference()
    tensors = replicated({n: a.copy() for n, a in glob.items()})
    handle = save(str(tmp_path), 2, tensors, {}, COMM, async_save=True)
    for a, _ in tensors.values():
        a[...] = 0  # training goes on: the checkpoint must hold the values at save time
    path = handle.wait()
    assert handle.wait() == path and handle.done()
    got, _ = load(path, {n: Layout.replicated(a.shape) for n, a in glob.items()}, COMM)
    assert all(np.array_equal(got[n], glob[n]) for n in glob)


class _Unreadable:
    """A local array whose data cannot be read (shape and dtype can)."""

    shape, dtype = (16, 8), np.dtype("<f8")

    def __getitem__(self, key):
        raise RuntimeError("device lost")


@pytest.mark.parametrize("async_save", [False, True])
def test_snapshot_failure_raises_and_commits_nothing(tmp_path, async_save):
    save_ref(tmp_path, step=1)
    tensors = {"model/a": (_Unreadable(), Layout.replicated((16, 8)))}
    with pytest.raises(CheckpointError, match="device lost"):
        result = save(str(tmp_path), 2, tensors, {}, COMM, async_save=async_save)
        if async_save:  # the background write reports it: wait() raises
            result.wait()
    assert latest(str(tmp_path)) == str(tmp_path / "step-0000001")


def flip_byte_in_chunk(path, dataset):
    """Flip a byte of the block's data (format v2: contiguous, at the dataset's offset)."""
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_flipped_byte_names_file_and_tensor(tmp_path):
    glob, path = save_ref(tmp_path)
    name = "model/transformer.wte.weight"
    rank_file = os.path.join(path, "rank-00000.h5")
    flip_byte_in_chunk(rank_file, f"{name}/block-0")
    with pytest.raises(CheckpointError, match=rf"rank-00000\.h5.*{name}"):
        load(path, {name: Layout.replicated((16, 8))}, COMM)
    # other tensors in the same file still load
    got, _ = load(path, {"model/transformer.ln_f.bias": Layout.replicated((8,))}, COMM)
    assert np.array_equal(got["model/transformer.ln_f.bias"], glob["model/transformer.ln_f.bias"])
    problems = verify(path)
    assert len(problems) == 1 and "rank-00000.h5" in problems[0] and "corrupt" in problems[0]


def test_truncated_file(tmp_path):
    glob, path = save_ref(tmp_path)
    rank_file = os.path.join(path, "rank-00000.h5")
    os.truncate(rank_file, os.path.getsize(rank_file) // 2)
    with pytest.raises(CheckpointError, match=r"rank-00000\.h5.*truncated.*tensor model/"):
        load(path, {"model/transformer.wte.weight": Layout.replicated((16, 8))}, COMM)
    assert any("truncated" in p for p in verify(path))


def test_missing_shard(tmp_path):
    glob, path = save_ref(tmp_path)
    os.remove(os.path.join(path, "rank-00000.h5"))
    with pytest.raises(CheckpointError, match=r"rank-00000\.h5: shard file missing.*optim/step"):
        load(path, {"optim/step": Layout.replicated(())}, COMM)
    assert any("missing" in p for p in verify(path))


def test_wrong_shape_and_missing_tensor(tmp_path):
    glob, path = save_ref(tmp_path)
    with pytest.raises(CheckpointError, match=r"model/transformer\.wte\.weight.*\[16, 8\].*\[32, 8\].*another model"):
        load(path, {"model/transformer.wte.weight": Layout.replicated((32, 8))}, COMM)
    with pytest.raises(CheckpointError, match=r"model/lm_head\.weight is not in checkpoint"):
        load(path, {"model/lm_head.weight": Layout.replicated((16, 8))}, COMM)
    with pytest.raises(CheckpointError, match=r"no checkpoint at"):
        load(str(tmp_path / "nothing"), {}, COMM)


def test_bad_save_input(tmp_path):
    a = np.zeros((4, 4))
    with pytest.raises(CheckpointError, match=r"model/a: local array has shape \[4, 4\]"):
        save(str(tmp_path), 1, {"model/a": (a, Layout.split((8, 4), 0, 0, 4))}, {}, COMM)
    with pytest.raises(CheckpointError, match=r"model/a: the ranks' blocks do not cover"):
        save(str(tmp_path), 1, {"model/a": (a, Layout.split((8, 4), 0, 0, 2))}, {}, COMM)
    assert latest(str(tmp_path)) is None


def test_assign_writers_lowest_rank_writes_once():
    """4 ranks as tp=2 x dp=2 (tp innermost) and a tensor held by two pipeline stages."""
    shape = (8, 4)
    holdings = []
    for rank in range(4):
        tp = rank % 2
        split = Layout.split(shape, 0, tp, 2, groups=2)
        holdings.append({
            "w": (shape, "<f8", [bounds(b.glob) for b in split.blocks]),
            "r": (shape, "<f8", [bounds(b.glob) for b in Layout.replicated(shape).blocks]),
        })
    holdings[0]["tied"] = holdings[3]["tied"] = (shape, "<f4", [((0, 8), (0, 4))])
    assignment = assign_writers(holdings)
    assert [(b.rank, b.region) for b in assignment["w"].blocks] == [
        (0, ((0, 2), (0, 4))), (1, ((2, 4), (0, 4))), (0, ((4, 6), (0, 4))), (1, ((6, 8), (0, 4)))]
    assert [b.rank for b in assignment["r"].blocks] == [0] and [b.rank for b in assignment["tied"].blocks] == [0]
    holdings[2]["r"] = (shape, "<f4", holdings[2]["r"][2])
    with pytest.raises(CheckpointError, match="ranks disagree"):
        assign_writers(holdings)


def test_assign_writers_rejects_partial_overlap():
    holdings = [{"w": ((8,), "<f8", [((0, 5),)])}, {"w": ((8,), "<f8", [((4, 8),)])}]
    with pytest.raises(CheckpointError, match="partly overlaps"):
        assign_writers(holdings)


def test_info_verify_export_cli(tmp_path, capsys):
    glob, path = save_ref(tmp_path, step=9)
    text = info(str(tmp_path))
    assert "step 9" in text and "model/transformer.wte.weight" in text and "[16, 8]" in text
    assert verify(path) == []
    assert checkpoint_tool("verify", str(tmp_path)) == 0
    assert "ok" in capsys.readouterr().out
    out = tmp_path / "all.npz"
    assert checkpoint_tool("export", path, out=str(out)) == 0
    with np.load(out) as npz:
        assert sorted(npz.files) == sorted(glob)
        for name, a in glob.items():
            assert np.array_equal(npz[name], a)
    with pytest.raises(CheckpointError, match="--out"):
        checkpoint_tool("export", path)
    assert checkpoint_tool("info", path) == 0
    assert "tensors: 5" in capsys.readouterr().out
    os.truncate(os.path.join(path, "rank-00000.h5"), 100)
    with pytest.raises(CheckpointError, match="rank-00000.h5"):
        checkpoint_tool("verify", path)


class _PoisonedEmpty:
    """numpy with `empty` returning NaN: what a load leaves unwritten shows up."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=float):
        return np.full(shape, np.nan, dtype=dtype)


def test_padding_is_zero_filled_in_flat_and_plain_layouts(tmp_path, monkeypatch):
    """A padded vocabulary shard (`Layout.split_padded`) and ZeRO flat ranges of it: the padding
    holds no stored element, and loading fills it with zeros whatever the assembly buffer held."""
    glob = reference(5)["model/transformer.wte.weight"][:15]     # [15, 8]: tp = 2 pads to 2 x 8 rows
    name = "model/transformer.wte.weight"
    path = save(str(tmp_path), 1, {name: (glob, Layout.replicated(glob.shape))}, {}, COMM)
    monkeypatch.setattr(loading, "np", _PoisonedEmpty())
    parent = Layout.split_padded(glob.shape, 0, 1, 2)           # rows 8..14 and one padding row
    for lay in (parent, parent.flat_range(0, 64), parent.flat_range(50, 64), parent.flat_range(60, 64)):
        assert lay.padded
        got, _ = load(path, {name: lay}, COMM)
        assert np.array_equal(got[name], lay.take(glob)) and not np.isnan(got[name]).any()
