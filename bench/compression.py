"""Gradient compression side by side with `none`: bytes per step, step time, loss, where it pays.

    mpiexec -n 4 python bench/compression.py [--steps 300] [--warm-up 100] [--rounds 2] [--time-steps 4]
                                             [--from-scratch] [--quick]

Every run trains through `Trainer.train` (the loop of `hpcpar train`) on a dp = n mesh (n = the
world size, pp = tp = 1, ZeRO 0, float32), one after another in this one launch:

1. Loss: the default model (docs/config.md: 4 layers, n_embd 128, T 128), `--steps` steps of the
   default job's schedule and global batch (48 sequences of 128 bytes per step:
   micro_batch_size 48 / (2 n), 2 micro-batches), with `train.grad_compression` = none, fp16,
   bf16, int8 from the first step; topk (ratio `--ratio`) and powersgd (rank `--rank`) after
   `--warm-up` uncompressed steps (`train.compression_start_step`: error feedback needs Adam's
   second moment settled first, docs/parallelism.md#gradient-compression), with and without error
   feedback (`train.error_feedback`); and, with error feedback, topk at each `--meet-ratio` and
   powersgd at each `--meet-rank`: the search for settings that meet the issue's loss criterion
   (within 3 % of none) in this many steps.
   `--from-scratch` adds topk and powersgd with and without error feedback from the first step
   (the configuration in which error feedback hurts). The final loss is the mean of the last 10
   steps' losses; the curves go to compression.png.

   A run with a warm-up is, for its first `--warm-up` steps, the `none` run (the same
   uncompressed reductions, up to the order of the float32 sums in buckets laid out for the
   compressor): so it is not trained twice but resumed from `none`'s checkpoint at that step
   (bitwise resume, tests/parallel/test_compression.py), and its curve begins with `none`'s.
2. Step time: every compressor (error feedback on, compressing from the first step) for
   `--time-steps` steps, `--rounds` rounds in alternation (so that load from elsewhere hits all
   alike), the fastest round kept: the default model, then a wider one (n_embd `--wide-embd`).

Bytes: the trainer's count of what this rank sent for gradient synchronisation per step
(`Communicator.sent`, mean over ranks and over the compressed steps after the first), next to
each compressor's formula (docs/parallelism.md#gradient-compression; N elements in B buckets of
N_b, s = 4 bytes, n ranks, b = `train.int8_block_size`, k_b = ceil(ratio N_b), for PowerSGD
r' = min(r, a, c) per [a, c] matrix, V = the elements of vectors):

    none        2 (n-1)/n · s N
    fp16, bf16  2 (n-1)/n · 2 N
    int8        2 (n-1)/n · N (1 + 4/b)
    topk        (n-1) · Σ_b k_b (4 + s)
    powersgd    2 (n-1)/n · s (Σ r' (a + c) + V)

(the formulas ignore the padding of buckets to a multiple of n and top-k's 8-byte alignment).
Step time: the slowest rank's median step, after the first.

Where compression pays: this machine's ranks share memory, so the wire is nearly free and the
measured step time t_c is compute plus the compressor's own work. On a link of bandwidth L with
latency alpha per message, a step would take about

    T_c(L) = t_c + S_c / L + alpha · h_c

(S_c the bytes a rank sends per step; h_c the messages in a row its collectives need: ring
all-reduce 2 (n-1), all-gather and all-to-all n - 1, per collective call). A compressor beats
`none` below the link speed L* = (S_none - S_c) / (t_c - t_none) (alpha neglected; when t_c <= t_none
it wins at any speed). Printed for 1, 10 and 100 Gb/s, alpha = `--alpha-us`.

Prints tables; writes bench/results/compression.json and compression.png (loss curves).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hpcpar import environment

environment.set_default_threads()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpar.config.load import load_config  # noqa: E402
from hpcpar.config.sections import Config  # noqa: E402
from hpcpar.training.trainer import Trainer  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
KINDS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
LINKS_GBPS = (1, 10, 100)
GLOBAL_SEQUENCES = 48  # the default job's global batch: dp 2 (pp 2 on 4 ranks) x 12 x 2 micro-batches


def say(*a) -> None:
    if RANK == 0:
        print(*a, flush=True)


@dataclass(frozen=True)
class Setting:
    """One run's compression settings."""

    kind: str
    error_feedback: bool = True
    start: int = 0           # train.compression_start_step
    ratio: float = 0.01      # top-k
    rank: int = 4            # PowerSGD


def overrides(embd: int, s: Setting, steps: int) -> list[str]:
    return [f"train.compression_start_step={s.start}", f"model.n_embd={embd}", "model.dtype=float32",
            f"mesh.dp={SIZE}", "mesh.tp=1", "mesh.pp=1",
            f"train.micro_batch_size={GLOBAL_SEQUENCES // (2 * SIZE)}", "train.microbatches=2",
            f"train.steps={steps}", f"train.grad_compression={s.kind}", f"train.compression_ratio={s.ratio}",
            f"train.powersgd_rank={s.rank}", f"train.error_feedback={str(s.error_feedback).lower()}",
            "run.eval_every=0", "run.progress=false"]


def formula_bytes(trainer: Trainer, setting: Setting) -> float:
    """Bytes one rank sends per step by the compressor's formula (module docstring), from the
    model's parameters and the bucket assignments (top-k's per-bucket k)."""
    kind, n, s = setting.kind, SIZE, 4
    params = [p for _, p in trainer.named_parameters if not getattr(p, "tied_to", None)]
    numel = sum(int(p.data.size) for p in params)
    ring = 2 * (n - 1) / n
    if kind == "none":
        return ring * s * numel
    if kind in ("fp16", "bf16"):
        return ring * 2 * numel
    if kind == "int8":
        return ring * numel * (1 + 4 / trainer.cfg.train.int8_block_size)
    if kind == "topk":
        used = [sum(sl.numel for sl in b.assignment.slots) for b in trainer.dp.buckets]
        return (n - 1) * sum(math.ceil(setting.ratio * u) for u in used) * (4 + s)
    factors = sum(min(setting.rank, p.shape[0], math.prod(p.shape[1:])) * (p.shape[0] + math.prod(p.shape[1:]))
                  if len(p.shape) >= 2 else int(p.data.size) for p in params)
    return ring * s * factors


def messages(trainer: Trainer, kind: str) -> int:
    """Messages in a row per step (h_c of the module docstring) from the buckets' collectives."""
    n, total = SIZE, 0
    for b in trainer.dp.buckets:
        matrices = any(len(p.shape) >= 2 for p in b.params)
        calls = {"none": [2], "fp16": [1, 1], "bf16": [1, 1], "int8": [1, 1], "topk": [1],
                 "powersgd": [2, 2] if matrices else [2]}[kind]  # in units of n - 1 hops
        total += sum(calls) * (n - 1)
    return total


def run(embd: int, s: Setting, steps: int, resume: str | None = None, before: list[float] | None = None,
        save_at: int = 0) -> tuple[dict, str | None]:
    """Train `steps` steps with setting `s` (from the checkpoint `resume`, whose run's losses up to
    it are `before`); with `save_at`, checkpoint at that step into a temporary directory. Returns
    the result row and the checkpoint's path (or None)."""
    cfg = load_config(None, overrides(embd, s, steps))
    trainer = Trainer(cfg, WORLD)
    if resume:
        trainer.load(resume)
    records = []

    def on_step(record: dict) -> None:
        slowest = trainer.mesh.world.all_reduce(np.array([record["step_time_s"]]), op="max")
        records.append({"loss": record["loss"], "step_s": float(slowest[0]), "compressed": record["grad_compressed"],
                        "grad_bytes": record["grad_bytes_sent"], "plain_bytes": record["grad_bytes_uncompressed"]})

    started = time.perf_counter()
    saved = None
    if save_at:
        trainer.train(steps=save_at, files=False, progress=False, on_step=on_step, peak_flops=0.0)
        directory = WORLD.bcast(tempfile.mkdtemp(prefix="hpcpar-bench-compression-") if RANK == 0 else None)
        saved = trainer.save(directory, keep=1)
    trainer.train(files=False, progress=False, on_step=on_step, peak_flops=0.0)
    # The first step (after a load too) warms up allocators and connections; bytes and times count
    # the compressed steps only (after the warm-up of `start` uncompressed steps).
    later = [r for r in records[1:] if r["compressed"] or s.kind == "none"] or records
    measured = statistics.fmean(r["grad_bytes"] for r in later)
    formula = formula_bytes(trainer, s)
    losses = list(before or []) + [r["loss"] for r in records]
    row = {"kind": s.kind, "error_feedback": s.error_feedback, "start_step": s.start, "ratio": s.ratio,
           "rank": s.rank, "embd": embd, "steps": steps, "resumed_at": trainer.step - len(records),
           "params": sum(int(p.data.size) for _, p in trainer.named_parameters if not getattr(p, "tied_to", None)),
           "buckets": len(trainer.dp.buckets), "bytes_per_step": measured, "formula_bytes": formula,
           "formula_error": measured / formula - 1,
           "uncompressed_bytes": statistics.fmean(r["plain_bytes"] for r in later),
           "step_s": statistics.median(r["step_s"] for r in later), "messages": messages(trainer, s.kind),
           "losses": losses, "final_loss": statistics.fmean(losses[-10:]), "wall_s": time.perf_counter() - started}
    trainer.mesh.free()
    say(f"  {name_of(row):<32} C={embd:<4} {steps:>4} steps: {measured / 2**20:8.3f} MiB/step "
        f"(formula {formula / 2**20:.3f}, {row['formula_error']:+.1%}), {1e3 * row['step_s']:7.1f} ms/step, "
        f"final loss {row['final_loss']:.4f}, {row['wall_s']:.0f} s")
    return row, saved


def timed(args, embd: int) -> list[dict]:
    """Every compressor (error feedback on) for `--time-steps` steps, `--rounds` times in
    alternation, so that load from elsewhere hits them alike; per compressor the round with the
    fastest median step is kept (its bytes and formula too)."""
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for kind in KINDS:
            row, _ = run(embd, Setting(kind, ratio=args.ratio, rank=args.rank), args.time_steps)
            if kind not in best or row["step_s"] < best[kind]["step_s"]:
                best[kind] = row
    return [best[k] for k in KINDS]


def shared_memory_gbps(nbytes: int, repeats: int = 5) -> float:
    """This machine's wire: Gb/s per rank of an all-reduce of `nbytes` float32 (the uncompressed
    gradient) through hpcpar's Communicator, counted like the step bytes (2 (n-1)/n of the array),
    best of `repeats`."""
    from hpcpar.runtime.comm import Communicator, bytes_sent
    comm = Communicator(WORLD.Dup(), "bench-wire")
    a = np.ones(nbytes // 4, dtype=np.float32)
    best = math.inf
    for _ in range(repeats):
        comm.barrier()
        t = time.perf_counter()
        comm.all_reduce(a, op="sum")
        best = min(best, float(comm.all_reduce(np.array([time.perf_counter() - t]), op="max")[0]))
    comm.free()
    return bytes_sent("all_reduce", a.nbytes, SIZE) * 8 / best / 1e9


def where_it_pays(rows: list[dict], alpha_s: float) -> list[dict]:
    """Predicted step time at each link speed and the crossover L* per compressor (module docstring)."""
    base = next(r for r in rows if r["kind"] == "none")
    out = []
    for r in rows:
        predicted = {str(g): r["step_s"] + r["bytes_per_step"] / (g * 1e9 / 8) + alpha_s * r["messages"]
                     for g in LINKS_GBPS}
        saved, extra = base["bytes_per_step"] - r["bytes_per_step"], r["step_s"] - base["step_s"]
        crossover = None if r["kind"] == "none" else (math.inf if extra <= 0 else saved / extra * 8 / 1e9)
        out.append({"kind": r["kind"], "embd": r["embd"], "predicted_step_s": predicted,
                    "crossover_gbps": crossover})
    return out


def name_of(r: dict) -> str:
    knob = {"topk": f" {r['ratio']:g}", "powersgd": f" r{r['rank']}"}.get(r["kind"], "")
    return (r["kind"] + knob + ("" if r["error_feedback"] or r["kind"] in ("none", "fp16", "bf16") else " (no EF)")
            + (f" (warm-up {r['start_step']})" if r.get("start_step") else ""))


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'hpcpar[bench]'): no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        k = 10  # a running mean over 10 steps: the curves are noisy step to step
        smooth = np.convolve(r["losses"], np.ones(k) / k, mode="valid")
        scratch = r["kind"] in ("topk", "powersgd") and not r["start_step"]
        style = "--" if not r["error_feedback"] else ":" if scratch else "-"
        ax.plot(np.arange(k - 1, len(r["losses"])), smooth, style, label=name_of(r))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / byte), running mean of 10")
    ax.set_title(f"gradient compression, dp={SIZE}, default model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps of the loss runs (default model)")
    parser.add_argument("--time-steps", type=int, default=4, help="steps of each timing run (the first warms up)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the timing runs")
    parser.add_argument("--wide-embd", type=int, default=384, help="n_embd of the wider model")
    parser.add_argument("--ratio", type=float, default=0.01, help="top-k: fraction of entries sent")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    parser.add_argument("--warm-up", type=int, default=100,
                        help="train.compression_start_step of the top-k and PowerSGD loss runs")
    parser.add_argument("--meet-ratio", type=float, nargs="*", default=[0.1, 0.2],
                        help="top-k: larger ratios tried against the loss criterion (within 3%% of none)")
    parser.add_argument("--meet-rank", type=int, nargs="*", default=[8, 12, 16],
                        help="PowerSGD: larger ranks tried against the loss criterion (within 3%% of none)")
    parser.add_argument("--from-scratch", action="store_true",
                        help="also run top-k and PowerSGD with and without error feedback from the first step")
    parser.add_argument("--alpha-us", type=float, default=10.0, help="link latency per message (µs)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 20 loss steps, 1 round of 3 timed steps")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "compression.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.time_steps, args.rounds, args.warm_up = 20, 3, 1, 5
    if not 0 < args.warm_up < args.steps:
        parser.error(f"--warm-up {args.warm_up} must be in (0, --steps {args.steps})")
    if GLOBAL_SEQUENCES % (2 * SIZE):
        parser.error(f"the global batch of {GLOBAL_SEQUENCES} sequences does not split over {SIZE} ranks")
    started = time.perf_counter()
    default_embd = Config().model.n_embd
    say(f"gradient compression on {SIZE} ranks (dp={SIZE}), float32, global batch {GLOBAL_SEQUENCES}x"
        f"{Config().model.block_size} tokens")
    say(f"1. loss: default model (n_embd {default_embd}), {args.steps} steps each")
    w, ratio, rank = args.warm_up, args.ratio, args.rank
    sparse = [Setting("topk", ef, w, ratio=ratio) for ef in (True, False)] + [
        Setting("powersgd", ef, w, rank=rank) for ef in (True, False)] + [
        Setting("topk", True, w, ratio=r) for r in args.meet_ratio] + [
        Setting("powersgd", True, w, rank=r) for r in args.meet_rank]
    if args.from_scratch:
        sparse += [Setting(k, ef, 0, ratio=ratio, rank=rank) for k in ("topk", "powersgd") for ef in (True, False)]
    none, warmed = run(default_embd, Setting("none"), args.steps, save_at=w)
    losses = [none] + [run(default_embd, Setting(k, ratio=ratio, rank=rank), args.steps)[0]
                       for k in ("fp16", "bf16", "int8")]
    for s in sparse:
        resume = warmed if s.start == w else None
        losses.append(run(default_embd, s, args.steps, resume, none["losses"][:w] if resume else None)[0])
    if RANK == 0:
        shutil.rmtree(os.path.dirname(warmed), ignore_errors=True)
    say(f"2. step time: default model, {args.rounds} alternating rounds of {args.time_steps} steps")
    default = timed(args, default_embd)
    say(f"3. step time: wider model (n_embd {args.wide_embd}), {args.rounds} alternating rounds of "
        f"{args.time_steps} steps")
    wide = timed(args, args.wide_embd)
    wire_gbps = shared_memory_gbps(int(losses[0]["params"]) * 4)
    if RANK:
        return 0

    alpha = args.alpha_us * 1e-6
    for rows in (losses, default, wide):
        base = rows[0]  # none
        for r in rows:
            r["ratio_to_none"] = r["bytes_per_step"] / base["bytes_per_step"]
            r["step_time_vs_none"] = r["step_s"] / base["step_s"]
            r["loss_vs_none"] = r["final_loss"] / base["final_loss"] - 1
    pays = {"default": where_it_pays(default, alpha), "wide": where_it_pays(wide, alpha)}

    print(f"\n# 1. loss after {args.steps} steps (mean of the last 10), default model, "
          f"{losses[0]['params'] / 1e6:.2f}M parameters")
    print(f"{'compressor':<32} {'MiB/step/rank':>13} {'formula':>9} {'error':>7} {'vs none':>8} {'final loss':>10} "
          f"{'loss vs none':>12}")
    for r in losses:
        print(f"{name_of(r):<32} {r['bytes_per_step'] / 2**20:>13.3f} {r['formula_bytes'] / 2**20:>9.3f} "
              f"{r['formula_error']:>+7.1%} {r['ratio_to_none']:>7.3f}x {r['final_loss']:>10.4f} "
              f"{r['loss_vs_none']:>+12.2%}")
    for title, rows in (("2. default model", default), (f"3. wider model (n_embd {args.wide_embd})", wide)):
        print(f"\n# {title}: {rows[0]['params'] / 1e6:.2f}M parameters, best of {args.rounds} alternating rounds")
        print(f"{'compressor':<32} {'MiB/step/rank':>13} {'formula':>9} {'error':>7} {'vs none':>8} {'step ms':>8} "
              f"{'time vs none':>12}")
        for r in rows:
            print(f"{name_of(r):<32} {r['bytes_per_step'] / 2**20:>13.3f} {r['formula_bytes'] / 2**20:>9.3f} "
                  f"{r['formula_error']:>+7.1%} {r['ratio_to_none']:>7.3f}x {1e3 * r['step_s']:>8.1f} "
                  f"{r['step_time_vs_none']:>11.2f}x")
    print(f"\n# where compression pays: predicted step time (ms) = measured here + bytes / link + "
          f"{args.alpha_us:g} µs x messages; L* = link speed below which the compressor beats none")
    print(f"# this machine's ranks share memory: the uncompressed gradient's all-reduce runs at {wire_gbps:.1f} Gb/s "
          f"per rank here ({SIZE} ranks on {os.cpu_count()} cores): a compressor pays here only if its L* is above "
          "that")
    for model, rows in pays.items():
        print(f"{model:<8} {'compressor':<10} " + " ".join(f"{g:>5} Gb/s" for g in LINKS_GBPS) + "   L* (Gb/s)")
        for r in rows:
            cross = ("-" if r["crossover_gbps"] is None else "any" if math.isinf(r["crossover_gbps"])
                     else f"{r['crossover_gbps']:.2f}")
            print(f"{'':<8} {r['kind']:<10} " + " ".join(f"{1e3 * r['predicted_step_s'][str(g)]:>10.1f}"
                                                        for g in LINKS_GBPS) + f"   {cross:>9}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for rows in pays.values():  # JSON has no infinity
        for r in rows:
            if r["crossover_gbps"] is not None and math.isinf(r["crossover_gbps"]):
                r["crossover_gbps"] = "any"
    meta = {"ranks": SIZE, "steps": args.steps, "time_steps": args.time_steps, "rounds": args.rounds,
            "wide_embd": args.wide_embd, "ratio": args.ratio, "rank": args.rank, "alpha_us": args.alpha_us,
            "warm_up": w, "meet_ratio": args.meet_ratio, "meet_rank": args.meet_rank,
            "quick": args.quick, "global_sequences": GLOBAL_SEQUENCES, "shared_memory_gbps": wire_gbps,
            "cores": os.cpu_count(), "load_average": list(os.getloadavg()), "wall_s": time.perf_counter() - started}
    for rows in (default, wide):
        for r in rows:
            del r["losses"]  # a few steps of a timing run: not a loss curve
    out.write_text(json.dumps({"meta": meta, "loss": losses, "default": default, "wide": wide,
                               "where_it_pays": pays}, indent=1))
    print(f"wrote {out}")
    plot(losses, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
