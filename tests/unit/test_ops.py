"""Every op's gradient against central finite differences in float64, fused ops
against their composed versions, and the graph machinery (accumulation, hooks)."""

import numpy as np
import pytest

from hpcpar.autograd import ops
from hpcpar.autograd.attention import causal_attention
from hpcpar.autograd.dropout import dropout
from hpcpar.autograd.functional import cross_entropy, embedding, layer_norm, softmax
from hpcpar.autograd.linear import linear
from hpcpar.autograd.tensor import Tensor, no_grad
from hpcpar.backend import splitmix

RNG = np.random.default_rng(0)


def leaf(*shape, positive=False):
    a = RNG.standard_normal(shape)
    return Tensor(np.abs(a) + 0.5 if positive else a, requires_grad=True)


def gradcheck(fn, inputs, eps=1e-6, tol=1e-6):
    """Compare autograd gradients of sum(fn(*inputs) * w) with central differences."""
    out = fn(*inputs)
    w = RNG.standard_normal(out.shape)
    (out * Tensor(w)).sum().backward()
    for t in inputs:
        if not isinstance(t, Tensor) or not t.requires_grad:
            continue
        numeric = np.zeros_like(t.data)
        flat = t.data.reshape(-1)
        for i in range(flat.size):
            old = flat[i]
            flat[i] = old + eps
            with no_grad():
                plus = float((fn(*inputs).data * w).sum())
            flat[i] = old - eps
            with no_grad():
                minus = float((fn(*inputs).data * w).sum())
            flat[i] = old
            numeric.reshape(-1)[i] = (plus - minus) / (2 * eps)
        np.testing.assert_allclose(t.grad, numeric, rtol=tol, atol=tol)


CASES = {
    "add_broadcast": (lambda a, b: a + b, lambda: [leaf(3, 4), leaf(4)]),
    "add_scalar": (lambda a: 2.0 + a, lambda: [leaf(3)]),
    "sub_broadcast": (lambda a, b: a - b, lambda: [leaf(2, 3, 4), leaf(3, 1)]),
    "rsub": (lambda a: 1.0 - a, lambda: [leaf(3)]),
    "mul_broadcast": (lambda a, b: a * b, lambda: [leaf(2, 3), leaf(2, 1)]),
    "div_broadcast": (lambda a, b: a / b, lambda: [leaf(2, 3), leaf(3, positive=True)]),
    "rdiv": (lambda a: 1.0 / a, lambda: [leaf(3, positive=True)]),
    "neg": (lambda a: -a, lambda: [leaf(3, 2)]),
    "pow": (lambda a: a ** 3, lambda: [leaf(4)]),
    "pow_frac": (lambda a: a ** 0.5, lambda: [leaf(4, positive=True)]),
    "exp": (ops.exp, lambda: [leaf(3, 2)]),
    "log": (ops.log, lambda: [leaf(3, 2, positive=True)]),
    "tanh": (ops.tanh, lambda: [leaf(3, 2)]),
    "gelu": (ops.gelu, lambda: [leaf(5, 3)]),
    "matmul": (lambda a, b: a @ b, lambda: [leaf(3, 4), leaf(4, 2)]),
    "matmul_batched_broadcast": (lambda a, b: a @ b, lambda: [leaf(2, 3, 4), leaf(4, 5)]),
    "matmul_batched": (lambda a, b: a @ b, lambda: [leaf(2, 2, 3, 4), leaf(2, 1, 4, 3)]),
    "linear": (linear, lambda: [leaf(2, 3, 4), leaf(5, 4), leaf(5)]),
    "linear_nobias": (lambda x, w: linear(x, w), lambda: [leaf(3, 4), leaf(2, 4)]),
    "sum_all": (lambda a: a.sum().reshape(1), lambda: [leaf(3, 4)]),
    "sum_axis": (lambda a: a.sum(axis=1), lambda: [leaf(3, 4, 2)]),
    "sum_keepdims": (lambda a: a.sum(axis=(0, 2), keepdims=True), lambda: [leaf(3, 4, 2)]),
    "mean_axis": (lambda a: a.mean(axis=-1), lambda: [leaf(3, 4)]),
    "max_axis": (lambda a: a.max(axis=1), lambda: [leaf(3, 5)]),
    "reshape": (lambda a: a.reshape(4, 3), lambda: [leaf(3, 4)]),
    "transpose": (lambda a: a.transpose(2, 0, 1), lambda: [leaf(2, 3, 4)]),
    "transpose_T": (lambda a: a.transpose(), lambda: [leaf(2, 3)]),
    "slice": (lambda a: a[1:, ::2], lambda: [leaf(3, 4)]),
    "fancy_index_repeat": (lambda a: a[np.array([0, 2, 0])], lambda: [leaf(3, 4)]),
    "split": (lambda a: ops.split(a, [1, 3], axis=1)[1] * ops.split(a, 2, axis=1)[0].sum(),
              lambda: [leaf(2, 4)]),
    "concat": (lambda a, b: ops.concat([a, b], axis=1), lambda: [leaf(2, 3), leaf(2, 1)]),
    "embedding_repeat": (lambda w: embedding(np.array([[0, 2], [2, 2]]), w), lambda: [leaf(3, 4)]),
    "softmax": (lambda a: softmax(a, axis=-1), lambda: [leaf(3, 5)]),
    "layer_norm": (lambda x, w, b: layer_norm(x, w, b), lambda: [leaf(2, 3, 6), leaf(6), leaf(6)]),
    "layer_norm_nobias": (lambda x, w: layer_norm(x, w, None), lambda: [leaf(4, 5), leaf(5)]),
    "cross_entropy": (lambda z: cross_entropy(z, np.array([[1, 0, 4], [3, 3, 2]])).reshape(1),
                      lambda: [leaf(2, 3, 5)]),
    "cross_entropy_ignore": (lambda z: cross_entropy(z, np.array([1, -100, 4, 0]), -100).reshape(1),
                             lambda: [leaf(4, 5)]),
    "causal_attention": (lambda qkv: causal_attention(qkv, 2), lambda: [leaf(2, 5, 12)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_matches_finite_differences(name):
    fn, make = CASES[name]
    gradcheck(fn, make())


def test_dropout_gradient_and_seeding():
    x = leaf(2, 3, 4)
    keys = [(1, 5, 0, 7), (1, 5, 1, 7)]
    gradcheck(lambda a: dropout(a, 0.5, keys), [x])
    y1 = dropout(Tensor(np.ones((2, 3, 4))), 0.5, keys).data
    y2 = dropout(Tensor(np.ones((1, 3, 4))), 0.5, keys[1:]).data
    np.testing.assert_array_equal(y1[1], y2[0])  # a sample's mask ignores its batch-mates
    assert set(np.unique(y1)) <= {0.0, 2.0} and 0 < (y1 == 0).mean() < 1


def composed_attention(qkv, n_head):
    b, t, three_c = qkv.shape
    c = three_c // 3
    d = c // n_head
    q, k, v = [z.reshape(b, t, n_head, d).transpose(0, 2, 1, 3) for z in ops.split(qkv, 3, axis=-1)]
    s = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / np.sqrt(d))
    mask = np.triu(np.full((t, t), -np.inf), k=1)
    p = softmax(s + Tensor(mask), axis=-1)
    return (p @ v).transpose(0, 2, 1, 3).reshape(b, t, c)


def composed_layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(axis=-1, keepdims=True)
    return xc / (var + eps) ** 0.5 * w + b


def composed_cross_entropy(z, t):
    m = Tensor(z.data.max(axis=-1, keepdims=True))
    lse = ops.log(ops.exp(z - m).sum(axis=-1, keepdims=True)) + m
    logp = z - lse
    onehot = np.eye(z.shape[-1])[t]
    return -(logp * Tensor(onehot)).sum() / t.size


def composed_gelu(x):
    return 0.5 * x * (1.0 + ops.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("fused,composed,make", [
    (lambda qkv: causal_attention(qkv, 3), lambda qkv: composed_attention(qkv, 3),
     lambda: [leaf(2, 6, 18)]),
    (lambda x, w, b: layer_norm(x, w, b), composed_layer_norm, lambda: [leaf(3, 7), leaf(7), leaf(7)]),
    (lambda z: cross_entropy(z, np.array([1, 2, 0, 4])), lambda z: composed_cross_entropy(z, np.array([1, 2, 0, 4])),
     lambda: [leaf(4, 5)]),
    (ops.gelu, composed_gelu, lambda: [leaf(4, 5)]),
])
def test_fused_ops_match_composed(fused, composed, make):
    a = make()
    b = [Tensor(t.data.copy(), requires_grad=True) for t in a]
    w = RNG.standard_normal(fused(*a).shape)
    (fused(*a) * Tensor(w)).sum().backward()
    (composed(*b) * Tensor(w)).sum().backward()
    np.testing.assert_allclose(fused(*a).data, composed(*b).data, rtol=1e-12, atol=1e-12)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x.grad, y.grad, rtol=1e-10, atol=1e-12)


def test_gradients_accumulate_in_place_and_hooks_fire_once_when_complete():
    w = leaf(3, 3)
    buffer = np.zeros((3, 3))
    w.grad = buffer
    events = []
    w.register_grad_hook(lambda t: events.append(t.grad.copy()))
    x = Tensor(RNG.standard_normal((2, 3)))
    loss = ((x @ w) * (x @ w)).sum() + (x @ w).sum()   # three uses of w
    loss.backward()
    assert w.grad is buffer                  # accumulated into the existing array
    assert len(events) == 1                  # fired once, after the last use
    np.testing.assert_allclose(events[0], w.grad)
    expected = w.grad.copy()
    loss2 = ((x @ w) * (x @ w)).sum() + (x @ w).sum()
    loss2.backward()
    np.testing.assert_allclose(w.grad, 2 * expected)
    assert len(events) == 2


def test_no_grad_records_nothing():
    a = leaf(2)
    with no_grad():
        b = a * 2
    assert not b.requires_grad and b.is_leaf


def test_backward_frees_graph():
    a = leaf(4)
    b = ops.tanh(a)
    c = (b * b).sum()
    c.backward()
    assert c._backward is None and b._backward is None


def test_counter_uniform_is_uniform_sliceable_and_keyed():
    keys = [(3, 1, 0, 2), (3, 1, 1, 2), (3, 2, 0, 2)]
    u = splitmix.counter_uniform(np, keys, (64, 512))
    assert u.shape == (3, 64, 512) and 0.0 <= u.min() and u.max() < 1.0
    # Uniform: mean 1/2, variance 1/12, flat histogram; streams of neighbouring keys uncorrelated.
    assert abs(u.mean() - 0.5) < 3e-3 and abs(u.var() - 1 / 12) < 2e-3
    counts = np.histogram(u, bins=16, range=(0, 1))[0]
    assert counts.min() > 0.95 * u.size / 16
    assert np.abs(np.corrcoef(u.reshape(3, -1)) - np.eye(3)).max() < 0.01
    # A row range is exactly that part of the full draw; a key's stream ignores its batch-mates.
    np.testing.assert_array_equal(splitmix.counter_uniform(np, keys, (64, 512), rows=slice(16, 48)), u[:, 16:48])
    np.testing.assert_array_equal(splitmix.counter_uniform(np, keys[1:2], (64, 512))[0], u[1])


def test_graph_keeps_no_reference_to_parameter_arrays():
    """ZeRO-3 frees a gathered parameter between forward and backward: after the forward no node
    of the graph may hold the parameter's array (the ops read `p.data` when backward runs), and
    backward with the array swapped back in gives the same gradients."""
    import gc
    import weakref

    from hpcpar.nn.module import Parameter

    w, b = Parameter(RNG.standard_normal((5, 4))), Parameter(RNG.standard_normal(5))
    table, pos = Parameter(RNG.standard_normal((7, 4))), Parameter(RNG.standard_normal((6, 4)))
    ln_w, ln_b = Parameter(RNG.standard_normal(4)), Parameter(RNG.standard_normal(4))
    params = (w, b, table, pos, ln_w, ln_b)

    def forward():
        ids = np.array([[1, 3, 0], [6, 2, 2]])
        h = embedding(ids, table) + ops.getitem(pos, (slice(0, 3),))
        h = layer_norm(h, Tensor.view_of_leaf(ln_w, lambda g: (g,)), ln_b)
        return (linear(h, w, b) ** 2).sum()

    forward().backward()
    expected = [p.grad.copy() for p in params]
    for p in params:
        p.grad = None
    loss = forward()
    values = [p.data.copy() for p in params]
    refs = [weakref.ref(p.data) for p in params]
    for p in params:  # "free" the gathered arrays: the parameters point elsewhere
        p.data = np.full_like(p.data, np.nan)
    gc.collect()
    assert all(r() is None for r in refs), "a graph node still holds a parameter's array"
    for p, v in zip(params, values):  # "gather again": fresh arrays with the same values
        p.data = v
    loss.backward()
    for p, g in zip(params, expected):
        np.testing.assert_array_equal(p.grad, g)
