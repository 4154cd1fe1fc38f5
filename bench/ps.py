"""Parameter server vs all-reduce on 4 workers: tokens/s with and without a straggler, bytes per
server, and what SSP and async cost in loss.

    mpiexec -n 6 python bench/ps.py [--steps 12] [--loss-steps 300] [--quick]

Every run trains the default job's model and data with 4 worker replicas (dp = 4, one
micro-batch each: the default job's global batch of 48 sequences), through `Trainer.train` (the
loop of `hpcpar train`, no files), each on a sub-communicator of this launch: all-reduce data
parallelism on 4 ranks, the parameter server with 1 server on 5 ranks and with 2 servers on 6.
Ranks a run does not use wait asleep.

1. Throughput: all-reduce, synchronous PS (ps.staleness = 0), SSP (k = 2) and async, each with
   no straggler, with a *random straggler* (at every step one worker, drawn from the seed and the
   step, takes twice as long: `run.debug_slow_ranks = "random"`, factor 2) and, with one server,
   a *fixed straggler* (worker rank 1 always twice as slow). tokens/s = steps x tokens per step /
   wall time of the slowest rank, after a warm-up step. With the random straggler an all-reduce
   step waits for whichever worker is slow, every step; SSP and async let the others go on. With
   the fixed one each replica still runs the same number of steps, so the run ends when the slow
   replica has done its share, in every mode: it bounds them all alike.
2. Bytes per server per step, measured (the server's messages in and out) next to the formula:
   in = s (3 W + R n), out = s (6 W + R n) (s bytes per element, W worker ranks, R replicas,
   n = the server's range; tp = pp = 1 here, so every rank pushes and pulls its replica's range).
3. Transport, between two ranks: a push and a pull of the default model's parameters by
   point-to-point messages against an MPI one-sided epoch (Lock, Accumulate, Get, Unlock), the
   latter with the server inside MPI and with it busy in NumPy (why the engine uses messages:
   docs/parallelism.md#parameter-server).
4. Loss: `--loss-steps` steps of the default job with synchronous PS, and with SSP k = 2 and
   async with no straggler and with the random one, under the default `ps.stale_weight` (a late
   push's weight per step of lateness) and, with the random straggler, under stale_weight = 1
   (late pushes count as fresh: no correction): final loss (mean of the last 10 steps) against
   synchronous, the staleness of every applied push (max and mean) and how many were late. The
   curves go to bench/results/ps.png.

Prints tables; writes bench/results/ps.json. On a machine with fewer cores than ranks the
figures measure the scheduler too; the ratios within one run are what counts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hpcpar import environment

environment.set_default_threads()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpar.config.load import load_config  # noqa: E402
from hpcpar.runtime.comm import Communicator  # noqa: E402
from hpcpar.training.run import build  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
WORKERS = 4
BASE = ["mesh.dp=4", "mesh.tp=1", "mesh.pp=1", "train.microbatches=1", "run.eval_every=0", "run.progress=false"]
MODES = {"allreduce": [], "sync": ["ps.staleness=0"], "ssp2": ["ps.staleness=2"], "async": ["ps.mode=async"]}
STRAGGLERS = {"none": [], "random": ["run.debug_slow_ranks=random", "run.debug_slow_factor=2"],
              "fixed": ["run.debug_slow_ranks=1", "run.debug_slow_factor=2"]}


def say(*a) -> None:
    if RANK == 0:
        print(*a, flush=True)


def sleep_barrier() -> None:
    """A barrier over the launch that sleeps while it waits (idle ranks leave the cores alone)."""
    req = WORLD.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def on_ranks(n: int, fn):
    """Run `fn(comm)` on the first `n` ranks (their own communicator); the result on rank 0."""
    sub = WORLD.Split(0 if RANK < n else MPI.UNDEFINED, RANK)
    result = fn(sub) if RANK < n else None
    if sub != MPI.COMM_NULL:
        sub.Free()
    sleep_barrier()
    return result


def ranks_of(mode: str, servers: int) -> tuple[int, list[str]]:
    if mode == "allreduce":
        return WORKERS, BASE
    return WORKERS + servers, BASE + [f"ps.servers={servers}", *MODES[mode]]


def throughput(mode: str, servers: int, straggler: str, steps: int) -> dict:
    n, overrides = ranks_of(mode, servers)

    def work(comm) -> dict:
        rank = build(load_config(None, overrides + STRAGGLERS[straggler]), comm)
        job = Communicator(comm, "bench")
        rank.train(steps=1, files=False, progress=False, peak_flops=0.0)   # warm-up
        job.barrier()
        started = time.perf_counter()
        result = rank.train(steps=steps, files=False, progress=False, peak_flops=0.0)
        wall = float(job.all_reduce(np.array([time.perf_counter() - started]), op="max")[0])
        report = job.all_gather_object(result.summary.get("ps") if comm.Get_rank() == 0 else None)[0]
        rank.free()
        tokens = WORKERS * rank.cfg.train.micro_batch_size * rank.cfg.model.block_size * steps
        return {"mode": mode, "servers": servers if mode != "allreduce" else 0, "straggler": straggler,
                "ranks": n, "steps": steps, "wall_s": wall, "tokens_per_s": tokens / wall,
                "ps": report, "itemsize": np.dtype(rank.cfg.model.dtype).itemsize}
    return on_ranks(n, work)


def loss_run(mode: str, straggler: str, steps: int, extra: list[str]) -> dict:
    n, overrides = ranks_of(mode, 1)

    def work(comm) -> dict:
        cfg = load_config(None, overrides + STRAGGLERS[straggler] + [f"train.steps={steps}"] + extra)
        rank = build(cfg, comm)
        losses: list[float] = []
        result = rank.train(steps=steps, files=False, progress=False, peak_flops=0.0,
                            on_step=lambda r: losses.append(r["loss"]))
        job = Communicator(comm, "bench")
        rank.free()
        return job.all_gather_object({"losses": losses, "ps": result.summary.get("ps"),
                                      "stale_weight": cfg.ps.stale_weight} if comm.Get_rank() == 0 else None)[0]
    row = on_ranks(n, work)
    if row is None:
        return {}
    final = float(np.mean(row["losses"][-10:]))
    ps = row["ps"] or {}
    return {"mode": mode, "straggler": straggler, "stale_weight": row["stale_weight"] if mode != "sync" else None,
            "steps": steps, "losses": row["losses"], "final_loss": final, "staleness_max": ps.get("staleness_max"),
            "staleness_mean": ps.get("staleness_mean"), "pushes_late": ps.get("pushes_late"),
            "late_max": ps.get("late_max"), "pushes_applied": ps.get("pushes_applied")}


def transport(n: int, repeats: int = 5) -> dict:
    """The transport choice, measured between ranks 0 (a worker) and 1 (a server) with a push and
    a pull of `n` float32 elements: point-to-point (Send, then Recv of the reply) against MPI
    one-sided (a passive-target epoch: Lock, Accumulate of the push, Get of the parameters,
    Unlock), the second once with the server waiting inside MPI and once with it busy in NumPy for
    a second (no MPI call: MPI's progress then waits for it)."""
    def work(comm) -> dict:
        r = comm.Get_rank()
        win = MPI.Win.Allocate(2 * n * 4 if r == 1 else 0, 4, comm=comm)
        push, pull = np.ones(n, np.float32), np.empty(n, np.float32)
        out: dict = {}
        for busy in (False, True):
            comm.Barrier()
            if r == 1:
                if busy:
                    until = time.perf_counter() + 1.0
                    while time.perf_counter() < until:
                        np.dot(np.ones(256), np.ones(256))
                comm.Barrier()
                continue
            started = time.perf_counter()
            win.Lock(1, MPI.LOCK_SHARED)
            win.Accumulate([push, MPI.FLOAT], 1, target=(0, n, MPI.FLOAT), op=MPI.SUM)
            win.Get([pull, MPI.FLOAT], 1, target=(n, n, MPI.FLOAT))
            win.Unlock(1)
            out["rma_server_busy_s" if busy else "rma_server_in_mpi_s"] = time.perf_counter() - started
            comm.Barrier()
        times = []
        for _ in range(repeats):
            comm.Barrier()
            started = time.perf_counter()
            if r == 0:
                comm.Send([push, MPI.FLOAT], 1)
                comm.Recv([pull, MPI.FLOAT], 1)
            else:
                comm.Recv([pull, MPI.FLOAT], 0)
                comm.Send([pull, MPI.FLOAT], 0)
            times.append(time.perf_counter() - started)
        win.Free()
        return {"elements": n, "p2p_round_trip_s": float(np.median(times)), **out} if r == 0 else None
    return on_ranks(2, work)


def bytes_rows(rows: list[dict]) -> list[dict]:
    """Per server of the no-straggler PS runs: measured bytes in/out per step next to the formula."""
    out = []
    for r in rows:
        if r["mode"] == "allreduce" or r["straggler"] != "none" or not r["ps"]:
            continue
        for s in r["ps"]["servers"]:
            n = s["range"][1] - s["range"][0]
            out.append({"mode": r["mode"], "servers": r["servers"], "server_rank": s["rank"], "range": s["range"],
                        "bytes_in": s["bytes_in_per_step"], "bytes_out": s["bytes_out_per_step"],
                        "formula_in": r["itemsize"] * (3 * WORKERS + WORKERS * n),
                        "formula_out": r["itemsize"] * (6 * WORKERS + WORKERS * n)})
    return out


def plot(losses: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in losses:
        label = r["mode"] + (f" ({r['straggler']} straggler)" if r["straggler"] != "none" else "")
        if r["stale_weight"] is not None:
            label += f", stale_weight {r['stale_weight']:g}"
        ax.plot(r["losses"], label=label, linewidth=1, linestyle="--" if r["stale_weight"] == 1 else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Parameter server, 4 workers + 1 server: synchronous, SSP k=2, async")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each throughput run")
    parser.add_argument("--loss-steps", type=int, default=300, help="steps of each loss run")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 timed steps, 12 loss steps")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "ps.json"))
    args = parser.parse_args()
    if WORLD.Get_size() < WORKERS + 2:
        say(f"bench/ps.py needs {WORKERS + 2} ranks (4 workers and up to 2 servers): mpiexec -n 6")
        return 2
    if args.quick:
        args.steps, args.loss_steps = 2, 12
    started = time.perf_counter()
    moved = transport(842_496)   # the default model's parameters
    if RANK == 0:
        say(f"transport, {moved['elements']:,} float32 each way: p2p round trip "
            f"{1e3 * moved['p2p_round_trip_s']:.1f} ms; "
            f"RMA epoch {1e3 * moved['rma_server_in_mpi_s']:.1f} ms with the server in MPI, "
            f"{1e3 * moved['rma_server_busy_s']:.0f} ms with it busy in NumPy for 1 s")
    rows = []
    plan = [(m, 1, s) for s in ("none", "random", "fixed") for m in MODES]
    plan += [(m, 2, s) for s in ("none", "random") for m in MODES if m != "allreduce"]
    for mode, servers, straggler in plan:
        row = throughput(mode, servers, straggler, args.steps)
        if RANK == 0:
            rows.append(row)
            say(f"{mode:9s} servers={row['servers']} straggler={straggler:6s} {row['tokens_per_s']:9,.0f} tokens/s "
                f"({row['wall_s']:.1f} s)")
    if RANK == 0:
        base = {r["straggler"]: r["tokens_per_s"] for r in rows if r["mode"] == "allreduce"}
        for r in rows:
            r["vs_allreduce"] = r["tokens_per_s"] / base[r["straggler"]]
    losses = []
    uncorrected = ["ps.stale_weight=1"]   # late pushes weigh as fresh ones: no correction
    loss_plan = [("sync", "none", [])] + [(m, s, []) for s in ("none", "random") for m in ("ssp2", "async")]
    loss_plan += [(m, "random", uncorrected) for m in ("ssp2", "async")]
    for mode, straggler, extra in loss_plan:
        row = loss_run(mode, straggler, args.loss_steps, extra)
        if RANK == 0:
            losses.append(row)
            weight = "" if row["stale_weight"] is None else f", stale_weight {row['stale_weight']:g}"
            say(f"loss {mode:6s} ({straggler} straggler{weight}): final {row['final_loss']:.4f}, staleness max "
                f"{row['staleness_max']}, mean {row['staleness_mean']:.2f}, late pushes {row['pushes_late']} of "
                f"{row['pushes_applied']} (by at most {row['late_max']})")
    if RANK != 0:
        return 0
    sync = next(r["final_loss"] for r in losses if r["mode"] == "sync")
    for r in losses:
        r["loss_vs_sync"] = r["final_loss"] / sync - 1
    traffic = bytes_rows(rows)
    for b in traffic:
        say(f"bytes/step server {b['server_rank']} ({b['mode']}, {b['servers']} servers): in {b['bytes_in']:,.0f} "
            f"(formula {b['formula_in']:,.0f}), out {b['bytes_out']:,.0f} (formula {b['formula_out']:,.0f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"argv": [str(a) for a in __import__("sys").argv[1:]], "ranks": WORLD.Get_size(),
            "wall_s": time.perf_counter() - started, "load_average": list(__import__("os").getloadavg())}
    out.write_text(json.dumps({"meta": meta, "transport": moved, "throughput": rows, "bytes": traffic, "loss": losses},
                              indent=1))
    plot(losses, out.with_suffix(".png"))
    say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
