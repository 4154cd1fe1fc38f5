"""In-memory partner snapshots and the restore from them (hpcpar/training/resilience.py,
hpcpar/checkpoint/memory.py), under `mpiexec -n 4` on any MPI: what a lost rank leaves behind is
enough to go on, on a smaller mesh, exactly as from a checkpoint on disk. The failures themselves
(ULFM: revoke, shrink, continue) run on the emulated cluster, tests/cluster/test_resilience.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, stored

from hpcpar.checkpoint.memory import MemoryStored, Snapshot
from hpcpar.config.load import load_config
from hpcpar.runtime.comm import Communicator
from hpcpar.training import resilience
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
TOKENS = np.random.default_rng(7).integers(0, 256, 6000).astype(np.uint8)
TINY = ["model.n_layer=2", "model.n_embd=16", "model.n_head=2", "model.block_size=8", "model.dtype=float64",
        "model.dropout=0.1", "train.steps=20", "train.warmup=1", "train.lr=0.01", "train.grad_clip=0.5",
        "run.eval_every=0", "run.progress=false", "train.bucket_mb=0.004"]
needs4 = pytest.mark.skipif(SIZE != 4, reason="needs 4 ranks")


def make(overrides, comm=WORLD) -> Trainer:
    return Trainer(load_config(None, TINY + overrides), comm=comm, tokens=TOKENS)


def test_partners_sit_on_the_next_node():
    assert resilience.partners(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert resilience.partners(["a", "b", "c"]) == [1, 2, 0]
    assert resilience.partners(["a", "a", "b", "b", "c", "c"]) == [2, 3, 4, 5, 0, 1]
    assert resilience.partners(["a", "a", "a"]) == [1, 2, 0]  # one node: the next rank


def test_a_snapshot_packs_and_unpacks_bitwise():
    t = make(["mesh.dp=1", "mesh.pp=1", "train.zero=0"], MPI.COMM_SELF)
    t.train_step(0)
    snap = Snapshot.take(0, t.checkpoint_state())
    back = Snapshot.unpack(snap.pack())
    t.free()
    assert back.step == snap.step == 1 and back.meta == snap.meta and sorted(back.tensors) == sorted(snap.tensors)
    for name, (array, layout) in snap.tensors.items():
        assert back.tensors[name][1] == layout and np.array_equal(back.tensors[name][0], array), name


@needs4
def test_every_rank_keeps_its_partners_latest_snapshot(tmp_path_factory):
    """memory_every = 2 over 5 steps: snapshots of steps 2 and 4; after the loop each rank holds its
    partner's snapshot of step 4, the same bytes as the partner's own, and still step 2's pair."""
    t = make(["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "checkpoint.memory_every=2", "train.micro_batch_size=2"])
    t.train(steps=5, files=False)
    snaps = t.snapshots
    mine = snaps.own[4]
    every = WORLD.allgather(mine.tobytes())
    t.free()
    copy = Snapshot.unpack(snaps.copies[4]) if 4 in snaps.copies else None
    ok = (copy is not None and copy.owner == snaps.source and copy.step == 4
          and snaps.copies[4].tobytes() == every[snaps.source] and Snapshot.unpack(mine).owner == RANK)
    # Step 2's pair stays until a step has passed since every rank received step 4's.
    collective_assert(ok and snaps.holdings() == {RANK: [2, 4], snaps.source: [2, 4]},
                      f"rank {RANK}: holds {snaps.holdings()}")


CASES = [  # (mesh before, the ranks lost, mesh after on the survivors)
    (["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "train.micro_batch_size=2", "train.microbatches=2"], [2, 3],
     ["mesh.dp=1", "mesh.tp=2", "mesh.pp=1", "train.micro_batch_size=2", "train.microbatches=4"]),
    (["mesh.dp=4", "mesh.pp=1", "train.zero=3", "train.micro_batch_size=1", "train.microbatches=2"], [1, 3],
     ["mesh.dp=2", "mesh.pp=1", "train.zero=3", "train.micro_batch_size=1", "train.microbatches=4"]),
    (["mesh.dp=2", "mesh.pp=2", "train.zero=1", "train.micro_batch_size=2", "train.microbatches=2"], [1, 3],
     ["mesh.dp=1", "mesh.pp=2", "train.zero=1", "train.micro_batch_size=2", "train.microbatches=4"]),
]


@needs4
@pytest.mark.parametrize("before, lost, after", CASES, ids=["dp2xtp2-lose-a-node", "zero3-lose-two-shards",
                                                             "dp2xpp2-lose-a-replica"])
def test_the_survivors_snapshots_load_the_smaller_mesh_as_a_checkpoint_does(before, lost, after, shared_dir):
    """Every rank snapshots step 2 and sends it to a partner that survives; the survivors load a
    smaller mesh from their snapshots and the copies (no file): every tensor equals what the same
    mesh loads from a checkpoint of step 2 on disk, bitwise, and so does the next step's loss."""
    t = make(before)
    for s in range(2):
        t.train_step(s)
    snap = Snapshot.take(RANK, t.checkpoint_state())
    path = t.save(os.path.join(shared_dir, "disk"), keep=1)
    t.free()
    alive = [r for r in range(SIZE) if r not in lost]
    keeper = {dead: alive[i % len(alive)] for i, dead in enumerate(lost)}  # a partner per lost rank
    held = [snap] if RANK in alive else []
    requests = []
    for dead, holder in keeper.items():
        if RANK == dead:
            requests.append(WORLD.isend(snap.pack(), dest=holder, tag=5))
        elif RANK == holder:
            held.append(Snapshot.unpack(WORLD.recv(source=dead, tag=5)))
    MPI.Request.Waitall(requests)
    sub = WORLD.Split(0 if RANK in alive else MPI.UNDEFINED, RANK)
    if sub != MPI.COMM_NULL:
        survivors = Communicator(sub, "survivors")
        from_memory = make(after, sub)
        memory = MemoryStored(held, survivors, snap.meta)
        from_memory.load_checkpoint_state(memory)
        memory.finish()
        a = stored(from_memory.save(os.path.join(shared_dir, "from-memory"), keep=1))
        from_disk = make(after, sub)
        from_disk.load(path)
        b = stored(from_disk.save(os.path.join(shared_dir, "from-disk"), keep=1))
        loss_a, loss_b = from_memory.train_step(2).loss, from_disk.train_step(2).loss
        steps = (from_memory.step, from_disk.step)
        from_memory.free()
        from_disk.free()
        differ = sorted(n for n in b if n not in a or not np.array_equal(a[n], b[n]))
        ok, what = not differ and sorted(a) == sorted(b) and loss_a == loss_b and steps == (3, 3), \
            f"{before} -> {after}: {differ[:3]}, losses {loss_a} vs {loss_b}, steps {steps}"
    else:
        ok, what = True, ""
    collective_assert(ok, what)


@needs4
def test_a_requeued_run_resumes_from_the_node_local_snapshots(shared_dir):
    """A run that ended after step 4 without a checkpoint (a crash) leaves the snapshots of step 4 in
    checkpoint.memory_dir; the next run, checkpoint.resume = "auto", starts there and its steps
    equal the uninterrupted run's bitwise. Older snapshots are removed a step after every rank
    holds newer ones (here the run ended first: steps 2 and 4 are both on disk)."""
    run = ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "train.micro_batch_size=2", f"run.dir={shared_dir}/run",
           "checkpoint.memory_every=2", f"checkpoint.memory_dir={shared_dir}/node-local", "checkpoint.resume=auto"]
    t = make(run)
    t.train(steps=5, files=False)  # snapshots of steps 2 and 4; no checkpoint on disk
    straight = [t.train_step(s).loss for s in range(5, 7)]
    t.free()
    folder = resilience._snapshot_dir(load_config(None, TINY + run))
    files = sorted(os.listdir(folder)) if RANK == 0 else []
    again = make(run)
    resumed = resilience.resume_from_node_local(again)
    at = again.step
    losses = [again.train_step(s).loss for s in range(at, 7)]
    again.free()
    collective_assert(resumed and at == 4 and losses[-2:] == straight and
                      (RANK != 0 or (len(files) == 8 and {f.split("-")[-1] for f in files} == {"s000000002.bin",
                                                                                                  "s000000004.bin"})),
                      f"resumed {resumed} at {at}: {losses} vs {straight}; files {files}")
