"""The search of `hpcpar plan`: every layout of an allocation, ranked by predicted step time.

For an allocation of `world` ranks and a model with a global batch of G sequences,
`fastest_layouts` enumerates every layout hpcpar runs (`candidates`): dp (and its dp_replicate x
dp_shard split), tp, pp with each schedule and its chunks, cp, the ZeRO stage, recomputation, the
micro-batch size b and count m = G / (dp b). It predicts each one's step (`predict.predict`,
closed-form pipelines first, then the simulator for the front runners), and keeps, fastest
first, those `config.validate` accepts whose `config.memory.estimate_memory` fits a rank.
`reasons` says per axis why the first won, `format_plans` prints the table, and `write_plan`
writes the best as a config `hpcpar train` runs as is (`runnable`: a 16-bit what-if becomes
float32 masters with train.precision).

A mixture-of-experts model (`model.moe_experts > 0`) is planned with the configured `mesh.ep`
kept fixed (layouts whose dp_shard it does not divide fail validation and drop out). Planning ep
itself is future work. Pure: with a hardware preset, planning loads no MPI (login nodes).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from hpcpar.backend.precision import LOW_DTYPES
from hpcpar.config.load import to_toml
from hpcpar.config.memory import estimate_memory, state_bytes_per_param
from hpcpar.config.sections import Config
from hpcpar.config.validate import validate
from hpcpar.errors import ConfigError, HpcparError
from hpcpar.nn.gpt import DTYPES
from hpcpar.planner.hardware import GiB, Hardware
from hpcpar.planner.predict import Prediction, predict
from hpcpar.runtime.topology import resolve_degrees
from hpcpar.schema import divisors

# `hpcpar plan --preset`: model shapes to plan, as the [model] keys they set.
MODEL_PRESETS: dict[str, dict] = {   # n_layer, n_head, n_embd, block_size, vocab_size
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
    "gpt2-1.5b": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50304),
    "7b": dict(n_layer=32, n_head=32, n_embd=4096, block_size=4096, vocab_size=32000),
    "70b": dict(n_layer=80, n_head=64, n_embd=8192, block_size=4096, vocab_size=32000),
    "175b": dict(n_layer=96, n_head=96, n_embd=12288, block_size=2048, vocab_size=51200),
}


_SIMULATED_CANDIDATES = 300   # plans ranked by the simulator (the rest by closed forms, after them)


def candidates(cfg: Config, world: int, hw: Hardware, global_batch: int):
    """Every layout of `world` ranks for cfg's model and `global_batch` sequences (not yet
    validated). Micro-batch sizes are the powers of two up to 64 that divide a dp rank's share
    (and the share itself when smaller); HSDP's dp_replicate is 1 or the value that keeps each
    shard group inside a node."""
    m = cfg.model
    for tp in divisors(world):
        if m.n_head % tp or tp > hw.ranks_per_node:
            continue
        for pp in divisors(world // tp):
            if pp > m.n_layer:
                continue
            for cp in divisors(world // (tp * pp)):
                if cp > 1 and (m.block_size % (2 * cp) or cp * tp > hw.ranks_per_node):
                    continue
                dp = world // (tp * pp * cp)
                if global_batch % dp:
                    continue
                per_rank = global_batch // dp
                sizes = {b for b in divisors(per_rank) if b & (b - 1) == 0 and b <= 64}
                if per_rank <= 64:
                    sizes.add(per_rank)
                in_node = max(1, hw.ranks_per_node // (tp * cp))
                replicates = {1} | ({dp // in_node} if dp > in_node and dp % in_node == 0 else set())
                for b in sorted(sizes):
                    mb = per_rank // b
                    for sched, chunks in _schedules(pp, mb, m.n_layer):
                        for zero in (0, 1, 2, 3) if dp * cp > 1 else (0,):
                            for replicate in sorted(r for r in replicates if r == 1 or zero):
                                for recompute, sp in itertools.product(("none", "selective", "full"),
                                                                       (False, True) if tp > 1 else (False,)):
                                    yield dataclasses.replace(
                                        cfg,
                                        mesh=dataclasses.replace(cfg.mesh, dp=dp, tp=tp, pp=pp, cp=cp,
                                                                 dp_replicate=replicate, sequence_parallel=sp),
                                        train=dataclasses.replace(cfg.train, micro_batch_size=b, microbatches=mb,
                                                                  zero=zero, recompute=recompute),
                                        pipeline=dataclasses.replace(cfg.pipeline, schedule=sched, chunks=chunks))


def _schedules(pp: int, microbatches: int, n_layer: int):
    """(schedule, chunks) pairs to try: 1F1B (GPipe when m < pp, where they tie), interleaved,
    ZB-H1 and ZB-V (chunks 0: the schedule's own)."""
    if pp == 1:
        yield "1f1b", 1
        return
    yield ("1f1b" if microbatches >= pp else "gpipe"), 1
    for chunks in (2, 4):
        if microbatches % pp == 0 and n_layer >= pp * chunks:
            yield "interleaved", chunks
    yield "zbh1", 1
    if n_layer >= 2 * pp:
        yield "zbv", 0


def fastest_layouts(cfg: Config, world: int, hw: Hardware, top: int = 5, global_batch: int | None = None,
                    keep: int = 400) -> list[Prediction]:
    """The fastest layouts that `config.validate` accepts and that fit `hw.memory_bytes`, fastest
    first: `top` of them (0: up to `keep`, enough for `reasons`). Every candidate is predicted
    (cheap); validation and the memory estimate then run in that order until enough fit."""
    if global_batch is None:
        global_batch = _global_batch(cfg, world)
    if state_bytes_per_param(cfg) * cfg.model.num_params() / world > hw.memory_bytes:
        raise ConfigError(_nothing_fits(cfg, world, hw, global_batch, 1))   # not even fully sharded
    rough = sorted((predict(c, hw, exact=False) for c in candidates(cfg, world, hw, global_batch)),
                   key=lambda p: p.step_time)
    # The simulator only for the candidates the closed forms put near the front.
    preds = sorted((predict(p.cfg, hw) for p in rough[:_SIMULATED_CANDIDATES]), key=lambda p: p.step_time)
    preds += rough[_SIMULATED_CANDIDATES:]
    found = []
    for p in preds:
        try:
            cand = _validate(p.cfg, world)
        except HpcparError:
            continue            # a layout the engine refuses is simply not a candidate
        memory = estimate_memory(cand, cand.mesh.dp, cand.mesh.tp, cand.mesh.pp, cand.mesh.cp)
        if memory <= hw.memory_bytes:
            found.append(dataclasses.replace(p, cfg=cand, memory_bytes=memory))
            if len(found) >= (top or keep):
                break
    if not found:
        raise ConfigError(_nothing_fits(cfg, world, hw, global_batch, len(preds)))
    return sorted(found, key=lambda p: p.step_time)


def _validate(cfg: Config, world: int) -> Config:
    """`config.validate`, except that a 16-bit model.dtype (a 16-bit model: what `train.precision`
    bf16/fp16 runs, with 16-bit GEMM rates and bytes) is planned as such: every other rule still
    applies, and `write_plan` writes it as float32 masters with `train.precision`."""
    if DTYPES[cfg.model.dtype] != 2:
        return validate(cfg, world)
    as32 = validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="float32")), world)
    return dataclasses.replace(as32, model=cfg.model)


def _global_batch(cfg: Config, world: int) -> int:
    """The config's global batch on `world` ranks: dp x micro_batch_size x microbatches."""
    try:
        dp = resolve_degrees(world, cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.cp)[0]
    except Exception:  # noqa: BLE001 - degrees that do not fit this world: the batch per rank as given
        dp = 1
    return dp * cfg.train.micro_batch_size * cfg.train.microbatches


def _nothing_fits(cfg: Config, world: int, hw: Hardware, global_batch: int, tried: int) -> str:
    """One line: why no layout fits, and how many ranks of this hardware the model state alone needs."""
    if tried == 0:
        return (f"no layout of {world} ranks divides the global batch of {global_batch} sequences and the model "
                f"(n_head={cfg.model.n_head}, n_layer={cfg.model.n_layer}); use a global batch or a rank count "
                "with common divisors")
    need = math.ceil(cfg.model.num_params() * state_bytes_per_param(cfg) / hw.memory_bytes)
    return (f"no layout of {world} ranks fits the {cfg.model.num_params() / 1e9:.2f}B-parameter model in "
            f"{hw.memory_bytes / GiB:.1f} GiB per rank (even with ZeRO-3 and full recomputation); its weights, "
            f"gradients and optimizer state alone need >= {need} such ranks (more for activations), or a "
            "smaller global batch per rank")


def reasons(best: Prediction, others: list[Prediction]) -> list[str]:
    """Per axis, why the best plan's value: the fastest plan with another value, and how much slower."""
    out = []
    axes = {"tp": lambda p: p.cfg.mesh.tp, "pp": lambda p: p.cfg.mesh.pp, "cp": lambda p: p.cfg.mesh.cp,
            "dp": lambda p: p.cfg.mesh.dp, "zero": lambda p: p.cfg.train.zero,
            "recompute": lambda p: p.cfg.train.recompute, "schedule": lambda p: p.cfg.pipeline.schedule,
            "micro_batch_size": lambda p: p.cfg.train.micro_batch_size}
    for axis, value in axes.items():
        alt = [p for p in others if value(p) != value(best)]
        if not alt:
            out.append(f"{axis}={value(best)}: the only value that validates and fits")
            continue
        runner = min(alt, key=lambda p: p.step_time)
        out.append(f"{axis}={value(best)}: the best plan with {axis}={value(runner)} is "
                   f"{runner.step_time / best.step_time:.2f}x slower")
    return out


def format_plans(plans: list[Prediction], world: int, hw: Hardware, why: list[str]) -> str:
    lines = [f"plans for {world} ranks on {hw.name} (predicted; memory is config.memory.estimate_memory)",
             f"{'#':>2}  {'step':>9}  {'tokens/s':>10}  {'MFU':>6}  {'memory':>9}  layout"]
    for i, p in enumerate(plans, 1):
        lines.append(f"{i:>2}  {p.step_time * 1e3:>7.1f}ms  {p.tokens_per_s:>10,.0f}  {p.mfu:>6.1%}  "
                     f"{p.memory_bytes / 2**20:>7.0f}Mi  {p.layout}")
    lines.append("why the first:")
    lines += [f"  {w}" for w in why]
    return "\n".join(lines)


PRECISION_OF = {dtype: name for name, dtype in LOW_DTYPES.items()}   # "bfloat16" -> "bf16"


def runnable(cfg: Config) -> Config:
    """`cfg` as `hpcpar train` runs it: a 16-bit model.dtype (the planner's what-if of a 16-bit
    model) becomes float32 masters with train.precision = "bf16" / "fp16"."""
    if DTYPES[cfg.model.dtype] != 2:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="float32"),
                               train=dataclasses.replace(cfg.train, precision=PRECISION_OF[cfg.model.dtype]))


def write_plan(pred: Prediction, path: str, run_dir: str | None = None) -> None:
    """A config `hpcpar train` runs as is: the planned config with its mesh degrees (and
    `run_dir` as its run.dir when given)."""
    cfg = runnable(pred.cfg)
    if run_dir:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=run_dir))
    with open(path, "w") as f:
        f.write(f"# hpcpar plan: {pred.layout}\n# predicted {pred.step_time * 1e3:.1f} ms/step, "
                f"{pred.tokens_per_s:,.0f} tokens/s\n")
        f.write(to_toml(cfg))
