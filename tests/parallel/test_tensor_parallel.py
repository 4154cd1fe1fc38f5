"""Tensor parallelism against the single-process model, in float64.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_tensor_parallel.py (also -n 1, 2, 3:
layouts whose tp does not divide the world are skipped on every rank alike).
Layouts are `Mesh(dp, tp)` over the world (tp innermost: a tp group is consecutive ranks).
"""

import collections

import numpy as np
import pytest
from collective import collective_assert, host
from mpi4py import MPI

from hpcpar.runtime.comm import Communicator
from hpcpar.runtime.mesh import Mesh
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.parallel.mappings import all_gather_dim, copy_to, gather_from, reduce_from, reduce_scatter_dim, split_to
from hpcpar.autograd.tensor import Tensor

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
# Divisible by tp = 4 everywhere: heads, 4C, vocab and (for sequence parallelism) T (padded
# vocabularies have their own test).
CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=16, dtype="float64")
SEED = 5
REL = 1e-10




def rel_err(a, b) -> float:
    a, b = host(a), host(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


@pytest.fixture
def groups(request):
    """(tp Communicator, dp Communicator) of a dp x tp mesh with tp = request.param over the
    world; skipped (on every rank) where tp does not divide the world."""
    tp = request.param
    if SIZE % tp:
        pytest.skip(f"tp={tp} does not divide {SIZE} ranks")
    mesh = Mesh(dp=SIZE // tp, tp=tp, comm=WORLD)
    yield mesh.comm("tp"), mesh.comm("dp")
    mesh.free()


def batch(b: int, seed: int, cfg=CFG):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, (b, cfg.block_size)), rng.integers(0, cfg.vocab_size, (b, cfg.block_size))


def with_dropout(model: GPT, sample_ids) -> GPT:
    model.rng_context = (SEED, 3, list(sample_ids))
    return model


def global_grad(p, comm: Communicator) -> np.ndarray:
    """The full gradient from every tp rank's shard (replicated parts averaged over their copies)."""
    total = np.zeros(p.layout.global_shape)
    copies = np.zeros(p.layout.global_shape)
    p.layout.put(host(p.grad), total)
    p.layout.put(np.ones(p.layout.local_shape), copies)
    return comm.all_reduce(total) / comm.all_reduce(copies)


def compare_grads(model: GPT, reference: GPT, comm: Communicator, what: str) -> None:
    ref = dict(reference.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    collective_assert(names == list(ref), f"{what}: parameter names differ: {names} vs {list(ref)}")
    for name, p in model.named_parameters():
        glob = global_grad(p, comm)
        err = rel_err(glob, ref[name].grad)
        local_err = rel_err(p.grad, p.layout.take(ref[name].grad))   # every copy, not just their mean
        collective_assert(max(err, local_err) < REL, f"{what}: {name} gradient relative error "
                                                     f"{err:.2e} (global), {local_err:.2e} (local)")


CASES = [(tp, sp, drop) for tp in (2, 4) for sp in (False, True) for drop in (0.0, 0.1)]


@pytest.mark.parametrize("groups,sp,dropout", CASES, indirect=["groups"],
                         ids=[f"tp{t}-{'sp' if s else 'nosp'}-drop{d}" for t, s, d in CASES])
def test_gpt_loss_logits_and_grads_match_single_process(groups, sp, dropout):
    tp_comm, _ = groups
    cfg = GPTConfig(**{**CFG.__dict__, "dropout": dropout})
    x, y = batch(3, seed=11)
    ids = range(3)
    reference = with_dropout(GPT(cfg, seed=SEED), ids)
    model = with_dropout(GPT(cfg, tp_comm=tp_comm, sequence_parallel=sp, seed=SEED), ids)
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        collective_assert(np.array_equal(host(p.data), host(p.layout.take(ref_params[name].data))),
                          f"{name}: the shard is not the slice of the single-process tensor")

    ref_logits, logits = reference(x).data, model(x).data
    collective_assert(logits.shape == ref_logits.shape and rel_err(logits, ref_logits) < REL,
                      f"logits differ: shape {logits.shape}, error {rel_err(logits, ref_logits):.2e}")
    ref_loss = reference(x, y)
    loss = model(x, y)
    collective_assert(abs(loss.item() - ref_loss.item()) < REL * abs(ref_loss.item()),
                      f"loss {loss.item()!r} vs {ref_loss.item()!r}")
    ref_loss.backward()
    loss.backward()
    compare_grads(model, reference, tp_comm, f"tp={tp_comm.size} sp={sp} dropout={dropout}")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_split_all_reduces_match_single_process(tp, sp, monkeypatch):
    # Every tp all-reduce of activations and their gradients as reduce-scatter + all-gather
    # (hpcpar.runtime.transports._SplitAllReduce, normally from 1 MiB up and when polling).
    if SIZE % tp:
        pytest.skip(f"tp={tp} does not divide {SIZE} ranks")
    import hpcpar.runtime.transports
    monkeypatch.setenv("HPCPAR_MPI_WAIT", "poll")
    monkeypatch.setattr(hpcpar.runtime.transports, "_SPLIT_ALL_REDUCE_BYTES", 1)
    made = []
    monkeypatch.setattr(hpcpar.runtime.transports, "_SplitAllReduce",
                        lambda *args, split=hpcpar.runtime.transports._SplitAllReduce: made.append(1) or split(*args))
    mesh = Mesh(dp=SIZE // tp, tp=tp, comm=WORLD)
    x, y = batch(3, seed=12)
    reference = GPT(CFG, seed=SEED)
    model = GPT(CFG, tp_comm=mesh.comm("tp"), sequence_parallel=sp, seed=SEED)
    ref_loss, loss = reference(x, y), model(x, y)
    collective_assert(abs(loss.item() - ref_loss.item()) < REL * abs(ref_loss.item()),
                      f"loss {loss.item()!r} vs {ref_loss.item()!r}")
    ref_loss.backward()
    loss.backward()
    collective_assert(bool(made), "no all-reduce was split")
    compare_grads(model, reference, mesh.comm("tp"), f"split all-reduce, tp={tp} sp={sp}")
    mesh.free()


@pytest.mark.parametrize("groups", [2, 4], indirect=True)
@pytest.mark.parametrize("sp", [False, True])
def test_pipeline_style_stages_with_sharded_tied_head(groups, sp):
    """Embedding stage and head stage apart (what a pipeline builds): the stage boundary
    carries [B, T, C], or [B, T/tp, C] under sequence parallelism, and the head's copy
    lm_head.weight is the vocabulary shard of wte."""
    tp_comm, _ = groups
    x, y = batch(2, seed=12)
    reference = GPT(CFG, seed=SEED)
    first = GPT(CFG, tp_comm=tp_comm, layers=[0], head=False, sequence_parallel=sp, seed=SEED)
    last = GPT(CFG, tp_comm=tp_comm, layers=[1], embed=False, sequence_parallel=sp, seed=SEED)
    boundary = first(x)
    expect = (2, CFG.block_size // (tp_comm.size if sp else 1), CFG.n_embd)
    collective_assert(boundary.shape == expect, f"stage output {boundary.shape}, expected {expect}")
    received = Tensor(boundary.data.copy(), requires_grad=True)
    loss = last(received, y)
    loss.backward()
    boundary.backward(received.grad)
    ref_loss = reference(x, y)
    ref_loss.backward()
    collective_assert(abs(loss.item() - ref_loss.item()) < REL * abs(ref_loss.item()), "stage loss differs")
    head = dict(last.named_parameters())["lm_head.weight"]
    wte = dict(first.named_parameters())["transformer.wte.weight"]
    collective_assert(head.layout == wte.layout and head.tied_to == "transformer.wte.weight",
                      "lm_head.weight is not laid out like its tied wte shard")
    wte.grad = wte.grad + head.grad        # what the tied-weight reduction does
    ref = dict(reference.named_parameters())
    for stage in (first, last):
        for name, p in stage.named_parameters():
            if p.tied_to:
                continue
            err = rel_err(global_grad(p, tp_comm), ref[name].grad)
            collective_assert(err < REL, f"{name}: gradient relative error {err:.2e}")


@pytest.mark.parametrize("groups", [2, 4], indirect=True)
@pytest.mark.parametrize("vocab", [62, 9])   # tp=4: 16 rows each, the last 14 real; 3 rows each, the last all padding
def test_padded_vocabulary_matches_single_process_and_padding_gets_nothing(groups, vocab):
    """A vocabulary tp does not divide is padded (Megatron): logits, loss and gradients equal the
    unpadded single-process model's, the padding's logits never reach the output and its rows
    get no gradient (so they stay zero through any optimizer)."""
    tp_comm, _ = groups
    cfg = GPTConfig(**{**CFG.__dict__, "vocab_size": vocab})
    x, y = batch(3, seed=15, cfg=cfg)
    reference = GPT(cfg, seed=SEED)
    model = GPT(cfg, tp_comm=tp_comm, seed=SEED)
    wte = model.transformer.wte.weight
    rows = -(-vocab // tp_comm.size)
    real = max(0, min(rows, vocab - tp_comm.rank * rows))
    collective_assert(wte.shape == (rows, cfg.n_embd) and wte.layout.global_shape == (vocab, cfg.n_embd),
                      f"wte shard {wte.shape}, global {wte.layout.global_shape}")
    ref_logits, logits = reference(x).data, model(x).data
    collective_assert(logits.shape == ref_logits.shape and rel_err(logits, ref_logits) < REL,
                      f"logits {logits.shape} vs {ref_logits.shape}")
    ref_loss, loss = reference(x, y), model(x, y)
    collective_assert(abs(loss.item() - ref_loss.item()) < REL * abs(ref_loss.item()),
                      f"loss {loss.item()!r} vs {ref_loss.item()!r}")
    ref_loss.backward()
    loss.backward()
    compare_grads(model, reference, tp_comm, f"tp={tp_comm.size} vocab={vocab}")
    collective_assert(not host(wte.data)[real:].any() and not host(wte.grad)[real:].any(),
                      "padding rows are not zero or received gradient")


@pytest.mark.parametrize("groups", [2], indirect=True)
@pytest.mark.parametrize("sp", [False, True])
def test_tp_times_dp_matches_single_process_on_the_global_batch(groups, sp):
    """(dp, tp) split of the world: each dp replica runs its share of the batch with tp=2;
    gradients averaged over dp equal the single-process model's on the whole batch."""
    tp_comm, dp_comm = groups
    per_replica = 2
    x, y = batch(per_replica * dp_comm.size, seed=13)
    mine = slice(dp_comm.rank * per_replica, (dp_comm.rank + 1) * per_replica)
    reference = GPT(CFG, seed=SEED)
    model = GPT(CFG, tp_comm=tp_comm, sequence_parallel=sp, seed=SEED)
    ref_loss = reference(x, y)
    loss = model(x[mine], y[mine])
    ref_loss.backward()
    loss.backward()
    mean_loss = dp_comm.all_reduce(np.array([loss.item()]), op="avg")[0]
    collective_assert(abs(mean_loss - ref_loss.item()) < REL * abs(ref_loss.item()),
                      f"dp-mean loss {mean_loss!r} vs {ref_loss.item()!r}")
    for p in model.parameters():
        p.grad = dp_comm.all_reduce(p.grad, op="avg")
    compare_grads(model, reference, tp_comm, f"dp={dp_comm.size} x tp={tp_comm.size} sp={sp}")


# ---------------------------------------------------------------------------------------------
# Adjoints: <A x, y> == <x, A^T y>, where A^T is what backward computes. A "replicated" space
# is one vector (the same on every rank, inner product taken once); a "per-rank" space is the
# concatenation of the ranks' arrays (inner product summed over ranks).
# ---------------------------------------------------------------------------------------------
def _vector(shape, replicated: bool, salt: int) -> np.ndarray:
    rng = np.random.default_rng([salt, 0 if replicated else 1 + RANK])
    return rng.standard_normal(shape)


def _inner(a, b, replicated: bool) -> float:
    local = float(np.vdot(a, b))
    return local if replicated else WORLD.allreduce(local)


def _shape(dim_size_at: int, dim: int) -> tuple:
    shape = [3, 4, 5]
    shape[dim] = dim_size_at
    return tuple(shape)


ADJOINT_OPS = {  # name: (op, input replicated?, output replicated?, input dim size, output dim size)
    "copy_to": (lambda x, c, d: copy_to(x, c), True, False, 2, 2),
    "reduce_from": (lambda x, c, d: reduce_from(x, c), False, True, 2, 2),
    "all_gather_dim": (all_gather_dim, False, False, 2, 2 * SIZE),
    "reduce_scatter_dim": (reduce_scatter_dim, False, False, 2 * SIZE, 2),
    "split_to": (split_to, True, False, 2 * SIZE, 2),
    "gather_from": (gather_from, False, True, 2, 2 * SIZE),
}


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("name", list(ADJOINT_OPS))
def test_differentiable_collective_is_adjoint_to_its_backward(name, dim):
    op, x_rep, y_rep, n_in, n_out = ADJOINT_OPS[name]
    comm = Communicator(WORLD.Dup(), "adjoint")
    try:
        x = Tensor(_vector(_shape(n_in, dim), x_rep, 1), requires_grad=True)
        y = _vector(_shape(n_out, dim), y_rep, 2)
        ax = op(x, comm, dim)
        lhs = _inner(ax.data, y, y_rep)
        ax.backward(y)
        rhs = _inner(x.data, x.grad, x_rep)
        scale = np.sqrt(_inner(x.data, x.data, x_rep) * _inner(y, y, y_rep))
        ok = abs(lhs - rhs) <= 1e-12 * scale and ax.shape == _shape(n_out, dim)
        if y_rep:   # a replicated result is the same on every rank
            ok = ok and np.array_equal(WORLD.bcast(ax.data, root=0), ax.data)
        collective_assert(ok, f"{name} dim={dim}: <Ax,y>={lhs!r} <x,A^T y>={rhs!r} shape {ax.shape}")
    finally:
        comm.free()


# ---------------------------------------------------------------------------------------------
# Communication per transformer layer and micro-batch, counted at the MPI calls themselves.
# ---------------------------------------------------------------------------------------------
class CountingMPI:
    """Stands in for a Communicator's mpi4py communicator and counts every call of its methods (a
    kept plan holds a method and calls it again: `Communicator._keep_plan`)."""

    def __init__(self, real):
        self._real = real
        self.calls = collections.Counter()

    def __getattr__(self, name):
        found = getattr(self._real, name)
        if not callable(found):
            return found

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return found(*args, **kwargs)
        return counted


def _counts(n_layer: int, tp_comm: Communicator, sp: bool, partial: bool = False) -> tuple:
    cfg = GPTConfig(**{**CFG.__dict__, "n_layer": n_layer})
    model = GPT(cfg, tp_comm=tp_comm, sequence_parallel=sp, seed=SEED)
    for p in model.parameters():   # partial: the training step sums their gradients (DataParallel does this)
        p.tp_partial_grad = partial and p.sequence_parallel
    transport = tp_comm._host  # the MPI transport every host-array op of tp_comm goes through
    counter = CountingMPI(transport.comm)
    transport.comm = counter
    tp_comm._plans.clear()  # kept plans hold the MPI communicator's methods (`Communicator._keep_plan`)
    try:
        x, y = batch(2, seed=14, cfg=cfg)
        loss = model(x, y)
        forward = collections.Counter(counter.calls)
        loss.backward()
        backward = counter.calls - forward
    finally:
        transport.comm = counter._real
        tp_comm._plans.clear()
    return forward, backward


def _op(name: str) -> str:
    """An mpi4py method's collective: blocking ops call MPI's blocking form (Allreduce,
    Reduce_scatter_block) when the watchdog's monitor runs, else the non-blocking one (Iallreduce,
    Ireduce_scatter): counted alike."""
    return name.lower().removeprefix("i").removesuffix("_block")


@pytest.mark.parametrize("groups", [2, 4], indirect=True)
@pytest.mark.parametrize("sp", [False, True])
def test_collectives_per_layer_and_microbatch(groups, sp):
    tp_comm, _ = groups
    f1, b1 = _counts(1, tp_comm, sp)
    f2, b2 = _counts(2, tp_comm, sp)
    per_layer_fwd, per_layer_bwd = ({_op(k): v for k, v in (c2 - c1).items()} for c1, c2 in ((f1, f2), (b1, b2)))
    if sp:
        # f/g become all-gather/reduce-scatter along T; the 6 all-reduces in backward sum the
        # sequence-shard gradients of ln_1, ln_2 (weight, bias) and both row-parallel biases.
        want_fwd = {"allgather": 2, "reduce_scatter": 2}
        want_bwd = {"allgather": 2, "reduce_scatter": 2, "allreduce": 6}
    else:
        want_fwd, want_bwd = {"allreduce": 2}, {"allreduce": 2}   # Megatron: g twice, f twice
    names = set(f2) | set(b2)
    collective_assert(per_layer_fwd == want_fwd and per_layer_bwd == want_bwd,
                      f"per layer: forward {per_layer_fwd} (want {want_fwd}), "
                      f"backward {per_layer_bwd} (want {want_bwd})")
    # mpi4py's lower-case methods pickle; only buffer (upper-case) methods may be used.
    collective_assert(all(n[0].isupper() for n in names), f"pickling mpi4py methods used: {sorted(names)}")


@pytest.mark.parametrize("groups", [2, 4], indirect=True)
def test_sequence_parallel_gradients_left_to_the_step_cost_nothing_per_layer(groups):
    """When the training step sums the sequence-shard parameters' gradients over tp once per step
    (`tp_partial_grad`, set by DataParallel; tests/parallel/test_step_collectives.py counts that
    sum), a layer's backward has no all-reduce left: 2 reduce-scatters + 2 all-gathers."""
    tp_comm, _ = groups
    f1, b1 = _counts(1, tp_comm, True, partial=True)
    f2, b2 = _counts(2, tp_comm, True, partial=True)
    per_layer = {_op(k): v for k, v in (b2 - b1).items()}
    want = {"allgather": 2, "reduce_scatter": 2}
    collective_assert(per_layer == want and f2 - f1 == _counts(2, tp_comm, True)[0] - _counts(1, tp_comm, True)[0],
                      f"per layer backward {per_layer} (want {want})")
