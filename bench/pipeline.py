"""Pipeline bubble: the real executor on stages of known cost, measured against the schedule math.

    mpiexec -n 4 python bench/pipeline.py [--t-forward 0.2] [--t-backward 0.2] [--t-weight 0.2]
                                          [--microbatches 8,16] [--schedules 1f1b,zbh1,zbv,interleaved]

Every rank is one pipeline rank (pp = world size). The stage modules are replaced by sleep
stages: per micro-batch and rank a forward sleeps t_f, B (the input's gradient) t_b and W (the
weights' gradient) t_w, each divided over the rank's chunks; a schedule without weight actions
runs B and W in one backward (t_b + t_w). Ranks sharing a few cores do not slow each other down,
and activations are tiny, so messages cost ~0. For each schedule and m the step time (slowest
rank, between barriers, median of --steps after one warm-up) is compared with
simulate.predict_step_time (the simulator replaying the same action lists) and the formulas
    1F1B / GPipe:  (m + p - 1)(t_f + t_b + t_w)     interleaved (v chunks):  (m + (p - 1)/v)(t_f + t_b + t_w)
    ZB-H1:         m (t_f + t_b + t_w) + (p - 1)(t_f + t_b - t_w)
A case passes when measured is within --tolerance (10%) of the prediction. A "calibrated"
prediction (the simulator fed the sleeps' real mean durations) separates oversleeping on a loaded
machine from executor overhead.

Side by side (same run, same m): every schedule against 1F1B. The bubble is the idle time of a
step (every schedule does the same work, so this is the time it wastes): the step time minus
the time each rank spent in forward, B and W as the executor clocked it (mean over ranks), so
that the sleeps' own oversleep counts as work, not as bubble. Its ratio to 1F1B's must be <= 0.4 for
ZB-H1 and <= 0.2 for ZB-V (Qi et al.: a third, and near zero), at a peak stash (the executor's
count of chunk activations held at once, in micro-batches of a rank's layers, worst rank) no
larger than 1F1B's. Also reported: the idle time from the step time, step - m (t_f + t_b + t_w)
(oversleep included), and the ratio of the idle fractions 1 - work / step. Results go to
bench/results/pipeline.json (+ pipeline.png); the exit status is 1 if a case is off or a ratio
misses its bound.

    mpiexec -n 4 python bench/pipeline.py --gpt [--gpt-meshes pp4,dp2xpp2] [--gpt-steps 3]
    mpiexec -n 2 python bench/pipeline.py --gpt --gpt-meshes pp2

Real training instead (`--gpt`): a float32 GPT (8 layers, C = 128, T = 128, 8 micro-batches of 2)
trained by `Trainer.train_step` (the step of `hpcpar train`) on pp=4 and on dp=2 x pp=2 (or pp=2
on 2 ranks), with every schedule of --schedules (interleaved: --chunks) built side by side in one
run. The schedules take turns, one step each, for --gpt-warmup + --gpt-steps rounds, so that a
change in the machine's load hits them alike; tokens/s = tokens per step / the slowest rank's
step time (median of the timed rounds), with the ratio to 1F1B's, and the time of the
synchronous global checks (loss mean and gradient norm for clipping and the NaN check) on the
last rank to reach them (the collectives alone) and on the first (waiting for the others
included). Every schedule trains the same batches from the same initialisation, so their losses
agree (the largest relative difference is printed).
Results: bench/results/pipeline_gpt.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from hpcpar import environment

environment.set_default_threads()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpar.autograd import ops  # noqa: E402
from hpcpar.runtime.mesh import Mesh  # noqa: E402
from hpcpar.nn.gpt import GPTConfig  # noqa: E402
from hpcpar.parallel.pp import schedules, simulate  # noqa: E402
from hpcpar.parallel.pp.executor import PipelineExecutor  # noqa: E402
from hpcpar.autograd.tensor import Tensor  # noqa: E402

CHANNELS = 8
RESULTS = Path(__file__).parent / "results"
# Bounds on the bubble (idle seconds) relative to 1F1B's, and what they mean (issue 16).
BOUNDS = {"zbh1": 0.4, "zbv": 0.2}


class SleepStage:
    """Stands in for a GPT stage: forward sleeps `t_forward`, B `t_backward`, W `t_weight`.

    The output is `s(h) * w` for a leaf parameter `w`, where s is an identity op whose backward
    sleeps (B: it lies on the input's gradient path) and `w`'s grad hook sleeps too (W: it fires
    when `w`'s gradient is accumulated, in the weight action under a split backward). The first
    stage makes h, a leaf, from the token ids' shape; the last returns a scalar "loss". `spent`
    collects how long each sleep really took (a loaded machine oversleeps), per kind.
    """

    def __init__(self, t_forward: float, t_backward: float, t_weight: float, first: bool, last: bool):
        self.config = GPTConfig(n_embd=CHANNELS, dtype="float64")
        self.cost = {"forward": t_forward, "backward": t_backward, "weight": t_weight}
        self.first, self.last = first, last
        self.spent: dict[str, list[float]] = {k: [] for k in self.cost}
        self.w = Tensor(np.ones(1), requires_grad=True)
        self.w.register_grad_hook(lambda _: self._sleep("weight"))

    def _sleep(self, kind: str) -> None:
        start = time.perf_counter()
        time.sleep(self.cost[kind])
        self.spent[kind].append(time.perf_counter() - start)

    def _b(self, g):
        self._sleep("backward")
        return (g,)

    def __call__(self, x, targets=None) -> Tensor:
        self._sleep("forward")
        h = Tensor(np.zeros(x.shape + (CHANNELS,)), requires_grad=True) if self.first else x
        out = Tensor.from_op(h.data, (h,), self._b) * self.w
        return ops.mean(out) if self.last else out


def measure(mesh: Mesh, name: str, m: int, chunks: int, t_f: float, t_b: float, t_w: float, steps: int) -> dict:
    """Step time of schedule `name` with sleep stages (median over `steps`, slowest rank)."""
    pp, rank = mesh.size("pp"), mesh.rank("pp")
    place = schedules.placement(name, pp, chunks)
    chunks = place.chunks
    stages = [SleepStage(t_f / chunks, t_b / chunks, t_w / chunks, place.stage(rank, c) == 0,
                         place.stage(rank, c) == place.stages - 1) for c in range(chunks)]
    actions = schedules.build(name, pp, m, chunks)
    executor = PipelineExecutor(stages, mesh, actions[rank], m, placement=place)
    batch = (np.zeros((1, 4), dtype=np.int64), np.zeros((1, 4), dtype=np.int64))
    world = mesh.world.mpi
    times = []
    for step in range(steps + 1):  # the first is a warm-up
        world.Barrier()
        start = time.perf_counter()
        executor.run([batch] * m)
        world.Barrier()
        elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if step:
            times.append(elapsed)
        else:  # the warm-up's compute time is not counted
            warmup_busy = executor.measured_busy()
    measured = statistics.median(times)
    sim = simulate.simulate(actions, t_f, t_b, 0.0, t_w, place)
    work = m * (t_f + t_b + t_w)
    formulas = {"interleaved": (m + (pp - 1) / chunks) * (t_f + t_b + t_w),
                "zbh1": work + (pp - 1) * (t_f + t_b - t_w) if m >= pp else None}
    formula = formulas.get(name, (m + pp - 1) * (t_f + t_b + t_w)) if name != "zbv" else None
    bubbles = world.allgather(executor.measured_bubble())
    # Idle seconds per step: the step (barrier to barrier) minus the time the rank spent in
    # forward, B and W as the executor clocked it, mean over ranks and the measured steps; the
    # bubble with the sleeps' oversleep counted as work, not as idle.
    busy = (executor.measured_busy() - warmup_busy) / steps
    executor_idle = statistics.mean(times) - statistics.mean(world.allgather(busy))
    # The costs the sleeps really had (mean over ranks and chunks, per micro-batch per rank):
    # the simulator fed these shows how much of the gap is oversleeping rather than the executor.
    real = {}
    for k in ("forward", "backward", "weight"):
        spent = [x for rank_spent in world.allgather([t for s in stages for t in s.spent[k]]) for x in rank_spent]
        real[k] = statistics.mean(spent) * chunks
    calibrated = simulate.simulate(actions, real["forward"], real["backward"], 0.0, real["weight"], place).makespan
    peak = max(world.allgather(executor.peak_stash)) / chunks
    return {"schedule": name, "pp": pp, "microbatches": m, "chunks": chunks, "t_forward": t_f,
            "t_backward": t_b, "t_weight": t_w, "measured_s": measured, "predicted_s": sim.makespan,
            "formula_s": formula, "error": measured / sim.makespan - 1, "real_t_forward": real["forward"],
            "real_t_backward": real["backward"], "real_t_weight": real["weight"], "calibrated_s": calibrated,
            "calibrated_error": measured / calibrated - 1,
            "measured_idle_s": measured - work, "predicted_idle_s": sim.makespan - work,
            "measured_bubble": 1 - work / measured, "predicted_bubble": 1 - work / sim.makespan,
            "measured_peak_stash": peak, "predicted_peak_stash": max(sim.peak_memory),
            "executor_idle_s": executor_idle, "executor_bubble_per_rank": bubbles, "step_times_s": times}


def compare(rows: list[dict]) -> list[dict]:
    """Per m, every schedule against 1F1B of the same run: ratios of idle time, idle fraction and
    peak stash, and whether the schedule's bound (`BOUNDS`) holds."""
    out = []
    for r in rows:
        base = next((b for b in rows if b["schedule"] == "1f1b" and b["microbatches"] == r["microbatches"]), None)
        if base is None or r is base:
            continue
        ratio = r["executor_idle_s"] / base["executor_idle_s"]
        bound = BOUNDS.get(r["schedule"])
        out.append({"schedule": r["schedule"], "microbatches": r["microbatches"],
                    "idle_ratio": ratio, "predicted_idle_ratio": r["predicted_idle_s"] / base["predicted_idle_s"],
                    "step_idle_ratio": r["measured_idle_s"] / base["measured_idle_s"],
                    "bubble_fraction_ratio": r["measured_bubble"] / base["measured_bubble"],
                    "step_time_ratio": r["measured_s"] / base["measured_s"],
                    "peak_stash": r["measured_peak_stash"], "peak_stash_1f1b": base["measured_peak_stash"],
                    "bound": bound, "ok": bound is None or (ratio <= bound and
                                                            r["measured_peak_stash"] <= base["measured_peak_stash"])})
    return out


def _time_checks(trainer) -> None:
    """Time what the step's global checks take on this rank (`trainer.check_s`, seconds, reset by the caller):
    the step's agreement (`Trainer._agree`: the loss mean over every rank, the global gradient norm
    and the rest in one world all-gather), the synchronisation every rank waits for before the
    optimizer step."""
    trainer.check_s = 0.0

    def timed(fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                trainer.check_s += time.perf_counter() - start
        return wrapper
    trainer._agree = timed(trainer._agree)


GPT_MESHES = {"pp4": (1, 4), "dp2xpp2": (2, 2), "pp2": (1, 2)}  # name -> (dp, pp); dp * pp = ranks


def gpt(args: argparse.Namespace) -> int:
    """Tokens/s of each schedule training a real GPT, side by side (see the module doc)."""
    from hpcpar.config.load import load_config
    from hpcpar.training.trainer import Trainer

    world = MPI.COMM_WORLD
    model = ["model.n_layer=8", "model.n_embd=128", "model.n_head=4", "model.block_size=128", "model.dtype=float32",
             "train.micro_batch_size=2", "train.microbatches=8", "train.steps=1000", "run.progress=false",
             "run.eval_every=0"]
    tokens = np.random.default_rng(0).integers(0, 256, 200_000).astype(np.uint8)
    result = {"model": model, "ranks": world.Get_size(), "meshes": []}
    for mesh_name in args.gpt_meshes.split(","):
        dp, pp = GPT_MESHES[mesh_name]
        trainers = {}
        for name in args.schedules.split(","):
            chunks = args.chunks if name == "interleaved" else 0
            cfg = load_config(None, model + [f"mesh.dp={dp}", f"mesh.pp={pp}", "mesh.tp=1",
                                                    f"pipeline.schedule={name}", f"pipeline.chunks={chunks}"])
            trainers[name] = Trainer(cfg, world, tokens=tokens)
            _time_checks(trainers[name])
        times: dict[str, list[float]] = {n: [] for n in trainers}
        losses: dict[str, list[float]] = {n: [] for n in trainers}
        check_times: dict[str, list[float]] = {n: [] for n in trainers}
        for step in range(args.gpt_warmup + args.gpt_steps):
            for name, trainer in trainers.items():  # one step each, in turn
                world.Barrier()
                start = time.perf_counter()
                losses[name].append(trainer.train_step(step).loss)
                elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
                # The last rank to reach the checks waits only for the collectives themselves (min
                # over ranks); the others also wait for it (max: load imbalance included).
                checks = (world.allreduce(trainer.check_s, op=MPI.MIN), world.allreduce(trainer.check_s, op=MPI.MAX))
                trainer.check_s = 0.0
                if step >= args.gpt_warmup:  # the first steps allocate buffers and open connections
                    times[name].append(elapsed)
                    check_times[name].append(checks)
        rows = []
        for name, trainer in trainers.items():
            step_s = statistics.median(times[name])
            rows.append({"schedule": name, "chunks": trainer.placement.chunks, "step_s": step_s,
                         "step_s_all": times[name], "tokens_per_step": trainer.tokens_per_step,
                         "tokens_per_s": trainer.tokens_per_step / step_s,
                         "pipeline_bubble": statistics.mean(world.allgather(trainer.executor.measured_bubble())),
                         "check_s": statistics.median(c for c, _ in check_times[name]),
                         "check_fraction": statistics.median(c for c, _ in check_times[name]) / step_s,
                         "check_with_wait_s": statistics.median(w for _, w in check_times[name]),
                         "losses": losses[name]})
        ref = next((r for r in rows if r["schedule"] == "1f1b"), rows[0])
        for r in rows:
            r["tokens_per_s_vs_1f1b"] = r["tokens_per_s"] / ref["tokens_per_s"]
            r["loss_rel_diff_vs_1f1b"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
        result["meshes"].append({"mesh": mesh_name, "dp": dp, "pp": pp, "rows": rows})
        for trainer in trainers.values():
            trainer.mesh.free()
    if world.Get_rank() == 0:
        print(f"GPT training, {world.Get_size()} ranks: " + " ".join(model))
        print(f"{'mesh':<9}{'schedule':<13}{'v':>3}{'step s':>9}{'tokens/s':>10}{'vs 1f1b':>9}{'bubble':>9}"
              f"{'checks ms':>11}{'+wait ms':>10}{'loss diff':>11}")
        for mesh in result["meshes"]:
            for r in mesh["rows"]:
                print(f"{mesh['mesh']:<9}{r['schedule']:<13}{r['chunks']:>3}{r['step_s']:>9.3f}"
                      f"{r['tokens_per_s']:>10.0f}{r['tokens_per_s_vs_1f1b']:>9.3f}{r['pipeline_bubble']:>9.1%}"
                      f"{1e3 * r['check_s']:>11.2f}{1e3 * r['check_with_wait_s']:>10.2f}"
                      f"{r['loss_rel_diff_vs_1f1b']:>11.1e}")
        print("checks: the loss mean and the global gradient norm (clipping, NaN check) every rank waits for "
              "before the optimizer step: on the last rank to get there (the collectives alone), and +wait on "
              "the first (the load imbalance of the step included)")
        out = Path(args.out or RESULTS / "pipeline_gpt.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['schedule']}\nm={r['microbatches']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(1.1 * len(rows) + 2, 4))
    ax.bar(x - 0.2, [r["predicted_s"] for r in rows], 0.4, label="predicted (simulator)")
    ax.bar(x + 0.2, [r["measured_s"] for r in rows], 0.4, label="measured")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("step time (s)")
    ax.set_title(f"pipeline step time, pp={rows[0]['pp']}, t_f={rows[0]['t_forward']}s, "
                 f"t_b={rows[0]['t_backward']}s, t_w={rows[0]['t_weight']}s (sleep stages)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t-forward", type=float, default=0.2, help="forward seconds per micro-batch per rank")
    parser.add_argument("--t-backward", type=float, default=0.2,
                        help="B (input gradient) seconds per micro-batch per rank")
    parser.add_argument("--t-weight", type=float, default=0.2,
                        help="W (weight gradient) seconds per micro-batch per rank")
    parser.add_argument("--microbatches", default="8,16")
    parser.add_argument("--schedules", default="1f1b,zbh1,zbv,interleaved",
                        help="comma list; interleaved uses --chunks, zbv its own 2")
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per case (after one warm-up)")
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--out", default=None, help="results JSON (default bench/results/pipeline.json, with "
                                                      "--gpt pipeline_gpt.json)")
    parser.add_argument("--gpt", action="store_true", help="train a real GPT with each schedule instead (tokens/s)")
    parser.add_argument("--gpt-meshes", default="pp4,dp2xpp2", help=f"comma list of {', '.join(GPT_MESHES)}")
    parser.add_argument("--gpt-warmup", type=int, default=2)
    parser.add_argument("--gpt-steps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.gpt:
        return gpt(args)

    world = MPI.COMM_WORLD
    mesh = Mesh(pp=world.Get_size(), comm=world)
    costs = (args.t_forward, args.t_backward, args.t_weight)
    rows = []
    for m in (int(s) for s in args.microbatches.split(",")):
        for name in args.schedules.split(","):  # the schedules of one m one after the other
            chunks = args.chunks if name == "interleaved" else 0
            schedules.validate(name, mesh.size("pp"), m, chunks)
            rows.append(measure(mesh, name, m, chunks, *costs, args.steps))
    ratios = compare(rows)
    off = [r for r in rows if abs(r["error"]) > args.tolerance]
    missed = [c for c in ratios if not c["ok"]]
    if world.Get_rank() == 0:
        print(f"pp={mesh.size('pp')}  t_f={args.t_forward}s  t_b={args.t_backward}s  t_w={args.t_weight}s  "
              "(sleep stages)")
        print(f"{'schedule':<12}{'v':>3}{'m':>4}{'simulated s':>13}{'measured s':>12}{'error':>8}"
              f"{'idle pred s':>13}{'idle meas s':>13}{'bubble meas':>13}{'peak stash':>12}{'calibrated s':>14}"
              f"{'error':>8}")
        for r in rows:
            print(f"{r['schedule']:<12}{r['chunks']:>3}{r['microbatches']:>4}"
                  f"{r['predicted_s']:>13.3f}{r['measured_s']:>12.3f}{r['error']:>+8.1%}"
                  f"{r['predicted_idle_s']:>13.3f}{r['measured_idle_s']:>13.3f}{r['measured_bubble']:>13.1%}"
                  f"{r['measured_peak_stash']:>12.1f}{r['calibrated_s']:>14.3f}{r['calibrated_error']:>+8.1%}")
        print("calibrated: the simulator fed the sleeps' real mean durations (oversleep on a loaded machine)")
        print(f"{len(rows) - len(off)}/{len(rows)} cases within {args.tolerance:.0%} of the prediction")
        print("\nagainst 1F1B of the same m (idle ratio: step time - the ranks' measured compute; from step: step "
              "time - nominal work; peak stash in micro-batches of a rank's layers)")
        print(f"{'schedule':<12}{'m':>4}{'idle ratio':>12}{'predicted':>11}{'bound':>7}{'from step':>11}"
              f"{'fraction ratio':>16}{'step ratio':>12}{'peak stash':>12}{'1f1b':>6}  ok")
        for c in ratios:
            bound = f"{c['bound']:.1f}" if c["bound"] is not None else "-"
            print(f"{c['schedule']:<12}{c['microbatches']:>4}{c['idle_ratio']:>12.3f}{c['predicted_idle_ratio']:>11.3f}"
                  f"{bound:>7}{c['step_idle_ratio']:>11.3f}{c['bubble_fraction_ratio']:>16.3f}"
                  f"{c['step_time_ratio']:>12.3f}"
                  f"{c['peak_stash']:>12.1f}{c['peak_stash_1f1b']:>6.1f}  {'yes' if c['ok'] else 'NO'}")
        out = Path(args.out or RESULTS / "pipeline.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"tolerance": args.tolerance, "bounds": BOUNDS, "cases": rows,
                                   "against_1f1b": ratios}, indent=2))
        try:
            plot(rows, out.with_suffix(".png"))
        except ImportError:
            print("matplotlib not installed: no plot")
    return 1 if off or missed else 0


if __name__ == "__main__":
    sys.exit(main())
