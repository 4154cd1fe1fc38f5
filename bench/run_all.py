"""Run every benchmark, collect their JSON, write bench/results/summary.json and docs/benchmarks.md.

    python bench/run_all.py [--quick] [--only mesh_scaling,vs_torch] [--note "shared 2-core VM"]
    python bench/run_all.py --report-only      # rebuild the page from bench/results/*.json

Each benchmark runs as a subprocess (under `mpiexec -n N` where it needs ranks, one BLAS
thread per rank), one after the other, writing its JSON into --results-dir. Then every
benchmark's latest JSON there is read, the key figures are pulled out, and both
summary.json (machine, command, status, figures and the raw results per benchmark) and the
markdown page are regenerated. With --only, the other benchmarks keep the figures and
commands of their last run (from the previous summary.json). --quick runs smaller sizes as
a smoke test and, unless --results-dir/--docs are given, writes to bench/results/quick/
(markdown included) so the real figures stay untouched. Without PyTorch the torch peer is
skipped and the page says so. Exit status 1 if a benchmark failed or timed out.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = ROOT / "bench" / "results"
DEFAULT_DOCS = ROOT / "docs" / "benchmarks.md"
MiB = 1 << 20
# Every child gets one BLAS/OpenMP thread per rank (the benchmarks compare ranks, not threads).
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str                   # relative to the repository root
    ranks: int | None             # mpiexec -n; None: the script runs alone (or launches its own)
    what: str                     # one line for the table
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ()
    needs_torch: bool = False
    needs_root: bool = False      # starts a cluster of node namespaces (tests/cluster/harness.py)
    timeout_s: float = 300.0


BENCHMARKS = (
    Benchmark("allreduce", "bench/allreduce.py", 4,
              "collectives on the hot paths (all-reduce, reduce-scatter, all-gather, non-blocking all-reduce, "
              "send/recv): hpcpar's bus bandwidth / raw mpi4py's; latency overhead vs before issue #20",
              quick_args=("--max-bytes", "1M", "--budget", "0.1", "--rounds", "2")),
    Benchmark("gemm", "bench/gemm.py", 2,
              "tensor-parallel GEMMs (column/row-parallel Linear, tp = ranks): fraction of the GEMM peak",
              quick_args=("--sizes", "512x512x2048", "--rounds", "2")),
    Benchmark("pipeline", "bench/pipeline.py", 4,
              "pipeline executor (sleep stages of known F, B, W cost) vs the schedule simulator's step time; "
              "bubble and peak stash of ZB-H1 and ZB-V against 1F1B in the same run", args=("--steps", "2"),
              quick_args=("--microbatches", "4", "--steps", "1", "--t-forward", "0.02", "--t-backward", "0.02",
                          "--t-weight", "0.02"), timeout_s=600.0),
    Benchmark("pipeline_gpt", "bench/pipeline.py", 4,
              "GPT training (Trainer.train_step) on pp=4 and dp=2 x pp=2: tokens/s of every pipeline schedule "
              "side by side", args=("--gpt",),
              quick_args=("--gpt", "--gpt-meshes", "dp2xpp2", "--gpt-warmup", "1", "--gpt-steps", "1")),
    Benchmark("checkpoint", "bench/checkpoint.py", 4,
              "checkpoint save/load throughput vs np.save/np.load of the same arrays",
              quick_args=("--mib", "32", "--repeats", "1")),
    Benchmark("scaling", "bench/scaling.py", None,
              "data parallelism, weak scaling dp=2 vs dp=1, gradient communication hidden behind backward",
              args=("--steps", "12", "--repeats", "4"), quick_args=("--steps", "2", "--repeats", "1")),
    Benchmark("mesh_scaling", "bench/mesh_scaling.py", None,
              "training (Trainer.train) over mesh shapes: strong and weak scaling vs 1x1x1, PyTorch peer",
              quick_args=("--worlds", "1,2", "--steps", "2", "--warmup", "1", "--repeats", "1"), timeout_s=480.0),
    Benchmark("context", "bench/context.py", 4,
              "context parallelism (ring attention, Ulysses) vs tp+sp at the same T: attention activations and "
              "bytes sent per rank, work balance, tokens/s, longest block_size under a memory limit",
              quick_args=("--seq", "256", "--limit-mib", "16", "--steps", "1", "--repeats", "1")),
    Benchmark("memory", "bench/memory.py", None,
              "memory per rank, measured next to its formula: activation bytes per layer with recompute "
              "none / selective / full, and in float32 vs bf16 vs fp16 with bytes per parameter; model-state bytes "
              "per parameter for ZeRO 0/1/2/3 on 4 ranks; a model plain DP refuses under a per-rank limit training "
              "under ZeRO-3",
              quick_args=("--seq", "256", "--n-layer", "2", "--repeats", "2", "--state-layers", "2",
                          "--state-embd", "64", "--state-big-embd", "128", "--state-steps", "1")),
    Benchmark("zero", "bench/zero.py", None,
              "ZeRO-3 (FSDP) vs ZeRO-1 tokens/s on 4 ranks with prefetch; all-gather time hidden behind compute",
              quick_args=("--steps", "2", "--repeats", "1", "--layers", "2")),
    Benchmark("plan", "bench/plan.py", None,
              "hpcpar plan: calibrate, plan 4 ranks, train every mesh's best plan: predicted vs measured step "
              "time; the A100 preset against Narayanan et al.'s published TFLOP/s per GPU",
              quick_args=("--steps", "1", "--repeats", "1", "--layers", "2"), timeout_s=900.0),
    Benchmark("precision", "bench/precision.py", 4,
              "mixed precision: 300 steps of the default job in full (float32), bf16 and fp16 side by side: final "
              "loss vs full, worst step, fp16 overflows and loss scale, tokens/s",
              quick_args=("--quick",), timeout_s=7200.0),
    Benchmark("compression", "bench/compression.py", 4,
              "gradient compression (fp16, bf16, int8, top-k, PowerSGD) side by side with none on dp=4: bytes per "
              "step vs each formula, step time, loss after 300 steps with and without error feedback, where it pays",
              quick_args=("--quick",), timeout_s=7200.0),
    Benchmark("diloco", "bench/diloco.py", 4,
              "local SGD and DiLoCo (sync every H = 1, 10, 50, 100 steps) vs synchronous data parallelism on 2 and "
              "4 replicas at equal tokens: loss gap, replica-axis bytes per step vs the formula, tokens/s on a slow "
              "link (modelled) against int8 and top-k compression; the goal: within 3 % at <= 2 % of the bytes",
              quick_args=("--quick",), timeout_s=1800.0),
    Benchmark("moe", "bench/moe.py", 4,
              "mixture of experts, ep=4 on 4 ranks: tokens/s vs the dense GPT of the same active parameters, "
              "all-to-all bytes per step vs the formula, expert load after N steps with and without the aux loss, "
              "and with the aux-loss-free expert bias (tokens/s and load)",
              quick_args=("--steps", "1", "--rounds", "1", "--balance-steps", "12", "--layers", "2", "--embd", "64",
                          "--block", "64", "--bias-warmup", "2")),
    Benchmark("varlen", "bench/varlen.py", None,
              "packed documents (issue #43), one process on the standard library's files: tokens/s and eval loss "
              "of packed + masked vs padding each document vs packing without masking; document attention vs the "
              "dense causal kernel (time and FLOPs, corpus and Pareto lengths); dp and cp (ring) balance of "
              "attention work",
              quick_args=("--quick",), timeout_s=600.0),
    Benchmark("sparse_embedding", "bench/sparse_embedding.py", 4,
              "sparse embedding gradients (issue #43), untied GPT with a BPE-sized vocabulary, dp=4: wte's sync "
              "bytes per step dense vs (row id, row) pairs, measured next to the formula; sync and step time; "
              "parameter servers (3 workers + 1 server): bytes pushed + pulled per worker, whole wte vs its rows",
              quick_args=("--quick",)),
    Benchmark("ps", "bench/ps.py", 6,
              "parameter server (1 and 2 servers) vs all-reduce on 4 workers: tokens/s of synchronous, SSP k=2 and "
              "async with no straggler, a random and a fixed 2x straggler; bytes per server vs the formula; loss "
              "after 300 steps of SSP and async vs synchronous", quick_args=("--quick",), timeout_s=7200.0),
    Benchmark("step_overhead", "bench/step_overhead.py", 4,
              "per-step overhead before / after issue #20 on dp=2 x tp=2 (sequence parallelism) and dp=2 x pp=2: "
              "step time and collectives per step (world; tp all-reduces of sequence-parallel gradients)",
              quick_args=("--quick",)),
    Benchmark("vs_torch", "bench/vs_torch.py", None,
              "one process, hpcpar vs PyTorch eager on the same GPT and batches: three model shapes, 1 and 2 "
              "threads (a process each)",
              args=("--steps", "5", "--rounds", "5"), quick_args=("--steps", "1", "--rounds", "1", "--shapes", "2x64x64x4"),
              needs_torch=True, timeout_s=1800.0),
    Benchmark("cluster", "bench/cluster.py", None,
              "what only a cluster shows (node namespaces on this machine, tbf-shaped links): collectives' bus "
              "bandwidth against the link rate, tp inside vs across nodes, where gradient compression pays "
              "(measured vs predicted), parameter server vs all-reduce across the link, hpcpar plan calibrated on "
              "the cluster; root only", quick_args=("--quick",), needs_root=True, timeout_s=1800.0),
    Benchmark("resilience", "bench/resilience.py", None,
              "partner snapshots every K = 1, 5, 20 steps on the default job: per-step overhead vs none, bytes and "
              "host memory per snapshot, seconds per level (memory, node-local); a node lost on the emulated "
              "cluster: ULFM shrink-and-continue vs requeue from the shared checkpoint or from node-local snapshots "
              "(time to the next step, steps lost); root only", quick_args=("--quick",), needs_root=True,
              timeout_s=1800.0),
)
BY_NAME = {b.name: b for b in BENCHMARKS}


# -- running --------------------------------------------------------------------------------
def mpiexec_path() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")


def command(b: Benchmark, quick: bool, out: Path) -> list[str]:
    """The argv that runs `b`, writing its JSON to `out`."""
    cmd = [sys.executable, str(ROOT / b.script), *(b.quick_args if quick else b.args), "--out", str(out)]
    return [mpiexec_path(), "-n", str(b.ranks), *cmd] if b.ranks else cmd


def display(argv: list[str]) -> str:
    """`argv` as a reader would type it: `python`, `mpiexec`, paths relative to the repository."""
    def short(arg: str) -> str:
        if arg == sys.executable:
            return "python"
        if arg == mpiexec_path():
            return "mpiexec"
        if arg.startswith(str(ROOT) + os.sep):
            return os.path.relpath(arg, ROOT)
        return arg
    words = [short(a) for a in argv]
    if "--out" in words:  # the default place needs no flag
        i = words.index("--out")
        if Path(ROOT / words[i + 1]).parent == DEFAULT_RESULTS:
            del words[i:i + 2]
    env = " ".join(f"{k}={v}" for k, v in THREAD_ENV.items() if k != "MKL_NUM_THREADS")
    return f"{env} {shlex.join(words)}"


def cluster_missing() -> str | None:
    """Why no cluster of node namespaces can start here (tests/cluster/harness.py), or None."""
    sys.path.insert(0, str(ROOT / "tests" / "cluster"))
    try:
        import harness
    except ImportError as e:
        return f"tests/cluster/harness.py cannot be imported ({e})"
    finally:
        sys.path.remove(str(ROOT / "tests" / "cluster"))
    return harness.missing()


def torch_version() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return None
    return importlib.metadata.version("torch")


def run(b: Benchmark, quick: bool, results_dir: Path) -> dict:
    """Run one benchmark; its summary entry (without figures)."""
    out = results_dir / f"{b.name}.json"
    argv = command(b, quick, out)
    entry = {"command": display(argv), "argv": argv, "quick": quick, "started": now(),
             "load_average_before": list(os.getloadavg())}
    if b.needs_torch and torch_version() is None:
        return {**entry, "status": "skipped: PyTorch is not installed (pip install torch)", "returncode": None}
    if b.needs_root and (why := cluster_missing()):
        return {**entry, "status": f"skipped: {why}", "returncode": None}
    print(f"\n=== {b.name}: {entry['command']}", flush=True)
    env = {**os.environ, **THREAD_ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    try:
        rc = subprocess.run(argv, cwd=ROOT, env=env, timeout=b.timeout_s).returncode
        status = "ok" if rc == 0 else f"exit status {rc}"
    except subprocess.TimeoutExpired:
        rc, status = None, f"timed out after {b.timeout_s:.0f} s"
    return {**entry, "status": status, "returncode": rc, "wall_s": time.perf_counter() - start,
            "load_average_after": list(os.getloadavg())}


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def machine_info(note: str) -> dict:
    """What produced the figures: CPU, cores, MPI library, package versions, load, date."""
    cpu = platform.processor() or platform.machine()
    virtual = False
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        models = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
        cpu = models[0] if models else cpu
        virtual = " hypervisor" in text
    except OSError:
        pass
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
                           capture_output=True, text=True, timeout=60)
    mpi = probe.stdout.strip().splitlines()[0].strip() if probe.returncode == 0 and probe.stdout.strip() else \
        "unknown (mpi4py failed to start)"

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "virtual_machine": virtual, "os": platform.platform(), "python": platform.python_version(),
            "mpi": " ".join(mpi.split()), "mpi4py": version("mpi4py"), "numpy": version("numpy"),
            "h5py": version("h5py"), "torch": torch_version(), "date": now(),
            "load_average_start": list(os.getloadavg()), "note": note}


# -- key figures ----------------------------------------------------------------------------
def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB" if nbytes >= 1024 else f"{nbytes} B"


def _allreduce(d: dict) -> list[str]:
    rows = {r["bytes"]: r for r in d["rows"] if r["op"] == "all_reduce"}
    summary = {s["op"]: s for s in d.get("summary", [])}
    ratios = [f"{rows[n]['ratio']:.2f} at {_size(n)}" for n in (MiB, 64 * MiB) if n in rows]
    ar = summary.get("all_reduce", {})
    worst, met = ar.get("min_ratio"), ar.get("goal_met_from_bytes")
    out = [f"all-reduce bus bandwidth, hpcpar / raw mpi4py: {', '.join(ratios) or 'n/a (sizes not run)'} "
           f"({d['meta']['ranks']} ranks)" + (f"; worst from 1 MiB up {worst:.2f}, goal >= {ar['bandwidth_goal']} met "
                                             + (f"from {_size(met)} up" if met else "at no size") if worst else "")]
    if rows:
        n = min(rows)
        r = rows[n]
        out.append(f"latency at {_size(n)}: {r['hpcpar']['time_us']:.1f} µs vs {r['raw']['time_us']:.1f} µs raw"
                   + (f" (vs {r['raw_nb']['time_us']:.1f} µs raw non-blocking + Wait)" if "raw_nb" in r else "")
                   + (f", {r['before']['time_us']:.1f} µs before" if "before" in r else ""))
    overheads = [f"{op} {s['overhead_us']:+.1f} vs {s['overhead_before_us']:+.1f} µs "
                 f"({s['overhead_vs_before']:.2f}x)" for op, s in summary.items() if s.get("overhead_vs_before")]
    if overheads:
        out.append(f"latency overhead, hpcpar - raw (median 8 B..1 KiB), now vs before (goal <= "
                   f"{summary['all_reduce']['overhead_goal']}x): " + ", ".join(overheads))
    if 64 * MiB in rows:
        out.append(f"busbw at 64 MiB: {rows[64 * MiB]['hpcpar']['busbw_GBps']:.2f} GB/s hpcpar, "
                   f"{rows[64 * MiB]['raw']['busbw_GBps']:.2f} GB/s raw")
    return out


# bench/allreduce.py's goals per op before issue #45 (bench/results/allreduce.json at 1402f7b, the same
# method): (worst busbw / raw from 1 MiB up, latency overhead / before issue #20's).
_COLLECTIVES_BEFORE_45 = {"all_reduce": (0.97, 0.27), "reduce_scatter": (0.77, 0.54), "all_gather": (0.76, 0.57),
                          "iall_reduce": (0.85, 0.42), "sendrecv": (0.76, 0.42)}


def _collectives_table(d: dict) -> list[str]:
    """bench/allreduce.py: the goals per op, then all_reduce size by size."""
    if "summary" not in d:
        return ["(results of an older bench/allreduce.py: rerun it for this table)"]
    m = d["meta"]
    lines = [f"{m['ranks']} ranks on {m['cores']} cores" + (" (oversubscribed: ranks share the cores)"
                                                           if m["oversubscribed"] else "")
             + (f" (load average {m['load_average_before'][0]:.1f} before the run, {m['load_average_after'][0]:.1f} "
                "after)" if "load_average_after" in m else "")
             + f", float32; per size the best of {m['rounds']} interleaved rounds, each the slowest rank's mean time "
             "per op. raw: mpi4py's upper-case call on preallocated buffers (non-blocking + Wait for iall_reduce and "
             "sendrecv; where hpcpar returns a new array, raw receives into the very buffer hpcpar's result lives in); "
             "hpcpar: the Communicator as training code calls it (flight recorder, byte accounting); before: the "
             f"Communicator of {m['before']} (its results in its own memory: its bandwidth ratios carry that "
             "memory's luck, up to 15% from 1 MiB up). busbw as in nccl-tests; overhead = time - raw's.", "",
             "| op | busbw / raw from 1 MiB, worst | before #45 | before | goal | goal met from | "
             "overhead (median 8 B..1 KiB) µs | before µs | ratio | before #45 | goal |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]

    def num(x, fmt: str) -> str:
        return "–" if x is None else format(x, fmt)

    def verdict(ok) -> str:
        return "–" if ok is None else "ok" if ok else "missed"
    for s in d["summary"]:
        met = s.get("goal_met_from_bytes")
        was = _COLLECTIVES_BEFORE_45.get(s["op"], (None, None))
        lines.append(f"| {s['op']} | {num(s['min_ratio'], '.2f')} | {num(was[0], '.2f')} | "
                     f"{num(s['min_ratio_before'], '.2f')} | "
                     f">= {s['bandwidth_goal']}: {verdict(s['bandwidth_ok'])} | {_size(met) if met else '–'} | "
                     f"{num(s['overhead_us'], '+.1f')} | "
                     f"{num(s['overhead_before_us'], '+.1f')} | {num(s['overhead_vs_before'], '.2f')} | "
                     f"{num(was[1], '.2f')} | <= {s['overhead_goal']}: {verdict(s['overhead_ok'])} |")
    lines += ["", "From 1 MiB up, hpcpar's polled all_reduce into a new array is a reduce-scatter into this rank's part of "
              "the result and an in-place all-gather (hpcpar/runtime/transports.py, `_SplitAllReduce`): MPI's out-of-place "
              "all-reduce first copies the input into the result, the reduce-scatter reads it where it is. With 4 "
              "ranks on 2 cores, whatever a call does in the interpreter before it enters the MPI op delays every "
              "rank many times over (5 µs of busy work before a raw Iallreduce of 256 KiB made it 14-18 µs slower, "
              "20 µs 48 µs slower; 3 µs of list arithmetic before a 1 MiB split all-reduce 70 µs), so an op enters "
              "MPI first and is recorded after. Issue #45 took the rest of that work off the other ops' paths: a "
              "repeated all_reduce, reduce_scatter, all_gather or iall_reduce of a contiguous NumPy array runs from a "
              "plan kept per shape and dtype (hpcpar/runtime/comm.py, `_keep_plan`: the checks, the MPI call and its "
              "counts worked out on the first call; then 1.3-1.5 µs of interpreter work per op instead of 2.2-2.9 "
              "µs, CPU time measured with MPI stubbed out), a blocking op that polls is recorded as a tuple like one "
              "inside MPI's blocking call (no OpRecord), and isend_irecv posts the receive and the send before "
              "recording either (sendrecv: 3.9 µs instead of 4.5). Polling stays (MPICH's non-blocking "
              "reduce-scatter with equal counts is as fast as its blocking one here; its Ireduce_scatter_block is "
              "6x slower at 1 MiB). The machine is shared: from 1 MiB up a round is mostly how the scheduler "
              "treated it, so single sizes swing by 10-30% between runs (before #45: the figures of the run before "
              "the change). Smaller messages are latency-bound (the overhead goal).", "",
              "all_reduce by size:", "",
              "| bytes | raw µs | hpcpar µs | before µs | raw busbw GB/s | hpcpar busbw GB/s | ratio | ratio before |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in d["rows"] if r["op"] == "all_reduce"):
        b = r.get("before")
        lines.append(f"| {_size(r['bytes'])} | {r['raw']['time_us']:.1f} | {r['hpcpar']['time_us']:.1f} | "
                     f"{num(b and b['time_us'], '.1f')} | {r['raw']['busbw_GBps']:.3f} | "
                     f"{r['hpcpar']['busbw_GBps']:.3f} | {r['ratio']:.2f} | {num(r.get('ratio_before'), '.2f')} |")
    return lines


def _gemm(d: dict, ranks: int) -> list[str]:
    run = d.get(f"n={ranks}") or d[sorted(d)[-1]]
    out = [f"tp={run['ranks']} on {run['cores']} cores, GEMM peak {run['peak_gflops']:.1f} GFLOP/s (1 thread)"]
    for s in run["sizes"]:
        out.append(f"{s['m']}x{s['k']}->{s['n']}: local GEMM {s['column_gemm_fraction_of_peak']:.2f} (column) / "
                   f"{s['row_gemm_fraction_of_peak']:.2f} (row) of peak; with the collective column "
                   f"{s['column_fraction_of_peak']:.2f}, row {s['row_fraction_of_peak']:.2f}; "
                   f"speedup vs unsharded {s['column_speedup']:.2f}x / {s['row_speedup']:.2f}x")
    return out


def _pipeline(d: dict) -> list[str]:
    cases = d["cases"]
    errors = [c["error"] for c in cases]
    within = sum(abs(e) <= d["tolerance"] for e in errors)
    one_f_one_b = [c for c in cases if c["schedule"] == "1f1b"] or cases
    c = one_f_one_b[len(one_f_one_b) // 2]  # a middle case of the plainest schedule as the example
    out = [f"pp={cases[0]['pp']}: measured step time {_pct(min(errors))} … {_pct(max(errors))} of the simulator's "
           f"prediction over {len(cases)} cases; {within}/{len(cases)} within {d['tolerance']:.0%}",
           f"e.g. {c['schedule']} m={c['microbatches']}: {c['measured_s']:.3f} s measured vs {c['predicted_s']:.3f} s "
           f"predicted; bubble {c['measured_bubble']:.1%} measured vs {c['predicted_bubble']:.1%} predicted"]
    for r in d.get("against_1f1b", []):
        if r.get("bound") is not None:
            out.append(f"{r['schedule']} m={r['microbatches']}: bubble {r['idle_ratio']:.2f}x 1F1B's "
                       f"(bound {r['bound']}, predicted {r['predicted_idle_ratio']:.2f}x), peak stash "
                       f"{r['peak_stash']:g} vs {r['peak_stash_1f1b']:g}: {'ok' if r['ok'] else 'MISSED'}")
    return out


def _pipeline_gpt(d: dict) -> list[str]:
    out = []
    for mesh in d["meshes"]:
        out.append(f"{mesh['mesh']}: " + ", ".join(f"{r['schedule']} {r['tokens_per_s']:,.0f} tok/s "
                                                   f"({r['tokens_per_s_vs_1f1b']:.2f}x)" for r in mesh["rows"]))
    return out


def _checkpoint(d: dict, ranks: int) -> list[str]:
    run = d.get(f"ranks={ranks}") or d[sorted(d)[-1]]
    g, r = run["gb_per_s"], run["ratio_vs_numpy"]
    return [f"{run['bytes'] / MiB:.0f} MiB float32 on {run['ranks']} ranks, best of {run['repeats']}",
            f"save {g['hpcpar save']:.2f} GB/s vs numpy {g['numpy save']:.2f} GB/s ({r['save']:.2f}x); "
            f"load {g['hpcpar load']:.2f} vs {g['numpy load']:.2f} GB/s ({r['load']:.2f}x); "
            f"resharded load {r['load resharded']:.2f}x"] + (
        [f"numpy load dropping each array as read (the reference before format v2): "
         f"{g['numpy load, arrays dropped']:.2f} GB/s, hpcpar load {r['load vs numpy load, arrays dropped']:.2f}x of it"]
        if "numpy load, arrays dropped" in g else []) + (
        [f"shared file (parallel HDF5, {run.get('mpi', 'MPI')}): save {g['hpcpar save shared']:.2f} GB/s "
         f"({r['save shared']:.2f}x); load {g['hpcpar load shared']:.2f} GB/s ({r['load shared']:.2f}x); "
         f"resharded load {r['load shared resharded']:.2f}x"] if run.get("shared_storage")
        else ["shared file: not measured (h5py without MPI)"])


def _scaling(d: dict) -> list[str]:
    rows = {r["dp"]: r for r in d["rows"]}
    base, top = min(rows), max(rows)
    r = rows[top]
    hidden = r.get("hidden_fraction")
    return [f"dp={top} vs dp={base}: {r['speedup']:.2f}x tokens/s (efficiency {r['efficiency']:.0%}); "
            f"per CPU-second {r['cpu_speedup']:.2f}x",
            f"gradient communication hidden behind backward: {hidden:.0%}" if hidden is not None
            else "gradient communication: not measured"]


def _mesh_scaling(d: dict) -> list[str]:
    out = []
    for mode in ("strong", "weak"):
        rows = [r for r in d[mode] if "error" not in r and r["ranks"] > 1]
        parts = []
        for n in sorted({r["ranks"] for r in rows}):
            at_n = [r for r in rows if r["ranks"] == n]
            best = max(at_n, key=lambda r: r["speedup"])
            star = "*" if best["oversubscribed"] else ""
            every = ", ".join(f"{r['mesh']} {r['speedup']:.2f}x" for r in at_n)
            parts.append(f"{n} ranks{star}: {every}; best {best['mesh']} ({best['cpu_speedup']:.2f}x per CPU-s)")
        failed = [r["mesh"] for r in d[mode] if "error" in r]
        failed_text = f"; failed: {', '.join(failed)}" if failed else ""
        out.append(f"{mode} tokens/s vs 1x1x1: " + "; ".join(parts) + failed_text)
    if d.get("torch"):
        base = d["baseline_tokens_per_s"]
        out.append("hpcpar 1x1x1 / PyTorch eager (1 process): " + ", ".join(
            f"{base / t['tokens_per_s']:.2f}x with {t['threads']} thread(s) ({base:.0f} vs {t['tokens_per_s']:.0f} "
            "tokens/s)" for t in d["torch"]))
    else:
        out.append(f"PyTorch peer skipped: {d.get('torch_note') or 'not run'}")
    out.append(f"* {d['meta']['note']}")
    return out


def _context(d: dict) -> list[str]:
    meta, k = d["meta"], d["meta"]["ranks"]
    at_k = {r["design"]: r for r in d["attention"] if r["k"] == k}
    sent = {r["design"]: r for r in d["bytes"] if r["k"] == k}
    naive = {r["k"]: r for r in d["naive"]}
    longest = ", ".join(f"cp={r['cp']} {r['block_size']}" for r in d["longest"])
    ok = d["checks"]
    proportional = "yes" if ok["activations_proportional_to_1_over_k_within_10pct"] else "NO"
    return [f"T={meta['seq']}, k={k}: attention activations per rank "
            + ", ".join(f"{n} {at_k[n]['saved_bytes_per_rank'] / MiB:.2f} MiB" for n in at_k)
            + f" (x k constant within 10%: {proportional})",
            "bytes sent per rank per layer: " + ", ".join(
                f"{n} {r['bytes_sent_per_layer'] / 1024:.0f} KiB (formula {r['formula_bytes'] / 1024:.0f})"
                for n, r in sent.items()),
            f"attention work max/mean: zigzag {at_k['ring']['work_max_over_mean']:.3f}, contiguous split "
            f"{naive[k]['work_max_over_mean']:.3f} ((2cp-1)/cp = {(2 * k - 1) / k:.3f})" if k in naive else
            "attention work: not measured",
            "tokens/s: " + ", ".join(f"{r['design']} {r['tokens_per_s']:,.0f}" for r in d["throughput"]),
            f"longest block_size under {meta['limit_bytes'] / MiB:.0f} MiB per rank (ring): {longest}; "
            f"measured peak within the limit: {'yes' if ok['measured_peak_within_limit'] else 'NO'}"]


def _memory(d: dict) -> list[str]:
    """One line per section of bench/memory.py that ran."""
    out = []
    if "activations" in d:
        a = d["activations"]
        c = a["config"]
        rows = {r["recompute"]: r for r in a["rows"]}
        out.append(f"activations per layer (B={c['batch']}, T={c['seq']}, C={c['n_embd']}, H={c['n_head']}, "
                   f"{c['dtype']}), measured / formula MiB: " + ", ".join(
                       f"{m} {r['measured_bytes_per_layer'] / MiB:.2f} / {r['formula_bytes_per_layer'] / MiB:.2f}"
                       for m, r in rows.items()))
        out.append("forward + backward time vs none: " + ", ".join(
            f"{m} {r['step_time_vs_none']:.2f}x" for m, r in rows.items() if m != "none"))
    if "precision" in d:
        rows = d["precision"]["rows"]
        out.append("activations per layer vs float32: " + ", ".join(
            f"{r['precision']} {r['activations_vs_full']:.2f}x" for r in rows if r["precision"] != "full")
            + "; bytes/parameter: " + ", ".join(f"{r['precision']} {r['state_bytes_per_parameter']:.2f}" for r in rows))
    if "model_state" in d:
        ms = d["model_state"]
        out.append(f"model-state bytes/parameter on {ms['rows'][0]['n']} ranks, measured (formula): " + ", ".join(
            f"zero={r['zero']} {r['measured']:.2f} ({r['formula_bytes_per_param']:.2f})" for r in ms["rows"]))
        f = ms["fit"]
        out.append(f"under {f['limit_bytes'] / MiB:.1f} MiB per rank: {f['params']['big'] / 1e6:.2f}M params "
                   f"({f['param_ratio']:.1f}x the {f['params']['small'] / 1e6:.2f}M plain DP fits) refused by "
                   f"zero=0, trains under zero=3 (measured peak {f['big_zero3_peak_bytes'] / MiB:.1f} MiB)")
    failed = [k for k, ok in d.get("checks", {}).items() if not ok]
    out.append("every figure within 10% of its formula: " + ("yes" if not failed else "NO: " + "; ".join(failed)))
    return out


def _zero(d: dict) -> list[str]:
    best = d["best"]
    hidden = d.get("hidden_fraction")
    before = d.get("before")
    out = [f"zero=3 / zero=1 tokens/s on {best['dp']} ranks: {d['ratio_zero3_over_zero1']:.2f}x "
           f"({best['zero3']['tokens_per_s']:,.0f} vs {best['zero1']['tokens_per_s']:,.0f}, same run; goal >= 0.95)",
           f"all-gather wait {1e3 * best['zero3']['gather_wait_s']:.1f} ms/step with prefetch "
           f"({best['zero3'].get('prefetch_depth', 1)} units ahead), "
           f"{1e3 * best['zero3_no_prefetch']['gather_wait_s']:.1f} without: "
           + (f"{hidden:.0%} hidden (goal >= 50 %)" if hidden is not None else "not measured")]
    if before:
        out.append(f"before (issue #45, one unit prefetched): {before['ratio_zero3_over_zero1']:.2f}x, "
                   f"wait {before['gather_wait_ms']:.1f} vs {before['gather_wait_no_prefetch_ms']:.1f} ms/step, "
                   f"{before['hidden_fraction']:.0%} hidden")
    return out


def _vs_torch(d: dict) -> list[str]:
    rows = d["rows"]
    cells = "; ".join(f"{r['n_layer']}x{r['n_embd']}x{r['block_size']}x{r['batch']} {r['threads']}t "
                      f"{r['ratio_hpcpar_over_torch']:.2f}x" for r in rows)
    o = d["op_overhead"]
    return [f"hpcpar / PyTorch {d['torch_version']} tokens/s, lowest {d['min_ratio']:.2f}x ({d['blas']} GEMMs)",
            f"L x C x T x B, threads: {cells}",
            f"per-op overhead {o['hpcpar_us']:.1f} µs vs {o['torch_us']:.1f} µs"]


def _plan(d: dict) -> list[str]:
    paper = d["narayanan"]
    worst = max(abs(r["ratio"] - 1) for r in paper)
    return [f"4 ranks, {len(d['rows'])} meshes: median |predicted - measured| / measured {d['median_abs_error']:.0%} "
            f"(goal <= 15 %), Spearman {d['spearman']:.2f} (goal >= 0.8), first choice "
            f"{d['first_choice_gap']:+.0%} from the fastest (goal <= 5 %)",
            f"Narayanan et al. table, A100 preset: predicted TFLOP/s per GPU within {worst:.0%} of the published "
            f"on all {len(paper)} rows (goal 20 %)"] + _plan_speed(d.get("speed", []))


def _plan_speed(rows: list[dict]) -> list[str]:
    """The planner's own time and memory at scale (`bench/plan.py --speed`), one key figure."""
    if not rows:
        return []
    worst_s, worst_mb = max(r["wall_s"] for r in rows), max(r["rss_mb"] for r in rows)
    return [f"hpcpar plan at scale, {len(rows)} allocations up to 16,384 ranks and 196,608 sequences: at most "
            f"{worst_s:.2f} s and {worst_mb:.0f} MB (goal <= 10 s, <= 500 MB; the exhaustive search before: up to "
            f"{max(r['before']['wall_s'] for r in rows):,.0f} s and "
            f"{max(r['before']['rss_mb'] for r in rows):,.0f} MB, or stopped)"]


def _plan_speed_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", "`python bench/plan.py --speed`: `hpcpar plan` as a user runs it (best wall time of 3 runs, its CPU "
             "time, peak RSS), next to the exhaustive search it replaced (issue 45's figures, or measured here at "
             "`ccb2193`; \">\": stopped before it finished):", "",
             "| allocation | wall s | CPU s | RSS MB | before |", "|---|---:|---:|---:|---|"]
    for r in rows:
        b, more = r["before"], (">" if r["before"].get("stopped") else "")
        was = ", ".join(f"{more}{b[k]:,.{n}f} {unit}" for k, unit, n in (("wall_s", "s", 1), ("cpu_s", "s CPU", 1),
                                                                       ("rss_mb", "MB", 0)) if b.get(k) is not None)
        lines.append(f"| {r['row']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['rss_mb']:.0f} | {was} |")
    return lines


def _plan_table(d: dict) -> list[str]:
    lines = ["`python bench/plan.py`: calibrated on this machine (4 ranks), the fastest plan of each mesh "
             "trained with `Trainer.train`; measured = the slowest rank's median step, best round.", "",
             "| plan | predicted ms | measured ms | error |", "|---|---:|---:|---:|"]
    for r in sorted(d["rows"], key=lambda r: r["measured_s"]):
        err = abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"]
        lines.append(f"| {r['layout']} | {r['predicted_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | {err:.0%} |")
    lines += ["", "The A100 preset (312 TFLOP/s bf16 peak, GEMM efficiency 0.70, HBM 2.0 TB/s, NVLink 300 GB/s, "
              "one 25 GB/s HCA per GPU) on the layouts of Narayanan et al., SC'21, Table 1 (full recomputation, "
              "micro-batch 1, 1F1B), TFLOP/s per GPU by the paper's FLOP count:", "",
              "| model | GPUs | tp | pp | dp | batch | published | predicted | ratio |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["narayanan"]:
        lines.append(f"| {r['params_b']}B | {r['gpus']} | {r['tp']} | {r['pp']} | {r['dp']} | {r['batch']} | "
                     f"{r['published_tflops']} | {r['predicted_tflops']:.1f} | {r['ratio']:.2f} |")
    return lines + _plan_speed_table(d.get("speed", []))


def _gbps(c) -> str:
    """A crossover link speed: Gb/s, or "any" (the compressor costs no time)."""
    return c if isinstance(c, str) else f"{c:.2f}"


def _compression_name(r: dict) -> str:
    knob = {"topk": f" {r['ratio']:g}", "powersgd": f" r{r['rank']}"}.get(r["kind"], "")
    return (r["kind"] + knob + ("" if r["error_feedback"] or r["kind"] in ("none", "fp16", "bf16") else " (no EF)")
            + (f" (warm-up {r['start_step']})" if r.get("start_step") else ""))


def _compression(d: dict) -> list[str]:
    m, loss = d["meta"], d["loss"]
    worst = max(abs(r["formula_error"]) for r in loss + d["default"] + d["wide"])
    cross = ", ".join(f"{r['kind']} {_gbps(r['crossover_gbps'])}" for r in d["where_it_pays"]["default"]
                      if r["crossover_gbps"] is not None)
    return [f"bytes/step/rank vs none, default model, dp={m['ranks']}: "
            + ", ".join(f"{r['kind']} {r['ratio_to_none']:.3f}x" for r in d["default"] if r["kind"] != "none")
            + f"; every measurement within {worst:.1%} of its formula",
            f"final loss vs none after {m['steps']} steps: "
            + ", ".join(f"{_compression_name(r)} {r['loss_vs_none']:+.1%}" for r in loss if r["kind"] != "none"),
            f"link speed below which each wins (Gb/s): {cross}; this machine's shared memory: "
            f"{m['shared_memory_gbps']:.1f} Gb/s"]


def _diloco_rate(gbps: float) -> str:
    return f"{gbps * 1e3:g} Mb/s" if gbps < 1 else f"{gbps:g} Gb/s"


def _diloco_gbps(x) -> str:
    """A crossover link speed: Gb/s, "any" (never slower) or "never"."""
    return "never" if x is None else x if isinstance(x, str) else f"{x:.3g}"


def _diloco(d: dict) -> list[str]:
    m, runs = d["meta"], d["runs"]
    top = m["timed_replicas"]
    out = []
    for replicas in sorted({r["replicas"] for r in runs}, reverse=True):
        rows = [r for r in runs if r["replicas"] == replicas and not (r["mode"] == "step" and
                                                                       r["grad_compression"] == "none")]
        out.append(f"R={replicas}, loss vs step after {m['steps']} steps (last 10 / validation): "
                   + ", ".join(f"{r['name']} {r['loss_gap']:+.1%} / {r['val_gap']:+.1%}" for r in rows))
    worst = max(abs(r["formula_error"]) for r in runs)
    out.append(f"replica-axis bytes/step vs step (R={top}): "
               + ", ".join(f"{r['name']} {r['bytes_ratio']:.3f}x" for r in runs
                           if r["replicas"] == top and r["mode"] != "step" and r["every"] > 1)
               + f"; every measurement within {worst:.1%} of its formula")
    slow = str(min(m["links"]))
    model = {r["name"]: r for r in d["link_model"]["rows"]}
    h = m["goal_every"]
    out.append(f"tokens/s at {_diloco_rate(float(slow))} (R={top}, modelled): "
               + ", ".join(f"{n} {model[n]['tokens_per_s'][slow]:,.0f}" for n in
                           ("step", "step int8", f"diloco H={h}", f"diloco H={h} F=2 tau=1") if n in model)
               + "; L* (Gb/s) below which diloco H=" + f"{h} beats step int8: "
               + _diloco_gbps(d["crossover_gbps"].get(f"diloco H={h} vs step int8"))
               + ", beats step: " + _diloco_gbps(d["crossover_gbps"].get(f"diloco H={h} vs step")))
    met = d.get("goal_met_by") or []
    out.append(f"goal (within {m['goal_loss']:.0%} of step's loss at <= {m['goal_bytes']:.0%} of its bytes): "
               + (f"met by {', '.join(met)}" if met else "not met by any setting"))
    return out


def _ps(d: dict) -> list[str]:
    rows = [r for r in d["throughput"] if r["servers"] in (0, 1)]
    ratio = {(r["mode"], r["straggler"]): r["vs_allreduce"] for r in rows}
    worst = max(max(abs(b["bytes_in"] / b["formula_in"] - 1), abs(b["bytes_out"] / b["formula_out"] - 1))
                for b in d["bytes"])
    return ["tokens/s vs all-reduce (1 server), random 2x straggler: "
            + ", ".join(f"{m} {ratio[(m, 'random')]:.2f}x" for m in ("sync", "ssp2", "async"))
            + "; fixed 2x straggler: " + ", ".join(f"{m} {ratio[(m, 'fixed')]:.2f}x" for m in ("sync", "ssp2", "async"))
            + "; none: " + ", ".join(f"{m} {ratio[(m, 'none')]:.2f}x" for m in ("sync", "ssp2", "async")),
            f"bytes per server per step within {worst:.2%} of the formula",
            "final loss vs synchronous (straggler, ps.stale_weight; 1 = uncorrected): " + ", ".join(
                f"{r['mode']} {r['straggler']} w={r.get('stale_weight', 1):g} {r['loss_vs_sync']:+.2%}"
                for r in d["loss"] if r["mode"] != "sync")]


def _ps_table(d: dict) -> list[str]:
    lines = ["4 worker replicas (dp=4, the default job's model and global batch of 48 sequences), float32; "
             "tokens/s = timed steps x tokens per step / wall time of the slowest rank, after a warm-up step. "
             "Random straggler: at every step one worker, drawn from (seed, step), runs 2x slower; fixed: worker "
             "rank 1 always 2x slower ([parallelism.md](parallelism.md#parameter-server)).", "",
             "| mode | servers | straggler | tokens/s | vs all-reduce |", "|---|---:|---|---:|---:|"]
    for r in d["throughput"]:
        lines.append(f"| {r['mode']} | {r['servers']} | {r['straggler']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['vs_allreduce']:.2f}x |")
    lines += ["", "Bytes per server per step (no straggler), measured and by the formula in = s (3 W + R n), "
              "out = s (5 W + R n):", "",
              "| mode | servers | server rank | range | in MiB | formula | out MiB | formula |",
              "|---|---:|---:|---|---:|---:|---:|---:|"]
    for b in d["bytes"]:
        lines.append(f"| {b['mode']} | {b['servers']} | {b['server_rank']} | [{b['range'][0]:,}, {b['range'][1]:,}) | "
                     f"{b['bytes_in'] / MiB:.3f} | {b['formula_in'] / MiB:.3f} | {b['bytes_out'] / MiB:.3f} | "
                     f"{b['formula_out'] / MiB:.3f} |")
    t = d.get("transport")
    if t:
        lines += ["", f"Transport, a push and a pull of {t['elements']:,} float32 between two ranks: point-to-point "
                  f"round trip {1e3 * t['p2p_round_trip_s']:.1f} ms; MPI one-sided epoch (Lock, Accumulate, Get, "
                  f"Unlock) {1e3 * t['rma_server_in_mpi_s']:.1f} ms with the server inside MPI, "
                  f"{1e3 * t['rma_server_busy_s']:.0f} ms with the server busy in NumPy for one second."]
    lines += ["", "Loss (1 server), mean of the last 10 steps; `ps.stale_weight` w: a push late by tau optimizer "
              "steps weighs w^tau in its step (1 = no correction); late pushes: of those applied, how many were "
              "late, and by at most how many steps:", "",
              "| mode | straggler | stale_weight | steps | final loss | vs synchronous | staleness max | "
              "staleness mean | late pushes |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in d["loss"]:
        weight = "–" if r.get("stale_weight") is None else f"{r['stale_weight']:g}"
        late = "–" if r.get("pushes_late") is None else f"{r['pushes_late']} of {r['pushes_applied']} (≤ {r['late_max']})"
        lines.append(f"| {r['mode']} | {r['straggler']} | {weight} | {r['steps']} | {r['final_loss']:.4f} | "
                     f"{r['loss_vs_sync']:+.2%} | {r['staleness_max']} | {r['staleness_mean']:.2f} | {late} |")
    return lines


def _precision(d: dict) -> list[str]:
    m, rows = d["meta"], d["rows"]
    return [f"final loss vs full after {m['steps']} steps: " + ", ".join(
                f"{r['precision']} {r['loss_vs_full']:+.2%}" for r in rows if r["precision"] != "full")
            + "; diverged: " + (", ".join(r["precision"] for r in rows if r["diverged"]) or "none"),
            "tokens/s vs full: " + ", ".join(f"{r['precision']} {r['speed_vs_full']:.2f}x" for r in rows
                                             if r["precision"] != "full")
            + f"; fp16 skipped steps {next(r['skipped_steps'] for r in rows if r['precision'] == 'fp16')}"]


def _moe(d: dict) -> list[str]:
    t, n = d["throughput"], d["ranks"]
    aux_rows = {b["alpha"]: b for b in d["balance"] if not b.get("bias_rate")}
    with_aux, without = aux_rows[max(aux_rows)], aux_rows[min(aux_rows)]
    bias = next((b for b in d["balance"] if b.get("bias_rate")), None)
    before = t.get("before")
    was = (f" (before issue #45: {before['ratio_moe_over_dense']:.2f}x, {before['ratio_moe_ep1_over_dense']:.2f}x; "
           f"goal >= 0.8x)" if before else "")
    return [f"MoE (E=4, top_k=1) / dense of the same active parameters, tokens/s: {t['ratio_moe_over_dense']:.2f}x "
            f"with ep={n} ({t['moe']['tokens_per_s']:,.0f} vs {t['dense']['tokens_per_s']:,.0f}), "
            f"{t['ratio_moe_ep1_over_dense']:.2f}x with ep=1{was}"
            + (f"; ep={n} with capacity factor {t['capacity_factor']}: {t['ratio_moe_cap_over_dense']:.2f}x "
               f"(the unlimited run's busiest expert: {t['moe']['load_imbalance']:.2f}x the mean)"
               if "moe_cap" in t else "")
            + (f"; with the expert bias (rate {t['bias_rate']}, after {t['moe_bias']['warmup_steps']} untimed steps, "
               f"default corpus): {t['ratio_moe_bias_over_dense']:.2f}x with ep={n} (max/mean tokens per expert "
               f"{t['moe_bias']['load_imbalance']:.2f}), {t['ratio_moe_ep1_bias_over_dense']:.2f}x with ep=1 "
               f"({t['moe_ep1_bias']['load_imbalance']:.2f})" if "moe_bias" in t else "")
            + (f"; routing frozen at initialisation (lr 1e-12): {t['ratio_moe_frozen_over_dense']:.2f}x with ep={n} "
               f"(max/mean {t['moe_frozen']['load_imbalance']:.2f}), {t['ratio_moe_ep1_frozen_over_dense']:.2f}x "
               "with ep=1" if "moe_frozen" in t else ""),
            f"all-to-all-v {t['moe']['all_to_all_v_bytes'] / MiB:.2f} MiB/step/rank vs "
            f"{t['formula_all_to_all_v_bytes'] / MiB:.2f} MiB formula (balanced routing)",
            f"max/mean tokens per expert after {with_aux['steps']} steps: "
            f"{with_aux['imbalance_last10']:.2f} with aux loss (alpha={with_aux['alpha']}), "
            f"{without['imbalance_last10']:.2f} without"
            + (f", {bias['imbalance_last10']:.2f} with the expert bias (rate {bias['bias_rate']}, no aux loss)"
               if bias else "")]


def _moe_table(d: dict) -> list[str]:
    t, n = d["throughput"], d["ranks"]
    lines = [f"dp={n}, float32; step time: slowest rank's median step, the fastest of {t.get('rounds', 2)} "
             "alternating runs; max/mean tokens per expert: the routing of the worst MoE layer, one step after the "
             "timed ones; bytes: "
             "`Communicator.sent` of the ep group per step, mean over ranks "
             "([parallelism.md](parallelism.md#mixture-of-experts-and-expert-parallelism)).", "",
             "| model | tokens/s | step ms | / dense | before #45 | max/mean tokens per expert | parameters per rank "
             "| active parameters | all-to-all-v MiB/step | formula |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    before = t.get("before", {})
    rows = [("dense", "dense", None), (f"MoE, ep={n}", "moe", "ratio_moe_over_dense"),
            ("MoE, ep=1", "moe_ep1", "ratio_moe_ep1_over_dense")]
    if "moe_cap" in t:
        rows.append((f"MoE, ep={n}, capacity factor {t['capacity_factor']} ({t['moe_cap']['dropped_fraction']:.1%} "
                     "dropped)", "moe_cap", "ratio_moe_cap_over_dense"))
    if "moe_bias" in t:
        warm = f"rate {t['bias_rate']}, default corpus, after {t['moe_bias']['warmup_steps']} untimed steps"
        rows += [(f"dense ({warm.split(', ', 1)[1]}: the expert-bias rows' twin)", "dense_warm", None),
                 (f"MoE, ep={n}, expert bias ({warm})", "moe_bias", "ratio_moe_bias_over_dense"),
                 (f"MoE, ep=1, expert bias ({warm})", "moe_ep1_bias", "ratio_moe_ep1_bias_over_dense")]
    if "moe_frozen" in t:
        rows += [("dense, lr 1e-12 (the frozen rows' twin)", "dense_frozen", None),
                 (f"MoE, ep={n}, routing frozen at initialisation (lr 1e-12)", "moe_frozen",
                  "ratio_moe_frozen_over_dense"),
                 ("MoE, ep=1, routing frozen at initialisation (lr 1e-12)", "moe_ep1_frozen",
                  "ratio_moe_ep1_frozen_over_dense")]
    for name, key, ratio in rows:
        r = t[key]
        formula = f"{t['formula_all_to_all_v_bytes'] / MiB:.3f}" if key == "moe" else "–"
        now = f"{t[ratio]:.2f}x" if ratio else "1"
        was = f"{before[ratio]:.2f}x" if ratio and ratio in before else "–"
        load = f"{r['load_imbalance']:.2f}" if r.get("load_imbalance") is not None else "–"
        sent = f"{r['all_to_all_v_bytes'] / MiB:.3f}" if "all_to_all_v_bytes" in r else "–"
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {1e3 * r['step_s']:.0f} | {now} | {was} | {load} | "
                     f"{r['params_per_rank']:,} | {r['active_params']:,} | {sent} | {formula} |")
    lines += ["", "Load balance (E=8, top_k=2, ep=4): max / mean tokens per expert of the worst MoE layer.", "",
              "| aux loss alpha | expert bias rate | step 0 | mean of the last 10 steps | steps | loss (last 10) |",
              "|---:|---:|---:|---:|---:|---:|"]
    for b in d["balance"]:
        lines.append(f"| {b['alpha']} | {b.get('bias_rate', 0.0)} | {b['imbalance_first']:.2f} | "
                     f"{b['imbalance_last10']:.2f} | {b['steps']} | "
                     f"{b['loss_last10']:.3f} |")
    return lines


def _varlen(d: dict) -> list[str]:
    """bench/varlen.py: lengths, the three layouts, attention time vs FLOPs, dp and cp balance."""
    m, t = d["meta"], d["training"]
    c = d["lengths"]["corpus"]
    rows = {r["layout"]: r for r in t["rows"]}
    pareto = next(b for b in d["balance"] if b["case"] != "corpus")
    return [f"corpus: {c['documents']} documents, median {c['median']:,.0f}, p99 {c['p99']:,.0f}, "
            f"max {c['max']:,} bytes; {c['share_documents_below_block']:.0%} of documents, "
            f"{c['share_tokens_below_block']:.2%} of tokens shorter than T = {m['block']}",
            "useful tokens/s vs packed + masked: " + ", ".join(
                f"{n} {rows[n]['tokens_per_s_vs_packed']:.2f}x" for n in ("padded", "stream"))
            + "; eval loss (masked val windows) "
            + ", ".join(f"{n} {r['eval_loss_masked']:.3f}" for n, r in rows.items())
            + f" (data-order spread {t['seed_spread']:.3f})",
            "document / dense causal attention, forward + backward: " + ", ".join(
                f"{a['case']} {a['forward_backward']['time_ratio']:.2f}x time at {a['flop_ratio']:.2f}x FLOPs"
                for a in d["attention"]) + " (all windows: " + ", ".join(
                f"{b['case']} {b['flop_ratio_all_windows']:.2f}x FLOPs" for b in d["balance"]) + ")",
            f"attention work max/mean per rank ({pareto['case']}): " + ", ".join(
                f"dp={dp} {pareto[f'dp{dp}']['today_mean']:.2f} today, {pareto[f'dp{dp}']['greedy_mean']:.2f} balanced"
                for dp in (4, 8))] + _varlen_cp(d)


def _varlen_cp(d: dict) -> list[str]:
    """Part 4's summary line (absent from results before it existed)."""
    if "cp_balance" not in d:
        return []
    b = next(b for b in d["cp_balance"] if b["case"] != "corpus")
    line = (f"ring cp unmasked pairs max/mean per rank ({b['case']}), token-zigzag -> work-balanced: " + ", ".join(
        f"cp={cp} {b[f'cp{cp}']['zigzag_work_mean']:.3f} -> {b[f'cp{cp}']['balanced_work_mean']:.3f}"
        for cp in (2, 4, 8)) + "; computed score elements " + ", ".join(
        f"{b[f'cp{cp}']['zigzag_box_mean']:.3f} -> {b[f'cp{cp}']['balanced_box_mean']:.3f}" for cp in (2, 4, 8)))
    if "busiest_now_over_before" in b["cp2"]:            # boxes per row and chunk (results after they existed)
        line += ("; busiest rank's computed elements vs one box per block on zigzag " + ", ".join(
            f"{b[f'cp{cp}']['busiest_now_over_before']:.2f}x" for cp in (2, 4, 8)))
    if "ring_timing" in d:
        r = d["ring_timing"]
        line += (f"; ring forward + backward on {r['ranks']} ranks, balanced / zigzag time {r['time_ratio']:.2f}x "
                 f"({r['cores']} cores)")
    return [line]


def _sparse_embedding(d: dict) -> list[str]:
    """bench/sparse_embedding.py: wte bytes dense -> sparse, measured vs formula, times."""
    return [f"wte sync bytes per rank per step, dp={d['world']}, V={c['vocab']:,}, {c['tokens_per_rank']} tokens/rank "
            f"({c['share_of_rows']:.1%} of rows touched): dense {c['wte_bytes_dense'] / 1e6:.2f} MB -> sparse "
            f"{c['wte_bytes_sparse'] / 1e6:.3f} MB ({c['ratio_measured']:.3f}x; formula {c['ratio_formula']:.3f}x); "
            f"sync time {c['sync_ratio']:.2f}x, step {c['time_ratio']:.2f}x" for c in d["cases"]] + _sparse_ps(d)


def _sparse_ps(d: dict) -> list[str]:
    """The parameter-server part's summary line (absent from results before it existed)."""
    if "ps" not in d:
        return []
    p = d["ps"]
    return [f"parameter servers ({p['workers']} workers + 1 server, V={p['vocab']:,}, {p['steps']} steps): bytes "
            f"pushed + pulled per worker per step {p['bytes_dense'] / 1e6:.2f} MB (whole wte) -> "
            f"{p['bytes_sparse'] / 1e6:.2f} MB (its rows), {p['ratio']:.3f}x; wte's {p['wte_bytes_dense'] / 1e6:.2f} "
            f"-> {p['wte_bytes_sparse'] / 1e6:.3f} MB ({p['wte_ratio_measured']:.3f}x; formula "
            f"{p['wte_ratio_formula']:.3f}x), a step before the last {p['wte_formula_sparse_step'] / 1e6:.3f} MB; "
            f"step {p['time_ratio']:.2f}x"]


def _sparse_embedding_table(d: dict) -> list[str]:
    lines = [f"Untied GPT (`model.tie_embeddings = false`), {d['n_layer']} layers x {d['n_embd']}, block "
             f"{d['block_size']}, {d['dtype']}, micro-batches of {d['micro_batch_size']} windows, dp = {d['world']}, "
             "Zipf-distributed token ids; `train.sparse_embedding = never` (dense, in the buckets) vs `auto` (pairs). "
             "Bytes per rank per step from the communicators' counters; formulas: dense 2 (n-1)/n V C s, sparse "
             "(n-1)/n sum_r k_r (C s + 8). Times: best of interleaved rounds, noisy on a shared machine.", "",
             "| V | tokens/rank | rows touched | wte dense MB | wte sparse MB | measured | formula | all grads MB "
             "dense -> sparse | sync time | step time |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in d["cases"]:
        lines.append(f"| {c['vocab']:,} | {c['tokens_per_rank']} | {c['rows_touched_per_rank']:.0f} "
                     f"({c['share_of_rows']:.1%}) | {c['wte_bytes_dense'] / 1e6:.2f} | "
                     f"{c['wte_bytes_sparse'] / 1e6:.3f} | {c['ratio_measured']:.3f}x | {c['ratio_formula']:.3f}x | {c['grad_bytes_dense'] / 1e6:.1f} -> "
                     f"{c['grad_bytes_sparse'] / 1e6:.1f} | {c['sync_ratio']:.2f}x | {c['time_ratio']:.2f}x |")
    if "ps" in d:
        p = d["ps"]
        lines += ["", f"Parameter servers: the same model, V = {p['vocab']:,}, {p['workers']} workers (dp = "
                  f"{p['workers']}, {p['tokens_per_worker']} tokens each per step) + 1 synchronous server, "
                  f"{p['steps']} steps per run. Before (`never`): every worker pushes and pulls the whole wte; now "
                  "(`auto`): its k touched rows up, the k' rows of its next step down, the whole table at the run's "
                  "last pull (parallel/ps/wire.py). Bytes per worker per step from the server's counters (in + out "
                  "/ workers) and wte's row messages (`RowRoutes.bytes`; the dense wte = the dense total minus the "
                  "sparse run's other bytes); formulas: dense 2 V C s, sparse 8 (2 + k + k') + (k + k') C s per "
                  "step (the last: 8 (2 + k) + k C s + V C s), with the measured distinct ids.", "",
                  "| V | rows touched | all bytes MB before -> now | wte MB before -> now | measured | formula | "
                  "a step before the last, formula MB | step time |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {p['vocab']:,} | {p['rows_touched_per_worker']:.0f} | {p['bytes_dense'] / 1e6:.2f} -> "
                  f"{p['bytes_sparse'] / 1e6:.2f} ({p['ratio']:.3f}x) | {p['wte_bytes_dense'] / 1e6:.2f} -> "
                  f"{p['wte_bytes_sparse'] / 1e6:.3f} | {p['wte_ratio_measured']:.3f}x | {p['wte_ratio_formula']:.3f}x "
                  f"| {p['wte_formula_sparse_step'] / 1e6:.3f} | {p['time_ratio']:.2f}x |"]
    return lines


def _varlen_table(d: dict) -> list[str]:
    m, t = d["meta"], d["training"]
    lines = [f"One process, float32, {m['corpus']}; block_size T = {m['block']}. Length distributions "
             f"(tokens = bytes; Pareto: a synthetic stream, alpha {m['pareto_alpha']:g}, smallest length "
             f"{m['pareto_xm']}):", "",
             "| lengths | documents | median | p90 | p99 | max | documents < T | tokens in documents < T |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in d["lengths"].items():
        lines.append(f"| {name} | {c['documents']:,} | {c['median']:,.0f} | {c['p90']:,.0f} | {c['p99']:,.0f} | "
                     f"{c['max']:,} | {c['share_documents_below_block']:.1%} | {c['share_tokens_below_block']:.2%} |")
    lines += ["", f"1. Training, GPT {m['layers']} x {m['embd']} ({m['heads']} heads), {m['steps']} steps of "
              f"{m['batch']} windows, AdamW lr {m['lr']:g} on a cosine to 0, the same initial weights; each layout "
              f"trained on {len(t['data_seeds'])} data orders (seeds {', '.join(map(str, t['data_seeds']))}), all "
              "runs in lockstep (one step of each in turn). packed: `data.packing = \"documents\"`; padded: one "
              f"document piece per window (documents cut into T pieces, padded with target -100; "
              f"{t['padding_fill']:.1%} of the slots of an epoch's {t['pieces']:,} pieces are real tokens); stream: "
              "`data.packing = \"none\"`, the same windows as packed. Useful tokens = targets in the loss (document "
              "boundary targets excluded in every layout); tokens/s = mean useful tokens per step / median step "
              f"time (forward, backward, AdamW). Eval: every model on the same {t['eval_windows']} validation "
              "windows, packed and masked (each document scored alone), and unmasked; the mean over the data "
              f"orders. The eval loss moves by up to {t['seed_spread']:.3f} with the data order alone: differences "
              "below that are noise."
              + (f" The packed path itself, on windows with no document start inside (the same batch with and "
                 f"without its Documents, forward + backward, best of {m['rounds']} interleaved rounds): "
                 f"{t['packed_path_whole_windows']:.2f}x the plain time (positions gathered from wpe per token, "
                 "and scattered back in backward, instead of one slice)." if "packed_path_whole_windows" in t
                 else ""), "",
              "| layout | useful tokens/s | vs packed | useful tokens / step | step ms | train loss (last 5) | "
              "eval loss, masked | per data order | eval loss, unmasked |",
              "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in t["rows"]:
        lines.append(f"| {r['layout']} | {r['useful_tokens_per_s']:,.0f} | {r['tokens_per_s_vs_packed']:.2f} | "
                     f"{r['useful_tokens_per_step']:,.0f} | {1e3 * r['step_s_median']:.0f} | "
                     f"{r['final_train_loss']:.3f} | "
                     f"{r['eval_loss_masked']:.3f} | {', '.join(f'{x:.3f}' for x in r['eval_loss_masked_per_seed'])} | "
                     f"{r['eval_loss_unmasked']:.3f} |")
    rows = {r["layout"]: r for r in t["rows"]}
    losses = [r["eval_loss_masked"] for r in t["rows"]]
    corpus = next(b for b in d["balance"] if b["case"] == "corpus")
    lines += ["", f"Reading: in byte tokens the standard library's files are mostly longer than T (median "
              f"{d['lengths']['corpus']['median']:,.0f}), so padding fills {t['padding_fill']:.1%} of its slots and "
              f"only {corpus['share_windows_cut']:.0%} of packed windows hold a document start: the three layouts' "
              f"eval losses lie within {max(losses) - min(losses):.3f} of each other, "
              + ("inside" if max(losses) - min(losses) <= t["seed_spread"] else "outside")
              + f" the data-order spread ({t['seed_spread']:.3f}), and packed + masked trains at "
              f"{1 / rows['stream']['tokens_per_s_vs_packed']:.2f}x the stream's useful tokens/s and "
              f"{1 / rows['padded']['tokens_per_s_vs_packed']:.2f}x padding's: its path's own cost, not yet paid "
              "back by attention work on this corpus. Where documents are short (the Pareto rows below) the "
              "attention work halves and its spread over dp ranks appears."]
    a0 = d["attention"][0]
    lines += ["", f"2. Attention on the same [B, T, 3C] input (B = {a0['B']}, T = {a0['T']}, C = {a0['C']}, "
              f"H = {a0['H']}, float32): `document_attention` (segments of equal length batched through the CPU "
              "causal kernels) vs `causal_attention` (dense causal), best of "
              f"{m['rounds']} interleaved rounds. FLOPs: 4 D H per (query, key) pair forward, 12 D H forward + "
              "backward; dense T (T + 1)/2 pairs per row and head, documents sum len_i (len_i + 1)/2. Windows "
              "without a document start go to the dense kernel itself: there the ratio measures the noise. Over "
              "all the windows of part 3, document attention's FLOPs are " + ", ".join(
                  f"{b['flop_ratio_all_windows']:.2f}x dense ({b['case']}; {b['share_windows_cut']:.0%} of the "
                  "windows hold a document start)" for b in d["balance"]) + ".", "",
              "| lengths | segments (distinct lengths) | pass | dense ms | documents ms | time ratio | dense GFLOP | "
              "documents GFLOP | FLOP ratio |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for a in d["attention"]:
        for mode, label in (("forward", "forward"), ("forward_backward", "forward + backward")):
            x = a[mode]
            lines.append(f"| {a['case']} | {a['segments']} ({a['distinct_lengths']}) | {label} | "
                         f"{1e3 * x['dense_s']:.1f} | {1e3 * x['documents_s']:.1f} | {x['time_ratio']:.2f} | "
                         f"{x['dense_gflop']:.2f} | {x['documents_gflop']:.2f} | {a['flop_ratio']:.2f} |")
    lines += ["", "Time above the FLOP ratio: document attention calls the causal kernels once per distinct segment "
              "length (" + ", ".join(f"{a['distinct_lengths']} for {a['case']}" for a in d["attention"])
              + ") on small batches, and copies each group's q, k, v in and its output (and gradient) out; and the "
              "CPU kernels score a block of 64 queries against the keys up to the block's end, so a segment of "
              "L <= 64 tokens costs L^2 pairs, up to twice its L (L + 1)/2 (the dense kernel's extra, 32 per query, "
              "is 6% of T/2 at T = 1024)."]
    b0 = d["balance"][0]
    lines += ["", f"3. Data-parallel balance of attention work (sum over a rank's windows' segments of "
              f"len (len + 1)/2), a global batch of {b0['global_batch']} packed windows over {b0['steps']} steps, 2 "
              "micro-batches per rank. today: windows dealt in sample-id order (`corpus.microbatch_sample_ids`); "
              "balanced: `data.balance = attention` (largest window first to the least loaded rank with room, then "
              "onto its micro-batches; `hpcpar.data.balance`). Tokens are balanced either way (every packed window "
              "holds T tokens).", "",
              "| lengths | dp | max/mean today (mean over steps) | worst step | data.balance=attention | worst step |",
              "|---|---:|---:|---:|---:|---:|"]
    for b in d["balance"]:
        for dp in (4, 8):
            x = b[f"dp{dp}"]
            lines.append(f"| {b['case']} | {dp} | {x['today_mean']:.2f} | {x['today_worst']:.2f} | "
                         f"{x['greedy_mean']:.2f} | {x['greedy_worst']:.2f} |")
    if "cp_balance" in d:
        c0 = d["cp_balance"][0]
        lines += ["", f"4. Context-parallel (ring attention) balance, {c0['micro_batches']} micro-batches of "
                  f"{c0['micro_batch']} packed windows: 2cp chunks two per rank, before: token-zigzag (rank r: "
                  "chunks r and 2cp-1-r), now: dealt by attention work (`hpcpar.parallel.cp.balance`: chunks by "
                  "unmasked pairs, the lightest with the heaviest). Pairs: unmasked (query, key) pairs per rank "
                  "(what `ContextParallel.stats` counts, and what the dealing balances); computed: score elements "
                  "the rank's ring blocks compute (what the kernels multiply): now a box per row of the "
                  "micro-batch and (my chunk, its chunk) of a block, the smallest holding that piece's pairs "
                  "(`cp.attention._Block`); before: one box per block, over all rows and both chunks. max/mean "
                  "over the ranks, mean (worst) over the micro-batches. elements / pairs: all ranks' computed "
                  "elements over their pairs, before (one box, zigzag) and now (boxes per piece, balanced); "
                  "busiest: the busiest rank's elements, now over before (sum over the micro-batches). Pure "
                  "arithmetic, no MPI.", "",
                  "| lengths | cp | re-dealt | pairs zigzag | pairs balanced | computed zigzag | computed balanced "
                  "| one box: zigzag | one box: balanced | elements / pairs before -> now | busiest now / before |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for b in d["cp_balance"]:
            for cp in (2, 4, 8):
                x = b[f"cp{cp}"]
                shared = (f"{x['zigzag_shared_box_mean']:.3f} | {x['balanced_shared_box_mean']:.3f} | "
                          f"{x['shared_box_over_pairs']:.2f} -> {x['box_over_pairs']:.2f} | "
                          f"{x['busiest_now_over_before']:.2f}" if "busiest_now_over_before" in x
                          else "– | – | – | –")
                lines.append(f"| {b['case']} | {cp} | {x['changed']:.0%} | {x['zigzag_work_mean']:.3f} "
                             f"({x['zigzag_work_worst']:.2f}) | {x['balanced_work_mean']:.3f} "
                             f"({x['balanced_work_worst']:.2f}) | {x['zigzag_box_mean']:.3f} "
                             f"({x['zigzag_box_worst']:.2f}) | {x['balanced_box_mean']:.3f} "
                             f"({x['balanced_box_worst']:.2f}) | {shared} |")
    if "ring_timing" in d:
        r = d["ring_timing"]
        lines += ["", f"Ring attention forward + backward, timed ({r['case']}, B = {r['batch']}, T = {r['block']}, "
                  f"C = {r['embd']}, H = {r['heads']}, float32): `mpiexec -n {r['ranks']}` on {r['cores']} cores "
                  f"(oversubscribed; load average {r['load_average'][0]:.1f} -> {r['load_average'][1]:.1f}), the "
                  f"first {len(r['rows'])} micro-batches the balance re-deals at cp = {r['ranks']}, token-zigzag "
                  f"vs balanced layout (both with boxes per piece), best of {r['rounds']} interleaved rounds; time "
                  "of the slowest rank. elements: the ranks' computed elements, max/mean.", "",
                  "| micro-batch | zigzag ms | balanced ms | balanced / zigzag | elements zigzag | elements balanced |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {x['micro_batch']} | {1e3 * x['zigzag_s']:.1f} | {1e3 * x['balanced_s']:.1f} | "
                  f"{x['time_ratio']:.2f} | {x['zigzag_elements_max_over_mean']:.3f} | "
                  f"{x['balanced_elements_max_over_mean']:.3f} |" for x in r["rows"]]
        lines.append(f"| all | {1e3 * sum(x['zigzag_s'] for x in r['rows']):.1f} | "
                     f"{1e3 * sum(x['balanced_s'] for x in r['rows']):.1f} | {r['time_ratio']:.2f} | | |")
    return lines


def _step_overhead(d: dict) -> list[str]:
    out = []
    for r in d["rows"]:
        old, new = r["before"]["ops_per_step"], r["after"]["ops_per_step"]
        out.append(f"{r['mesh']}: step {1e3 * r['before']['step_s']:.1f} -> {1e3 * r['after']['step_s']:.1f} ms "
                   f"({r['speedup']:.2f}x); world collectives/step {sum(old['world'].values()):g} -> "
                   f"{sum(new['world'].values()):g}; tp all-reduces/step {old['tp'].get('all_reduce', 0):g} -> "
                   f"{new['tp'].get('all_reduce', 0):g}")
    return out


def _step_overhead_table(d: dict) -> list[str]:
    m = d["model"]
    lines = [f"`mpiexec -n 4 python bench/step_overhead.py`: GPT n_layer={m['n_layer']} n_embd={m['n_embd']} "
             f"T={m['block_size']}, micro-batch {m['batch']} x {m['microbatches']}, {m['dtype']}, dropout "
             f"{m['dropout']}. Before: the step as it was before issue #20, emulated in the same run (four world "
             "collectives per step; the sequence-parallel gradients all-reduced over tp at every use, "
             "`DataParallel.tp_sum_per_step = False`); after: one world all-gather and one tp all-reduce of those "
             "gradients per step ([parallelism.md](parallelism.md#sequence-parallelism)). Step: wall time of a "
             "loop iteration of the slowest rank, median over the timed steps, best of alternating rounds; ops: "
             "per rank and step.", "",
             "| mesh | variant | step ms | world ops | tp all-reduce | tp all-gather | dp ops | loss rel. diff |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        for variant in ("before", "after"):
            v = r[variant]
            ops = v["ops_per_step"]
            lines.append(f"| {r['mesh']} | {variant} | {1e3 * v['step_s']:.2f} | {sum(ops['world'].values()):g} | "
                         f"{ops['tp'].get('all_reduce', 0):g} | {ops['tp'].get('all_gather', 0):g} | "
                         f"{sum(ops['dp'].values()):g} | "
                         + (f"{r['loss_rel_diff']:.1e} |" if variant == "after" else "– |"))
    return lines


_RATES = ("100mbit", "1gbit", "10gbit", None)
_RATE_TEXT = {"100mbit": "100 Mb/s", "1gbit": "1 Gb/s", "10gbit": "10 Gb/s", None: "unshaped"}
_RATE_GBPS = {"100mbit": 0.1, "1gbit": 1.0, "10gbit": 10.0}


def _cluster_lstar(x) -> str:
    return "–" if x is None else x if isinstance(x, str) else f"{x:.2f}"


def _cluster(d: dict) -> list[str]:
    """bench/cluster.py: one line per section that ran."""
    if "skipped" in d:
        return [f"skipped: {d['skipped']}"]
    out = []
    col = d.get("collectives", {})
    if col.get("rows"):
        size = max(col["sizes_mib"]) * MiB
        ar = {r["rate"]: r for r in col["rows"] if r["op"] == "all_reduce" and r["nodes"] == 2 and r["bytes"] == size}
        parts = [f"{_RATE_TEXT[rate]} {ar[rate]['busbw_gbps']:.2f}" + (
            f" ({ar[rate]['busbw_gbps'] / _RATE_GBPS[rate]:.0%})" if rate in _RATE_GBPS else "")
            for rate in _RATES if rate in ar]
        ratios = [x for t in col["traffic"] for x in t["sent_over_expected"].values()]
        out.append(f"all-reduce {size // MiB} MiB across 2 nodes, busbw Gb/s (of the link): " + ", ".join(parts)
                   + f"; eth0 bytes {min(ratios):.2f}-{max(ratios):.2f}x the ring volume")
    elif "error" in col:
        out.append(f"collectives: failed ({col['error'][:200]})")
    paths = d.get("allreduce_paths", {})
    if paths.get("rows"):
        at = [r for r in paths["rows"] if r["nodes"] == 4 and r["rate"] == "1gbit"]
        size = max(r["bytes"] for r in at) if at else None
        out.append(f"all-reduce {size // MiB if size else '?'} MiB on 4 nodes at 1 Gb/s, share of the link: " + ", ".join(
            f"{r['path']} {r['share_of_link']:.0%}" for r in at if r["bytes"] == size))
    tp = d.get("tp_placement", {})
    if tp.get("rows"):
        across = [r for r in tp["rows"] if r["placement"] == "across"]
        out.append("dp=2 x tp=2 on 2x2, tp across nodes / tp inside: " + ", ".join(
            f"{_RATE_TEXT[r['rate']]} {r['vs_inside']:.2f}x" for r in sorted(across, key=lambda r: _RATES.index(r["rate"]))))
    elif "error" in tp:
        out.append(f"tp placement: failed ({tp['error'][:200]})")
    comp = d.get("compression", {})
    if comp.get("verdicts"):
        out.append("compression beats none (dp=2 across 2 nodes): " + "; ".join(
            f"{v['kind']} {v['measured'].split(' (')[0]} (predicted L* {_cluster_lstar(v['predicted_lstar_gbps'])} Gb/s)"
            for v in comp["verdicts"]))
    elif "error" in comp:
        out.append(f"compression: failed ({comp['error'][:200]})")
    ps = d.get("ps", {})
    if ps.get("rows"):
        parts = []
        for rate in ps["rates"]:
            cells = [f"{r['mode']}{'' if r['straggler'] == 'none' else ' (straggler)'} {r['vs_allreduce']:.2f}x"
                     for r in ps["rows"] if r["rate"] == rate and r["mode"] in ("sync", "async")]
            parts.append(f"{_RATE_TEXT[rate]}: " + ", ".join(cells))
        out.append("PS (1 server) tokens/s vs all-reduce, 3 workers: " + "; ".join(parts))
    elif "error" in ps:
        out.append(f"parameter server: failed ({ps['error'][:200]})")
    plan = d.get("plan", {})
    if plan.get("rows"):
        out.append(f"hpcpar plan calibrated on 2x2 at {_RATE_TEXT[plan['rate']]}: first choice "
                   f"{'is' if plan['first_choice_is_fastest'] else 'is not'} the fastest measured "
                   f"({plan['first_choice_gap']:+.0%}), median |error| {plan['median_abs_error']:.0%}, "
                   f"Spearman {plan['spearman']:.2f} over {len(plan['rows'])} meshes")
    elif "error" in plan:
        out.append(f"plan: failed ({plan['error'][:200]})")
    return out


def _cluster_table(d: dict, docs_path: Path | None) -> list[str]:
    """bench/cluster.py's sections as tables, with its two plots."""
    if "skipped" in d:
        return [f"Skipped: {d['skipped']}."]
    m = d["meta"]
    lines = ["`python bench/cluster.py` (root): a cluster of node namespaces on this machine "
             "(tests/cluster/harness.py: per node a network namespace with its own eth0 on a bridge, hostname and "
             "/tmp), ranks launched across them with MPICH's hydra (inter-node bytes over TCP on eth0, ranks of one "
             "node through shared memory), links shaped with tbf on both ends (no netem here: latency is not "
             f"shaped). **Every node shares this machine's {m['cores']} cores**: compute does not grow with nodes, "
             "only the link is real; figures are about bandwidth, and the absolute times are those of ranks sharing "
             f"2 cores (load average {m['load_average_start'][0]:.1f} at the start). {m['mpi']}; run took "
             f"{m['wall_s']:.0f} s. How far these figures moved over several runs, and what they change in the "
             "advice: [tuning.md](tuning.md#across-nodes-what-benchclusterpy-measured)."]
    col = d.get("collectives", {})
    if col.get("rows"):
        rates = [r for r in _RATES if any(x["rate"] == r for x in col["rows"])]
        lines += ["", "**Collectives across nodes**, one rank per node, through hpcpar's Communicator (float32); "
                  "time = the slowest rank's, median of 3-8 repeats; busbw = algbw x 2(n-1)/n (all-reduce) or (n-1)/n "
                  "(all-gather, reduce-scatter; bytes = the full result), in Gb/s, with the share of the link's rate:", "",
                  "| op | nodes | MiB | " + " | ".join(_RATE_TEXT[r] for r in rates) + " |",
                  "|---|---:|---:|" + "---:|" * len(rates)]
        keys = sorted({(r["op"], r["nodes"], r["bytes"]) for r in col["rows"]},
                      key=lambda k: (col["ops"].index(k[0]), k[1], k[2]))
        by = {(r["op"], r["nodes"], r["bytes"], r["rate"]): r for r in col["rows"]}
        for op, n, size in keys:
            cells = []
            for rate in rates:
                r = by.get((op, n, size, rate))
                cells.append("–" if r is None else f"{r['busbw_gbps']:.3f}" + (
                    f" ({r['busbw_gbps'] / _RATE_GBPS[rate]:.0%})" if rate in _RATE_GBPS else ""))
            lines.append(f"| {op} | {n} | {size // MiB} | " + " | ".join(cells) + " |")
        lines += ["", "Bytes on eth0 during each launch (`Cluster.traffic`) against the ring volume its calls imply "
                  "(factor x bytes per call, summed over the timed calls and a 1 MiB warm-up all-reduce):", "",
                  "| nodes | link | expected MiB sent per node | sent / expected | received / expected |",
                  "|---:|---|---:|---|---|"]
        for t in col["traffic"]:
            s, r = list(t["sent_over_expected"].values()), list(t["received_over_expected"].values())
            lines.append(f"| {t['nodes']} | {_RATE_TEXT[t['rate']]} | {t['expected_sent_per_node'] / MiB:.1f} | "
                         f"{min(s):.3f}-{max(s):.3f} | {min(r):.3f}-{max(r):.3f} |")
        shaped = [r for r in col["rows"] if r["rate"] in _RATE_GBPS]
        over = sorted({(r["op"], r["nodes"], r["bytes"] // MiB, r["rate"]) for r in shaped
                       if r["busbw_gbps"] > _RATE_GBPS[r["rate"]]})
        notes = []
        for n in col["nodes"]:
            free = [r["busbw_gbps"] for r in col["rows"] if r["rate"] is None and r["nodes"] == n]
            if free:
                notes.append(f"Unshaped, {n} nodes' veth pairs moved {min(free):.1f}-{max(free):.1f} Gb/s of bus "
                             "bandwidth (what this machine's CPUs carry through TCP and the bridge)"
                             + (": below the 10 Gb/s limit, so there the 10 Gb/s column measures the CPUs (and tbf's "
                                "own cost), not the link" if max(free) < 10 and any(r["rate"] == "10gbit" for r in shaped)
                                else ""))
        if over:
            notes.append("Above the link's rate: " + ", ".join(f"{op} {n} nodes {mib} MiB at {_RATE_TEXT[rate]}"
                                                             for op, n, mib, rate in over)
                         + ": a message that fits in tbf's bucket (burst: 1 ms of the rate, at least 64 KiB) "
                         "passes at the veth's own speed")
        for n in sorted({r["nodes"] for r in shaped}):
            share = {op: [r["busbw_gbps"] / _RATE_GBPS[r["rate"]] for r in shaped if r["nodes"] == n and r["op"] == op
                          and r["rate"] in ("100mbit", "1gbit") and r["bytes"] >= 8 * MiB] for op in col["ops"]}
            if all(share.values()):
                notes.append(f"{n} nodes at 100 Mb/s and 1 Gb/s, 8 MiB and up: " + ", ".join(
                    f"{op} {min(v):.0%}-{max(v):.0%}" for op, v in share.items()) + " of the link")
        if notes:
            lines += ["", ". ".join(notes) + "."]
        png = next((p for p in d.get("plots", []) if p.endswith("cluster.png")), None)
        if png:
            lines += ["", f"![collectives across nodes]({_link(png, docs_path)})"]
    elif "error" in col:
        lines += ["", f"Collectives: failed: {col['error']}"]
    paths = d.get("allreduce_paths", {})
    if paths.get("rows"):
        cases = list(dict.fromkeys((r["nodes"], r["rate"], r["bytes"]) for r in paths["rows"]))
        by = {(r["path"], r["nodes"], r["rate"], r["bytes"]): r for r in paths["rows"]}
        lines += ["", "**All-reduce paths across nodes**, one rank per node, the paths alternating in one launch: "
                  "hpcpar's all_reduce waiting inside MPI (it runs MPI's Allreduce: where ranks do not share cores) "
                  "and polled (its split, a reduce-scatter then an all-gather: where they do, `HPCPAR_MPI_WAIT=poll`), "
                  f"raw mpi4py next to them; busbw Gb/s (share of the link), {paths['time']}.", "",
                  "| path | " + " | ".join(f"{n} nodes, {_RATE_TEXT[rate]}, {b // MiB} MiB" for n, rate, b in cases)
                  + " |", "|---|" + "---:|" * len(cases)]
        for path in paths["paths"]:
            cells = [by.get((path, *c)) for c in cases]
            lines.append(f"| {path} | " + " | ".join("–" if r is None else f"{r['busbw_gbps']:.3f} "
                                                     f"({r['share_of_link']:.0%})" for r in cells) + " |")
    elif "error" in paths:
        lines += ["", f"All-reduce paths: failed: {paths['error']}"]
    tp = d.get("tp_placement", {})
    if tp.get("rows"):
        p = tp["placements"]
        lines += ["", f"**tp inside nodes against tp across nodes**: `hpcpar train` on 2 nodes x 2 ranks, "
                  f"{tp['mesh']}, " + " ".join(tp["model"]) + f", micro-batch {tp['batch_per_replica']} per replica, "
                  f"{tp['steps']} steps, {tp.get('rounds', 1)} round(s); step = "
                  + tp.get("step", "median of metrics.jsonl's step_time_s") + f" (metrics.jsonl's step_time_s after "
                  f"{tp['warm_up']} warm-up steps); eth0 = the launch's bytes sent by the busier node / steps. Inside: hydra's default "
                  f"placement (`-hosts {p['inside']['argv_hosts']}`), `hpcpar info --dp 2 --tp 2`: \"every tp group "
                  f"inside one node: {'yes' if p['inside']['every_tp_group_inside_one_node'] else 'NO'}\"; across: "
                  f"`-hosts {p['across']['argv_hosts']}` (hydra wraps round): \"every tp group inside one node: "
                  f"{'yes' if p['across']['every_tp_group_inside_one_node'] else 'NO'}\".", "",
                  "| link | tp inside ms | tp across ms | across / inside | eth0 MiB/step inside | across |",
                  "|---|---:|---:|---:|---:|---:|"]
        by = {(r["placement"], r["rate"]): r for r in tp["rows"]}
        for rate in (r for r in _RATES if ("inside", r) in by):
            i, a = by[("inside", rate)], by[("across", rate)]
            lines.append(f"| {_RATE_TEXT[rate]} | {1e3 * i['step_s']:.0f} | {1e3 * a['step_s']:.0f} | "
                         f"{a['vs_inside']:.2f}x | {i['link_sent_per_step'] / MiB:.2f} | "
                         f"{a['link_sent_per_step'] / MiB:.2f} |")
    elif "error" in tp:
        lines += ["", f"tp placement: failed: {tp['error']}"]
    comp = d.get("compression", {})
    if comp.get("rows"):
        rates = comp["rates"]
        by = {(r["kind"], r["rate"]): r for r in comp["rows"]}
        lines += ["", f"**Gradient compression on a slow link**: dp=2 across 2 nodes (one rank per node), the "
                  f"default model, global batch {comp['global_sequences']} sequences, error feedback on, compressing "
                  f"from the first step (timing runs, as bench/compression.py's); step (the slowest rank's) = "
                  + comp.get("step", "the best round's median") + f", {comp['rounds']} alternating rounds of "
                  f"{comp['steps']} steps after a warm-up step; a compressor beats none where its step is more than "
                  f"{comp.get('margin', 0):.0%} shorter. In brackets: "
                  "bench/compression.py's prediction from this run's unshaped row, t_c + S_c / L + "
                  f"{comp['alpha_us']:g} µs x messages.", "",
                  "| compressor | MiB/step/rank | " + " | ".join(f"{_RATE_TEXT[r]} ms" for r in rates) + " |",
                  "|---|---:|" + "---:|" * len(rates)]
        for k in comp["kinds"]:
            cells = []
            for rate in rates:
                r = by[(k, rate)]
                pred = f" ({1e3 * r['predicted_step_s']:.0f})" if "predicted_step_s" in r else ""
                cells.append(f"{1e3 * r['step_s']:.0f}{pred}" + ("" if k == "none" else f", {r['vs_none']:.2f}x"))
            lines.append(f"| {k} | {by[(k, rates[0])]['bytes_per_step'] / MiB:.3f} | " + " | ".join(cells) + " |")
        lines += ["", "Where each beats none, measured against predicted (L*: the link speed below which it wins by the "
                  "prediction; `compression.json`: the same prediction from bench/compression.py's dp=4 run on one "
                  "host):", "", "| compressor | beats none (measured) | predicted L* Gb/s, this run | "
                  "predicted L* Gb/s, compression.json |", "|---|---|---:|---:|"]
        for v in comp["verdicts"]:
            lines.append(f"| {v['kind']} | {v['measured']} | {_cluster_lstar(v['predicted_lstar_gbps'])} | "
                         f"{_cluster_lstar(v['reference_lstar_gbps'])} |")
    elif "error" in comp:
        lines += ["", f"Compression: failed: {comp['error']}"]
    ps = d.get("ps", {})
    if ps.get("rows"):
        lines += ["", f"**Parameter server against all-reduce across the link**: 2 nodes x 2 ranks, {ps['workers']} "
                  f"workers; {ps['placement']}. {ps['model']}; tokens/s over {ps['steps']} steps after a warm-up step "
                  "(the slowest rank's wall time); random straggler: at every step one worker 2x slower "
                  "(`run.debug_slow_ranks=random`, `run.debug_slow_factor=2`). eth0: bytes sent per step by the "
                  "busier node during the timed steps.", "",
                  "| link | mode | straggler | tokens/s | vs all-reduce | eth0 MiB/step |", "|---|---|---|---:|---:|---:|"]
        for r in ps["rows"]:
            lines.append(f"| {_RATE_TEXT[r['rate']]} | {r['mode']} | {r['straggler']} | {r['tokens_per_s']:,.0f} | "
                         f"{r['vs_allreduce']:.2f}x | {r['link_sent_per_step'] / MiB:.2f} |")
    elif "error" in ps:
        lines += ["", f"Parameter server: failed: {ps['error']}"]
    png = next((p for p in d.get("plots", []) if p.endswith("cluster_training.png")), None)
    if png:
        lines += ["", f"![training across nodes]({_link(png, docs_path)})"]
    plan = d.get("plan", {})
    if plan.get("rows"):
        c = plan["calibration"]
        scales = ", ".join(f"tp={k} {v:.2f}" for k, v in sorted(c.get("tp_scales", {}).items()))
        lines += ["", f"**hpcpar plan on the cluster**: `hpcpar plan --calibrate` launched with hydra on 2 nodes x 2 "
                  f"ranks at {_RATE_TEXT[plan['rate']]} ({plan['calibrate_wall_s']:.0f} s), then `{plan['cli']}` "
                  f"and the best plan of each mesh trained on the cluster (slowest rank's median step, best of "
                  f"{plan['rounds']} alternating rounds of {plan['steps']} steps). The calibration measured the "
                  f"all-reduce over the world: alpha {1e6 * c['intra']['alpha']:.0f} µs, beta "
                  f"{c['intra']['beta'] / 1e9:.2f} GB/s, stored as both the intra- and the inter-node link "
                  f"(ranks_per_node {c['ranks_per_node']}); fitted tp traffic scales {scales}.", "",
                  "| plan | predicted ms | measured ms | error | eth0 MiB/step |", "|---|---:|---:|---:|---:|"]
        for r in plan["rows"]:
            lines.append(f"| {r['layout']} | {1e3 * r['predicted_s']:.1f} | {1e3 * r['measured_s']:.1f} | "
                         f"{r['error']:+.0%} | {r['link_sent_per_step'] / MiB:.2f} |")
        lines += ["", f"First choice {plan['first_choice']}: "
                  + ("the fastest measured" if plan["first_choice_is_fastest"] else
                     f"{plan['first_choice_gap']:+.0%} from the fastest measured ({plan['fastest_measured']})")
                  + f"; median |error| {plan['median_abs_error']:.0%}, Spearman {plan['spearman']:.2f}; planned as one "
                  f"node of 4 (`--ranks 4`) the first choice is {plan['first_choice_as_one_node']}."]
    elif "error" in plan:
        lines += ["", f"Plan: failed: {plan['error']}"]
    for note in d.get("notes", []):
        lines += ["", note]
    return lines


def _resilience_cases(d: dict) -> dict:
    c = d.get("cluster") or {}
    return {k: v for k, v in (c.get("cases") or {}).items() if "steps_lost" in v}


RESILIENCE_CASES = {"ulfm": "a. ULFM shrink-and-continue", "requeue_shared": "b. requeue, shared checkpoint",
                    "requeue_node_local": "c. requeue, node-local snapshots"}


def _resilience(d: dict) -> list[str]:
    """bench/resilience.py: snapshot overhead at K = 1, 5, 20 and a node's loss three ways."""
    out = []
    o = d.get("overhead") or {}
    rows = [r for r in o.get("rows") or [] if r["every"]]
    if rows:
        noise = o["interleaved"]["none_noise"]
        out.append("partner snapshots on the default job vs none, interleaved in one launch: CPU per step "
                   + ", ".join(f"{r['name']} {r['overhead_cpu']:+.1%}" for r in rows) + "; wall per step "
                   + ", ".join(f"{r['name']} {r['overhead']:+.1%}" for r in rows)
                   + f" (none vs none: {noise:.1%}); snapshot work timed directly "
                   + ", ".join(f"{r['name']} {r['after_step_share']:.2%}" for r in rows)
                   + f" of a step (goal <= {o['goal']:.0%} at K=5)")
        sizes = rows[0]["bytes_per_snapshot_per_rank"]
        between = max((x.get("held_over_snapshot_between") or 0 for x in rows))
        out.append(f"one snapshot {sum(sizes) / len(sizes) / MiB:.2f} MiB per rank; host memory held {between:.1f}x "
                   "that between exchanges, "
                   f"{max(x['held_over_snapshot_max'] for x in rows):.1f}x during one")
    elif o.get("error"):
        out.append(f"overhead: failed: {o['error'][:200]}")
    cases = _resilience_cases(d)
    c = d.get("cluster") or {}
    if cases:
        out.append(f"node lost at step {c['fail_at']} (checkpoint every {c['checkpoint_every']}, snapshots every "
                   f"{c['memory_every']}): " + "; ".join(
                       f"{RESILIENCE_CASES.get(k, k).split('. ', 1)[1]} next step after "
                       f"{v['time_to_next_step_s']:.1f} s, {v['steps_lost']} steps lost" for k, v in cases.items()))
    elif c.get("skipped") or c.get("error"):
        out.append(f"cluster: {'skipped: ' + c['skipped'] if c.get('skipped') else 'failed: ' + c['error'][:200]}")
    return out


def _resilience_table(d: dict) -> list[str]:
    """bench/resilience.py: the overhead of partner snapshots, then a node's loss three ways."""
    m = d["meta"]
    load = m.get("load_average_start") or [0.0]
    lines = [f"`python bench/resilience.py` (root for the cluster part; {m.get('wall_s', 0) / 60:.0f} min on this "
             f"{m.get('cores')}-core machine, load average {load[0]:.1f} at the start from other work). Partner "
             "snapshots (`checkpoint.memory_every` = K): every K steps each rank copies its checkpoint state to host "
             "memory and sends it to a partner rank on the next node, the transfer completing behind the next step; "
             "`checkpoint.memory_dir` also writes them to a node-local directory (issue #42)."]
    o = d.get("overhead") or {}
    rows = o.get("rows") or []
    if rows:
        lane, sep = o["interleaved"], o["separate"]
        segments = lane["schedule"]["segments"]
        cycle = segments[:lane["schedule"].get("cycle", len(segments))]
        repeats = lane["schedule"].get("repeats", 1)
        lines += ["", f"**Overhead**: the default job (`mpiexec -n 4 hpcpar train`, {o['mesh'].split(' (')[0]}, "
                  "`run.eval_every=0`) through a wrapper that timestamps each loop iteration (step, snapshot work, "
                  "record) on every rank. *Interleaved*: one launch of "
                  f"{lane['steps']} steps with `checkpoint.memory_dir` on /dev/shm in which the wrapper sets the "
                  "cadence, and whether the node-local write happens, segment by segment after "
                  f"{lane['schedule']['warm'] - 1} warm-up steps: "
                  + " → ".join(f"{'none' if not k else f'K={k}' + ('' if level == 'memory' else ' + ' + level)} "
                               f"({n})" for k, level, n in cycle)
                  + (f", {repeats} times, then none" if repeats > 1 else "")
                  + "; each K segment's wall time per step against the mean of the none segments on either side (the "
                  "same load from other work; CPU: the same for the 4 ranks' CPU seconds), the median over its "
                  f"segments; consecutive none segments differed by {lane['none_noise']:.1%} (median): the noise. "
                  "*Separate launches*: `checkpoint.memory_every` set as a user would, "
                  f"{sep['steps']} steps, the last {sep['steps'] - sep['warm']} timed, alternating, best of "
                  f"{sep['rounds']} rounds: wall time per step / the median `step_time_s` of metrics.jsonl + the "
                  "snapshot work after the step (`step_time_s` times the step alone) / CPU seconds of the 4 ranks per "
                  "step. *Snapshot work*: the time inside `PartnerSnapshots.after_step` per step, as a share of "
                  f"none's step ({1e3 * rows[0]['step_s']:.0f} ms, the mean of its interleaved segments).", "",
                  "| K | vs none, interleaved: wall (CPU) | separate launches: wall / step + snapshot / CPU | "
                  "snapshot work | MiB/snapshot/rank | held: between / during an exchange | copy + pack ms | "
                  "exchange start ms | wait ms | write ms |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            s = r.get("separate")
            apart = "–" if not s or not r["every"] else (
                f"{s['overhead_step_s']:+.1%} / {s['overhead_step_plus_snapshot_s']:+.1%} / "
                f"{s['overhead_cpu_s_per_step']:+.1%}")
            if not r["every"]:
                continue
            t = r["seconds_per_snapshot"]
            size = sum(r["bytes_per_snapshot_per_rank"]) / len(r["bytes_per_snapshot_per_rank"])
            between = r.get("held_over_snapshot_between")
            lines.append(f"| {r['name']} | {r['overhead']:+.1%} ({r['overhead_cpu']:+.1%}) | {apart} | "
                         f"{r['after_step_share']:.2%} | {size / MiB:.2f} | "
                         f"{'–' if between is None else f'{between:.1f}x'} / {r['held_over_snapshot_max']:.1f}x | "
                         f"{1e3 * t['take']:.1f} | {1e3 * t['start']:.1f} | {1e3 * t['wait']:.1f} | "
                         + (f"{1e3 * t['write']:.1f} |" if r["level"] != "memory" else "– |"))
        k5 = next((r for r in rows if r["name"] == "K=5"), None)
        if k5:
            goal, noise = o["goal"], lane["none_noise"]
            verdict = ("met" if max(k5["overhead_cpu"], k5["after_step_share"]) <= goal else "not met")
            lines += ["", f"Goal <= {goal:.0%} at K=5: {verdict} by the CPU time ({k5['overhead_cpu']:+.1%}) and the "
                      f"snapshot work timed directly ({k5['after_step_share']:.2%} of a step); wall time "
                      f"{k5['overhead']:+.1%}, " + ("within" if abs(k5["overhead"]) <= noise else "outside")
                      + f" the noise of this machine ({noise:.1%} between neighbouring none segments). The CPU "
                      "seconds are what the snapshots add with a core per rank; the wall clock here also carries "
                      "the load of other work, and the separate launches' figures swing with it from launch to launch "
                      "(it changes by tens of percent within a minute here): they are kept for the record."]
        lines += ["", "Held: the host bytes a rank's snapshots take (its own snapshot, kept until the partner holds "
                  "the next; the partner's copy; during an exchange also the new snapshot and the receive buffer) over "
                  "one snapshot's. Per snapshot, mean over ranks of each rank's median: copy + pack = "
                  "`checkpoint_state()` copied to the host and packed into one buffer; exchange start = the size "
                  "handshake with the partner and posting the non-blocking send and receive; wait = completing them a "
                  "step later; write = the rank's own snapshot and its partner's copy written to /dev/shm."]
    elif o.get("error"):
        lines += ["", f"Overhead: failed: {o['error']}"]
    c = d.get("cluster") or {}
    cases = _resilience_cases(d)
    if cases:
        lines += ["", f"**A node lost**: the emulated cluster (tests/cluster/harness.py), {c['nodes']} nodes x "
                  f"{c['ranks_per_node']} ranks, mesh {c['mesh']}, the default model with "
                  + ", ".join(x for x in c["model"] if x.startswith("train.micro"))
                  + f", {c['steps']} steps; {c['lost']} SIGKILLed at the start of step s = {c['fail_at']} "
                  f"(`run.debug_fail_at`); `checkpoint.every={c['checkpoint_every']}`, snapshots every "
                  f"{c['memory_every']} steps (a, c). a: Open MPI 5 (`mpirun --with-ft ulfm`, TCP between all "
                  "ranks), `run.on_failure=shrink`; b, c: MPICH's hydra ends the job, relaunched at once with "
                  "`checkpoint.resume=auto` (no queue wait: a real requeue adds it). Time to the next step: from the "
                  "kill (its unix time on stderr) to the next completed step (b, c: the job's end + relaunch to its "
                  "first step); recompute: steps lost x the step time before the failure; back at s: measured until "
                  "step s is done again.", "",
                  "| case | time to next step s | of which | steps lost | step ms | recompute s | back at s after s |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        for k, v in cases.items():
            if k == "ulfm" and "before_first_step_s" in v:
                parts = (f"detect {v['detect_s']:.2f} + revoke, shrink, agree, reload {v['recovery_s']:.2f} + start "
                         f"of `Trainer.train` {v['before_first_step_s']:.2f} + the step "
                         f"{v['first_step_s'] - v['before_first_step_s']:.2f}")
            elif k == "ulfm":
                parts = (f"detect {v['detect_s']:.2f} + revoke, shrink, agree, reload {v['recovery_s']:.2f} + first "
                         f"step {v['first_step_s']:.2f}")
            else:
                parts = f"job end {v['job_end_s']:.2f} + relaunch to first step {v['relaunch_to_first_step_s']:.2f}"
            back = "–" if v.get("time_to_regain_s") is None else f"{v['time_to_regain_s']:.1f}"
            lines.append(f"| {RESILIENCE_CASES.get(k, k)} | {v['time_to_next_step_s']:.1f} | {parts} | "
                         f"{v['steps_lost']} | {1e3 * v['step_s']:.0f} | {v['recompute_s']:.1f} | {back} |")
        u = cases.get("ulfm")
        if u:
            lines += ["", f"a went on as {u['event']['mesh']} on the {u['event']['ranks_kept']} survivors from the "
                      f"partner snapshots of step {u['event']['rollback_to']} ({1e3 * u['step_s_after']:.0f} ms per "
                      "step after, the same global batch); recovered_unix + the first step's `step_time_s` gives "
                      f"{u['time_to_next_step_formula_s']:.1f} s (it leaves out the start of `Trainer.train` on the "
                      "new mesh, which measures the GEMM peak again). The requeues here wait in no queue and "
                      "start on nodes already up: on a real cluster b and c add that wait, a does not. With the "
                      "failure at a uniformly random step, a restart from the shared checkpoint "
                      f"loses {(c['checkpoint_every'] + 1) / 2:g} steps on average, the partner snapshots "
                      f"{(c['memory_every'] + 1) / 2:g} (a snapshot counts once its exchange is complete, a step "
                      "after it was taken)."]
    for name in ("ulfm", "requeue_shared", "requeue_node_local"):
        v = (c.get("cases") or {}).get(name) or {}
        if v.get("skipped") or v.get("error"):
            lines += ["", f"{RESILIENCE_CASES[name]}: " + (f"skipped: {v['skipped']}" if v.get("skipped")
                                                             else f"failed: {v['error'][:300]}")]
    if c.get("skipped") or c.get("error"):
        lines += ["", "A node lost: " + (f"skipped: {c['skipped']}" if c.get("skipped") else f"failed: {c['error']}")]
    return lines


def key_figures(name: str, data: dict, ranks: int | None = None) -> list[str]:
    """The headline figures of benchmark `name` from its JSON `data`, one string per line."""
    try:
        if name == "gemm":
            return _gemm(data, ranks or 2)
        if name == "checkpoint":
            return _checkpoint(data, ranks or 4)
        return {"allreduce": _allreduce, "pipeline": _pipeline, "pipeline_gpt": _pipeline_gpt, "scaling": _scaling,
                "mesh_scaling": _mesh_scaling, "context": _context, "memory": _memory, "zero": _zero,
                "compression": _compression, "diloco": _diloco, "precision": _precision, "vs_torch": _vs_torch,
                "plan": _plan, "moe": _moe, "varlen": _varlen, "sparse_embedding": _sparse_embedding, "ps": _ps,
                "step_overhead": _step_overhead,
                "cluster": _cluster, "resilience": _resilience}[name](data)
    except (KeyError, IndexError, ValueError, TypeError, ZeroDivisionError) as e:
        return [f"results not in the expected form ({type(e).__name__}: {e})"]


# -- the report -----------------------------------------------------------------------------
def collect(results_dir: Path, machine: dict, entries: dict, quick: bool) -> dict:
    """summary.json's content: per benchmark its run entry, results JSON (if any) and key figures."""
    benchmarks = {}
    for b in BENCHMARKS:
        entry = dict(entries.get(b.name) or {"status": "not run"})
        path = results_dir / f"{b.name}.json"
        entry["results_file"] = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        skipped = str(entry.get("status", "")).startswith("skipped")
        if path.exists() and not skipped:
            data = json.loads(path.read_text())
            entry["results"] = data
            entry["figures"] = key_figures(b.name, data, b.ranks)
        else:
            entry.pop("results", None)
            entry["figures"] = [entry["status"] if skipped else "no results"]
        benchmarks[b.name] = entry
    return {"generated": now(), "quick": quick, "machine": machine, "benchmarks": benchmarks}


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _mesh_table(d: dict) -> list[str]:
    meta = d["meta"]
    weak = {r["mesh"]: r for r in d["weak"]}
    lines = [f"GPT n_layer={meta['n_layer']}, n_embd={meta['n_embd']}, T={meta['block_size']}, float32, "
             f"{meta['microbatches']} micro-batches per step; strong: {meta['global_batch']} sequences per step on "
             f"every mesh; weak: {meta['rank_batch']} sequences per step per rank. Best of {meta['repeats']} "
             f"launches x {meta['steps']} timed steps. Speedup: tokens/s over 1x1x1's; efficiency = speedup / "
             f"ranks, (cores) = speedup / min(ranks, {meta['cores']} cores); CPU-s: the speedup in tokens per "
             "CPU-second of the busiest rank (the rate with a core per rank; on a shared machine more "
             "processes also get a larger share of the cores, which inflates wall-clock speedups). "
             "\\* = more ranks than cores (oversubscribed).", "",
             "| mesh | ranks | strong tokens/s | speedup | efficiency (cores) | CPU-s | weak tokens/s | speedup | "
             "efficiency (cores) | CPU-s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cells(r: dict | None) -> str:
        if r is None or "error" in r:
            return ("–" if r is None else "failed") + " | – | – | –"
        return (f"{r['tokens_per_s']:,.0f} | {r['speedup']:.2f}x | "
                f"{r['efficiency']:.0%} ({r['efficiency_cores']:.0%}) | {r['cpu_speedup']:.2f}x")
    for r in d["strong"]:
        star = "\\*" if r["oversubscribed"] else ""
        lines.append(f"| {r['mesh']} | {r['ranks']}{star} | {cells(r)} | {cells(weak.get(r['mesh']))} |")
    for t in d.get("torch") or []:
        lines.append(f"| PyTorch eager, {t['threads']} thread(s) | 1 | {t['tokens_per_s']:,.0f} | "
                     f"{t['tokens_per_s'] / d['baseline_tokens_per_s']:.2f}x | – | "
                     f"{t['tokens_per_cpu_s'] / d['baseline_tokens_per_cpu_s']:.2f}x | | | | |")
    if not d.get("torch"):
        lines += ["", f"PyTorch peer skipped: {d.get('torch_note') or 'not run'}."]
    return lines


def _pipeline_table(d: dict) -> list[str]:
    c0 = d["cases"][0]
    lines = [f"Sleep stages, pp={c0['pp']}, per micro-batch and rank t_f={c0['t_forward']} s, "
             f"B t_b={c0['t_backward']} s, W t_w={c0.get('t_weight', 0)} s (a schedule without W actions runs B "
             "and W as one backward). Bubble: the idle fraction 1 - work / step time.", "",
             "| schedule | v | m | predicted s | measured s | error | bubble predicted | bubble measured | "
             "peak stash |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in d["cases"]:
        lines.append(f"| {c['schedule']} | {c['chunks']} | {c['microbatches']} | {c['predicted_s']:.3f} | "
                     f"{c['measured_s']:.3f} | {_pct(c['error'])} | {c['predicted_bubble']:.1%} | "
                     f"{c['measured_bubble']:.1%} | {c.get('measured_peak_stash', float('nan')):g} |")
    if d.get("against_1f1b"):
        lines += ["", "Against 1F1B of the same m, same run. Idle: step time minus each rank's compute time as "
                  "the executor clocked it (mean over ranks); from step time: step - nominal work; peak stash in "
                  "micro-batches of a rank's layers (worst rank).", "",
                  "| schedule | m | idle / 1F1B | predicted | bound | from step time | idle fraction / 1F1B | "
                  "step time / 1F1B | peak stash (1F1B) | ok |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in d["against_1f1b"]:
            lines.append(f"| {r['schedule']} | {r['microbatches']} | {r['idle_ratio']:.2f} | "
                         f"{r['predicted_idle_ratio']:.2f} | {r['bound'] if r['bound'] is not None else '–'} | "
                         f"{r['step_idle_ratio']:.2f} | {r['bubble_fraction_ratio']:.2f} | "
                         f"{r['step_time_ratio']:.2f} | "
                         f"{r['peak_stash']:g} ({r['peak_stash_1f1b']:g}) | {'yes' if r['ok'] else 'no'} |")
    return lines


def _pipeline_gpt_table(d: dict) -> list[str]:
    lines = [f"{d['ranks']} ranks, " + " ".join(d["model"]) + ". Each schedule trains the same batches, in turn "
             "one step each; tokens/s from the median of the slowest rank's step times. Bubble: the executor's "
             "idle fraction (mean over ranks).", "",
             "Checks: the synchronous loss mean and global gradient norm (clipping, NaN check) before the "
             "optimizer step, on the last rank to get there (the collectives alone); + wait: on the first "
             "(waiting for the others included).", "",
             "| mesh | schedule | v | step s | tokens/s | vs 1F1B | bubble | checks ms (of step) | + wait ms | "
             "loss rel. diff vs 1F1B |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mesh in d["meshes"]:
        for r in mesh["rows"]:
            lines.append(f"| {mesh['mesh']} | {r['schedule']} | {r['chunks']} | {r['step_s']:.3f} | "
                         f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s_vs_1f1b']:.2f}x | {r['pipeline_bubble']:.1%} | "
                         f"{1e3 * r['check_s']:.2f} ({r['check_fraction']:.2%}) | "
                         f"{1e3 * r.get('check_with_wait_s', float('nan')):.2f} | {r['loss_rel_diff_vs_1f1b']:.1e} |")
    return lines


def render_markdown(summary: dict, docs_path: Path | None = None) -> str:
    """docs/benchmarks.md from `summary` (collect's output); PNG links relative to `docs_path`."""
    m = summary["machine"]
    load = m["load_average_start"]
    kind = "virtual machine" if m.get("virtual_machine") else "machine"
    shared = load[0] >= 0.5 * m["cores"]
    lines = [
        "# Benchmarks", "",
        "<!-- Generated by `python bench/run_all.py`; edit that script, not this file. -->", "",
        f"Latest figures of every benchmark in `bench/` (what each measures: [bench/README.md]"
        f"({_link('bench/README.md', docs_path)})). Regenerate the whole page with `python bench/run_all.py` "
        "(about 10 minutes; `--only NAME` reruns one benchmark and keeps the others' figures). "
        "GPU figures (`bench/gpu.py`): [benchmarks-gpu.md](benchmarks-gpu.md).", "",
        "## Machine", "",
        f"- {m['cores']}-core {kind}, {m['cpu']}; {m['os']}",
        f"- MPI: {m['mpi']} (mpi4py {m['mpi4py']}); Python {m['python']}, NumPy {m['numpy']}, h5py {m['h5py']}, "
        f"PyTorch {m['torch'] or 'not installed'}",
        f"- date: {m['date']}; load average (1, 5, 15 min) at the start: "
        f"{', '.join(f'{x:.2f}' for x in load)}" + (
            f", at the end: {', '.join(f'{x:.2f}' for x in m['load_average_end'])}" if m.get("load_average_end")
            else ""),
        "- one BLAS thread per rank throughout; runs with more ranks than cores share the cores "
        "(oversubscribed)",
    ]
    if shared:
        lines.append(f"- **the machine was shared with other work** (load average {load[0]:.1f} on {m['cores']} "
                     "cores before the first benchmark): absolute figures are noisy and low; the benchmarks "
                     "report best-of-N, and ratios measured side by side in one run are the meaningful part")
    if m.get("note"):
        lines.append(f"- note: {m['note']}")
    if summary.get("quick"):
        lines.append("- **quick run** (`--quick`, smaller sizes): a smoke test, not figures to quote")
    lines += ["", "## Latest figures", "",
              "| benchmark | what | key figures | command (JSON in `bench/results/`) | run |", "|---|---|---|---|---|"]
    for b in BENCHMARKS:
        e = summary["benchmarks"].get(b.name, {"status": "not run", "figures": ["no results"]})
        figures = "<br>".join(_escape(f) for f in e.get("figures", []))
        cmd = f"`{_escape(e['command'])}`" if e.get("command") else "–"
        when = e.get("started", "")[:16].replace("T", " ")
        run = _escape(f"{e.get('status', 'not run')}" + (f", {e['wall_s']:.0f} s" if e.get("wall_s") else "")
                      + (f", {when}, load {e['load_average_before'][0]:.1f}" if e.get("load_average_before") else ""))
        lines.append(f"| {b.name} | {_escape(b.what)} | {figures} | {cmd} | {run} |")
    details = summary["benchmarks"]
    # Detail sections: (benchmark, title, table from its results, image alt text or None).
    for name, title, table, image in (("allreduce", "Collectives", _collectives_table, None),
                                      ("mesh_scaling", "Mesh scaling", _mesh_table, "mesh scaling"),
                                      ("pipeline", "Pipeline bubble", _pipeline_table, "pipeline"),
                                      ("pipeline_gpt", "Pipeline schedules training a GPT", _pipeline_gpt_table,
                                       None),
                                      ("context", "Context parallelism", _context_table, None),
                                      ("memory", "Memory", _memory_table, None),
                                      ("plan", "Plan", _plan_table, None),
                                      ("precision", "Mixed precision", _precision_table,
                                       "mixed precision loss curves"),
                                      ("compression", "Gradient compression", _compression_table,
                                       "gradient compression loss curves"),
                                      ("diloco", "DiLoCo",
                                       lambda d: _diloco_table(d, _beside(details, "diloco", "diloco_cluster.json")),
                                       "DiLoCo loss curves and loss vs bytes"),
                                      ("moe", "Mixture of experts", _moe_table, None),
                                      ("varlen", "Packed documents", _varlen_table,
                                       "packed documents: loss curves, length distributions, attention time vs FLOPs"),
                                      ("sparse_embedding", "Sparse embedding gradients", _sparse_embedding_table,
                                       None),
                                      ("ps", "Parameter server", _ps_table, "parameter server loss curves"),
                                      ("step_overhead", "Per-step overhead", _step_overhead_table, None),
                                      ("vs_torch", "hpcpar vs PyTorch eager", _vs_torch_table, None),
                                      ("cluster", "Cluster", lambda d: _cluster_table(d, docs_path), None),
                                      ("resilience", "Resilience", _resilience_table, "resilience")):
        results = details.get(name, {}).get("results")
        if not results:
            continue
        lines += ["", f"## {title}", ""]
        try:
            lines += table(results)
        except (KeyError, TypeError, ZeroDivisionError) as e:
            lines.append(f"(results not in the expected form: {type(e).__name__}: {e})")
        if image:
            lines += _image(image, details[name]["results_file"], docs_path)
    return "\n".join(lines) + "\n"


def _vs_torch_table(d: dict) -> list[str]:
    """bench/vs_torch.py: every shape at every thread count, side by side."""
    lines = [f"One process, the same GPT and batches in both (forward, backward, clipping, AdamW; hpcpar through "
             f"`Trainer.train`), float32, n_head 4, vocabulary 256; each framework in its own process, driven in "
             f"turns, best of {d['rounds']} alternating rounds of {d['steps']} steps. hpcpar's GEMMs: {d['blas']}. "
             "MFU is against the GEMM peak measured with hpcpar's GEMM at the same thread count.", "",
             "| L x C x T x B | threads | hpcpar tokens/s | PyTorch tokens/s | hpcpar / PyTorch | MFU hpcpar | "
             "MFU PyTorch |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        lines.append(f"| {r['n_layer']} x {r['n_embd']} x {r['block_size']} x {r['batch']} | {r['threads']} | "
                     f"{r['hpcpar']['tokens_per_s']:,.0f} | {r['torch']['tokens_per_s']:,.0f} | "
                     f"{r['ratio_hpcpar_over_torch']:.2f}x | {r['hpcpar']['mfu']:.1%} | {r['torch']['mfu']:.1%} |")
    o = d["op_overhead"]
    lines += ["", f"Per-op framework overhead (a tiny elementwise multiply with the graph recorded): hpcpar "
              f"{o['hpcpar_us']:.1f} µs, PyTorch {o['torch_us']:.1f} µs."]
    return lines


def _memory_table(d: dict) -> list[str]:
    """bench/memory.py's sections as tables (each only when it ran)."""
    lines = []
    if "activations" in d:
        a = d["activations"]
        c = a["config"]
        lines += [f"Activation bytes per transformer layer, one process, B={c['batch']}, T={c['seq']}, "
                  f"C={c['n_embd']}, H={c['n_head']}, {c['dtype']}, dropout={c['dropout']}: NumPy bytes held between "
                  "forward and backward (tracemalloc), a "
                  f"{c['n_layer']}-block GPT minus a 1-block one, per block. Formula (s bytes per element, d = 1 with "
                  "dropout): none `s B T [(24 + 4d) C + 2] + s B H (K(T) + T)`, selective without the `K(T)` "
                  "term, full `s B T C`; K(T) = the elements of one head's [T, T] scores the CPU attention keeps "
                  "(its causal blocks of 64 queries, `cpu.attention.kept_probabilities`). Estimate: the start-up "
                  "estimate's count (docs/config.md). Backward peak: bytes above the held ones during backward.", "",
                  "| recompute | measured MiB | formula MiB | ratio | saved vs none | estimate MiB | "
                  "backward peak + MiB | forward + backward time |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in a["rows"]:
            lines.append(f"| {r['recompute']} | {r['measured_bytes_per_layer'] / MiB:.3f} | "
                         f"{r['formula_bytes_per_layer'] / MiB:.3f} | {r['ratio']:.3f} | {r['saved_vs_none']:.1%} | "
                         f"{r['estimate_bytes_per_layer'] / MiB:.3f} | "
                         f"{r['backward_peak_above_held_bytes'] / MiB:.2f} | {r['step_time_vs_none']:.2f}x |")
    if "precision" in d:
        p = d["precision"]
        c = p["config"]
        lines += [""] if lines else []
        lines += [f"Mixed precision, one process: activation bytes per layer (B={c['batch']}, T={c['seq']}, "
                  f"C={c['n_embd']}, H={c['n_head']}, dropout={c['dropout']}, recompute none) next to the count of "
                  "what each op keeps (16-bit: `a B T 18 C + 16 B T + d (2a + 2) B T C + a B H K(T)`, a = 2), and NumPy "
                  "bytes per parameter a one-rank Trainer holds after two steps (float32 masters, AdamW).", "",
                  "| precision | activations MiB | formula MiB | ratio | vs float32 | bytes/parameter |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in p["rows"]:
            lines.append(f"| {r['precision']} | {r['measured_bytes_per_layer'] / MiB:.3f} | "
                         f"{r['formula_bytes_per_layer'] / MiB:.3f} | {r['ratio']:.3f} | "
                         f"{r['activations_vs_full']:.2f}x | {r['state_bytes_per_parameter']:.2f} |")
    if "model_state" in d:
        ms = d["model_state"]
        m, n = ms["model"], ms["rows"][0]["n"]
        lines += [""] if lines else []
        lines += [f"Model state per parameter under ZeRO, GPT {m['layers']}x{m['embd']} {m['dtype']}, AdamW, "
                  f"{ms['rows'][0]['params'] / 1e6:.2f}M parameters, dp = N = {n}: bytes of NumPy allocations live "
                  "after two steps (tracemalloc), busiest rank, per parameter; ZeRO-3 adds its largest unit "
                  "gathered through the real gather path.", "",
                  "| zero | formula | formula bytes/param | measured | of which the gathered unit | error |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in ms["rows"]:
            lines.append(f"| {r['zero']} | {r['formula']} | {r['formula_bytes_per_param']:.2f} | {r['measured']:.2f} | "
                         f"{r['unit_bytes_per_param']:.2f} | {r['error']:+.1%} |")
        f = ms["fit"]
        lines += ["", f"Per-rank limit {f['limit_bytes'] / MiB:.1f} MiB (config estimate): plain DP (zero=0) fits "
                  f"{f['params']['small'] / 1e6:.2f}M parameters and refuses {f['params']['big'] / 1e6:.2f}M "
                  f"({f['param_ratio']:.1f}x; estimated {f['estimates']['big_zero0'] / MiB:.1f} MiB); zero=3 trains "
                  f"them (estimated {f['estimates']['big_zero3'] / MiB:.1f} MiB, measured peak "
                  f"{f['big_zero3_peak_bytes'] / MiB:.1f} MiB)."]
    return lines


def _precision_table(d: dict) -> list[str]:
    m = d["meta"]
    lines = [f"The default job ({d['rows'][0]['mesh']}, float32 masters) on {m['ranks']} ranks, {m['steps']} steps "
             "per precision through `Trainer.train`; final loss: mean of the last 10 steps; worst step: the largest "
             "relative excess over full's loss at the same step; tokens/s: the slowest rank's median step, best of "
             f"{m['rounds']} alternating rounds of {m['time_steps']} steps. On the CPU the GEMMs are float32 in every "
             "precision ([parallelism.md](parallelism.md#mixed-precision)).", "",
             "| precision | final loss | vs full | worst step | skipped (overflow) | final loss scale | tokens/s | "
             "vs full |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        scale = "–" if r["final_loss_scale"] is None else f"{r['final_loss_scale']:g}"
        lines.append(f"| {r['precision']} | {r['final_loss']:.4f} | {r['loss_vs_full']:+.2%} | "
                     f"{r['worst_step_vs_full']:+.2%} | {r['skipped_steps']} | {scale} | {r['tokens_per_s']:,.0f} | "
                     f"{r['speed_vs_full']:.2f}x |")
    return lines


def _compression_table(d: dict) -> list[str]:
    m = d["meta"]
    lines = [f"dp={m['ranks']}, float32, global batch {m['global_sequences']} sequences of the default job; bytes: "
             "what a rank sends per step for gradient synchronisation (`Communicator.sent`), next to the "
             "compressor's formula ([parallelism.md](parallelism.md#gradient-compression)); final loss: mean of the "
             f"last 10 of {m['steps']} steps; step time: slowest rank's median step, best of {m['rounds']} alternating "
             f"rounds of {m['time_steps']} steps. top-k ratio {m['ratio']}, PowerSGD rank {m['rank']}; \"warm-up W\": "
             "`train.compression_start_step = W` (such a run is resumed from `none`'s checkpoint at step W and its "
             "curve begins with `none`'s); larger settings tried against the loss criterion (within 3 % of none): "
             f"top-k ratio {', '.join(map(str, m['meet_ratio']))}, PowerSGD rank "
             f"{', '.join(map(str, m['meet_rank']))}.", "",
             f"Loss, default model, {d['loss'][0]['params'] / 1e6:.2f}M parameters:", "",
             "| compressor | MiB/step/rank | formula | error | vs none | final loss | loss vs none |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["loss"]:
        lines.append(f"| {_compression_name(r)} | {r['bytes_per_step'] / MiB:.3f} | {r['formula_bytes'] / MiB:.3f} | "
                     f"{r['formula_error']:+.1%} | {r['ratio_to_none']:.3f}x | {r['final_loss']:.4f} | "
                     f"{r['loss_vs_none']:+.2%} |")
    compressed = [r for r in d["loss"] if r["kind"] != "none" and r["error_feedback"]]
    lines += ["", "Within 3 % of none with error feedback (the loss criterion): "
              + (", ".join(_compression_name(r) for r in compressed if r["loss_vs_none"] <= 0.03) or "none")
              + "; not: " + (", ".join(_compression_name(r) for r in compressed if r["loss_vs_none"] > 0.03) or "none")
              + ". Top-k and PowerSGD need the warm-up: from the first step error feedback pays the first steps' "
              "large, fast-turning gradients back about 1/ρ steps late (top-k ended worse with it than without); "
              "after it the remaining gap is that delay, which only a larger ratio or rank shrinks. Why, and what "
              "else was tried: [parallelism.md](parallelism.md#what-compression-does-to-the-loss)."]
    for title, rows in (("default model", d["default"]), (f"wider model (n_embd {m['wide_embd']})", d["wide"])):
        lines += ["", f"Step time, {title}, {rows[0]['params'] / 1e6:.2f}M parameters:", "",
                  "| compressor | MiB/step/rank | formula | error | vs none | step ms | time vs none |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['kind']} | {r['bytes_per_step'] / MiB:.3f} | {r['formula_bytes'] / MiB:.3f} | "
                         f"{r['formula_error']:+.1%} | {r['ratio_to_none']:.3f}x | {1e3 * r['step_s']:.0f} | "
                         f"{r['step_time_vs_none']:.2f}x |")
    lines += ["", f"Where compression pays: predicted step time = measured here + bytes / link + {m['alpha_us']:g} µs "
              "x messages; L* = the link speed below which the compressor beats none (\"any\": it costs no time "
              f"here). This machine's shared memory moves the uncompressed gradient at {m['shared_memory_gbps']:.1f} "
              "Gb/s per rank; a compressor pays here only where L* is above that.", "",
              "| model | compressor | 1 Gb/s ms | 10 Gb/s ms | 100 Gb/s ms | L* Gb/s |",
              "|---|---|---:|---:|---:|---:|"]
    for model, rows in d["where_it_pays"].items():
        for r in rows:
            cross = "–" if r["crossover_gbps"] is None else _gbps(r["crossover_gbps"])
            lines.append(f"| {model} | {r['kind']} | " + " | ".join(f"{1e3 * r['predicted_step_s'][g]:.0f}"
                                                                   for g in ("1", "10", "100")) + f" | {cross} |")
    return lines


def _beside(details: dict, name: str, filename: str) -> dict | None:
    """The JSON `filename` next to benchmark `name`'s results file, if there is one."""
    path = ROOT / Path(details[name]["results_file"]).with_name(filename)
    return json.loads(path.read_text()) if path.exists() else None


def _diloco_cluster(c: dict) -> list[str]:
    """bench/diloco.py --link-check on the emulated cluster (diloco_cluster.json): one shaped link."""
    rate = _diloco_rate(c["link_gbps"])
    reps = c["repetitions"]
    names = [r["name"] for r in reps[0]["shaped"]]
    errors = [r["predicted_error"] for rep in reps for r in rep["shaped"]]
    return ["", f"Measured on the emulated cluster: {c['what']}. Tokens/s at {rate} (repetitions separated by /), and "
            f"the prediction's error, {min(errors):+.0%} … {max(errors):+.0%}:", "",
            "| setting | KiB/step | tokens/s | measured step / predicted - 1 |", "|---|---:|---:|---:|"] + [
        f"| {n} | {reps[0]['shaped'][i]['bytes_per_step'] / 1024:.1f} | "
        + " / ".join(f"{rep['shaped'][i]['tokens_per_s']:,.0f}" for rep in reps) + " | "
        + " / ".join(f"{rep['shaped'][i]['predicted_error']:+.0%}" for rep in reps) + " |"
        for i, n in enumerate(names)]


def _diloco_table(d: dict, cluster: dict | None = None) -> list[str]:
    m = d["meta"]
    lines = [f"GPT {m['layers']} blocks, n_embd {m['embd']}, T {m['block']}, float32, AdamW (lr {m['lr']:g}, the "
             f"default schedule), the default corpus; every run {m['steps']} steps of the same global batch of "
             f"{m['batch']} sequences (equal tokens), R replicas on R ranks (`mesh.dp=R`; local / diloco with "
             "`mesh.dp_replicate=R`). step: `train.sync=step` (gradients averaged every step); local: parameters "
             f"averaged every H steps; diloco: outer Nesterov SGD lr {m['outer_lr']:g}, momentum "
             f"{m['outer_momentum']:g}; F=2 tau=1: two fragments synced H/2 steps apart, each reduction overlapping "
             "one step. Loss: mean of the last 10 steps' training losses (replicas averaged) and the validation loss "
             f"after the last step ({m['eval_batches']} global batches; every run but the streamed one ends on a "
             "synchronisation), gap to step of the same R. Bytes: `Communicator.sent` on the replica axis per step "
             "(step mode: the gradient all-reduce), next to the formula "
             "([parallelism.md](parallelism.md#local-sgd-and-diloco)). Goal: "
             f"within {m['goal_loss']:.0%} of step's loss (both) at <= {m['goal_bytes']:.0%} of its bytes.", "",
             "| R | setting | final loss | gap | val loss | gap | KiB/step | formula | error | vs step | goal |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in d["runs"]:
        lines.append(f"| {r['replicas']} | {r['name']} | {r['final_loss']:.4f} | {r['loss_gap']:+.2%} | "
                     f"{r['val_loss']:.4f} | {r['val_gap']:+.2%} | {r['bytes_per_step'] / 1024:.2f} | "
                     f"{r['formula_bytes'] / 1024:.2f} | {r['formula_error']:+.1%} | {r['bytes_ratio']:.4f} | "
                     f"{'met' if r['meets_goal'] else ''} |")
    met = d.get("goal_met_by") or []
    lines += ["", "Goal: " + (f"met by {', '.join(met)}." if met else "not met by any setting.")]
    model, links = d["link_model"], [str(g) for g in m["links"]]
    lines += ["", f"Tokens/s with the replica axis on a slow link, R={m['timed_replicas']}, modelled (this machine's "
              f"ranks share memory): compute-only step t0 = {1e3 * model['t0_s']:.1f} ms (the median step without "
              f"replica-axis traffic; {m['ranks']} ranks on {m['cores']} cores) + the setting's own work per step "
              "measured here (compressors: their step minus step's; local / diloco: a sync step minus an inner "
              f"step, / H; timing runs of {m['time_steps']} steps, fastest of {m['rounds']} alternating rounds) + "
              f"bytes / L + {m['alpha_us']:g} µs x messages; streamed: a fragment's transfer overlaps one step of "
              "compute. L*: the link speed below which the first setting is faster (\"any\": at every "
              "speed).", "",
              "| setting | own ms/step | " + " | ".join(f"tokens/s at {_diloco_rate(float(g))}" for g in links) + " |",
              "|---|---:|" + "---:|" * len(links)]
    for r in model["rows"]:
        lines.append(f"| {r['name']} | {1e3 * r['own_s']:.2f} | "
                     + " | ".join(f"{r['tokens_per_s'][g]:,.0f}" for g in links) + " |")
    lines += ["", "L* (Gb/s): " + "; ".join(f"{pair} {_diloco_gbps(x)}" for pair, x in d["crossover_gbps"].items())
              + "."]
    return lines + (_diloco_cluster(cluster) if cluster else
                    ["", "No cluster measurement (bench/diloco.py --link-check under tests/cluster/harness.py): the "
                     "figures above are modelled."])


def _context_table(d: dict) -> list[str]:
    m = d["meta"]
    sent = {(r["design"], r["k"]): r for r in d["bytes"]}
    lines = [f"T={m['seq']}, B={m['batch']}, C={m['n_embd']}, H={m['n_head']}, float32; k = the design's degree "
             "(cp, or tp with sequence parallelism); k = 1 is plain attention. Activations: what the attention op "
             "keeps for backward per rank. Bytes: sent per rank per transformer layer, forward + backward.", "",
             "| design | k | activations MiB | bytes x k / first | work max/mean | KiB sent / layer | formula KiB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["attention"] + d["naive"]:
        naive = r in d["naive"]
        s = None if naive else sent.get((r["design"], r["k"]))
        ratio = r.get("saved_x_k_over_reference")
        ratio_text = "–" if ratio is None or naive or (r["design"] == "ring" and r["k"] == 1) else f"{ratio:.3f}"
        measured = f"{s['bytes_sent_per_layer'] / 1024:.1f}" if s else "–"
        formula = f"{s['formula_bytes'] / 1024:.1f}" if s else "–"
        lines.append(f"| {r['design']}{' (contiguous)' if naive else ''} | {r['k']} | "
                     f"{r['saved_bytes_per_rank'] / MiB:.3f} | {ratio_text} | {r['work_max_over_mean']:.3f} | "
                     f"{measured} | {formula} |")
    lines += ["", "| cp | longest block_size | estimate MiB | measured peak MiB |", "|---:|---:|---:|---:|"]
    for r in d["longest"]:
        lines.append(f"| {r['cp']} | {r['block_size']} | {r['estimate_bytes'] / MiB:.1f} | "
                     f"{r['measured_peak_bytes'] / MiB:.1f} |")
    return lines


def _image(title: str, results_file: str, docs_path: Path | None) -> list[str]:
    """Markdown lines showing the PNG next to `results_file`, if the benchmark drew one."""
    png = str(Path(results_file).with_suffix(".png"))
    return ["", f"![{title}]({_link(png, docs_path)})"] if (ROOT / png).exists() else []


def _link(path: str, docs_path: Path | None) -> str:
    """`path` (relative to the repository) as a link from the markdown file's directory."""
    if docs_path is None:
        return path
    return os.path.relpath(ROOT / path, Path(docs_path).resolve().parent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a smoke test")
    parser.add_argument("--only", default="", help=f"comma list of benchmarks to run: {', '.join(BY_NAME)}")
    parser.add_argument("--results-dir", default=None,
                        help="where the JSON goes (default bench/results, with --quick bench/results/quick)")
    parser.add_argument("--docs", default=None,
                        help="markdown to write (default docs/benchmarks.md, with --quick <results-dir>/benchmarks.md)")
    parser.add_argument("--note", default=None, help="a line about the machine for the page, e.g. 'shared VM'")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: rebuild summary.json and the page from the JSON in --results-dir")
    args = parser.parse_args(argv)
    names = [] if args.report_only else [n for n in args.only.split(",") if n] or list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"--only: unknown benchmark {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    results_dir = Path(args.results_dir or (DEFAULT_RESULTS / "quick" if args.quick else DEFAULT_RESULTS)).resolve()
    docs = Path(args.docs or (results_dir / "benchmarks.md" if args.quick else DEFAULT_DOCS)).resolve()
    results_dir.mkdir(parents=True, exist_ok=True)
    summary_path = results_dir / "summary.json"

    previous = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    entries = {name: {k: v for k, v in e.items() if k not in ("results", "figures")}
               for name, e in previous.get("benchmarks", {}).items()}
    if args.report_only and "machine" in previous:  # the machine and load of the run that measured
        machine = previous["machine"]
        machine["note"] = machine.get("note", "") if args.note is None else args.note
    else:
        machine = machine_info(args.note or "")
        started = time.perf_counter()
        for name in names:
            entries[name] = run(BY_NAME[name], args.quick, results_dir)
        machine["load_average_end"] = list(os.getloadavg())
        machine["wall_s"] = time.perf_counter() - started
    summary = collect(results_dir, machine, entries, args.quick)
    summary_path.write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(render_markdown(summary, docs))
    print(f"\nwrote {summary_path} and {docs}" + (f" ({machine['wall_s']:.0f} s)" if names else ""))
    for name in names:
        e = summary["benchmarks"][name]
        print(f"  {name}: {e['status']}")
        for figure in e["figures"]:
            print(f"      {figure}")
    failed = [n for n in names if entries[n]["status"] != "ok" and not entries[n]["status"].startswith("skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
