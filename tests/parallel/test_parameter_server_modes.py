"""Parameter-server modes on 4 ranks (3 workers, dp=3, and 1 server), driven through `Trainer.train`.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_parameter_server_modes.py (skips at other sizes).
- With a straggler (rank 1 three times slower), stale synchronous parallel keeps every applied
  push's staleness within k (what each worker is told, and what the server recorded), async
  takes every push, the straggler's pushes are recorded late (by at least one optimizer step:
  they weigh ps.stale_weight^tau), and synchronous stays at staleness 0, no push late, with the
  one-process losses.
- A preemption signal on one worker stops every rank at the same step with REQUEUE_STATUS,
  in every mode.
- Pushes overlap the backward: with a bucket per parameter the first piece of a push leaves
  while the backward still completes gradients (counted by the job communicator's bytes sent),
  and the pieces give bitwise the losses and parameters of a one-piece push, which are the
  one-process losses (dp=3; tp=2 with sequence parallelism; pp=2; 1 or 2 servers).
(The synchronous equivalence matrix and resume run through `hpcpar train`:
tests/launch/test_parameter_server_cli.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, one_process_losses

from hpcpar.runtime import preemption
from hpcpar.config.load import load_config
from hpcpar.training.run import build
from hpcpar.launch.jobs import REQUEUE_STATUS

WORLD = MPI.COMM_WORLD
TINY = ["model.n_layer=2", "model.n_embd=16", "model.n_head=2", "model.block_size=8", "model.dtype=float64",
        "train.micro_batch_size=2", "train.microbatches=2", "train.steps=8", "train.warmup=1", "train.lr=0.01",
        "run.eval_every=0", "model.dropout=0.1", "train.grad_clip=0.5", "ps.servers=1", "mesh.dp=3",
        "mesh.tp=1", "mesh.pp=1"]
TOKENS = np.random.default_rng(5).integers(32, 127, 20_000).astype(np.uint8)

pytestmark = pytest.mark.skipif(WORLD.size != 4, reason="3 workers and 1 server: 4 ranks")


def run(*overrides: str, steps: int = 8, on_step=None) -> tuple[object, list]:
    rank = build(load_config(None, TINY + list(overrides)), WORLD, tokens=TOKENS)
    records: list = []

    def record(r):
        records.append(r)
        if on_step:
            on_step(r)
    result = rank.train(steps=steps, files=False, progress=False, on_step=record, peak_flops=0.0)
    rank.free()   # MPICH has a few thousand communicators per process: the suite must not leak them
    return result, records


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", [("ps.staleness=2",), ("ps.mode=async",), ()], ids=["ssp2", "async", "sync"])
def test_staleness_with_a_straggler(mode):
    result, records = run(*mode, "run.debug_slow_ranks=1", "run.debug_slow_factor=3")
    bound = 2 if mode == ("ps.staleness=2",) else 0 if not mode else None
    problems = []
    if WORLD.rank < 3:
        seen = [r["staleness"] for r in records]
        if len(seen) != 8 or (bound is not None and max(seen) > bound) or min(seen) < 0:
            problems.append(f"rank {WORLD.rank}: staleness {seen}")
        if WORLD.rank == 0:
            ps = result.summary["ps"]
            if ps["pushes_applied"] != 24 or (bound is not None and ps["staleness_max"] > bound):
                problems.append(f"server report {ps}")
            if (ps["pushes_late"] == 0) != (not mode):   # only the synchronous run has no late push
                problems.append(f"late pushes {ps['pushes_late']} (max {ps['late_max']})")
            if not all(np.isfinite(r["loss"]) for r in records):
                problems.append("non-finite loss")
    if not mode and WORLD.rank == 0:
        # Synchronous: the one-process losses (the same global batch: 3 x 2 micro-batches).
        want = one_process_losses(TINY + ["ps.servers=0", "mesh.dp=1", "train.microbatches=6"], 8, TOKENS)
        got = [r["loss"] for r in records]
        if not np.allclose(got, want, rtol=1e-10, atol=0):
            problems.append(f"synchronous losses {got} vs one process {want}")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", [("ps.staleness=2",), ("ps.mode=async",), ()], ids=["ssp2", "async", "sync"])
def test_preemption_stops_every_rank_at_one_step(mode):
    def signal_at_step_2(record):
        if WORLD.rank == 1 and record["step"] == 2:
            preemption._requested = True
    try:
        result, records = run(*mode, on_step=signal_at_step_2)
    finally:
        preemption._requested = False
    stopped = WORLD.allgather((result.status, records[-1]["step"] + 1 if records else None))
    statuses = {s for s, _ in stopped}
    ends = {e for r, (_, e) in enumerate(stopped) if r < 3}
    collective_assert(statuses == {REQUEUE_STATUS} and len(ends) == 1 and 3 <= ends.pop() < 8,
                      f"(status, stop step) per rank: {stopped}")



def _pushes_during_backward(*overrides: str) -> tuple[list, list, list]:
    """A synchronous run of 4 steps: (the losses, this rank's final parameters, per step the bytes
    this worker had pushed over the job communicator at each gradient completion of the last
    micro-batch's backward, and at the end of the step; [] on the servers)."""
    rank = build(load_config(None, TINY + list(overrides)), WORLD, tokens=TOKENS)
    worker = hasattr(rank, "dp")
    steps: list = []
    calls: list = []
    if worker:
        for _, p in rank.named_parameters:   # after the bucket hooks: they push first
            p.register_grad_hook(lambda _: calls.append(rank.job.sent["send"]))
    ends = [rank.job.sent["send"] if worker else 0.0]   # after the setup's messages
    losses: list = []

    def step_ended(record):
        losses.append(record["loss"])
        if worker:
            ends.append(rank.job.sent["send"])
            last = calls[len(calls) // 2:]          # 2 micro-batches: every parameter's second call
            steps.append(([c - ends[-2] for c in last], ends[-1] - ends[-2]))
            calls.clear()
    rank.train(steps=4, files=False, progress=False, on_step=step_ended, peak_flops=0.0)
    params = [p.data.copy() for _, p in rank.named_parameters] if worker else []
    rank.free()
    return losses, params, steps


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [(), ("mesh.dp=1", "mesh.tp=2", "mesh.sequence_parallel=true", "ps.servers=2"),
                                    ("mesh.dp=1", "mesh.pp=2", "ps.servers=2")], ids=["dp3", "tp2-sp", "pp2"])
def test_pushes_overlap_backward_and_pieces_sum_as_one_message(layout):
    """With a gradient bucket per parameter the push leaves in pieces from the grad hooks: its
    first piece is on the wire while the backward still completes several gradients, and (dp
    only) just the header (3 numbers per server) waits for the end of the step; sequence-parallel
    parameters wait for their tp sum. With the default bucket (every gradient in one, the push in
    one piece) nothing goes before the last gradient is complete. The pieces sum to the same
    floats as the one message: losses and parameters bitwise equal."""
    one_losses, one_params, one = _pushes_during_backward(*layout)
    losses, params, pieces = _pushes_during_backward(*layout, "train.bucket_mb=0.0001")
    servers = 2 if layout else 1
    problems = []
    for name, steps, want in (("one piece", one, lambda n: n == 0), ("pieces", pieces, lambda n: n >= 3)):
        for during, total in steps:
            after = sum(1 for d in during if d > 0) - 1    # gradients completed after the first piece left
            header_last = total - during[-1] == 8 * 3 * servers or bool(layout)
            if not (want(after) and header_last and total > 8 * 3 * servers):
                problems.append(f"rank {WORLD.rank} {name}: bytes pushed at each gradient of the last backward "
                                f"{during}, {total} by the step's end")
    if losses != one_losses or not all(np.array_equal(a, b) for a, b in zip(params, one_params)):
        problems.append(f"rank {WORLD.rank}: pieces {losses} vs one message {one_losses}")
    if WORLD.rank == 0:   # and both are the one-process run (the same global batch)
        want = one_process_losses(TINY + ["ps.servers=0", "mesh.dp=1", "mesh.tp=1", "mesh.pp=1",
                                          f"train.microbatches={2 if layout else 6}"], 4, TOKENS)
        if not np.allclose(losses, want, rtol=1e-10, atol=0):
            problems.append(f"pieces {losses} vs one process {want}")
    collective_assert(not problems, "; ".join(problems))
