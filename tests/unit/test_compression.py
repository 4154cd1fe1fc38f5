"""Gradient compressors on simulated ranks (threads), against NumPy references of the same algorithms.

- error feedback loses nothing: compress∘decompress plus the new residual equals the input
  (gradient plus the old residual) bitwise, for int8 and top-k, float32 and float64, over values
  from 1e-30 to 1e30, zeros and exact block maxima; PowerSGD's residual is the input minus the
  approximation (to the input's last bit: it is one floating-point subtraction);
- int8 (both phases, worker and owner residuals), top-k and PowerSGD on 4 ranks equal a reference
  written here from the paper's description (bitwise where the summation order is fixed; PowerSGD's
  orthogonalization by NumPy's QR, 1e-12);
- PowerSGD with rank = min(matrix dims) gives back the mean gradient (1e-10, float64);
- a non-finite gradient reaches the average (so the step is skipped), and a step that is not
  committed leaves the residuals and Q as they were;
- the bucket groups keep matrices from vectors (PowerSGD) and tp-replicated from tp-split
  parameters (int8, top-k); the byte formula per collective kind; the config keys and the
  `grad_wire_dtype` alias.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from compression_reference import ref_int8, ref_orthogonalize, ref_powersgd, ref_topk, run_steps
from test_data_parallel import run_ranks

from hpcpar.config.load import load_config, loads, to_toml
from hpcpar.config.sections import COMPRESSION_KINDS, WIRE_DTYPE_ALIAS, Config
from hpcpar.runtime.comm import bytes_sent
from hpcpar.errors import ConfigError
from hpcpar.parallel.dp.compression import compressors
from hpcpar.parallel.dp.buckets import assign_buckets
from hpcpar.parallel.dp.compression.compressors import (BucketSpec, Compression, Int8, SpecSlot, TopK, _unpack, int8_decode,
                                         make_compressor, topk_count)
from hpcpar.parallel.dp.compression.powersgd import PowerSGD, initial_q, orthogonalize

N = 4  # simulated ranks


def flat_spec(index: int, size: int, dtype: str) -> BucketSpec:
    return BucketSpec(index, size, dtype, (SpecSlot(f"b{index}", 0, size, (size,)),))


def simulate(make, specs: list, grads: list) -> list:
    """`run_steps` of the compressor `make(comm)` on N simulated ranks: grads[step][rank]."""
    def rank(comm):
        c = make(comm)
        c.setup(specs)
        return run_steps(c, [step[comm.rank] for step in grads])
    return run_ranks(N, rank)


def wide_values(rng, size: int, dtype) -> np.ndarray:
    """Random signs and magnitudes from 1e-30 to 1e30, some zeros: a hard case for scales."""
    x = rng.standard_normal(size) * 10.0 ** rng.integers(-30, 30, size)
    x[rng.random(size) < 0.05] = 0.0
    return x.astype(dtype)


def topk_dense(payload, size: int, k: int, dtype) -> np.ndarray:
    """One rank's top-k message as a dense array."""
    nv = k * np.dtype(dtype).itemsize
    out = np.zeros(size, dtype=dtype)
    out[payload[nv:nv + 4 * k].view(np.int32)] = payload[:nv].view(dtype)
    return out


# -- error feedback loses nothing ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", ["int8", "topk"])
def test_compress_decompress_plus_residual_is_the_input_exactly(kind, dtype):
    rng = np.random.default_rng(1)
    size, steps = 4 * 300, 3
    grads = [wide_values(rng, size, dtype) for _ in range(steps)]
    grads[1][:256] = 0.0  # an all-zero block
    grads[2][256:512] = rng.standard_normal(256).astype(dtype) * np.float32(1e-39)  # below float32's normal scales

    def rank(comm):
        c = Int8(comm, block_size=64) if kind == "int8" else TopK(comm, ratio=0.1)
        c.setup([flat_spec(0, size, dtype)])
        bad = []
        residual = np.zeros(size, dtype=dtype)
        for g in grads:
            x = g + residual  # what error feedback compresses
            payload = c.compress(0, g)
            if kind == "int8":
                q, scales = _unpack(payload, size // comm.size)
                sent = int8_decode(q, scales, 64, np.dtype(dtype)).reshape(-1)
            else:
                sent = topk_dense(payload, size, topk_count(size, 0.1), dtype)
            residual = c.worker.pending[0].copy()
            if not np.array_equal(sent + residual, x) or not np.array_equal(x - sent, residual):
                bad.append(int(np.sum(sent + residual != x)))
            c.commit()
        return bad

    assert run_ranks(1, rank) == [[]]


def test_powersgd_residual_is_the_input_minus_the_approximation():
    rng = np.random.default_rng(2)
    shape = (12, 20)
    grads = [rng.standard_normal(shape) for _ in range(3)]

    def rank(comm):
        c = PowerSGD(comm, rank=2, seed=3)
        c.setup([BucketSpec(0, 240, "float64", (SpecSlot("w", 0, 240, shape),))])
        residual, worst = np.zeros(240), 0.0
        for g in grads:
            x = g.reshape(-1) + residual
            approx = c.all_gather(0, c.decompress(0, c.exchange(c.compress(0, g.reshape(-1))).wait()))
            residual = c.worker.pending[0].copy()
            assert np.array_equal(residual, x - approx)
            worst = max(worst, float(np.max(np.abs(approx + residual - x))))
            c.commit()
        return worst / max(float(np.max(np.abs(g))) for g in grads)

    assert run_ranks(1, rank)[0] <= 4 * np.finfo(np.float64).eps  # one rounding of one subtraction


# -- int8 against a reference ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_int8_two_phases_on_4_ranks_equal_the_reference_bitwise(dtype):
    rng = np.random.default_rng(3)
    size, b = N * 250, 32  # parts of 250: the last block of each part is short
    grads = [[(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 3)).astype(dtype) for _ in range(N)]
             for _ in range(3)]

    results = simulate(lambda comm: Int8(comm, block_size=b), [flat_spec(0, size, dtype)], grads)
    worker = [np.zeros(size, dtype=dtype) for _ in range(N)]
    owner = [np.zeros(size // N, dtype=np.result_type(np.float32, dtype)) for _ in range(N)]
    for s, step in enumerate(grads):
        whole, worker, owner = ref_int8([g + r for g, r in zip(step, worker)], owner, b)
        for r in range(N):
            _, got_whole, state = results[r][s]
            np.testing.assert_array_equal(got_whole, whole)
            np.testing.assert_array_equal(state["residual"][0], worker[r])
            np.testing.assert_array_equal(state["owner_residual"][0], owner[r])
    # int8 with 32-value blocks: the average is within a few per cent of the exact mean
    exact = np.mean(grads[0], axis=0)
    assert np.max(np.abs(results[0][0][1] - exact)) < 0.05 * np.max(np.abs(exact))


def test_int8_zero_sends_one_phase_and_its_part():
    """The reduce-scatter case (ZeRO 1/2): each rank's decompressed part is its piece of the
    reference average before re-quantization; no owner residual exists."""
    rng = np.random.default_rng(4)
    size = N * 64
    grads = [rng.standard_normal(size) for _ in range(N)]

    def rank(comm):
        c = Int8(comm, block_size=16)
        c.gathers = False
        c.setup([flat_spec(0, size, "float64")])
        return c.decompress(0, c.exchange(c.compress(0, grads[comm.rank])).wait()), dict(c.owner.pending)

    m = size // N
    whole, _, _ = ref_int8(grads, None, 16)
    for r, (part, owners) in enumerate(run_ranks(N, rank)):
        np.testing.assert_array_equal(part, whole[r * m:(r + 1) * m])
        assert owners == {}


# -- top-k against a reference ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("ratio", [0.03, 1.0])
def test_topk_on_4_ranks_equals_the_reference_bitwise(ratio, dtype):
    rng = np.random.default_rng(5)
    size = N * 101
    grads = [[rng.standard_normal(size).astype(dtype) for _ in range(N)] for _ in range(2)]

    results = simulate(lambda comm: TopK(comm, ratio=ratio), [flat_spec(0, size, dtype)], grads)
    residual = [np.zeros(size, dtype=dtype) for _ in range(N)]
    for s, step in enumerate(grads):
        whole, residual = ref_topk([g + r for g, r in zip(step, residual)], math.ceil(ratio * size))
        for r in range(N):
            part, got, state = results[r][s]
            np.testing.assert_array_equal(got, whole)
            np.testing.assert_array_equal(part, whole[r * size // N:(r + 1) * size // N])
            np.testing.assert_array_equal(state["residual"][0], residual[r])
    if ratio == 1.0:  # everything sent: the exact mean (summed in rank order), nothing owed
        np.testing.assert_allclose(results[0][0][1], np.mean(grads[0], axis=0), rtol=1e-6 if dtype == "float32"
                                   else 1e-14, atol=1e-6 if dtype == "float32" else 1e-14)
        assert not np.any(results[0][1][2]["residual"][0])


# -- PowerSGD against a reference -------------------------------------------------------------------

SHAPES = [(12, 20), (20, 12), (8, 8)]


def powersgd_bucket(shapes):
    slots, off = [], 0
    for j, sh in enumerate(shapes):
        slots.append(SpecSlot(f"m{j}", off, sh[0] * sh[1], sh))
        off += sh[0] * sh[1]
    size = -(-off // N) * N
    return BucketSpec(0, size, "float64", tuple(slots)), size


def run_powersgd(grads, rank_r, seed=7):
    spec, size = powersgd_bucket(SHAPES)
    return simulate(lambda comm: PowerSGD(comm, rank=rank_r, seed=seed), [spec], grads), spec, size


def test_powersgd_on_4_ranks_equals_the_reference():
    rng = np.random.default_rng(8)
    spec, size = powersgd_bucket(SHAPES)
    grads = [[rng.standard_normal(size) for _ in range(N)] for _ in range(2)]
    for g in (gr for step in grads for gr in step):
        g[sum(a * b for a, b in SHAPES):] = 0.0  # the bucket's padding holds no gradient
    results, spec, size = run_powersgd(grads, 3)
    qs = [initial_q(s.key, s.shape[1], min(3, *s.shape), 7, np.float64, np) for s in spec.slots]
    residual = [np.zeros(size) for _ in range(N)]
    for step in range(2):
        whole, residual, qs = ref_powersgd([g + r for g, r in zip(grads[step], residual)], qs,
                                           [(s.offset, *s.shape) for s in spec.slots])
        for r in range(N):
            _, got, state = results[r][step]
            scale = np.max(np.abs(whole))
            assert np.max(np.abs(got - whole)) <= 1e-12 * scale
            assert np.max(np.abs(state["residual"][0] - residual[r])) <= 1e-12 * scale
            assert all(np.max(np.abs(state["powersgd_q"][(0, j)] - qs[j])) <= 1e-12 * np.max(np.abs(qs[j]))
                       for j in range(3))
        assert all(np.array_equal(results[0][step][1], results[r][step][1]) for r in range(N))  # same bits


def test_powersgd_at_full_rank_gives_back_the_mean_gradient():
    rng = np.random.default_rng(9)
    spec, size = powersgd_bucket(SHAPES)
    grads = [[rng.standard_normal(size) for _ in range(N)]]
    results, _, _ = run_powersgd(grads, rank_r=min(min(s) for s in SHAPES) + 100)  # min(rank, a, b) = min(a, b)
    mean = np.mean(grads[0], axis=0)
    used = sum(a * b for a, b in SHAPES)
    assert np.max(np.abs(results[0][0][1][:used] - mean[:used])) <= 1e-10 * np.max(np.abs(mean))


def test_powersgd_at_full_rank_gives_back_a_rank_deficient_mean_gradient():
    """Matrices with zero rows (an embedding's rows of tokens no rank's batch holds) and one of rank
    1: at full rank P's columns beyond the average's rank are rounding noise, which must become
    unit columns orthogonal to the others (not noise that stretches P Pᵀ M past M), and the next
    step, of full rank, must come back whole from the warm-started Q (not with those columns lost)."""
    rng = np.random.default_rng(11)
    spec, size = powersgd_bucket(SHAPES)
    grads = [[rng.standard_normal(size) for _ in range(N)]]
    (a0, b0), (a1, b1) = SHAPES[0], SHAPES[1]
    for g in grads[0]:
        g[3 * b0:a0 * b0] = 0.0  # matrix 0: rows 3.. are zero on every rank (rank 3 < min(a, b) = 12)
        g[a0 * b0:a0 * b0 + a1 * b1] = np.outer(rng.standard_normal(a1), rng.standard_normal(b1)).reshape(-1)
    grads.append([rng.standard_normal(size) for _ in range(N)])  # then full rank: the warm-started Q
    results, _, _ = run_powersgd(grads, rank_r=100)                  # must still span everything
    used = sum(a * b for a, b in SHAPES)
    for step in range(2):
        mean = np.mean(grads[step], axis=0)
        assert np.max(np.abs(results[0][step][1][:used] - mean[:used])) <= 1e-10 * np.max(np.abs(mean))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_orthogonalize_replaces_columns_in_the_span_of_earlier_ones(dtype):
    """A dependent (or zero) column is rounding noise after the projections: normalised it would
    not be orthogonal to the others and P Pᵀ would stretch. It must become a unit column
    orthogonal to them (a coordinate axis made so), so that P stays orthonormal; with zero rows
    (rank 3 of 5 columns: the embedding rows of absent tokens) that column lies in the zero rows."""
    rng = np.random.default_rng(12)
    dependent = rng.standard_normal((8, 5)).astype(dtype)
    dependent[:, 2] = dependent[:, 0] - 3 * dependent[:, 1]
    dependent[:, 4] = 2 * dependent[:, 3]
    zero_rows = rng.standard_normal((8, 5)).astype(dtype)
    zero_rows[3:] = 0
    tol = 100 * np.finfo(dtype).eps
    for p in (dependent, zero_rows, np.zeros((4, 2), dtype=dtype)):
        before = p.copy()
        orthogonalize(p)
        np.testing.assert_allclose(p.T @ p, np.eye(p.shape[1]), atol=tol)
        assert np.linalg.norm(p @ p.T @ before, 2) <= (1 + tol) * np.linalg.norm(before, 2)  # no stretch
    assert not zero_rows[:3, 3:].any()  # outside the span of the nonzero rows: nothing of M lost or added


def test_orthogonalize_is_deterministic_and_orthonormal():
    p = np.random.default_rng(10).standard_normal((30, 5))
    a, b = p.copy(), p.copy()
    orthogonalize(a)
    orthogonalize(b)
    assert np.array_equal(a, b)
    np.testing.assert_allclose(a.T @ a, np.eye(5), atol=1e-14)
    np.testing.assert_allclose(a, ref_orthogonalize(p), atol=1e-13)


# -- non-finite gradients and uncommitted steps --------------------------------------------------------

@pytest.mark.parametrize("kind", ["int8", "topk", "powersgd", "fp16", "bf16"])
def test_a_nan_reaches_the_average_and_an_uncommitted_step_changes_no_state(kind):
    spec, size = powersgd_bucket(SHAPES)
    rng = np.random.default_rng(11)
    good = [rng.standard_normal(size) for _ in range(N)]
    bad = [g.copy() for g in good]
    bad[2][5] = np.nan

    def rank(comm):
        c = make_compressor(Compression(kind, ratio=0.05, rank=2), comm)
        c.setup([spec])

        def step(grads):
            return c.all_gather(0, c.decompress(0, c.exchange(c.compress(0, grads[comm.rank])).wait()))
        step(good)
        c.commit()
        before = {k: {i: a.copy() for i, a in v.items()} for k, v in c.state().items()}
        nan = step(bad)  # not committed: the trainer skips this step
        after = c.state()
        same = all(np.array_equal(before[k][i], after[k][i]) for k in before for i in before[k])
        return bool(np.isnan(nan).any()), same

    assert run_ranks(N, rank) == [(True, True)] * N


# -- plumbing -------------------------------------------------------------------------------------------

def test_bucket_groups_keep_matrices_and_tp_split_parameters_apart():
    # registration order a (matrix), b (vector), c (matrix), d (vector); buckets fill in reverse
    params = [("a", 6, "float32"), ("b", 2, "float32"), ("c", 6, "float32"), ("d", 2, "float32")]
    psgd = Compression("powersgd")
    groups = [psgd.bucket_group(nd, False) for nd in (2, 1, 2, 1)]
    assignments = assign_buckets(params, bucket_bytes=1 << 20, pad_to=4, groups=groups)
    assert [[s.name for s in p.slots] for p in assignments] == [["d", "b"], ["c", "a"]]
    assert [p.size for p in assignments] == [4, 12]
    topk = Compression("topk")
    groups = [topk.bucket_group(2, split) for split in (True, False, True, False)]
    assignments = assign_buckets(params, bucket_bytes=40, groups=groups)  # 40 bytes: 10 float32
    # c + a reach 40 bytes and close first; d + b stay open until the end
    assert [[s.name for s in p.slots] for p in assignments] == [["c", "a"], ["d", "b"]]
    assert assign_buckets(params, bucket_bytes=1 << 20) == assign_buckets(params, bucket_bytes=1 << 20, groups=None)
    assert Compression("fp16").bucket_group(2, True) is None


def test_bytes_sent_per_collective_kind():
    s = 1000
    assert bytes_sent("all_reduce", s, 4) == 1500 and bytes_sent("reduce_scatter", s, 4) == 750
    assert bytes_sent("all_gather", s, 4) == 3000 and bytes_sent("all_to_all", s, 4) == 750
    assert bytes_sent("send", s, 2) == s and bytes_sent("recv", s, 2) == 0 and bytes_sent("broadcast", s, 4) == s
    assert all(bytes_sent(op, s, 1) == 0 for op in ("all_reduce", "all_gather", "send"))


@pytest.mark.parametrize("kw, match", [({"kind": "int4"}, "compression 'int4' is unknown"),
                                       ({"kind": "topk", "ratio": 0.0}, r"outside \(0, 1\]"),
                                       ({"kind": "topk", "ratio": 1.5}, r"outside \(0, 1\]"),
                                       ({"kind": "powersgd", "rank": 0}, "rank 0 must be >= 1"),
                                       ({"kind": "int8", "block_size": 0}, "block size 0 must be >= 1")])
def test_bad_compression_arguments_are_one_line_errors(kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        Compression(**kw)
    assert "\n" not in str(e.value)


def test_config_keys_and_the_grad_wire_dtype_alias():
    assert COMPRESSION_KINDS == compressors.KINDS
    assert WIRE_DTYPE_ALIAS == compressors.WIRE_DTYPE_KINDS
    assert load_config(None, ["train.grad_wire_dtype=float16"]).train.grad_compression == "fp16"
    assert load_config(None, ["train.grad_wire_dtype=bfloat16"]).train.grad_compression == "bf16"
    kept = load_config(None, ["train.grad_compression=int8", "train.grad_wire_dtype=float32"])
    assert kept.train.grad_compression == "int8"  # float32 was the old default: it means nothing
    old = to_toml(Config()).replace('grad_compression = "none"', 'grad_wire_dtype = "float32"')
    assert loads(old).train.grad_compression == "none"  # configs saved before the new key load
    assert "grad_wire_dtype" not in to_toml(Config())
    c = Config()
    assert (c.train.grad_compression, c.train.compression_ratio, c.train.powersgd_rank, c.train.error_feedback,
            c.train.compression_start_step, c.train.int8_block_size) == ("none", 0.01, 4, True, 0, 256)
