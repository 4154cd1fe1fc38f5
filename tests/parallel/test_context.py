"""Context parallelism (ring attention, Ulysses) against the single-process model, in float64.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_context.py (also -n 1, 2, 3: meshes that
do not fit the world are skipped on every rank alike).

- ops: ring attention (zigzag and contiguous layouts) and Ulysses, forward and backward, equal
  `causal_attention` on the whole sequence; the ring posts its messages before the block's
  attention and waits after it; Ulysses' all-to-all is the adjoint of its backward.
- training: cp = world (each design), cp x dp (ZeRO-1 too), cp x tp (+ sequence parallelism) and
  cp x pp, dropout on, match a one-process Trainer (COMM_SELF) on the same global batch to 1e-10
  relative: losses, gradient norms and every global parameter; evaluation too.
- checkpoints: a cp run's checkpoint loads bitwise on cp = 1 and back, and training continues
  identically on either.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, one_step_trace, rel_err, stored, training_problems

from hpcpar.checkpoint.directory import latest
from hpcpar.autograd.attention import causal_attention
from hpcpar.runtime.comm import Communicator
from hpcpar.config.load import load_config
from hpcpar.parallel.cp.attention import ContextParallel, all_to_all_dim, positions
from hpcpar.autograd.tensor import Tensor
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
STEPS = 3
RTOL = 1e-10
# block_size 24 cuts into 2cp zigzag chunks for cp = 2, 3, 4 (and 2cp x tp=2 for cp = 2).
BASE = ["model.vocab_size=256", "model.block_size=24", "model.n_layer=2", "model.n_head=4", "model.n_embd=16",
        "model.dtype=float64", "model.dropout=0.1", "train.micro_batch_size=2", f"train.steps={STEPS}",
        "train.warmup=1", "train.lr=0.01", "train.grad_clip=1.0", "train.seed=7", "run.progress=false"]
SIX_HEADS = ["model.n_head=6", "model.n_embd=12"]   # Ulysses over cp = 3
TOKENS = np.random.default_rng(0).integers(0, 256, 50_000).astype(np.uint8)


@pytest.fixture(scope="module")
def cp_world():
    comm = Communicator(WORLD.Dup(), "cp-test")
    yield comm
    comm.free()


# ---------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------
def test_zigzag_layout_balances_the_causal_work():
    for cp in (1, 2, 3, 4):
        t = 8 * cp
        held = [positions("zigzag", t, cp, r) for r in range(cp)]
        assert sorted(np.concatenate(held).tolist()) == list(range(t))
        # Causal pairs of rank r: sum over its queries of (position + 1); equal for every rank.
        assert len({int((p + 1).sum()) for p in held}) == 1
        contiguous = [positions("contiguous", t, cp, r) for r in range(cp)]
        assert np.array_equal(np.concatenate(contiguous), np.arange(t))


@pytest.mark.parametrize("impl,layout", [("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "contiguous")])
def test_attention_matches_the_whole_sequence(cp_world, impl, layout):
    b, t, h, d = 2, 8 * SIZE, 2 * SIZE, 3
    rng = np.random.default_rng(11)
    qkv, g = rng.standard_normal((b, t, 3 * h * d)), rng.standard_normal((b, t, h * d))
    whole = Tensor(qkv.copy(), requires_grad=True)
    want = causal_attention(whole, h)
    want.backward(g)
    cp = ContextParallel(cp_world, impl, layout)
    mine = cp.positions(t)
    x = Tensor(qkv[:, mine].copy(), requires_grad=True)
    y = cp.attention(x, h)
    y.backward(g[:, mine])
    out_err, grad_err = rel_err(y.data, want.data[:, mine]), rel_err(x.grad, whole.grad[:, mine])
    collective_assert(out_err < 1e-13 and grad_err < 1e-13, f"{impl}/{layout}: output {out_err:.1e}, "
                                                             f"gradient {grad_err:.1e}")


@pytest.mark.skipif(SIZE < 2, reason="a ring needs >= 2 ranks")
def test_ring_posts_its_messages_before_the_block_and_waits_after(cp_world):
    """Overlap, from the ring's event log: in every step but the last, forward and backward, the
    K/V messages are posted before that step's attention starts and waited only after it ends."""
    b, t, h, d = 1, 4 * SIZE, 2, 4
    qkv = Tensor(np.random.default_rng(1).standard_normal((b, t // SIZE, 3 * h * d)), requires_grad=True)
    cp = ContextParallel(cp_world, "ring")
    cp.events = []
    y = cp.attention(qkv, h)
    y.backward(np.ones_like(y.data))
    when = {(what, step): t for what, step, t in cp.events}
    problems = []
    for prefix in ("", "back_"):
        for step in range(SIZE - 1):
            post, start = when[(prefix + "post", step)], when[(prefix + "compute", step)]
            end, arrived = when[(prefix + "computed", step)], when[(prefix + "arrived", step)]
            if not post <= start <= end <= arrived:
                problems.append(f"{prefix}step {step}: post {post}, compute {start}..{end}, arrived {arrived}")
        if (prefix + "post", SIZE - 1) in when:
            problems.append(f"{prefix}: a message posted in the last step")
    kv = 2 * b * h * (t // SIZE) * d * 8
    expected = (SIZE - 1) * kv + (SIZE - 1) * kv + SIZE * kv   # forward K/V, backward K/V, dK/dV
    if cp.stats["bytes_sent"] != expected:
        problems.append(f"bytes sent {cp.stats['bytes_sent']}, expected {expected}")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("split,concat", [(3, 1), (1, 2), (0, 2)])
def test_all_to_all_is_adjoint_to_its_backward(cp_world, split, concat):
    """<A x, y> = <x, A^T y> summed over the ranks (both sides sharded), A^T being the backward."""
    shape = [2, 3, 2, 5]
    shape[split] *= SIZE                       # the split dim holds every rank's part
    rng = np.random.default_rng(100 + RANK)
    x = Tensor(rng.standard_normal(shape), requires_grad=True)
    ax = all_to_all_dim(x, cp_world, split, concat)
    y = rng.standard_normal(ax.shape)
    ax.backward(y)
    lhs = float(cp_world.all_reduce(np.array([np.vdot(ax.data, y)]))[0])
    rhs = float(cp_world.all_reduce(np.array([np.vdot(x.data, x.grad)]))[0])
    out_shape = list(shape)
    out_shape[split] //= SIZE
    out_shape[concat] *= SIZE
    collective_assert(abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0) and list(ax.shape) == out_shape,
                      f"<Ax,y>={lhs!r} <x,A^T y>={rhs!r}, shape {ax.shape}")


# ---------------------------------------------------------------------------------------------
# Training through the Trainer
# ---------------------------------------------------------------------------------------------
_reference_cache: dict = {}


def reference(total_microbatches: int, model: tuple = ()):
    """(per-step (loss, grad_norm), global parameters, eval loss) of the 1-rank run."""
    key = (total_microbatches, model)
    if key not in _reference_cache:
        cfg = load_config(None, BASE + list(model) + ["mesh.dp=1", "mesh.tp=1", "mesh.pp=1",
                                                      f"train.microbatches={total_microbatches}"])
        ref = Trainer(cfg, comm=MPI.COMM_SELF, tokens=TOKENS)
        results = [ref.train_step(s) for s in range(STEPS)]
        _reference_cache[key] = ([(r.loss, r.grad_norm) for r in results], ref.global_parameters(),
                                 ref.evaluate(2))
    return _reference_cache[key]


def cases():
    """(dp, tp, pp, cp, impl, extra overrides) that fill the world."""
    out = []
    if SIZE >= 2:
        for impl in ("ring", "ulysses"):
            out.append((1, 1, 1, SIZE, impl, SIX_HEADS if impl == "ulysses" and SIZE == 3 else []))
    if SIZE == 4:
        out += [(2, 1, 1, 2, "ring", ["train.zero=1"]), (2, 1, 1, 2, "ulysses", []),
                (1, 1, 1, 4, "ring", ["train.zero=1"]),
                (1, 2, 1, 2, "ring", ["mesh.sequence_parallel=true"]),
                (1, 2, 1, 2, "ulysses", ["mesh.sequence_parallel=true"]), (1, 2, 1, 2, "ring", []),
                (1, 1, 2, 2, "ring", ["pipeline.schedule=1f1b"]), (1, 1, 2, 2, "ulysses", ["pipeline.schedule=gpipe"]),
                (1, 1, 2, 2, "ring", ["pipeline.schedule=zbv", "model.n_layer=4"]),
                (1, 1, 2, 2, "ulysses", ["pipeline.schedule=zbh1"])]
    return [pytest.param(*c, id=f"dp{c[0]}-tp{c[1]}-pp{c[2]}-cp{c[3]}-{c[4]}" + "".join(
        "-" + o.split(".")[1].replace("sequence_parallel=true", "sp") for o in c[5] if not o.startswith("model.")))
        for c in out]


def make_trainer(dp, tp, pp, cp, impl, extra, m=2, comm=WORLD):
    overrides = [f"mesh.dp={dp}", f"mesh.tp={tp}", f"mesh.pp={pp}", f"mesh.cp={cp}", f"mesh.cp_impl={impl}",
                 f"train.microbatches={m}", *extra]
    return Trainer(load_config(None, BASE + overrides), comm=comm, tokens=TOKENS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp,tp,pp,cp,impl,extra", cases())
def test_training_matches_single_process(dp, tp, pp, cp, impl, extra):
    trainer = make_trainer(dp, tp, pp, cp, impl, extra)
    x, _ = trainer.microbatches(0)[0]
    shape_ok = x.shape == (2, 24 // cp)   # the data path hands this rank its tokens only
    results = [trainer.train_step(s) for s in range(STEPS)]
    ref_steps, ref_params, ref_eval = reference(dp * 2, tuple(o for o in extra if o.startswith("model.")))
    problems = [] if shape_ok else [f"micro-batch shape {x.shape}"]
    problems += training_problems(results, ref_steps, trainer.global_parameters(), ref_params, RTOL)
    if pp == 1 and tp == 1:   # evaluation (forward-only replay) on the trained weights
        got = trainer.evaluate(2)
        if rel_err(got, ref_eval) > RTOL:
            problems.append(f"eval loss {got!r} vs {ref_eval!r}")
    collective_assert(not problems, "; ".join(problems[:3]))


@pytest.mark.timeout(120)
@pytest.mark.skipif(SIZE < 2, reason="needs >= 2 ranks for cp > 1")
@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_trace_shows_cp_communication(shared_dir, impl):
    """`pipeline.trace = true`: every rank's timeline has a context-parallel row with its messages
    (and, for the ring, the attention blocks they overlap)."""
    trainer = make_trainer(1, 1, 1, SIZE, impl, ["pipeline.trace=true"] + (SIX_HEADS if SIZE == 3 else []))
    events = one_step_trace(trainer, shared_dir)
    problem = ""
    if RANK == 0:
        want = {"cp_kv_send_recv", "cp_kv_wait", "cp_attention_block", "cp_dkv_send_recv"} if impl == "ring" \
            else {"cp_all_to_all"}
        for rank in range(SIZE):
            names = {e["name"] for e in events if e["pid"] == rank and e["ph"] == "X" and e["tid"] == 99}
            rows = [e["args"]["name"] for e in events if e["pid"] == rank and e["name"] == "thread_name"
                    and e["tid"] == 99]
            if not want <= names or rows != [f"context parallel ({impl})"]:
                problem = f"rank {rank}: cp spans {sorted(names)}, rows {rows}"
    problem = WORLD.bcast(problem, root=0)
    assert not problem, problem


# ---------------------------------------------------------------------------------------------
# Checkpoints across cp
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.skipif(SIZE < 2, reason="needs >= 2 ranks for cp > 1")
def test_checkpoint_of_a_cp_run_loads_on_cp_1_and_back(shared_dir):
    """cp = world (ring) saves; a one-process cp = 1 Trainer loads it (bitwise), re-saves, and a
    cp = world (Ulysses where the heads allow) Trainer loads that (bitwise); all three continue
    with the same losses and parameters."""
    impl_back = "ulysses" if 4 % SIZE == 0 else "ring"
    old = make_trainer(1, 1, 1, SIZE, "ring", [])
    for step in range(2):
        old.train_step(step)
    original = stored(old.save(os.path.join(shared_dir, "cp"), keep=1))
    old_losses = [old.train_step(s).loss for s in (2, 3)]
    old_params = old.global_parameters()

    single = make_trainer(1, 1, 1, 1, "ring", [], comm=MPI.COMM_SELF)   # each rank: a 1-process run
    single.load(latest(os.path.join(shared_dir, "cp")))
    resaved = stored(single.save(os.path.join(shared_dir, f"single-{RANK}"), keep=1))
    problems = [n for n in original if not np.array_equal(original[n], resaved.get(n))]
    single_losses = [single.train_step(s).loss for s in (2, 3)]
    single_params = single.global_parameters()

    back = make_trainer(1, 1, 1, SIZE, impl_back, [])
    meta = back.load(latest(os.path.join(shared_dir, "single-0")))
    problems += [f"back: {n}" for n, p in back.global_parameters().items()
                 if not np.array_equal(p, original[f"model/{n}"])]
    back_losses = [back.train_step(s).loss for s in (2, 3)]
    back_params = back.global_parameters()
    if meta["step"] != 2 or meta["mesh"]["cp"] != 1:
        problems.append(f"meta {meta['step']}, {meta['mesh']}")
    for name, losses, params in (("cp=1", single_losses, single_params), ("back", back_losses, back_params)):
        loss_err = max(rel_err(a, b) for a, b in zip(losses, old_losses))
        worst = max(rel_err(params[n], old_params[n]) for n in old_params)
        if loss_err > RTOL or worst > RTOL:
            problems.append(f"{name}: continued training differs: loss {loss_err:.1e}, params {worst:.1e}")
    collective_assert(not problems, f"{problems[:4]}")
