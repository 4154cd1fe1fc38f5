"""Per-step overhead: the step's collectives before and after issue #20, side by side in one run.

    mpiexec -n 4 python bench/step_overhead.py [--steps 8] [--rounds 3] [--quick]

Trains a small float32 GPT with `Trainer.train` (no files) on two meshes of 4 ranks,

  dp2xtp2-sp   dp=2 x tp=2 with sequence parallelism
  dp2xpp2      dp=2 x pp=2 (1F1B), the default mesh at 4 ranks

each in two variants, alternating round by round so that load from elsewhere hits them alike:

  before   the step as it was: the world hears four collectives per step (loss all-reduce, norm
           all-gather, bytes all-gather, preemption all-reduce; five with experts), emulated here by
           issuing them in place of the one all-gather (`Trainer._gather_step`, with the same
           figures: the norm's all-gather carries the loss parts too), and the
           sequence-parallel gradients are summed over tp at every use (`DataParallel.tp_sum_per_step
           = False`: f's all-reduce in backward, about six per block and micro-batch, and wpe's
           all-gather per micro-batch);
  after    the step now: one world all-gather per step, and one tp all-reduce of all those
           gradients per step.

Time per step: the wall time from one step's end to the next (the whole loop iteration, so the
collectives that used to follow `train_step` count), of the slowest rank, median over the timed
steps after a warm-up step; the best round per variant. Ops per step: what each communicator
numbered (`Communicator._begin`), per rank, mean over the timed steps. Results:
bench/results/step_overhead.json and a table on stdout. Both variants compute the same numbers
(the losses are printed side by side: equal to rounding).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaling import ROOT, write_result  # noqa: E402

MESHES = {"dp2xtp2-sp": ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "mesh.sequence_parallel=true"],
          "dp2xpp2": ["mesh.dp=2", "mesh.tp=1", "mesh.pp=2", "pipeline.schedule=1f1b"]}


def before(trainer) -> None:
    """The step as it was: per-use sequence-parallel sums, and the world's four collectives per step
    (loss all-reduce, norm all-gather, bytes all-gather, preemption all-reduce), giving `_agree` the
    same gathered figures."""
    trainer.dp.tp_sum_per_step = False
    world = trainer.mesh.world

    def gather_separately(row: np.ndarray) -> np.ndarray:
        world.all_reduce(row[0:1].copy(), op="sum")                         # the loss
        parts = world.all_gather(row[None, 0:2].copy())                      # the norm (+ loss parts for `_agree`)
        traffic = world.all_gather(row[None, 3:].copy())                     # the step's bytes
        stop = world.all_reduce(np.array([row[2]], dtype=np.int32), op="max")   # the preemption flag
        return np.column_stack([parts, np.full(world.size, float(stop[0])), traffic])
    trainer._gather_step = gather_separately


def run(mesh: str, variant: str, args, tokens) -> dict:
    from mpi4py import MPI

    from hpcpar.config.load import load_config
    from hpcpar.training.trainer import Trainer

    cfg = load_config(None, MESHES[mesh] + [
        f"model.n_layer={args.layers}", f"model.n_embd={args.embd}", "model.n_head=4", f"model.block_size={args.block}",
        "model.dtype=float32", "model.dropout=0.1", f"train.micro_batch_size={args.batch}",
        f"train.microbatches={args.microbatches}", "train.steps=1000", "run.eval_every=0", "run.progress=false"])
    trainer = Trainer(cfg, MPI.COMM_WORLD, tokens=tokens)
    if variant == "before":
        before(trainer)
    comms = {"world": trainer.mesh.world, "tp": trainer.mesh.comm("tp"), "dp": trainer.dp.dp_comm}
    counts = {name: collections.Counter() for name in comms}
    for name, comm in comms.items():
        begin = comm._begin

        def counting(op, a, *rest, _begin=begin, _count=counts[name], **kw):
            _count[op] += 1
            return _begin(op, a, *rest, **kw)
        comm._begin = counting
    marks, losses, per_step = [], [], []

    def on_step(record: dict) -> None:
        marks.append(time.perf_counter())
        losses.append(record["loss"])
        per_step.append({name: dict(c) for name, c in counts.items()})
        for c in counts.values():
            c.clear()
    trainer.train(steps=args.steps + 2, files=False, progress=False, on_step=on_step, peak_flops=0.0)
    for name, comm in comms.items():   # the measurement's own gather below is not the step's
        del comm._begin
    intervals = np.diff(marks)[1:]   # step k's end to step k+1's end; the first step warms up
    slowest = np.max(MPI.COMM_WORLD.allgather(intervals), axis=0)
    timed = per_step[2:]
    ops = {name: {op: statistics.fmean(s[name].get(op, 0) for s in timed)
                  for op in sorted({op for s in timed for op in s[name]})} for name in comms}
    everyone = MPI.COMM_WORLD.allgather(ops)
    trainer.mesh.free()
    return {"mesh": mesh, "variant": variant, "step_s": float(statistics.median(slowest)), "losses": losses,
            "ops_per_step": {name: {op: statistics.fmean(o[name].get(op, 0) for o in everyone)
                                    for op in sorted({op for o in everyone for op in o[name]})} for name in comms}}


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_overhead.json"))
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run (after a warm-up step)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; the best per variant is kept")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 steps, 1 round, 2 layers")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.layers = 2, 1, 2
    world = MPI.COMM_WORLD
    if world.size != 4:
        raise SystemExit("run under mpiexec -n 4")
    started = time.perf_counter()
    tokens = np.random.default_rng(0).integers(0, 256, 1 << 16).astype(np.uint8)
    best: dict = {}
    for _ in range(args.rounds):
        for mesh in MESHES:
            for variant in ("before", "after"):
                r = run(mesh, variant, args, tokens)
                if (mesh, variant) not in best or r["step_s"] < best[(mesh, variant)]["step_s"]:
                    best[(mesh, variant)] = r
    rows = []
    for mesh in MESHES:
        old, new = best[(mesh, "before")], best[(mesh, "after")]
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(old["losses"], new["losses"]))
        rows.append({"mesh": mesh, "before": old, "after": new, "speedup": old["step_s"] / new["step_s"],
                     "loss_rel_diff": loss_diff})
    if world.rank == 0:
        print(f"{'mesh':<12}{'variant':<8}{'step ms':>9}{'world ops':>11}{'tp all-reduce':>15}"
              f"{'tp all-gather':>15}{'dp ops':>8}")
        for row in rows:
            for variant in ("before", "after"):
                r, ops = row[variant], row[variant]["ops_per_step"]
                print(f"{row['mesh']:<12}{variant:<8}{1e3 * r['step_s']:>9.2f}{sum(ops['world'].values()):>11.1f}"
                      f"{ops['tp'].get('all_reduce', 0):>15.1f}{ops['tp'].get('all_gather', 0):>15.1f}"
                      f"{sum(ops['dp'].values()):>8.1f}")
            print(f"{row['mesh']:<12}after / before step time {1 / row['speedup']:.3f} "
                  f"(speed-up {row['speedup']:.3f}x); losses equal to {row['loss_rel_diff']:.1e}")
        model = {"n_layer": args.layers, "n_embd": args.embd, "block_size": args.block, "batch": args.batch,
                 "microbatches": args.microbatches, "dtype": "float32", "dropout": 0.1}
        write_result(args.out, started, "before: emulated (see bench/step_overhead.py)", model=model,
                     steps=args.steps, rounds=args.rounds, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
