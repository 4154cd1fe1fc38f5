"""Collective bandwidth sweep, nccl-tests style: hpcpar's Communicator next to raw mpi4py.

    mpiexec -n 4 python bench/allreduce.py [--max-bytes 64M] [--ops all_reduce,all_gather,reduce_scatter]

For each op and each message size (8 B doubling to 64 MiB of float32; the size is
the full array, as in nccl-tests) both implementations run the same number of
iterations after a warm-up, in alternating rounds so that noise from other work on
the machine hits both alike. Time per op is the slowest rank's, the median over
rounds. algbw = size / time; busbw = algbw * 2(n-1)/n for all_reduce and
algbw * (n-1)/n for all_gather and reduce_scatter. "raw" is blocking upper-case
mpi4py on preallocated buffers (the cost floor); "raw_nb" is MPI's non-blocking
form of the same op finished by a C-level Wait(); "hpcpar" is the public API as
training code calls it (a result array per call; blocking MPI underneath, recorded for the watchdog). ratio =
hpcpar/raw busbw; vs_nb = hpcpar/raw_nb busbw. Results go to bench/results/allreduce.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from hpcpar import threads

threads.set_default_threads()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpar.comm import Communicator  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter")
ROUNDS = 5


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def runners(op: str, comm: Communicator, nbytes: int):
    """(hpcpar, raw, raw_nb) callables running `op` once on a float32 array of `nbytes` in total.

    For all_gather the total is the gathered result; for reduce_scatter it is the input.
    raw_nb is MPI's non-blocking form of the op finished by a blocking C Wait(): what
    hpcpar runs, minus hpcpar's Python and polling loop.
    """
    n = comm.size
    count = max(1, nbytes // 4)
    mpi = comm.mpi
    if op == "all_reduce":
        x = np.ones(count, dtype=np.float32)
        out = np.empty_like(x)
        return ((lambda: comm.all_reduce(x)), (lambda: mpi.Allreduce(x, out, MPI.SUM)),
                (lambda: mpi.Iallreduce(x, out, MPI.SUM).Wait()))
    part = max(1, count // n)
    if op == "all_gather":
        x = np.ones(part, dtype=np.float32)
        out = np.empty(part * n, dtype=np.float32)
        return ((lambda: comm.all_gather(x)), (lambda: mpi.Allgather(x, out)),
                (lambda: mpi.Iallgather(x, out).Wait()))
    x = np.ones(part * n, dtype=np.float32)
    out = np.empty(part, dtype=np.float32)
    return ((lambda: comm.reduce_scatter(x)), (lambda: mpi.Reduce_scatter_block(x, out, MPI.SUM)),
            (lambda: mpi.Ireduce_scatter_block(x, out, MPI.SUM).Wait()))


def time_once(fn, iters: int, mpi: MPI.Comm) -> float:
    """Seconds per call of the slowest rank over `iters` calls."""
    mpi.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = (time.perf_counter() - start) / iters
    return mpi.allreduce(elapsed, op=MPI.MAX)  # one scalar per round, outside the timed region


def measure(op: str, comm: Communicator, nbytes: int, budget_s: float, rounds: int = ROUNDS) -> dict:
    impls = dict(zip(("hpcpar", "raw", "raw_nb"), runners(op, comm, nbytes)))
    # Warm-up (connections, allocator, caches), which also sizes the iteration count.
    probe = max(max(time_once(fn, 2, comm.mpi) for fn in impls.values()), 1e-6)
    iters = int(comm.mpi.bcast(min(1000, max(2, budget_s / (len(impls) * rounds * probe))), root=0))
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(rounds):
        for name, fn in impls.items():
            samples[name].append(time_once(fn, iters, comm.mpi))
    row = {"op": op, "bytes": nbytes, "iters": iters}
    for name, times in samples.items():
        t = statistics.median(times)
        algbw = nbytes / t / 1e9
        row[name] = {"time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(op, comm.size)}
    row["ratio"] = row["hpcpar"]["busbw_GBps"] / row["raw"]["busbw_GBps"]
    row["ratio_nb"] = row["hpcpar"]["busbw_GBps"] / row["raw_nb"]["busbw_GBps"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", default="8")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--budget", type=float, default=0.6,
                        help="seconds of timed work per op and size (both implementations)")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="alternating rounds per size; the median round counts")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "allreduce.json"))
    args = parser.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    for o in ops:
        if o not in OPS:
            parser.error(f"unknown op {o!r}; choose from {', '.join(OPS)}")

    comm = Communicator(MPI.COMM_WORLD.Dup(), "world")
    root = comm.rank == 0
    sizes, nbytes = [], parse_bytes(args.min_bytes)
    while nbytes <= parse_bytes(args.max_bytes):
        sizes.append(nbytes)
        nbytes *= 2

    rows = []
    started = time.perf_counter()
    for op in ops:
        if root:
            print(f"\n# {op}, {comm.size} ranks (times in us, bandwidths in GB/s)")
            print(f"{'bytes':>10} {'iters':>6} | {'hpcpar us':>10} {'algbw':>7} {'busbw':>7} | "
                  f"{'raw us':>10} {'algbw':>7} {'busbw':>7} | {'raw_nb us':>10} {'busbw':>7} | "
                  f"{'ratio':>5} {'vs_nb':>5}")
        for size in sizes:
            row = measure(op, comm, size, args.budget, args.rounds)
            rows.append(row)
            if root:
                h, r, nb = row["hpcpar"], row["raw"], row["raw_nb"]
                print(f"{size:>10} {row['iters']:>6} | {h['time_us']:>10.1f} {h['algbw_GBps']:>7.3f} "
                      f"{h['busbw_GBps']:>7.3f} | {r['time_us']:>10.1f} {r['algbw_GBps']:>7.3f} "
                      f"{r['busbw_GBps']:>7.3f} | {nb['time_us']:>10.1f} {nb['busbw_GBps']:>7.3f} | "
                      f"{row['ratio']:>5.2f} {row['ratio_nb']:>5.2f}", flush=True)
    if root:
        small = [r for r in rows if r["bytes"] == sizes[0]]
        for r in small:
            added = r["hpcpar"]["time_us"] - r["raw"]["time_us"]
            added_nb = r["hpcpar"]["time_us"] - r["raw_nb"]["time_us"]
            print(f"added latency at {sizes[0]} B, {r['op']}: {added:+.1f} us vs blocking mpi4py, "
                  f"{added_nb:+.1f} us vs non-blocking + Wait")
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"ranks": comm.size, "mpi": MPI.Get_library_version().splitlines()[0].strip(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "rounds": args.rounds,
                "wall_s": time.perf_counter() - started, "argv": sys.argv}
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {out} ({meta['wall_s']:.0f} s)")
    comm.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
