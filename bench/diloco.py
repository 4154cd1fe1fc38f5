"""Local SGD and DiLoCo against synchronous data parallelism: loss, replica-axis bytes, tokens/s on slow links.

    mpiexec -n 4 python bench/diloco.py [--steps 300] [--every 1,10,50,100] [--goal-every 50] [--quick]

Every run trains through `Trainer.train` (the loop of `hpcpar train`) a small GPT (`--layers`
blocks, n_embd `--embd`, T `--block`, float32, AdamW inner optimizer with the default job's
schedule: lr 3e-3, 20 warm-up steps, cosine to 3e-4) on the default corpus, `--steps` steps of one
global batch of `--batch` sequences whatever the mesh: so every run sees the same tokens. For R
replicas (R = 2 and 4, `--replicas`) on R ranks, one rank per replica:

- step:   `train.sync=step` on `mesh.dp=R` (ordinary data parallelism: the gradients averaged over
          the R ranks every step), with `train.grad_compression` none, and as the compressors to
          beat int8 and top-k (`--ratio`, after `--warm-up` uncompressed steps, error feedback);
- local:  `train.sync=local` on `mesh.dp=R mesh.dp_replicate=R` (each replica steps on its own
          gradient; the parameters averaged every H steps), H in `--every`;
- diloco: `train.sync=diloco`, the same mesh, outer Nesterov SGD lr 0.7, momentum 0.9 (DiLoCo's
          defaults), H in `--every`; at `--goal-every` also with `train.outer_compression=int8` and
          streamed (`train.sync_fragments=2 train.sync_delay=1`).

With 4 ranks the R = 2 runs go two at a time, each on a communicator of 2 ranks (the world split in
halves); their step times are therefore not used. Every H divides `--steps`, so every run (but the
streamed one, whose two fragments land at different steps) ends on a synchronisation and its
replicas hold the same parameters.

Loss: the mean of the last 10 steps' training losses (the mean over the replicas, each on its own
parameters), and the validation loss after the last step (`Trainer.evaluate`, `--eval-batches`
global batches; the streamed run: the mean of its replicas'); gap = loss / step's loss - 1, same R.

Bytes on the replica axis per step: `Communicator.sent` (hpcpar's count of what a bandwidth-optimal
algorithm sends for each op) of the dp communicator (step mode: `grad_bytes_sent`) or of the
dp_replicate communicator (`outer_bytes_sent`, counted at the steps a fragment starts its
reduction), mean over ranks and steps, next to the formula (N parameters, s = 4 bytes, R ranks, b =
`train.int8_block_size`, n_p the elements of parameter p, N_b of gradient bucket b):

    step none              2 (R-1)/R s N                 ring all-reduce every step
    step int8              2 (R-1)/R N (1 + 4/b)
    step top-k             (R-1) sum_b ceil(ratio N_b) (4 + s)
    local, diloco          2 (R-1)/R s N / H             one all-reduce of the parameter change per H steps
    diloco, outer int8     (R-1) sum_p (n_p + 4 ceil(n_p/b)) / H    all-gather of int8 codes + scales
                           (~ (R-1) N (1 + 4/b) / H)

Fragments (streaming) split the same bytes into F all-reduces H/F steps apart.

Tokens/s on a slow replica axis (modelled; this machine's ranks share memory): short timing runs
of the largest R, the world (`--time-steps` steps, `--rounds` rounds in alternation so that load from elsewhere hits
all alike, per setting the fastest round's median step): step mode with none, int8 and top-k
(compressing from the first step); local, diloco, diloco int8 at H = 2 (a sync after every other
step: inner and sync steps side by side) and streamed at H = 2 (a fragment starts and one lands
after every step). t0 = the compute-only step (median of the H = 2 runs' inner steps); each
setting's own work per step o: a compressor's step minus step none's; local / diloco: a sync
step minus an inner step (streamed: a step minus t0), times F / H. Then with a link of bandwidth
L and latency alpha per message

    T(L) = t0 + o + S / L + alpha h        (S bytes and h messages in a row per step; ring all-reduce
                                            2 (R-1) per call, all-gather R - 1)
    streamed, delay tau: T(L) = t0 + o + (F/H) max(0, S_f / L + alpha h_f - tau t0)
                                           (a fragment's reduction overlaps tau steps of compute)

tokens/s = tokens per step / T(L), at `--links` Gb/s. Step mode's overlap of the gradient
all-reduce with backward is not credited (at most one backward per step). L*: the link speed below
which one setting beats another in tokens/s ("any": it is not slower at any speed).

`--link-check` measures one point on a real link instead: step, step int8 and diloco H =
`--goal-every` on the world (R = its ranks), `--link-steps` steps each, their mean step and
tokens/s; with `--predict-from` (the JSON of the same run on an unshaped link) next to the
prediction (that run's mean step + bytes / `--link-gbps`). On the emulated cluster:

    python tests/cluster/harness.py --nodes 2 --ranks-per-node 1 [--rate 100mbit] -- \
        python bench/diloco.py --link-check --goal-every 50 --out FILE [--predict-from UNSHAPED --link-gbps 0.1]

Goal (issue #44): a local / diloco setting within 3 % of step's loss (both the final training loss
and the validation loss, same R) at <= 2 % of step's replica-axis bytes. Exit status 1 if none
meets it. Prints tables; writes bench/results/diloco.json and diloco.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcpar import environment

environment.set_default_threads()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpar.config.load import load_config  # noqa: E402
from hpcpar.parallel.dp.outer import syncs_after  # noqa: E402
from hpcpar.training.trainer import Trainer  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
S = 4  # bytes per float32
GOAL_LOSS, GOAL_BYTES = 0.03, 0.02


def say(*a) -> None:
    if RANK == 0:
        print(*a, flush=True)


@dataclass(frozen=True)
class Setting:
    """One run: the sync mode and its knobs (step mode: the gradient compressor)."""

    mode: str                     # step, local, diloco
    every: int = 1                # H
    outer_compression: str = "none"
    fragments: int = 1
    delay: int = 0
    grad_compression: str = "none"
    ratio: float = 0.01           # top-k
    start: int = 0                # train.compression_start_step (top-k's warm-up)

    @property
    def name(self) -> str:
        if self.mode == "step":
            knob = {"int8": " int8", "topk": f" top-k {self.ratio:g}"}.get(self.grad_compression, "")
            return "step" + knob + (f" (warm-up {self.start})" if self.start else "")
        extra = (f" {self.outer_compression}" if self.outer_compression != "none" else "") + (
            f" F={self.fragments} tau={self.delay}" if self.fragments > 1 or self.delay else "")
        return f"{self.mode} H={self.every}{extra}"


def overrides(args, replicas: int, s: Setting) -> list[str]:
    base = [f"model.n_layer={args.layers}", f"model.n_embd={args.embd}", f"model.n_head={args.heads}",
            f"model.block_size={args.block}", "model.dtype=float32", f"mesh.dp={replicas}", "mesh.tp=1",
            "mesh.pp=1", "train.zero=0", f"train.micro_batch_size={args.batch // replicas}", "train.microbatches=1",
            f"train.steps={args.steps}", f"train.lr={args.lr}", "run.eval_every=0", "run.progress=false"]
    if s.mode == "step":
        return base + ["mesh.dp_replicate=1", f"train.grad_compression={s.grad_compression}",
                       f"train.compression_ratio={s.ratio}", f"train.compression_start_step={s.start}"]
    return base + [f"mesh.dp_replicate={replicas}", f"train.sync={s.mode}", f"train.sync_every={s.every}",
                   f"train.outer_lr={args.outer_lr}", f"train.outer_momentum={args.outer_momentum}",
                   f"train.sync_fragments={s.fragments}", f"train.sync_delay={s.delay}",
                   f"train.outer_compression={s.outer_compression}"]


def formula(trainer: Trainer, s: Setting, replicas: int) -> tuple[float, float, int]:
    """(bytes per step by the module docstring's formula, messages in a row per step, parameters N)."""
    R, b = replicas, trainer.cfg.train.int8_block_size
    params = [p for _, p in trainer.named_parameters if not getattr(p, "tied_to", None)]
    n = sum(int(p.data.size) for p in params)
    ring = 2 * (R - 1) / R
    if s.mode == "step":
        buckets = len(trainer.dp.buckets)
        if s.grad_compression == "int8":
            return ring * n * (1 + 4 / b), 2 * (R - 1) * buckets, n
        if s.grad_compression == "topk":
            used = [sum(sl.numel for sl in bk.assignment.slots) for bk in trainer.dp.buckets]
            return (R - 1) * sum(math.ceil(s.ratio * u) for u in used) * (4 + S), (R - 1) * buckets, n
        return ring * S * n, 2 * (R - 1) * buckets, n
    sizes = [int(p.data.size) for p in trainer.outer.pieces]
    if s.outer_compression == "int8":
        per_sync, hops = (R - 1) * sum(m + 4 * math.ceil(m / b) for m in sizes), R - 1
    elif s.outer_compression == "bf16":
        per_sync, hops = (R - 1) * 2 * sum(sizes), R - 1
    else:
        per_sync, hops = ring * S * sum(sizes), 2 * (R - 1)
    return per_sync / s.every, hops * s.fragments / s.every, n


def outer_steps(s: Setting, steps: int) -> list[bool]:
    """Per step: whether a fragment starts or lands its synchronisation after it (its time holds the
    outer update and the replica-axis reduction)."""
    if s.mode == "step":
        return [False] * steps
    return [any(syncs_after(k, f, s.every, s.fragments) or (k >= s.delay and syncs_after(k - s.delay, f, s.every,
                                                                                        s.fragments))
                for f in range(s.fragments)) for k in range(steps)]


def run(comm, args, replicas: int, s: Setting, steps: int | None = None) -> dict:
    """Train `s` with `replicas` replicas on the ranks of `comm` for `steps` steps (default
    `--steps`, then the validation loss; fewer: a timing run); the result row on every rank of comm."""
    timing = steps is not None
    cfg = load_config(None, overrides(args, replicas, s) + ([f"train.steps={steps}"] if timing else []))
    trainer = Trainer(cfg, comm)
    records = []

    def on_step(record: dict) -> None:
        row = np.array([record["step_time_s"], record["grad_bytes_sent"], record.get("outer_bytes_sent", 0.0),
                        float(record.get("grad_compressed", False))])
        every = trainer.mesh.world.all_gather(row[None, :])
        records.append({"loss": record["loss"], "step_s": float(every[:, 0].max()),
                        "grad_bytes": float(every[:, 1].mean()), "outer_bytes": float(every[:, 2].mean()),
                        "compressed": bool(every[:, 3].all())})

    started = time.perf_counter()
    trainer.train(files=False, progress=False, on_step=on_step, peak_flops=0.0)
    val = None if timing else trainer.evaluate(args.eval_batches)
    per_step, messages, n = formula(trainer, s, replicas)
    outer = outer_steps(s, len(records))
    if s.mode == "step":  # compressed steps only (top-k: after its warm-up), after the first
        counted = [r for r in records[1:] if r["compressed"] or s.grad_compression == "none"] or records
        measured = statistics.fmean(r["grad_bytes"] for r in counted)
    else:
        measured = sum(r["outer_bytes"] for r in records) / len(records)
        counted = records[1:]
    inner = [r["step_s"] for r, o in zip(records[1:], outer[1:]) if not o and r in counted]
    synced = [r["step_s"] for r, o in zip(records[1:], outer[1:]) if o]
    losses = [r["loss"] for r in records]
    row = {"replicas": replicas, "name": s.name, **asdict(s), "params": n,
           "outer_params": sum(int(p.data.size) for p in trainer.outer.pieces) if trainer.outer else None,
           "steps": len(records), "tokens_per_step": trainer.tokens_per_step, "losses": losses,
           "final_loss": statistics.fmean(losses[-10:]), "val_loss": val, "bytes_per_step": measured,
           "formula_bytes": per_step, "formula_error": measured / per_step - 1 if per_step else 0.0,
           "messages_per_step": messages, "step_s": statistics.median(r["step_s"] for r in counted),
           "mean_step_s": statistics.fmean(r["step_s"] for r in records[1:]),
           "inner_step_s": statistics.median(inner) if inner else None,
           "sync_step_s": statistics.median(synced) if synced else None, "wall_s": time.perf_counter() - started}
    if trainer.outer is not None:
        # A streamed run ends with a fragment's non-blocking reduction in flight, which neither
        # train(files=False) nor free() completes: left so, MPI later writes into freed buffers.
        trainer.outer.complete_in_flight()
    trainer.free()
    if comm.Get_rank() == 0 and not timing:
        print(f"  R={replicas} {s.name:<28} loss {row['final_loss']:.4f} val {val:.4f}  "
              f"{measured / 2**10:9.2f} KiB/step (formula {per_step / 2**10:.2f}, {row['formula_error']:+.1%})  "
              f"{row['wall_s']:.0f} s", flush=True)
    return row


def timed(args, replicas: int) -> dict[str, dict]:
    """Step times on the whole world (`replicas` = SIZE): step mode with each compressor (from the
    first step), and local / diloco at H = 2 (a sync after every other step: the inner step and
    the sync step side by side), also with int8 and streamed (a fragment starts and one lands
    after every step); `--time-steps` steps each, `--rounds` rounds in alternation (so that load
    from elsewhere hits them alike), per setting the round with the fastest median step kept."""
    runs = [Setting("step"), Setting("step", grad_compression="int8"),
            Setting("step", grad_compression="topk", ratio=args.ratio), Setting("local", 2), Setting("diloco", 2),
            Setting("diloco", 2, outer_compression="int8"), Setting("diloco", 2, fragments=2, delay=1)]
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for s in runs:
            row = run(WORLD, args, replicas, s, steps=args.time_steps)
            if s.name not in best or row["step_s"] < best[s.name]["step_s"]:
                best[s.name] = row
    for row in best.values():
        del row["losses"]
        say(f"  {row['name']:<28} step {1e3 * row['step_s']:6.1f} ms"
            + (f", inner {1e3 * row['inner_step_s']:.1f} ms" if row["inner_step_s"] else "")
            + (f", sync {1e3 * row['sync_step_s']:.1f} ms" if row["sync_step_s"] else ""))
    return best


def settings(args) -> list[Setting]:
    """The runs of one replica count: step first (the reference), then local and diloco at every H."""
    return ([Setting("step")] + [Setting("local", h) for h in args.every]
            + [Setting("diloco", h) for h in args.every])


def extras(args) -> list[Setting]:
    """The R = 4-only runs: compressed DiLoCo, streamed DiLoCo, the step-mode compressors to beat."""
    h = args.goal_every
    return [Setting("diloco", h, outer_compression="int8"), Setting("diloco", h, fragments=2, delay=1),
            Setting("step", grad_compression="int8"), Setting("step", grad_compression="topk", ratio=args.ratio,
                                                              start=args.warm_up)]


def polite_barrier() -> None:
    """A world barrier that sleeps instead of spinning (a finished group leaves the cores to the other)."""
    request = WORLD.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


def run_replicas(args, replicas: int, runs: list[Setting]) -> list[dict]:
    """`runs` with `replicas` replicas: SIZE / replicas groups of `replicas` ranks, the runs dealt
    round-robin among them; every row on rank 0 in the order of `runs`."""
    groups = SIZE // replicas
    group = RANK // replicas
    comm = WORLD.Split(group, RANK)
    mine = {i: run(comm, args, replicas, s) for i, s in enumerate(runs) if i % groups == group}
    comm.Free()
    polite_barrier()
    gathered = WORLD.gather(mine if RANK % replicas == 0 else {}, root=0)
    if RANK:
        return []
    rows = {i: r for part in gathered for i, r in part.items()}
    return [rows[i] for i in range(len(runs))]


def compare(rows: list[dict]) -> None:
    """Gap and byte ratio of every row to step mode of the same replica count."""
    for r in rows:
        ref = next(x for x in rows if x["replicas"] == r["replicas"] and x["mode"] == "step"
                   and x["grad_compression"] == "none")
        r["loss_gap"] = r["final_loss"] / ref["final_loss"] - 1
        r["val_gap"] = r["val_loss"] / ref["val_loss"] - 1
        r["bytes_ratio"] = r["bytes_per_step"] / ref["bytes_per_step"]
        r["meets_goal"] = (r["mode"] != "step" and r["bytes_ratio"] <= GOAL_BYTES * (1 + 1e-9)
                           and r["loss_gap"] <= GOAL_LOSS and r["val_gap"] <= GOAL_LOSS)


def link_model(rows: list[dict], timing: dict[str, dict], links_gbps: list[float], alpha_s: float) -> dict:
    """Step time and tokens/s of every row (one replica count, its timing runs `timing`) at each
    link speed (module docstring)."""
    t0 = statistics.median(t["inner_step_s"] for t in timing.values()
                           if t["mode"] != "step" and t["inner_step_s"] is not None)
    none = timing["step"]["step_s"]
    out = []
    for r in rows:
        # Its own work per step: a compressor's (its step minus step none's, whose all-reduce the
        # link model replaces), or the outer syncs' (a sync step minus an inner step at H = 2;
        # streamed: a step with one fragment starting and one landing minus t0), per H steps.
        if r["mode"] == "step":
            own = timing[r["name"].split(" (")[0]]["step_s"] - none
        else:
            key = r["name"].replace(f"H={r['every']}", "H=2")
            t = timing[key]
            per_sync = t["step_s"] - t0 if r["delay"] else t["sync_step_s"] - t["inner_step_s"]
            own = per_sync * r["fragments"] / r["every"]
        predicted = {}
        for g in links_gbps:
            bw = g * 1e9 / 8
            if r["delay"]:  # streamed: each fragment's reduction overlaps `delay` steps of compute
                per_fragment = r["every"] / r["fragments"]
                wire = (r["bytes_per_step"] * per_fragment / bw + alpha_s * r["messages_per_step"] * per_fragment
                        - r["delay"] * t0)
                predicted[str(g)] = t0 + own + max(0.0, wire) / per_fragment
            else:
                predicted[str(g)] = t0 + own + r["bytes_per_step"] / bw + alpha_s * r["messages_per_step"]
        out.append({"name": r["name"], "own_s": own, "fixed_s": t0 + own + alpha_s * r["messages_per_step"],
                    "bytes_per_step": r["bytes_per_step"], "predicted_step_s": predicted,
                    "tokens_per_s": {g: r["tokens_per_step"] / t for g, t in predicted.items()},
                    "streamed": bool(r["delay"])})
    return {"t0_s": t0, "step_allreduce_here_s": none - t0, "rows": out}


def crossover(model: dict, fast: str, slow: str) -> float | str | None:
    """The link speed (Gb/s) below which setting `fast` (fewer bytes) beats `slow` in tokens/s:
    "any" if it is never slower, None if it never wins; streamed rows are not linear in 1/L."""
    a = next(r for r in model["rows"] if r["name"] == fast)
    b = next(r for r in model["rows"] if r["name"] == slow)
    saved, extra = b["bytes_per_step"] - a["bytes_per_step"], a["fixed_s"] - b["fixed_s"]
    if saved <= 0:
        return "any" if extra < 0 and saved == 0 else None
    return "any" if extra <= 0 else saved / extra * 8 / 1e9


def plot(rows: list[dict], path: Path, show: list[str], replicas: int) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'hpcpar[bench]'): no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    k = 10
    for r in rows:
        if r["replicas"] == replicas and r["name"] in show:
            smooth = np.convolve(r["losses"], np.ones(k) / k, mode="valid")
            left.plot(np.arange(k - 1, len(r["losses"])), smooth, "--" if r["mode"] == "local" else "-",
                      label=r["name"])
    left.set_xlabel("step")
    left.set_ylabel("training loss (nats / byte), running mean of 10")
    left.set_title(f"R = {replicas} replicas, equal tokens")
    left.grid(alpha=0.3)
    left.legend()
    marks = {"local": "s", "diloco": "o", "step": "^"}
    shown = set()
    for r in rows:
        if r["mode"] == "step" and r["grad_compression"] == "none":
            continue
        colour = "C0" if r["replicas"] == 2 else "C1"
        key = (r["mode"] if r["mode"] != "step" else "step, compressed", r["replicas"])
        right.scatter(r["bytes_ratio"], 100 * r["loss_gap"], marker=marks[r["mode"]], color=colour,
                      label=None if key in shown else f"{key[0]}, R={key[1]}")
        shown.add(key)
        short = r["name"].replace("local ", "").replace("diloco ", "").replace("step ", "")
        right.annotate(short, (r["bytes_ratio"], 100 * r["loss_gap"]), fontsize=6, xytext=(4, 2),
                       textcoords="offset points")
    right.legend(fontsize=7)
    right.axhline(100 * GOAL_LOSS, color="grey", ls="--", lw=0.8)
    right.axvline(GOAL_BYTES, color="grey", ls="--", lw=0.8)
    right.set_xscale("log")
    right.set_xlabel("replica-axis bytes per step / step mode's (log)")
    right.set_ylabel("final loss gap to step mode (%)")
    right.set_title("loss gap vs bytes; goal: under 3 % at <= 2 % of the bytes (dashed)")
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser.add_argument("--steps", type=int, default=300, help="steps of every run (equal tokens)")
    parser.add_argument("--every", type=ints, default=[1, 10, 50, 100], help="H values of local and diloco")
    parser.add_argument("--goal-every", type=int, default=50,
                        help="H of the compressed and streamed DiLoCo runs and of the crossover")
    parser.add_argument("--replicas", type=ints, default=[2, 4], help="replica counts R (each divides the world)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="global batch in sequences (every run)")
    parser.add_argument("--lr", type=float, default=3e-3, help="inner AdamW peak learning rate")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--ratio", type=float, default=0.01, help="top-k: fraction of entries sent")
    parser.add_argument("--warm-up", type=int, default=100, help="top-k: uncompressed steps first")
    parser.add_argument("--eval-batches", type=int, default=8, help="global batches of the validation loss")
    parser.add_argument("--time-steps", type=int, default=16, help="steps of each timing run (the first warms up)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds of the timing runs")
    parser.add_argument("--links", type=lambda t: [float(x) for x in t.split(",")], default=[0.1, 1.0, 10.0],
                        help="link speeds of the model, Gb/s")
    parser.add_argument("--alpha-us", type=float, default=10.0, help="link latency per message (µs)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 40 steps, H = 1, 10, 20")
    parser.add_argument("--link-check", action="store_true",
                        help="only step, step int8 and diloco H=--goal-every on the world (R = ranks, e.g. one per "
                             "node of tests/cluster/harness.py), --link-steps each: measured mean step and tokens/s")
    parser.add_argument("--link-steps", type=int, default=100)
    parser.add_argument("--predict-from", default=None,
                        help="--link-check: the JSON of an unshaped --link-check run, to predict from at --link-gbps")
    parser.add_argument("--link-gbps", type=float, default=0.1, help="--link-check: the shaped link's rate")
    parser.add_argument("--out", default=None,
                        help="the JSON (default bench/results/diloco.json; --link-check: diloco_link.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.goal_every, args.warm_up, args.eval_batches = 40, [1, 10, 20], 20, 10, 1
        args.time_steps, args.rounds = 5, 1
    bad = [h for h in args.every + [args.goal_every] if h < 1 or args.steps % h]
    if bad:
        parser.error(f"every H must divide --steps {args.steps} (the runs end on a synchronisation): {bad}")
    if args.goal_every % 2 or args.layers % 2:
        parser.error("--goal-every and --layers must be even (the streamed run has 2 fragments)")
    if not 0 < args.warm_up < args.steps:
        parser.error(f"--warm-up {args.warm_up} must be in (0, --steps {args.steps})")
    args.out = args.out or str(Path(__file__).parent / "results" / (
        "diloco_link.json" if args.link_check else "diloco.json"))
    if args.link_check:
        args.replicas = [SIZE]
    wrong = [r for r in args.replicas if r < 2 or SIZE % r or args.batch % r]
    if wrong or max(args.replicas) != SIZE:
        parser.error(f"--replicas {args.replicas}: each R must be >= 2 and divide the world ({SIZE} ranks) and "
                     "--batch, the largest R the world itself (it is timed)")
    if args.time_steps < 4:
        parser.error("--time-steps must be >= 4 (the first step warms up; H = 2 needs inner and sync steps)")
    return args


def report(rows: list[dict], model: dict, crossings: dict, args) -> None:
    print("\n# loss and replica-axis bytes; gap and bytes vs step mode of the same R")
    print(f"{'R':>2} {'setting':<30} {'final':>7} {'gap':>7} {'val':>7} {'gap':>7} {'KiB/step':>9} {'formula':>9} "
          f"{'error':>6} {'vs step':>8}  goal")
    for r in rows:
        print(f"{r['replicas']:>2} {r['name']:<30} {r['final_loss']:>7.4f} {r['loss_gap']:>+7.2%} "
              f"{r['val_loss']:>7.4f} {r['val_gap']:>+7.2%} {r['bytes_per_step'] / 1024:>9.2f} "
              f"{r['formula_bytes'] / 1024:>9.2f} {r['formula_error']:>+6.1%} {r['bytes_ratio']:>8.4f}  "
              f"{'MET' if r['meets_goal'] else ''}")
    links = [str(g) for g in args.links]
    print(f"\n# R = {max(args.replicas)}: tokens/s with the replica axis on a link of L Gb/s (modelled: t0 "
          f"{1e3 * model['t0_s']:.1f} ms compute-only + own work + bytes / L + {args.alpha_us:g} µs x messages; "
          f"step mode's all-reduce took {1e3 * model['step_allreduce_here_s']:.1f} ms here)")
    print(f"{'setting':<30} {'own ms':>7} " + " ".join(f"{g + ' Gb/s':>12}" for g in links))
    for m in model["rows"]:
        print(f"{m['name']:<30} {1e3 * m['own_s']:>7.2f} " + " ".join(f"{m['tokens_per_s'][g]:>12,.0f}" for g in links))
    print("\n# L*: link speed (Gb/s) below which the first beats the second in tokens/s")
    for pair, value in crossings.items():
        print(f"  {pair}: {value if isinstance(value, str) or value is None else f'{value:.3g}'}")


def link_check(args) -> int:
    """--link-check: the measured mean step (slowest rank, after the first; sync steps included)
    of step, step int8 and diloco on the world; with --predict-from, next to the prediction from an
    unshaped run of the same: its mean step + bytes / L (L = --link-gbps; tbf shapes no latency)."""
    runs = [Setting("step"), Setting("step", grad_compression="int8"), Setting("diloco", args.goal_every)]
    rows = [run(WORLD, args, SIZE, s, steps=args.link_steps) for s in runs]
    if RANK:
        return 0
    base = {r["name"]: r for r in json.loads(Path(args.predict_from).read_text())["rows"]} if args.predict_from \
        else {}
    print(f"R = {SIZE}, {args.link_steps} steps each: mean step, tokens/s" + (
        f"; predicted at {args.link_gbps:g} Gb/s from {args.predict_from}" if base else ""))
    for r in rows:
        del r["losses"]
        r["tokens_per_s"] = r["tokens_per_step"] / r["mean_step_s"]
        if r["name"] in base:
            r["predicted_step_s"] = base[r["name"]]["mean_step_s"] + r["bytes_per_step"] * 8 / (args.link_gbps * 1e9)
            r["predicted_error"] = r["mean_step_s"] / r["predicted_step_s"] - 1
        print(f"  {r['name']:<16} {r['bytes_per_step'] / 1024:9.1f} KiB/step  {1e3 * r['mean_step_s']:7.1f} ms  "
              f"{r['tokens_per_s']:9,.0f} tokens/s" + (
                  f"  predicted {1e3 * r['predicted_step_s']:7.1f} ms ({r['predicted_error']:+.0%})"
                  if "predicted_step_s" in r else ""))
    Path(args.out).write_text(json.dumps({"link_gbps": args.link_gbps if base else None, "ranks": SIZE,
                                          "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.link_check:
        return link_check(args)
    started = time.perf_counter()
    say(f"local SGD / DiLoCo vs step on {SIZE} ranks: GPT {args.layers}x{args.embd}, T {args.block}, float32, "
        f"global batch {args.batch} sequences, {args.steps} steps per run")
    rows = []
    for replicas in sorted(args.replicas):
        runs = settings(args) + (extras(args) if replicas == max(args.replicas) else [])
        say(f"R = {replicas}: {len(runs)} runs, {SIZE // replicas} at a time")
        rows += run_replicas(args, replicas, runs)
    if RANK == 0:
        compare(rows)
    top = max(args.replicas)
    say(f"timing, R = {top}: {args.rounds} alternating rounds of {args.time_steps} steps")
    timing = timed(args, top)
    if RANK:
        return 0
    model = link_model([r for r in rows if r["replicas"] == top], timing, args.links, args.alpha_us * 1e-6)
    h = args.goal_every
    crossings = {f"diloco H={h} vs step int8": crossover(model, f"diloco H={h}", "step int8"),
                 f"diloco H={h} vs step": crossover(model, f"diloco H={h}", "step"),
                 f"diloco H={h} int8 vs step int8": crossover(model, f"diloco H={h} int8", "step int8"),
                 "step int8 vs step": crossover(model, "step int8", "step")}
    report(rows, model, crossings, args)
    met = [r for r in rows if r["meets_goal"]]
    print(f"\ngoal (within {GOAL_LOSS:.0%} of step's loss, final and validation, at <= {GOAL_BYTES:.0%} of its "
          "replica-axis bytes): " + ("met by " + ", ".join(f"{r['name']} (R={r['replicas']})" for r in met)
                                     if met else "NOT met by any setting"))
    meta = {k: v for k, v in vars(args).items() if k != "out"}
    meta.update(ranks=SIZE, cores=os.cpu_count(), load_average=list(os.getloadavg()),
                wall_s=time.perf_counter() - started, goal_loss=GOAL_LOSS, goal_bytes=GOAL_BYTES,
                timed_replicas=top)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "runs": rows, "timing": list(timing.values()), "link_model": model,
                               "crossover_gbps": crossings,
                               "goal_met_by": [f"{r['name']} (R={r['replicas']})" for r in met]}, indent=1))
    print(f"wrote {out} ({meta['wall_s']:.0f} s)")
    show = ["step"] + [f"diloco H={x}" for x in args.every if x > 1] + [f"local H={args.goal_every}"]
    plot(rows, out.with_suffix(".png"), show, top)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
