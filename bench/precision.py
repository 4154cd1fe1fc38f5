"""Mixed precision side by side: the default job in full (float32), bf16 and fp16.

    mpiexec -n 4 python bench/precision.py [--steps 300] [--time-steps 6] [--rounds 2] [--quick]

1. Loss: the default job (the main job's config and mesh: `hpcpar train` with no options on this
   world size, dp 2 x pp 2 at 4 ranks, float32 masters) for `--steps` steps with
   `train.precision` = full, bf16 and fp16 (dynamic loss scaling), through `Trainer.train` (the
   loop of `hpcpar train`, no files), one after another in this one launch. Final loss: the mean
   of the last 10 steps' losses; the issue's bar is within 2 % of full and no divergence (no step
   whose loss exceeds the full run's at that step by more than 10 %). fp16: skipped (overflow)
   steps and the final loss scale. The curves go to bench/results/precision.png.
2. Speed: each precision for `--time-steps` steps, `--rounds` rounds in alternation (load from
   elsewhere hits all alike), the fastest round kept: tokens/s of the slowest rank's median step,
   as a ratio to full. On the CPU the GEMMs run in float32 either way (BLAS has no 16-bit GEMM):
   16 bits cost casts and save activation memory (bench/memory.py --sections precision), they do
   not buy speed here.

Prints tables; writes bench/results/precision.json (and precision.png with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from hpcpar import environment

environment.set_default_threads()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpar.config.load import load_config  # noqa: E402
from hpcpar.training.trainer import Trainer  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
PRECISIONS = ("full", "bf16", "fp16")
DIVERGED = 0.10   # a step's loss this far above full's at the same step counts as divergence


def say(*a) -> None:
    if RANK == 0:
        print(*a, flush=True)


def run(precision: str, steps: int, train_steps: int) -> tuple[list[dict], Trainer]:
    """`steps` steps of the default job (its schedule set by `train_steps`) in `precision`."""
    cfg = load_config(None, [f"train.precision={precision}", f"train.steps={train_steps}",
                                    "run.eval_every=0", "run.progress=false"])
    trainer = Trainer(cfg, WORLD)
    records: list[dict] = []

    def on_step(record: dict) -> None:
        slowest = trainer.mesh.world.all_reduce(np.array([record["step_time_s"]]), op="max")
        records.append({"loss": record["loss"], "step_s": float(slowest[0]), "skipped": record["skipped"],
                        "loss_scale": record.get("loss_scale")})

    trainer.train(steps=steps, files=False, progress=False, on_step=on_step, peak_flops=0.0)
    return records, trainer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps of each loss run")
    parser.add_argument("--time-steps", type=int, default=6, help="steps of each timing run")
    parser.add_argument("--rounds", type=int, default=2, help="alternating timing rounds")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 20 steps, one timing round")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "precision.json"))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.time_steps = 20, 1, 4
    started = time.perf_counter()

    curves, rows = {}, []
    for precision in PRECISIONS:
        t0 = time.perf_counter()
        records, trainer = run(precision, args.steps, args.steps)
        curves[precision] = [r["loss"] for r in records]
        rows.append({"precision": precision, "final_loss": statistics.fmean(curves[precision][-10:]),
                     "skipped_steps": sum(r["skipped"] for r in records),
                     "final_loss_scale": records[-1]["loss_scale"],
                     "mesh": trainer._mesh_text(), "seconds": time.perf_counter() - t0})
        trainer.mesh.free()
        say(f"{precision}: final loss {rows[-1]['final_loss']:.4f} ({rows[-1]['seconds']:.0f} s)")
    full = rows[0]
    for r in rows:
        r["loss_vs_full"] = r["final_loss"] / full["final_loss"] - 1
        worst = max(a / b - 1 for a, b in zip(curves[r["precision"]], curves["full"]))
        r["worst_step_vs_full"] = worst
        r["diverged"] = worst > DIVERGED or not all(np.isfinite(curves[r["precision"]]))
        r["within_2pct"] = abs(r["loss_vs_full"]) <= 0.02

    best = {p: float("inf") for p in PRECISIONS}
    for _ in range(args.rounds):
        for precision in PRECISIONS:
            records, trainer = run(precision, args.time_steps, args.steps)
            best[precision] = min(best[precision], statistics.median(r["step_s"] for r in records[1:]))
            tokens = trainer.tokens_per_step
            trainer.mesh.free()
    for r in rows:
        r["tokens_per_s"] = tokens / best[r["precision"]]
        r["speed_vs_full"] = best["full"] / best[r["precision"]]

    say(f"\ndefault job ({full['mesh']}, float32 masters), {args.steps} steps; final loss = mean of the last 10")
    say(f"{'precision':<10} {'final loss':>10} {'vs full':>8} {'worst step':>10} {'skipped':>8} "
        f"{'loss scale':>10} {'tokens/s':>9} {'vs full':>8}")
    for r in rows:
        scale = "-" if r["final_loss_scale"] is None else f"{r['final_loss_scale']:g}"
        say(f"{r['precision']:<10} {r['final_loss']:>10.4f} {r['loss_vs_full']:>+8.2%} "
            f"{r['worst_step_vs_full']:>+10.2%} {r['skipped_steps']:>8} {scale:>10} {r['tokens_per_s']:>9,.0f} "
            f"{r['speed_vs_full']:>7.2f}x")
    if RANK == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        result = {"meta": {"ranks": WORLD.Get_size(), "steps": args.steps, "time_steps": args.time_steps,
                           "rounds": args.rounds, "generated_s": time.perf_counter() - started,
                           "omp_threads": os.environ.get("OMP_NUM_THREADS")},
                  "rows": rows, "curves": curves}
        out.write_text(json.dumps(result, indent=2) + "\n")
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(7, 4))
            for p in PRECISIONS:
                ax.plot(curves[p], label=p, linewidth=1)
            ax.set_xlabel("step")
            ax.set_ylabel("training loss")
            ax.set_title(f"default job, {full['mesh']}: full vs bf16 vs fp16")
            ax.legend()
            fig.tight_layout()
            fig.savefig(out.with_suffix(".png"), dpi=100)
        except ImportError:
            print("matplotlib not installed: no plot")
        print(f"total {time.perf_counter() - started:.0f} s; wrote {out}")
    ok = all(r["within_2pct"] and not r["diverged"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
