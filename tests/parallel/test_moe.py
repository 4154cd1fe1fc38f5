"""Mixture of experts with expert parallelism, through the Trainer, against the single-process run.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_moe.py (also -n 2; layouts that do not fit
the world are left out).
- ep = 2 and 4, alone, with dp left over, with tp (experts whole on every tp rank), with pp (1F1B
  and the zero-bubble zbh1, whose weight passes hold the experts' dW), with ZeRO-1/2 (expert state
  sharded over the expert-dp group), dropout and full recomputation: the losses, gradient norms
  and every global parameter equal the one-process model's to 1e-10 in float64, with unlimited
  capacity and with a capacity factor that drops tokens (the same dropped fraction as one process).
  The one-process reference runs the same micro-batches: micro_batch_size B and dp x microbatches
  of them (routing, capacity and the aux loss are per rank's micro-batch).
- Experts that no token is routed to: a router forced to send every token to experts 0, 1 and 3
  of 8 leaves, under ep = 4, two ranks with no rows at all and one with an empty expert beside a
  busy one (under ep = 2 one rank with none): forward, backward, capacity dropping and the
  all-to-all-v with zero counts still give the one-process model's losses and parameters.
- The all-to-all-v dispatch and combine (`mappings.all_to_all_v`) is the adjoint of its backward,
  also where a rank sends or receives no rows.
- Checkpoints: a run saved with ep = 4 loads with ep = 1 (experts are global [E, ...] tensors) and
  back, and every stored tensor is bitwise the original after the round trip.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, host, run_and_free, stored, training_problems

from hpcpar import backend
from hpcpar.config.load import load_config
from hpcpar.runtime.comm import Communicator
from hpcpar.nn import moe as moe_layer
from hpcpar.parallel.mappings import all_to_all_v
from hpcpar.autograd.tensor import Tensor
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
TOKENS = np.random.default_rng(3).integers(0, 256, 5000).astype(np.uint8)
TINY = ["model.n_layer=2", "model.n_embd=16", "model.n_head=2", "model.block_size=8", "model.dtype=float64",
        "model.moe_experts=4", "model.moe_top_k=2", "model.moe_aux_loss=0.05", "model.moe_z_loss=0.01",
        "train.steps=4", "train.warmup=1", "train.lr=0.01", "train.grad_clip=0.5", "train.bucket_mb=0.004",
        "run.eval_every=0", "run.progress=false"]
MBS, STEPS = 2, 3
DROP = "model.moe_capacity_factor=0.75"   # each expert takes 3 of a micro-batch's 8 assignments per 4 experts


def layouts(world: int) -> list:
    out = [(f"ep{world}", [f"mesh.dp={world}", "mesh.pp=1", f"mesh.ep={world}"]),
           (f"ep{world}-drop", [f"mesh.dp={world}", "mesh.pp=1", f"mesh.ep={world}", DROP])]
    if world == 4:
        out += [("dp4-ep2", ["mesh.dp=4", "mesh.pp=1", "mesh.ep=2"]),
                ("dp4-ep2-drop-dropout", ["mesh.dp=4", "mesh.pp=1", "mesh.ep=2", DROP, "model.dropout=0.1"]),
                ("ep2-tp2", ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "mesh.ep=2"]),
                ("ep2-pp2-1f1b", ["mesh.dp=2", "mesh.pp=2", "mesh.ep=2", DROP]),
                ("ep2-pp2-zbh1", ["mesh.dp=2", "mesh.pp=2", "mesh.ep=2", "pipeline.schedule=zbh1"]),
                ("ep4-zero1", ["mesh.dp=4", "mesh.pp=1", "mesh.ep=4", "train.zero=1"]),
                ("ep2-zero2-recompute", ["mesh.dp=4", "mesh.pp=1", "mesh.ep=2", "train.zero=2",
                                         "train.recompute=full"]),
                ("ep2-hsdp-zero1", ["mesh.dp=4", "mesh.pp=1", "mesh.ep=2", "mesh.dp_replicate=2", "train.zero=1"]),
                ("ep2-moe-every2", ["mesh.dp=2", "mesh.pp=2", "mesh.ep=2", "model.moe_every=2", "model.n_layer=3"])]
    return out


def make(overrides, comm=WORLD, microbatches=2) -> Trainer:
    cfg = load_config(None, TINY + [f"train.micro_batch_size={MBS}", f"train.microbatches={microbatches}"]
                             + overrides)
    return Trainer(cfg, comm=comm, tokens=TOKENS)


# Experts 0, 1 and 3 of 8 take every token (`favour`): with top-2 each token picks two of them.
FAVOURED, STARVE = (0, 1, 3), ["model.moe_experts=8"]


def favour(trainer: Trainer, experts=FAVOURED) -> Trainer:
    """Route every token of `trainer`'s model to `experts` only (the others get none), for the
    whole short run, and still by the token among those. ln_2's bias is set to 3 u (u = ones / sqrt C)
    and router row e to r_e + 2 u for a favoured expert, r_e - 2 u for the others, r_e small, random
    and orthogonal to u: a LayerNorm output with weight 1 and bias 3 u is z + 3 u with z orthogonal
    to u and |z| = sqrt C, so logit e = z . r_e +- 6, and the favoured ones lead by 12 - 2 |z| max|r_e|
    (> 7 here). The same (seeded) values on every rank and in the reference."""
    c = trainer.cfg.model.n_embd
    u = np.ones(c) / np.sqrt(c)
    for name, p in trainer.named_parameters:
        if name.endswith(".ln_2.bias"):
            p.data[...] = backend.xp.asarray(3 * u, dtype=p.data.dtype)
        elif name.endswith(".mlp.router.weight"):
            r = np.random.default_rng(sum(map(ord, name))).standard_normal(p.shape) * 0.1
            r -= np.outer(r @ u, u)
            sign = np.where(np.isin(np.arange(p.shape[0]), experts), 2.0, -2.0)
            p.data[...] = backend.xp.asarray(r + np.outer(sign, u), dtype=p.data.dtype)
    return trainer


def routing_problems(results: list, routing: list, keys: tuple) -> list[str]:
    """The routing figures `keys` of each step's `results` that differ from the one-process
    run's (`routing`) by more than 1e-10 relative."""
    problems = []
    for key in keys:
        got, want = [r.moe[key] for r in results], [r[key] for r in routing]
        if np.asarray(got) != pytest.approx(np.asarray(want), rel=1e-10):
            problems.append(f"{key} {got} vs {want}")
    return problems


@functools.lru_cache(maxsize=None)
def reference(model: tuple, microbatches: int, favoured: bool = False):
    """One process, the same micro-batches: (losses, norms, routing figures, global parameters,
    expert bias after the run); with `favoured`, the router set by `favour` first."""
    t = make(list(model) + ["mesh.dp=1", "mesh.tp=1", "mesh.pp=1"], MPI.COMM_SELF, microbatches)
    if favoured:
        favour(t)
    results = [t.train_step(step) for step in range(STEPS)]
    out = ([(r.loss, r.grad_norm) for r in results], [r.moe for r in results], t.global_parameters(),
           t.expert_bias.bias.copy())
    t.mesh.free()
    return out


@pytest.mark.parametrize("overrides", [o for _, o in layouts(SIZE)], ids=[i for i, _ in layouts(SIZE)])
def test_expert_parallel_matches_single_process(overrides):
    results, params, dp = run_and_free(make(overrides), STEPS)
    model = tuple(o for o in overrides if o.startswith("model."))
    steps, routing, ref_params, _ = reference(model, 2 * dp)
    # The routing figures too (recomputation must not count a re-run's routing twice).
    problems = training_problems(results, steps, params, ref_params, 1e-10) + routing_problems(
        results, routing, ("moe_dropped_fraction", "moe_aux_loss", "moe_load_imbalance", "moe_layer_imbalance"))
    dropped = [r["moe_dropped_fraction"] for r in routing]
    # The finite capacity factor really drops assignments; unlimited capacity none.
    if (max(dropped) > 0) != (DROP in overrides):
        problems.append(f"dropped fractions {dropped} with {overrides}")
    clipped = max(n for _, n in steps) > 0.5
    collective_assert(not problems and clipped, f"{overrides}: {problems[:4]}")


BIAS = "model.moe_expert_bias_rate=0.05"   # large: the bias changes routing within the 3 steps


def bias_layouts(world: int) -> list:
    out = [(f"ep{world}", [f"mesh.dp={world}", "mesh.pp=1", f"mesh.ep={world}"])]
    if world == 4:
        out += [("dp4-ep2-drop", ["mesh.dp=4", "mesh.pp=1", "mesh.ep=2", DROP]),
                ("ep2-tp2", ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "mesh.ep=2"]),
                ("ep2-pp2-zbh1", ["mesh.dp=2", "mesh.pp=2", "mesh.ep=2", "pipeline.schedule=zbh1"]),
                ("ep4-zero1", ["mesh.dp=4", "mesh.pp=1", "mesh.ep=4", "train.zero=1"]),
                ("ep2-moe-every2", ["mesh.dp=2", "mesh.pp=2", "mesh.ep=2", "model.moe_every=2", "model.n_layer=3"])]
    return out


@pytest.mark.parametrize("overrides", [o for _, o in bias_layouts(SIZE)], ids=[i for i, _ in bias_layouts(SIZE)])
def test_expert_bias_matches_single_process_and_changes_routing(overrides):
    """model.moe_expert_bias_rate > 0 (aux-loss-free balancing): every rank holds bitwise the
    one-process model's bias after 3 steps (loads counted over the global batch), and the losses,
    gradient norms, parameters and routing figures equal the one-process run's to 1e-10; the
    bias did change the routing (the per-layer loads differ from the same run without it)."""
    overrides = [BIAS] + overrides
    trainer = make(overrides)
    bias = trainer.expert_bias.bias
    results, params, dp = run_and_free(trainer, STEPS)
    model = tuple(o for o in overrides if o.startswith("model."))
    steps, routing, ref_params, ref_bias = reference(model, 2 * dp)
    problems = training_problems(results, steps, params, ref_params, 1e-10) + routing_problems(
        results, routing, ("moe_dropped_fraction", "moe_aux_loss", "moe_layer_imbalance", "moe_expert_bias_max"))
    every = WORLD.allgather(bias)
    if not all(np.array_equal(b, ref_bias) for b in every) or not np.abs(ref_bias).max() > 0:
        problems.append(f"bias {bias.tolist()} vs one process {ref_bias.tolist()}")
    unbiased = reference(tuple(o for o in model if o != BIAS), 2 * dp)[1]
    if [r["moe_layer_imbalance"] for r in routing][1:] == [r["moe_layer_imbalance"] for r in unbiased][1:]:
        problems.append("the expert bias did not change the routing")
    collective_assert(not problems, f"{overrides}: {problems[:4]}")


def starved_layouts(world: int) -> list:
    out = [(f"ep{world}", [f"mesh.dp={world}", "mesh.pp=1", f"mesh.ep={world}"]),
           (f"ep{world}-drop", [f"mesh.dp={world}", "mesh.pp=1", f"mesh.ep={world}", DROP])]
    if world == 4:
        out += [("dp4-ep2", ["mesh.dp=4", "mesh.pp=1", "mesh.ep=2"])]
    return out


@pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks")
@pytest.mark.parametrize("overrides", [o for _, o in starved_layouts(SIZE)], ids=[i for i, _ in starved_layouts(SIZE)])
def test_experts_without_tokens_match_single_process(overrides, monkeypatch):
    """Experts 2 and 4-7 of 8 get no token (`favour`): under ep = 4 ranks 2 and 3 receive no rows
    (their experts' GEMMs, the gather that groups the rows and its backward see 0 rows) and rank 1
    one empty expert beside a busy one; under ep = 2 rank 1 none. Losses, gradient norms and every
    parameter equal the one-process model's to 1e-10 in float64, also with capacity dropping."""
    overrides = STARVE + overrides
    seen = []                                                # rows per local expert, every call
    grouped_linear = moe_layer.grouped_linear

    def spy(x, weight, bias, counts):
        seen.append([int(c) for c in counts])
        return grouped_linear(x, weight, bias, counts)
    monkeypatch.setattr(moe_layer, "grouped_linear", spy)
    results, params, dp = run_and_free(favour(make(overrides)), STEPS)
    monkeypatch.undo()
    model = tuple(o for o in overrides if o.startswith("model."))
    steps, routing, ref_params, _ = reference(model, 2 * dp, True)
    problems = training_problems(results, steps, params, ref_params, 1e-10)
    dropped = [r["moe_dropped_fraction"] for r in routing]
    if (max(dropped) > 0) != (DROP in overrides):
        problems.append(f"dropped fractions {dropped} with {overrides}")
    # The case under test happened: some rank got no rows at all, some an empty and a busy expert.
    nothing = any(sum(c) == 0 for c in seen)
    partly = any(0 in c and sum(c) > 0 for c in seen)
    flags = np.array(WORLD.allgather((nothing, partly, len(seen) > 0)))
    if not (flags[:, 0].any() and flags[:, 1].any() and flags[:, 2].all()):
        problems.append(f"routing never left an expert or a rank without rows: {flags.tolist()}")
    collective_assert(not problems, f"{overrides}: {problems[:4]}")


@pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks")
def test_all_to_all_v_is_adjoint_to_its_backward():
    """<A x, y> = <x, A^T y> for the dispatch (rows to ranks by counts) and its backward."""
    comm = Communicator(WORLD, "world")
    rng = np.random.default_rng(10 + comm.rank)
    # Counts from every rank to every rank, known to all (a fixed pattern with some zeros).
    counts = np.array([[(3 * s + 2 * d) % 4 for d in range(SIZE)] for s in range(SIZE)])
    send, recv = counts[comm.rank], counts[:, comm.rank]
    x = Tensor(rng.standard_normal((int(send.sum()), 3)), requires_grad=True)
    ax = all_to_all_v(x, comm, send, recv)
    y = rng.standard_normal((int(recv.sum()), 3))
    ax.backward(y)
    local = np.array([float((ax.data * y).sum()), float((x.data * x.grad).sum())])
    total = comm.all_reduce(local)
    collective_assert(ax.shape == y.shape and abs(total[0] - total[1]) <= 1e-12 * abs(total[0]),
                      f"<Ax, y> = {total[0]!r} but <x, A^T y> = {total[1]!r}")


@pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks")
@pytest.mark.parametrize("pattern", ["random", "empty"])
def test_dispatch_reaches_the_experts_ranks_and_combine_is_its_adjoint(pattern):
    """MoE._dispatch over ep = world: every row arrives at the rank holding its expert, grouped by
    local expert; combine (`undo`) brings the rows home in their order; and the dispatch's
    backward is its adjoint (<D x, y> = <x, D^T y> summed over ranks). "empty": rank 0 sends no
    row at all and no rank sends any to rank 1's experts (rank 1 receives none, its gather of the
    arrived rows and that gather's backward have 0 rows)."""
    from hpcpar.nn.gpt import GPTConfig
    from hpcpar.nn.moe import MoE

    comm = Communicator(WORLD, "ep")
    experts = 2 * SIZE
    cfg = GPTConfig(n_embd=4, n_head=1, dtype="float64", moe_experts=experts, moe_top_k=1)
    moe = MoE(cfg, comm)
    rng = np.random.default_rng(20 + comm.rank)
    kept = rng.integers(0, 4, experts)                      # rows this rank sends to each expert
    if pattern == "empty":
        kept = np.zeros(experts, dtype=np.int64) if comm.rank == 0 else rng.integers(1, 4, experts)
        kept[2:4] = 0
    owner = np.repeat(np.arange(experts), kept)              # rows sorted by expert
    data = rng.standard_normal((owner.size, 4))
    data[:, 0] = owner                                       # column 0 names the row's expert
    sent = Tensor(data, requires_grad=True)
    grouped, counts, undo = moe._dispatch(sent, kept)
    local = np.arange(comm.rank * 2, comm.rank * 2 + 2)
    expected = np.repeat(local, counts)
    back = undo(Tensor(grouped.data))
    y = rng.standard_normal(grouped.shape)
    grouped.backward(y)
    total = comm.all_reduce(np.array([float((grouped.data * y).sum()), float((sent.data * sent.grad).sum()),
                                      float(counts.sum()), float(kept.sum())]))
    collective_assert(np.array_equal(grouped.data[:, 0], expected) and np.array_equal(back.data, sent.data)
                      and total[2] == total[3] and abs(total[0] - total[1]) <= 1e-12 * abs(total[0])
                      and sent.grad.shape == sent.shape and (pattern != "empty" or comm.rank != 1 or counts.sum() == 0),
                      f"arrived experts {grouped.data[:, 0]} vs {expected}; adjoint {total[:2]}")


@pytest.mark.skipif(SIZE != 4, reason="needs 4 ranks")
def test_checkpoint_reshards_experts_ep4_to_ep1_and_back_bitwise(shared_dir):
    """ep = 4 saves [E, ...] expert tensors (each rank its E/4 experts); ep = 1 (dp = 4) loads and
    re-saves them; ep = 4 loads that: every stored tensor, optimizer moments included, is the
    original bitwise, and one more step on each layout gives the same loss."""
    ep4, ep1 = ["mesh.dp=4", "mesh.pp=1", "mesh.ep=4"], ["mesh.dp=4", "mesh.pp=1", "mesh.ep=1"]
    old = make(ep4)
    for step in range(2):
        old.train_step(step)
    first = old.save(os.path.join(shared_dir, "ep4"), keep=1)
    original = stored(first)
    loss_old = old.train_step(2).loss
    old.mesh.free()

    middle = make(ep1)
    middle.load(first)
    second = middle.save(os.path.join(shared_dir, "ep1"), keep=1)
    loss_middle = middle.train_step(2).loss
    middle.mesh.free()

    last = make(ep4)
    last.load(second)
    third = stored(last.save(os.path.join(shared_dir, "ep4-again"), keep=1))
    loss_last = last.train_step(2).loss
    last.mesh.free()
    experts = [n for n in original if ".experts." in n]
    differ = sorted(n for n in original if n not in third or not np.array_equal(host(original[n]), host(third[n])))
    collective_assert(len(experts) == 2 * 4 * 3 and original["model/transformer.h.0.mlp.experts.c_fc.weight"].shape
                      == (4, 64, 16) and sorted(third) == sorted(original) and not differ,
                      f"round trip ep4 -> ep1 -> ep4 differs: {differ[:4]} ({len(experts)} expert tensors)")
    collective_assert(loss_middle == pytest.approx(loss_old, rel=1e-10) and loss_last == loss_old,
                      f"continued losses {loss_old!r}, {loss_middle!r}, {loss_last!r}")


@pytest.mark.skipif(SIZE != 4, reason="needs 4 ranks")
def test_expert_bias_resumes_bitwise_and_reshards(shared_dir):
    """With the expert bias on: ep = 4 trains 1 step and saves (the bias nonzero); the same layout
    resumed from it runs steps 1-2 bitwise as the uninterrupted run (losses, parameters, bias);
    ep = 2 x tp = 2 (twice the micro-batches: the same global batch) loads the same bias bitwise
    (replicated, in the checkpoint metadata) and continues to 1e-10."""
    ep4, other = ["mesh.dp=4", "mesh.pp=1", "mesh.ep=4", BIAS], ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "mesh.ep=2",
                                                               BIAS]
    old = make(ep4)
    old.train_step(0)
    path = old.save(os.path.join(shared_dir, "bias"), keep=1)
    saved = old.expert_bias.bias.copy()
    losses = [old.train_step(step).loss for step in (1, 2)]
    bias, params = old.expert_bias.bias.copy(), old.global_parameters()
    old.mesh.free()
    problems = []
    for overrides, bitwise in ((ep4, True), (other, False)):
        new = make(overrides, microbatches=2 if bitwise else 4)
        new.load(path)
        loaded = new.expert_bias.bias.copy()
        got = [new.train_step(step).loss for step in (1, 2)]
        got_params = new.global_parameters()
        new.mesh.free()
        if not np.array_equal(loaded, saved) or not np.abs(saved).max() > 0:
            problems.append(f"{overrides}: loaded bias {loaded.tolist()} vs saved {saved.tolist()}")
        if bitwise:
            same = got == losses and np.array_equal(new.expert_bias.bias, bias) and all(
                np.array_equal(got_params[n], params[n]) for n in params)
        else:
            worst = max(float(np.max(np.abs(got_params[n] - params[n])) / np.max(np.abs(params[n]))) for n in params)
            same = (got == pytest.approx(losses, rel=1e-10) and np.array_equal(new.expert_bias.bias, bias)
                    and worst <= 1e-10)
        if not same:
            problems.append(f"{overrides}: continued losses {got} vs {losses}")
    collective_assert(not problems, "; ".join(problems[:3]))
