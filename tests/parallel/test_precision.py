"""Mixed precision (train.precision = bf16 / fp16) on parallel meshes.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_precision.py (meshes that do not fit the
world are left out on every rank alike).

- Layouts (dp, tp + sequence parallelism, pp with 1F1B, interleaved and ZB-V, ZeRO-1 and ZeRO-3,
  HSDP, context parallelism ring and Ulysses, full and selective recomputation) track the
  one-process run of the same precision and global batch. Why not 1e-10: activations are rounded to
  16 bits after every op, and tensor or context parallelism changes the float32 sums behind an
  activation (a GEMM split over tp, attention in ring blocks) by a few float32 ulps; now and then
  that moves a value across a 16-bit rounding boundary: one 16-bit ulp (2^-8 relative for bfloat16,
  2^-11 for float16) in that element. Averaged over a loss or a gradient norm such flips stay far
  below one ulp (measured: about 1e-5 relative on the loss and 1e-4 on the norm under bf16): the
  test allows a quarter of a 16-bit ulp on the loss and gradient norm of each of 3 steps, and 2
  ulps on every parameter tensor. Data parallelism and ZeRO split only the batch and give the same
  bits up to float64 sums. The optimizer is SGD with momentum and the model has no biases: AdamW
  divides by sqrt(v), so a gradient that is pure rounding noise (the key projection's bias: its
  exact gradient is 0, softmax ignores a per-query shift) becomes a full-size step whose sign
  differs between layouts; that is AdamW on noise, not the layout. Masters are float64, so the
  optimizer adds no rounding of its own.
- fp16 overflow: a gradient blown up on pipeline stage 0 only makes every rank skip the same
  step, leave every parameter as it was, and back the loss scale off the same way.
- Resume with fp16 dynamic loss scaling is bitwise the uninterrupted run (the scale and its
  counters travel in the checkpoint); a bf16 checkpoint loads into a full-precision run (the
  masters are what is stored) and back.
"""

import os

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, training_problems

from hpcpar.config.load import load_config
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
STEPS = 3
ULP = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
BASE = ["model.vocab_size=256", "model.block_size=16", "model.n_layer=4", "model.n_head=4", "model.n_embd=32",
        "model.dtype=float64", "model.bias=false", "model.dropout=0.1", "train.micro_batch_size=2",
        "train.optimizer=sgd", "train.momentum=0.9",
        f"train.steps={STEPS}",
        "train.warmup=1", "train.lr=0.01", "train.grad_clip=1.0", "train.seed=7", "run.progress=false"]
TOKENS = np.random.default_rng(0).integers(0, 256, 50_000).astype(np.uint8)

# name -> (ranks, overrides, micro-batches per step)
MESHES = {
    "dp2": (2, ["mesh.dp=2", "mesh.pp=1"], 2),
    "pp2-1f1b": (2, ["mesh.pp=2", "pipeline.schedule=1f1b"], 3),
    "dp4-z1": (4, ["mesh.dp=4", "mesh.pp=1", "train.zero=1"], 2),
    "dp2-tp2-sp": (4, ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "mesh.sequence_parallel=true"], 2),
    "dp2-pp2-zbv-z3": (4, ["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=zbv", "train.zero=3"], 3),
    "tp2-pp2-1f1b": (4, ["mesh.tp=2", "mesh.pp=2", "pipeline.schedule=1f1b"], 3),
    "cp2-ring-dp2": (4, ["mesh.dp=2", "mesh.cp=2", "mesh.pp=1", "mesh.cp_impl=ring"], 2),
    "cp2-ulysses-tp2": (4, ["mesh.cp=2", "mesh.tp=2", "mesh.pp=1", "mesh.cp_impl=ulysses"], 2),
    "hsdp2x2-z3-full-recompute": (4, ["mesh.dp=4", "mesh.pp=1", "mesh.dp_replicate=2", "train.zero=3",
                                      "train.recompute=full"], 2),
    "dp2-pp2-interleaved-selective": (4, ["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=interleaved",
                                          "pipeline.chunks=2", "train.recompute=selective"], 4),
}


def trainer(overrides: list, comm=WORLD, run_dir: str = "") -> Trainer:
    extra = [f"run.dir={run_dir}"] if run_dir else []
    return Trainer(load_config(None, BASE + overrides + extra), comm=comm, tokens=TOKENS)


def run(overrides: list, comm=WORLD):
    t = trainer(overrides, comm)
    results = [t.train_step(s) for s in range(STEPS)]
    params = t.global_parameters()
    t.mesh.free()
    return results, params


_reference_cache: dict = {}


def reference(precision: str, microbatches: int):
    key = (precision, microbatches)
    if key not in _reference_cache:
        results, params = run(["mesh.dp=1", "mesh.tp=1", "mesh.pp=1", f"train.precision={precision}",
                               f"train.microbatches={microbatches}"], MPI.COMM_SELF)
        _reference_cache[key] = ([(r.loss, r.grad_norm) for r in results], params)
    return _reference_cache[key]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("mesh", [m for m, (ranks, _, _) in MESHES.items() if ranks == SIZE])
def test_layouts_track_the_one_process_run(mesh, precision):
    _, overrides, m = MESHES[mesh]
    results, params = run(overrides + [f"train.precision={precision}", f"train.microbatches={m}"])
    dp = 1
    for o in overrides:
        if o.startswith("mesh.dp="):
            dp = int(o.split("=")[1])
    ref_steps, ref_params = reference(precision, dp * m)
    steps_ok = training_problems(results, ref_steps, {}, {}, ULP[precision] / 4)
    params_ok = training_problems([], [], params, ref_params, 2 * ULP[precision])
    problems = steps_ok + params_ok
    if any(r.skipped for r in results):
        problems.append(f"skipped steps {[r.skipped for r in results]}")
    collective_assert(not problems, f"{mesh} {precision}: " + "; ".join(problems[:3]))


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE < 2, reason="needs two pipeline stages")
def test_an_overflow_on_one_stage_skips_the_step_everywhere():
    t = trainer(["mesh.pp=2", f"mesh.dp={SIZE // 2}", "pipeline.schedule=1f1b", "train.microbatches=2",
                 "train.precision=fp16", "train.loss_scale_hysteresis=1", "train.initial_loss_scale=1024"])
    first = t.train_step(0)
    before = t.global_parameters()
    finish = t.dp.finish_backward
    stage0 = t.mesh.rank("pp") == 0

    def blow_up():  # a gradient far past float16 (and float32) range on stage 0 only
        finish()
        if stage0:
            p = t.stages[0].parameters()[0]
            p.grad *= np.float64(1e300)
    t.dp.finish_backward = blow_up
    hit = t.train_step(1)
    t.dp.finish_backward = finish
    after = t.global_parameters()
    recovered = t.train_step(2)
    verdicts = WORLD.allgather((hit.skipped, hit.overflow, hit.loss_scale, t.scaler.scale, t.scaler.overflows))
    problems = []
    if len(set(verdicts)) != 1:
        problems.append(f"ranks disagree: {verdicts}")
    if (first.skipped, hit.skipped, hit.overflow, recovered.skipped) != (False, True, True, False):
        problems.append(f"skipped {first.skipped} {hit.skipped} {recovered.skipped}, overflow {hit.overflow}")
    if (hit.loss_scale, recovered.loss_scale, t.scaler.overflows) != (1024.0, 512.0, 1):
        problems.append(f"loss scale {hit.loss_scale} -> {recovered.loss_scale}, overflows {t.scaler.overflows}")
    problems += [f"{name} changed in the skipped step" for name in before
                 if not np.array_equal(before[name], after[name])]
    collective_assert(not problems, "; ".join(problems[:3]))
    t.mesh.free()


@pytest.mark.timeout(300)
def test_fp16_resume_is_bitwise_and_bf16_checkpoints_load_in_full_precision(shared_dir):
    mesh = ["mesh.pp=2", f"mesh.dp={SIZE // 2}"] if SIZE % 2 == 0 else ["mesh.pp=1"]
    fp16 = mesh + ["train.precision=fp16", "train.loss_scale_window=1", "train.initial_loss_scale=256",
                   "train.microbatches=2"]
    whole = trainer(fp16, run_dir=os.path.join(shared_dir, "whole"))
    want = [whole.train_step(s) for s in range(4)]
    want_params, want_scale = whole.global_parameters(), whole.scaler.checkpoint_state().meta["loss_scale"]
    whole.mesh.free()

    first = trainer(fp16, run_dir=os.path.join(shared_dir, "first"))
    for s in range(2):
        first.train_step(s)
    path = first.save(os.path.join(shared_dir, "ckpt"), keep=1)
    first.mesh.free()
    resumed = trainer(fp16, run_dir=os.path.join(shared_dir, "resumed"))
    resumed.load(path)
    got = [resumed.train_step(s) for s in range(2, 4)]
    problems = [f"step {s}: {g} vs {w}" for s, (g, w) in enumerate(zip(got, want[2:]), 2)
                if (g.loss, g.grad_norm, g.loss_scale) != (w.loss, w.grad_norm, w.loss_scale)]
    problems += [f"{n} differs after resume" for n, a in resumed.global_parameters().items()
                 if not np.array_equal(a, want_params[n])]
    got_scale = resumed.scaler.checkpoint_state().meta["loss_scale"]
    if got_scale != want_scale or want_scale["scale"] != 256.0 * 2 ** 4:
        problems.append(f"scaler {got_scale} vs {want_scale}")
    resumed.mesh.free()

    # bf16 -> full -> bf16: the checkpoint holds the float64 masters, bitwise.
    bf16 = trainer(mesh + ["train.precision=bf16"], run_dir=os.path.join(shared_dir, "bf16"))
    bf16.train_step(0)
    masters = bf16.global_parameters()
    bf16_path = bf16.save(os.path.join(shared_dir, "bf16-ckpt"), keep=1)
    bf16.mesh.free()
    full = trainer(["mesh.pp=1"], run_dir=os.path.join(shared_dir, "full"))
    full.load(bf16_path)
    problems += [f"{n}: full-precision load differs" for n, a in full.global_parameters().items()
                 if not np.array_equal(a, masters[n])]
    back_path = full.save(os.path.join(shared_dir, "full-ckpt"), keep=1)
    full.mesh.free()
    again = trainer(mesh + ["train.precision=bf16"], run_dir=os.path.join(shared_dir, "again"))
    again.load(back_path)
    problems += [f"{n}: round trip differs" for n, a in again.global_parameters().items()
                 if not np.array_equal(a, masters[n])]
    again.mesh.free()
    collective_assert(not problems, "; ".join(problems[:3]))
