"""Packed documents (data.packing = "documents") on every mesh against the single-process packed run.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_packing.py (layouts of other sizes skip).
Context parallelism (ring, Ulysses) also op by op: my rows of `document_attention` of the whole
windows and their gradients (1e-12), the ring computing only unmasked pairs and skipping blocks
and K/V messages nobody further along needs (on any world of 2 ranks or more).
Documents of long-tailed lengths (many shorter than block_size, so most windows hold several
segments and cut documents), float64: 3 training steps of the parallel Trainer match a Trainer on
a 1x1x1 mesh (COMM_SELF, same seed and global batch) to 1e-10 relative: losses, gradient norms and
every global parameter. Dropout is on where the layout's masks are the single process's (they
are keyed by sample, not by rank). Mixed precision tracks the one-process packed run of the same
precision to its rounding, as tests/parallel/test_precision.py does. With parameter servers
(synchronous: 3 workers and 1 server, or pp=2 workers and 2 servers, tied and untied embeddings)
the workers' losses, gradient norms and parameters match the one-process packed run too.
"""

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, training_problems

from hpcpar.autograd.attention import document_attention
from hpcpar.autograd.tensor import Tensor
from hpcpar.config.load import load_config
from hpcpar.data import balance, formats, packing
from hpcpar.parallel.cp.attention import ContextParallel, positions
from hpcpar.runtime.comm import Communicator
from hpcpar.training.run import build
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
STEPS = 3
RTOL = 1e-10
ULP = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
BASE = ["model.vocab_size=256", "model.block_size=16", "model.n_layer=4", "model.n_head=4", "model.n_embd=16",
        "model.dtype=float64", "train.micro_batch_size=2", f"train.steps={STEPS}", "train.warmup=1",
        "train.lr=0.01", "train.grad_clip=1.0", "train.seed=7", "run.progress=false", "data.packing=documents"]
_rng = np.random.default_rng(0)
TOKENS = _rng.integers(0, 256, 20_000).astype(np.uint8)
# Long-tailed document lengths (1 .. a few hundred tokens, median ~7): windows of 16 tokens hold
# one to several segments, and begin inside a document more often than not.
STARTS = np.unique(np.concatenate([[0], np.cumsum(np.ceil(_rng.pareto(1.2, 4000) * 6)).astype(np.int64)]))
STARTS = STARTS[STARTS < len(TOKENS)]
DATA = formats.from_tokens(TOKENS, 0.05, STARTS)

# name -> (overrides, micro-batches per dp rank); every one runs on 4 ranks.
LAYOUTS = {
    "dp4": (["mesh.dp=4", "mesh.pp=1", "model.dropout=0.1"], 1),
    "dp2-tp2": (["mesh.dp=2", "mesh.tp=2", "mesh.pp=1"], 2),
    "tp4-sp": (["mesh.tp=4", "mesh.pp=1", "mesh.sequence_parallel=true", "model.dropout=0.1"], 2),
    "pp4-1f1b": (["mesh.pp=4", "pipeline.schedule=1f1b"], 4),
    "pp2-dp2-interleaved": (["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=interleaved", "pipeline.chunks=2"], 2),
    "pp2-tp2-sp-zbv": (["mesh.tp=2", "mesh.pp=2", "pipeline.schedule=zbv", "mesh.sequence_parallel=true"], 3),
    "pp2-dp2-zbh1-full-recompute": (["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=zbh1",
                                     "train.recompute=full"], 2),
    "dp2-tp2-selective": (["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "train.recompute=selective"], 2),
    "dp4-zero1": (["mesh.dp=4", "mesh.pp=1", "train.zero=1"], 1),
    "dp4-zero3-full-recompute": (["mesh.dp=4", "mesh.pp=1", "train.zero=3", "train.recompute=full"], 1),
    "moe-ep2-dp4": (["mesh.dp=4", "mesh.pp=1", "mesh.ep=2", "model.moe_experts=4", "model.moe_top_k=2",
                     "model.moe_capacity_factor=0.75"], 1),
    "moe-ep2-pp2": (["mesh.dp=2", "mesh.pp=2", "mesh.ep=2", "model.moe_experts=4", "model.moe_top_k=2"], 2),
    # Context parallelism: each rank holds T/cp tokens of every window (ring: zigzag chunks of 2
    # tokens at cp=4, so many blocks are wholly masked and skipped), the Documents whole.
    "cp4-ring": (["mesh.cp=4", "mesh.pp=1", "model.dropout=0.1"], 2),
    "cp4-ulysses": (["mesh.cp=4", "mesh.cp_impl=ulysses", "mesh.pp=1", "model.dropout=0.1"], 2),
    "cp2-dp2-ring-selective": (["mesh.cp=2", "mesh.dp=2", "mesh.pp=1", "train.recompute=selective"], 2),
    "cp2-dp2-ulysses-full-recompute": (["mesh.cp=2", "mesh.dp=2", "mesh.cp_impl=ulysses", "mesh.pp=1",
                                        "train.recompute=full"], 2),
    "cp2-tp2-sp-ring": (["mesh.cp=2", "mesh.tp=2", "mesh.pp=1", "mesh.sequence_parallel=true",
                         "model.dropout=0.1"], 2),
    "cp2-tp2-ulysses": (["mesh.cp=2", "mesh.tp=2", "mesh.cp_impl=ulysses", "mesh.pp=1"], 2),
    "cp2-pp2-ring-1f1b": (["mesh.cp=2", "mesh.pp=2", "pipeline.schedule=1f1b"], 2),
}


# data.balance = "attention": the global batch's windows dealt by attention work, so the grouping
# into (dp rank, micro-batch) differs from the one-process run's; the per-token loss does not.
BALANCED = {
    "dp4": (["mesh.dp=4", "mesh.pp=1", "model.dropout=0.1"], 1),
    "dp2-tp2": (["mesh.dp=2", "mesh.tp=2", "mesh.pp=1"], 2),
    "pp2-dp2-1f1b": (["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=1f1b"], 2),
    "cp2-dp2-ring": (["mesh.cp=2", "mesh.dp=2", "mesh.pp=1", "model.dropout=0.1"], 2),
}


def dp_of(overrides) -> int:
    return next((int(o.split("=")[1]) for o in overrides if o.startswith("mesh.dp=")), 1)


def run(overrides: list, comm=WORLD):
    t = Trainer(load_config(None, BASE + overrides), comm=comm, tokens=DATA)
    results = [t.train_step(s) for s in range(STEPS)]
    params = t.global_parameters()
    t.free()
    return results, params


_reference_cache: dict = {}


def reference(overrides: tuple):
    """(per-step (loss, grad_norm), global parameters) of the 1x1x1 packed run with `overrides`
    (the model and precision: everything but the mesh)."""
    if overrides not in _reference_cache:
        results, params = run(["mesh.dp=1", "mesh.tp=1", "mesh.pp=1", *overrides], MPI.COMM_SELF)
        _reference_cache[overrides] = ([(r.loss, r.grad_norm) for r in results], params)
    return _reference_cache[overrides]


def model_overrides(overrides) -> tuple:
    return tuple(o for o in overrides if o.startswith(("model.", "train.precision")))


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE != 4, reason="the layouts of 4 ranks")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_training_matches_single_process(name):
    overrides, m = LAYOUTS[name]
    results, params = run(overrides + [f"train.microbatches={m}"])
    ref_steps, ref_params = reference(model_overrides(overrides) + (f"train.microbatches={dp_of(overrides) * m}",))
    problems = training_problems(results, ref_steps, params, ref_params, RTOL)
    collective_assert(not problems, f"{name}: " + "; ".join(problems[:3]))


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE != 4, reason="the layouts of 4 ranks")
@pytest.mark.parametrize("mesh", [("mesh.tp=2", "mesh.sequence_parallel=true"), ("mesh.cp=2", "mesh.cp_impl=ring")],
                         ids=["tp2-sp", "cp2-ring"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_packed_mixed_precision_tracks_the_one_process_run(precision, mesh):
    # As test_precision.py: no biases (one starting at 0 has no scale to round against) and SGD (AdamW
    # turns a rounding-sized gradient into a full-sized step).
    model = ("model.bias=false", "train.optimizer=sgd", "train.momentum=0.9", f"train.precision={precision}")
    overrides = ["mesh.dp=2", "mesh.pp=1", *mesh, *model]
    results, params = run(overrides + ["train.microbatches=2"])
    ref_steps, ref_params = reference(model + ("train.microbatches=4",))
    problems = (training_problems(results, ref_steps, {}, {}, ULP[precision] / 4)
                + training_problems([], [], params, ref_params, 2 * ULP[precision]))
    collective_assert(not any(r.skipped for r in results) and not problems, f"{precision}: {problems[:3]}")


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE != 4, reason="the layouts of 4 ranks")
@pytest.mark.parametrize("name", list(BALANCED))
def test_balanced_packed_training_matches_single_process(name):
    """Dealt by attention work, equal to the one-process run dealt in sample-id order (whose
    micro-batches group the windows otherwise): the per-token loss does not depend on the grouping."""
    overrides, m = BALANCED[name]
    dp = dp_of(overrides)
    results, params = run(overrides + [f"train.microbatches={m}", "data.balance=attention"])
    ref_steps, ref_params = reference(model_overrides(overrides) + (f"train.microbatches={dp * m}",))
    problems = training_problems(results, ref_steps, params, ref_params, RTOL)
    dealt = balance.deal(DATA, "train", 7, 0, dp, m, 2, 16, "documents", "attention")
    if {frozenset(ids.tolist()) for ids in dealt.ids.reshape(-1, 2)} == \
            {frozenset(ids.tolist()) for ids in balance.in_order(dp, m, 2).reshape(-1, 2)}:
        problems.append("the dealing is the sample-id order's grouping: nothing here is regrouped")
    collective_assert(not problems, f"{name}: " + "; ".join(problems[:3]))


@pytest.mark.timeout(120)
@pytest.mark.skipif(SIZE != 4, reason="the layouts of 4 ranks")
def test_packing_changes_the_run():
    """The packed run is not today's stream run (the test above could not pass by ignoring packing)."""
    overrides = ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "train.microbatches=2"]
    packed, _ = run(overrides)
    plain, _ = run(overrides + ["data.packing=none"])
    collective_assert(abs(packed[0].loss - plain[0].loss) > 1e-6, f"same loss {packed[0].loss} either way")


def cp_of_packed(documents, h: int, rng, impl: str = "ring", d: int = 3) -> tuple[list, dict, list]:
    """`impl` attention over WORLD of random q, k, v [B, T, 3 h d] of the windows of `documents` (each
    rank its columns, `cp.positions(T, documents)`), forward and backward, against `document_attention`
    of the whole windows: (problems: output or gradient off by more than 1e-12, this rank's
    `cp.stats`, every rank's positions)."""
    b, t = len(documents.starts), documents.block_size
    qkv, g = rng.standard_normal((b, t, 3 * h * d)), rng.standard_normal((b, t, h * d))
    whole = Tensor(qkv.copy(), requires_grad=True)
    want = document_attention(whole, h, documents)
    want.backward(g)
    comm = Communicator(WORLD.Dup(), "cp-packed-test")
    try:
        cp = ContextParallel(comm, impl)
        cols = cp.positions(t, documents)
        mine = Tensor(qkv[:, cols].copy(), requires_grad=True)
        got = cp.attention(mine, h, documents=documents)
        got.backward(g[:, cols])
        stats, held = dict(cp.stats), cp.held(t, documents)
    finally:
        comm.free()
    problems = [f"{what}: {err:.1e}" for what, err in
                (("output", np.abs(got.data - want.data[:, cols]).max() / np.abs(want.data).max()),
                 ("grad", np.abs(mine.grad - whole.grad[:, cols]).max() / np.abs(whole.grad).max()))
                if not err <= 1e-12]
    return problems, stats, held


@pytest.mark.skipif(SIZE < 2, reason="context parallelism needs >= 2 ranks")
@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_cp_attention_of_packed_windows_is_document_attention(impl):
    """Ring attention and Ulysses over the world on packed windows of short documents (<= 6 tokens,
    zigzag chunks of 4): my rows of `document_attention` and of its gradient; the attention work
    is exactly the unmasked pairs; the ring skips blocks and sends fewer K/V bytes than unmasked."""
    b, t, h, d = 2, 8 * SIZE, SIZE, 3
    rng = np.random.default_rng(11)
    doc_starts = np.concatenate([[0], np.cumsum(rng.integers(1, 7, 4 * t))]).astype(np.int64)
    documents, _ = packing.Documents.of_windows(doc_starts, np.array([3, t + 5]), t)
    problems, mine, _ = cp_of_packed(documents, h, rng, impl, d)   # ring: the chunks dealt by attention work
    stats = WORLD.allgather(mine)
    unmasked = h * sum(len(rows) * n * (n + 1) // 2 for n, rows, _ in documents.segments())
    if sum(s["pairs"] for s in stats) != unmasked:
        problems.append(f"pairs {[s['pairs'] for s in stats]}, unmasked {unmasked}")
    if impl == "ring":
        kv = 2 * b * h * (t // SIZE) * d * 8
        unmasked_ring = SIZE * (2 * (SIZE - 1) * kv + SIZE * kv)   # every rank: K/V twice around, dK/dV
        sent = sum(s["bytes_sent"] for s in stats)
        if SIZE > 2 and not (sum(s["skipped"] for s in stats) and sent < unmasked_ring):
            problems.append(f"nothing skipped: {stats}")
    collective_assert(not problems, f"{impl}: " + "; ".join(problems))


@pytest.mark.skipif(SIZE < 2, reason="context parallelism needs >= 2 ranks")
def test_ring_deals_packed_chunks_by_attention_work():
    """A micro-batch whose token-zigzag is unbalanced (a document starts 3/4 into each window, so
    the last chunks are light): the ring runs on the work-balanced layout, every rank's unmasked
    pairs (`cp.stats`) are its chunks' work, the busiest rank's below zigzag's, and the output and
    gradient are still my rows of `document_attention` of the whole windows."""
    t, h = 8 * SIZE, 2
    doc_starts = np.array([0, 3 * t // 4, t + 3 * t // 4, 2 * t + 5], dtype=np.int64)
    documents, _ = packing.Documents.of_windows(doc_starts, np.array([0, t]), t)
    problems, stats, held = cp_of_packed(documents, h, np.random.default_rng(5))
    pairs = np.array(WORLD.allgather(stats["pairs"]))
    per_position = (documents.positions() + 1).sum(axis=0)          # unmasked pairs of each query column
    balanced = np.array([per_position[p].sum() for p in held])
    zigzag = np.array([per_position[positions("zigzag", t, SIZE, r)].sum() for r in range(SIZE)])
    if not np.array_equal(pairs, h * balanced):
        problems.append(f"pairs per rank {pairs.tolist()}, the balanced layout's {(h * balanced).tolist()}")
    if not pairs.max() / pairs.mean() < zigzag.max() / zigzag.mean():
        problems.append(f"max/mean {pairs.max() / pairs.mean():.3f}, token-zigzag {zigzag.max() / zigzag.mean():.3f}")
    collective_assert(not problems, "; ".join(problems))


def _box_elements(documents, held: list, rank: int, per_piece: bool) -> int:
    """Score elements (per head) rank `rank`'s ring blocks compute over the windows of `documents`
    with every rank's positions `held`: the smallest box holding a block's unmasked pairs, per row
    and (chunk, chunk) of the block (`per_piece`), or one over all rows and chunks (times B)."""
    first = np.arange(documents.block_size) - documents.positions()          # [B, T] segment starts
    q, total = held[rank], 0
    for k in held:
        allowed = (q[:, None] >= k[None, :]) & (k[None, None, :] >= first[:, q][:, :, None])   # [B, Tq, Tk]
        pieces = [allowed.any(axis=0)]
        if per_piece:
            half = len(q) // 2                                                   # my two zigzag chunks
            pieces = [c for row in allowed for a in np.split(row, [half], axis=0) for c in np.split(a, [half], axis=1)]
        for piece in pieces:
            r, c = np.flatnonzero(piece.any(axis=1)), np.flatnonzero(piece.any(axis=0))
            if r.size:
                total += (1 if per_piece else len(allowed)) * (r[-1] - r[0] + 1) * (c[-1] - c[0] + 1)
    return int(total)


@pytest.mark.skipif(SIZE < 2, reason="context parallelism needs >= 2 ranks")
def test_ring_computes_a_box_per_row_and_chunk_of_packed_windows():
    """Windows whose documents start at different places (a row of one segment, a row of short
    documents, a row cut late): each rank's ring computes per row and (chunk, chunk) of a block the
    smallest box of its pairs (`cp.stats["elements"]`), fewer elements than one box over all rows
    and chunks, and its rows of `document_attention` and their gradient still."""
    t, h = 8 * SIZE, 2
    rng = np.random.default_rng(3)
    short = np.cumsum(rng.integers(1, 5, t)) + 2 * t
    doc_starts = np.concatenate([[0], [2 * t], short[short < 3 * t], [3 * t + t - 3, 5 * t]]).astype(np.int64)
    documents, _ = packing.Documents.of_windows(doc_starts, np.array([t // 2, 2 * t, 3 * t]), t)
    problems, stats, held = cp_of_packed(documents, h, rng)
    rank = WORLD.Get_rank()
    pieces, shared = _box_elements(documents, held, rank, True), _box_elements(documents, held, rank, False)
    if not (stats["pairs"] <= stats["elements"] == h * pieces):
        problems.append(f"elements {stats['elements']}, pairs {stats['pairs']}, per-piece boxes {h * pieces}")
    fewer = WORLD.allreduce(int(pieces < shared), MPI.SUM)
    if WORLD.allreduce(int(pieces > shared), MPI.SUM) or not fewer:
        problems.append(f"per-piece boxes {pieces}, shared box {shared} (ranks with fewer: {fewer})")
    collective_assert(not problems, f"rank {rank}: " + "; ".join(problems))


# Synchronous parameter servers: (overrides, micro-batches per replica); the workers' mesh is 4 - servers ranks.
SERVERS = {
    "dp3-1server": (["mesh.dp=3", "mesh.pp=1", "ps.servers=1", "model.dropout=0.1"], 1),
    "pp2-2servers": (["mesh.dp=1", "mesh.pp=2", "ps.servers=2", "pipeline.schedule=1f1b"], 3),
    "dp3-untied": (["mesh.dp=3", "mesh.pp=1", "ps.servers=1", "model.tie_embeddings=false"], 2),
}


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE != 4, reason="the layouts of 4 ranks")
@pytest.mark.parametrize("name", list(SERVERS))
def test_packed_parameter_server_training_matches_single_process(name):
    overrides, m = SERVERS[name]
    rank = build(load_config(None, BASE + overrides + [f"train.microbatches={m}", "run.eval_every=0"]), WORLD,
                 tokens=DATA)
    records: list = []
    rank.train(steps=STEPS, files=False, progress=False, on_step=records.append, peak_flops=0.0)
    worker = hasattr(rank, "dp")
    mine = {n: p.data.copy() for n, p in rank.named_parameters if not p.tied_to} if worker else {}
    rank.free()
    problems = []
    if worker:
        ref_steps, ref_params = reference(model_overrides(overrides) + (f"train.microbatches={dp_of(overrides) * m}",))
        for s, (r, (loss, norm)) in enumerate(zip(records, ref_steps)):
            if abs(r["loss"] - loss) > RTOL * abs(loss) or abs(r["grad_norm"] - norm) > RTOL * abs(norm):
                problems.append(f"step {s}: loss {r['loss']!r} vs {loss!r}, norm {r['grad_norm']!r} vs {norm!r}")
        if len(records) != STEPS or not mine:
            problems.append(f"{len(records)} steps, {len(mine)} parameters")
        for n, a in mine.items():
            ref = ref_params[n]
            if a.shape != ref.shape or np.linalg.norm(a - ref) > RTOL * np.linalg.norm(ref):
                problems.append(f"{n} differs from the one-process run")
    collective_assert(not problems, f"{name} rank {WORLD.Get_rank()}: " + "; ".join(problems[:3]))
