"""Activation recomputation on parallel meshes: bitwise the training of recompute = "none".

Run: mpiexec -n 4 python -m pytest tests/parallel/test_recompute.py (also -n 1, 2, 3: meshes that
do not fit the world are left out on every rank alike).

For each mesh that fits the world (one rank; dp; tp + sequence parallelism; pp with 1F1B and
interleaved; cp with ring attention and Ulysses; ZeRO-3 (FSDP) alone, with HSDP, tp, pp and cp,
and ZeRO-2; and their products at 4 ranks) and each of
recompute = full / selective with recompute_every = 1 and 2, with dropout on, 3 training steps
through `Trainer` give exactly (np.array_equal) the losses, gradient norms and global parameters
of recompute = "none" on the same mesh; and that run matches the one-process reference
(COMM_SELF, same global batch) to 1e-10 relative in float64. A full recomputation re-runs the
block's collectives (tp f/g, sequence-parallel gathers, the cp ring or all-to-all) inside backward:
every rank of a group re-runs the same block at the same point, so they match, or the run would
hang or differ.
"""

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, training_problems

from hpcpar.config.load import load_config
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
STEPS = 3
RTOL = 1e-10
# block_size 16: 2cp zigzag chunks for cp <= 4 (x tp = 2 under sequence parallelism); n_head 4:
# whole heads on every tp x cp rank for Ulysses; 4 blocks: one per virtual stage at pp=2 x 2 chunks.
BASE = ["model.vocab_size=256", "model.block_size=16", "model.n_layer=4", "model.n_head=4", "model.n_embd=16",
        "model.dtype=float64", "model.dropout=0.1", "train.micro_batch_size=2", f"train.steps={STEPS}",
        "train.warmup=1", "train.lr=0.01", "train.grad_clip=1.0", "train.seed=7", "run.progress=false"]
TOKENS = np.random.default_rng(0).integers(0, 256, 50_000).astype(np.uint8)
MODES = [("full", 1), ("full", 2), ("selective", 1), ("selective", 2)]

# name -> (ranks, overrides, micro-batches per step). Micro-batch counts give the pipeline
# schedules work to interleave (forwards of later micro-batches before earlier backwards).
MESHES = {
    "one-rank": (1, ["mesh.dp=1", "mesh.tp=1", "mesh.pp=1"], 2),
    "dp2": (2, ["mesh.dp=2", "mesh.pp=1"], 2),
    "tp2-sp": (2, ["mesh.tp=2", "mesh.pp=1", "mesh.sequence_parallel=true"], 2),
    "pp2-1f1b": (2, ["mesh.pp=2", "pipeline.schedule=1f1b"], 3),
    # Zero-bubble: the recomputation runs in B, and the parameter gradients it leaves in W.
    "pp2-zbh1": (2, ["mesh.pp=2", "pipeline.schedule=zbh1"], 3),
    "pp2-zbv": (2, ["mesh.pp=2", "pipeline.schedule=zbv"], 3),
    "cp2-ring": (2, ["mesh.cp=2", "mesh.pp=1", "mesh.cp_impl=ring"], 2),
    "cp2-ulysses": (2, ["mesh.cp=2", "mesh.pp=1", "mesh.cp_impl=ulysses"], 2),
    "dp2-tp2-sp": (4, ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "mesh.sequence_parallel=true"], 2),
    "tp2-sp-pp2-1f1b": (4, ["mesh.tp=2", "mesh.pp=2", "mesh.sequence_parallel=true", "pipeline.schedule=1f1b"], 3),
    "dp2-pp2-interleaved": (4, ["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=interleaved", "pipeline.chunks=2"], 4),
    "cp4-ring": (4, ["mesh.cp=4", "mesh.pp=1", "mesh.cp_impl=ring"], 2),
    "cp2-ulysses-tp2": (4, ["mesh.cp=2", "mesh.tp=2", "mesh.pp=1", "mesh.cp_impl=ulysses"], 2),
    # ZeRO-3 (FSDP): a recomputed block's re-run inside backward reads the parameters its unit's
    # pre-backward gather brought in (the unit wraps the recomputation); ZeRO-2 releases buckets.
    "dp2-z3": (2, ["mesh.dp=2", "mesh.pp=1", "train.zero=3"], 2),
    "dp2-z3-keep": (2, ["mesh.dp=2", "mesh.pp=1", "train.zero=3", "train.reshard_after_forward=false"], 2),
    "dp3-z3": (3, ["mesh.dp=3", "mesh.pp=1", "train.zero=3"], 2),
    "dp3-z2": (3, ["mesh.dp=3", "mesh.pp=1", "train.zero=2"], 2),
    "hsdp2x2-z3": (4, ["mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=2", "train.zero=3"], 2),
    "dp2-tp2-sp-z3": (4, ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "mesh.sequence_parallel=true", "train.zero=3"], 2),
    "dp2-pp2-1f1b-z3": (4, ["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=1f1b", "train.zero=3"], 3),
    "dp2-pp2-zbv-z3": (4, ["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=zbv", "train.zero=3"], 3),
    "tp2-sp-pp2-zbh1": (4, ["mesh.tp=2", "mesh.pp=2", "mesh.sequence_parallel=true", "pipeline.schedule=zbh1"], 5),
    "cp2-ring-dp2-z3": (4, ["mesh.dp=2", "mesh.cp=2", "mesh.pp=1", "mesh.cp_impl=ring", "train.zero=3"], 2),
}


def fits(ranks: int) -> bool:
    """A mesh of `ranks` runs at world size `ranks`; the one-rank mesh runs at every size."""
    return ranks == SIZE or ranks == 1


def run(mesh: str, mode: str, every: int, comm=WORLD):
    """(per-step (loss, grad_norm), global parameters) of STEPS steps on `mesh` with recomputation."""
    _, overrides, m = MESHES[mesh]
    cfg = load_config(None, BASE + overrides + [f"train.microbatches={m}", f"train.recompute={mode}",
                                                f"train.recompute_every={every}"])
    trainer = Trainer(cfg, comm=comm, tokens=TOKENS)
    results = [trainer.train_step(s) for s in range(STEPS)]
    out = [(r.loss, r.grad_norm) for r in results], trainer.global_parameters(), trainer.cfg.mesh.dp * m
    trainer.mesh.free()   # MPI has a few thousand communicators per process; a mesh holds dozens
    return out


_none_cache: dict = {}
_reference_cache: dict = {}


def none_run(mesh: str):
    if mesh not in _none_cache:
        comm = MPI.COMM_SELF if MESHES[mesh][0] == 1 else WORLD
        _none_cache[mesh] = run(mesh, "none", 1, comm)
    return _none_cache[mesh]


def reference(microbatches: int):
    """The one-process run of the same global batch, recompute = "none"."""
    if microbatches not in _reference_cache:
        cfg = load_config(None, BASE + ["mesh.dp=1", "mesh.tp=1", "mesh.pp=1", f"train.microbatches={microbatches}"])
        trainer = Trainer(cfg, comm=MPI.COMM_SELF, tokens=TOKENS)
        results = [trainer.train_step(s) for s in range(STEPS)]
        _reference_cache[microbatches] = ([(r.loss, r.grad_norm) for r in results], trainer.global_parameters())
        trainer.mesh.free()
    return _reference_cache[microbatches]


def cases():
    for mesh, (ranks, _, _) in MESHES.items():
        if fits(ranks):
            for mode, every in MODES:
                yield pytest.param(mesh, mode, every, id=f"{mesh}-{mode}-every{every}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh,mode,every", list(cases()))
def test_recomputation_is_bitwise_none(mesh, mode, every):
    comm = MPI.COMM_SELF if MESHES[mesh][0] == 1 else WORLD
    steps, params, _ = run(mesh, mode, every, comm)
    want_steps, want_params, microbatches = none_run(mesh)
    problems = [f"step {s}: (loss, grad norm) {got} vs {want}"
                for s, (got, want) in enumerate(zip(steps, want_steps)) if got != want]
    problems += [f"{name} differs" for name in want_params if not np.array_equal(params[name], want_params[name])]
    collective_assert(not problems, f"{mesh} {mode} every {every} vs none: " + "; ".join(problems[:3]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [m for m, (ranks, _, _) in MESHES.items() if ranks == SIZE and ranks > 1])
def test_none_matches_the_one_process_model(mesh):
    """The runs recomputation is compared with are the single-process model's, to 1e-10 (float64)."""
    steps, params, microbatches = none_run(mesh)
    ref_steps, ref_params = reference(microbatches)

    class Step:  # training_problems reads StepResults
        def __init__(self, loss, grad_norm):
            self.loss, self.grad_norm = loss, grad_norm
    problems = training_problems([Step(*s) for s in steps], ref_steps, params, ref_params, RTOL)
    collective_assert(not problems, f"{mesh}: " + "; ".join(problems[:3]))


@pytest.mark.timeout(120)
@pytest.mark.skipif(SIZE < 2, reason="one rank gathers nothing")
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_zero3_recomputation_gathers_no_unit_more_often_than_none(mode):
    """ZeRO-3 wraps each block's unit around its recomputation: the re-run inside backward runs
    on the parameters the unit's pre-backward gather brought in, so a step issues exactly the
    gathers (and unit forwards) of recompute = "none"; the re-run is no unit forward of its own."""
    def events(recompute):
        cfg = load_config(None, BASE + [f"mesh.dp={SIZE}", "mesh.pp=1", "train.zero=3", "train.microbatches=2",
                                        f"train.recompute={recompute}"])
        trainer = Trainer(cfg, comm=WORLD, tokens=TOKENS)
        trainer.train_step(0)
        counts: dict = {}
        for kind, unit, _ in trainer.dp.events:
            if kind in ("gather", "forward_begin", "backward_begin"):
                counts[(kind, unit)] = counts.get((kind, unit), 0) + 1
        trainer.mesh.free()
        return counts
    got, want = events(mode), events("none")
    collective_assert(got == want and want[("gather", "h.1")] >= 2,
                      f"{mode}: {sorted(set(got.items()) ^ set(want.items()))[:6]}")
