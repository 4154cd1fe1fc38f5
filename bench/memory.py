"""Memory per rank: what hpcpar keeps, measured, next to the formula that says what it should keep.

    python bench/memory.py [--sections activations] [--seq 512] [--batch 2] [--n-embd 128] [--n-head 4]

The script is a list of independent sections (`SECTIONS`: name -> function(args) -> Section). Each
measures one thing, returns its rows, a printed table and its checks; `main` runs the chosen ones
(`--sections`, default all), prints every table and writes bench/results/memory.json (`--out`) with
one key per section plus `meta` and `checks` (a section run alone keeps the others' results in an
existing file). Exit status 1 if a check fails.

activations: activation bytes per transformer layer with train.recompute = none / selective / full.
  Measured: every NumPy allocation (tracemalloc) made by one micro-batch's forward and still held
  when its backward would start, for a GPT of `--n-layer` blocks minus one of 1 block, divided by
  the difference in blocks (the embedding, the head and the loss cancel), one process, float32,
  dropout > 0. Formula, hpcpar's NumPy ops (B = batch, T = block_size, C = n_embd, H = n_head,
  s = bytes per element, d = 1 when dropout > 0), per layer:

      none        s B T [(24 + 4d) C + 2] + s B H T^2
      selective   s B T [(24 + 4d) C + 2]               the [B, H, T, T] probabilities are recomputed
      full        s B T C                               the block's input, nothing else

  `none` term by term (what each op's backward keeps; an op's output is kept by the graph):

      ln_1          output, xhat (B T C each), 1/std (B T)            2 B T C + B T
      c_attn        qkv                                               3 B T C
      attention     heads-merged output; probabilities [B, H, T, T]   B T C + B H T^2
      attn.c_proj   output                                            B T C
      dropout       mask and output (both in the model's dtype)       2d B T C
      residual add  h                                                 B T C
      ln_2          as ln_1                                           2 B T C + B T
      mlp.c_fc      hidden                                            4 B T C
      gelu          tanh(u) and output                                8 B T C
      mlp.c_proj    output                                            B T C
      dropout       mask and output                                   2d B T C
      residual add  block output                                      B T C

  Korthikanti et al. 2022 (arXiv 2205.05198) count s b h (34 + 5 a s / h) bytes per layer for
  Megatron in 16-bit (their s = T, b = B, h = C, a = H; 1-byte dropout masks, dropout on the
  probabilities): 34 B T C + 5 H T^2 B bytes. hpcpar keeps every element in the model's dtype (masks
  too), has no attention dropout (so one [T, T] tensor per head instead of Megatron's softmax output,
  mask and dropout output: 1 instead of 5 bytes-per-2-byte-element), and its fused ops keep what
  their backward reads (LayerNorm's xhat, GELU's tanh, each linear's output), which makes (24 + 4d)
  elements per B T C where Megatron's 34 bytes are 17 two-byte elements. The [T, T] term is what
  selective recomputation removes in both; full leaves the input alone in both.
  Also reported: the start-up estimate's count for the same model (`config.estimate_memory`:
  Megatron's per-layer terms, one formula for every layout, docs/config.md "Memory estimate"; it
  differs from this exact count), the peak during backward
  above what the forward held (full re-runs one block there; selective one layer's [T, T]), and the
  time of one forward + backward against none (full runs every recomputed forward twice).
  The fused GPU ops keep less (LayerNorm keeps 1/std and the mean, not xhat; attention only the
  causal part of the probabilities): bench/gpu.py is where GPU memory is measured.

Prints a table per section; writes bench/results/memory.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import tracemalloc
from pathlib import Path
from typing import Callable

from hpcpar import threads

threads.set_default_threads()

import numpy as np  # noqa: E402

from hpcpar import config  # noqa: E402
from hpcpar.nn.gpt import DTYPES, RECOMPUTE_MODES, GPT, GPTConfig  # noqa: E402

MiB = 1 << 20
TOLERANCE = 0.10   # each measured figure within 10 % of its formula


@dataclasses.dataclass
class Section:
    """One section's results: `data` (JSON), the table to print (`title`, `header`, `rows` of
    already formatted cells) and its checks (name -> passed)."""

    data: dict
    title: str
    header: list[str]
    rows: list[list[str]]
    checks: dict[str, bool]
    notes: list[str] = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Shared: the table and the JSON
# ---------------------------------------------------------------------------------------------
def print_table(section: Section) -> None:
    widths = [max(len(str(c)) for c in column) for column in zip(section.header, *section.rows)]
    print(f"\n{section.title}")
    for i, row in enumerate([section.header, *section.rows]):
        print("  ".join(str(c).rjust(w) if j else str(c).ljust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for note in section.notes:
        print(f"  {note}")


def write_results(path: Path, meta: dict, sections: dict[str, Section]) -> dict:
    """Merge `sections` into the JSON at `path` (other sections' results stay) and write it."""
    previous = json.loads(path.read_text()) if path.exists() else {}
    merged = {**previous, "meta": {**previous.get("meta", {}), **meta}}
    checks = dict(previous.get("checks", {}))
    for name, s in sections.items():
        merged[name] = s.data
        checks.update({f"{name}: {k}": v for k, v in s.checks.items()})
    merged["checks"] = checks
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=2) + "\n")
    return merged


# ---------------------------------------------------------------------------------------------
# Activations per layer, by recompute mode
# ---------------------------------------------------------------------------------------------
def formula_bytes(mode: str, batch: int, seq: int, n_embd: int, n_head: int, dtype: str, dropout: float) -> int:
    """Activation bytes one block keeps for backward on hpcpar's NumPy path (the module doc)."""
    s, d = DTYPES[dtype], int(dropout > 0)
    if mode == "full":
        return s * batch * seq * n_embd
    tokens = s * batch * seq * ((24 + 4 * d) * n_embd + 2)
    return tokens + (0 if mode == "selective" else s * batch * n_head * seq * seq)


def model_config(args, n_layer: int) -> GPTConfig:
    return GPTConfig(vocab_size=256, block_size=args.seq, n_layer=n_layer, n_head=args.n_head,
                     n_embd=args.n_embd, dropout=args.dropout, dtype="float32")


def measure(cfg: GPTConfig, mode: str, batch: int) -> dict:
    """Bytes one micro-batch's forward leaves held for backward, and the peak above that during
    backward (tracemalloc: every NumPy allocation), after a warm-up step (caches, gradients)."""
    model = GPT(cfg, seed=0)
    model.set_recompute(mode)
    model.rng_context = (0, 0, range(batch))
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab_size, (batch, cfg.block_size)) for _ in range(2))
    model(x, y).backward()
    tracemalloc.start()
    loss = model(x, y)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    loss.backward()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"held_bytes": held, "backward_peak_above_held_bytes": peak - held}


def step_seconds(cfg: GPTConfig, batch: int, repeats: int) -> dict[str, float]:
    """Best time of one forward + backward per recompute mode, the modes alternating round by round
    (so a busy moment of a shared machine hits them alike); no tracemalloc."""
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab_size, (batch, cfg.block_size)) for _ in range(2))
    models = {}
    for mode in RECOMPUTE_MODES:
        models[mode] = GPT(cfg, seed=0)
        models[mode].set_recompute(mode)
        models[mode].rng_context = (0, 0, range(batch))
        models[mode](x, y).backward()   # warm-up
    best = {mode: float("inf") for mode in models}
    for _ in range(repeats):
        for mode, model in models.items():
            start = time.perf_counter()
            model(x, y).backward()
            best[mode] = min(best[mode], time.perf_counter() - start)
    return best


def estimate_per_layer(args, mode: str) -> float:
    """The start-up memory estimate's activation bytes per block for the same micro-batch (one rank,
    one micro-batch in flight): the difference between n_layer and 1 block, per block."""
    def act(n_layer: int) -> int:
        cfg = config.load_config(None, [f"model.block_size={args.seq}", f"model.n_layer={n_layer}",
                                        f"model.n_head={args.n_head}", f"model.n_embd={args.n_embd}",
                                        f"model.dropout={args.dropout}", "model.dtype=float32",
                                        f"train.micro_batch_size={args.batch}", "train.microbatches=1",
                                        f"train.recompute={mode}", "mesh.pp=1"])
        return config._memory_parts(cfg, 1, 1, 1, 1)[1]
    return (act(args.n_layer) - act(1)) / (args.n_layer - 1)


def activations(args) -> Section:
    layers = args.n_layer
    rows, table = [], []
    seconds = step_seconds(model_config(args, layers), args.batch, args.repeats)
    for mode in RECOMPUTE_MODES:
        one, many = (measure(model_config(args, n), mode, args.batch) for n in (1, layers))
        measured = (many["held_bytes"] - one["held_bytes"]) / (layers - 1)
        formula = formula_bytes(mode, args.batch, args.seq, args.n_embd, args.n_head, "float32", args.dropout)
        rows.append({"recompute": mode, "measured_bytes_per_layer": measured, "formula_bytes_per_layer": formula,
                     "ratio": measured / formula, "estimate_bytes_per_layer": estimate_per_layer(args, mode),
                     "held_bytes": many["held_bytes"],
                     "backward_peak_above_held_bytes": many["backward_peak_above_held_bytes"],
                     "step_s": seconds[mode]})
    none = rows[0]
    for r in rows:
        r["step_time_vs_none"] = r["step_s"] / none["step_s"]
        r["saved_vs_none"] = 1 - r["measured_bytes_per_layer"] / none["measured_bytes_per_layer"]
        table.append([r["recompute"], f"{r['measured_bytes_per_layer'] / MiB:.3f}",
                      f"{r['formula_bytes_per_layer'] / MiB:.3f}", f"{r['ratio']:.3f}",
                      f"{r['saved_vs_none']:.1%}", f"{r['estimate_bytes_per_layer'] / MiB:.3f}",
                      f"{r['backward_peak_above_held_bytes'] / MiB:.2f}", f"{r['step_time_vs_none']:.2f}x"])
    korthikanti = args.seq * args.batch * args.n_embd * (34 + 5 * args.n_head * args.seq / args.n_embd)
    checks = {f"{r['recompute']} within {TOLERANCE:.0%} of its formula": abs(r["ratio"] - 1) <= TOLERANCE
              for r in rows}
    data = {"config": {"batch": args.batch, "seq": args.seq, "n_embd": args.n_embd, "n_head": args.n_head,
                       "n_layer": layers, "dropout": args.dropout, "dtype": "float32", "repeats": args.repeats},
            "rows": rows, "korthikanti_16bit_bytes_per_layer": korthikanti}
    return Section(
        data=data,
        title=(f"activations per layer: B={args.batch}, T={args.seq}, C={args.n_embd}, H={args.n_head}, float32, "
               f"dropout={args.dropout}; {layers} blocks minus 1 block, one process"),
        header=["recompute", "measured MiB", "formula MiB", "ratio", "saved", "estimate MiB",
                "bwd peak +MiB", "fwd+bwd time"],
        rows=table, checks=checks,
        notes=[f"formula: none s B T [(24 + 4d) C + 2] + s B H T^2; selective without the T^2 term; full s B T C "
               f"(Korthikanti, 16-bit Megatron: {korthikanti / MiB:.3f} MiB)",
               "estimate: the start-up estimate's per-layer count for the same micro-batch (config.estimate_memory: "
               "Megatron's per-layer terms for every layout, not this exact count; docs/config.md)",
               "bwd peak: NumPy bytes above the held ones during backward (full: one block re-run)"])


SECTIONS: dict[str, Callable[[argparse.Namespace], Section]] = {"activations": activations}


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of: {', '.join(SECTIONS)}")
    parser.add_argument("--seq", type=int, default=512, help="block_size T (activations: >= 512 makes them dominate)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=3, help="blocks of the larger model (the smaller has 1)")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=8,
                        help="timed forward + backward passes per mode, alternating (best kept)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.json"))
    args = parser.parse_args(argv)
    names = [n for n in args.sections.split(",") if n]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.n_layer < 2:
        parser.error("--n-layer must be >= 2 (per-layer figures are differences against a 1-block model)")
    started = time.perf_counter()
    done = {name: SECTIONS[name](args) for name in names}
    for section in done.values():
        print_table(section)
    out = Path(args.out)
    merged = write_results(out, {"generated_s": time.perf_counter() - started}, done)
    failed = [k for k, ok in merged["checks"].items() if not ok and k.split(":")[0] in done]
    print("\nchecks: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in merged["checks"].items()
                                   if k.split(":")[0] in done))
    print(f"total {time.perf_counter() - started:.0f} s; wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
