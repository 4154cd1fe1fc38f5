"""Activation recomputation in one process: `recompute` (full) and
`causal_attention(recompute=True)` (selective) give bitwise the gradients of keeping
everything, parameters inside a recomputed function get exactly one gradient (and one hook call)
per backward, the re-run uses the dropout context of its own micro-batch, and the memory held
between forward and backward shrinks as documented. Parallel meshes: tests/parallel/test_recompute.py."""

import tracemalloc

import numpy as np
import pytest

from hpcpar import backend
from hpcpar.backend.cpu.attention import kept_probabilities
from hpcpar.autograd import ops
from hpcpar.autograd.attention import causal_attention
from hpcpar.autograd.linear import linear
from hpcpar.autograd.recompute import recompute as recompute_op
from hpcpar.errors import ConfigError
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.nn.gpt import recomputed
from hpcpar.nn.module import Parameter
from hpcpar.autograd.tensor import Tensor, no_grad

CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, n_embd=32, dtype="float64", dropout=0.1)
RNG = np.random.default_rng(5)


def batch(b=3, t=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (b, t)), rng.integers(0, 256, (b, t))


def gradients(model):
    return {n: p.grad.copy() for n, p in model.named_parameters()}


def train_grads(mode, every=1, microbatches=2, interleave=False):
    """Gradients accumulated over `microbatches` backwards of a 4-block GPT with dropout;
    `interleave`: every forward first, then the backwards in order (as a pipeline schedule's
    warm-up does), so a re-run happens after the model's rng_context moved on."""
    model = GPT(CFG, seed=1)
    model.set_recompute(mode, every)
    losses, pending = [], []
    for mb in range(microbatches):
        x, y = batch(seed=mb)
        model.rng_context = (7, 0, range(3 * mb, 3 * mb + 3))
        loss = model(x, y)
        losses.append(loss.item())
        if interleave:
            pending.append(loss)
        else:
            loss.backward()
    for loss in pending:
        loss.backward()
    return losses, gradients(model)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("mode,every", [("full", 1), ("full", 2), ("selective", 1), ("selective", 3)])
def test_gpt_gradients_are_bitwise_those_of_none(mode, every, interleave):
    want_losses, want = train_grads("none", interleave=interleave)
    got_losses, got = train_grads(mode, every, interleave=interleave)
    assert got_losses == want_losses
    assert want.keys() == got.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_recomputed_blocks_follow_the_rule():
    model = GPT(CFG)
    model.set_recompute("full", 3)
    assert [b.recompute for b in model.transformer.h.items] == ["full", "none", "none", "full"]
    assert [recomputed(i, 2) for i in range(5)] == [True, False, True, False, True]
    stage = GPT(CFG, layers=range(2, 4), embed=False, head=True)  # global indices decide
    stage.set_recompute("selective", 2)
    assert [b.attn.recompute_scores for b in stage.transformer.h.items] == [True, False]
    with pytest.raises(ConfigError, match="train.recompute='half'"):
        model.set_recompute("half")
    with pytest.raises(ConfigError, match="train.recompute_every=0 is invalid"):
        model.set_recompute("full", 0)


def test_recompute_op_runs_fn_again_in_backward_only():
    calls = []
    w = Parameter(RNG.standard_normal((4, 5)))
    x = Tensor(RNG.standard_normal((3, 5)), requires_grad=True)

    def fn(a):
        calls.append(a.requires_grad)
        return ops.gelu(linear(a, w)) * 2.0

    y = recompute_op(fn, x)
    assert calls == [True] and y.requires_grad and y._parents == (x,)
    g = RNG.standard_normal(y.shape)
    y.backward(g)
    assert calls == [True, True]
    x_ref, w_ref = Tensor(x.data.copy(), requires_grad=True), Parameter(w.data.copy())
    (ops.gelu(linear(x_ref, w_ref)) * 2.0).backward(g)
    assert np.array_equal(x.grad, x_ref.grad) and np.array_equal(w.grad, w_ref.grad)
    with no_grad():  # evaluation: just fn, no graph and no re-run
        out = recompute_op(fn, x)
    assert calls == [True, True, True] and not out.requires_grad


def test_parameters_inside_get_one_gradient_and_one_hook_per_backward():
    """Data parallelism counts hook calls per micro-batch: a parameter used (twice) only inside the
    recomputed function is reached only by the nested backward, and must fire exactly once each
    backward, after both its uses; the input needs no grad (a pipeline stage's received input may not)."""
    w = Parameter(RNG.standard_normal((5, 5)))
    fired = []
    w.register_grad_hook(lambda p: fired.append(p.grad.copy()))
    x = Tensor(RNG.standard_normal((3, 5)))                     # requires no grad

    def fn(a):
        return linear(ops.tanh(linear(a, w)), w)

    for mb in range(2):
        recompute_op(fn, x).sum().backward()
        assert len(fired) == mb + 1
    w_ref = Parameter(w.data.copy())
    for _ in range(2):
        fn_ref = linear(ops.tanh(linear(x, w_ref)), w_ref)
        fn_ref.sum().backward()
    assert np.array_equal(w.grad, w_ref.grad) and np.array_equal(fired[-1], w.grad)
    assert x.grad is None


def test_selective_attention_is_bitwise_the_same():
    qkv = RNG.standard_normal((2, 9, 3 * 12))
    g = RNG.standard_normal((2, 9, 12))
    out = {}
    for recompute in (False, True):
        x = Tensor(qkv.copy(), requires_grad=True)
        y = causal_attention(x, 3, recompute=recompute)
        y.backward(g)
        out[recompute] = (y.data, x.grad)
    assert np.array_equal(out[True][0], out[False][0]) and np.array_equal(out[True][1], out[False][1])


def held_bytes(recompute: str, every: int = 1) -> int:
    """NumPy bytes allocated by one forward and still held when backward would start (host
    memory, measured by tracemalloc: the model runs on NumPy whatever HPCPAR_BACKEND says)."""
    previous = backend.name()
    backend.use("numpy")
    try:
        return _held_bytes(recompute, every)
    finally:
        backend.use(previous)


def _held_bytes(recompute: str, every: int) -> int:
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=32, dtype="float32")
    model = GPT(cfg, seed=0)
    model.set_recompute(recompute, every)
    x, y = batch(b=2, t=128)
    model(x, y).backward()   # warm caches (causal mask) outside the measurement
    tracemalloc.start()
    loss = model(x, y)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del loss
    return held


def test_recomputation_holds_less_between_forward_and_backward():
    none, selective, full, half = held_bytes("none"), held_bytes("selective"), held_bytes("full"), held_bytes("full", 2)
    b, h, t = 2, 4, 128
    probs = b * h * kept_probabilities(t) * 4  # one block's float32 probabilities (causal blocks)
    # (+ small Python objects: the list of blocks and each block's array header, a few hundred bytes a block)
    assert none - selective == pytest.approx(2 * probs, abs=2048)
    saved = none - half                                # full recomputation of block 0 alone
    assert saved > 1.5 * probs                         # all its activations but its input go
    assert half - full == pytest.approx(saved, rel=0.01)   # block 1 saves as much
