"""Mixed precision: the loss scaler's rules, and the 16-bit ops against their float32 selves.

- LossScaler (Megatron's dynamic scaler with hysteresis): growth after `window` clean steps,
  backoff after `hysteresis` overflows, the minimum, a static scale that never moves, and a
  checkpoint round trip that continues exactly.
- Each fused op with 16-bit inputs (linear, layer_norm, gelu, attention, cross-entropy, dropout)
  stores its output and input gradients in 16 bits and equals the float32 op applied to the
  same 16-bit inputs and the 16-bit-rounded weights, to the output's own rounding (one 16-bit
  ulp); weight gradients come out in float32. The GPT in full precision is untouched (bitwise the
  same with and without the precision argument), and bf16/fp16 GPT gradients track float32's.
"""

import numpy as np
import pytest

from hpcpar.autograd import ops
from hpcpar.autograd.attention import causal_attention
from hpcpar.autograd.dropout import dropout
from hpcpar.autograd.functional import cross_entropy, layer_norm
from hpcpar.autograd.linear import linear
from hpcpar.errors import CheckpointError, ConfigError
from hpcpar.optim.loss_scale import LossScaler
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.backend.precision import activation_dtype, is_low
from hpcpar.autograd.tensor import Tensor
from hpcpar.checkpoint.parts import load_parts, save_parts
from hpcpar.checkpoint.save import save
from hpcpar.runtime.solo import SoloCommunicator

LOW = {"bf16": np.dtype("bfloat16"), "fp16": np.dtype("float16")}
ULP = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


# -- loss scaler --------------------------------------------------------------------------------
def run(scaler: LossScaler, overflows: str) -> list:
    """Feed a pattern ("." clean, "x" overflow); the scale after each step."""
    out = []
    for c in overflows:
        scaler.update(c == "x")
        out.append(scaler.scale)
    return out


def test_scale_grows_after_window_clean_steps():
    s = LossScaler(8.0, window=3, growth=2.0)
    assert run(s, "......") == [8, 8, 16, 16, 16, 32]


def test_backoff_waits_for_hysteresis_overflows():
    s = LossScaler(64.0, window=100, backoff=0.5, hysteresis=2)
    # First overflow: tolerated; second: back off; every later one backs off until a growth refills.
    assert run(s, "x.x.x") == [64, 64, 32, 32, 16]
    assert s.overflows == 3


def test_an_overflow_resets_the_growth_count():
    s = LossScaler(4.0, window=3, hysteresis=5)
    assert run(s, "..x...") == [4, 4, 4, 4, 4, 8]


def test_growth_refills_hysteresis():
    s = LossScaler(16.0, window=2, hysteresis=1)
    assert run(s, "x..x") == [8, 8, 16, 8]


def test_scale_never_goes_below_minimum():
    s = LossScaler(4.0, backoff=0.5, hysteresis=1, min_scale=1.0)
    assert run(s, "xxxx") == [2, 1, 1, 1]
    assert s.at_minimum


def test_static_scale_never_moves_and_every_overflow_is_at_minimum():
    s = LossScaler(128.0, dynamic=False, window=1)
    assert run(s, ".x..x") == [128] * 5
    assert s.at_minimum and s.overflows == 2


def test_checkpoint_round_trip_continues_exactly(tmp_path):
    a = LossScaler(1024.0, window=3, hysteresis=2)
    run(a, ".x.")
    path = save_parts(str(tmp_path), 3, [a], SoloCommunicator())   # checkpoint meta is JSON
    b = LossScaler(1.0, window=3, hysteresis=2)
    load_parts(path, [b], SoloCommunicator())
    assert b.checkpoint_state() == a.checkpoint_state()
    assert run(a, "..x.x") == run(b, "..x.x")


def test_malformed_state_is_refused(tmp_path):
    path = save(str(tmp_path), 0, {}, {"loss_scale": {"scale": 2.0}}, SoloCommunicator())
    with pytest.raises(CheckpointError, match="loss_scale"):
        load_parts(path, [LossScaler(1.0)], SoloCommunicator())


# -- 16-bit ops ------------------------------------------------------------------------------
def low_input(rng, shape, dtype):
    return Tensor(rng.standard_normal(shape).astype(np.float32).astype(dtype), requires_grad=True)


def param(rng, shape, scale=0.3):
    return Tensor(rng.standard_normal(shape) * scale, requires_grad=True)   # float64 masters


def reference_run(fn, inputs16, params, dtype):
    """fn on float32 copies of the 16-bit inputs and the 16-bit-rounded parameters."""
    xs = [Tensor(x.data.astype(np.float32), requires_grad=True) for x in inputs16]
    ps = [Tensor(p.data.astype(dtype).astype(np.float32), requires_grad=True) for p in params]
    return fn(*xs, *ps), xs, ps


def close_in_low(got, want, precision, ulps=1.0):
    """got (16-bit) equals want (float32) rounded, give or take `ulps` of the 16-bit format in
    norm (||got - want|| / ||want||; rounding the output alone gives at most half an ulp)."""
    want = np.asarray(want, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want)) <= ulps * ULP[precision]


OPS = {
    "linear": (lambda x, w, b: linear(x, w, b), [(6, 8)], [(5, 8), (5,)]),
    "layer_norm": (lambda x, w, b: layer_norm(x, w, b), [(4, 3, 16)], [(16,), (16,)]),
    "gelu": (lambda x: ops.gelu(x), [(4, 9)], []),
    "attention": (lambda qkv: causal_attention(qkv, 2), [(2, 5, 3 * 8)], []),
    "attention-recompute": (lambda qkv: causal_attention(qkv, 2, recompute=True), [(2, 5, 3 * 8)], []),
    "dropout": (lambda x: dropout(x, 0.25, [(1, 2, i) for i in range(3)]), [(3, 4, 8)], []),
}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", list(OPS))
def test_a_16_bit_op_is_its_float32_self_rounded(name, precision):
    fn, in_shapes, p_shapes = OPS[name]
    dtype = LOW[precision]
    rng = np.random.default_rng(3)
    xs = [low_input(rng, s, dtype) for s in in_shapes]
    ps = [param(rng, s) for s in p_shapes]
    out = fn(*xs, *ps)
    assert out.dtype == dtype
    g = rng.standard_normal(out.shape).astype(np.float32).astype(dtype)
    out.backward(g)
    want, rx, rp = reference_run(fn, xs, ps, dtype)
    want.backward(g.astype(np.float32))
    assert close_in_low(out.data, want.data, precision), name
    for x, r in zip(xs, rx):
        assert x.grad.dtype == dtype
        assert close_in_low(x.grad, r.grad, precision), f"{name} input gradient"
    for p, r in zip(ps, rp):
        assert p.grad.dtype == np.float64          # accumulated into the master dtype
        assert np.allclose(p.grad, r.grad, rtol=1e-5, atol=1e-6 * np.abs(r.grad).max()), f"{name} weight gradient"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cross_entropy_of_16_bit_logits_is_float32(precision):
    dtype = LOW[precision]
    rng = np.random.default_rng(4)
    logits = low_input(rng, (3, 5, 11), dtype)
    targets = rng.integers(0, 11, (3, 5))
    loss = cross_entropy(logits, targets)
    assert loss.dtype == np.float32
    loss.backward()
    ref = Tensor(logits.data.astype(np.float32), requires_grad=True)
    want = cross_entropy(ref, targets)
    want.backward()
    assert loss.data == want.data
    assert logits.grad.dtype == dtype
    assert close_in_low(logits.grad, ref.grad, precision)


TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


def gpt_grads(precision: str, cfg=TINY):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 64, (4, 16)), rng.integers(0, 64, (4, 16))
    model = GPT(cfg, seed=1, precision=precision)
    loss = model(x, y)
    loss.backward()
    return float(loss.data), {n: p.grad for n, p in model.named_parameters()}, model


def test_full_precision_gpt_is_unchanged_by_the_precision_argument():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 64, (4, 16)), rng.integers(0, 64, (4, 16))
    plain = GPT(TINY, seed=1)
    a = plain(x, y)
    a.backward()
    loss, grads, model = gpt_grads("full")
    assert float(a.data) == loss and model.activation_dtype == "float32"
    assert all(np.array_equal(p.grad, grads[n]) for n, p in plain.named_parameters())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_gpt_tracks_float32(precision):
    full_loss, full, _ = gpt_grads("full")
    loss, grads, model = gpt_grads(precision)
    assert model.activation_dtype == LOW[precision].name and all(p.dtype == np.float32 for p in model.parameters())
    assert abs(loss - full_loss) / full_loss < 4 * ULP[precision]
    flat = np.concatenate([g.ravel() for g in grads.values()])
    ref = np.concatenate([full[n].ravel() for n in grads])
    # Gradients through a dozen 16-bit roundings: a few percent of the norm under bf16.
    assert np.linalg.norm(flat - ref) / np.linalg.norm(ref) < 16 * ULP[precision]


def test_precision_names():
    assert activation_dtype("full", "float64") == "float64"
    assert activation_dtype("bf16", "float32") == "bfloat16" and is_low("bfloat16") and not is_low("float32")
    with pytest.raises(ConfigError, match="train.precision"):
        GPT(TINY, precision="half")
    with pytest.raises(ConfigError, match='train.precision="bf16"'):
        GPTConfig(dtype="bfloat16").check_dtype()


def test_the_16_bit_gemm_path_tracks_the_float32_one(monkeypatch):
    """The GPU's fp16 path (CuPy float16 GEMMs on the tensor cores), exercised on NumPy float16:
    the same shapes and dtypes in and out as the float32-GEMM path, values within 16-bit rounding."""
    rng = np.random.default_rng(5)
    x = low_input(rng, (6, 16), np.float16)
    w, b = param(rng, (5, 16)), param(rng, (5,))
    g = rng.standard_normal((6, 5)).astype(np.float16)
    runs = []
    for sixteen in (False, True):
        monkeypatch.setattr("hpcpar.autograd.linear._gemm_in_16_bits", lambda a, dt, on=sixteen: on and dt == np.float16)
        xs, ws, bs = (Tensor(t.data.copy(), requires_grad=True) for t in (x, w, b))
        out = linear(xs, ws, bs)
        out.backward(g)
        runs.append((out, xs.grad, ws.grad, bs.grad))
    (o32, gx32, gw32, gb32), (o16, gx16, gw16, gb16) = runs
    assert o16.dtype == o32.dtype == np.float16 and gx16.dtype == np.float16 and gw16.dtype == np.float64
    assert close_in_low(o16.data, o32.data, "fp16", ulps=2.0)
    assert close_in_low(gx16, gx32, "fp16", ulps=2.0)
    assert close_in_low(gw16, gw32, "fp16", ulps=2.0) and np.array_equal(gb16, gb32)
