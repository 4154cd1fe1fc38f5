"""The mixture-of-experts layer on one process (hpcpar/nn/moe.py), in float64.

- Routing: top-k is deterministic, ties going to the lower expert index.
- Capacity: an expert keeps its first ceil(factor N k / E) assignments, first choices (in token
  order) before second choices; dropped assignments add nothing, so a token dropped by all its
  experts leaves the layer with a zero MLP output (the block's residual passes it through).
- The aux loss is alpha E sum_i f_i P_i plus the z-loss, against a NumPy reference, with f_i
  counted before dropping.
- Gradients of the router, the experts and the input pass a central finite-difference check of
  a loss that includes the aux and z losses.
- The expert weights' gradients are weight work: under a split backward (B/W, zero-bubble
  pipelines) B leaves them, W gives bitwise the one-pass gradients.
- Zero tokens: a row gather of no rows (`ops.getitem`, as the dispatch does on a rank that no row
  reaches) has a zero gradient; `grouped_linear` with empty groups (or no rows at all) equals
  per-group linears, the empty groups' weight gradients zero; a layer with more experts than
  assignments passes the finite-difference check, its idle experts getting zero gradients.
- Parameter counts (total, per ep rank, active for MFU) are the elements of a built GPT.
"""

import math
from dataclasses import dataclass

import numpy as np
import pytest

from hpcpar.autograd import ops
from hpcpar.autograd.functional import softmax
from hpcpar.autograd.linear import grouped_linear, linear
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.nn.moe import MoE, capacity, dispatch_order, top_k
from hpcpar.autograd.tensor import Tensor, WeightGrads


pytestmark = pytest.mark.usefixtures("numpy_backend")


def config(**kw) -> GPTConfig:
    base = dict(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=8, dtype="float64", moe_experts=4,
                moe_top_k=2, moe_aux_loss=0.1, moe_z_loss=0.01)
    return GPTConfig(**{**base, **kw})


def layer(cfg: GPTConfig, seed: int = 0) -> MoE:
    """An MoE layer with random weights (biases too: nonzero, so their gradients are tested)."""
    moe = MoE(cfg)
    rng = np.random.default_rng(seed)
    for _, p in moe.named_parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.5
    return moe


def test_top_k_breaks_ties_toward_the_lower_expert():
    probs = np.array([[0.25, 0.25, 0.25, 0.25],
                      [0.1, 0.4, 0.1, 0.4],
                      [0.5, 0.2, 0.2, 0.1]])
    assert top_k(probs, 2).tolist() == [[0, 1], [1, 3], [0, 1]]
    assert top_k(probs, 3).tolist() == [[0, 1, 2], [1, 3, 0], [0, 1, 2]]


def test_capacity_keeps_first_choices_in_token_order_then_second_choices():
    # 4 tokens, top-2 over 3 experts: 8 assignments, capacity ceil(0.75 * 4 * 2 / 3) = 2.
    choices = np.array([[0, 1], [0, 2], [0, 1], [1, 0]])
    cap = capacity(4, 2, 3, 0.75)
    assert cap == 2 and capacity(4, 2, 3, 0.0) is None
    routing = dispatch_order(choices, 3, cap)
    assert routing["routed"].tolist() == [4, 3, 1]           # before dropping
    # Expert 0: first choices of tokens 0, 1, 2 -> keeps tokens 0 and 1; token 2's first choice and
    # token 3's second choice are dropped. Expert 1: token 3's first choice, then token 0's second
    # choice; token 2's second choice dropped. Expert 2: token 1's second choice.
    assignment = {(j, n): j * 4 + n for j in range(2) for n in range(4)}   # choice-major
    kept = [a for a in range(8) if routing["row"][a] < routing["order"].size]
    assert sorted(kept) == sorted([assignment[0, 0], assignment[0, 1], assignment[0, 3], assignment[1, 0],
                                   assignment[1, 1]])
    assert routing["kept"].tolist() == [2, 2, 1]
    # Sorted by expert, priority order inside each.
    assert routing["order"].tolist() == [assignment[0, 0], assignment[0, 1], assignment[0, 3], assignment[1, 0],
                                         assignment[1, 1]]
    unlimited = dispatch_order(choices, 3, None)
    assert unlimited["kept"].tolist() == [4, 3, 1] and (unlimited["row"] < 8).all()


def test_a_token_dropped_by_every_expert_gets_a_zero_output():
    cfg = config(moe_experts=2, moe_top_k=1, moe_capacity_factor=0.5)
    moe = layer(cfg)
    x = Tensor(np.random.default_rng(1).standard_normal((1, 8, cfg.n_embd)))
    y = moe(x).data.reshape(8, -1)
    routed, dropped, assignments, _ = moe.stats[-1]
    probs = softmax(linear(Tensor(x.data.reshape(8, -1)), moe.router.weight)).data
    routing = dispatch_order(top_k(probs, 1), 2, capacity(8, 1, 2, 0.5))
    lost = routing["row"] == routing["order"].size
    assert dropped == int(lost.sum()) > 0 and assignments == 8
    assert np.all(y[lost] == 0) and np.all(np.abs(y[~lost]).sum(axis=1) > 0)


def numpy_moe(cfg, moe: MoE, x: np.ndarray, choose=None):
    """The layer's output and aux + z loss, written directly in NumPy from the weights; `choose`
    (probs [N, E] -> experts [N, k]) replaces the top-k choice (an expert bias's)."""
    n = x.shape[0] * x.shape[1]
    tokens = x.reshape(n, -1)
    logits = tokens @ moe.router.weight.data.T
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    choices = np.argsort(-probs, axis=1, kind="stable")[:, :cfg.moe_top_k] if choose is None else choose(probs)
    e, k = cfg.moe_experts, cfg.moe_top_k
    f = np.bincount(choices.reshape(-1), minlength=e) / (n * k)
    aux = cfg.moe_aux_loss * e * np.sum(f * probs.mean(axis=0))
    lse = np.log(np.exp(logits).sum(axis=1))
    aux += cfg.moe_z_loss * np.mean(lse ** 2)
    w1, b1 = moe.experts.c_fc.weight.data, moe.experts.c_fc.bias.data
    w2, b2 = moe.experts.c_proj.weight.data, moe.experts.c_proj.bias.data
    y = np.zeros_like(tokens)
    for t in range(n):
        for j in range(k):
            ex = choices[t, j]
            h = tokens[t] @ w1[ex].T + b1[ex]
            h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
            y[t] += probs[t, ex] * (h @ w2[ex].T + b2[ex])
    return y.reshape(x.shape), aux


def test_output_and_aux_loss_match_a_numpy_reference():
    cfg = config()
    moe = layer(cfg, seed=2)
    x = np.random.default_rng(3).standard_normal((2, 5, cfg.n_embd))
    y = moe(Tensor(x))
    want_y, want_aux = numpy_moe(cfg, moe, x)
    aux = float(moe.stats[-1][3])
    assert np.allclose(y.data, want_y, rtol=1e-12, atol=1e-12)
    assert aux == pytest.approx(want_aux, rel=1e-12)
    assert aux > cfg.moe_aux_loss   # alpha E sum f P >= alpha (equality only when perfectly balanced)


def loss_of(moe: MoE, x: Tensor, r: np.ndarray) -> Tensor:
    """<y, r> + the aux and z losses (which `with_loss` adds to the gradient with scale 1)."""
    y = moe(x)
    return ops.sum(y * r) + Tensor(np.asarray(float(moe.stats[-1][3])))


@pytest.mark.parametrize("factor", [0.0, 0.75])
def test_router_and_expert_gradients_pass_finite_differences(factor):
    cfg = config(moe_capacity_factor=factor)
    moe = layer(cfg, seed=4)
    rng = np.random.default_rng(5)
    x = Tensor(rng.standard_normal((2, 4, cfg.n_embd)), requires_grad=True)
    r = rng.standard_normal(x.shape)
    loss_of(moe, x, r).backward()
    check_finite_differences(moe, x, r, rng)


def check_finite_differences(moe: MoE, x: Tensor, r: np.ndarray, rng) -> None:
    """x's and every parameter's gradient (after `loss_of(moe, x, r).backward()`) against central
    differences of the loss at a few random elements each."""
    checks = [("x", x)] + list(moe.named_parameters())
    eps = 1e-6
    for name, t in checks:
        analytic = t.grad.copy()
        for flat in rng.choice(t.data.size, size=min(6, t.data.size), replace=False):
            index = np.unravel_index(flat, t.shape)
            old = t.data[index]
            t.data[index] = old + eps
            up = loss_of(moe, Tensor(x.data), r).item()
            t.data[index] = old - eps
            down = loss_of(moe, Tensor(x.data), r).item()
            t.data[index] = old
            numeric = (up - down) / (2 * eps)
            assert analytic[index] == pytest.approx(numeric, rel=1e-5, abs=1e-7), (name, index)


@pytest.mark.parametrize("shape, index", [((5, 3), np.array([], dtype=np.int64)),
                                          ((4, 2, 3), np.zeros((0, 2), dtype=np.int64)),
                                          ((0, 3), np.array([], dtype=np.int64)),
                                          ((5, 3), (np.array([], dtype=np.int32),))])
def test_a_gather_of_no_rows_has_a_zero_gradient(shape, index):
    """x[ids] with no ids (the dispatch's gather on a rank no row reaches): [0, ...] forward, and
    backward a zero gradient of x's shape, not a reshape error."""
    x = Tensor(np.random.default_rng(0).standard_normal(shape), requires_grad=True)
    y = ops.getitem(x, index)
    ids = index[0] if isinstance(index, tuple) else index
    assert y.shape == ids.shape + shape[1:] and y.data.size == 0
    ops.sum(y).backward()
    assert x.grad.shape == shape and x.grad.dtype == x.data.dtype and not x.grad.any()
    # The gradient of a gather with rows is still the scatter-add (repeated rows accumulate).
    if shape[0]:
        z = Tensor(x.data, requires_grad=True)
        ops.sum(ops.getitem(z, np.array([1, 1, 0]))).backward()
        want = np.zeros(shape)
        want[1], want[0] = 2, 1
        assert np.array_equal(z.grad, want)


@pytest.mark.parametrize("counts", [[0, 3, 0, 2], [0, 0, 0, 0], [5, 0, 0, 0]])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear_with_empty_groups_equals_per_group_linears(counts, bias):
    rng = np.random.default_rng(6)
    m, g, n_in, n_out = sum(counts), len(counts), 3, 4
    x = Tensor(rng.standard_normal((m, n_in)), requires_grad=True)
    w = Tensor(rng.standard_normal((g, n_out, n_in)), requires_grad=True)
    b = Tensor(rng.standard_normal((g, n_out)), requires_grad=True) if bias else None
    y = grouped_linear(x, w, b, np.array(counts))
    gy = rng.standard_normal((m, n_out))
    y.backward(gy)
    ends = np.cumsum(counts)
    want_y, want_gx = np.zeros((m, n_out)), np.zeros((m, n_in))
    want_gw, want_gb = np.zeros(w.shape), np.zeros((g, n_out))
    for e, (a, z) in enumerate(zip(ends - counts, ends)):
        want_y[a:z] = x.data[a:z] @ w.data[e].T + (b.data[e] if bias else 0)
        want_gx[a:z] = gy[a:z] @ w.data[e]
        want_gw[e] = gy[a:z].T @ x.data[a:z]
        want_gb[e] = gy[a:z].sum(axis=0)
    assert y.shape == (m, n_out) and np.allclose(y.data, want_y, rtol=1e-13, atol=1e-13)
    assert x.grad.shape == x.shape and np.allclose(x.grad, want_gx, rtol=1e-13, atol=1e-13)
    assert np.allclose(w.grad, want_gw, rtol=1e-13, atol=1e-13)
    assert all(not w.grad[e].any() for e in range(g) if counts[e] == 0)
    if bias:
        assert np.allclose(b.grad, want_gb, rtol=1e-13, atol=1e-13)
        assert all(not b.grad[e].any() for e in range(g) if counts[e] == 0)


@pytest.mark.parametrize("counts", [[1, 1, 1], [2, 1], [2, 2, 2, -1]])
def test_grouped_linear_refuses_counts_that_do_not_cover_the_rows(counts):
    x, w = Tensor(np.zeros((3, 2))), Tensor(np.zeros((4, 5, 2)))
    with pytest.raises(ValueError, match="group sizes"):
        grouped_linear(x, w, None, counts)


@pytest.mark.parametrize("factor", [0.0, 0.5])
def test_experts_without_tokens_get_zero_gradients_and_pass_finite_differences(factor):
    """8 experts, top-1, 4 tokens: 5 experts get no token (and with capacity factor 0.5, one
    expert's second token is dropped too). The output, the aux loss and every gradient stay right;
    the idle experts' gradients are exactly 0."""
    cfg = config(moe_experts=8, moe_top_k=1, moe_capacity_factor=factor)
    moe = layer(cfg, seed=7)
    rng = np.random.default_rng(8)
    x = Tensor(rng.standard_normal((1, 4, cfg.n_embd)), requires_grad=True)
    y = moe(x)
    if factor == 0:   # (the NumPy reference drops nothing)
        want_y, want_aux = numpy_moe(cfg, moe, x.data)
        assert np.allclose(y.data, want_y, rtol=1e-12, atol=1e-12)
        assert float(moe.stats[-1][3]) == pytest.approx(want_aux, rel=1e-12)
    assert (moe.stats[-1][1] > 0) == (factor > 0)
    moe.stats.clear()
    r = rng.standard_normal(x.shape)
    loss_of(moe, x, r).backward()
    idle = moe.stats[-1][0] == 0
    assert idle.sum() >= 5
    for name, p in moe.experts.named_parameters():
        assert not p.grad[idle].any() and p.grad[~idle].any(), name
    check_finite_differences(moe, x, r, rng)


def test_expert_gradients_are_weight_work_under_a_split_backward():
    cfg = config(n_layer=1)

    def run(split: bool):
        model = GPT(cfg, embed=False, head=False, seed=3)
        x = Tensor(np.random.default_rng(0).standard_normal((2, 8, cfg.n_embd)), requires_grad=True)
        out = model(x)
        g = np.random.default_rng(1).standard_normal(out.shape)
        if not split:
            out.backward(g)
            return model, x.grad, None
        w = WeightGrads()
        out.backward(g, inputs=(x,), defer=w)
        return model, x.grad, w

    whole, want_x, _ = run(False)
    split, got_x, w = run(True)
    assert np.array_equal(got_x, want_x)
    assert all(p.grad is None for p in split.parameters()) and len(w) > 0
    w.run()
    for (name, p), (_, q) in zip(split.named_parameters(), whole.named_parameters()):
        assert np.array_equal(p.grad, q.grad), name


@dataclass
class Ranks:
    """Stands in for a Communicator where only the group's size and my rank matter (layer setup)."""

    size: int
    rank: int = 0


@pytest.mark.parametrize("bias", [True, False])
def test_parameter_counts_are_the_elements_of_a_built_moe_gpt(bias):
    cfg = config(n_layer=3, moe_every=2, bias=bias, n_embd=16)
    assert [cfg.is_moe(i) for i in range(3)] == [True, False, True]
    for ep in (1, 2, 4):
        for rank in range(ep):
            model = GPT(cfg, ep_comm=Ranks(ep, rank) if ep > 1 else None)
            assert cfg.num_params(ep=ep) == sum(p.data.size for p in model.parameters())
            stage = GPT(cfg, layers=[1, 2], embed=False, head=False, ep_comm=Ranks(ep, rank) if ep > 1 else None)
            assert cfg.stage_params(range(1, 3), False, False, ep=ep) == sum(p.data.size for p in stage.parameters())
    # MFU's N: the router and top_k experts of an MoE layer, the dense blocks whole.
    model = dict(GPT(cfg).named_parameters())
    c, b, k, e = 16, int(bias), 2, 4
    expert = 8 * c * c + 5 * c * b
    outside = sum(p.data.size for n, p in model.items() if not n.startswith(("transformer.wte", "transformer.wpe")))
    assert cfg.non_embedding_params() == outside - 2 * (e - k) * expert
