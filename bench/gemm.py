"""Tensor-parallel GEMM throughput per rank, next to one unsharded GEMM and the GEMM peak.

    mpiexec -n 4 python bench/gemm.py [--sizes 512x512x2048,1024x1024x4096] [--rounds 3]

All ranks form one tensor-parallel group (tp = world size). For each size M x K -> N
(x [M, K] times W^T, W [N, K] as nn.Linear; M = tokens, K = in, N = out features), the
forward of hpcpar's layers runs in float32 on one BLAS thread per rank:

  column   ColumnParallelLinear(K, N, gather_output=True): local GEMM [M, K] x [K, N/tp],
           then all-gather of the output [M, N/tp] -> [M, N]
  row      RowParallelLinear(K, N): local GEMM [M, K/tp] x [K/tp, N], then all-reduce [M, N]

"gemm" columns time the local GEMM alone (no collective), the others the layer with
its collective. GFLOP/s per rank = 2*M*N*K / tp / time, with time the slowest rank's,
the best of the rounds (the machine is shared; the minimum rejects
other work best). The references are measured by rank 0 alone while the other
ranks sleep: one unsharded GEMM of the same size, and the peak (a large square float32
matmul). "speedup" = unsharded time / tensor-parallel time. With more ranks than cores
the ranks share cores, so per-rank throughput falls below the peak by that ratio.
Results: a table on rank 0 and bench/results/gemm.json (one entry per world size).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

# One BLAS thread per rank: the peak this is compared with is a 1-thread peak.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
    os.environ[_var] = "1"

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpar.runtime.comm import Communicator  # noqa: E402
from hpcpar.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from hpcpar.autograd.tensor import Tensor, no_grad  # noqa: E402

PEAK_N = 2048
DTYPE = "float32"


def seconds_per_call(fn, comm: Communicator, rounds: int, min_round_s: float = 0.2,
                     alone: bool = False) -> float:
    """Best over `rounds` of the slowest rank's seconds per call (rank 0 only when `alone`)."""
    iters = 1
    if not alone or comm.rank == 0:
        fn()  # warm-up (allocations, BLAS buffers, first MPI connection)
        start = time.perf_counter()
        fn()
        iters = max(1, int(min_round_s / max(time.perf_counter() - start, 1e-9)))
    iters = int(comm.all_reduce(np.array([iters]), op="max")[0])
    samples = []
    for _ in range(rounds):
        comm.barrier()  # hpcpar's barrier sleeps while waiting: idle ranks leave the cores to rank 0
        elapsed = 0.0
        if not alone or comm.rank == 0:
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            elapsed = (time.perf_counter() - start) / iters
        samples.append(float(comm.all_reduce(np.array([elapsed]), op="max")[0]))
    return min(samples)


def peak_gflops(comm: Communicator, rounds: int) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((PEAK_N, PEAK_N)).astype(DTYPE)
    b = rng.standard_normal((PEAK_N, PEAK_N)).astype(DTYPE)
    t = seconds_per_call(lambda: a @ b, comm, rounds, alone=True)
    return 2 * PEAK_N ** 3 / t / 1e9


def bench_size(m: int, k: int, n: int, comm: Communicator, rounds: int, peak: float) -> dict:
    tp = comm.size
    rng = np.random.default_rng(1 + comm.rank)
    flops = 2 * m * n * k
    x = Tensor(rng.standard_normal((m, k)).astype(DTYPE))
    w_full = rng.standard_normal((n, k)).astype(DTYPE)
    t_full = seconds_per_call(lambda: x.data @ w_full.T, comm, rounds, alone=True)

    column = ColumnParallelLinear(k, n, comm, bias=False, dtype=DTYPE, gather_output=True)
    row = RowParallelLinear(k, n, comm, bias=False, dtype=DTYPE)
    for layer in (column, row):
        layer.weight.data[...] = rng.standard_normal(layer.weight.shape).astype(DTYPE)
    x_shard = Tensor(np.ascontiguousarray(x.data[:, comm.rank * (k // tp):(comm.rank + 1) * (k // tp)]))
    with no_grad():
        times = {
            "column_gemm": seconds_per_call(lambda: x.data @ column.weight.data.T, comm, rounds),
            "column": seconds_per_call(lambda: column(x), comm, rounds),
            "row_gemm": seconds_per_call(lambda: x_shard.data @ row.weight.data.T, comm, rounds),
            "row": seconds_per_call(lambda: row(x_shard), comm, rounds),
        }
    result = {"m": m, "k": k, "n": n, "tp": tp, "unsharded_s": t_full,
              "unsharded_gflops": flops / t_full / 1e9, "unsharded_fraction_of_peak": flops / t_full / 1e9 / peak}
    for name, t in times.items():
        per_rank = flops / tp / t / 1e9
        result[f"{name}_s"] = t
        result[f"{name}_gflops_per_rank"] = per_rank
        result[f"{name}_fraction_of_peak"] = per_rank / peak
        result[f"{name}_speedup"] = t_full / t
    return result


def parse_sizes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",") if item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512x512x2048,1024x1024x4096,2048x1024x4096",
                        help="comma-separated MxKxN (tokens x in -> out); K and N divisible by the ranks")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gemm.json"))
    args = parser.parse_args()
    comm = Communicator(MPI.COMM_WORLD, "tp")
    peak = peak_gflops(comm, args.rounds)
    rows = [bench_size(m, k, n, comm, args.rounds, peak) for m, k, n in parse_sizes(args.sizes)]
    if comm.rank != 0:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"tp={comm.size} ranks on {cores} cores, float32, 1 BLAS thread per rank; "
          f"peak (rank 0 alone, {PEAK_N}^3 matmul): {peak:.1f} GFLOP/s")
    print("GFLOP/s per rank; frac = column/row (with their collective) over the peak; "
          "speedup = unsharded time / tp time")
    print(f"{'M x K -> N':>20} {'unsharded':>10} | {'col gemm':>9} {'column':>9} {'frac':>5} {'speedup':>7} |"
          f" {'row gemm':>9} {'row':>9} {'frac':>5} {'speedup':>7}")
    for r in rows:
        print(f"{r['m']:>6} x {r['k']:>5} -> {r['n']:>5} {r['unsharded_gflops']:>10.1f} | "
              f"{r['column_gemm_gflops_per_rank']:>9.1f} {r['column_gflops_per_rank']:>9.1f} "
              f"{r['column_fraction_of_peak']:>5.2f} {r['column_speedup']:>7.2f} | "
              f"{r['row_gemm_gflops_per_rank']:>9.1f} {r['row_gflops_per_rank']:>9.1f} "
              f"{r['row_fraction_of_peak']:>5.2f} {r['row_speedup']:>7.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    everything = json.loads(out.read_text()) if out.exists() else {}
    everything[f"n={comm.size}"] = {"ranks": comm.size, "cores": cores, "dtype": DTYPE, "blas_threads": 1,
                                    "peak_gflops": peak, "peak_matmul_n": PEAK_N, "sizes": rows}
    out.write_text(json.dumps(everything, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
