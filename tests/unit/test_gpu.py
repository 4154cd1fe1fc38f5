"""The CuPy path against the NumPy path: fused kernels, a whole training run, the NCCL transport.

Skipped (with the reason) where CuPy or a GPU is missing. float64 must agree to rounding
(1e-10 relative), float32 to 1e-5 relative, as the GPU issue asks.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hpcpar.autograd import ops
from hpcpar.autograd.attention import causal_attention
from hpcpar.autograd.functional import cross_entropy, embedding, layer_norm
from hpcpar.optim.optimizers import AdamW
from hpcpar.autograd.tensor import Tensor

try:
    import cupy as cp
    cp.cuda.runtime.getDeviceCount()
except Exception as err:  # noqa: BLE001 - any failure to reach a GPU means: skip
    pytestmark = pytest.mark.skip(reason=f"needs CuPy and a CUDA GPU ({type(err).__name__}: {err})")
    cp = None

TOL = {"float64": 1e-10, "float32": 1e-5}


def rel(a, b) -> float:
    a, b = (np.asarray(cp.asnumpy(x) if cp is not None and isinstance(x, cp.ndarray) else x, dtype=np.float64)
            for x in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def both(fn, arrays, dtype):
    """fn's output and input gradients on NumPy and on CuPy for the same inputs (leaves)."""
    results = []
    for xp in (np, cp):
        leaves = [Tensor(xp.asarray(a.astype(dtype)), requires_grad=True) for a in arrays]
        out = fn(*leaves)
        seed = np.random.default_rng(7).standard_normal(out.shape).astype(dtype)
        out.backward(xp.asarray(seed))
        results.append((out.data, [leaf.grad for leaf in leaves]))
    return results


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("op", ["gelu", "layer_norm", "layer_norm_nobias", "attention", "attention_chunked",
                                "cross_entropy"])
def test_fused_kernel_matches_numpy(op, dtype, monkeypatch):
    # attention_chunked: 3 query chunks (16, 16, 5); attention: 1
    monkeypatch.setattr("hpcpar.autograd.attention._QUERY_CHUNK", 16)
    rng = np.random.default_rng(3)
    targets = rng.integers(0, 50, (4, 6))
    targets[0, :2] = -100  # ignored positions
    cases = {
        "gelu": (lambda x: ops.gelu(x), [rng.standard_normal((4, 6, 40)) * 3]),
        "layer_norm": (lambda x, w, b: layer_norm(x, w, b),
                       [rng.standard_normal((4, 6, 40)) + 2, rng.standard_normal(40), rng.standard_normal(40)]),
        "layer_norm_nobias": (lambda x, w: layer_norm(x, w, None),
                              [rng.standard_normal((4, 6, 40)), rng.standard_normal(40)]),
        "attention": (lambda qkv: causal_attention(qkv, 4), [rng.standard_normal((2, 13, 3 * 32))]),
        "attention_chunked": (lambda qkv: causal_attention(qkv, 4), [rng.standard_normal((2, 37, 3 * 32))]),
        "cross_entropy": (lambda z: cross_entropy(z, (cp if isinstance(z.data, cp.ndarray) else np).asarray(
            targets)), [rng.standard_normal((4, 6, 50)) * 4]),
    }
    fn, arrays = cases[op]
    (host_out, host_grads), (dev_out, dev_grads) = both(fn, arrays, dtype)
    assert rel(dev_out, host_out) < TOL[dtype], op
    for i, (gd, gh) in enumerate(zip(dev_grads, host_grads)):
        assert rel(gd, gh) < TOL[dtype], f"{op}: gradient of input {i}"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fused_adamw_matches_numpy(dtype):
    states = []
    for xp in (np, cp):
        params = [SimpleNamespace(data=xp.asarray(np.random.default_rng(i).standard_normal((30, 7)).astype(dtype)),
                                  grad=None, no_decay=i == 1) for i in range(2)]
        opt = AdamW(params, lr=1e-2, weight_decay=0.1)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = xp.asarray(np.random.default_rng(10 * step + i).standard_normal((30, 7)).astype(dtype))
            opt.step()
        states.append([p.data for p in params] + [a for p in params for a in opt.state_of(p).values()])
    for host, dev in zip(*states):
        assert rel(dev, host) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gpt_training_on_gpu_matches_numpy(dtype):
    """Three AdamW steps of a small GPT with dropout: the losses, the first step's gradients and
    the final parameters agree with NumPy's."""
    from hpcpar import backend
    from hpcpar.data import corpus
    from hpcpar.nn.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1, dtype=dtype)
    tokens = np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint8)
    runs = []
    for name in ("numpy", "cupy"):
        previous = backend.name()
        backend.use(name)
        try:
            model = GPT(cfg, seed=4)
            named = list(model.named_parameters())
            opt = AdamW([p for _, p in named], lr=3e-3)
            losses, first_grads = [], None
            for step in range(3):
                for _, p in named:
                    p.grad = None
                x, y = corpus.get_batch(tokens, 4, step, range(4), cfg.block_size)
                model.rng_context = (4, step, list(range(4)))
                loss = model(x, y)
                loss.backward()
                first_grads = first_grads or {n: backend.to_host(p.grad) for n, p in named}
                opt.step()
                losses.append(loss.item())
            final = np.concatenate([backend.to_host(p.data).ravel() for _, p in named])
            runs.append((losses, first_grads, final))
        finally:
            backend.use(previous)
    (host_losses, host_grads, host_final), (dev_losses, dev_grads, dev_final) = runs
    assert rel(dev_losses, host_losses) < TOL[dtype]
    for name in host_grads:
        assert rel(dev_grads[name], host_grads[name]) < TOL[dtype], name
    assert rel(dev_final, host_final) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fused_selective_attention_is_bitwise_the_kept_one(dtype, monkeypatch):
    """Selective recomputation on the fused path: each chunk's probabilities recomputed in backward
    give bitwise the output and gradient of keeping them (3 query chunks)."""
    monkeypatch.setattr("hpcpar.autograd.attention._QUERY_CHUNK", 16)
    qkv = np.random.default_rng(2).standard_normal((2, 37, 3 * 32)).astype(dtype)
    g = cp.asarray(np.random.default_rng(3).standard_normal((2, 37, 32)).astype(dtype))
    got = []
    for recompute in (False, True):
        x = Tensor(cp.asarray(qkv), requires_grad=True)
        y = causal_attention(x, 4, recompute=recompute)
        y.backward(g)
        got.append((cp.asnumpy(y.data), cp.asnumpy(x.grad)))
    assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gather_gradient_is_numpys_add_at_bitwise_and_reproducible(dtype):
    """Embedding / row-gather backward on CuPy: every repeated id's rows summed in NumPy's order.

    CuPy's own add.at uses atomics (run-to-run different last bits); the kernel must not."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 7, 4000)                     # few ids: long runs of repeats
    g = rng.standard_normal((4000, 33)).astype(dtype)
    expected = np.zeros((9, 33), dtype)
    np.add.at(expected, ids, g)
    weight = Tensor(cp.zeros((9, 33), dtype), requires_grad=True)
    for _ in range(3):
        weight.grad = None
        embedding(cp.asarray(ids), weight).backward(cp.asarray(g))
        assert np.array_equal(cp.asnumpy(weight.grad), expected)
    rows = Tensor(cp.zeros((9, 33), dtype), requires_grad=True)
    ops.getitem(rows, cp.asarray(ids)).backward(cp.asarray(g))
    assert np.array_equal(cp.asnumpy(rows.grad), expected)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gpt_recompute_on_gpu_is_bitwise_none(mode):
    """A GPT with dropout on CuPy: loss and every gradient under recomputation equal "none"'s bitwise."""
    from hpcpar import backend
    from hpcpar.nn.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1, dtype="float32")
    x, y = (np.random.default_rng(s).integers(0, 256, (3, 32)) for s in (0, 1))
    previous = backend.name()
    backend.use("cupy")
    try:
        runs = []
        for m in ("none", mode):
            model = GPT(cfg, seed=4)
            model.set_recompute(m)
            model.rng_context = (4, 0, [0, 1, 2])
            loss = model(x, y)
            loss.backward()
            runs.append((loss.item(), {n: cp.asnumpy(p.grad) for n, p in model.named_parameters()}))
    finally:
        backend.use(previous)
    assert runs[0][0] == runs[1][0]
    for name, grad in runs[0][1].items():
        assert np.array_equal(runs[1][1][name], grad), name


def test_nccl_transport_runs_every_kind_on_one_rank():
    """The NCCL transport itself (a one-rank NCCL communicator): every kind of op moves the bytes."""
    from cupy.cuda import nccl
    from mpi4py import MPI

    from hpcpar.runtime.transports import NcclTransport
    if not nccl.available:
        pytest.skip("CuPy was built without NCCL")
    t = NcclTransport(MPI.COMM_SELF)
    a = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    for kind, op in (("all_reduce", "sum"), ("all_reduce", "max"), ("reduce_scatter", "sum"),
                     ("all_gather", None), ("all_to_all", None), ("broadcast", None)):
        out = a.copy() if kind == "broadcast" else cp.full_like(a, -1)  # broadcast: in place from the root
        request = t.start(kind, out if kind == "broadcast" else a, out, op=op, peer=0)
        while not request.Test():
            pass
        np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(a), err_msg=kind)
