"""Pipeline bubble: the real executor on stages of known cost, measured against the schedule math.

    mpiexec -n 4 python bench/pipeline.py [--t-forward 0.05] [--t-backward 0.1] [--microbatches 4,8,16]

Every rank is one pipeline stage (pp = world size). The stage modules are replaced by sleep
stages: a forward sleeps t_f / chunks and a backward t_b / chunks (from a gradient hook), so a
micro-batch costs t_f + t_b per rank whatever the chunking, and ranks sharing a few cores do not
slow each other down. Activations are tiny, so messages cost ~0. For each schedule and m the
step time (slowest rank, between barriers, median of --steps after one warm-up) is compared with
    schedule.predict_step_time (the simulator replaying the same action lists), and the formulas
    1F1B / GPipe:  (m + p - 1)(t_f + t_b)        interleaved (v chunks):  (m + (p - 1)/v)(t_f + t_b)
A case passes when measured is within --tolerance (10%) of the prediction. A "calibrated"
prediction (the simulator fed the sleeps' real mean durations) separates oversleeping on a loaded
machine from executor overhead. Results go to
bench/results/pipeline.json (+ pipeline.png); the exit status is 1 if any case is off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from hpcpar import threads

threads.set_default_threads()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpar import ops  # noqa: E402
from hpcpar.mesh import Mesh  # noqa: E402
from hpcpar.nn.gpt import GPTConfig  # noqa: E402
from hpcpar.parallel import schedule  # noqa: E402
from hpcpar.parallel.pipeline import PipelineExecutor  # noqa: E402
from hpcpar.tensor import Tensor  # noqa: E402

CHANNELS = 8


class SleepStage:
    """Stands in for a GPT stage: forward sleeps `t_forward`, backward `t_backward`.

    The output is `h * w` for a leaf `w`, so the executor's backward reaches `w`, whose grad
    hook does the backward's sleep. The first stage makes h from the token ids' shape; the last
    returns a scalar "loss". `spent` collects how long each sleep really took (a loaded machine
    oversleeps), per kind.
    """

    def __init__(self, t_forward: float, t_backward: float, first: bool, last: bool):
        self.config = GPTConfig(n_embd=CHANNELS, dtype="float64")
        self.t_forward, self.t_backward, self.first, self.last = t_forward, t_backward, first, last
        self.spent: dict[str, list[float]] = {"forward": [], "backward": []}
        self.w = Tensor(np.ones(1), requires_grad=True)
        self.w.register_grad_hook(lambda _: self._sleep("backward", self.t_backward))

    def _sleep(self, kind: str, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.spent[kind].append(time.perf_counter() - start)

    def __call__(self, x, targets=None) -> Tensor:
        self._sleep("forward", self.t_forward)
        h = Tensor(np.zeros(x.shape + (CHANNELS,))) if self.first else x
        out = h * self.w
        return ops.mean(out) if self.last else out


def measure(mesh: Mesh, name: str, m: int, chunks: int, t_f: float, t_b: float, steps: int) -> dict:
    """Step time of schedule `name` with sleep stages (median over `steps`, slowest rank)."""
    pp, rank = mesh.size("pp"), mesh.rank("pp")
    stages = [SleepStage(t_f / chunks, t_b / chunks, schedule.stage_of(rank, c, pp) == 0,
                         schedule.stage_of(rank, c, pp) == pp * chunks - 1) for c in range(chunks)]
    executor = PipelineExecutor(stages, mesh, schedule.build(name, pp, m, chunks)[rank], m)
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
    measured = statistics.median(times)
    predicted = schedule.predict_step_time(name, pp, m, chunks, t_f, t_b)
    v = chunks
    formula = (m + (pp - 1) / v) * (t_f + t_b) if name == "interleaved" else (m + pp - 1) * (t_f + t_b)
    bubbles = world.allgather(executor.measured_bubble())
    # The costs the sleeps really had (mean over ranks and chunks, per micro-batch per rank):
    # the simulator fed these shows how much of the gap is oversleeping rather than the executor.
    real = {k: statistics.mean(x for rank_spent in world.allgather([t for s in stages for t in s.spent[k]])
                               for x in rank_spent) * chunks for k in ("forward", "backward")}
    calibrated = schedule.predict_step_time(name, pp, m, chunks, real["forward"], real["backward"])
    return {"schedule": name, "pp": pp, "microbatches": m, "chunks": chunks, "t_forward": t_f,
            "t_backward": t_b, "measured_s": measured, "predicted_s": predicted, "formula_s": formula,
            "error": measured / predicted - 1, "real_t_forward": real["forward"],
            "real_t_backward": real["backward"], "calibrated_s": calibrated,
            "calibrated_error": measured / calibrated - 1, "measured_bubble": 1 - m * (t_f + t_b) / measured,
            "predicted_bubble": 1 - m * (t_f + t_b) / predicted,
            "executor_bubble_per_rank": bubbles, "step_times_s": times}


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
                 f"t_b={rows[0]['t_backward']}s (sleep stages)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t-forward", type=float, default=0.05, help="forward seconds per micro-batch per rank")
    parser.add_argument("--t-backward", type=float, default=0.1, help="backward seconds per micro-batch per rank")
    parser.add_argument("--microbatches", default="4,8,16")
    parser.add_argument("--schedules", default="1f1b,interleaved", help="comma list; interleaved uses --chunks")
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per case (after one warm-up)")
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline.json"))
    args = parser.parse_args(argv)

    world = MPI.COMM_WORLD
    mesh = Mesh(pp=world.Get_size(), comm=world)
    rows = []
    for name in args.schedules.split(","):
        chunks = args.chunks if name == "interleaved" else 1
        for m in (int(s) for s in args.microbatches.split(",")):
            schedule.validate(name, mesh.size("pp"), m, chunks)
            rows.append(measure(mesh, name, m, chunks, args.t_forward, args.t_backward, args.steps))
    off = [r for r in rows if abs(r["error"]) > args.tolerance]
    if world.Get_rank() == 0:
        print(f"pp={mesh.size('pp')}  t_f={args.t_forward}s  t_b={args.t_backward}s  (sleep stages)")
        print(f"{'schedule':<12}{'v':>3}{'m':>4}{'formula s':>11}{'simulated s':>13}{'measured s':>12}"
              f"{'error':>8}{'bubble pred':>13}{'bubble meas':>13}{'calibrated s':>14}{'error':>8}")
        for r in rows:
            print(f"{r['schedule']:<12}{r['chunks']:>3}{r['microbatches']:>4}{r['formula_s']:>11.3f}"
                  f"{r['predicted_s']:>13.3f}{r['measured_s']:>12.3f}{r['error']:>+8.1%}"
                  f"{r['predicted_bubble']:>13.1%}{r['measured_bubble']:>13.1%}"
                  f"{r['calibrated_s']:>14.3f}{r['calibrated_error']:>+8.1%}")
        print("calibrated: the simulator fed the sleeps' real mean durations (oversleep on a loaded machine)")
        print(f"{len(rows) - len(off)}/{len(rows)} cases within {args.tolerance:.0%} of the prediction")
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"tolerance": args.tolerance, "cases": rows}, indent=2))
        try:
            plot(rows, out.with_suffix(".png"))
        except ImportError:
            print("matplotlib not installed: no plot")
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
