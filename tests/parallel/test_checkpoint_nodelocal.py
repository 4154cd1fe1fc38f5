"""Checkpoints on node-local disks (`checkpoint.location = "node-local"`, checkpoint/replicate.py).

Run: mpiexec -n 4 python -m pytest tests/parallel/test_checkpoint_nodelocal.py (3 ranks work too).
One host fakes two nodes: ranks 0,1 and 2,3 (node = rank // 2, `COMM.split`) with a directory of
their own each (<tmp>/node0/ckpt, <tmp>/node1/ckpt), the same checkpoint path on every "node"
being a different disk, as on a cluster with /tmp or local NVMe checkpoints.
"""

import hashlib
import os
import shutil

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert

from hpcpar.checkpoint.directory import latest, pointer
from hpcpar.checkpoint.format import MANIFEST, read_manifest
from hpcpar.checkpoint.load import load
from hpcpar.checkpoint.replicate import probe_location, replicate, start_of_run
from hpcpar.checkpoint.save import save
from hpcpar.checkpoint.tools import verify
from hpcpar.config.load import load_config
from hpcpar.errors import CheckpointError, ConfigError
from hpcpar.layout import Layout
from hpcpar.runtime.comm import Communicator
from hpcpar.training.run import checkpoint_location

WORLD = MPI.COMM_WORLD
COMM = Communicator(WORLD, "world")
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
NODE = RANK // 2  # the fake node
NODES = (SIZE + 1) // 2
LEADER = RANK % 2 == 0

pytestmark = pytest.mark.skipif(SIZE < 3, reason="two fake nodes need 3 or more ranks")


@pytest.fixture(scope="module")
def node_comm():
    """The fake node's ranks (its leader is the even rank)."""
    comm = COMM.split(NODE, RANK, name="fake-node")
    yield comm
    comm.free()


def node_dir(shared_dir: str, node: int = NODE) -> str:
    """A fake node's own checkpoint directory (this rank's path when `node` is its own)."""
    return os.path.join(shared_dir, f"node{node}", "ckpt")


def reference() -> dict[str, np.ndarray]:
    """Tiny global tensors, the same on every rank."""
    rng = np.random.default_rng(7)
    return {"model/w": rng.standard_normal((12, 12)), "model/b": rng.standard_normal(6).astype(np.float32),
            "optim/w/exp_avg": rng.standard_normal((12, 12)), "optim/step": np.array(5, dtype=np.int64)}


def save_layouts() -> dict[str, Layout]:
    """model/w split over all ranks by rows, its optimizer state by columns in reversed order, the
    bias replicated, the step on the last rank only: every rank writes a block of something."""
    g = reference()
    return {"model/w": Layout.split(g["model/w"].shape, 0, RANK, SIZE),
            "optim/w/exp_avg": Layout.split(g["optim/w/exp_avg"].shape, 1, SIZE - 1 - RANK, SIZE),
            "model/b": Layout.replicated(g["model/b"].shape),
            **({"optim/step": Layout.replicated(())} if RANK == SIZE - 1 else {})}


def save_node_local(shared_dir: str, node_comm, step: int = 1, **kw):
    g = reference()
    tensors = {name: (layout.take(g[name]), layout) for name, layout in save_layouts().items()}
    return save(node_dir(shared_dir), step, tensors, {"note": "node-local"}, COMM, location="node-local",
                node_comm=node_comm, **kw)


def digests(path: str) -> dict[str, str]:
    """Every regular file in `path` -> its sha256."""
    out = {}
    for name in sorted(os.listdir(path)):
        if not os.path.isfile(os.path.join(path, name)):
            continue
        with open(os.path.join(path, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def leaders_view(what) -> list:
    """`what()` on each fake node's leader, gathered on every rank (None from the others); an
    exception comes back as its text, so that no rank leaves the others waiting."""
    def answer():
        try:
            return what()
        except Exception as err:  # noqa: BLE001 - compared (and failing) on every rank
            return f"raised {err!r}"
    return [x for x in WORLD.allgather(answer() if LEADER else None) if x is not None]


def test_probe_location(shared_dir, node_comm):
    own = probe_location(node_dir(shared_dir), COMM, node_comm)
    one = probe_location(os.path.join(shared_dir, "one"), COMM, node_comm)
    lone = COMM.split(0, RANK)  # all ranks on one node: no probe at all
    alone = probe_location(os.path.join(shared_dir, "lone"), COMM, lone)
    lone.free()
    left = leaders_view(lambda: [e for e in os.listdir(node_dir(shared_dir)) if e.startswith(".")]
                        if os.path.isdir(node_dir(shared_dir)) else [])
    collective_assert(own == "node-local" and one == "shared" and alone == "shared" and left == [[]] * NODES
                      and not os.path.exists(os.path.join(shared_dir, "lone")),
                      f"probe: own dirs {own}, one dir {one}, one node {alone}; probe files left {left}")


def test_save_gives_every_node_a_full_verifying_copy(shared_dir, node_comm):
    path = save_node_local(shared_dir, node_comm)
    ok = path == os.path.join(node_dir(shared_dir), "step-0000001")
    copies = leaders_view(lambda: (digests(path), verify(path), sorted(os.listdir(node_dir(shared_dir))),
                                   sorted(read_manifest(path)["files"])))
    ok = ok and all(isinstance(c, tuple) for c in copies)
    files, problems, entries, listed = zip(*copies) if ok else ([], [], [], [])
    ok = ok and len(copies) == NODES and all(f == files[0] for f in files) and problems == ([],) * NODES
    ok = ok and all(e == ["latest", "step-0000001"] for e in entries)  # no temporary directory left
    ok = ok and sorted(set(files[0]) - {MANIFEST}) == listed[0] and len(listed[0]) == SIZE + 1  # rank files, index
    collective_assert(ok, f"path {path}; copies {copies}")


def test_load_on_another_layout_and_on_two_ranks(shared_dir, node_comm):
    save_node_local(shared_dir, node_comm, step=4)
    g = reference()
    # All ranks, another layout (columns where rows were, and back), each from its own node's copy.
    wanted = {"model/w": Layout.split(g["model/w"].shape, 1, (RANK + 1) % SIZE, SIZE),
              "optim/w/exp_avg": Layout.split(g["optim/w/exp_avg"].shape, 0, RANK, SIZE),
              "model/b": Layout.replicated(g["model/b"].shape), "optim/step": Layout.replicated(())}
    got, meta = load(node_dir(shared_dir), wanted, COMM)
    ok = meta["step"] == 4 and all(np.array_equal(got[n], lay.take(g[n])) and got[n].dtype == g[n].dtype
                                   for n, lay in wanted.items())
    # Two ranks (the second node's, which wrote none of the first node's rank files), and the others.
    sub = COMM.split(int(NODE == 1), RANK)
    halves = {"model/w": Layout.split(g["model/w"].shape, 0, sub.rank, sub.size)} if sub.size > 1 else {}
    wanted = {**halves, "optim/w/exp_avg": Layout.replicated(g["optim/w/exp_avg"].shape)}
    got, _ = load(os.path.join(node_dir(shared_dir), "step-0000004"), wanted, sub)
    ok = ok and all(np.array_equal(got[n], lay.take(g[n])) for n, lay in wanted.items())
    sub.free()
    collective_assert(ok, "a tensor loaded from a node-local copy differs from the reference")


def test_keep_prunes_on_every_node(shared_dir, node_comm):
    for step in (1, 2, 3):
        save_node_local(shared_dir, node_comm, step=step, keep=2)
    entries = leaders_view(lambda: sorted(os.listdir(node_dir(shared_dir))))
    collective_assert(entries == [["latest", "step-0000002", "step-0000003"]] * NODES
                      and latest(node_dir(shared_dir)).endswith("step-0000003"), f"entries per node {entries}")


def test_async_save_node_local(shared_dir, node_comm):
    handle = save_node_local(shared_dir, node_comm, step=2, async_save=True)
    path = handle.wait()
    copies = leaders_view(lambda: (digests(path), verify(path)))
    got, _ = load(path, {"model/w": Layout.replicated((12, 12))}, COMM)
    collective_assert(all(c == copies[0] for c in copies) and copies[0][1] == [] and len(copies) == NODES
                      and np.array_equal(got["model/w"], reference()["model/w"]), f"async: {copies}")


def _lose_node1(shared_dir: str) -> None:
    """Node 1 loses its checkpoint directory (a job requeued onto a node that never saw it)."""
    if RANK == 2:
        shutil.rmtree(node_dir(shared_dir))
    WORLD.Barrier()


def test_run_start_copies_the_newest_checkpoint_to_a_node_that_lacks_it(shared_dir, node_comm):
    save_node_local(shared_dir, node_comm, step=1)
    save_node_local(shared_dir, node_comm, step=2)
    _lose_node1(shared_dir)
    location = start_of_run(node_dir(shared_dir), "auto", "auto", COMM, node_comm)
    path = latest(node_dir(shared_dir))
    copies = leaders_view(lambda: (os.path.basename(path), pointer(node_dir(shared_dir)), digests(path),
                                   verify(path)))
    mine = Layout.split((12, 12), 0, RANK, SIZE)
    got, meta = load(node_dir(shared_dir), {"model/w": mine}, COMM)
    collective_assert(location == "node-local" and len(copies) == NODES
                      and all(c == copies[0] for c in copies) and copies[0][:2] == ("step-0000002",) * 2
                      and copies[0][3] == [] and meta["step"] == 2
                      and np.array_equal(got["model/w"], mine.take(reference()["model/w"])),
                      f"location {location}; copies {copies}")


def test_run_start_agrees_on_the_newest_step_and_a_named_path(shared_dir, node_comm):
    save_node_local(shared_dir, node_comm, step=1)
    _lose_node1(shared_dir)
    if LEADER and NODE == 1:  # node 1 holds step 1 only; node 0 also step 3 (saved, say, before a requeue)
        os.makedirs(node_dir(shared_dir))
    start_of_run(node_dir(shared_dir), "auto", "node-local", COMM, node_comm)
    save_node_local(shared_dir, node_comm, step=3)
    if RANK == 2:
        shutil.rmtree(os.path.join(node_dir(shared_dir), "step-0000003"))
        with open(os.path.join(node_dir(shared_dir), "latest"), "w") as f:
            f.write("step-0000001\n")
    WORLD.Barrier()
    start_of_run(node_dir(shared_dir), "auto", "node-local", COMM, node_comm)
    newest = leaders_view(lambda: (pointer(node_dir(shared_dir)), sorted(os.listdir(node_dir(shared_dir)))))
    # A named step directory: copied where missing, `latest` left alone.
    _lose_node1(shared_dir)
    named = os.path.join(node_dir(shared_dir), "step-0000001")
    start_of_run(node_dir(shared_dir), named, "node-local", COMM, node_comm)
    after = leaders_view(lambda: (verify(named), pointer(node_dir(shared_dir)), digests(named)))
    collective_assert(newest == [("step-0000003", ["latest", "step-0000001", "step-0000003"])] * NODES
                      and after[0][0] == [] and all(a[0] == [] and a[2] == after[0][2] for a in after)
                      and [a[1] for a in after] == ["step-0000003"] + [None] * (NODES - 1),
                      f"newest per node {newest}; named path {[a[:2] for a in after]}")


def test_run_start_through_the_config(shared_dir, node_comm):
    """training/run.checkpoint_location: location resolved, the checkpoint to resume copied."""
    save_node_local(shared_dir, node_comm, step=5)
    _lose_node1(shared_dir)
    cfg = load_config(None, [f"checkpoint.dir={node_dir(shared_dir)}", "checkpoint.resume=auto"])
    resolved = checkpoint_location(cfg, COMM, node_comm)
    found = leaders_view(lambda: verify(node_dir(shared_dir)))
    # One MPI-IO file cannot live on node-local disks: refused on every rank, in one line.
    shared_file = load_config(None, [f"checkpoint.dir={node_dir(shared_dir)}", "checkpoint.format=shared"])
    with pytest.raises(ConfigError, match='found checkpoint.dir .* own disk.*checkpoint.format="per_rank"'):
        checkpoint_location(shared_file, COMM, node_comm)
    collective_assert(resolved.checkpoint.location == "node-local" and found == [[]] * NODES,
                      f"{resolved.checkpoint.location}; verify per node {found}")


def test_replicate_in_chunks_skips_what_every_node_has(shared_dir, node_comm):
    path = os.path.join(shared_dir, f"node{NODE}", "files")
    rng = np.random.default_rng(NODE)
    if LEADER:
        os.makedirs(path)
        mine = {"empty": b"", "odd": rng.bytes(2500 + NODE), "both": b"same everywhere"}
        for name, data in mine.items():
            with open(os.path.join(path, f"{name}-{NODE}" if name != "both" else name), "wb") as f:
                f.write(data)
        os.mkdir(os.path.join(path, "sub"))  # not a regular file: left alone
    WORLD.Barrier()
    received = replicate(path, COMM, node_comm, chunk_bytes=1000)  # "odd" takes three chunks
    copies = leaders_view(lambda: digests(path))
    others = [n for n in range(NODES) if n != NODE]
    expected = sorted([f"empty-{n}" for n in others] + [f"odd-{n}" for n in others]) if LEADER else []
    collective_assert(all(c == copies[0] for c in copies) and len(copies[0]) == 2 * NODES + 1
                      and sorted(received) == expected, f"{copies}; received {received}")


def test_copies_that_differ_fail_on_every_rank(shared_dir, node_comm):
    path = os.path.join(shared_dir, f"node{NODE}", "files")
    if LEADER:
        os.makedirs(path)
        with open(os.path.join(path, "rank-00000.h5"), "wb") as f:
            f.write(b"x" * (10 + NODE))
    WORLD.Barrier()
    with pytest.raises(CheckpointError) as err:
        replicate(path, COMM, node_comm)
    messages = WORLD.allgather(str(err.value))
    collective_assert(len(set(messages)) == 1 and "rank-00000.h5" in messages[0] and "differ" in messages[0],
                      f"messages {messages}")


def test_a_node_that_cannot_write_fails_every_rank(shared_dir, node_comm):
    path = os.path.join(shared_dir, f"node{NODE}", "files")
    if LEADER:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if NODE == 1:  # a file where the directory should be
            open(path, "w").close()
        else:
            os.makedirs(path)
            with open(os.path.join(path, "a"), "wb") as f:
                f.write(b"abc")
    WORLD.Barrier()
    with pytest.raises(CheckpointError) as err:
        replicate(path, COMM, node_comm)
    messages = WORLD.allgather(str(err.value))
    collective_assert(len(set(messages)) == 1 and messages[0].startswith("rank 2:")
                      and os.path.join("node1", "files") in messages[0], f"messages {messages}")


def test_a_failed_read_leaves_no_copy_behind(shared_dir, node_comm, monkeypatch):
    """The sender fails mid-file (after the first chunk): every rank raises, and the receivers keep
    neither the garbage nor a `.part` file, so a later copy starts over."""
    from hpcpar.checkpoint import replicate as module

    path = os.path.join(shared_dir, f"node{NODE}", "files")
    if LEADER:
        os.makedirs(path)
        if NODE == 0:
            with open(os.path.join(path, "big"), "wb") as f:
                f.write(b"y" * 3000)
    real, reads = module._read_into, []

    def second_read_fails(f, view):
        reads.append(len(view))
        return real(f, view) if len(reads) < 2 else OSError(5, "Input/output error")

    if RANK == 0:
        monkeypatch.setattr(module, "_read_into", second_read_fails)
    WORLD.Barrier()
    with pytest.raises(CheckpointError) as err:
        replicate(path, COMM, node_comm, chunk_bytes=1000)
    messages = WORLD.allgather(str(err.value))
    left = leaders_view(lambda: sorted(os.listdir(path)))
    collective_assert(len(set(messages)) == 1 and messages[0].startswith("rank 0:") and "Input/output error"
                      in messages[0] and left == [["big"]] + [[]] * (NODES - 1), f"{messages}; left {left}")


def test_node_local_on_a_shared_directory_is_refused(shared_dir, node_comm):
    """Told node-local, on one directory every node sees: the leader that comes second finds the
    save's new directory made already, and every rank raises; nothing is committed."""
    g = reference()
    tensors = {name: (layout.take(g[name]), layout) for name, layout in save_layouts().items()}
    with pytest.raises(CheckpointError, match="one filesystem that several nodes see") as err:
        save(shared_dir, 1, tensors, {}, COMM, location="node-local", node_comm=node_comm)
    messages = WORLD.allgather(str(err.value))
    collective_assert(len(set(messages)) == 1 and messages[0][:7] in ("rank 0:", "rank 2:")
                      and latest(shared_dir) is None,
                      f"{messages}")
