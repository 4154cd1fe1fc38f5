"""Collectives of hpcpar's Communicator next to raw mpi4py, nccl-tests style, side by side in one run.

    mpiexec -n 4 python bench/allreduce.py [--max-bytes 64M] [--ops all_reduce,iall_reduce,...]
                                           [--rounds 5] [--before REV | --before none]

Ops: the collectives the engine runs on its hot paths. all_reduce, reduce_scatter and all_gather
are the blocking calls (tensor parallelism, checks); iall_reduce is the non-blocking all-reduce
finished by `wait()` (data-parallel buckets); sendrecv is a ring exchange of `isend_irecv` pairs
(the pipeline's and ring attention's messages). For each op and message size (8 B doubling to
64 MiB of float32; the size is the full array as in nccl-tests: the all-reduced array, the
gathered result, the reduce-scatter input, the message) every implementation runs the same
number of iterations per round, in interleaved rounds (the order rotates) so that noise from
other work hits all alike, and the best round counts: with more ranks than cores the ranks share
cores and a round's time is mostly how the scheduler treated it. Time per op is the slowest
rank's. algbw = size / time; busbw = algbw * 2(n-1)/n (all-reduce), (n-1)/n (all-gather,
reduce-scatter), 1 (sendrecv).

Implementations: "raw" is mpi4py's upper-case call on preallocated buffers (blocking, or the
non-blocking call finished by a C-level Wait for iall_reduce and sendrecv): the floor. Where
hpcpar returns a new result, raw receives into the same memory (see `runners`). "hpcpar"
is the public API as training code calls it (a result array per call, the watchdog's flight
recorder, byte accounting). "before" is the same API from the Communicator of revision `--before`
(comm.py and watchdog.py as they were before issue #20 removed their per-call overhead, loaded
from git), for the overhead goal; left out where git or the revision is missing.

Goals (the brief of issue #20; issue #45 holds every op to them), printed per op with the verdict,
and exit status 1 when all_reduce misses one: busbw hpcpar / raw >= 0.95 at every size from 1 MiB
up, and the latency overhead (hpcpar - raw time, median over the sizes up to 1 KiB) at most half
of before's.
Results: bench/results/allreduce.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

from hpcpar import environment

environment.set_default_threads()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpar.runtime.comm import Communicator  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OPS = ("all_reduce", "reduce_scatter", "all_gather", "iall_reduce", "sendrecv")
ROUNDS = 7
BEFORE = "3a029e8"  # the last revision before issue #20's work on the per-call path of comm.py
BANDWIDTH_FROM = 1 << 20  # sizes from which busbw must reach BANDWIDTH_GOAL x raw
BANDWIDTH_GOAL = 0.95
SMALL_UP_TO = 1 << 10  # sizes whose latency overhead is summed for the overhead goal
OVERHEAD_GOAL = 0.5    # hpcpar's overhead / before's
GOAL_OP = "all_reduce"  # the op whose goals decide the exit status


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def bus_factor(op: str, n: int) -> float:
    if op in ("all_reduce", "iall_reduce"):
        return 2 * (n - 1) / n
    return 1.0 if op == "sendrecv" else (n - 1) / n


def load_before(rev: str, world: MPI.Comm):
    """The Communicator class of hpcpar/comm.py (now hpcpar/runtime/comm.py) at git revision `rev`, on the watchdog.py of the
    same revision (its own flight recorder and monitor thread), or None and why when git or the
    revision is missing. Rank 0 reads the sources; every rank runs them as modules of their own."""
    sources, why = None, None
    if world.rank == 0:
        try:
            sources = [subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:hpcpar/{name}.py"], check=True,
                                      capture_output=True, text=True).stdout for name in ("watchdog", "comm")]
        except (OSError, subprocess.CalledProcessError) as err:
            why = f"git show {rev}:hpcpar/... failed ({(getattr(err, 'stderr', '') or str(err)).strip()})"
    sources, why = world.bcast((sources, why), root=0)  # setup only: pickled
    if sources is None:
        return None, why

    def module(name: str, source: str) -> types.ModuleType:
        m = types.ModuleType(f"hpcpar_{name}_before")
        m.__file__ = f"{rev}:hpcpar/{name}.py"
        sys.modules[m.__name__] = m  # dataclasses look their module up while a class is built
        exec(compile(source, m.__file__, "exec"), m.__dict__)  # noqa: S102 - our own history
        return m
    watchdog_before = module("watchdog", sources[0])
    # The old comm.py imports `from hpcpar import backend, watchdog` and `from hpcpar.precision import
    # is_low`: modules of the flat layout of its time, lent for the length of its import. Its backend
    # also held the MPI and NCCL buffer specs (now hpcpar/runtime/buffers.py): the lent one has both.
    import hpcpar
    from hpcpar import backend
    from hpcpar.backend import precision
    from hpcpar.runtime import buffers
    backend_before = types.ModuleType("hpcpar_backend_before")
    backend_before.__dict__.update({k: v for k, v in vars(backend).items() if not k.startswith("__")},
                                   mpi_buffer=buffers.mpi_buffer, mpi_datatype=buffers.mpi_datatype,
                                   nccl_buffer=buffers.nccl_buffer)
    lent = {"hpcpar.watchdog": watchdog_before, "hpcpar.precision": precision, "hpcpar.backend": backend_before}
    saved = {name: sys.modules.get(name) for name in lent}
    sys.modules.update(lent)
    hpcpar.watchdog, hpcpar.backend = watchdog_before, backend_before
    try:
        comm_before = module("comm", sources[1])
    finally:
        del hpcpar.watchdog
        hpcpar.backend = backend
        for name, m in saved.items():
            if m is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = m
    return comm_before.Communicator, None


def runners(op: str, comms: dict, nbytes: int) -> dict:
    """impl name -> a maker: called (untimed, on every rank in the same order) before each round,
    it returns the callable that runs `op` once on float32 buffers of `nbytes` in total (see the
    module docstring); `comms` maps "hpcpar" (and "before") to a Communicator.

    raw receives into the very buffer hpcpar's results live in, borrowed for its round (hpcpar's
    result of an untimed call): from 1 MiB up, which memory a buffer got moves a run by up to
    15% here (raw into a buffer allocated next to its input against raw into another), so both
    write to the same memory.
    """
    hp = comms["hpcpar"]
    n, mpi = hp.size, hp.mpi
    count = max(1, nbytes // 4)
    part = max(1, count // n)
    makers = {}
    if op in ("all_reduce", "reduce_scatter", "all_gather"):
        x = np.ones(part if op == "all_gather" else count if op == "all_reduce" else part * n, np.float32)
        call, raw = {"all_reduce": (Communicator.all_reduce, lambda out: mpi.Allreduce(x, out, MPI.SUM)),
                     "reduce_scatter": (Communicator.reduce_scatter,
                                        lambda out: mpi.Reduce_scatter_block(x, out, MPI.SUM)),
                     "all_gather": (Communicator.all_gather, lambda out: mpi.Allgather(x, out))}[op]

        def make_raw():
            out = call(hp, x)  # borrowed: hpcpar's result buffer
            return lambda: raw(out)
        makers["raw"] = make_raw
        for name, c in comms.items():
            makers[name] = lambda c=c: lambda: getattr(c, op)(x)
    elif op == "iall_reduce":  # in place (sums of ones grow to inf: as fast as finite values)
        x = np.ones(count, np.float32)
        makers["raw"] = lambda: lambda: mpi.Iallreduce(MPI.IN_PLACE, x, MPI.SUM).Wait()
        for name, c in comms.items():
            makers[name] = lambda c=c: lambda: c.iall_reduce(x).wait()
    elif op == "sendrecv":
        x, out = np.ones(count, np.float32), np.empty(count, np.float32)
        nxt, prv = (hp.rank + 1) % n, (hp.rank - 1) % n
        makers["raw"] = lambda: lambda: MPI.Request.Waitall([mpi.Irecv(out, prv, 3), mpi.Isend(x, nxt, 3)])

        def exchange(c):
            sent, received = c.isend_irecv(x, nxt, out, prv, 3, 3)
            received.wait()
            sent.wait()
        for name, c in comms.items():
            makers[name] = lambda c=c: lambda: exchange(c)
    else:
        raise ValueError(f"unknown op {op!r}")
    return makers


def time_once(fn, iters: int, mpi: MPI.Comm) -> float:
    """Seconds per call of the slowest rank over `iters` calls."""
    mpi.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = (time.perf_counter() - start) / iters
    return mpi.allreduce(elapsed, op=MPI.MAX)  # one scalar per round, outside the timed region


def measure(op: str, comms: dict, nbytes: int, budget_s: float, rounds: int) -> dict:
    makers = runners(op, comms, nbytes)
    mpi = comms["hpcpar"].mpi

    def run(name: str, iters: int) -> float:
        fn = makers[name]()  # a round's callable; a borrowed buffer goes back when it does
        return time_once(fn, iters, mpi)
    for name in makers:  # warm-up: connections, allocator, result pools
        run(name, 2)
    # The iteration count from a probe: the fastest of a few short runs (other work on the machine
    # only ever slows a run down, and one slow moment must not cut the measurement short).
    probe = max(min(run(name, 3) for _ in range(5) for name in makers), 1e-6)
    iters = int(mpi.bcast(min(2000, max(2, budget_s / (len(makers) * rounds * probe))), root=0))
    best = {name: float("inf") for name in makers}
    names = list(makers)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate: no impl always goes first
            best[name] = min(best[name], run(name, iters))
    row = {"op": op, "bytes": nbytes, "iters": iters}
    for name, t in best.items():
        algbw = nbytes / t / 1e9
        row[name] = {"time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(op, comms["hpcpar"].size)}
    for name in ("hpcpar", "before"):
        if name in row:
            suffix = "" if name == "hpcpar" else "_before"
            row["ratio" + suffix] = row[name]["busbw_GBps"] / row["raw"]["busbw_GBps"]
            row["overhead_us" + suffix] = row[name]["time_us"] - row["raw"]["time_us"]
    return row


def summarize(op: str, rows: list[dict]) -> dict:
    """One op's goals: the worst busbw ratio from BANDWIDTH_FROM up, and the latency overhead
    (the median over the sizes up to SMALL_UP_TO: a size that other work on the machine hit in
    every round does not decide it) next to before's (None where not measured)."""
    big = [r for r in rows if r["bytes"] >= BANDWIDTH_FROM]
    small = [r for r in rows if r["bytes"] <= SMALL_UP_TO]
    s = {"op": op, "bandwidth_from_bytes": BANDWIDTH_FROM, "bandwidth_goal": BANDWIDTH_GOAL,
         "min_ratio": min((r["ratio"] for r in big), default=None),
         "min_ratio_before": min((r["ratio_before"] for r in big if "ratio_before" in r), default=None),
         "small_up_to_bytes": SMALL_UP_TO, "small_sizes": len(small), "overhead_goal": OVERHEAD_GOAL,
         "overhead_us": statistics.median(r["overhead_us"] for r in small) if small else None,
         "raw_us": statistics.median(r["raw"]["time_us"] for r in small) if small else None,
         "overhead_before_us": None, "overhead_vs_before": None}
    if small and all("overhead_us_before" in r for r in small):
        s["overhead_before_us"] = statistics.median(r["overhead_us_before"] for r in small)
        if s["overhead_before_us"] > 0:
            s["overhead_vs_before"] = s["overhead_us"] / s["overhead_before_us"]
    s["bandwidth_ok"] = None if s["min_ratio"] is None else s["min_ratio"] >= BANDWIDTH_GOAL
    # The smallest size from which every larger size meets the bandwidth goal (None: not even the largest).
    s["goal_met_from_bytes"] = None
    for r in sorted(big, key=lambda r: -r["bytes"]):
        if r["ratio"] < BANDWIDTH_GOAL:
            break
        s["goal_met_from_bytes"] = r["bytes"]
    s["overhead_ok"] = None if s["overhead_vs_before"] is None else s["overhead_vs_before"] <= OVERHEAD_GOAL
    return s


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB" if nbytes >= 1 << 10 else f"{nbytes} B"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "ok" if ok else "MISSED"


def print_table(op: str, rows: list[dict], n: int, has_before: bool) -> None:
    print(f"\n# {op}, {n} ranks: time (us) and busbw (GB/s), best of the rounds; ratio = busbw / raw's "
          f"(goal >= {BANDWIDTH_GOAL} from {BANDWIDTH_FROM >> 20} MiB); overhead = time - raw's (us)")
    head = f"{'bytes':>10} {'iters':>5} | {'raw us':>9} {'busbw':>7} | {'hpcpar us':>9} {'busbw':>7} {'ratio':>5} {'over':>6}"
    print(head + (f" | {'before us':>9} {'busbw':>7} {'ratio':>5} {'over':>6}" if has_before else ""))
    for r in rows:
        raw, h = r["raw"], r["hpcpar"]
        flag = "!" if r["bytes"] >= BANDWIDTH_FROM and r["ratio"] < BANDWIDTH_GOAL else " "
        line = (f"{r['bytes']:>10} {r['iters']:>5} | {raw['time_us']:>9.1f} {raw['busbw_GBps']:>7.3f} | "
                f"{h['time_us']:>9.1f} {h['busbw_GBps']:>7.3f} {r['ratio']:>5.2f}{flag}{r['overhead_us']:>+6.1f}")
        if has_before:
            b = r["before"]
            line += (f" | {b['time_us']:>9.1f} {b['busbw_GBps']:>7.3f} {r['ratio_before']:>5.2f} "
                     f"{r['overhead_us_before']:>+6.1f}")
        print(line, flush=True)


def print_summary(summaries: list[dict], meta: dict) -> None:
    print(f"\n# goals, {meta['ranks']} ranks on {meta['cores']} cores"
          + (" (oversubscribed: ranks share cores)" if meta["oversubscribed"] else "")
          + f"; best of {meta['rounds']} interleaved rounds per size")
    print(f"{'op':<15} {'busbw/raw from 1 MiB, worst':>27} {'(before)':>8} {'goal':>6} {'met from':>8} | "
          f"{'overhead <= 1 KiB, median us':>28} {'before':>7} {'ratio':>6} {'goal':>6}")
    for s in summaries:
        def num(x, fmt):
            return "–" if x is None else format(x, fmt)
        met = s["goal_met_from_bytes"]
        print(f"{s['op']:<15} {num(s['min_ratio'], '.2f'):>27} {num(s['min_ratio_before'], '.2f'):>8} "
              f"{_verdict(s['bandwidth_ok']):>6} {'–' if met is None else _size(met):>8} | "
              f"{num(s['overhead_us'], '+.1f'):>28} "
              f"{num(s['overhead_before_us'], '+.1f'):>7} {num(s['overhead_vs_before'], '.2f'):>6} "
              f"{_verdict(s['overhead_ok']):>6}")
    print(f"goals: busbw >= {BANDWIDTH_GOAL}x raw at every size from {BANDWIDTH_FROM >> 20} MiB; overhead (time - "
          f"raw's, median over 8 B..{SMALL_UP_TO} B) <= {OVERHEAD_GOAL}x before's; {GOAL_OP} decides the exit status")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", default="8")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--budget", type=float, default=0.3,
                        help="seconds of timed work per op and size (all implementations together)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds per size; the best counts")
    parser.add_argument("--before", default=BEFORE,
                        help="git revision whose comm.py runs as 'before' (the overhead goal); 'none' to skip")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "allreduce.json"))
    args = parser.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    for o in ops:
        if o not in OPS:
            parser.error(f"unknown op {o!r}; choose from {', '.join(OPS)}")

    world = MPI.COMM_WORLD
    comms = {"hpcpar": Communicator(world.Dup(), "world")}
    root = world.rank == 0
    before_note = "skipped (--before none)"
    if args.before != "none":
        before_cls, why = load_before(args.before, world)
        if before_cls is not None:
            comms["before"] = before_cls(world.Dup(), "world-before")
            before_note = f"hpcpar/comm.py and watchdog.py at {args.before}"
        else:
            before_note = f"not run: {why}"
            if root:
                print(f"before: {before_note}", file=sys.stderr)
    sizes, nbytes = [], parse_bytes(args.min_bytes)
    while nbytes <= parse_bytes(args.max_bytes):
        sizes.append(nbytes)
        nbytes *= 2

    cores = environment.cores()
    meta = {"ranks": world.size, "cores": cores, "oversubscribed": world.size > cores,
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "rounds": args.rounds, "budget_s": args.budget,
            "before": before_note, "load_average_before": list(os.getloadavg()), "argv": sys.argv}
    rows, summaries = [], []
    started = time.perf_counter()
    for op in ops:
        op_rows = [measure(op, comms, size, args.budget, args.rounds) for size in sizes]
        rows += op_rows
        summaries.append(summarize(op, op_rows))
        if root:
            print_table(op, op_rows, world.size, "before" in comms)
    meta["wall_s"] = time.perf_counter() - started
    meta["load_average_after"] = list(os.getloadavg())
    goal = next((s for s in summaries if s["op"] == GOAL_OP), None)
    missed = goal is not None and (goal["bandwidth_ok"] is False or goal["overhead_ok"] is False)
    if root:
        print_summary(summaries, meta)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "summary": summaries, "rows": rows}, indent=1))
        print(f"wrote {out} ({meta['wall_s']:.0f} s; load average {meta['load_average_before'][0]:.1f} before, "
              f"{meta['load_average_after'][0]:.1f} after)")
    for c in comms.values():
        c.free()
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
