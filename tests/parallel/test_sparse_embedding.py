"""Untied embeddings (model.tie_embeddings = false) with wte's gradient synced as (row id, row) pairs.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_sparse_embedding.py (other sizes skip).
float64, 3 training steps of the parallel Trainer against a Trainer on a 1x1x1 mesh (COMM_SELF,
same seed and global batch) to 1e-10 relative: losses, gradient norms and every global parameter
(lm_head.weight included), on dp=4, dp=2 x tp=2 (wte vocab-parallel: sparse per tp shard),
pp=2 x dp=2, cp=2 x dp=2, ZB-V and experts (ep=2 x dp=4, also under ZeRO-1), ZeRO-1, ZeRO-2
and ZeRO-3 (each row to its owner: dp=4, an uneven row split of 1003 rows, dp=2 x tp=2, HSDP,
ZeRO-3 under pp=2 x dp=2), with and without packed documents. The vocabulary (1024 ids, of which
the data uses 256) is large against a rank's 32 tokens, so the sparse path is taken: its counter says so
on every rank holding wte. With many tokens per rank and the whole vocabulary in use, dense wins
and is taken, and the result equals the run with train.sparse_embedding = "never" (the dense
all-reduce, or ZeRO's reduce-scatter, of wte). An untied checkpoint reshards lm_head.weight by
its name like every weight, and a ZeRO-2/3 checkpoint of wte's row shards resumes on another mesh.
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

# name -> (overrides, micro-batches per dp rank); wte's sync is the sparse one on every layout
LAYOUTS = {
    "dp4": (["mesh.dp=4", "mesh.pp=1", "model.dropout=0.1"], 1),
    "dp2-tp2": (["mesh.dp=2", "mesh.tp=2", "mesh.pp=1"], 2),
    "pp2-dp2": (["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=1f1b"], 2),
    "cp2-dp2": (["mesh.dp=2", "mesh.cp=2", "mesh.pp=1"], 2),
    "pp2-dp2-zbv": (["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=zbv"], 2),
    "moe-ep2-dp4": (["mesh.dp=4", "mesh.pp=1", "mesh.ep=2", "model.moe_experts=4", "model.moe_top_k=2"], 1),
    "dp4-zero1": (["mesh.dp=4", "mesh.pp=1", "train.zero=1"], 1),
    "moe-ep2-dp4-zero1": (["mesh.dp=4", "mesh.pp=1", "mesh.ep=2", "model.moe_experts=4", "model.moe_top_k=2",
                           "train.zero=1"], 1),
    "dp4-zero2": (["mesh.dp=4", "mesh.pp=1", "train.zero=2"], 1),
    "dp4-zero2-uneven": (["mesh.dp=4", "mesh.pp=1", "train.zero=2", "model.vocab_size=1003"], 1),
    "dp2-tp2-zero1": (["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "train.zero=1"], 2),
    "hsdp-zero2": (["mesh.dp=4", "mesh.dp_replicate=2", "mesh.pp=1", "train.zero=2"], 1),
    "dp4-zero3": (["mesh.dp=4", "mesh.pp=1", "train.zero=3"], 1),
    "dp4-zero3-uneven": (["mesh.dp=4", "mesh.pp=1", "train.zero=3", "model.vocab_size=1003"], 1),
    "dp2-tp2-zero3": (["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "train.zero=3"], 2),
    "pp2-dp2-zero3": (["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=1f1b", "train.zero=3"], 2),
    "hsdp-zero3": (["mesh.dp=4", "mesh.dp_replicate=2", "mesh.pp=1", "train.zero=3"], 1),
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
    overrides, m = LAYOUTS[name]
    results, params, sync = run(overrides + [f"train.microbatches={m}"], packing)
    model = tuple(o for o in overrides if o.startswith("model."))
    ref_steps, ref_params = reference(model + (f"train.microbatches={dp_of(overrides) * m}",), packing)
    problems = training_problems(results, ref_steps, params, ref_params, RTOL)
    if "lm_head.weight" not in params:
        problems.append("no lm_head.weight among the global parameters")
    counters = [c for c in sparse_steps_everywhere(sync) if c is not None]
    if not counters or any(c != (STEPS, 0) for c in counters):
        problems.append(f"the sparse path was not taken every step on every rank holding wte: {counters}")
    collective_assert(not problems, f"{name}/{packing}: " + "; ".join(problems[:3]))


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE != 4, reason="the layouts of 4 ranks")
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_dense_wins_with_many_tokens_per_rank_and_equals_never(zero):
    # 256 ids. DDP, 256 tokens per rank: about 160 distinct rows, (n-1)/n 640 (C s + 8) > 2 (n-1)/n
    # V C s. ZeRO (the reduce-scatter's (n-1)/n V C s): 1024 tokens per rank, about 250 distinct
    # rows, of which 3/4 leave the rank: 3/4 1000 (C s + 8) > 3/4 V C s.
    m = 2 if zero == 0 else 8
    overrides = ["model.vocab_size=256", "mesh.dp=4", "mesh.pp=1", "train.micro_batch_size=8",
                 f"train.microbatches={m}", f"train.zero={zero}"]
    results, params, sync = run(overrides, "none")
    _, dense, none = run(overrides + ["train.sparse_embedding=never"], "none")
    ref_steps, ref_params = reference(("model.vocab_size=256", "train.micro_batch_size=8",
                                       f"train.microbatches={4 * m}"), "none")
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
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_sparse_equals_dense_sync_and_sends_fewer_bytes(zero):
    overrides = ["mesh.dp=4", "mesh.pp=1", "train.microbatches=1", f"train.zero={zero}"]
    results, params, sync = run(overrides, "none")
    _, dense, _ = run(overrides + ["train.sparse_embedding=never"], "none")
    problems = [f"{n} differs from the dense run" for n in params if rel_err(params[n], dense[n]) > RTOL]
    last = sync["last"]
    pair = 16 * 8 + 8
    if zero == 0:
        # What this rank sent: the counts' all-gather, then its k ids and rows to each of the 3 others.
        counts = last["counts"]
        expected = 3 * 8 + 3 * last["rows"] * pair
        total = sum(counts)
    else:
        # The [4, 4] count matrix's all-gather (a row of 4 int64), then each of its rows whose
        # owner (256 rows each) is another rank, once.
        k = np.array(last["counts"])
        expected = 3 * 4 * 8 + (k[WORLD.Get_rank()].sum() - k[WORLD.Get_rank(), WORLD.Get_rank()]) * pair
        total = int(k.sum())
        if k[WORLD.Get_rank()].sum() != last["rows"] or k.shape != (4, 4):
            problems.append(f"count matrix {k.tolist()} does not hold this rank's {last['rows']} rows")
    if last["sent"] != expected:
        problems.append(f"sent {last['sent']} bytes for wte, expected {expected}")
    if not (last["sparse"] and total < 4 * 32 + 1 and last["sparse_bytes"] < last["dense_bytes"] / 4):
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


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE != 4, reason="the layouts of 4 ranks")
@pytest.mark.parametrize("zero", [2, 3])
def test_row_shards_of_wte_save_and_resume_on_another_mesh(shared_dir, zero):
    # ZeRO-2/3 on dp=4 saves wte's parameters and AdamW moments as each owner's rows; resumed on
    # dp=2 x tp=2 under ZeRO-1 (other owners, vocab-parallel wte), the next step equals the
    # uninterrupted run's.
    first = Trainer(load_config(None, BASE + ["mesh.dp=4", "mesh.pp=1", f"train.zero={zero}",
                                              "train.microbatches=1"]), comm=WORLD, tokens=DATA["none"])
    for s in range(2):
        first.train_step(s)
    path = first.save(shared_dir, keep=2)
    saved = first.global_parameters()
    on = first.train_step(2)
    after = first.global_parameters()
    first.free()
    t = Trainer(load_config(None, BASE + ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "train.zero=1",
                                          "train.microbatches=2"]), comm=WORLD, tokens=DATA["none"])
    t.load(str(path))
    got = t.global_parameters()
    resumed = t.train_step(2)
    again = t.global_parameters()
    t.free()
    problems = [f"{n} differs after loading" for n in saved if not np.array_equal(got[n], saved[n])]
    problems += [f"{n} differs after the resumed step" for n in after if rel_err(again[n], after[n]) > RTOL]
    if abs(resumed.loss - on.loss) > RTOL * abs(on.loss):
        problems.append(f"resumed loss {resumed.loss} != {on.loss}")
    collective_assert(not problems, "; ".join(problems[:3]))
