"""Sharded checkpoints across ranks: save on one layout, load on others, bitwise.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_checkpoint.py (also -n 1, 2, 3).
The save layout is tp x dp with tp = 2 when the world is even (tp innermost: rank = dp*tp + t).
"""

import json
import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert

from hpcpar import checkpoint as ck
from hpcpar.comm import Communicator
from hpcpar.errors import CheckpointError
from hpcpar.layout import Layout

WORLD = MPI.COMM_WORLD
COMM = Communicator(WORLD, "world")  # checkpoint functions take hpcpar Communicators
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
TP = 2 if SIZE % 2 == 0 else 1
DP = SIZE // TP






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
    return ck.save(directory, step, tensors, {"mesh": {"dp": DP, "tp": TP}}, comm, **kw)


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
    got, meta = ck.load(shared_dir, wanted, COMM)
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
        with h5py.File(os.path.join(path, ck.INDEX), "r") as f:
            for name, a in g.items():
                if not np.array_equal(f[name][()], a):
                    ok, why = False, f"index {name} differs from the global tensor"
    collective_assert(ok, why)


def test_cart_comm_and_async_save(shared_dir):
    cart = Communicator(WORLD.Create_cart([DP, TP]), "cart")
    handle = save_reference(shared_dir, step=3, comm=cart, async_save=True)
    path = handle.wait()
    cart.free()
    got, meta = ck.load(path, load_layouts("split_all"), COMM)
    g = reference()
    ok = all(np.array_equal(got[n], lay.take(g[n])) for n, lay in load_layouts("split_all").items())
    collective_assert(ok and meta["step"] == 3, "async save / cart comm round trip differs")


def test_keep_and_latest(shared_dir):
    for step in (1, 2, 3):
        save_reference(shared_dir, step=step, keep=2)
    entries = sorted(os.listdir(shared_dir))
    collective_assert(entries == ["latest", "step-0000002", "step-0000003"]
                      and ck.latest(shared_dir).endswith("step-0000003"), f"entries {entries}")


def test_corrupt_shard_seen_by_one_rank_raises_everywhere(shared_dir):
    path = save_reference(shared_dir)
    damaged = None
    if RANK == 0:  # flip a byte in the first block of model/a, wherever the index says it is
        with h5py.File(os.path.join(path, ck.INDEX), "r") as f:
            block = json.loads(f["model/a"].attrs["sharding"])[0]
        damaged = block["file"]
        with h5py.File(os.path.join(path, damaged), "r") as f:
            offset = f[block["dataset"]].id.get_chunk_info(0).byte_offset
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
        ck.load(path, wanted, COMM)
    messages = WORLD.allgather(str(err.value))
    collective_assert(len(set(messages)) == 1 and damaged in messages[0] and "model/a" in messages[0],
                      f"messages differ or miss file/tensor: {messages}")


def test_wrong_shape_on_one_rank_raises_everywhere(shared_dir):
    save_reference(shared_dir)
    wanted = {"model/ln.bias": Layout.replicated((13,) if RANK == SIZE - 1 else (12,))}
    with pytest.raises(CheckpointError, match=r"model/ln\.bias.*\[12\].*\[13\].*another model"):
        ck.load(shared_dir, wanted, COMM)
