"""The backward split into B and W (tensor.py: `backward(..., defer=WeightGrads())`, `weight_grad`):
B computes the input's gradient and leaves every parameter's; W, run later, gives bitwise the
gradients of the one-pass backward and fires each parameter's grad hook then (once, in the same
order), on every kind of pipeline stage, with recomputation, dropout and interleaved micro-batches.
Tensor/sequence-parallel mappings (a parameter's f, whose all-reduce moves to W) are checked on
real meshes in tests/parallel/test_pipeline.py (also under CuPy). The split is the autograd's
bookkeeping, the same for every array backend: these tests pin NumPy whatever HPCPAR_BACKEND says."""

import numpy as np
import pytest

from hpcpar.autograd.linear import linear
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.autograd.tensor import Deferred, Tensor, WeightGrads, weight_grad


pytestmark = pytest.mark.usefixtures("numpy_backend")


CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16, dtype="float64", dropout=0.1)


def batch(seed, b=2, t=8):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 64, (b, t)), rng.integers(0, 64, (b, t))


def stage_model(kind, recompute):
    """A GPT stage: "first" (embedding, no head), "middle" (blocks only), "last" (head), "whole"."""
    embed, head = {"first": (True, False), "middle": (False, False), "last": (False, True),
                   "whole": (True, True)}[kind]
    model = GPT(CFG, layers=range(1, 3) if not embed else range(0, 2), embed=embed, head=head, seed=3)
    model.set_recompute(recompute)
    return model


def run(kind, recompute, split, order="interleaved", microbatches=2):
    """Per micro-batch: forward, then backward (one pass, or B with W deferred); returns the
    parameters' gradients, the inputs' gradients, and the hook calls [(name, phase)]."""
    model = stage_model(kind, recompute)
    names = {id(p): n for n, p in model.named_parameters()}
    calls, phase = [], ["forward"]
    for p in model.parameters():
        p.register_grad_hook(lambda q: calls.append((names[id(q)], phase[0])))
    outs = []
    for mb in range(microbatches):
        x, y = batch(mb)
        model.rng_context = (7, 0, [2 * mb, 2 * mb + 1])
        if kind in ("middle", "last"):
            x = Tensor(np.random.default_rng(10 + mb).standard_normal((2, 8, CFG.n_embd)), requires_grad=True)
        out = model(x, y if kind in ("last", "whole") else None)
        grad = np.asarray(0.5) if out.ndim == 0 else np.random.default_rng(20 + mb).standard_normal(out.shape)
        outs.append((x, out, grad))
    pending, input_grads = [], []
    for x, out, grad in outs:  # B of every micro-batch before any W: what a zero-bubble rank does
        phase[0] = "B"
        if split:
            w = WeightGrads()
            out.backward(grad, inputs=(x,) if isinstance(x, Tensor) else (), defer=w)
            pending.append(w)
        else:
            out.backward(grad)
        input_grads.append(x.grad if isinstance(x, Tensor) else None)
    phase[0] = "W"
    for w in pending:
        w.run()
    return {n: p.grad for n, p in model.named_parameters()}, input_grads, calls


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("kind", ["first", "middle", "last", "whole"])
def test_b_then_w_is_bitwise_the_one_pass_backward(kind, recompute):
    want, want_in, want_calls = run(kind, recompute, split=False)
    got, got_in, got_calls = run(kind, recompute, split=True)
    assert want.keys() == got.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    for a, b in zip(got_in, want_in):
        assert (a is None and b is None) or np.array_equal(a, b)
    # Every parameter's hook fires once per backward, all of them in W, in the one-pass order.
    assert all(phase == "W" for _, phase in got_calls)
    assert [n for n, _ in got_calls] == [n for n, _ in want_calls]
    assert len(got_calls) == 2 * len(want)


def test_b_leaves_the_parameters_alone_and_w_empties_itself():
    model = stage_model("middle", "none")
    x = Tensor(np.random.default_rng(0).standard_normal((2, 8, CFG.n_embd)), requires_grad=True)
    model.rng_context = (7, 0, [0, 1])
    out = model(x)
    w = WeightGrads()
    out.backward(np.ones(out.shape), inputs=(x,), defer=w)
    assert x.grad is not None and len(w) > 0
    assert all(p.grad is None for p in model.parameters())
    w.run()
    assert len(w) == 0 and all(p.grad is not None for p in model.parameters())


def test_the_dw_gemms_wait_for_w():
    """B runs dX only: linear's dW and db (and layer_norm's, and embedding's scatter) are Deferred."""
    x = Tensor(np.random.default_rng(0).standard_normal((4, 3)), requires_grad=True)
    weight = Tensor(np.random.default_rng(1).standard_normal((5, 3)), requires_grad=True)
    bias = Tensor(np.zeros(5), requires_grad=True)
    out = linear(x, weight, bias)
    w = WeightGrads()
    out.backward(np.ones((4, 5)), inputs=(x,), defer=w)
    assert np.array_equal(x.grad, np.ones((4, 5)) @ weight.data)
    assert weight.grad is None and bias.grad is None
    assert all(isinstance(e.value, Deferred) for e in w.events)
    w.run()
    assert np.array_equal(weight.grad, np.ones((4, 5)).T @ x.data) and np.array_equal(bias.grad, np.full(5, 4.0))
    assert weight_grad(lambda: 3) == 3  # outside a deferring backward: computed at once


def test_an_input_used_like_a_parameter_still_gets_its_gradient_in_b():
    """A leaf in `inputs` that an op treats as a parameter (x * w with x a leaf) is computed in B."""
    x = Tensor(np.arange(3.0), requires_grad=True)
    w_leaf = Tensor(np.full(3, 2.0), requires_grad=True)
    w = WeightGrads()
    (x * w_leaf).sum().backward(inputs=(x,), defer=w)
    assert np.array_equal(x.grad, np.full(3, 2.0)) and w_leaf.grad is None
    w.run()
    assert np.array_equal(w_leaf.grad, np.arange(3.0))
