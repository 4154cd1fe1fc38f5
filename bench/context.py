"""Context parallelism: ring attention and Ulysses next to tensor + sequence parallelism at the same T.

    mpiexec -n 4 python bench/context.py [--seq 1024] [--limit-mib 64] [--steps 3]

Four measurements, each on meshes over the world's ranks (degree k = 1, 2, 4 where it fits; the
other ranks form dp replicas):

1. Attention activations per rank: the bytes the attention op keeps for backward (found by
   walking its autograd graph: every array its backward closures hold, input excluded), for
   ring attention (cp = k), Ulysses (cp = k) and Megatron tp + sp (tp = k: attention on H/k heads of
   the whole sequence), at the same T, B, C, H. Without context parallelism (k = 1) all three are
   `causal_attention` and keep the [B, H, T, T] probabilities; the ring keeps q, k, v, the
   output and the log-sum-exp of its T/cp tokens only. Checked: bytes x k is constant within 10%
   over the degrees of each design (the ring from cp = 2, where it starts).
2. Bytes each rank sends per transformer layer (forward + backward), measured from the flight
   recorder (the difference between a 2-layer and a 1-layer GPT; sends count their bytes,
   collectives what a bandwidth-optimal algorithm moves per rank) next to each design's formula
   (s = bytes per element, n = T/cp):
       ring       2 B n C s (3cp - 2)          K/V forward and backward (cp - 1 steps each) + dK/dV (cp)
       ulysses    8 B n C s (cp - 1)/cp        q, k, v and the output, forward and backward
       tp + sp    8 B T C s (tp - 1)/tp + 12 C s (tp - 1)/tp   2 all-gathers + 2 reduce-scatters each
                                               way, and the backward's all-reduces of LayerNorm/bias grads
   and the attention work per rank, max/mean of the causal (query, key) pairs its forward scored:
   the zigzag layout against the naive contiguous split, whose last rank does (2cp-1)/cp of the
   mean; the time of one attention forward + backward (slowest rank) and, for the ring, the
   max/mean over ranks of the time spent computing blocks (waits excluded; with more ranks than
   cores this is blurred by ranks sharing cores).
3. Training tokens/s (Trainer.train, median step after the first) for each design at k = world.
4. The longest block_size that trains under a fixed per-rank memory limit (--limit-mib) at
   cp = 1, 2, 4 (ring): the largest multiple of --granularity whose config memory estimate
   (`validate(..., available_memory_bytes=limit)`) passes, then one real training step at
   that length with its measured peak (tracemalloc: every NumPy allocation live on the rank;
   the peak over ranks).

Tiny widths keep it to seconds per case; float32. Prints tables; writes bench/results/context.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc
import types
from pathlib import Path

from hpcpar import environment

environment.set_default_threads()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpar.config.load import load_config
from hpcpar.config.memory import estimate_memory
from hpcpar.config.sections import Config
from hpcpar.config.validate import validate
from hpcpar.autograd.attention import causal_attention
from hpcpar.runtime import watchdog  # noqa: E402
from hpcpar.errors import ConfigError  # noqa: E402
from hpcpar.runtime.mesh import Mesh  # noqa: E402
from hpcpar.runtime.topology import Axis  # noqa: E402
from hpcpar.nn.gpt import GPT, GPTConfig  # noqa: E402
from hpcpar.parallel.cp.attention import ContextParallel  # noqa: E402
from hpcpar.autograd.tensor import Tensor  # noqa: E402
from hpcpar.training.trainer import Trainer  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
DESIGNS = ("ring", "ulysses", "tp+sp")
MiB = 1 << 20
TOKENS = np.random.default_rng(0).integers(32, 127, 400_000).astype(np.uint8)


def degrees() -> list[int]:
    return [k for k in (1, 2, 4) if SIZE % k == 0]


def make_mesh(design: str, k: int) -> Mesh:
    if design == "tp+sp":
        return Mesh(dp=SIZE // k, tp=k, comm=WORLD)
    return Mesh(dp=SIZE // k, cp=k, comm=WORLD)


# ---------------------------------------------------------------------------------------------
# 1. What attention keeps for backward
# ---------------------------------------------------------------------------------------------
def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def saved_bytes(out: Tensor, inputs: list) -> int:
    """Bytes of the distinct buffers that `out`'s backward closures hold (inputs' buffers excluded)."""
    exclude = {id(_root(a)) for a in inputs}
    buffers: dict[int, int] = {}
    seen: set[int] = set()

    def scan(value) -> None:
        if isinstance(value, np.ndarray):
            buf = _root(value)
            if id(buf) not in exclude:
                buffers[id(buf)] = buf.nbytes
        elif isinstance(value, types.FunctionType) and id(value) not in seen:
            seen.add(id(value))
            for cell in value.__closure__ or ():
                try:
                    scan(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
        elif isinstance(value, (tuple, list)):
            for v in value:
                scan(v)

    stack, visited = [out], set()
    while stack:
        t = stack.pop()
        if id(t) in visited:
            continue
        visited.add(id(t))
        scan(t._backward)
        stack += [p for p in t._parents if p is not None]
    return sum(buffers.values())


def attention_case(design: str, k: int, args, layout: str | None = None) -> dict:
    """One attention forward + backward on this rank's share: saved bytes, time, causal pairs."""
    b, t, c, h = args.batch, args.seq, args.n_embd, args.n_head
    mesh = make_mesh(design, k)
    rng = np.random.default_rng(5)
    qkv_full = rng.standard_normal((b, t, 3 * c)).astype(np.float32)
    if design == "tp+sp":       # my heads' q, k, v of the whole sequence
        heads = h // k
        r, d = mesh.rank(Axis.TP), c // h
        cols = np.concatenate([np.arange(g * c + r * heads * d, g * c + (r + 1) * heads * d) for g in range(3)])
        x_data = np.ascontiguousarray(qkv_full[:, :, cols])

        def attend(x):
            return causal_attention(x, heads)
        pairs = b * heads * t * (t + 1) // 2
        cp = None
    else:
        cp = ContextParallel(mesh.comm(Axis.CP), design, layout)
        x_data = np.ascontiguousarray(qkv_full[:, cp.positions(t)])

        def attend(x):
            return cp.attention(x, h)
        pairs = None
    times, busy, saved = [], [], 0
    for _ in range(args.repeats):
        x = Tensor(x_data.copy(), requires_grad=True)
        if cp is not None:
            cp.reset_stats()
            cp.events = []
        mesh.world.barrier()
        start = time.perf_counter()
        y = attend(x)
        saved = saved_bytes(y, [x.data])
        y.backward(np.ones_like(y.data))
        times.append(time.perf_counter() - start)
        if cp is not None and cp.events:   # the ring's block computations alone (no waiting)
            began = {(w.removesuffix("compute"), step): t for w, step, t in cp.events if w.endswith("compute")}
            busy.append(sum(t - began[(w.removesuffix("computed"), step)] for w, step, t in cp.events
                            if w.endswith("computed")))
    if cp is not None:
        pairs = cp.stats["pairs"] if k > 1 else b * h * t * (t + 1) // 2
    every = mesh.world.all_gather_object((saved, min(times), pairs, min(busy) if busy else min(times)))
    mesh.free()
    savings = [e[0] for e in every]
    secs = [e[1] for e in every]
    work = [e[2] for e in every]
    compute = [e[3] for e in every]
    shown = "plain" if k == 1 else layout or ("zigzag" if design == "ring" else "-")
    return {"design": design, "k": k, "layout": shown,
            "saved_bytes_per_rank": max(savings), "attention_s_max": max(secs),
            "attention_s_mean": statistics.fmean(secs), "time_max_over_mean": max(secs) / statistics.fmean(secs),
            "compute_s_max": max(compute), "compute_max_over_mean": max(compute) / statistics.fmean(compute),
            "pairs_max": max(work), "pairs_mean": statistics.fmean(work),
            "work_max_over_mean": max(work) / statistics.fmean(work)}


# ---------------------------------------------------------------------------------------------
# 2. Bytes sent per layer
# ---------------------------------------------------------------------------------------------
def _sent(record) -> float:
    """Bytes this rank puts on the wire for one recorded op (bandwidth-optimal algorithms)."""
    p = int(record.group.count(",")) + 1
    kind = record.op
    if kind == "send":
        return record.nbytes
    if kind == "all_gather":
        return (p - 1) * record.nbytes
    if kind in ("reduce_scatter", "all_to_all"):
        return (p - 1) / p * record.nbytes
    if kind == "all_reduce":
        return 2 * (p - 1) / p * record.nbytes
    return 0.0


def bytes_per_layer(design: str, k: int, args) -> dict:
    """Measured bytes sent per rank per layer (forward + backward), from 2-layer minus 1-layer runs."""
    mesh = make_mesh(design, k)
    comm_name = "tp" if design == "tp+sp" else "cp"
    sent = []
    for layers in (1, 2):
        cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=layers, n_head=args.n_head,
                        n_embd=args.n_embd, dtype="float32")
        if design == "tp+sp":
            model = GPT(cfg, tp_comm=mesh.comm(Axis.TP), sequence_parallel=True, seed=1)
            cols = np.arange(args.seq)
        else:
            cp = ContextParallel(mesh.comm(Axis.CP), design)
            model = GPT(cfg, seed=1, cp=cp)
            cols = cp.positions(args.seq)
        x = TOKENS[:args.batch * (args.seq + 1)].reshape(args.batch, args.seq + 1).astype(np.int64)
        watchdog.recorder.clear()
        loss = model(x[:, :-1][:, cols], x[:, 1:][:, cols])
        loss.backward()
        snap = watchdog.recorder.snapshot()["done"]
        sent.append(sum(_sent(r) for r in snap if r.comm == comm_name))
    mesh.free()
    measured = max(WORLD.allgather(sent[1] - sent[0]))
    s, b, t, c = 4, args.batch, args.seq, args.n_embd
    n = t // k
    formula = {"ring": 2 * b * n * c * s * (3 * k - 2),
               "ulysses": 8 * b * n * c * s * (k - 1) / k,
               "tp+sp": 8 * b * t * c * s * (k - 1) / k + 12 * c * s * (k - 1) / k}[design]
    return {"design": design, "k": k, "bytes_sent_per_layer": measured, "formula_bytes": formula}


# ---------------------------------------------------------------------------------------------
# 3. Training throughput
# ---------------------------------------------------------------------------------------------
def train_config(design: str, k: int, seq: int, args, extra=()) -> Config:
    mesh = ([f"mesh.tp={k}", "mesh.sequence_parallel=true", "mesh.cp=1"] if design == "tp+sp"
            else [f"mesh.cp={k}", f"mesh.cp_impl={design}", "mesh.tp=1"])
    return load_config(None, [
        f"model.block_size={seq}", f"model.n_embd={args.n_embd}", f"model.n_head={args.n_head}",
        f"model.n_layer={args.n_layer}", "model.dtype=float32", f"train.micro_batch_size={args.batch}",
        "train.microbatches=1", "train.steps=1000", "train.warmup=0", f"mesh.dp={SIZE // k}", "mesh.pp=1",
        "run.progress=false", "run.eval_every=0", *mesh, *extra])


def throughput(design: str, args) -> dict:
    trainer = Trainer(train_config(design, SIZE, args.seq, args), WORLD, tokens=TOKENS)
    times = []
    trainer.train(steps=args.steps + 1, files=False, progress=False, peak_flops=0.0,
                  on_step=lambda r: times.append(r["step_time_s"]))
    step = statistics.median(times[1:])
    trainer.mesh.free()
    return {"design": design, "k": SIZE, "tokens_per_step": trainer.tokens_per_step,
            "tokens_per_s": trainer.tokens_per_step / step, "step_s": step}


# ---------------------------------------------------------------------------------------------
# 4. Longest context under a memory limit
# ---------------------------------------------------------------------------------------------
def fits(cp: int, seq: int, limit: int, args) -> bool:
    try:
        validate(train_config("ring", cp, seq, args, ["model.n_head=1"]), SIZE, limit)
        return True
    except ConfigError:
        return False


def longest_context(cp: int, limit: int, args) -> dict:
    g = args.granularity
    lo, hi = 0, g
    while fits(cp, hi, limit, args):
        lo, hi = hi, 2 * hi
    while hi - lo > g:                       # the estimate grows with T: bisect on multiples of g
        mid = (lo + hi) // 2 // g * g
        lo, hi = (mid, hi) if fits(cp, mid, limit, args) else (lo, mid)
    seq = lo
    cfg = train_config("ring", cp, seq, args, ["model.n_head=1"])
    estimate = estimate_memory(validate(cfg, SIZE), SIZE // cp, 1, 1, cp)
    tracemalloc.start()
    trainer = Trainer(cfg, WORLD, tokens=TOKENS)
    trainer.train_step(0)                    # gradient buckets and optimizer state come to life
    tracemalloc.reset_peak()
    start = time.perf_counter()
    trainer.train_step(1)
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    trainer.mesh.free()
    peaks = WORLD.allgather(peak)
    return {"cp": cp, "block_size": seq, "estimate_bytes": estimate, "measured_peak_bytes": max(peaks),
            "limit_bytes": limit, "step_s": max(WORLD.allgather(elapsed))}


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048, help="T for the side-by-side measurements")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="attention timings per case (best kept)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps (after one warm-up)")
    parser.add_argument("--limit-mib", type=float, default=64.0, help="per-rank memory limit for part 4")
    parser.add_argument("--long-n-embd", type=int, default=16, help="model width for part 4 (1 head)")
    parser.add_argument("--long-n-layer", type=int, default=1, help="layers for part 4")
    parser.add_argument("--granularity", type=int, default=128, help="block_size step of the search in part 4")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "context.json"))
    args = parser.parse_args(argv)
    if args.seq % (2 * SIZE) or args.n_head % SIZE:
        parser.error(f"--seq must divide by {2 * SIZE} and --n-head by {SIZE}")
    watchdog.recorder = watchdog.FlightRecorder(capacity=1_000_000)   # keep every op for part 2
    started = time.perf_counter()
    say = print if RANK == 0 else (lambda *a, **k: None)

    say(f"context parallelism on {SIZE} ranks: T={args.seq}, B={args.batch}, C={args.n_embd}, H={args.n_head}, "
        f"float32")
    attention = [attention_case(d, k, args) for d in DESIGNS for k in degrees()]
    naive = [attention_case("ring", k, args, layout="contiguous") for k in degrees() if k > 1]
    base = {d: next(r for r in attention if r["design"] == d and r["k"] == (2 if d == "ring" and SIZE > 1 else 1))
            for d in DESIGNS}
    for r in attention:
        ref = base[r["design"]]
        r["saved_x_k_over_reference"] = r["saved_bytes_per_rank"] * r["k"] / (ref["saved_bytes_per_rank"] * ref["k"])
    say("\n1. attention activations kept for backward, per rank (ratio: bytes x k over the design's first point)")
    say(f"{'design':<9}{'k':>3}{'layout':>12}{'saved MiB':>11}{'x k ratio':>11}{'pairs max/mean':>16}"
        f"{'attn s (max)':>14}{'compute max/mean':>18}")
    for r in attention + naive:
        ratio = "-" if r["design"] == "ring" and r["k"] == 1 else f"{r.get('saved_x_k_over_reference', 0):.3f}"
        ratio = "-" if r in naive else ratio
        say(f"{r['design']:<9}{r['k']:>3}{r['layout']:>12}{r['saved_bytes_per_rank'] / MiB:>11.3f}{ratio:>11}"
            f"{r['work_max_over_mean']:>16.3f}{r['attention_s_max']:>14.4f}{r['compute_max_over_mean']:>18.3f}")
    proportional = all(abs(r["saved_x_k_over_reference"] - 1) <= 0.10 for r in attention
                       if not (r["design"] == "ring" and r["k"] == 1))

    comm = [bytes_per_layer(d, k, args) for d in DESIGNS for k in degrees() if k > 1]
    say("\n2. bytes sent per rank per transformer layer (forward + backward)")
    say(f"{'design':<9}{'k':>3}{'measured KiB':>14}{'formula KiB':>13}{'ratio':>8}")
    for r in comm:
        say(f"{r['design']:<9}{r['k']:>3}{r['bytes_sent_per_layer'] / 1024:>14.1f}{r['formula_bytes'] / 1024:>13.1f}"
            f"{r['bytes_sent_per_layer'] / r['formula_bytes']:>8.3f}")

    speed = [throughput(d, args) for d in DESIGNS] if SIZE > 1 else []
    say(f"\n3. training throughput, k = {SIZE} (dp = 1), {args.n_layer} layers, median of {args.steps} steps")
    for r in speed:
        say(f"{r['design']:<9}{r['tokens_per_s']:>12,.0f} tokens/s  ({r['step_s'] * 1e3:.0f} ms/step)")

    limit = int(args.limit_mib * MiB)
    long_args = argparse.Namespace(**{**vars(args), "n_embd": args.long_n_embd, "n_head": 1,
                                      "n_layer": args.long_n_layer})
    longest = [longest_context(cp, limit, long_args) for cp in degrees()]
    say(f"\n4. longest block_size under {args.limit_mib:g} MiB per rank (ring; C={args.long_n_embd}, 1 head, "
        f"{args.long_n_layer} layer(s), B={args.batch})")
    say(f"{'cp':>3}{'block_size':>12}{'x previous':>12}{'estimate MiB':>14}{'measured peak MiB':>19}{'step s':>8}")
    for i, r in enumerate(longest):
        grown = r["block_size"] / longest[i - 1]["block_size"] if i else 1.0
        say(f"{r['cp']:>3}{r['block_size']:>12}{grown:>12.2f}"
            f"{r['estimate_bytes'] / MiB:>14.1f}{r['measured_peak_bytes'] / MiB:>19.1f}{r['step_s']:>8.2f}")
    say("   (cp=1 is plain attention, which keeps [T, T] probabilities per layer; from cp=2 on the ring keeps "
        "none, so its limit is one [T/cp, T/cp] block)")

    balance = {r["k"]: r["work_max_over_mean"] for r in attention if r["design"] == "ring" and r["k"] > 1}
    naive_balance = {r["k"]: r["work_max_over_mean"] for r in naive}
    checks = {
        "activations_proportional_to_1_over_k_within_10pct": proportional,
        "zigzag_max_over_mean_work_le_1.05": all(v <= 1.05 for v in balance.values()),
        "naive_split_near_(2cp-1)/cp": all(abs(v - (2 * k - 1) / k) <= 0.05 for k, v in naive_balance.items()),
        "measured_bytes_within_5pct_of_formula": all(abs(r["bytes_sent_per_layer"] / r["formula_bytes"] - 1) <= 0.05
                                                      for r in comm),
        "longest_context_at_least_8192_at_cp_4": any(r["cp"] == 4 and r["block_size"] >= 8192 for r in longest),
        "measured_peak_within_limit": all(r["measured_peak_bytes"] <= r["limit_bytes"] for r in longest),
    }
    say("\nchecks: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in checks.items()))
    say(f"total {time.perf_counter() - started:.0f} s")
    if RANK == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": {"ranks": SIZE, "seq": args.seq, "batch": args.batch,
                                            "n_embd": args.n_embd, "n_head": args.n_head, "n_layer": args.n_layer,
                                            "dtype": "float32", "limit_bytes": limit,
                                            "long_n_embd": args.long_n_embd, "long_n_layer": args.long_n_layer,
                                            "granularity": args.granularity},
                                   "attention": attention, "naive": naive, "bytes": comm, "throughput": speed,
                                   "longest": longest, "checks": checks}, indent=2))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
