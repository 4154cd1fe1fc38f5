"""`hpcpar plan` against measurement: calibrate this machine, plan 4 ranks, run every mesh.

    python bench/plan.py [--ranks 4] [--steps 6] [--repeats 3] [--layers 4 --embd 128 --block 128 --batch 12]

The script launches itself under `mpiexec -n 4` (1 BLAS thread per rank). In that launch it

  1. calibrates (`training.calibrate`, what `hpcpar plan --calibrate` runs): GEMM rate, all-reduce
     alpha and beta, the model's block and head times per tp shard, the optimizer's rate, with
     every rank working at once;
  2. plans the default job's model and global batch on 4 ranks (`search.fastest_layouts`: every layout that
     validates and fits, predicted step time) and keeps the fastest plan of each mesh
     (dp, tp, pp, cp);
  3. trains each of those plans with `Trainer.train` (the loop of `hpcpar train`, no files) for a
     warm-up step and `--steps` timed steps, `--repeats` rounds alternating over the plans (the
     faster round kept), the slowest rank's median step time being the measurement.

It reports predicted vs measured step time per mesh, the median absolute error, the Spearman
rank correlation of predicted and measured times, and how far the plan's first choice is from
the fastest measured mesh. Goals (issue 21): median error <= 15 %, Spearman >= 0.8, first
choice within 5 % of the fastest. Exit status 1 when one is missed. Results: bench/results/plan.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = "1"  # 1 thread per rank, before NumPy

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaling import ROOT, timed_steps, write_result  # noqa: E402


def model_overrides(args) -> list[str]:
    return [f"model.n_layer={args.layers}", f"model.n_embd={args.embd}", f"model.n_head={args.heads}",
            f"model.block_size={args.block}", "model.dtype=float32", f"train.micro_batch_size={args.batch}",
            "train.microbatches=2", "train.steps=1000", "run.eval_every=0", "run.progress=false"]


def worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    from hpcpar.config.load import load_config
    from hpcpar.planner.predict import Prediction
    from hpcpar.planner.search import fastest_layouts
    from hpcpar.runtime.comm import Communicator
    from hpcpar.training.calibrate import calibrate
    from hpcpar.training.trainer import Trainer

    world = MPI.COMM_WORLD
    comm = Communicator(world, "world")
    cfg = load_config(None, model_overrides(args))
    hw = comm.broadcast_object(calibrate(cfg, world), root=0)
    plans = fastest_layouts(cfg, world.Get_size(), hw, top=0, keep=10**6)
    best: dict[tuple, Prediction] = {}
    for p in plans:   # fastest first: the first plan of each mesh is its best
        best.setdefault((p.cfg.mesh.dp, p.cfg.mesh.tp, p.cfg.mesh.pp, p.cfg.mesh.cp), p)
    chosen = list(best.values())
    tokens = np.random.default_rng(0).integers(0, 256, 1 << 18).astype(np.uint8)
    measured: list[list[float]] = [[] for _ in chosen]
    for _ in range(args.repeats):
        for i, p in enumerate(chosen):
            trainer = Trainer(p.cfg, world, tokens=tokens)
            step_s, _, _ = timed_steps(trainer, args.steps, lambda: 0.0)
            measured[i].append(step_s)
    if world.Get_rank() == 0:
        rows = [{"layout": p.layout, "mesh": dict(zip(("dp", "tp", "pp", "cp"), key)),
                 "predicted_s": p.step_time, "measured_s": min(m), "rounds_s": m, "parts": p.parts,
                 "memory_bytes": p.memory_bytes}
                for (key, p), m in zip(best.items(), measured)]
        calib = {"gemm_flops": hw.peak_flops, "alpha_s": hw.intra.alpha, "beta_Bps": hw.intra.beta,
                 "optimizer_s_per_param": hw.optimizer_seconds_per_param, "layer_times": hw.layer_times,
                 "tp_scales": hw.tp_scales, "cp_scale": hw.cp_scale, "cores_per_rank": hw.cores_per_rank,
                 "overlap": hw.overlap, "step_overhead_s": hw.step_overhead,
                 "microbatch_overhead_s": hw.microbatch_overhead}
        Path(args.out).write_text(json.dumps({"rows": rows, "calibration": calib, "plans": len(plans)}))


# Narayanan et al., SC'21 (arXiv 2104.04473), Table 1 (also Megatron-LM's README): GPT with
# s = 2048, V = 51200, mixed precision, full recomputation, micro-batch 1, A100s of Selene.
# (billions of parameters, heads, hidden, layers, tp, pp, GPUs, global batch, TFLOP/s per GPU)
NARAYANAN = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
             (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
             (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
             (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
             (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def narayanan() -> list[dict]:
    """The paper's layouts through `predict.predict` with the A100 preset: predicted TFLOP/s per GPU
    (the paper's count, 96 B s l h^2 (1 + s/6h + V/16lh) per step) against the published ones."""
    from hpcpar.config.load import load_config
    from hpcpar.planner.hardware import PRESETS
    from hpcpar.planner.predict import predict

    rows = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, published in NARAYANAN:
        dp = gpus // (tp * pp)
        cfg = load_config(None, [
            f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={hidden}", "model.block_size=2048",
            "model.vocab_size=51200", "model.dtype=bfloat16", f"mesh.dp={dp}", f"mesh.tp={tp}", f"mesh.pp={pp}",
            "mesh.cp=1", "train.micro_batch_size=1", f"train.microbatches={batch // dp}", "train.recompute=full"])
        step = predict(cfg, PRESETS["a100"]).step_time
        flops = 96 * batch * 2048 * layers * hidden**2 * (1 + 2048 / (6 * hidden) + 51200 / (16 * layers * hidden))
        predicted = flops / step / gpus / 1e12
        rows.append({"params_b": params, "tp": tp, "pp": pp, "dp": dp, "gpus": gpus, "batch": batch,
                     "published_tflops": published, "predicted_tflops": predicted, "ratio": predicted / published,
                     "step_s": step})
    return rows


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties expected in measured times)."""
    ra, rb = (np.argsort(np.argsort(x)).astype(float) for x in (a, b))
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 1 else 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=12, help="micro-batch size of the config the plan starts "
                                                              "from (its global batch: auto dp x batch x 2)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "plan.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    import subprocess
    import tempfile
    started = time.perf_counter()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        raw = f.name
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    cmd = [mpiexec, "-n", str(args.ranks), sys.executable, __file__, "--worker", "--out", raw,
           "--steps", str(args.steps), "--repeats", str(args.repeats), "--layers", str(args.layers),
           "--embd", str(args.embd), "--heads", str(args.heads), "--block", str(args.block),
           "--batch", str(args.batch)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(cmd, check=True, timeout=args.timeout, env=env)
    result = json.loads(Path(raw).read_text())
    os.unlink(raw)
    rows = result["rows"]
    predicted = [r["predicted_s"] for r in rows]
    measured = [r["measured_s"] for r in rows]
    errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
    rho = spearman(predicted, measured)
    first = rows[int(np.argmin(predicted))]
    fastest = min(measured)
    gap = first["measured_s"] / fastest - 1
    print(f"{'mesh':<22} {'predicted':>10} {'measured':>10} {'error':>7}  plan")
    for r, e in sorted(zip(rows, errors), key=lambda x: x[0]["measured_s"]):
        mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items())
        print(f"{mesh:<22} {r['predicted_s'] * 1e3:>8.1f}ms {r['measured_s'] * 1e3:>8.1f}ms {e:>6.1%}  {r['layout']}")
    median_error = float(np.median(errors))
    print(f"median |error| {median_error:.1%} (goal <= 15 %), Spearman {rho:.2f} (goal >= 0.8), plan's first "
          f"choice {gap:+.1%} from the fastest measured (goal <= 5 %); {result['plans']} plans fit")
    paper = narayanan()
    worst = max(abs(r["ratio"] - 1) for r in paper)
    print(f"Narayanan et al. (SC'21) weak-scaling table, A100 preset: predicted / published TFLOP/s per GPU "
          f"within {worst:.0%} on all {len(paper)} rows (goal 20 %)")
    write_result(args.out, started, "hpcpar plan's predictions vs measured step times, one launch",
                 rows=rows, calibration=result["calibration"], median_abs_error=median_error, spearman=rho,
                 first_choice_gap=gap, plans_that_fit=result["plans"], narayanan=paper)
    return 0 if median_error <= 0.15 and rho >= 0.8 and gap <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
