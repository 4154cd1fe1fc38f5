"""Optimizers, clipping and LR schedule against PyTorch (float64) and closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpcpar.errors import CheckpointError, ConfigError
from hpcpar.optim.optimizers import SGD, AdamW, clip_grad_norm, grad_norm_sq, lr_at


class P:
    """The parameter protocol the optimizers need: .data, .grad, .no_decay."""

    def __init__(self, data: np.ndarray, no_decay: bool = False) -> None:
        self.data = data
        self.grad: np.ndarray | None = None
        self.no_decay = no_decay


SHAPES = [((4, 3), False), ((3,), True), ((2, 5), False)]  # a bias-like no_decay parameter in the middle


def make_params(seed: int = 0, dtype=np.float64) -> list[P]:
    rng = np.random.default_rng(seed)
    return [P(rng.standard_normal(s).astype(dtype), nd) for s, nd in SHAPES]


def grads_for(steps: int, seed: int = 1) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s) for s, _ in SHAPES] for _ in range(steps)]


def torch_params(params: list[P]):
    torch = pytest.importorskip("torch")
    return [torch.tensor(p.data.copy(), dtype=torch.float64, requires_grad=True) for p in params]


def torch_groups(tparams, params, weight_decay):
    decay = [t for t, p in zip(tparams, params) if not p.no_decay]
    no_decay = [t for t, p in zip(tparams, params) if p.no_decay]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def run_both(ours, theirs, params, tparams, grads, lrs):
    torch = pytest.importorskip("torch")
    for gs, lr in zip(grads, lrs):
        for p, t, g in zip(params, tparams, gs):
            p.grad = g.copy()
            t.grad = torch.tensor(g)
        for group in theirs.param_groups:  # None: back to the base lr
            group["lr"] = ours.lr if lr is None else lr
        ours.step(lr=lr)
        theirs.step()
        for p, t in zip(params, tparams):
            np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-12, atol=1e-14)


def test_adamw_matches_torch():
    torch = pytest.importorskip("torch")
    params = make_params()
    tparams = torch_params(params)
    kw = dict(lr=0.05, betas=(0.8, 0.9), eps=1e-6)
    ours = AdamW(params, weight_decay=0.3, **kw)
    theirs = torch.optim.AdamW(torch_groups(tparams, params, 0.3), foreach=False, **kw)
    lrs = [None, 0.02, 0.04, None, 0.1, 0.01]  # schedule overrides, then back to the base lr
    run_both(ours, theirs, params, tparams, grads_for(len(lrs)), lrs)
    for p, t in zip(params, tparams):
        st = theirs.state[t]
        np.testing.assert_allclose(ours.state_of(p)["exp_avg"], st["exp_avg"].numpy(), rtol=1e-12)
        np.testing.assert_allclose(ours.state_of(p)["exp_avg_sq"], st["exp_avg_sq"].numpy(), rtol=1e-12)
    assert ours.step_count == len(lrs)


def test_adamw_no_decay_parameter_is_not_decayed():
    # With zero gradients Adam's update is exactly zero, so only decay moves a parameter.
    params = make_params()
    before = [p.data.copy() for p in params]
    opt = AdamW(params, lr=0.1, weight_decay=0.5)
    for p in params:
        p.grad = np.zeros_like(p.data)
    opt.step()
    for p, b in zip(params, before):
        np.testing.assert_array_equal(p.data, b if p.no_decay else b * (1 - 0.1 * 0.5))


@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 0.01), (0.0, 0.05), (0.5, 0.0)])
def test_sgd_matches_torch(momentum, weight_decay):
    torch = pytest.importorskip("torch")
    params = make_params()
    tparams = torch_params(params)
    ours = SGD(params, lr=0.1, momentum=momentum, weight_decay=weight_decay)
    theirs = torch.optim.SGD(torch_groups(tparams, params, weight_decay), lr=0.1, momentum=momentum,
                             foreach=False)
    lrs = [None, 0.05, None, 0.2, None]
    run_both(ours, theirs, params, tparams, grads_for(len(lrs)), lrs)
    if momentum:
        for p, t in zip(params, tparams):
            np.testing.assert_allclose(ours.state_of(p)["momentum_buffer"],
                                       theirs.state[t]["momentum_buffer"].numpy(), rtol=1e-12)
    else:
        assert all(ours.state_of(p) == {} for p in params)


@pytest.mark.parametrize("cls,kw", [(AdamW, dict(lr=0.01)), (SGD, dict(lr=0.1, momentum=0.9))])
def test_update_is_in_place_and_skips_missing_grads(cls, kw):
    params = make_params()
    views = [p.data.reshape(-1) for p in params]  # others (DP buckets, checkpoints) hold views
    ids = [id(p.data) for p in params]
    opt = cls(params, **kw)
    frozen = params[1].data.copy()
    for p, g in zip(params, grads_for(1)[0]):
        p.grad = g
    params[1].grad = None
    opt.step()
    assert [id(p.data) for p in params] == ids
    for p, v in zip(params, views):
        np.testing.assert_array_equal(v, p.data.reshape(-1))
    np.testing.assert_array_equal(params[1].data, frozen)
    assert not np.array_equal(params[0].data, make_params()[0].data)


def test_float32_parameters_stay_float32():
    params = make_params(dtype=np.float32)
    opt = AdamW(params, lr=0.01)
    for p, g in zip(params, grads_for(1)[0]):
        p.grad = g.astype(np.float32)
    opt.step()
    assert all(p.data.dtype == np.float32 for p in params)
    assert all(a.dtype == np.float32 for p in params for a in opt.state_of(p).values())


def test_zero_grad_drops_gradients():
    params = make_params()
    for p in params:
        p.grad = np.ones_like(p.data)
    AdamW(params).zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("cls,kw", [(AdamW, dict(lr=0.01, weight_decay=0.1)),
                                    (SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01))])
def test_state_dict_round_trip_resumes_exactly(cls, kw):
    grads = grads_for(5)
    a_params = make_params()
    a = cls(a_params, **kw)
    for step, gs in enumerate(grads):
        if step == 2:  # "checkpoint": copy the state into a fresh optimizer over copied params
            b_params = [P(p.data.copy(), p.no_decay) for p in a_params]
            b = cls(b_params, **kw)
            saved = a.state_dict()
            b.load_state_dict({**saved, "state": [{k: v.copy() for k, v in s.items()} for s in saved["state"]]})
            assert b.step_count == 2
        for p, g in zip(a_params, gs):
            p.grad = g.copy()
        a.step()
        if step >= 2:
            for p, g in zip(b_params, gs):
                p.grad = g.copy()
            b.step()
    for pa, pb in zip(a_params, b_params):
        np.testing.assert_array_equal(pa.data, pb.data)


def test_state_dict_names_state_per_parameter():
    params = make_params()
    opt = AdamW(params)
    sd = opt.state_dict()
    assert sd["step"] == 0 and len(sd["state"]) == len(params)
    for p, st in zip(params, sd["state"]):
        assert st is opt.state_of(p)
        assert set(st) == {"exp_avg", "exp_avg_sq"}
        assert all(a.shape == p.data.shape for a in st.values())
    with pytest.raises(ValueError):
        opt.state_of(P(np.zeros(3)))


def test_load_state_dict_rejects_mismatches():
    opt = AdamW(make_params())
    sd = opt.state_dict()
    with pytest.raises(CheckpointError, match="parameters"):
        opt.load_state_dict({**sd, "state": sd["state"][:2]})
    bad_shape = [dict(s) for s in sd["state"]]
    bad_shape[0] = {k: np.zeros((5, 5)) for k in bad_shape[0]}
    with pytest.raises(CheckpointError, match="shape"):
        opt.load_state_dict({**sd, "state": bad_shape})
    with pytest.raises(CheckpointError, match="another optimizer"):
        opt.load_state_dict(SGD(make_params(), lr=0.1, momentum=0.9).state_dict())


def test_bad_hyperparameters_raise_config_error():
    with pytest.raises(ConfigError):
        AdamW(make_params(), betas=(1.0, 0.9))
    with pytest.raises(ConfigError):
        AdamW(make_params(), eps=0.0)
    with pytest.raises(ConfigError):
        SGD(make_params(), lr=0.1, momentum=-0.1)
    params = make_params()
    with pytest.raises(ConfigError, match="twice"):
        AdamW(params + params[:1])


@pytest.mark.parametrize("max_norm", [0.5, 1e3])  # clipping, and a bound that does not bite
def test_clip_grad_norm_matches_torch(max_norm):
    torch = pytest.importorskip("torch")
    params = make_params()
    tparams = torch_params(params)
    for p, t, g in zip(params, tparams, grads_for(1)[0]):
        p.grad = g.copy()
        t.grad = torch.tensor(g)
    norm = clip_grad_norm(params, max_norm)
    tnorm = torch.nn.utils.clip_grad_norm_(tparams, max_norm)
    assert norm == pytest.approx(float(tnorm), rel=1e-14)
    for p, t in zip(params, tparams):
        np.testing.assert_allclose(p.grad, t.grad.numpy(), rtol=1e-14)


def test_clip_disabled_and_missing_grads():
    params = make_params()
    grads = grads_for(1)[0]
    for p, g in zip(params, grads):
        p.grad = g.copy()
    params[2].grad = None
    expected = math.sqrt(sum(float((g ** 2).sum()) for g in grads[:2]))
    assert clip_grad_norm(params, 0.0) == pytest.approx(expected, rel=1e-14)
    for p, g in zip(params[:2], grads):
        np.testing.assert_array_equal(p.grad, g)


def test_clip_uses_the_reduced_norm():
    params = make_params()
    for p, g in zip(params, grads_for(1)[0]):
        p.grad = g.copy()
    local = grad_norm_sq(params)
    seen = []

    def reduce(sq: float) -> float:  # as if three identical ranks were summed
        seen.append(sq)
        return 3 * sq

    before = [p.grad.copy() for p in params]
    norm = clip_grad_norm(params, 1.0, norm_sq_reduce=reduce)
    assert seen == [pytest.approx(local, rel=1e-15)]
    assert norm == pytest.approx(math.sqrt(3 * local), rel=1e-14)
    for p, b in zip(params, before):
        np.testing.assert_allclose(p.grad, b / (norm + 1e-6), rtol=1e-14)
    assert math.sqrt(grad_norm_sq(params)) * math.sqrt(3) == pytest.approx(1.0, rel=1e-5)


def test_grad_norm_sq_accumulates_float32_in_float64():
    # 2**24 + 1 is not representable in float32: float32 accumulation would lose the ones.
    p = P(np.zeros(1 + 4096, dtype=np.float32))
    p.grad = np.ones(1 + 4096, dtype=np.float32)
    p.grad[0] = 2.0 ** 12
    assert grad_norm_sq([p]) == 2.0 ** 24 + 4096


def test_lr_schedule_key_steps():
    base, lo, warm, total = 1e-3, 1e-4, 10, 110
    assert lr_at(0, base, warm, total, lo) == pytest.approx(base / warm)
    assert lr_at(4, base, warm, total, lo) == pytest.approx(base * 5 / warm)
    assert lr_at(warm - 1, base, warm, total, lo) == pytest.approx(base)
    assert lr_at(warm, base, warm, total, lo) == pytest.approx(base)
    assert lr_at(60, base, warm, total, lo) == pytest.approx((base + lo) / 2)  # half-way through decay
    assert lr_at(35, base, warm, total, lo) == pytest.approx(lo + (base - lo) * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_at(total, base, warm, total, lo) == pytest.approx(lo)
    assert lr_at(total + 50, base, warm, total, lo) == lo
    decay = [lr_at(s, base, warm, total, lo) for s in range(warm, total + 1)]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert lr_at(0, base, 0, total, lo) == pytest.approx(base)  # no warm-up
    with pytest.raises(ConfigError):
        lr_at(0, base, -1, total, lo)
