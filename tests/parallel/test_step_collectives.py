"""Per-step communication of `Trainer`: what a training step says to the whole world and to tp.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_step_collectives.py (layouts that do not fit
the world are skipped on every rank alike). Ops are counted where the Communicator numbers them
(`Communicator._begin`, which also feeds the flight recorder).

- The world hears exactly one collective per step, an all-gather (`Trainer._agree`: loss, gradient
  norm, preemption flag, bytes, and with experts the routing table), on the plain path: dp x pp,
  ZeRO-1, tp with sequence parallelism, context parallelism, mixture of experts.
- Sequence parallelism: the gradients of the replicated parameters applied to sequence shards
  (LayerNorms, row-parallel biases, wpe) are summed over tp once per step, whatever the number of
  blocks and micro-batches (the other all-reduces over tp are the loss's, two per micro-batch on
  the last stage), under ZeRO 0/1/3, a zero-bubble pipeline and with gradient compression (there
  once per bucket that holds such gradients, before the bucket is compressed); afterwards those
  parameters are bitwise the same on every tp rank.
- The step's record counts every byte of the step: what the ranks sent up to the agreement plus
  the optimizer step's ZeRO parameter all-gather (`DataParallel.step_bytes`, known beforehand).
- No host read per micro-batch: the pipeline executor keeps each micro-batch's loss on the device
  and copies them to the host once per step.
- Dropout under sequence parallelism draws only this rank's rows of the counter-based mask.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, one_process_losses

from hpcpar.runtime.comm import bytes_sent
from hpcpar.config.load import load_config
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
TINY = ["model.vocab_size=256", "model.block_size=8", "model.n_head=2", "model.n_embd=16", "model.dtype=float64",
        "model.dropout=0.1", "train.micro_batch_size=2", "train.steps=3", "train.warmup=1", "train.lr=0.01",
        "train.grad_clip=1.0", "run.progress=false", "run.eval_every=0"]
TOKENS = np.random.default_rng(3).integers(0, 256, 20_000).astype(np.uint8)
STEPS = 3


def make_trainer(*overrides: str) -> Trainer:
    return Trainer(load_config(None, TINY + list(overrides)), WORLD, tokens=TOKENS)


def count_ops(comm) -> collections.Counter:
    """From now on count `comm`'s ops by kind (every op the Communicator issues, recorded or not)."""
    calls: collections.Counter = collections.Counter()
    begin = comm._begin

    def counting(op, a, *args, **kwargs):
        calls[op] += 1
        return begin(op, a, *args, **kwargs)
    comm._begin = counting
    return calls


def per_step(trainer: Trainer, comm) -> list[dict]:
    """Run STEPS steps through `Trainer.train` (no files); `comm`'s ops in each, by kind."""
    calls = count_ops(comm)
    steps: list = []

    def on_step(record):
        steps.append(dict(calls))
        calls.clear()
    trainer.train(steps=STEPS, files=False, progress=False, on_step=on_step, peak_flops=0.0)
    return steps


WORLD_LAYOUTS = {   # name -> (ranks, overrides)
    "dp2-pp2": (4, ["mesh.dp=2", "mesh.pp=2", "model.n_layer=2", "train.microbatches=2"]),
    "dp4-zero1": (4, ["mesh.dp=4", "mesh.pp=1", "model.n_layer=2", "train.zero=1", "train.microbatches=1"]),
    "dp2-tp2-sp": (4, ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "mesh.sequence_parallel=true", "model.n_layer=2",
                       "train.microbatches=2"]),
    "cp2-pp2": (4, ["mesh.cp=2", "mesh.pp=2", "model.n_layer=2", "train.microbatches=2"]),
    "dp2-moe-ep2": (2, ["mesh.dp=2", "mesh.pp=1", "mesh.ep=2", "model.moe_experts=4", "model.n_layer=2",
                        "train.microbatches=2"]),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(WORLD_LAYOUTS))
def test_one_world_collective_per_step(name):
    ranks, overrides = WORLD_LAYOUTS[name]
    if SIZE != ranks:
        pytest.skip(f"{name} needs {ranks} ranks")
    trainer = make_trainer(*overrides)
    steps = per_step(trainer, trainer.mesh.world)
    trainer.mesh.free()
    collective_assert(steps == [{"all_gather": 1}] * STEPS, f"{name}: world ops per step {steps}")


SP_LAYOUTS = {   # name -> (overrides, tp all-reduces over the step's sequence-parallel gradients)
    "zero0": ([], 1),
    "zero1": (["train.zero=1"], 1),
    "zero3": (["train.zero=3"], 1),
    "pp2-zbh1": (["mesh.pp=2", "pipeline.schedule=zbh1"], 1),
    "recompute": (["train.recompute=full"], 1),
    "int8": (["train.grad_compression=int8"], None),   # None: one per bucket holding such gradients
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SP_LAYOUTS))
def test_sequence_parallel_gradients_are_summed_once_per_step(name):
    if SIZE != 4:
        pytest.skip("dp x tp = 2 x 2 (or tp x pp) needs 4 ranks")
    overrides, sums = SP_LAYOUTS[name]
    pp = 2 if "mesh.pp=2" in overrides else 1
    layout = ["mesh.tp=2", "mesh.sequence_parallel=true", *([] if pp > 1 else ["mesh.dp=2", "mesh.pp=1"])]
    counts = {}
    for layers, m in ((2, 2), (4, 2), (2, 3)):
        trainer = make_trainer(*layout, *overrides, f"model.n_layer={layers}", f"train.microbatches={m}")
        tp = trainer.mesh.comm("tp")
        steps = per_step(trainer, tp)
        loss_reductions = 2 * m if trainer.stages[-1].head else 0   # vocabulary-parallel loss: max, sum
        expected = sums
        if expected is None:   # compression: the buckets that hold sequence-parallel gradients
            expected = sum(1 for b in trainer.dp.buckets if any(p.sequence_parallel for p in b.params))
        counts[(layers, m)] = [s.get("all_reduce", 0) - loss_reductions for s in steps]
        same = _sequence_parallel_parameters_agree(trainer)
        trainer.mesh.free()
        collective_assert(same, f"{name}: sequence-parallel parameters differ between tp ranks")
        collective_assert(counts[(layers, m)] == [expected] * STEPS,
                          f"{name}: tp all-reduces per step besides the loss's {counts} (want {expected})")


def _sequence_parallel_parameters_agree(trainer: Trainer) -> bool:
    """Whether every sequence-parallel parameter is bitwise the same on all tp ranks (after the
    steps: ZeRO's parameters are whole again)."""
    tp = trainer.mesh.comm("tp")
    if trainer.cfg.train.zero == 3:
        full = trainer.dp.full_parameters()
        arrays = [full[n] for n, p in trainer.named_parameters if p.sequence_parallel]
    else:
        arrays = [p.data for _, p in trainer.named_parameters if p.sequence_parallel]
    mine = np.concatenate([np.asarray(a).reshape(-1) for a in arrays]) if arrays else np.zeros(0)
    return bool(arrays) and len({bytes(x) for x in tp.all_gather_object(mine.tobytes())}) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_the_step_record_counts_every_byte_of_the_step(zero):
    """The record's bytes (means over ranks) are what each rank's communicators counted over the
    whole `train_step`, the agreement's own all-gather aside; ZeRO 1/2's parameter all-gather,
    which follows the agreement, included."""
    if SIZE < 2:
        pytest.skip("needs data parallelism")
    trainer = make_trainer(f"mesh.dp={SIZE}", "mesh.pp=1", "model.n_layer=2", "train.microbatches=2",
                           f"train.zero={zero}")
    problems = []
    for step in range(2):
        sent, grad = trainer._bytes_sent()
        world = trainer.mesh.world.bytes_sent_total()
        result = trainer.train_step(step)
        now_sent, now_grad = trainer._bytes_sent()
        agreement = trainer.mesh.world.bytes_sent_total() - world
        mean = WORLD.allreduce(np.array([now_sent - sent - agreement, now_grad - grad]), op=MPI.SUM) / SIZE
        want = {"bytes_sent": mean[0], "grad_bytes_sent": mean[1]}
        got = {k: result.traffic[k] for k in want}
        if got != want or (zero and not result.traffic["grad_bytes_sent"] > 0):
            problems.append(f"step {step}: record {got}, counted {want}")
        row = bytes_sent("all_gather", 8 * 7, SIZE)   # seven float64 figures per rank
        if agreement != row:
            problems.append(f"step {step}: the world carried {agreement} bytes from this rank, not {row}")
    trainer.mesh.free()
    collective_assert(not problems, f"zero={zero}: {problems}")


@pytest.mark.timeout(180)
def test_compressed_buckets_sum_the_parts_before_compressing():
    """Sequence parallelism with a lossless compressor (top-k at ratio 1: the parts summed over tp
    bucket by bucket, before each compression) trains as without compression (summed once after
    the reduction), to 1e-9; the tp copies stay bitwise equal."""
    if SIZE != 4:
        pytest.skip("dp x tp = 2 x 2 needs 4 ranks")
    layout = ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "mesh.sequence_parallel=true", "model.n_layer=2",
              "train.microbatches=2"]
    runs = []
    for extra in ([], ["train.grad_compression=topk", "train.compression_ratio=1.0"]):
        trainer = make_trainer(*layout, *extra)
        losses = [trainer.train_step(s).loss for s in range(STEPS)]
        runs.append((losses, trainer.global_parameters(), _sequence_parallel_parameters_agree(trainer)))
        trainer.mesh.free()
    (plain_losses, plain, _), (losses, params, same) = runs
    worst = max(float(np.abs(params[n] - plain[n]).max() / max(np.abs(plain[n]).max(), 1e-300)) for n in plain)
    collective_assert(same and worst <= 1e-9 and np.allclose(losses, plain_losses, rtol=1e-9, atol=0),
                      f"compressed: {worst:.2e} from the plain run, losses {losses} vs {plain_losses}, "
                      f"tp copies equal: {same}")


@pytest.mark.timeout(180)
def test_parameter_server_workers_with_sequence_parallelism():
    """Two tp = 2 workers with sequence parallelism push whole gradients (summed over tp in
    `finish_backward`) to two synchronous servers: the one-process losses."""
    if SIZE != 4:
        pytest.skip("a tp = 2 worker and 2 servers: 4 ranks")
    from hpcpar.training.run import build
    overrides = ["model.n_layer=2", "train.microbatches=2", "mesh.dp=1", "mesh.pp=1"]
    rank = build(load_config(None, TINY + overrides + ["ps.servers=2", "mesh.tp=2", "mesh.sequence_parallel=true"]),
                 WORLD, tokens=TOKENS)
    records: list = []
    rank.train(steps=STEPS, files=False, progress=False, on_step=records.append, peak_flops=0.0)
    rank.free()
    problems = []
    if WORLD.rank == 0:
        want = one_process_losses(TINY + overrides, STEPS, TOKENS)
        got = [r["loss"] for r in records]
        if not np.allclose(got, want, rtol=1e-10, atol=0):
            problems.append(f"losses {got} vs one process {want}")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.timeout(60)
def test_the_executor_reads_the_losses_once_per_step(monkeypatch):
    if SIZE != 4:
        pytest.skip("dp x pp = 2 x 2 needs 4 ranks")
    from hpcpar import backend
    trainer = make_trainer("mesh.dp=2", "mesh.pp=2", "model.n_layer=2", "train.microbatches=4")
    reads, to_host, run = [], backend.to_host, trainer.executor.run

    def counted(batches, **kwargs):   # the executor's part of the step, with every host copy counted
        with monkeypatch.context() as patch:
            patch.setattr(backend, "to_host", lambda a: (reads.append(getattr(a, "shape", None)), to_host(a))[1])
            return run(batches, **kwargs)
    trainer.executor.run = counted
    trainer.train_step(0)
    last = trainer.stages[-1].head
    trainer.mesh.free()
    collective_assert(reads == ([(4,)] if last else []), f"host reads in the step: {reads} (last stage: {last})")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sp", [False, True])
def test_dropout_draws_only_this_ranks_rows(monkeypatch, sp):
    """tp = 2: with sequence parallelism every mask drawn has T/tp rows (this rank's of the whole
    sequence's mask, `splitmix.counter_uniform(rows=...)`), without it T (the activations are whole)."""
    if SIZE % 2:
        pytest.skip("tp = 2")
    from hpcpar.backend import splitmix
    from hpcpar.runtime.mesh import Mesh
    from hpcpar.nn.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, dtype="float64", dropout=0.1)
    mesh = Mesh(dp=SIZE // 2, tp=2, comm=WORLD)
    model = GPT(cfg, tp_comm=mesh.comm("tp"), sequence_parallel=sp, seed=1)
    model.rng_context = (1, 0, [0, 1])
    drawn = []
    draw = splitmix.counter_uniform
    monkeypatch.setattr(splitmix, "counter_uniform", lambda *a, **k: (lambda u: (drawn.append(u.shape), u)[1])(draw(*a, **k)))
    x = np.random.default_rng(0).integers(0, 64, (2, 8))
    model(x, x).backward()
    mesh.free()
    rows = 8 // 2 if sp else 8
    collective_assert(len(drawn) == 1 + 2 * cfg.n_layer and all(shape[:2] == (2, rows) for shape in drawn),
                      f"masks drawn: {drawn} (want [2, {rows}, ...] each)")
