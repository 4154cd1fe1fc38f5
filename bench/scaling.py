"""Weak scaling of data parallelism: tokens/s at dp=2 vs dp=1, and how much of the gradient
communication hides behind backward.

    python bench/scaling.py [--ranks 1,2] [--steps 8] [--repeats 3] [--bucket-mb 0.25]

The script launches itself under `mpiexec -n 1` and `mpiexec -n 2` (1 BLAS thread per rank,
the same per-rank batch: weak scaling), alternating the launches `--repeats` times so that
load from other work on the machine hits both alike; for each world size the best repeat is
kept (the run least disturbed by others). Each worker trains a float32 GPT on a dp=world mesh
with `Trainer.train` (the training loop of `hpcpar train`, writing no files) for a warm-up
step and `--steps` timed steps in each of four runs:

  overlap            reductions start from grad hooks during backward (the normal mode):
                     the throughput figure;
  no overlap         every reduction starts in `finish_backward` (nothing hidden);
  comm (on / off)    both again with a barrier between backward and `finish_backward`, for
                     the communication accounting below.

Time per step is the slowest rank's. tokens/s = dp * micro_batch * block / step time.
On a machine shared with other work (load average above the core count) wall time mostly
measures the scheduler's share for each process, so the script also reports tokens per
CPU-second of the busiest rank (process_time): the rate each rank would reach with a core to
itself, which charges DP its real costs (communication, waiting spins, extra work).
Communication is timed in two more runs with a barrier between backward and
`finish_backward` (so rank skew is not counted as communication): with overlap off,
`finish_backward` is the whole reduction (launch + wait); with overlap on it is only the part
left unhidden, so
    hidden fraction = 1 - finish_backward(overlap on) / finish_backward(overlap off).
Results: bench/results/scaling.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = "1"  # 1 thread per rank, before NumPy

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> None:
    """One mpiexec launch: the four runs on a dp=world mesh; rank 0 writes a JSON row to args.out."""
    from mpi4py import MPI

    from hpcpar.config.load import load_config
    from hpcpar.training.trainer import Trainer

    dp = MPI.COMM_WORLD.Get_size()
    cfg = load_config(None, [
        f"model.block_size={args.block}", f"model.n_layer={args.layers}", "model.n_head=4",
        f"model.n_embd={args.embd}", "model.dtype=float32", f"mesh.dp={dp}", "mesh.tp=1", "mesh.pp=1",
        f"train.micro_batch_size={args.batch}", "train.microbatches=1", f"train.bucket_mb={args.bucket_mb}",
        "train.steps=1000", "run.eval_every=0", "run.progress=false"])  # steps: only the lr schedule sees it
    tokens = np.random.default_rng(0).integers(0, 256, 1 << 16).astype(np.uint8)
    row = {"dp": dp, "micro_batch": args.batch, "block": args.block}

    def run(overlap: bool, sync: bool) -> dict:
        """Medians over the timed steps; `sync` puts a barrier between backward and
        finish_backward, so that finish_backward times communication, not rank skew."""
        trainer = Trainer(cfg, MPI.COMM_WORLD, tokens=tokens)
        world, data_parallel = trainer.mesh.world, trainer.dp
        data_parallel.overlap = overlap
        if sync:
            finish_backward = data_parallel.finish_backward

            def synced_finish_backward() -> None:
                world.barrier()
                finish_backward()
            data_parallel.finish_backward = synced_finish_backward
        row["params"] = sum(p.data.size for _, p in trainer.named_parameters)
        row["buckets"] = len(data_parallel.buckets)
        step_s, wait_s, cpu_s = timed_steps(trainer, args.steps, lambda: data_parallel.wait_s)
        trainer.mesh.free()
        return {"step_s": step_s, "finish_backward_s": wait_s, "cpu_s": cpu_s}

    row["overlap"] = run(overlap=True, sync=False)          # the throughput figure
    row["no_overlap"] = run(overlap=False, sync=False)
    row["comm_overlap"] = run(overlap=True, sync=True)      # unhidden communication
    row["comm_no_overlap"] = run(overlap=False, sync=True)  # all of the communication
    t = row["overlap"]["step_s"]
    row["tokens_per_s"] = dp * args.batch * args.block / t
    # Per CPU-second of the busiest rank: what the rate would be with a core per rank to itself
    # (on a machine shared with other work, wall time mostly measures the scheduler).
    row["tokens_per_cpu_s"] = dp * args.batch * args.block / row["overlap"]["cpu_s"]
    if MPI.COMM_WORLD.Get_rank() == 0:
        Path(args.out).write_text(json.dumps(row))


def timed_steps(trainer, steps: int, extra) -> tuple[float, float, float]:
    """`Trainer.train` for a warm-up step and `steps` timed ones (no files); the medians over the
    timed steps of the slowest rank's step time and of `extra()` (a time read after each step),
    and of the busiest rank's CPU time."""
    world = trainer.mesh.world
    step_s, extra_s, cpu_s = [], [], []

    def on_step(record: dict) -> None:
        times = np.array([record["step_time_s"], extra(), record["cpu_time_s"]])
        slowest = world.all_reduce(times, op="max")
        if record["step"]:  # step 0 warms up allocators and connections
            step_s.append(float(slowest[0]))
            extra_s.append(float(slowest[1]))
            cpu_s.append(float(slowest[2]))

    trainer.train(steps=steps + 1, files=False, progress=False, on_step=on_step, peak_flops=0.0)
    return statistics.median(step_s), statistics.median(extra_s), statistics.median(cpu_s)


def launch(n: int, args: argparse.Namespace, script: str = __file__) -> dict:
    """Run `script --worker` (this one, or another benchmark with the same model options) under
    `mpiexec -n n`; the JSON row its rank 0 writes."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    cmd = [mpiexec, "-n", str(n), sys.executable, script, "--worker", "--out", out,
           "--steps", str(args.steps), "--bucket-mb", str(args.bucket_mb), "--batch", str(args.batch),
           "--block", str(args.block), "--layers", str(args.layers), "--embd", str(args.embd)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(cmd, check=True, timeout=args.timeout, env=env)
    row = json.loads(Path(out).read_text())
    os.unlink(out)
    return row


def add_model_options(parser: argparse.ArgumentParser, steps: int, repeats: int, timeout: float, out: str) -> None:
    """The model and launch options `launch` passes on to the worker (shared with bench/zero.py), and
    `--out` (default bench/results/<out>)."""
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / out))
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--bucket-mb", type=float, default=0.25,
                        help="bucket size; the default gives the 3.3 MB model ~13 buckets")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2", help="world sizes to launch (the first is the baseline)")
    add_model_options(parser, steps=8, repeats=3, timeout=600, out="scaling.json")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    ranks = [int(r) for r in args.ranks.split(",")]
    runs: dict[int, list] = {n: [] for n in ranks}
    started = time.perf_counter()
    for _ in range(args.repeats):
        for n in ranks:
            runs[n].append(launch(n, args))
    best = {n: max(rs, key=lambda r: r["tokens_per_s"]) for n, rs in runs.items()}
    base = best[ranks[0]]["tokens_per_s"]
    rows = []
    print(f"\n# weak scaling, GPT {args.layers}x{args.embd} float32, {best[ranks[0]]['params'] / 1e6:.2f}M params, "
          f"micro-batch {args.batch}x{args.block} tokens per rank, buckets of {args.bucket_mb} MiB")
    cpu_base = best[ranks[0]]["tokens_per_cpu_s"]
    print(f"{'dp':>3} {'tokens/s':>10} {'speedup':>8} {'eff':>6} | {'tok/cpu-s':>10} {'speedup':>8} | "
          f"{'step ms':>8} {'comm ms':>8} {'unhidden ms':>11} {'hidden':>7} | {'step ms (no overlap)':>20}")
    for n in ranks:
        r = best[n]
        comm = r["comm_no_overlap"]["finish_backward_s"]
        left = r["comm_overlap"]["finish_backward_s"]
        hidden = max(0.0, 1.0 - left / comm) if n > 1 and comm > 0 else None
        row = {**r, "speedup": r["tokens_per_s"] / base, "efficiency": r["tokens_per_s"] / base / (n / ranks[0]),
               "cpu_speedup": r["tokens_per_cpu_s"] / cpu_base,
               "comm_s": comm, "unhidden_comm_s": left, "hidden_fraction": hidden,
               "all_repeats_tokens_per_s": [x["tokens_per_s"] for x in runs[n]]}
        rows.append(row)
        print(f"{n:>3} {r['tokens_per_s']:>10.0f} {row['speedup']:>7.2f}x {row['efficiency']:>6.1%} | "
              f"{r['tokens_per_cpu_s']:>10.0f} {row['cpu_speedup']:>7.2f}x | "
              f"{1e3 * r['overlap']['step_s']:>8.1f} {1e3 * comm:>8.2f} {1e3 * left:>11.2f} "
              f"{'-' if hidden is None else f'{hidden:.0%}':>7} | {1e3 * r['no_overlap']['step_s']:>20.1f}")
    write_result(args.out, started, "comm = finish_backward after a barrier with every reduction launched there "
                 "(overlap off); unhidden = the same with overlap on; best of the repeats per world size", rows=rows)
    return 0


def write_result(path: str, started: float, note: str, **data) -> None:
    """Write {"meta": machine, load, wall time, note; **data} as JSON to `path` and say so."""
    meta = {"argv": sys.argv[1:], "cores": os.cpu_count(), "threads_per_rank": 1,
            "load_average": os.getloadavg(), "wall_s": time.perf_counter() - started, "note": note}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, **data}, indent=1))
    print(f"wrote {out} (load average {meta['load_average'][0]:.1f} on {meta['cores']} cores)")


if __name__ == "__main__":
    sys.exit(main())
