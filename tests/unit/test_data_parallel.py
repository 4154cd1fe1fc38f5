"""Data parallelism in one process: the bucket plan, 16-bit wire formats, and dp = 1
(same API, no communication) against plain AdamW on the whole batch."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar import data
from hpcpar.errors import CheckpointError, ConfigError
from hpcpar.mesh import Mesh
from hpcpar.nn import GPT, GPTConfig
from hpcpar.optim import AdamW, clip_grad_norm
from hpcpar.parallel.data_parallel import DataParallel, decode16, encode16, plan_buckets

CFG = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=16, dtype="float64")
TOKENS = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)


# -- plan -------------------------------------------------------------------------------------

def test_plan_reverse_order_cap_and_padding():
    params = [("a", 10, "float32"), ("b", 3, "float32"), ("c", 300, "float32"), ("d", 5, "float32")]
    plan = plan_buckets(params, bucket_bytes=40, pad_to=4)
    assert [[s.name for s in b.slots] for b in plan] == [["d", "c"], ["b", "a"]]
    assert [b.size for b in plan] == [308, 16]          # 305 -> 308, 13 -> 16 (multiples of 4)
    assert [b.used for b in plan] == [305, 13]
    assert [(s.offset, s.numel) for s in plan[0].slots] == [(0, 5), (5, 300)]
    assert [s.index for s in plan[1].slots] == [1, 0]


def test_plan_large_parameter_alone_and_dtype_change_splits():
    params = [("a", 4, "float64"), ("b", 1000, "float32"), ("c", 4, "float32")]
    plan = plan_buckets(params, bucket_bytes=64)
    assert [[s.name for s in b.slots] for b in plan] == [["c", "b"], ["a"]]
    assert [b.dtype for b in plan] == ["float32", "float64"]
    plan = plan_buckets([("a", 1000, "float32"), ("b", 4, "float32")], bucket_bytes=64)
    assert [[s.name for s in b.slots] for b in plan] == [["b", "a"]]  # closed once past the cap


def test_plan_tied_weights_go_last_sorted():
    params = [("wte", 8, "float64"), ("x", 2, "float64"), ("lm_head", 8, "float64")]
    plan = plan_buckets(params, bucket_bytes=1 << 20, pad_to=3, tied={"wte", "lm_head"})
    assert [s.name for s in plan[0].slots] == ["x"] and not plan[0].tied
    assert [s.name for s in plan[1].slots] == ["lm_head", "wte"] and plan[1].tied
    assert plan[1].size == 18


# -- wire formats -----------------------------------------------------------------------------

def test_float16_wire_roundtrip():
    x = np.random.default_rng(1).standard_normal(1000)
    got = decode16(encode16(x, "float16"), "float16")
    np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))


def test_bfloat16_wire_rounds_like_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(5000).astype(np.float32) * 10.0 ** rng.integers(-20, 20, 5000),
                        np.float32([0.0, -0.0, np.inf, -np.inf, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8])])
    got = decode16(encode16(x, "bfloat16"), "bfloat16")
    want = torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(got, want)
    assert np.isnan(decode16(encode16(np.float32([np.nan]), "bfloat16"), "bfloat16")).all()


# -- dp = 1 -----------------------------------------------------------------------------------

def make_dp(zero=0, bucket_mb=0.002, **kw):
    model = GPT(CFG, seed=5)
    mesh = Mesh(comm=MPI.COMM_SELF)
    dp = DataParallel(list(model.named_parameters()), mesh, bucket_mb=bucket_mb, zero=zero,
                      make_optimizer=lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1), **kw)
    return model, dp


def run_dp(model, dp, steps=3, m=2, mbs=2, clip=0.5):
    losses = []
    for step in range(steps):
        dp.begin_step(microbatches=m)
        total = 0.0
        for j in range(m):
            x, y = data.get_batch(TOKENS, 7, step, data.microbatch_sample_ids(0, 1, mbs, j), CFG.block_size)
            loss = model(x, y)
            loss.backward(np.float64(1.0 / m))
            total += loss.item() / m
        dp.finish_backward()
        dp.clip_grad_norm(clip)
        dp.step(1e-2)
        losses.append(total)
    return losses


def run_reference(steps=3, batch=4, clip=0.5):
    model = GPT(CFG, seed=5)
    params = model.parameters()
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        for p in params:
            p.grad = None
        x, y = data.get_batch(TOKENS, 7, step, range(batch), CFG.block_size)
        loss = model(x, y)
        loss.backward()
        clip_grad_norm(params, clip)
        opt.step(1e-2)
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("zero", [0, 1])
def test_dp1_accumulation_matches_whole_batch(zero):
    ref, ref_losses = run_reference()
    model, dp = make_dp(zero=zero)
    assert len(dp.buckets) > 2
    losses = run_dp(model, dp)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.data, want[name].data, rtol=1e-10, atol=1e-14, err_msg=name)
    assert dp.optimizer_step_count() == 3


def test_hooks_launch_buckets_during_backward_in_order():
    model, dp = make_dp()
    dp.begin_step(microbatches=1)
    x, y = data.get_batch(TOKENS, 7, 0, range(2), CFG.block_size)
    model(x, y).backward()
    starts = [i for kind, i, _ in dp.events if kind == "bucket_start"]
    assert starts == list(range(len(dp.buckets)))  # all launched from hooks, in order
    dp.finish_backward()


def test_second_backward_beyond_microbatches_is_an_error():
    model, dp = make_dp()
    dp.begin_step(microbatches=1)
    x, y = data.get_batch(TOKENS, 7, 0, range(2), CFG.block_size)
    model(x, y).backward()
    with pytest.raises(RuntimeError, match="micro-batch"):
        model(x, y).backward()


def test_optimizer_state_roundtrip_zero():
    model, dp = make_dp(zero=1)
    run_dp(model, dp, steps=2)
    state = dp.optimizer_state()
    assert set(state) == {n for n, _ in model.named_parameters()}
    model2, dp2 = make_dp(zero=1)
    dp2.load_optimizer_state(state, dp.optimizer_step_count())
    for name, st in dp2.optimizer_state().items():
        for k, v in st.items():
            np.testing.assert_array_equal(v, state[name][k])
    assert dp2.optimizer_step_count() == 2
    bad = {n: dict(st) for n, st in state.items()}
    bad["transformer.wpe.weight"]["exp_avg"] = np.zeros(3)
    with pytest.raises(CheckpointError, match="wpe"):
        dp2.load_optimizer_state(bad)


@pytest.mark.parametrize("kw, match", [({"wire_dtype": "int8"}, "wire_dtype"), ({"zero": 2}, "ZeRO"),
                                       ({"bucket_mb": 0}, "bucket_mb")])
def test_bad_arguments(kw, match):
    with pytest.raises(ConfigError, match=match):
        make_dp(**kw)
