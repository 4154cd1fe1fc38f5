"""`hpcpar plan --calibrate`: measure this machine for the planner, with every rank of the job.

`calibrate` measures, with every rank working at once as they would in training: the GEMM rate,
the all-reduce's alpha and beta inside the world, the model's block and head times for each tp
shard (`_measure_layer`: a + c * tokens), and the optimizer's update rate. Then it runs real
training steps (`Trainer.train`, no files) against the planner's predictions for them
(`planner.predict`) and fits what the cost model's pieces leave out: the share of the gradient
reduction hidden behind backward, the per-step and per-micro-batch overheads, and the factors on
tp and cp traffic. The result is a `planner.hardware.Hardware` named "this", which
`hardware.save_hardware` stores for `hpcpar plan --hardware this`.

In training/ because it runs the Trainer: the planner itself never imports training.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import numpy as np

from hpcpar import metrics
from hpcpar.autograd.attention import causal_attention
from hpcpar.autograd.functional import cross_entropy, layer_norm
from hpcpar.autograd.linear import linear
from hpcpar.autograd.tensor import Tensor
from hpcpar.config.sections import Config
from hpcpar.config.validate import validate
from hpcpar.errors import HpcparError
from hpcpar.optim.optimizers import AdamW
from hpcpar.planner.hardware import GiB, Hardware, Link
from hpcpar.planner.predict import model_key, predict
from hpcpar.runtime.comm import Communicator
from hpcpar.schema import divisors
from hpcpar.training.trainer import Trainer


def calibrate(cfg: Config, world_comm, repeats: int = 3) -> Hardware:
    """Measure this machine with every rank of `world_comm` (an mpi4py communicator) working at
    once, as they would in training: GEMM rate, collectives' alpha and beta inside the world,
    the model's block and head times for each tp shard, and the optimizer's update rate; then,
    from real training steps (`Trainer.train`) against their predictions, the share of the
    gradient reduction hidden behind backward, the per-step and per-micro-batch overheads, and
    the factors on tp and cp traffic (`Hardware`)."""
    world = world_comm.Get_size()
    comm = Communicator(world_comm, "world")
    comm.barrier()
    gemm = float(np.median(comm.all_gather_object(metrics.measure_gemm_flops(cfg.model.dtype, 512, 0.3))))
    alpha, beta = _measure_all_reduce(comm, world, repeats)
    layer_times = {tp: _measure_layer(cfg, tp, comm) for tp in divisors(world) if cfg.model.n_head % tp == 0}
    opt = _measure_optimizer(comm)
    memory = metrics.available_memory_bytes() or 8 * GiB
    hw = Hardware("this", gemm, 1.0, 10e9, int(memory // world), world, Link(alpha, beta), Link(alpha, beta),
                  overlap=0.0, optimizer_seconds_per_param=opt, layer_times=layer_times, model=model_key(cfg),
                  cores_per_rank=min(1.0, (os.cpu_count() or world) / world))
    hw = _fit_overlap(cfg, hw, world_comm, comm)
    hw = _fit_overheads(cfg, hw, world_comm, comm)
    return _fit_traffic_scales(cfg, hw, world_comm, comm)


def _measure_all_reduce(comm: Communicator, world: int, repeats: int) -> tuple[float, float]:
    """(alpha, beta) of the all-reduce over the world, fitted to 1 KiB .. 4 MiB; defaults alone."""
    alpha, beta = 20e-6, 1e9
    if world == 1:
        return alpha, beta
    sizes = [2**k for k in range(10, 23, 3)]               # 1 KiB .. 4 MiB
    # Measured as training meets them: each collective right after some compute, so that a
    # rank that was descheduled (ranks sharing cores) or is late costs what it costs there.
    work = np.random.default_rng(0).standard_normal((160, 160))

    def loop(nbytes: int | None) -> float:
        buf = np.zeros(max(1, (nbytes or 8) // 8))
        comm.barrier()
        start = time.perf_counter()
        for _ in range(repeats * 4):
            work @ work
            if nbytes is not None:
                comm.all_reduce(buf)
        return (time.perf_counter() - start) / (repeats * 4)
    loop(sizes[-1])
    compute = float(np.median(comm.all_gather_object(loop(None))))
    times = [max(comm.all_gather_object(loop(nbytes) - compute)) for nbytes in sizes]
    # all-reduce time = 2(n-1) alpha + 2(n-1)/n bytes / beta: fit alpha and 1/beta.
    x = np.array([[2 * (world - 1), 2 * (world - 1) / world * s] for s in sizes])
    coef, *_ = np.linalg.lstsq(x, np.array(times), rcond=None)
    return max(float(coef[0]), 1e-7), 1.0 / max(float(coef[1]), 1e-12)


def _on_dp(cfg: Config, world: int, microbatches: int, size: int) -> Config:
    """`cfg` as plain data parallelism over the world (1F1B on one stage, no ZeRO, no recomputation)."""
    return validate(dataclasses.replace(
        cfg, mesh=dataclasses.replace(cfg.mesh, dp=world, tp=1, pp=1, cp=1, dp_replicate=1,
                                      sequence_parallel=False),
        train=dataclasses.replace(cfg.train, micro_batch_size=size, microbatches=microbatches, zero=0,
                                  recompute="none"),
        pipeline=dataclasses.replace(cfg.pipeline, schedule="1f1b", chunks=1)), world)


def _fit_overlap(cfg: Config, hw: Hardware, world_comm, comm: Communicator) -> Hardware:
    """How much of the gradient reduction the engine hides behind backward here: the same step
    with the bucketed reduction overlapped and not."""
    world = world_comm.Get_size()
    if world == 1:
        return hw
    run = _on_dp(cfg, world, 1, cfg.train.micro_batch_size)
    hidden = _measure_step(run, world_comm, comm, overlap=False) - _measure_step(run, world_comm, comm)
    reduce = predict(run, hw).parts["dp_exposed"]
    return dataclasses.replace(hw, overlap=min(max(hidden / reduce, 0.0), 1.0) if reduce > 0 else 0.0)


def _fit_overheads(cfg: Config, hw: Hardware, world_comm, comm: Communicator) -> Hardware:
    """What the pieces leave out (data, loss, Python between ops, the step's bookkeeping): two
    real training steps on dp = world, 1 and 3 micro-batches of one sequence, against their
    predictions; the difference per micro-batch and the rest per step."""
    residual = []
    for microbatches in (1, 3):
        run = _on_dp(cfg, world_comm.Get_size(), microbatches, 1)
        residual.append(_measure_step(run, world_comm, comm) - predict(run, hw).step_time)
    per_mb = max(0.0, (residual[1] - residual[0]) / 2)
    return dataclasses.replace(hw, microbatch_overhead=per_mb, step_overhead=max(0.0, residual[0] - per_mb))


def _fit_traffic_scales(cfg: Config, hw: Hardware, world_comm, comm: Communicator) -> Hardware:
    """The tensor- and context-parallel traffic of a real step (with everything around it: the
    mappings, vocabulary-parallel loss, ring bookkeeping) against the alpha-beta model's: the
    ratio scales those terms. On the whole world, one micro-batch of the config's size.

    The cp ring is scaled whole (cp_hidden 0): what of it the attention hides here is in the
    measured ratio, not assumed to be the data-parallel reduction's share. tp: each degree of its
    own (the rest of the world in dp), since a pair's traffic and a quartet's differ by more than
    the ring model says when ranks share cores."""
    world = world_comm.Get_size()
    hw = dataclasses.replace(hw, cp_hidden=0.0)
    tp_scales = {}
    for axis, key, degree in [("tp", "tp_in_pipeline", d) for d in divisors(world) if d > 1] + \
            [("cp", "cp_in_pipeline", world)]:
        degrees = {"tp": 1, "cp": 1, axis: degree}
        run = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp=world // degree, pp=1, dp_replicate=1,
                                                                sequence_parallel=False, **degrees),
                                  train=dataclasses.replace(cfg.train, microbatches=1, zero=0, recompute="none"),
                                  pipeline=dataclasses.replace(cfg.pipeline, schedule="1f1b", chunks=1))
        try:
            run = validate(run, world)
        except HpcparError:
            continue    # the model does not split over the whole world on this axis: keep 1
        pred = predict(run, dataclasses.replace(hw, tp_scale=1.0, tp_scales={}, cp_scale=1.0))   # unscaled
        if world > 1 and pred.parts[key] > 0:
            rest = pred.step_time - pred.parts[key]
            scale = (_measure_step(run, world_comm, comm) - rest) / pred.parts[key]
            scale = min(max(scale, 0.05), 20.0)
            if axis == "tp":
                tp_scales[degree] = scale
                hw = dataclasses.replace(hw, tp_scale=scale, tp_scales=dict(tp_scales))
            else:
                hw = dataclasses.replace(hw, cp_scale=scale)
    return hw


def _measure_step(cfg: Config, world_comm, comm, steps: int = 4, overlap: bool = True) -> float:
    """The slowest rank's median step time of `cfg` through `Trainer.train` (no files); `overlap`
    False: data-parallel reductions wait for the end of backward."""
    tokens = np.random.default_rng(0).integers(0, 256, 1 << 16).astype(np.uint8)
    trainer = Trainer(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, eval_every=0)), world_comm,
                      tokens=tokens)
    trainer.dp.overlap = overlap
    times = []

    def on_step(record: dict) -> None:
        slowest = comm.all_reduce(np.array([record["step_time_s"]]), op="max")
        if record["step"]:
            times.append(float(slowest[0]))
    trainer.train(steps + 1, files=False, progress=False, on_step=on_step, peak_flops=1.0)
    return float(np.median(times))


def _measure_layer(cfg: Config, tp: int, comm) -> list[float]:
    """[a_f, c_f, a_b, c_b, a_h, c_h]: a block's forward and backward and the head's forward +
    backward seconds on a tp shard, fitted to a + c * tokens from two micro-batch sizes, every
    rank measuring at once (the shapes are the shard's: heads / tp, widths 3C/tp and 4C/tp); the
    best of 5 repeats, the median over ranks."""
    m = cfg.model
    c, t, heads = m.n_embd, m.block_size, m.n_head // tp
    rng = np.random.default_rng(0)
    dtype = m.dtype

    def w(*shape):
        return Tensor(rng.standard_normal(shape).astype(dtype) * 0.02, requires_grad=True)

    ln = (Tensor(np.ones(c, dtype), requires_grad=True), Tensor(np.zeros(c, dtype), requires_grad=True))
    w_qkv, w_o, w_fc, w_pr = w(3 * c // tp, c), w(c, c // tp), w(4 * c // tp, c), w(c, 4 * c // tp)
    b_qkv, b_fc = w(3 * c // tp), w(4 * c // tp)
    w_head = w(m.vocab_rows(tp), c)

    def block(x):
        h = linear(layer_norm(x, *ln), w_qkv, b_qkv)
        y = causal_attention(h, heads)
        x = x + linear(y, w_o)
        h = linear(layer_norm(x, *ln), w_fc, b_fc, activation="gelu")
        return x + linear(h, w_pr)

    def timed(b: int) -> tuple[float, float, float]:
        x = Tensor(rng.standard_normal((b, t, c)).astype(dtype), requires_grad=True)
        targets = rng.integers(0, m.vocab_size, (b, t)) % m.vocab_rows(tp)
        best = [math.inf] * 3
        for _ in range(5):
            comm.barrier()
            t0 = time.perf_counter()
            out = block(x)
            t1 = time.perf_counter()
            out.backward(np.ones(out.shape, dtype))
            t2 = time.perf_counter()
            loss = cross_entropy(linear(layer_norm(x, *ln), w_head).reshape(b * t, -1),
                                     targets.reshape(-1))
            loss.backward()
            t3 = time.perf_counter()
            best = [min(best[0], t1 - t0), min(best[1], t2 - t1), min(best[2], t3 - t2)]
        return tuple(float(np.median([r[i] for r in comm.all_gather_object(best)])) for i in range(3))

    small, large = 4, 16
    lo, hi = timed(small), timed(large)
    n_lo, n_hi = small * t, large * t
    out = []
    for i in range(3):
        slope = max((hi[i] - lo[i]) / (n_hi - n_lo), 0.0)
        out += [max(lo[i] - slope * n_lo, 0.0), slope]
    return out


def _measure_optimizer(comm) -> float:
    """Seconds per parameter of one AdamW update (every rank at once)."""
    p = Tensor(np.zeros(1 << 20), requires_grad=True)
    p.grad = np.ones(1 << 20)
    opt = AdamW([p], lr=1e-3)
    opt.step()
    comm.barrier()
    start = time.perf_counter()
    for _ in range(5):
        opt.step()
    return float(np.median(comm.all_gather_object((time.perf_counter() - start) / 5 / (1 << 20))))
