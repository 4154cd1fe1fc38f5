"""Gradient compression under mpiexec: the collectives against NumPy references, training on
every kind of layout, and resume through checkpoints.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_compression.py (the collectives at any
world size >= 2; the training tests need 4 ranks).

- The int8 (both phases), top-k and PowerSGD collectives over the world, on real MPI, equal the
  references of tests/compression_reference.py computed here from every rank's input (each rank
  draws all ranks' gradients from one seed): int8 and top-k bitwise, float32 and float64;
  PowerSGD to 1e-12 and, at rank = min(matrix dims), the mean gradient to 1e-10.
- Training (float64, tiny GPT): top-k at ratio 1 and PowerSGD at full rank lose nothing, so on
  dp, dp x tp, dp x pp (1F1B, interleaved), ZeRO 1 and 2 and HSDP they reproduce the
  uncompressed run to 1e-9; int8 and the 16-bit wires train on the same layouts within their
  rounding, with replicas bitwise identical; the step records count the bytes and the ratio.
- Resume: with each compressor, 2 steps + save + load into a fresh trainer + 2 steps equals 4
  uninterrupted steps bitwise (residuals and PowerSGD's Q travel in the checkpoint); a
  checkpoint saved with compression loads without it, and one saved without loads with it.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, rel_err, stored
from compression_reference import ref_int8, ref_powersgd, ref_topk, run_steps

from hpcpar.config.load import load_config
from hpcpar.runtime.comm import Communicator
from hpcpar.parallel.dp.compression.compressors import BucketSpec, Int8, SpecSlot, TopK
from hpcpar.parallel.dp.compression.powersgd import PowerSGD, initial_q
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
needs_4 = pytest.mark.skipif(SIZE != 4, reason="the layouts need 4 ranks")
collectives = pytest.mark.skipif(SIZE < 2, reason="a collective needs 2 ranks")


@pytest.fixture(scope="module")
def comm():
    c = Communicator(WORLD.Dup(), "compression-test")
    yield c
    c.free()


def every_rank(seed: int, size: int, steps: int, dtype="float64") -> list[list[np.ndarray]]:
    """grads[step][rank]: every rank draws all of them, so each can compute the reference."""
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 3)).astype(dtype) for _ in range(SIZE)]
            for _ in range(steps)]


def flat_spec(size: int, dtype: str) -> list[BucketSpec]:
    return [BucketSpec(0, size, dtype, (SpecSlot("b", 0, size, (size,)),))]


# -- the collectives against the references ---------------------------------------------------------

@collectives
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_int8_both_phases_equal_the_reference_bitwise(comm, dtype):
    size, b = SIZE * 250, 32  # parts of 250: each part's last block is short
    grads = every_rank(1, size, 3, dtype)
    c = Int8(comm, block_size=b)
    c.setup(flat_spec(size, dtype))
    got = run_steps(c, [step[RANK] for step in grads])
    worker = [np.zeros(size, dtype=dtype)] * SIZE
    owner = [np.zeros(size // SIZE, dtype=np.result_type(np.float32, dtype))] * SIZE
    bad = []
    for s, step in enumerate(grads):
        whole, worker, owner = ref_int8([g + r for g, r in zip(step, worker)], owner, b)
        _, mine, state = got[s]
        if not (np.array_equal(mine, whole) and np.array_equal(state["residual"][0], worker[RANK])
                and np.array_equal(state["owner_residual"][0], owner[RANK])):
            bad.append(s)
    collective_assert(not bad, f"int8 differs from the reference at steps {bad}")


@collectives
def test_int8_reduce_scatter_case_is_phase_one_only(comm):
    size = SIZE * 64
    grads = every_rank(2, size, 1)[0]
    c = Int8(comm, block_size=16)
    c.gathers = False  # ZeRO 1/2: the caller keeps its part
    c.setup(flat_spec(size, "float64"))
    part = c.decompress(0, c.exchange(c.compress(0, grads[RANK])).wait())
    whole, _, _ = ref_int8(grads, None, 16)
    m = size // SIZE
    collective_assert(np.array_equal(part, whole[RANK * m:(RANK + 1) * m]) and not c.owner.pending,
                      "int8 phase one differs from the reference (or kept an owner residual)")


@collectives
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("ratio", [0.02, 1.0])
def test_topk_equals_the_reference_bitwise(comm, ratio, dtype):
    size = SIZE * 101
    grads = every_rank(3, size, 3, dtype)
    c = TopK(comm, ratio=ratio)
    c.setup(flat_spec(size, dtype))
    got = run_steps(c, [step[RANK] for step in grads])
    residual, bad = [np.zeros(size, dtype=dtype)] * SIZE, []
    for s, step in enumerate(grads):
        whole, residual = ref_topk([g + r for g, r in zip(step, residual)], math.ceil(ratio * size))
        part, mine, state = got[s]
        m = size // SIZE
        if not (np.array_equal(mine, whole) and np.array_equal(part, whole[RANK * m:(RANK + 1) * m])
                and np.array_equal(state["residual"][0], residual[RANK])):
            bad.append(s)
    collective_assert(not bad, f"top-k differs from the reference at steps {bad}")


SHAPES = [(12, 20), (20, 12), (8, 8)]


def powersgd_run(comm, rank_r: int, steps: int):
    slots, off = [], 0
    for j, (a, b) in enumerate(SHAPES):
        slots.append(SpecSlot(f"m{j}", off, a * b, (a, b)))
        off += a * b
    size = -(-off // SIZE) * SIZE
    grads = every_rank(4, size, steps)
    for g in (g for step in grads for g in step):
        g[off:] = 0.0  # the bucket's padding holds no gradient
    c = PowerSGD(comm, rank=rank_r, seed=7)
    c.setup([BucketSpec(0, size, "float64", tuple(slots))])
    return grads, run_steps(c, [step[RANK] for step in grads]), slots


@collectives
def test_powersgd_equals_the_reference(comm):
    grads, got, slots = powersgd_run(comm, 3, steps=3)
    qs = [initial_q(s.key, s.shape[1], min(3, *s.shape), 7, np.float64, np) for s in slots]
    residual, worst = [np.zeros_like(grads[0][0])] * SIZE, 0.0
    for s, step in enumerate(grads):
        whole, residual, qs = ref_powersgd([g + r for g, r in zip(step, residual)], qs,
                                           [(sl.offset, *sl.shape) for sl in slots])
        _, mine, state = got[s]
        scale = np.max(np.abs(whole))
        worst = max(worst, np.max(np.abs(mine - whole)) / scale,
                    np.max(np.abs(state["residual"][0] - residual[RANK])) / scale,
                    *(np.max(np.abs(state["powersgd_q"][(0, j)] - q)) / np.max(np.abs(q)) for j, q in enumerate(qs)))
    same = WORLD.allgather(got[-1][1].tobytes())
    collective_assert(worst <= 1e-12 and len(set(same)) == 1,
                      f"PowerSGD vs the reference: {worst:.2e} (or ranks disagree: {len(set(same))} versions)")


@collectives
def test_powersgd_at_full_rank_is_the_mean(comm):
    grads, got, slots = powersgd_run(comm, max(min(s) for s in SHAPES), steps=1)  # r' = min(a, b) each
    used = sum(a * b for a, b in SHAPES)
    mean = np.mean(grads[0], axis=0)
    err = np.max(np.abs(got[0][1][:used] - mean[:used])) / np.max(np.abs(mean))
    collective_assert(err <= 1e-10, f"full-rank PowerSGD is {err:.2e} from the mean gradient")


# -- training on every kind of layout ------------------------------------------------------------------

TINY = ["model.n_layer=4", "model.n_embd=16", "model.n_head=2", "model.block_size=8", "model.vocab_size=256",
        "model.dtype=float64", "train.steps=4", "train.warmup=1", "train.lr=0.01", "train.microbatches=2",
        "run.progress=false", "run.eval_every=0", "train.bucket_mb=0.004"]  # ~1000 values: several buckets
# (dp, tp, pp, zero, dp_replicate, schedule) with a global batch of 8 sequences
LAYOUTS = [(4, 1, 1, 0, 1, "1f1b"), (2, 2, 1, 1, 1, "1f1b"), (2, 1, 2, 2, 1, "1f1b"),
           (2, 1, 2, 0, 1, "interleaved"), (4, 1, 1, 1, 2, "1f1b")]
FULL_RANK = 16  # min(dims) of every matrix of TINY (n_embd)
TOKENS = np.random.default_rng(5).integers(32, 127, size=20_000, dtype=np.uint8)


def make_trainer(layout, *extra: str) -> Trainer:
    dp, tp, pp, zero, replicate, schedule = layout
    chunks = 2 if schedule == "interleaved" else 1
    cfg = load_config(None, TINY + [f"mesh.dp={dp}", f"mesh.tp={tp}", f"mesh.pp={pp}", f"train.zero={zero}",
                                           f"mesh.dp_replicate={replicate}", f"pipeline.schedule={schedule}",
                                           f"pipeline.chunks={chunks}", f"train.micro_batch_size={4 // dp}",
                                           *extra])
    return Trainer(cfg, WORLD, tokens=TOKENS)


def train(trainer: Trainer, steps: int) -> list[dict]:
    records = []
    trainer.train(steps=steps, files=False, progress=False, on_step=records.append, peak_flops=0.0)
    return records


@pytest.fixture(scope="module")
def uncompressed():
    """The plain run's parameters after 2 steps and its losses (the layout does not change the math)."""
    t = make_trainer(LAYOUTS[0])
    losses = [r["loss"] for r in train(t, 2)]
    params = t.global_parameters()
    t.mesh.free()
    return params, losses


def replicas_differ(trainer: Trainer) -> list[str]:
    """Parameters whose local arrays differ between the data-parallel replicas (ZeRO: after the
    all-gather every replica holds the same whole parameters), or, for tp-replicated ones
    (LayerNorm, some biases), between the tp ranks."""
    dp, tp = trainer.dp.dp_comm, trainer.mesh.comm("tp")
    differ = [n for n, p in trainer.named_parameters if len(set(dp.all_gather_object(p.data.tobytes()))) > 1]
    return differ + [f"{n} (tp)" for n, p in trainer.named_parameters
                     if p.layout.is_replicated and len(set(tp.all_gather_object(p.data.tobytes()))) > 1]


@needs_4
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "dp{}-tp{}-pp{}-zero{}-rep{}-{}".format(*lay))
def test_lossless_settings_reproduce_the_uncompressed_run(layout, uncompressed):
    uncompressed, _ = uncompressed
    for extra in (["train.grad_compression=topk", "train.compression_ratio=1.0"],
                  ["train.grad_compression=powersgd", f"train.powersgd_rank={FULL_RANK}"]):
        t = make_trainer(layout, *extra)
        records = train(t, 2)
        params = t.global_parameters()
        worst = max(rel_err(params[n], uncompressed[n]) for n in uncompressed)
        differ = replicas_differ(t)
        ratio = records[-1]["compression_ratio"]
        t.mesh.free()
        collective_assert(worst <= 1e-9 and not differ and records[-1]["grad_compressed"],
                          f"{extra[0]} on {layout}: {worst:.2e} from the uncompressed run; "
                          f"replicas differ: {differ[:3]}")
        assert ratio > 0  # bytes were counted


@needs_4
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "dp{}-tp{}-pp{}-zero{}-rep{}-{}".format(*lay))
def test_lossy_compressors_train_every_layout(layout, uncompressed):
    """int8 and bf16 round each value to about 1 % (Adam normalises away the scale of what is
    left, so parameters are no measure); the second step's loss, after one compressed update,
    is within 1e-3 of the plain run's. Top-k and PowerSGD at low rank take other steps."""
    _, losses = uncompressed
    for kind, tol in (("int8", 1e-3), ("bf16", 1e-3), ("topk", None), ("powersgd", None)):
        t = make_trainer(layout, f"train.grad_compression={kind}", "train.compression_ratio=0.1",
                         "train.powersgd_rank=2")
        records = train(t, 2)
        differ = replicas_differ(t)
        t.mesh.free()
        err = abs(records[1]["loss"] - losses[1]) / losses[1]
        ok = all(np.isfinite(r["loss"]) for r in records) and not differ and (tol is None or err <= tol)
        sent, plain = records[-1]["grad_bytes_sent"], records[-1]["grad_bytes_uncompressed"]
        collective_assert(ok and 0 < sent < plain, f"{kind} on {layout}: loss {err:.2e} from the uncompressed "
                          f"run's, replicas differ {differ[:3]}, bytes {sent:.0f} of {plain:.0f}")


@needs_4
def test_warm_up_steps_are_uncompressed_and_counted_so():
    t = make_trainer(LAYOUTS[0], "train.grad_compression=int8", "train.compression_start_step=1")
    records = train(t, 2)
    t.mesh.free()
    first, second = records
    formula = (1 + 4 / 256) / 8  # int8 + a float32 scale per 256 values, against float64 (N / n per rank each)
    collective_assert(not first["grad_compressed"] and first["compression_ratio"] == 1.0
                      and second["grad_compressed"] and abs(second["compression_ratio"] / formula - 1) < 0.1,
                      f"warm-up step records: {first}, {second}")


# -- resume ------------------------------------------------------------------------------------------

@needs_4
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind, layout", [("int8", LAYOUTS[0]), ("int8", LAYOUTS[4]), ("topk", LAYOUTS[1]),
                                          ("powersgd", LAYOUTS[2]), ("powersgd", LAYOUTS[4]), ("fp16", LAYOUTS[3])],
                         ids=lambda v: v if isinstance(v, str) else "dp{}-tp{}-pp{}-zero{}-rep{}-{}".format(*v))
def test_resume_is_bitwise_the_uninterrupted_run(kind, layout, shared_dir):
    extra = [f"train.grad_compression={kind}", "train.compression_ratio=0.1", "train.powersgd_rank=2"]
    whole = make_trainer(layout, *extra)
    train(whole, 4)
    want = whole.global_parameters()
    whole.mesh.free()

    first = make_trainer(layout, *extra)
    train(first, 2)
    path = first.save(os.path.join(shared_dir, kind), keep=1)
    first.mesh.free()
    resumed = make_trainer(layout, *extra)
    resumed.load(path)
    train(resumed, 2)
    got = resumed.global_parameters()
    resumed.mesh.free()
    differ = [n for n in want if not np.array_equal(got[n], want[n])]
    collective_assert(not differ, f"{kind} on {layout}: resumed run differs in {differ[:4]}")


@needs_4
@pytest.mark.timeout(240)
def test_a_checkpoint_loads_with_and_without_compression(shared_dir):
    """Saved with int8 (residuals in it) -> loaded without compression: the same parameters, the
    residuals ignored, training goes on -> saved -> loaded with PowerSGD: nothing to load, so
    the compressor starts fresh (no residual, the initial Q) and trains."""
    layout = LAYOUTS[0]
    a = make_trainer(layout, "train.grad_compression=int8")
    train(a, 2)
    path = a.save(os.path.join(shared_dir, "int8"), keep=1)
    params = a.global_parameters()
    a.mesh.free()

    plain = make_trainer(layout)
    plain.load(path)
    same = all(np.array_equal(plain.global_parameters()[n], params[n]) for n in params)
    ok_plain = np.isfinite(train(plain, 1)[0]["loss"])
    path = plain.save(os.path.join(shared_dir, "plain"), keep=1)
    plain.mesh.free()

    t = make_trainer(layout, "train.grad_compression=powersgd", "train.powersgd_rank=2")
    t.load(path)
    state = t.dp.compressor.state()
    fresh = not state["residual"] and not state["powersgd_q"] and t.step == 3
    record = train(t, 1)[0]
    t.mesh.free()
    collective_assert(same and ok_plain and fresh and np.isfinite(record["loss"]) and record["grad_compressed"],
                      f"loaded weights equal: {same}; plain run trains: {ok_plain}; PowerSGD state fresh: {fresh}; "
                      f"its step: {record}")


@needs_4
@pytest.mark.timeout(120)
def test_residuals_load_into_another_group_size(shared_dir):
    """Saved by 4 dp ranks, loaded by 2 (dp x tp = 2 x 2): each rank takes the mean of the stored
    rows of its pieces, and training goes on."""
    a = make_trainer(LAYOUTS[0], "train.grad_compression=topk", "train.compression_ratio=0.1")
    train(a, 2)
    path = a.save(os.path.join(shared_dir, "topk4"), keep=1)
    a.mesh.free()
    stored_rows = stored(path)
    b = make_trainer(LAYOUTS[1], "train.grad_compression=topk", "train.compression_ratio=0.1")
    b.load(path)
    residuals = b.dp.compression_state.checkpoint_state().tensors  # {name: (local array, layout)} of what it now owes
    bad = []
    for name, (local, layout) in residuals.items():
        mean = stored_rows[name].mean(axis=0)  # [*shape]: the mean over the 4 stored rows
        want = layout.take(np.ascontiguousarray(np.broadcast_to(mean, layout.global_shape)))  # every new row
        if not np.allclose(local, want, rtol=1e-12, atol=0):
            bad.append(name)
    record = train(b, 1)[0]
    b.mesh.free()
    collective_assert(residuals and not bad and np.isfinite(record["loss"]),
                      f"loaded residuals differ from the mean of the stored rows: {bad[:3]}; step {record}")


@needs_4
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["int8", "topk", "powersgd"])
def test_a_nan_on_one_rank_skips_the_step_and_keeps_the_state(kind):
    """Rank 2's gradient turns NaN in step 1: the compressed average shows it on every rank, the
    step is skipped (no update), the residuals and Q stay as step 0 left them, and step 2 trains."""
    t = make_trainer(LAYOUTS[0], f"train.grad_compression={kind}", "train.compression_ratio=0.1",
                     "train.powersgd_rank=2")
    train(t, 1)
    c = t.dp.compressor
    before = {k: {i: a.copy() for i, a in v.items()} for k, v in c.state().items()}
    params = t.global_parameters()
    compress = c.compress

    def poisoned(index, grad):
        grad = grad.copy()
        grad[0] = np.nan
        return compress(index, grad)
    if RANK == 2:
        c.compress = poisoned
    bad = train(t, 1)[0]
    c.compress = compress
    after = c.state()
    kept = all(np.array_equal(before[k][i], after[k][i]) for k in before for i in before[k]) and \
        all(set(before[k]) == set(after[k]) for k in before)
    unchanged = all(np.array_equal(p, params[n]) for n, p in t.global_parameters().items())
    good = train(t, 1)[0]
    t.mesh.free()
    collective_assert(bad["skipped"] and kept and unchanged and not good["skipped"] and np.isfinite(good["loss"]),
                      f"{kind}: skipped {bad['skipped']}, state kept {kept}, parameters kept {unchanged}, "
                      f"next step {good}")
