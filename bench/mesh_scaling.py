"""Strong and weak scaling of training over the mesh shapes that fit the machine, PyTorch as the peer.

    python bench/mesh_scaling.py [--worlds 1,2,4] [--steps 4] [--warmup 2] [--repeats 2]

For each world size N in --worlds the script launches itself under `mpiexec -n N` (one BLAS
thread per rank) once per mesh shape of that size:

    N=1  1x1x1          N=2  dp=2, tp=2, pp=2
    N=4  dp=4, tp=4, pp=4, dp=2xpp=2, dp=2xtp=2, tp=2xpp=2

Each launch builds `hpcpar.training.trainer.Trainer` from the default config with the overrides below,
once per scaling mode, and runs its training loop (`Trainer.train`, the loop of `hpcpar train`,
writing no files) for --warmup + --steps steps; the last --steps are timed (the slowest rank's
step time); the fastest timed step counts (the median is kept in the JSON).
Every mesh uses --microbatches micro-batches per step (>= the largest pp, so every pipeline
can fill); the batch per step is

    strong scaling  the same global batch on every mesh (--global-batch sequences):
                    micro_batch_size = global_batch / (dp * microbatches)
    weak scaling    the global batch grows with the ranks (--rank-batch sequences per rank):
                    micro_batch_size = rank_batch * N / (dp * microbatches)

so at N=1 (the baseline) both are the same run by default. tokens/s = global batch * T /
step time; speedup = tokens/s / baseline tokens/s; efficiency = speedup / N, and
"eff (cores)" = speedup / min(N, cores), the share of what the machine's cores allow.
Launches go over the meshes --repeats times, in reverse order every other time, and the best
repeat of each counts (the machine may be shared). "tok/cpu-s" divides by the busiest rank's
CPU time instead of wall time: the rate with a core per rank, and the fairer figure on a
machine shared with other work, where more processes also win a larger share of the cores
(waits spin for up to a few ms before they sleep, which this counts as work). As the peer,
PyTorch eager trains the same GPT on the same strong-scaling batch in one process (1 thread,
and one thread per core), via bench/vs_torch.py's `torch_trainer`; it is skipped, and the
output says so, where torch is not installed. Strong-scaling runs train the same global
batches, so their losses must agree (printed).
Results: a table, bench/results/mesh_scaling.json and bench/results/mesh_scaling.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# One BLAS thread per rank, set before NumPy is imported (in the workers too: they inherit it).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
    os.environ[_var] = "1"

ROOT = Path(__file__).resolve().parent.parent
MARKER = "MESH_SCALING_RESULT "  # prefixes the worker's one JSON line on stdout
# (dp, tp, pp) per world size, in the order they are reported.
MESHES = {1: [(1, 1, 1)],
          2: [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
          4: [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 1, 2), (2, 2, 1), (1, 2, 2)]}


def mesh_name(dp: int, tp: int, pp: int) -> str:
    """'1x1x1' for one rank, else the parallel axes, e.g. 'dp=2xpp=2'."""
    parts = [f"{axis}={n}" for axis, n in (("dp", dp), ("tp", tp), ("pp", pp)) if n > 1]
    return "x".join(parts) or "1x1x1"


def micro_batch_size(mode: str, dp: int, tp: int, pp: int, microbatches: int, global_batch: int,
                     rank_batch: int) -> int:
    """Sequences per micro-batch per dp rank for `mode` ('strong' or 'weak'); ValueError if it is not whole."""
    world = dp * tp * pp
    sequences = global_batch if mode == "strong" else rank_batch * world
    if sequences % (dp * microbatches):
        raise ValueError(f"{mode} scaling on {mesh_name(dp, tp, pp)}: {sequences} sequences per step do not "
                         f"split into dp={dp} x {microbatches} micro-batches; pick a batch divisible by "
                         f"{dp * microbatches}")
    return sequences // (dp * microbatches)


def overrides(args: argparse.Namespace, dp: int, tp: int, pp: int, mbs: int) -> list[str]:
    """`--set` style overrides of the default config for one worker."""
    return [f"model.n_layer={args.layers}", f"model.n_embd={args.embd}", f"model.n_head={args.heads}",
            f"model.block_size={args.block}", "model.dtype=float32",
            f"mesh.dp={dp}", f"mesh.tp={tp}", f"mesh.pp={pp}",
            f"train.micro_batch_size={mbs}", f"train.microbatches={args.microbatches}",
            "train.steps=1000", "run.progress=false", "run.eval_every=0"]  # steps: only the lr schedule sees it


def worker(args: argparse.Namespace) -> None:
    """One mpiexec launch: a Trainer per micro-batch size in --mbs, timing the steps of its training
    loop; rank 0 prints MARKER + a JSON list with a row per size."""
    import numpy as np
    from mpi4py import MPI

    from hpcpar.config.load import load_config
    from hpcpar.training.trainer import Trainer

    rows = []
    for mbs in (int(m) for m in args.mbs.split(",")):
        trainer = Trainer(load_config(None, overrides(args, args.dp, args.tp, args.pp, mbs)), MPI.COMM_WORLD)
        world = trainer.mesh.world
        step_s, cpu_s, losses = [], [], []

        def on_step(record: dict) -> None:
            """The slowest rank's step time and the busiest rank's CPU time in the step."""
            slowest, busiest = world.all_reduce(np.array([record["step_time_s"], record["cpu_time_s"]]), op="max")
            if record["step"] >= args.warmup:  # the first steps allocate buffers and open connections
                step_s.append(float(slowest))
                cpu_s.append(float(busiest))
            losses.append(record["loss"])

        trainer.train(steps=args.warmup + args.steps, files=False, progress=False, on_step=on_step, peak_flops=0.0)
        tokens = trainer.tokens_per_step
        best = min(range(len(step_s)), key=step_s.__getitem__)  # the step least disturbed by other work
        rows.append({"micro_batch_size": mbs, "tokens_per_step": tokens, "step_s": step_s[best],
                     "step_s_all": step_s, "tokens_per_s": tokens / step_s[best],
                     "tokens_per_s_median": tokens / statistics.median(step_s),
                     "tokens_per_cpu_s": tokens / cpu_s[best], "loss": losses[-1],
                     "pipeline_bubble": trainer.executor.measured_bubble()})
        trainer.mesh.free()
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(MARKER + json.dumps(rows), flush=True)


def torch_worker(args: argparse.Namespace) -> None:
    """PyTorch eager on one process: the strong-scaling batch of the baseline; prints MARKER + JSON."""
    sys.path.insert(0, str(ROOT / "bench"))
    import torch
    import vs_torch
    from mpi4py import MPI

    from hpcpar.config.load import load_config
    from hpcpar.training.trainer import Trainer

    torch.set_num_threads(args.threads)
    cfg = load_config(None, overrides(args, 1, 1, 1, int(args.mbs)))
    reference = Trainer(cfg, MPI.COMM_SELF)  # the 1x1x1 run's model and batches
    step_fn = vs_torch.torch_trainer(reference.stages[0], max_norm=cfg.train.grad_clip)
    step_s, cpu_s = [], []
    for step in range(args.warmup + args.steps):
        batches = reference.microbatches(step)
        t0, c0 = time.perf_counter(), time.process_time()
        step_fn(batches)
        if step >= args.warmup:
            step_s.append(time.perf_counter() - t0)
            cpu_s.append(time.process_time() - c0)
    tokens_per_step = reference.tokens_per_step
    best = min(range(len(step_s)), key=step_s.__getitem__)
    print(MARKER + json.dumps({"threads": args.threads, "version": torch.__version__, "step_s": step_s[best],
                               "tokens_per_s": tokens_per_step / step_s[best],
                               "tokens_per_cpu_s": tokens_per_step / cpu_s[best],
                               "tokens_per_s_median": tokens_per_step / statistics.median(step_s)}), flush=True)


def launch(ranks: int | None, worker_args: list[str], timeout: float) -> dict | list:
    """Run this script in a worker mode (under `mpiexec -n ranks` unless None); what it printed
    after MARKER, or {"error": ...} when it fails."""
    cmd = [sys.executable, __file__, *worker_args]
    if ranks is not None:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        cmd = [str(mpiexec) if mpiexec.exists() else (shutil.which("mpiexec") or "mpiexec"), "-n", str(ranks), *cmd]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s: {' '.join(cmd)}"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": f"exit status {proc.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1][len(MARKER):])


def model_args(args: argparse.Namespace) -> list[str]:
    return ["--layers", str(args.layers), "--embd", str(args.embd), "--heads", str(args.heads),
            "--block", str(args.block), "--microbatches", str(args.microbatches),
            "--steps", str(args.steps), "--warmup", str(args.warmup)]


def cores_available() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def torch_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def summarise(runs: dict, baseline: dict, cores: int) -> list[dict]:
    """One row per mesh: the best repeat, with speedups and efficiencies against `baseline`
    ({"tokens_per_s", "tokens_per_cpu_s"} of the 1x1x1 run)."""
    rows = []
    for (dp, tp, pp, mbs), repeats in runs.items():
        ok = [r for r in repeats if "error" not in r]
        world = dp * tp * pp
        row = {"mesh": mesh_name(dp, tp, pp), "dp": dp, "tp": tp, "pp": pp, "ranks": world,
               "micro_batch_size": mbs, "oversubscribed": world > cores}
        if not ok:
            rows.append({**row, "error": repeats[0]["error"]})
            continue
        best = max(ok, key=lambda r: r["tokens_per_s"])
        speedup = best["tokens_per_s"] / baseline["tokens_per_s"]
        rows.append({**row, **best, "speedup": speedup, "efficiency": speedup / world,
                     "cpu_speedup": best["tokens_per_cpu_s"] / baseline["tokens_per_cpu_s"],
                     "efficiency_cores": speedup / min(world, cores),
                     "all_repeats_tokens_per_s": [r["tokens_per_s"] for r in ok]})
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cores = result["meta"]["cores"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = {1: "tab:gray", 2: "tab:blue", 4: "tab:orange"}
    for ax, mode in zip(axes, ("strong", "weak")):
        rows = [r for r in result[mode] if "error" not in r]
        x = range(len(rows))
        ax.bar(x, [r["speedup"] for r in rows], color=[colors.get(r["ranks"], "tab:green") for r in rows])
        ax.scatter(x, [r["cpu_speedup"] for r in rows], marker="D", s=25, color="white", edgecolor="black",
                   label="per CPU-second of the busiest rank", zorder=4)
        ax.scatter(x, [min(r["ranks"], cores) for r in rows], marker="_", s=400, color="black",
                   label=f"ideal on {cores} cores", zorder=3)
        for torch_row in result["torch"] or []:
            ax.axhline(torch_row["tokens_per_s"] / result["baseline_tokens_per_s"], linestyle="--", linewidth=1,
                       color="tab:red" if torch_row["threads"] == 1 else "tab:purple",
                       label=f"PyTorch eager, {torch_row['threads']} thread(s)")
        ax.set_xticks(list(x), [f"{r['mesh']}\n{r['ranks']} rank{'s' * (r['ranks'] > 1)}" for r in rows],
                      fontsize=7)
        batch = "global batch fixed" if mode == "strong" else "batch per rank fixed"
        ax.set_title(f"{mode} scaling ({batch})")
        ax.set_ylabel("tokens/s relative to 1x1x1")
        ax.legend(fontsize=7)
    m = result["meta"]
    fig.suptitle(f"GPT n_layer={m['n_layer']} n_embd={m['n_embd']} T={m['block_size']}, "
                 f"{m['microbatches']} micro-batches, best of {m['repeats']}; {m['note']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_table(result: dict) -> None:
    m, cores = result["meta"], result["meta"]["cores"]
    print(f"\n# mesh scaling: GPT n_layer={m['n_layer']} n_embd={m['n_embd']} T={m['block_size']} float32, "
          f"{m['microbatches']} micro-batches per step, 1 BLAS thread per rank, best of {m['repeats']}")
    print(f"# {m['note']}")
    print(f"{'mode':<7}{'mesh':<11}{'ranks':>5} {'batch':>7}{'tokens/s':>10}{'speedup':>9}{'eff':>6}"
          f"{'eff(cores)':>11}{'tok/cpu-s':>11}{'speedup':>9}{'loss':>9}")
    for mode in ("strong", "weak"):
        for r in result[mode]:
            star = "*" if r["oversubscribed"] else " "
            if "error" in r:
                print(f"{mode:<7}{r['mesh']:<11}{r['ranks']:>4}{star} failed: {r['error']}")
                continue
            batch = f"{r['tokens_per_step'] // m['block_size']}x{m['block_size']}"
            print(f"{mode:<7}{r['mesh']:<11}{r['ranks']:>4}{star} {batch:>7}{r['tokens_per_s']:>10.0f}"
                  f"{r['speedup']:>8.2f}x{r['efficiency']:>6.0%}{r['efficiency_cores']:>11.0%}"
                  f"{r['tokens_per_cpu_s']:>11.0f}{r['cpu_speedup']:>8.2f}x{r['loss']:>9.4f}")
    if any(r["oversubscribed"] for r in result["strong"]):
        print(f"* more ranks than the {cores} cores: oversubscribed, the ranks share cores")
    print("tok/cpu-s: tokens per CPU-second of the busiest rank (the rate with a core per rank; on a machine "
          "shared with other work, more processes also get a larger share of it, which inflates wall-clock "
          "speedups)")
    if result["torch"] is None:
        print(f"PyTorch peer skipped: {result['torch_note']}")
    for t in result["torch"] or []:
        print(f"PyTorch {t['version']} eager, 1 process, {t['threads']} thread(s): {t['tokens_per_s']:.0f} tokens/s, "
              f"{t['tokens_per_cpu_s']:.0f} per CPU-s (hpcpar 1x1x1 / torch = "
              f"{result['baseline_tokens_per_s'] / t['tokens_per_s']:.2f}, per CPU-s "
              f"{result['baseline_tokens_per_cpu_s'] / t['tokens_per_cpu_s']:.2f})")
    if result["strong_loss_spread"] is not None:
        print(f"strong scaling: the last step's loss agrees across meshes to {result['strong_loss_spread']:.1e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2,4", help="world sizes to run (1 is always run: the baseline)")
    parser.add_argument("--global-batch", type=int, default=16, help="strong scaling: sequences per step")
    parser.add_argument("--rank-batch", type=int, default=16, help="weak scaling: sequences per step per rank")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (>= the largest pp)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per launch (the median counts)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=2, help="launches per mesh; the best counts")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per launch")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "mesh_scaling.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    for axis in ("dp", "tp", "pp", "threads"):
        parser.add_argument(f"--{axis}", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--mbs", default="1", help=argparse.SUPPRESS)  # comma list for --worker
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.torch_worker:
        torch_worker(args)
        return 0

    worlds = sorted({1, *(int(w) for w in args.worlds.split(",") if w)})
    if any(w not in MESHES for w in worlds):
        parser.error(f"--worlds {args.worlds}: choose from {', '.join(map(str, MESHES))}")
    cores = cores_available()
    sizes = {}  # (dp, tp, pp) -> {mode: micro-batch size}
    try:
        for w in worlds:
            for dp, tp, pp in MESHES[w]:
                if pp > args.microbatches:
                    raise ValueError(f"pp={pp} needs --microbatches >= {pp}, got {args.microbatches}")
                sizes[dp, tp, pp] = {mode: micro_batch_size(mode, dp, tp, pp, args.microbatches, args.global_batch,
                                                            args.rank_batch) for mode in ("strong", "weak")}
    except ValueError as e:
        parser.error(str(e))
    skip_torch = "--no-torch given" if args.no_torch else None if torch_installed() else "torch is not installed"
    torch_threads = sorted({1, cores})

    started, load_before = time.perf_counter(), os.getloadavg()
    plan = {mode: {(*mesh, by_mode[mode]): [] for mesh, by_mode in sizes.items()} for mode in ("strong", "weak")}
    torch_runs: dict[int, list] = {t: [] for t in torch_threads}
    for repeat in range(args.repeats):
        # Every other repeat runs the meshes in reverse order, so that each mesh (the 1x1x1
        # baseline above all) is measured both early and late while other load comes and goes.
        for (dp, tp, pp), by_mode in list(sizes.items())[::-1 if repeat % 2 else 1]:
            batch_sizes = sorted(set(by_mode.values()))  # one launch runs both modes (one run where they agree)
            print(f"[{repeat + 1}/{args.repeats}] {mesh_name(dp, tp, pp):<10} micro-batch "
                  f"{' and '.join(map(str, batch_sizes))}", flush=True)
            out = launch(dp * tp * pp, ["--worker", "--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
                                        "--mbs", ",".join(map(str, batch_sizes)), *model_args(args)], args.timeout)
            by_size = dict(zip(batch_sizes, out)) if isinstance(out, list) else dict.fromkeys(batch_sizes, out)
            for mode, mbs in by_mode.items():
                plan[mode][dp, tp, pp, mbs].append(by_size[mbs])
            if (dp, tp, pp) == (1, 1, 1) and not skip_torch:  # next to the baseline, under the same load
                for threads in torch_threads:
                    print(f"[{repeat + 1}/{args.repeats}] PyTorch eager, {threads} thread(s)", flush=True)
                    torch_runs[threads].append(launch(None, ["--torch-worker", "--threads", str(threads), "--mbs",
                                                             str(by_mode["strong"]), *model_args(args)], args.timeout))

    baselines = {}  # mode -> the 1x1x1 run's best rates
    for mode, runs in plan.items():
        base = next(results for (dp, tp, pp, _), results in runs.items() if dp * tp * pp == 1)
        if all("error" in r for r in base):
            print(f"the 1x1x1 baseline ({mode} scaling) failed: {base[0]['error']}", file=sys.stderr)
            return 1
        baselines[mode] = {key: max(r[key] for r in base if "error" not in r)
                           for key in ("tokens_per_s", "tokens_per_cpu_s")}
    torch_rows = None
    if not skip_torch:
        torch_rows = []
        for threads, runs in torch_runs.items():
            ok = [r for r in runs if "error" not in r]
            torch_rows.append(max(ok, key=lambda r: r["tokens_per_s"]) if ok else {"threads": threads, **runs[0]})
        torch_rows = [t for t in torch_rows if "error" not in t] or None
        if torch_rows is None:
            skip_torch = f"the PyTorch worker failed: {torch_runs[1][0]['error']}"
    strong = summarise(plan["strong"], baselines["strong"], cores)
    weak = summarise(plan["weak"], baselines["weak"], cores)
    losses = [r["loss"] for r in strong if "error" not in r]
    oversubscribed = [w for w in worlds if w > cores]
    result = {
        "meta": {"n_layer": args.layers, "n_embd": args.embd, "n_head": args.heads, "block_size": args.block,
                 "dtype": "float32", "microbatches": args.microbatches, "global_batch": args.global_batch,
                 "rank_batch": args.rank_batch, "steps": args.steps, "warmup": args.warmup,
                 "repeats": args.repeats, "worlds": worlds, "cores": cores, "threads_per_rank": 1,
                 "load_average_before": load_before, "load_average_after": os.getloadavg(),
                 "wall_s": time.perf_counter() - started, "argv": sys.argv[1:],
                 "note": (f"the machine has {cores} cores: {' and '.join(map(str, oversubscribed))}-rank runs are "
                          "oversubscribed (ranks share cores)" if oversubscribed else
                          f"every run has a core per rank ({cores} cores)")},
        "baseline_tokens_per_s": baselines["strong"]["tokens_per_s"],
        "baseline_tokens_per_cpu_s": baselines["strong"]["tokens_per_cpu_s"], "strong": strong, "weak": weak,
        "torch": torch_rows, "torch_note": skip_torch,
        "strong_loss_spread": max(losses) - min(losses) if len(losses) > 1 else None,
    }
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    try:
        plot(result, out.with_suffix(".png"))
        print(f"wrote {out} and {out.with_suffix('.png')} ({result['meta']['wall_s']:.0f} s)")
    except ImportError:
        print(f"wrote {out} ({result['meta']['wall_s']:.0f} s; matplotlib not installed: no plot)")
    failed = [r for r in strong + weak if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
