"""Untied embeddings (model.tie_embeddings = false) with wte's gradient synced as (row id, row) pairs.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_sparse_embedding.py (other sizes skip).
float64, 3 training steps of the parallel Trainer against a Trainer on a 1x1x1 mesh (COMM_SELF,
same seed and global batch) to 1e-10 relative: losses, gradient norms and every global parameter
(lm_head.weight included), on dp=4, dp=2 x tp=2 (wte vocab-parallel: sparse per tp shard),
pp=2 x dp=2, cp=2 x dp=2, ZB-V and experts (ep=2 x dp=4), with and without packed documents;
ZeRO-1 and ZeRO-3 keep wte dense and match too. The vocabulary (1024 ids, of which the data uses
256) is large against a rank's 32 tokens, so the sparse path is taken: its counter says so on
every rank holding wte. With many tokens per rank and the whole vocabulary in use, dense wins and
is taken, and the result equals the run with train.sparse_embedding = "never" (the dense
all-reduce of wte). An untied checkpoint reshards lm_head.weight by its name like every weight.
"""

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, rel_err, training_problems

from hpcpar.config.load import load_config
from hpcpar.data import formats
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
STEPS = 3
RTOL = 1e-10
BASE = ["model.vocab_size=1024", "model.block_size=16", "model.n_layer=4", "model.n_head=4", "model.n_embd=16",
        "model.dtype=float64", "model.tie_embeddings=false", "train.micro_batch_size=2", f"train.steps={STEPS}",
        "train.warmup=1", "train.lr=0.01", "train.grad_clip=1.0", "train.seed=7", "run.progress=false"]
_rng = np.random.default_rng(0)
TOKENS = _rng.integers(0, 256, 20_000).astype(np.uint16)
# Long-tailed document lengths, as tests/parallel/test_packing.py.
STARTS = np.unique(np.concatenate([[0], np.cumsum(np.ceil(_rng.pareto(1.2, 4000) * 6)).astype(np.int64)]))
STARTS = STARTS[STARTS < len(TOKENS)]
DATA = {"none": formats.from_tokens(TOKENS, 0.05), "documents": formats.from_tokens(TOKENS, 0.05, STARTS)}

# name -> (overrides, micro-batches per dp rank, whether the sync of wte is DDP's sparse one)
LAYOUTS = {
    "dp4": (["mesh.dp=4", "mesh.pp=1", "model.dropout=0.1"], 1, True),
    "dp2-tp2": (["mesh.dp=2", "mesh.tp=2", "mesh.pp=1"], 2, True),
    "pp2-dp2": (["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=1f1b"], 2, True),
    "cp2-dp2": (["mesh.dp=2", "mesh.cp=2", "mesh.pp=1"], 2, True),
    "pp2-dp2-zbv": (["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=zbv"], 2, True),
    "moe-ep2-dp4": (["mesh.dp=4", "mesh.pp=1", "mesh.ep=2", "model.moe_experts=4", "model.moe_top_k=2"], 1, True),
    "dp4-zero1": (["mesh.dp=4", "mesh.pp=1", "train.zero=1"], 1, False),
    "dp4-zero3": (["mesh.dp=4", "mesh.pp=1", "train.zero=3"], 1, False),
}


def dp_of(overrides) -> int:
    return next((int(o.split("=")[1]) for o in overrides if o.startswith("mesh.dp=")), 1)


def run(overrides: list, packing: str, comm=WORLD):
    t = Trainer(load_config(None, BASE + [f"data.packing={packing}"] + overrides), comm=comm, tokens=DATA[packing])
    results = [t.train_step(s) for s in range(STEPS)]
    params = t.global_parameters()
    sync = getattr(getattr(t.dp, "dense", t.dp), "embedding_sync", None)  # with experts: the dense weights' DDP
    t.free()
    return results, params, sync


_reference_cache: dict = {}


def reference(overrides: tuple, packing: str):
    """(per-step (loss, grad_norm), global parameters) of the 1x1x1 run with `overrides`."""
    key = (overrides, packing)
    if key not in _reference_cache:
        results, params, _ = run(["mesh.dp=1", "mesh.tp=1", "mesh.pp=1", *overrides], packing, MPI.COMM_SELF)
        _reference_cache[key] = ([(r.loss, r.grad_norm) for r in results], params)
    return _reference_cache[key]


def sparse_steps_everywhere(sync) -> list:
    """Every rank's (sparse steps, dense steps) of its wte, or None where it holds none / syncs it in buckets."""
    mine = (sync["steps"]["sparse"], sync["steps"]["dense"]) if sync else None
    return WORLD.allgather(mine)


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE != 4, reason="the layouts of 4 ranks")
@pytest.mark.parametrize("packing", ["none", "documents"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_untied_training_matches_single_process(name, packing):
    overrides, m, sparse = LAYOUTS[name]
    results, params, sync = run(overrides + [f"train.microbatches={m}"], packing)
    model = tuple(o for o in overrides if o.startswith("model."))
    ref_steps, ref_params = reference(model + (f"train.microbatches={dp_of(overrides) * m}",), packing)
    problems = training_problems(results, ref_steps, params, ref_params, RTOL)
    if "lm_head.weight" not in params:
        problems.append("no lm_head.weight among the global parameters")
    counters = [c for c in sparse_steps_everywhere(sync) if c is not None]
    if sparse and (not counters or any(c != (STEPS, 0) for c in counters)):
        problems.append(f"the sparse path was not taken every step on every rank holding wte: {counters}")
    if not sparse and counters:
        problems.append(f"wte was synced apart from the dense buckets under ZeRO: {counters}")
    collective_assert(not problems, f"{name}/{packing}: " + "; ".join(problems[:3]))


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE != 4, reason="the layouts of 4 ranks")
def test_dense_wins_with_many_tokens_per_rank_and_equals_never():
    # 256 ids, 256 tokens per rank: about 160 distinct rows, (n-1)/n 640 (C s + 8) > 2 (n-1)/n V C s.
    overrides = ["model.vocab_size=256", "mesh.dp=4", "mesh.pp=1", "train.micro_batch_size=8",
                 "train.microbatches=2"]
    results, params, sync = run(overrides, "none")
    _, dense, none = run(overrides + ["train.sparse_embedding=never"], "none")
    ref_steps, ref_params = reference(("model.vocab_size=256", "train.micro_batch_size=8",
                                       "train.microbatches=8"), "none")
    problems = training_problems(results, ref_steps, params, ref_params, RTOL)
    problems += [f"{n} differs from the dense run" for n in params if rel_err(params[n], dense[n]) > RTOL]
    if sparse_steps_everywhere(sync) != [(0, STEPS)] * SIZE:
        problems.append(f"dense was not chosen every step: {sparse_steps_everywhere(sync)}")
    if sync["last"]["sparse_bytes"] <= sync["last"]["dense_bytes"]:
        problems.append(f"the formula says sparse is cheaper: {sync['last']}")
    if none:
        problems.append("train.sparse_embedding = never still kept wte out of the buckets")
    collective_assert(not problems, "; ".join(problems[:3]))


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE != 4, reason="the layouts of 4 ranks")
def test_sparse_equals_dense_sync_and_sends_fewer_bytes():
    overrides = ["mesh.dp=4", "mesh.pp=1", "train.microbatches=1"]
    results, params, sync = run(overrides, "none")
    _, dense, _ = run(overrides + ["train.sparse_embedding=never"], "none")
    problems = [f"{n} differs from the dense run" for n in params if rel_err(params[n], dense[n]) > RTOL]
    last = sync["last"]
    counts = last["counts"]
    # What this rank sent: the counts' all-gather, then its k ids and rows to each of the 3 others.
    expected = 3 * 8 + 3 * last["rows"] * (16 * 8 + 8)
    if last["sent"] != expected:
        problems.append(f"sent {last['sent']} bytes for wte, expected {expected}")
    if not (last["sparse"] and sum(counts) < 4 * 32 + 1 and last["sparse_bytes"] < last["dense_bytes"] / 4):
        problems.append(f"unexpected figures {last}")
    collective_assert(not problems, "; ".join(problems[:3]))


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE != 4, reason="the layouts of 4 ranks")
def test_untied_head_saves_and_reshards_by_its_own_name(shared_dir):
    # Saved on dp=2 x tp=2 (lm_head.weight vocab-parallel), loaded on pp=2 x dp=2 (on the last stage,
    # a plain parameter) and on tp=4: every global weight bitwise.
    first = Trainer(load_config(None, BASE + ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "train.microbatches=2"]),
                    comm=WORLD, tokens=DATA["none"])
    for s in range(2):
        first.train_step(s)
    path = first.save(shared_dir, keep=2)
    saved = first.global_parameters()
    first.free()
    problems = []
    for mesh in (["mesh.dp=2", "mesh.pp=2"], ["mesh.tp=4", "mesh.pp=1"]):
        t = Trainer(load_config(None, BASE + mesh + ["train.microbatches=2"]), comm=WORLD, tokens=DATA["none"])
        t.load(str(path))
        got = t.global_parameters()
        t.free()
        problems += [f"{mesh}: {n} differs after loading" for n in saved if not np.array_equal(got[n], saved[n])]
        if "lm_head.weight" not in got or np.array_equal(got["lm_head.weight"], got["transformer.wte.weight"][:1024]):
            problems.append(f"{mesh}: lm_head.weight missing or equal to wte")
    collective_assert(not problems, "; ".join(problems[:3]))
