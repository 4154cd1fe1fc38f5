"""Sharded checkpoints across ranks: save on one layout, load on others, bitwise.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_checkpoint.py (also -n 1, 2, 3).
The save layout is tp x dp with tp = 2 when the world is even (tp innermost: rank = dp*tp + t).
"""

import json
import os
import re
import shutil
import subprocess

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert

from hpcpar.checkpoint.directory import latest
from hpcpar.checkpoint.format import INDEX, MANIFEST
from hpcpar.checkpoint.load import load
from hpcpar.checkpoint.save import save
from hpcpar.checkpoint.tools import verify
from hpcpar.checkpoint.writers import assign_writers
from hpcpar.errors import CheckpointError
from hpcpar.layout import Layout, bounds
from hpcpar.runtime.comm import Communicator

WORLD = MPI.COMM_WORLD
COMM = Communicator(WORLD, "world")  # checkpoint functions take hpcpar Communicators
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
TP = 2 if SIZE % 2 == 0 else 1
DP = SIZE // TP
# Shared storage (one HDF5 file written collectively) needs parallel h5py: the Open MPI lane of .ci/run.
needs_parallel_h5py = pytest.mark.skipif(
    not h5py.get_config().mpi, reason="h5py is not built with MPI (the pip wheel): storage=\"shared\" needs "
    "parallel HDF5 (README, Parallel HDF5; built in the Open MPI lane of .ci/run)")






def reference() -> dict[str, np.ndarray]:
    """Global tensors, the same on every rank (sizes divide by 1..4 ranks and 3 groups)."""
    rng = np.random.default_rng(1234)
    return {
        "model/a": rng.standard_normal((24, 12)),                      # split dim 0 over tp
        "model/b": rng.standard_normal((12, 24)).astype(np.float32),   # split dim 1 over tp
        "model/c_attn.weight": rng.standard_normal((36, 12)),         # q,k,v groups split over tp
        "model/ln.bias": rng.standard_normal(12),                      # replicated everywhere
        "model/wte.weight": rng.standard_normal((24, 12)),            # tied: first and last rank
        "optim/a/exp_avg": rng.standard_normal((24, 12)),             # ZeRO-style: split over all
    }


def save_layouts() -> dict[str, Layout]:
    t, d = RANK % TP, RANK // TP
    g = reference()
    layouts = {
        "model/a": Layout.split(g["model/a"].shape, 0, t, TP),
        "model/b": Layout.split(g["model/b"].shape, 1, t, TP),
        "model/c_attn.weight": Layout.split(g["model/c_attn.weight"].shape, 0, t, TP, groups=3),
        "model/ln.bias": Layout.replicated(g["model/ln.bias"].shape),
        "optim/a/exp_avg": Layout.split(g["optim/a/exp_avg"].shape, 0, d * TP + t, SIZE),
    }
    if RANK in (0, SIZE - 1):
        layouts["model/wte.weight"] = Layout.replicated(g["model/wte.weight"].shape)
    return layouts


def save_reference(directory: str, step: int = 1, comm=COMM, **kw) -> str:
    g = reference()
    tensors = {name: (layout.take(g[name]), layout) for name, layout in save_layouts().items()}
    return save(directory, step, tensors, {"mesh": {"dp": DP, "tp": TP}}, comm, **kw)


def load_layouts(kind: str) -> dict[str, Layout]:
    g = reference()
    if kind == "replicated":
        return {n: Layout.replicated(a.shape) for n, a in g.items()}
    if kind == "split_all":  # tp = world, same dims
        return {n: Layout.split(a.shape, 0 if n != "model/b" else 1, RANK, SIZE,
                                groups=3 if "c_attn" in n else 1) for n, a in g.items()}
    if kind == "other_dim":  # split on the other dim, in reversed rank order
        return {n: Layout.split(a.shape, 1 if a.ndim == 2 and n != "model/b" else 0, SIZE - 1 - RANK, SIZE)
                for n, a in g.items()}
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["replicated", "split_all", "other_dim"])
def test_reshard_on_load_is_bitwise(shared_dir, kind):
    path = save_reference(shared_dir)
    wanted = load_layouts(kind)
    got, meta = load(shared_dir, wanted, COMM)
    g = reference()
    ok = all(got[n].dtype == g[n].dtype and np.array_equal(got[n], layout.take(g[n]))
             for n, layout in wanted.items())
    collective_assert(ok and meta["world_size"] == SIZE and meta["mesh"] == {"dp": DP, "tp": TP},
                      f"{kind}: a loaded tensor differs from the reference slice")
    assert path.endswith("step-0000001")


def test_each_block_written_once_and_index_reads_globals(shared_dir):
    path = save_reference(shared_dir)
    ok, why = True, ""
    if RANK == 0:
        g = reference()
        per_tensor: dict[str, list[tuple[str, int]]] = {}
        for file in sorted(os.listdir(path)):
            if not file.startswith("rank-"):
                continue
            with h5py.File(os.path.join(path, file), "r") as f:
                f.visititems(lambda name, obj: per_tensor.setdefault(obj.attrs["tensor"], []).append(
                    (file, obj.size)) if isinstance(obj, h5py.Dataset) else None)
        for name, a in g.items():
            written = per_tensor.get(name, [])
            if sum(n for _, n in written) != a.size:  # every element stored exactly once
                ok, why = False, f"{name}: {written}"
        for name in ("model/ln.bias", "model/wte.weight"):
            if [f for f, _ in per_tensor[name]] != ["rank-00000.h5"]:
                ok, why = False, f"{name} written by {per_tensor[name]}"
        if TP == 2 and sorted(f for f, _ in per_tensor["model/a"]) != ["rank-00000.h5", "rank-00001.h5"]:
            ok, why = False, f"model/a written by {per_tensor['model/a']}, expected the dp=0 tp group"
        with h5py.File(os.path.join(path, INDEX), "r") as f:
            for name, a in g.items():
                if not np.array_equal(f[name][()], a):
                    ok, why = False, f"index {name} differs from the global tensor"
    collective_assert(ok, why)


def test_cart_comm_and_async_save(shared_dir):
    cart = Communicator(WORLD.Create_cart([DP, TP]), "cart")
    handle = save_reference(shared_dir, step=3, comm=cart, async_save=True)
    path = handle.wait()
    cart.free()
    got, meta = load(path, load_layouts("split_all"), COMM)
    g = reference()
    ok = all(np.array_equal(got[n], lay.take(g[n])) for n, lay in load_layouts("split_all").items())
    collective_assert(ok and meta["step"] == 3, "async save / cart comm round trip differs")


class _Untouchable:
    """Stands in for a local array whose blocks this rank does not write: shape and dtype only.
    Reading its data (slicing, copying, moving it to the host) fails."""

    def __init__(self, a):
        self.shape, self.dtype = a.shape, a.dtype

    def __getitem__(self, key):
        raise AssertionError("a rank that writes no block of this tensor read its data")

    def __array__(self, *args, **kwargs):
        raise AssertionError("a rank that writes no block of this tensor copied it")


@pytest.mark.parametrize("async_save", [False, True])
def test_only_the_rank_writing_a_block_touches_its_data(shared_dir, async_save):
    """dp replicas (and ranks 1.. of a replicated tensor) hand over arrays nobody may read: the
    save assigns the writers from shapes and regions, and only a block's writer snapshots it."""
    g = reference()
    held = {n: (lay.global_shape, g[n].dtype.str, [bounds(b.glob) for b in lay.blocks])
            for n, lay in save_layouts().items()}
    assignment = assign_writers(WORLD.allgather(held))
    tensors = {}
    for name, layout in save_layouts().items():
        local = layout.take(g[name])
        writes = any(b.rank == RANK for b in assignment[name].blocks)
        tensors[name] = (local if writes else _Untouchable(local), layout)
    result = save(shared_dir, 2, tensors, {}, COMM, async_save=async_save)
    path = result.wait() if async_save else result
    got, _ = load(path, load_layouts("split_all"), COMM)
    ok = all(np.array_equal(got[n], lay.take(g[n])) for n, lay in load_layouts("split_all").items())
    untouched = sum(isinstance(a, _Untouchable) for a, _ in tensors.values())
    counts = WORLD.allgather(untouched)
    collective_assert(ok and (SIZE == 1 or sum(counts) > 0), f"round trip differs or nothing was untouchable: {counts}")


def test_keep_and_latest(shared_dir):
    for step in (1, 2, 3):
        save_reference(shared_dir, step=step, keep=2)
    entries = sorted(os.listdir(shared_dir))
    collective_assert(entries == ["latest", "step-0000002", "step-0000003"]
                      and latest(shared_dir).endswith("step-0000003"), f"entries {entries}")


@pytest.mark.parametrize("storage", ["per_rank", pytest.param("shared", marks=needs_parallel_h5py)])
def test_corrupt_shard_seen_by_one_rank_raises_everywhere(shared_dir, storage):
    path = save_reference(shared_dir, storage=storage)
    damaged = None
    if RANK == 0:  # flip a byte in the first block of model/a, wherever the index says it is
        with h5py.File(os.path.join(path, INDEX), "r") as f:
            block = json.loads(f["model/a"].attrs["sharding"])[0]
        damaged = block["file"]
        with h5py.File(os.path.join(path, damaged), "r") as f:  # rank files: contiguous; shared: chunked
            ds = f[block["dataset"]]
            offset = ds.id.get_chunk_info(0).byte_offset if ds.chunks else ds.id.get_offset()
        with open(os.path.join(path, damaged), "r+b") as f:
            f.seek(offset + 3)
            byte = f.read(1)
            f.seek(offset + 3)
            f.write(bytes([byte[0] ^ 0x55]))
    damaged = WORLD.bcast(damaged, root=0)
    g = reference()
    # Only rank 0 asks for the damaged tensor; the others read healthy ones.
    wanted = ({"model/a": Layout.replicated(g["model/a"].shape)} if RANK == 0
              else {"model/ln.bias": Layout.replicated(g["model/ln.bias"].shape)})
    with pytest.raises(CheckpointError) as err:
        load(path, wanted, COMM)
    messages = WORLD.allgather(str(err.value))
    problems = verify(path) if RANK == 0 else None  # one process reads every block back
    verified = RANK != 0 or (len(problems) == 1 and damaged in problems[0] and "model/a" in problems[0])
    collective_assert(len(set(messages)) == 1 and damaged in messages[0] and "model/a" in messages[0] and verified,
                      f"messages differ or miss file/tensor: {messages}; verify: {problems}")


def test_wrong_shape_on_one_rank_raises_everywhere(shared_dir):
    save_reference(shared_dir)
    wanted = {"model/ln.bias": Layout.replicated((13,) if RANK == SIZE - 1 else (12,))}
    with pytest.raises(CheckpointError, match=r"model/ln\.bias.*\[12\].*\[13\].*another model"):
        load(shared_dir, wanted, COMM)


# ----------------------------------------------------------------------------------------
# Shared storage: one HDF5 file written collectively (parallel h5py; the Open MPI lane of .ci/run).


def globals_of(path: str) -> dict[str, np.ndarray]:
    """Every global tensor of a checkpoint, read by hpcpar on one process."""
    stored = json.load(open(os.path.join(path, MANIFEST)))["tensors"]
    got, _ = load(path, {n: Layout.replicated(t["shape"]) for n, t in stored.items()}, Communicator.local())
    return got


@needs_parallel_h5py
def test_shared_and_per_rank_load_into_each_other_bitwise(shared_dir):
    g = reference()
    # shared, saved on (dp, tp): loads into every other layout
    shared = save_reference(os.path.join(shared_dir, "a"), storage="shared")
    for kind in ("replicated", "split_all", "other_dim"):
        got, meta = load(shared, load_layouts(kind), COMM)
        ok = all(got[n].dtype == g[n].dtype and np.array_equal(got[n], lay.take(g[n]))
                 for n, lay in load_layouts(kind).items())
        collective_assert(ok and meta["mesh"] == {"dp": DP, "tp": TP}, f"shared -> {kind} differs")
    # -> per-rank files from another layout -> shared again from a third: the same global tensors
    other = load_layouts("other_dim")
    got, _ = load(shared, other, COMM)
    per_rank = save(os.path.join(shared_dir, "b"), 2, {n: (got[n], other[n]) for n in other}, {}, COMM)
    split = load_layouts("split_all")
    got, _ = load(per_rank, split, COMM)
    again = save(os.path.join(shared_dir, "c"), 3, {n: (got[n], split[n]) for n in split}, {}, COMM,
                    storage="shared")
    ok, why = True, ""
    if RANK == 0:
        a, b, c = globals_of(shared), globals_of(per_rank), globals_of(again)
        for name, ref in g.items():
            if not all(x[name].dtype == ref.dtype and np.array_equal(x[name], ref) for x in (a, b, c)):
                ok, why = False, f"{name} differs after shared -> per_rank -> shared"
        if sorted(os.listdir(shared)) != [INDEX, MANIFEST] or not any(
                f.startswith("rank-") for f in os.listdir(per_rank)):
            ok, why = False, f"files: {os.listdir(shared)} / {os.listdir(per_rank)}"
    collective_assert(ok, why)


@needs_parallel_h5py
def test_shared_file_reads_as_globals_with_plain_h5py_and_h5dump(shared_dir):
    path = save_reference(shared_dir, storage="shared")
    ok, why = True, ""
    if RANK == 0:
        g = reference()
        index = os.path.join(path, INDEX)
        with h5py.File(index, "r") as f:  # real datasets, not virtual: the data is in this one file
            for name, a in g.items():
                if f[name].is_virtual or not np.array_equal(f[name][()], a):
                    ok, why = False, f"plain h5py: {name} differs from the global tensor"
            sharding = json.loads(f["model/ln.bias"].attrs["sharding"])
            if [b["rank"] for b in sharding] != [0]:  # replicated: written once, by rank 0
                ok, why = False, f"model/ln.bias written by {sharding}"
            written = sum(_volume(b["region"]) for b in json.loads(f["optim/a/exp_avg"].attrs["sharding"]))
            if written != g["optim/a/exp_avg"].size:
                ok, why = False, f"optim/a/exp_avg: {written} elements written"
        if shutil.which("h5dump"):
            out = subprocess.run(["h5dump", "-d", "/model/ln.bias", "-m", "%.17g", index],
                                 capture_output=True, text=True, timeout=60)
            data = out.stdout.split("DATA {", 1)[-1].split("}", 1)[0]  # the dataset's, before its attributes
            values = [float(v) for v in re.findall(r"\(\d+\): ([^,\s]+)", data)]
            if out.returncode != 0 or not np.array_equal(values, g["model/ln.bias"]):
                ok, why = False, f"h5dump: {out.returncode} {out.stderr[-300:]} {values[:3]}"
    collective_assert(ok, why)


def _volume(region) -> int:
    return int(np.prod([e - s for s, e in region]))


@needs_parallel_h5py
def test_shared_refuses_async_save(shared_dir):
    with pytest.raises(CheckpointError, match="async_save needs per_rank storage"):
        save_reference(shared_dir, storage="shared", async_save=True)
