"""Memory per rank: what hpcpar keeps, measured, next to the formula that says what it should keep.

    python bench/memory.py [--sections activations,precision,model_state] [--seq 512] [--batch 2] [--n-embd 128]
                           [--n-head 4] [--ranks 4] [--state-layers 4] [--state-embd 128]

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

      none        s B T [(22 + 4d) C + 4] + s B H (K(T) + T)
      selective   s B T [(22 + 4d) C + 4] + s B H T     the probabilities' blocks are recomputed
      full        s B T C                               the block's input, nothing else

  K(T) = the elements of one head's [T, T] probabilities that the CPU attention keeps: each block of
  64 queries against the keys up to its causal edge (`cpu.attention.kept_probabilities`: 3/4 T^2 at
  T = 128, 9/16 at 512), kept as exponentials with their row sums (B H T) beside them.

  `none` term by term (what each op's backward keeps; an op's output is kept by the graph):

      ln_1          output (B T C), mean and 1/std (B T each)         B T C + 2 B T
      c_attn        qkv                                               3 B T C
      attention     heads-merged output; causal blocks of exp(scores) B T C + B H K(T), row sums B H T
      attn.c_proj   output                                            B T C
      dropout       mask and output (both in the model's dtype)       2d B T C
      residual add  h                                                 B T C
      ln_2          as ln_1                                           B T C + 2 B T
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
  their backward reads (LayerNorm's mean and 1/std per row, GELU's tanh, each linear's output), which
  makes (22 + 4d) elements per B T C where Megatron's 34 bytes are 17 two-byte elements. The [T, T] term is what
  selective recomputation removes in both; full leaves the input alone in both.
  Also reported: the start-up estimate's count for the same model (`config.memory.estimate_memory`:
  Megatron's per-layer terms, one formula for every layout, docs/config.md "Memory estimate"; it
  differs from this exact count), the peak during backward
  above what the forward held (full re-runs one block there; selective one layer's [T, T]), and the
  time of one forward + backward against none (full runs every recomputed forward twice).
  The fused GPU ops keep less (attention only the causal part of the probabilities): bench/gpu.py is where GPU memory is measured.

model_state: model-state bytes per parameter under ZeRO 0/1/2/3, and a model plain data
  parallelism refuses under a memory limit training under ZeRO-3 on the same ranks. The section
  launches itself under `mpiexec -n --ranks` (default 4; one BLAS thread per rank). On a dp = N mesh
  (float32, AdamW), for zero = 0, 1, 2, 3: the bytes of every NumPy allocation live on a rank after
  two training steps (tracemalloc, NumPy's domain: real allocations, not a count of what the objects
  say they hold) minus those live before the Trainer was built, per parameter of the model, the
  busiest rank's, next to the ZeRO paper's fp32 Adam formulas (arXiv 1910.02054, 4 bytes a value):

      zero 0   4 + 4 + 8       = 16      weights, gradients, two moments
      zero 1   4 + 4 + 8/N               moments sharded
      zero 2   4 + (4 + 8)/N             gradients sharded too
      zero 3   16/N + one gathered unit  everything sharded; a unit's parameters are gathered
                                         around its use

  For zero 3 the largest unit is then gathered through the real gather path and its bytes added
  (the "+ one unit" term, measured). Each figure must be within 10 % of its formula; padding to a
  multiple of N is in the measurement, not in the formula. Then the fit demonstration: a per-rank
  limit under which the config's memory estimate (`validate(..., available_memory_bytes)`,
  the check `hpcpar train` makes before any collective) accepts a base model with plain DP
  (zero 0) but refuses a model with >= 3x its parameters; the big model is accepted with zero=3 and
  trains `--state-steps` steps on the same ranks, its measured peak (tracemalloc, all allocations
  of the steps) under the limit.

precision: bytes per parameter and activation bytes per layer under train.precision = full
  (float32), bf16 and fp16, one process. Activations measured as in `activations` (recompute none,
  dropout > 0), next to the 16-bit count of what each op keeps (a = 2 bytes; LayerNorm keeps its
  output and a float32 mean and 1/std per row, GELU its input only, dropout a
  1-byte mask, attention the 16-bit probabilities):

      16-bit    a B T 18 C + 16 B T + d (2a + 2) B T C + a B H K(T)

  Bytes per parameter: every NumPy allocation a one-rank Trainer (AdamW, zero 0) holds after two
  steps, per parameter, next to 4 + 4 + 8 = 16 for all three precisions (the masters, gradients and
  moments stay float32; no 16-bit weight copy is kept: each op rounds the weight it reads).

Prints a table per section; writes bench/results/memory.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Callable

from hpcpar import environment

environment.set_default_threads()

import numpy as np  # noqa: E402

from hpcpar.config.load import load_config
from hpcpar.config.memory import estimate_memory, memory_parts
from hpcpar.config.sections import Config
from hpcpar.config.validate import validate
from hpcpar.backend.cpu.attention import kept_probabilities  # noqa: E402
from hpcpar.errors import ConfigError  # noqa: E402
from hpcpar.nn.gpt import DTYPES, RECOMPUTE_MODES, GPT, GPTConfig  # noqa: E402

MiB = 1 << 20
TOLERANCE = 0.10   # each measured figure within 10 % of its formula
TOKENS = np.random.default_rng(0).integers(0, 256, 1 << 16).astype(np.uint8)


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
def activation_formula_bytes(mode: str, batch: int, seq: int, n_embd: int, n_head: int, dtype: str,
                             dropout: float) -> int:
    """Activation bytes one block keeps for backward on hpcpar's NumPy path (the module doc)."""
    s, d = DTYPES[dtype], int(dropout > 0)
    if mode == "full":
        return s * batch * seq * n_embd
    tokens = s * batch * seq * ((22 + 4 * d) * n_embd + 4)
    # Attention: the row sums of the exponentials (B H T) always; the causal blocks of the
    # exponentials themselves, K(T) per head (cpu.attention.kept_probabilities), unless recomputed.
    kept = 0 if mode == "selective" else kept_probabilities(seq)
    return tokens + s * batch * n_head * (seq + kept)


def model_config(args, n_layer: int) -> GPTConfig:
    return GPTConfig(vocab_size=256, block_size=args.seq, n_layer=n_layer, n_head=args.n_head,
                     n_embd=args.n_embd, dropout=args.dropout, dtype="float32")


def measure_activations(cfg: GPTConfig, mode: str, batch: int, precision: str = "full") -> dict:
    """Bytes one micro-batch's forward leaves held for backward, and the peak above that during
    backward (tracemalloc: every NumPy allocation), after a warm-up step (caches, gradients)."""
    model = GPT(cfg, seed=0, precision=precision)
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
        cfg = load_config(None, [f"model.block_size={args.seq}", f"model.n_layer={n_layer}",
                                        f"model.n_head={args.n_head}", f"model.n_embd={args.n_embd}",
                                        f"model.dropout={args.dropout}", "model.dtype=float32",
                                        f"train.micro_batch_size={args.batch}", "train.microbatches=1",
                                        f"train.recompute={mode}", "mesh.pp=1"])
        return memory_parts(cfg, 1, 1, 1, 1)[1]
    return (act(args.n_layer) - act(1)) / (args.n_layer - 1)


def activations(args) -> Section:
    layers = args.n_layer
    rows, table = [], []
    seconds = step_seconds(model_config(args, layers), args.batch, args.repeats)
    for mode in RECOMPUTE_MODES:
        one, many = (measure_activations(model_config(args, n), mode, args.batch) for n in (1, layers))
        measured = (many["held_bytes"] - one["held_bytes"]) / (layers - 1)
        formula = activation_formula_bytes(mode, args.batch, args.seq, args.n_embd, args.n_head, "float32",
                                           args.dropout)
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
        notes=[f"formula: none s B T [(22 + 4d) C + 4] + s B H (K(T) + T); selective without K(T); full s B T C "
               f"(Korthikanti, 16-bit Megatron: {korthikanti / MiB:.3f} MiB)",
               "estimate: the start-up estimate's per-layer count for the same micro-batch (config.memory.estimate_memory: "
               "Megatron's per-layer terms for every layout, not this exact count; docs/config.md)",
               "bwd peak: NumPy bytes above the held ones during backward (full: one block re-run)"])


# ---------------------------------------------------------------------------------------------
# Mixed precision: activation bytes per layer and bytes per parameter, full vs bf16 vs fp16
# ---------------------------------------------------------------------------------------------
PRECISIONS = ("full", "bf16", "fp16")


def precision_formula_bytes(precision: str, batch: int, seq: int, n_embd: int, n_head: int, dropout: float) -> int:
    """Activation bytes one block keeps for backward (recompute none) under `precision` (module doc)."""
    if precision == "full":
        return activation_formula_bytes("none", batch, seq, n_embd, n_head, "float32", dropout)
    a, d, bt = 2, int(dropout > 0), batch * seq
    return (a * bt * 18 * n_embd + 16 * bt + d * (2 * a + 2) * bt * n_embd
            + a * batch * n_head * kept_probabilities(seq))


def state_bytes_per_parameter(args, precision: str) -> float:
    """NumPy bytes a one-rank Trainer holds after two steps, per parameter (tracemalloc)."""
    from mpi4py import MPI

    from hpcpar.training.trainer import Trainer

    tracemalloc.start()
    before = numpy_bytes()
    cfg = load_config(None, [
        f"model.n_layer={args.state_layers}", f"model.n_embd={args.state_embd}", f"model.n_head={args.state_heads}",
        f"model.block_size={args.state_block}", "model.dtype=float32", "mesh.dp=1", "mesh.tp=1", "mesh.pp=1",
        f"train.micro_batch_size={args.state_batch}", "train.microbatches=1", f"train.precision={precision}",
        "train.steps=100", "run.eval_every=0", "run.progress=false"])
    trainer = Trainer(cfg, MPI.COMM_SELF, tokens=TOKENS)
    for step in range(2):
        trainer.train_step(step)
    after = numpy_bytes()
    params = sum(int(np.prod(p.layout.local_shape)) for _, p in trainer.named_parameters)
    trainer.mesh.free()
    del trainer
    tracemalloc.stop()
    return (after - before) / params


def precision(args) -> Section:
    layers, rows, table = args.n_layer, [], []
    for name in PRECISIONS:
        one, many = (measure_activations(model_config(args, n), "none", args.batch, name) for n in (1, layers))
        measured = (many["held_bytes"] - one["held_bytes"]) / (layers - 1)
        formula = precision_formula_bytes(name, args.batch, args.seq, args.n_embd, args.n_head, args.dropout)
        rows.append({"precision": name, "measured_bytes_per_layer": measured, "formula_bytes_per_layer": formula,
                     "ratio": measured / formula, "state_bytes_per_parameter": state_bytes_per_parameter(args, name)})
    full = rows[0]
    for r in rows:
        r["activations_vs_full"] = r["measured_bytes_per_layer"] / full["measured_bytes_per_layer"]
        table.append([r["precision"], f"{r['measured_bytes_per_layer'] / MiB:.3f}",
                      f"{r['formula_bytes_per_layer'] / MiB:.3f}", f"{r['ratio']:.3f}",
                      f"{r['activations_vs_full']:.2f}x", f"{r['state_bytes_per_parameter']:.2f}"])
    checks = {f"{r['precision']} activations within {TOLERANCE:.0%} of the formula": abs(r["ratio"] - 1) <= TOLERANCE
              for r in rows}
    checks.update({f"{r['precision']} state within {TOLERANCE:.0%} of 16 bytes/parameter":
                   abs(r["state_bytes_per_parameter"] / 16 - 1) <= TOLERANCE for r in rows})
    data = {"config": {"batch": args.batch, "seq": args.seq, "n_embd": args.n_embd, "n_head": args.n_head,
                       "n_layer": layers, "dropout": args.dropout, "master_dtype": "float32",
                       "state_model": {"n_layer": args.state_layers, "n_embd": args.state_embd}},
            "rows": rows}
    return Section(
        data=data,
        title=(f"mixed precision: activations per layer (B={args.batch}, T={args.seq}, C={args.n_embd}, "
               f"H={args.n_head}, dropout={args.dropout}) and model state per parameter, float32 masters, one process"),
        header=["precision", "activations MiB", "formula MiB", "ratio", "vs full", "state bytes/param"],
        rows=table, checks=checks,
        notes=["formula: full s B T [(22 + 4d) C + 4] + s B H (K(T) + T) (s = 4); 16-bit a B T 18 C + 16 B T "
               "+ d (2a + 2) B T C + a B H K(T) (a = 2), K(T) the causal blocks' elements",
               "state: masters, gradients and AdamW moments stay float32 (16 bytes/parameter in every precision)"])


# ---------------------------------------------------------------------------------------------
# Model state per parameter, by ZeRO stage (runs on --ranks ranks, under mpiexec)
# ---------------------------------------------------------------------------------------------
def numpy_bytes() -> int:
    """Bytes of every NumPy array allocation live now (tracemalloc must be tracing)."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def train_config(args, zero: int, embd: int, ranks: int) -> Config:
    return load_config(None, [
        f"model.n_layer={args.state_layers}", f"model.n_embd={embd}", f"model.n_head={args.state_heads}",
        f"model.block_size={args.state_block}", "model.dtype=float32", f"mesh.dp={ranks}", "mesh.tp=1", "mesh.pp=1",
        f"train.micro_batch_size={args.state_batch}", "train.microbatches=1",
        f"train.bucket_mb={args.state_bucket_mb}", f"train.zero={zero}", "train.steps=100", "run.eval_every=0",
        "run.progress=false"])


FORMULAS = {0: "4 + 4 + 8", 1: "4 + 4 + 8/N", 2: "4 + 12/N", 3: "16/N + unit"}


def state_formula_bytes(zero: int, n: int) -> float:
    """Bytes per parameter by the ZeRO paper's fp32 Adam accounting (without the gathered unit)."""
    return {0: 16.0, 1: 8.0 + 8.0 / n, 2: 4.0 + 12.0 / n, 3: 16.0 / n}[zero]


def measure_model_state(args, zero: int, world) -> dict:
    """One zero stage: model-state bytes of this rank after two steps (and a gathered unit)."""
    from hpcpar.training.trainer import Trainer

    tracemalloc.start()
    before = numpy_bytes()
    trainer = Trainer(train_config(args, zero, args.state_embd, world.Get_size()), world, tokens=TOKENS)
    for step in range(2):
        trainer.train_step(step)
    after = numpy_bytes()
    params = sum(int(np.prod(p.layout.local_shape)) for _, p in trainer.named_parameters)
    unit_bytes, unit_params = 0, 0
    units = trainer.dp.unit_hooks
    if units is not None:  # the "+ one gathered unit" term: the largest unit through the real gather path
        unit = max(units.units.values(), key=lambda u: sum(f.size for f in u.flats))
        units._acquire(unit, None, True)  # no prefetch: this unit alone
        unit_bytes = numpy_bytes() - after
        unit_params = sum(f.size for f in unit.flats)
        units._release(unit)
    held = trainer.dp.model_state_bytes()
    trainer.mesh.free()
    del trainer
    tracemalloc.stop()
    return {"zero": zero, "params": params, "state_bytes": after - before, "unit_bytes": unit_bytes,
            "unit_params": unit_params, "held_by_objects": held}


def fit_demonstration(args, world) -> dict:
    """A per-rank limit that plain DP (zero 0) cannot train the big model under but zero 3 can."""
    from hpcpar.training.trainer import Trainer

    n, small, big = world.Get_size(), args.state_embd, args.state_big_embd
    cases = (("small_zero0", 0, small), ("big_zero0", 0, big), ("big_zero3", 3, big))
    estimate = {name: estimate_memory(validate(train_config(args, zero, embd, n), n), n, 1, 1, 1)
                for name, zero, embd in cases}
    # 10 % above what the config estimates for the big model under zero 3 (the estimate is within a
    # few per cent of the measured peak), far below what plain DP needs for it.
    limit = int(max(estimate["small_zero0"], estimate["big_zero3"]) * 1.10)
    accepted, refused = {}, {}
    for name, zero, embd in cases:
        try:
            validate(train_config(args, zero, embd, n), n, available_memory_bytes=limit)
            accepted[name] = True
        except ConfigError as err:
            accepted[name], refused[name] = False, str(err)
    params = {name: validate(train_config(args, 0, embd, n), n).model.num_params()
              for name, embd in (("small", small), ("big", big))}
    # The big model under zero 3, as `hpcpar train` builds it with this limit: it trains.
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    trainer = Trainer(train_config(args, 3, big, n), world, tokens=TOKENS, available_memory_bytes=limit)
    tracemalloc.reset_peak()
    losses, started = [], time.perf_counter()
    for step in range(args.state_steps):
        losses.append(trainer.train_step(step).loss)
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] - base
    trainer.mesh.free()
    del trainer
    tracemalloc.stop()
    peak = max(world.allgather(peak))
    return {"limit_bytes": limit, "estimates": estimate, "accepted": accepted, "refused": refused,
            "params": params, "param_ratio": params["big"] / params["small"], "big_zero3_losses": losses,
            "big_zero3_peak_bytes": peak, "big_zero3_peak_under_limit": peak <= limit,
            "big_zero3_step_s": elapsed / max(args.state_steps, 1)}


def model_state_worker(out: str, args) -> int:
    """One rank of the model_state section's launch; rank 0 writes the section's data to `out`."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    n = world.Get_size()
    rows = []
    for zero in (0, 1, 2, 3):
        every = world.allgather(measure_model_state(args, zero, world))
        busiest = max(every, key=lambda r: r["state_bytes"] + r["unit_bytes"])
        p = busiest["params"]
        measured, unit = busiest["state_bytes"] / p, busiest["unit_bytes"] / p
        expected = state_formula_bytes(zero, n) + 4.0 * busiest["unit_params"] / p  # one gathered unit, fp32
        rows.append({**busiest, "n": n, "bytes_per_param": measured, "unit_bytes_per_param": unit,
                     "measured": measured + unit, "formula": FORMULAS[zero], "formula_bytes_per_param": expected,
                     "error": (measured + unit) / expected - 1.0, "per_rank": [r["state_bytes"] for r in every]})
    data = {"model": {"layers": args.state_layers, "embd": args.state_embd, "heads": args.state_heads,
                      "block": args.state_block, "batch": args.state_batch, "dtype": "float32", "optimizer": "adamw"},
            "rows": rows, "within_10_percent": all(abs(r["error"]) <= TOLERANCE for r in rows),
            "fit": fit_demonstration(args, world)}
    if world.Get_rank() == 0:
        Path(out).write_text(json.dumps(data))
    return 0


def model_state(args) -> Section:
    """The model_state section: launches `model_state_worker` under mpiexec, tabulates its JSON."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    options = [f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items() if key.startswith("state_")]
    cmd = [mpiexec, "-n", str(args.ranks), sys.executable, __file__, "--model-state-worker", out, *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": f"{Path(__file__).resolve().parent.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(cmd, check=True, timeout=args.timeout, env=env)
    data = json.loads(Path(out).read_text())
    os.unlink(out)
    rows = [[str(r["zero"]), r["formula"], f"{r['formula_bytes_per_param']:.2f}", f"{r['measured']:.2f}",
             f"{r['unit_bytes_per_param']:.2f}", f"{r['error']:+.1%}"] for r in data["rows"]]
    f = data["fit"]
    checks = {f"zero={r['zero']} within {TOLERANCE:.0%} of its formula": abs(r["error"]) <= TOLERANCE
              for r in data["rows"]}
    checks.update({"the big model has >= 3x the parameters": f["param_ratio"] >= 3,
                   "plain DP refuses the big model": not f["accepted"]["big_zero0"],
                   "zero=3 accepts it": f["accepted"]["big_zero3"],
                   "zero=3's measured peak is under the limit": f["big_zero3_peak_under_limit"]})
    m, n = data["model"], data["rows"][0]["n"]
    return Section(
        data=data,
        title=(f"model state per parameter on {n} ranks (dp={n}), GPT {m['layers']}x{m['embd']} float32 AdamW, "
               f"{data['rows'][0]['params'] / 1e6:.2f}M params; NumPy allocations after 2 steps, busiest rank"),
        header=["zero", "formula", "bytes/param", "measured", "of which unit", "error"],
        rows=rows, checks=checks,
        notes=[f"under a limit of {f['limit_bytes'] / MiB:.1f} MiB per rank (config estimate): "
               f"{f['params']['small'] / 1e6:.2f}M params with zero=0 "
               f"{'accepted' if f['accepted']['small_zero0'] else 'REFUSED'}; {f['params']['big'] / 1e6:.2f}M "
               f"({f['param_ratio']:.1f}x) with zero=0 {'accepted' if f['accepted']['big_zero0'] else 'refused'} "
               f"(estimated {f['estimates']['big_zero0'] / MiB:.1f} MiB), with zero=3 "
               f"{'accepted' if f['accepted']['big_zero3'] else 'REFUSED'} "
               f"(estimated {f['estimates']['big_zero3'] / MiB:.1f} MiB)",
               f"zero=3 trained {len(f['big_zero3_losses'])} steps (loss {f['big_zero3_losses'][0]:.3f} -> "
               f"{f['big_zero3_losses'][-1]:.3f}); measured peak {f['big_zero3_peak_bytes'] / MiB:.1f} MiB per rank",
               *([f"zero=0: {f['refused']['big_zero0']}"] if "big_zero0" in f["refused"] else [])])


SECTIONS: dict[str, Callable[[argparse.Namespace], Section]] = {"activations": activations,
                                                             "precision": precision,
                                                             "model_state": model_state}


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--model-state-worker"]:  # one rank of the model_state section's mpiexec
        return model_state_worker(argv[1], parser_for().parse_args(argv[2:]))
    args = parser_for().parse_args(argv)
    names = [n for n in args.sections.split(",") if n]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser_for().error(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if ("activations" in names or "precision" in names) and args.n_layer < 2:
        parser_for().error("--n-layer must be >= 2 (per-layer figures are differences against a 1-block model)")
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


def parser_for() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of: {', '.join(SECTIONS)}")
    parser.add_argument("--seq", type=int, default=512, help="activations: block_size T (>= 512 makes them "
                        "dominate)")
    parser.add_argument("--batch", type=int, default=2, help="activations: micro-batch")
    parser.add_argument("--n-embd", type=int, default=128, help="activations: width")
    parser.add_argument("--n-head", type=int, default=4, help="activations: heads")
    parser.add_argument("--n-layer", type=int, default=3, help="activations: blocks of the larger model (the smaller "
                        "has 1)")
    parser.add_argument("--dropout", type=float, default=0.1, help="activations: dropout")
    parser.add_argument("--repeats", type=int, default=8,
                        help="activations: timed forward + backward passes per mode, alternating (best kept)")
    parser.add_argument("--ranks", type=int, default=4, help="model_state: ranks (dp = N)")
    parser.add_argument("--state-layers", type=int, default=4, help="model_state: blocks")
    parser.add_argument("--state-embd", type=int, default=128, help="model_state: width of the measured model")
    parser.add_argument("--state-big-embd", type=int, default=256, help="model_state: width of the model plain DP "
                        "refuses")
    parser.add_argument("--state-heads", type=int, default=4)
    parser.add_argument("--state-block", type=int, default=64)
    parser.add_argument("--state-batch", type=int, default=2, help="model_state: micro-batch per rank (small: the "
                        "model state dominates)")
    parser.add_argument("--state-bucket-mb", type=float, default=0.25)
    parser.add_argument("--state-steps", type=int, default=3, help="model_state: steps of the zero=3 fit")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.json"))
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
