"""Pipeline parallelism against the single-process model, in float64.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_pipeline.py (also -n 1, 2, 3).
For every mesh that fits the world (pp = world; at 4 ranks also pp=2 x dp=2 and pp=2 x tp=2),
every schedule and several micro-batch counts (m < pp included), 5 training steps of the parallel
Trainer match a Trainer on a 1x1x1 mesh (COMM_SELF, same seed and global batch) to 1e-10
relative: losses, gradient norms, every global parameter and every tied head copy. (The
reference's own pp = 1 executor path is checked against a plain forward/backward loop in
tests/unit/test_pipeline_split.py.)
"""


import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, one_step_trace, rel_err, training_problems

from hpcpar.config.load import load_config
from hpcpar.parallel.pp import schedules, simulate
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
STEPS = 5
RTOL = 1e-10
BASE = ["model.vocab_size=256", "model.block_size=8", "model.n_layer=8", "model.n_head=2", "model.n_embd=16",
        "model.dtype=float64", "train.micro_batch_size=2", f"train.steps={STEPS}", "train.warmup=2",
        "train.lr=0.01", "train.grad_clip=1.0", "train.seed=7", "run.progress=false"]
# A fixed pseudo-random byte corpus: no file reading, the same on every rank.
TOKENS = np.random.default_rng(0).integers(0, 256, 50_000).astype(np.uint8)



_reference_cache: dict = {}


def reference(total_microbatches: int):
    """(per-step (loss, grad_norm), global parameters) of the 1x1x1 run with this global batch."""
    if total_microbatches not in _reference_cache:
        cfg = load_config(None, BASE + ["mesh.dp=1", "mesh.tp=1", "mesh.pp=1",
                                        f"train.microbatches={total_microbatches}"])
        ref = Trainer(cfg, comm=MPI.COMM_SELF, tokens=TOKENS)
        results = [ref.train_step(s) for s in range(STEPS)]
        _reference_cache[total_microbatches] = ([(r.loss, r.grad_norm) for r in results],
                                                ref.global_parameters())
    return _reference_cache[total_microbatches]


def meshes():
    """(dp, tp, pp) meshes that fit the world: pp over every rank, and at 4 ranks pp x dp, pp x tp."""
    return [(1, 1, SIZE)] + ([(2, 1, 2), (1, 2, 2)] if SIZE == 4 else [])


def cases():
    for dp, tp, pp in meshes():
        for name, ms, chunks in (("gpipe", (1, 2, 5), 1), ("1f1b", (1, 2, 5), 1), ("interleaved", (2, 4), 2),
                                 ("zbh1", (1, 2, 4, 5), 1), ("zbv", (1, 2, 4, 5), 0)):
            if name in ("interleaved", "zbv") and pp == 1:
                continue  # interleaving and the V need >= 2 stages (config rejects them)
            for m in ms:
                m = m * pp if name == "interleaved" else m  # interleaved needs m % pp == 0
                mesh_id = f"dp{dp}-tp{tp}-pp{pp}"
                yield pytest.param(dp, tp, pp, name, m, chunks, False, id=f"{mesh_id}-{name}-m{m}")
    if SIZE == 4:  # sequence parallelism: activations cross stages as [mbs, T/tp, C]
        for name, m, chunks in (("1f1b", 3, 1), ("interleaved", 4, 2), ("zbh1", 3, 1), ("zbv", 3, 0)):
            yield pytest.param(1, 2, 2, name, m, chunks, True, id=f"dp1-tp2-pp2-sp-{name}-m{m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp,tp,pp,name,m,chunks,sp", list(cases()))
def test_training_matches_single_process(dp, tp, pp, name, m, chunks, sp):
    check_training(dp, tp, pp, name, m, chunks, sp)


@pytest.mark.timeout(120)
@pytest.mark.skipif(SIZE < 2, reason="needs >= 2 pipeline stages")
def test_pipeline_messages_through_host_match_single_process():
    """The fallback for schedules NCCL's in-order matching could deadlock (interleaved, m > pp):
    messages staged through host memory give the same training."""
    check_training(1, 1, SIZE, "interleaved", 2 * SIZE, 2, False, host_messages=True)


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE != 4, reason="the meshes of 4 ranks")
@pytest.mark.parametrize("dp,tp,pp,name,m,sp", [(2, 1, 2, "zbh1", 2, False), (1, 2, 2, "1f1b", 3, True),
                                                (2, 2, 1, "1f1b", 2, False)])
def test_training_with_every_all_reduce_split_matches_single_process(dp, tp, pp, name, m, sp, monkeypatch):
    # Every polled all-reduce into a new array (tensor-parallel activations and gradients, the
    # step's reductions) as reduce-scatter + all-gather (hpcpar.runtime.transports._SplitAllReduce), which runs
    # from 1 MiB up otherwise: at this size never.
    import hpcpar.runtime.transports
    monkeypatch.setenv("HPCPAR_MPI_WAIT", "poll")
    monkeypatch.setattr(hpcpar.runtime.transports, "_SPLIT_ALL_REDUCE_BYTES", 1)
    made = []
    monkeypatch.setattr(hpcpar.runtime.transports, "_SplitAllReduce",
                        lambda *args, split=hpcpar.runtime.transports._SplitAllReduce: made.append(1) or split(*args))
    check_training(dp, tp, pp, name, m, 1, sp)
    collective_assert(bool(made), "no all-reduce was split")


def check_training(dp, tp, pp, name, m, chunks, sp, host_messages=False):
    overrides = [f"mesh.dp={dp}", f"mesh.tp={tp}", f"mesh.pp={pp}", f"pipeline.schedule={name}",
                 f"pipeline.chunks={chunks}", f"train.microbatches={m}",
                 f"mesh.sequence_parallel={str(sp).lower()}"]
    trainer = Trainer(load_config(None, BASE + overrides), comm=WORLD, tokens=TOKENS)
    trainer.executor.host_messages = host_messages or trainer.executor.host_messages
    results = [trainer.train_step(s) for s in range(STEPS)]
    ref_steps, ref_params = reference(dp * m)

    problems = training_problems(results, ref_steps, trainer.global_parameters(), ref_params, RTOL)
    # The activations the executor held at once are the simulator's count for this rank.
    every_rank = simulate.simulate(schedules.build(name, pp, m, chunks), placement=trainer.placement)
    predicted = every_rank.peak_stash[trainer.executor.pp_rank]
    if trainer.executor.peak_stash != predicted:
        problems.append(f"peak stash {trainer.executor.peak_stash} chunk activations, simulator {predicted}")
    # The head's tied copy on the last stage (not in global_parameters) must track wte exactly.
    for stage in trainer.stages:
        for pname, p in stage.named_parameters():
            if p.tied_to:
                want = p.layout.take(ref_params[p.tied_to])
                if rel_err(p.data, want) > RTOL:
                    problems.append(f"{pname} (tied to {p.tied_to}): relative error {rel_err(p.data, want):.2e}")
    trainer.mesh.free()  # MPI has a few thousand communicators per process, and the suite makes many
    collective_assert(not problems, "; ".join(problems[:3]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,chunks", [("1f1b", 1), ("interleaved", 2)])
def test_evaluate_matches_single_process(name, chunks):
    """Forward-only replay (any number of batches, chunks included) gives the reference losses."""
    if chunks > 1 and SIZE == 1:
        pytest.skip("interleaving needs >= 2 pipeline stages")
    m = SIZE * chunks
    cfg = load_config(None, BASE + ["mesh.dp=1", "mesh.tp=1", f"mesh.pp={SIZE}", f"pipeline.schedule={name}",
                                    f"pipeline.chunks={chunks}", f"train.microbatches={m}"])
    trainer = Trainer(cfg, comm=WORLD, tokens=TOKENS)
    got = trainer.evaluate(3)
    trainer.mesh.free()
    ref_cfg = load_config(None, BASE + ["mesh.dp=1", "mesh.tp=1", "mesh.pp=1", f"train.microbatches={m}"])
    want = Trainer(ref_cfg, comm=MPI.COMM_SELF, tokens=TOKENS).evaluate(3)
    collective_assert(rel_err(got, want) <= RTOL, f"eval loss {got!r} vs {want!r}")




@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,chunks", [("1f1b", 1), ("zbh1", 1), ("zbv", 2)])
def test_trace_has_every_rank(shared_dir, name, chunks):
    """Every rank's compute spans: m forwards and backwards per chunk, and under a zero-bubble
    schedule as many weight spans (W as its own block, after its B)."""
    if name == "zbv" and SIZE == 1:
        pytest.skip("ZB-V needs >= 2 pipeline stages")
    m = 2
    cfg = load_config(None, BASE + ["mesh.dp=1", "mesh.tp=1", f"mesh.pp={SIZE}", f"pipeline.schedule={name}",
                                    f"train.microbatches={m}", "pipeline.trace=true"])
    events = one_step_trace(Trainer(cfg, comm=WORLD, tokens=TOKENS), shared_dir)
    problem = ""
    if RANK == 0:
        spans = [e for e in events if e["ph"] == "X"]
        kinds = ("forward", "backward", "weight")
        want = {"forward": m * chunks, "backward": m * chunks, "weight": m * chunks if name != "1f1b" else 0}
        for rank in range(SIZE):
            mine = [e for e in spans if e["pid"] == rank]
            counts = {k: sum(e["name"] == k for e in mine) for k in kinds}
            if counts != want:
                problem = f"rank {rank}: {counts} compute spans, expected {want}"
            # Chrome trace times are in microseconds; allow 1 for rounding.
            span = {(e["name"], e["args"]["mb"], e["tid"]): e for e in mine if e["name"] in kinds}
            late = [key for key, e in span.items() if key[0] == "weight"
                    and e["ts"] < span[("backward", *key[1:])]["ts"] + span[("backward", *key[1:])]["dur"] - 1]
            if late:
                problem = f"rank {rank}: weight spans {late} do not follow their backward"
            if SIZE > 1 and not any(e["name"].startswith("recv") for e in mine):
                problem = f"rank {rank}: no recv spans"
        if any(e["ts"] < 0 or e["dur"] < 0 for e in spans):
            problem = "negative timestamps or durations"
    problem = WORLD.bcast(problem, root=0)  # rank 0's verdict, on every rank
    assert not problem, problem
