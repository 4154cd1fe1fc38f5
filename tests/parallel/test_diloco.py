"""Local SGD and DiLoCo (train.sync = "local" / "diloco", hpcpar/parallel/dp/outer.py) against
the single-process model, under `mpiexec -n 4`.

- H = 1, outer SGD with lr 1 and no momentum, inner SGD: ordinary data parallelism, i.e. the
  single-process run on the whole global batch, on every mesh with a replica axis (tp + sp, pp,
  cp, ZeRO 1-3, experts).
- Any H, AdamW inside, Nesterov outside, clipping and dropout, streaming fragments with a delay
  and a mix: the replicas trained alone, each on its share of the global batch by one process,
  with the outer step written out here in NumPy (`reference_diloco`), on several meshes.
- Checkpoints: a resume in the middle of a period, with a fragment in flight and outer
  compression, is bitwise; a reshard inside the replicas is exact; another replica count or
  train.sync = "step" is refused in one line.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, host

from hpcpar.config.load import load_config
from hpcpar.errors import CheckpointError
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
TOKENS = np.random.default_rng(3).integers(0, 256, 6000).astype(np.uint8)
TINY = ["model.n_layer=2", "model.n_embd=16", "model.n_head=2", "model.block_size=8", "model.dtype=float64",
        "train.steps=20", "train.warmup=1", "run.eval_every=0", "run.progress=false", "train.bucket_mb=0.004"]
MBS, M = 2, 2
needs4 = pytest.mark.skipif(SIZE != 4, reason="needs 4 ranks")


def make(overrides, comm=WORLD, mbs=MBS) -> Trainer:
    cfg = load_config(None, TINY + [f"train.micro_batch_size={mbs}", f"train.microbatches={M}"] + overrides)
    return Trainer(cfg, comm=comm, tokens=TOKENS)


def rel(a, b) -> float:
    a, b = np.asarray(host(a), dtype=np.float64), np.asarray(host(b), dtype=np.float64)
    return float(np.max(np.abs(a - b))) / (float(np.max(np.abs(b))) or 1.0)


def dp_of(overrides) -> int:
    return int(next(o for o in overrides if o.startswith("mesh.dp=")).split("=")[1])


# -- H = 1 is data parallelism ---------------------------------------------------------------------

SGD = ["train.optimizer=sgd", "train.momentum=0", "train.weight_decay=0", "train.grad_clip=0", "train.lr=0.05"]
H1_MESHES = [
    ("rep2x2", ["mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=2"]),
    ("rep2x2-z3", ["mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=2", "train.zero=3"]),
    ("rep2-tp2-sp-z1", ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "mesh.dp_replicate=2", "mesh.sequence_parallel=true",
                        "train.zero=1"]),
    ("rep2-pp2-1f1b", ["mesh.dp=2", "mesh.pp=2", "mesh.dp_replicate=2"]),
    ("rep2-cp2-z2", ["mesh.dp=2", "mesh.cp=2", "mesh.pp=1", "mesh.dp_replicate=2", "train.zero=2"]),
    ("rep2x2-moe-ep2", ["mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=2", "mesh.ep=2", "model.moe_experts=2"]),
    ("rep2-pp2-zbv", ["mesh.dp=2", "mesh.pp=2", "mesh.dp_replicate=2", "pipeline.schedule=zbv", "model.n_layer=4"]),
    ("rep2-pp2-interleaved", ["mesh.dp=2", "mesh.pp=2", "mesh.dp_replicate=2", "pipeline.schedule=interleaved",
                              "pipeline.chunks=2", "model.n_layer=4"]),
    ("rep2-cp2-ulysses-recompute", ["mesh.dp=2", "mesh.cp=2", "mesh.pp=1", "mesh.dp_replicate=2",
                                    "mesh.cp_impl=ulysses", "train.recompute=full"]),
]
MODES = [("local", ["train.sync=local"]),
         ("diloco-lr1", ["train.sync=diloco", "train.outer_lr=1", "train.outer_momentum=0"])]


@needs4
@pytest.mark.parametrize("mode", [m for _, m in MODES], ids=[i for i, _ in MODES])
@pytest.mark.parametrize("mesh", [m for _, m in H1_MESHES], ids=[i for i, _ in H1_MESHES])
def test_sync_every_step_with_plain_outer_sgd_is_data_parallelism(mesh, mode):
    """H = 1, outer lr 1, no momentum, inner SGD (linear in the gradient): every step averages the
    replicas' parameter change, which is the gradient average of data parallelism: the losses and
    parameters equal the single-process run on the whole global batch."""
    model = [o for o in mesh if o.startswith("model.")]
    steps = 3
    t = make(mesh + mode + SGD + ["train.sync_every=1"])
    losses = [t.train_step(s).loss for s in range(steps)]
    params = t.global_parameters()
    t.free()
    ref = make(model + SGD + ["mesh.dp=1", "mesh.pp=1"], MPI.COMM_SELF, mbs=MBS * dp_of(mesh))
    ref_losses = [ref.train_step(s).loss for s in range(steps)]
    ref_params = ref.global_parameters()
    ref.free()
    worst = max(rel(params[n], ref_params[n]) for n in ref_params)
    collective_assert(rel(losses, ref_losses) <= 1e-12 and worst <= 1e-12,
                      f"{mesh} {mode}: losses {losses} vs {ref_losses}, parameters off by {worst:.1e}")


# -- any H: the replicas trained alone, the outer step written out -----------------------------------

def fragment_of(name: str, n_layer: int, fragments: int) -> int:
    parts = name.split(".")
    if "h" in parts:
        return int(parts[parts.index("h") + 1]) // (n_layer // fragments)
    return 0 if ("wte" in parts or "wpe" in parts) else fragments - 1


def reference_diloco(overrides: list, replicas: int, shards: int, steps: int) -> tuple[list, dict]:
    """`replicas` one-process trainers, replica r on the sample ids of dp ranks r*shards ..
    (r+1)*shards - 1 of the global batch, synchronised by the outer step of the DiLoCo paper
    (fragments, delay and mix as train.sync_* say). Returns (the mean loss per step, replica 0's
    parameters). Not collective."""
    cfg = load_config(None, TINY + overrides)
    t = cfg.train
    dp = replicas * shards
    trainers = []
    for r in range(replicas):
        tr = make(overrides + ["mesh.dp=1", "mesh.tp=1", "mesh.pp=1", "mesh.cp=1", "mesh.dp_replicate=1",
                               "train.sync=step", "train.sync_fragments=1", "train.sync_delay=0", "train.sync_mix=0"],
                  MPI.COMM_SELF, mbs=MBS * shards)
        tr.sample_ids = (lambda step=None, r=r: [range((j * dp + r * shards) * MBS,
                                                       (j * dp + r * shards + shards) * MBS) for j in range(M)])
        trainers.append(tr)
    params = [dict(tr.named_parameters) for tr in trainers]
    names = sorted(params[0])
    anchor = {n: host(params[0][n].data).copy() for n in names}
    momentum = {n: np.zeros_like(anchor[n]) for n in names}
    frag = {n: fragment_of(n, cfg.model.n_layer, t.sync_fragments) for n in names}
    period = t.sync_every // t.sync_fragments
    landing: dict[int, int] = {}
    losses = []
    for s in range(steps):
        losses.append(float(np.mean([tr.train_step(s).loss for tr in trainers])))
        for f, due in sorted(landing.items()):
            if due == s:
                for n in names:
                    if frag[n] == f:
                        for p in params:
                            p[n].data[...] = t.sync_mix * host(p[n].data) + (1 - t.sync_mix) * anchor[n]
                del landing[f]
        for f in range(t.sync_fragments):
            if (s + 1) % t.sync_every != ((f + 1) * period) % t.sync_every:
                continue
            for n in names:
                if frag[n] != f:
                    continue
                delta = sum(anchor[n] - host(p[n].data) for p in params) / replicas
                if t.sync == "local":
                    anchor[n] = anchor[n] - delta
                else:
                    momentum[n] = t.outer_momentum * momentum[n] + delta
                    step = delta + t.outer_momentum * momentum[n] if t.outer_nesterov else momentum[n]
                    anchor[n] = anchor[n] - t.outer_lr * step
            landing[f] = s + t.sync_delay
            if t.sync_delay == 0:
                for n in names:
                    if frag[n] == f:
                        for p in params:
                            p[n].data[...] = t.sync_mix * host(p[n].data) + (1 - t.sync_mix) * anchor[n]
                del landing[f]
    out = trainers[0].global_parameters()
    for tr in trainers:
        tr.free()
    return losses, out


ADAM = ["model.dropout=0.1", "train.lr=0.01", "train.grad_clip=0.3"]
ANY_H = [
    ("diloco-H3-rep2-tp2", ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "mesh.dp_replicate=2", "train.sync=diloco",
                            "train.sync_every=3"], 2, 1),
    ("local-H2-rep2-pp2-z1", ["mesh.dp=2", "mesh.pp=2", "mesh.dp_replicate=2", "train.sync=local",
                              "train.sync_every=2", "train.zero=1"], 2, 1),
    ("diloco-heavyball-H3-rep2x2-z3", ["mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=2", "train.sync=diloco",
                                       "train.sync_every=3", "train.zero=3", "train.outer_nesterov=false"], 2, 2),
    ("streaming-F2-delay1-mix-rep4", ["mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=4", "train.sync=diloco",
                                      "train.sync_every=4", "train.sync_fragments=2", "train.sync_delay=1",
                                      "train.sync_mix=0.5"], 4, 1),
    ("streaming-F2-rep2-pp2", ["mesh.dp=2", "mesh.pp=2", "mesh.dp_replicate=2", "train.sync=diloco",
                               "train.sync_every=2", "train.sync_fragments=2", "train.sync_delay=1"], 2, 1),
]


@needs4
@pytest.mark.parametrize("case", [c[1:] for c in ANY_H], ids=[c[0] for c in ANY_H])
def test_diloco_equals_the_replicas_trained_alone_and_synchronised_by_hand(case):
    """AdamW inside (clipping by each replica's own norm, dropout), the outer step every H steps:
    the losses and replica 0's parameters equal one-process replicas synchronised by NumPy."""
    overrides, replicas, shards = case
    steps = 7
    t = make(ADAM + overrides)
    losses = [t.train_step(s).loss for s in range(steps)]
    params = t.global_parameters()
    t.free()
    ref_losses, ref_params = reference_diloco(ADAM + overrides, replicas, shards, steps)
    worst = max(rel(params[n], ref_params[n]) for n in ref_params)
    diverged = rel(losses[1:], [losses[0]] * (steps - 1)) > 1e-6  # the run did train
    collective_assert(rel(losses, ref_losses) <= 1e-12 and worst <= 1e-12 and diverged,
                      f"{overrides}: losses {losses} vs {ref_losses}, replica 0's parameters off by {worst:.1e}")


@needs4
def test_outer_compression_is_the_same_on_every_layout_and_costs_fewer_bytes():
    """bf16 codes are elementwise and int8 blocks follow whole parameters (tp = 1, ZeRO <= 2), so
    a compressed outer gradient does not depend on the layout inside a replica; the replica axis
    carries the codes' bytes."""
    base = ADAM + ["train.sync=diloco", "train.sync_every=2", "mesh.dp_replicate=2"]
    for kind in ("bf16", "int8"):
        runs = []
        for mesh, mbs in ((["mesh.dp=2", "mesh.pp=2"], MBS), (["mesh.dp=4", "mesh.pp=1", "train.zero=1"], MBS // 2)):
            t = make(base + mesh + [f"train.outer_compression={kind}"], mbs=mbs)
            results = [t.train_step(s) for s in range(4)]
            runs.append(([r.loss for r in results], t.global_parameters(), results[1].traffic["outer_bytes_sent"]))
            t.free()
        (l1, p1, _), (l2, p2, sent) = runs
        worst = max(rel(p1[n], p2[n]) for n in p2)
        n = sum(v.size for v in p2.values())
        per_value = {"bf16": 2, "int8": 1 + 4 / 256}[kind]
        collective_assert(rel(l1, l2) <= 1e-12 and worst <= 1e-12,
                          f"{kind}: layouts differ, losses {l1} vs {l2}, parameters {worst:.1e}")
        collective_assert(0 < sent <= n * per_value * 1.1 + 4096,
                          f"{kind}: {sent} bytes on the replica axis for {n} parameters")


# -- checkpoints ----------------------------------------------------------------------------------

STREAM = ADAM + ["train.sync=diloco", "train.sync_every=4", "train.sync_fragments=2", "train.sync_delay=1",
                 "mesh.dp_replicate=2", "train.outer_compression=bf16"]


@needs4
@pytest.mark.parametrize("mesh, mbs", [(["mesh.dp=2", "mesh.tp=2", "mesh.pp=1"], MBS),
                                       (["mesh.dp=4", "mesh.pp=1", "train.zero=1"], MBS // 2)],
                         ids=["tp2", "shard2-z1"])
def test_resume_with_a_fragment_in_flight_is_bitwise(shared_dir, mesh, mbs):
    """Save after step 5 (fragment 0 started after step 5 and lands after step 6; error-feedback
    residuals and momentum live), resume, and steps 6..8 equal the uninterrupted run bitwise
    (with dp_shard = 2 each shard rank sends half of the codes over the replicas)."""
    t = make(STREAM + mesh, mbs=mbs)
    for s in range(6):
        t.train_step(s)
    path = t.save(os.path.join(shared_dir, "diloco"), keep=1)
    straight = [t.train_step(s).loss for s in range(6, 9)]
    params = t.global_parameters()
    t.free()
    u = make(STREAM + mesh, mbs=mbs)
    meta = u.load(path)
    resumed = [u.train_step(s).loss for s in range(6, 9)]
    params2 = u.global_parameters()
    u.free()
    same = all(np.array_equal(host(params[n]), host(params2[n])) for n in params)
    collective_assert(meta["sync"]["landing"] == {"0": 6} and resumed == straight and same,
                      f"landing {meta['sync']}: {resumed} vs {straight}, parameters equal: {same}")


@needs4
def test_reshard_inside_the_replicas_is_exact_and_other_replica_counts_are_refused(shared_dir):
    base = ADAM + ["train.sync=diloco", "train.sync_every=3", "mesh.dp_replicate=2"]
    t = make(base + ["mesh.dp=2", "mesh.pp=2"])
    for s in range(4):
        t.train_step(s)
    path = t.save(os.path.join(shared_dir, "reshard"), keep=1)
    straight = [t.train_step(s).loss for s in range(4, 7)]
    t.free()
    u = make(base + ["mesh.dp=4", "mesh.pp=1", "train.zero=3"], mbs=MBS // 2)
    u.load(path)
    resumed = [u.train_step(s).loss for s in range(4, 7)]
    u.free()
    collective_assert(rel(resumed, straight) <= 1e-12, f"dp_shard 1 x pp 2 -> dp_shard 2 x ZeRO-3: {resumed} vs "
                                                        f"{straight}")
    for other in (["mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=4", "train.sync=diloco"],
                  ["mesh.dp=2", "mesh.pp=2", "mesh.dp_replicate=1", "train.sync=step"]):
        v = make(ADAM + ["train.sync_every=3"] + other, mbs=MBS // 2 if "mesh.dp=4" in other else MBS)
        with pytest.raises(CheckpointError) as err:
            v.load(path)
        v.free()
        assert "train.sync=\"diloco\", 2 replicas" in str(err.value) and "\n" not in str(err.value), err.value


@needs4
def test_a_synchronous_checkpoint_starts_every_replica(shared_dir):
    """A checkpoint of train.sync = "step" loads into a DiLoCo run: every replica takes its model
    and optimizer state and the anchor starts there, so the first step equals the synchronous
    run's next step on each replica's share (its loss is the same global mean)."""
    mesh = ["mesh.dp=4", "mesh.pp=1", "train.zero=1"]
    t = make(ADAM + mesh, mbs=MBS // 2)
    for s in range(2):
        t.train_step(s)
    path = t.save(os.path.join(shared_dir, "sync"), keep=1)
    straight = t.train_step(2).loss  # the forward of step 2 does not depend on how it is synced
    t.free()
    u = make(ADAM + mesh + ["mesh.dp_replicate=2", "train.sync=diloco", "train.sync_every=2"], mbs=MBS // 2)
    meta = u.load(path)
    anchors_at_parameters = all(np.array_equal(host(p.anchor), host(p.data)) for p in u.outer.pieces)
    first = u.train_step(2).loss
    u.free()
    collective_assert(meta["step"] == 2 and first == straight and anchors_at_parameters,
                      f"{first} vs {straight}, anchors at the loaded parameters: {anchors_at_parameters}")


@needs4
def test_no_reduction_is_left_running_when_a_run_ends():
    """A run that ends with a fragment's reduction in flight (train.sync_delay) completes it first:
    MPI would otherwise write the result into buffers freed after the run (heap corruption)."""
    t = make(ADAM + ["mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=4", "train.sync=diloco", "train.sync_every=4",
                     "train.sync_fragments=2", "train.sync_delay=1"], mbs=1)
    t.train(steps=6, files=False)  # fragment 0 starts after step 5 and would land after step 6
    flights = dict(t.outer.in_flight)
    t.free()
    collective_assert(list(flights) == [0] and flights[0].due == 6 and flights[0].done, f"{flights}")
