"""Validation of the run configuration: every value and combination, for a world size.

`validate(cfg, world_size, available_memory_bytes)` checks field types and ranges, the model, the
parameter server's share of the world, the mesh degrees (resolved by `topology.resolve_degrees`:
no 0 = "auto" left), data, tensor, context and pipeline parallelism, experts, checkpoints and,
given the memory available, the memory estimate (`config.memory`); it returns the same `Config`
with the mesh degrees and pipeline.chunks resolved. Every error is a one-line `ConfigError` (or
`MeshError` for a mesh that does not fit the world) saying what is wrong and what would be right.

Pure: no communication and no I/O, so every rank reaches the same verdict before the first
collective, and no MPI (validation runs on login nodes: `hpcpar job render`, `hpcpar plan`).
`doubts` lists legal but doubtful settings, which a run warns about once; `slow_ranks` reads
run.debug_slow_ranks.
"""

import dataclasses
import math
import re
from typing import Any

from hpcpar import backend
from hpcpar.config.load import coerce, did_you_mean, toml_value
from hpcpar.config.memory import memory_parts
from hpcpar.config.sections import FIELD_TYPES, MFU_PEAK_PRESETS, SECTIONS, CheckpointConfig, Config
from hpcpar.errors import ConfigError, MeshError
from hpcpar.parallel.pp import schedules
from hpcpar.runtime.topology import resolve_degrees
from hpcpar.schema import divisors, require_divisible

def _gt0(v: float) -> bool:
    return v > 0


def _ge0(v: float) -> bool:
    return v >= 0


def _ge1(v: float) -> bool:
    return v >= 1


def _unit(v: float) -> bool:
    return 0 <= v < 1


def _open_unit(v: float) -> bool:
    return 0 < v < 1


# (section.key, test, what it must be) for every single-value range.
_RANGES: tuple[tuple[str, Any, str], ...] = (
    ("model.vocab_size", _ge1, ">= 1"),
    ("model.block_size", lambda v: v >= 2, ">= 2"),
    ("model.n_layer", _ge1, ">= 1"),
    ("model.n_head", _ge1, ">= 1"),
    ("model.n_embd", _ge1, ">= 1"),
    ("model.dropout", _unit, "in [0, 1)"),
    ("mesh.dp", _ge0, ">= 0 (0 = auto)"),
    ("mesh.tp", _ge0, ">= 0 (0 = auto)"),
    ("mesh.pp", _ge0, ">= 0 (0 = auto)"),
    ("mesh.cp", _ge0, ">= 0 (0 = auto)"),
    ("mesh.dp_replicate", _ge1, ">= 1 (1 = no HSDP)"),
    ("mesh.ep", _ge1, ">= 1 (1 = no expert parallelism)"),
    ("model.moe_experts", _ge0, ">= 0 (0 = dense)"),
    ("model.moe_top_k", _ge1, ">= 1"),
    ("model.moe_every", _ge1, ">= 1 (1 = every block)"),
    ("model.moe_capacity_factor", _ge0, ">= 0 (0 = unlimited)"),
    ("model.moe_aux_loss", _ge0, ">= 0 (0 = off)"),
    ("model.moe_z_loss", _ge0, ">= 0 (0 = off)"),
    ("model.moe_expert_bias_rate", _ge0, ">= 0 (0 = off)"),
    ("data.val_fraction", _unit, "in [0, 1)"),
    ("train.steps", _ge1, ">= 1"),
    ("train.micro_batch_size", _ge1, ">= 1"),
    ("train.microbatches", _ge1, ">= 1"),
    ("train.lr", _gt0, "> 0"),
    ("train.min_lr", _ge0, ">= 0"),
    ("train.warmup", _ge0, ">= 0"),
    ("train.weight_decay", _ge0, ">= 0"),
    ("train.beta1", _open_unit, "in (0, 1)"),
    ("train.beta2", _open_unit, "in (0, 1)"),
    ("train.eps", _gt0, "> 0"),
    ("train.grad_clip", _ge0, ">= 0 (0 = no clipping)"),
    ("train.seed", _ge0, ">= 0"),
    ("train.momentum", _unit, "in [0, 1)"),
    ("train.bucket_mb", _gt0, "> 0"),
    ("train.prefetch_units", _ge0, ">= 0 (0 = no prefetch)"),
    ("train.compression_ratio", lambda v: 0 < v <= 1, "in (0, 1]: the fraction of each bucket's entries top-k sends"),
    ("train.powersgd_rank", _ge1, ">= 1"),
    ("train.compression_start_step", _ge0, ">= 0"),
    ("train.int8_block_size", _ge1, ">= 1"),
    ("train.max_bad_steps", _ge1, ">= 1"),
    ("train.sync_every", _ge1, ">= 1 (steps between synchronisations of the replicas)"),
    ("train.outer_lr", _gt0, "> 0"),
    ("train.outer_momentum", _unit, "in [0, 1)"),
    ("train.sync_fragments", _ge1, ">= 1"),
    ("train.sync_delay", _ge0, ">= 0"),
    ("train.sync_mix", _unit, "in [0, 1)"),
    ("train.recompute_every", _ge1, ">= 1 (1 = every block)"),
    ("train.loss_scale", _ge0, ">= 0 (0 = dynamic)"),
    ("train.initial_loss_scale", _gt0, "> 0"),
    ("train.loss_scale_window", _ge1, ">= 1"),
    ("train.loss_scale_growth", lambda v: v > 1, "> 1"),
    ("train.loss_scale_backoff", _open_unit, "in (0, 1)"),
    ("train.loss_scale_hysteresis", _ge1, ">= 1"),
    ("train.min_loss_scale", _gt0, "> 0"),
    ("pipeline.chunks", _ge0, ">= 0 (0 = the schedule's own)"),
    ("checkpoint.every", _ge0, ">= 0 (0 = only at the end)"),
    ("checkpoint.keep", _ge1, ">= 1"),
    ("run.dir", bool, "a non-empty directory path"),
    ("run.log_every", _ge1, ">= 1"),
    ("run.eval_every", _ge0, ">= 0 (0 = never)"),
    ("run.eval_batches", _ge1, ">= 1"),
    ("run.timeout", _gt0, "> 0 seconds"),
    ("run.debug_check_every", _ge0, ">= 0 (0 = off)"),
    ("checkpoint.memory_every", _ge0, ">= 0 (0 = no in-memory partner snapshots)"),
    ("run.debug_fail_at", lambda v: v == "" or re.fullmatch(r"\d+(,\d+)*@\d+(/exchange)?", v) is not None,
     "\"\" or \"R[,R...]@STEP\" (world ranks, a step), optionally with \"/exchange\""),
    ("run.debug_slow_factor", _ge1, ">= 1 (1 = off)"),
    ("run.mfu_peak", lambda v: mfu_peak_flops(v) is not None or v in ("auto", "measure", *MFU_PEAK_PRESETS),
     "\"auto\", \"measure\", " + ", ".join(f'"{p}"' for p in MFU_PEAK_PRESETS) + " or a positive number of "
     "FLOP/s per rank (e.g. \"989e12\")"),
    ("ps.servers", _ge0, ">= 0 (0 = no parameter server)"),
    ("ps.staleness", _ge0, ">= 0 (0 = synchronous)"),
    ("ps.stale_weight", lambda v: 0 <= v <= 1, "in [0, 1] (1 = a late push counts as fresh, 0 = dropped)"),
)


def mfu_peak_flops(value: str) -> float | None:
    """run.mfu_peak as FLOP/s per rank when it is a positive finite number ("989e12"), else None."""
    try:
        flops = float(value)
    except ValueError:
        return None
    return flops if math.isfinite(flops) and flops > 0 else None


def _get(cfg: Config, name: str) -> Any:
    section, key = name.split(".")
    return getattr(getattr(cfg, section), key)


def _check_fields(cfg: Config) -> None:
    """Types (for configs built in code), finite numbers, UTF-8 text, fixed choices."""
    for section in SECTIONS:
        for f in dataclasses.fields(SECTIONS[section]):
            name, ftype = f"{section}.{f.name}", FIELD_TYPES[section][f.name]
            value = coerce(name, ftype, _get(cfg, name))
            if ftype is float and not math.isfinite(value):
                raise ConfigError(f"{name}={value!r} is invalid: must be a finite number")
            if ftype is str:
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ConfigError(f"{name}={value!r} is not valid UTF-8; the config is saved as TOML "
                                      "(UTF-8), so use a UTF-8 name") from None
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                hint = did_you_mean(value, choices) if isinstance(value, str) else ""
                raise ConfigError(f"{name}={toml_value(value)} is not one of "
                                  f"{', '.join(toml_value(c) for c in choices)}; {hint}".rstrip("; "))


def _check_ranges(cfg: Config) -> None:
    for name, ok, requirement in _RANGES:
        value = _get(cfg, name)
        if not ok(value):
            raise ConfigError(f"{name}={toml_value(value)} is invalid: must be {requirement}")


def _check_model(cfg: Config) -> None:
    m = cfg.model
    require_divisible("model.n_embd", m.n_embd, "model.n_head", m.n_head, "(heads split the width evenly)")
    m.check_dtype()
    if cfg.data.format == "bytes" and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is invalid: must be >= 256 with data.format=\"bytes\" "
                          "(tokens are bytes 0..255)")
    t = cfg.train
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr!r} exceeds train.lr={t.lr!r}; the cosine schedule decays "
                          "from lr down to min_lr, so choose min_lr <= lr")
    if cfg.run.eval_every > 0 and cfg.data.val_fraction == 0:
        raise ConfigError(f"run.eval_every={cfg.run.eval_every} needs held-out data but data.val_fraction=0; "
                          "set data.val_fraction > 0 (e.g. 0.05) or run.eval_every=0")


def _check_packing(cfg: Config) -> None:
    """data.packing = "documents" where document masking is built (data/packing.py, ring attention,
    Ulysses and synchronous parameter servers included); the GPU backend, local SGD / DiLoCo and stale
    or async parameter servers refused. data.balance deals packed
    windows, and regroups the micro-batches that MoE's capacity and balancing loss are computed
    over: not with experts."""
    if cfg.data.balance != "none" and cfg.data.packing != "documents":
        raise ConfigError(f"data.balance = \"{cfg.data.balance}\" deals packed documents: set data.packing = "
                          "\"documents\" (or data.balance = \"none\")")
    if cfg.data.balance != "none" and cfg.model.moe_experts:
        raise ConfigError(f"data.balance = \"{cfg.data.balance}\" does not compose with model.moe_experts > 0: "
                          "expert capacity and the balancing loss are per micro-batch, so regrouping windows "
                          "changes the run; set data.balance = \"none\"")
    if cfg.data.packing != "documents":
        return
    # The per-token weights count the kept targets of the whole global batch (data/balance.py): right
    # where every step averages every replica's gradients of that step, not where replicas step alone.
    if cfg.train.sync != "step":
        raise ConfigError(f"data.packing = \"documents\" does not yet work with train.sync = \"{cfg.train.sync}\": "
                          "its per-token loss counts the whole global batch's targets, not a replica's own; set "
                          "train.sync = \"step\" or data.packing = \"none\"")
    if cfg.ps.servers and (cfg.ps.mode != "bounded" or cfg.ps.staleness):
        raise ConfigError("data.packing = \"documents\" works with synchronous parameter servers only (ps.mode = "
                          "\"bounded\", ps.staleness = 0): its per-token loss counts each step's whole global batch")
    if cfg.run.backend == "cupy" or (cfg.run.backend == "auto" and backend.name() == "cupy"):
        raise ConfigError("data.packing = \"documents\" does not yet work with the GPU backend: its attention "
                          "kernel does not mask documents yet (set run.backend=\"numpy\")")


def _check_data_parallel(cfg: Config, dp: int) -> None:
    """HSDP splits dp into dp_replicate x dp_shard and needs ZeRO; gradient compression works on
    the buckets of zero 0-2, not on ZeRO-3's units."""
    t, r = cfg.train, cfg.mesh.dp_replicate
    require_divisible("mesh.dp", dp, "mesh.dp_replicate", r, "(HSDP: dp = dp_replicate x dp_shard)",
                      alternative="mesh.dp_replicate=1")
    if r > 1 and t.zero == 0 and t.sync == "step":
        raise ConfigError(f"mesh.dp_replicate={r} splits dp for HSDP, which shards model state over dp_shard; "
                          "use train.zero >= 1 with it, or mesh.dp_replicate=1")
    if t.grad_compression != "none" and t.zero == 3:
        raise ConfigError(f"train.grad_compression={toml_value(t.grad_compression)} compresses the gradient buckets "
                          "of train.zero 0-2; ZeRO-3 reduce-scatters each unit's flat gradient instead (and PowerSGD "
                          "needs whole matrices, which ZeRO-3 never holds); use train.zero <= 2 or "
                          "train.grad_compression=\"none\"")


def _check_outer_sync(cfg: Config, tp: int) -> None:
    """train.sync = "local" / "diloco" synchronises the dp_replicate groups every sync_every steps
    (parallel/dp/outer.py): it needs replicas (so no parameter server, which refuses dp_replicate > 1),
    fragments that cut the blocks and the period evenly, and refuses what would mix the replicas
    every step or make the codes depend on the layout."""
    t, m = cfg.train, cfg.mesh
    if t.sync == "step":
        knobs = [k for k, v in (("train.sync_fragments", t.sync_fragments != 1), ("train.sync_delay", t.sync_delay),
                                ("train.sync_mix", t.sync_mix),
                                ("train.outer_compression", t.outer_compression != "none")) if v]
        if knobs:
            raise ConfigError(f"{knobs[0]} configures train.sync=\"local\" / \"diloco\", but train.sync=\"step\" "
                              "averages every step; set train.sync or leave it at its default")
        return
    mode = f"train.sync={toml_value(t.sync)}"
    if m.dp_replicate < 2:
        raise ConfigError(f"{mode} synchronises the replicas (mesh.dp_replicate groups) every train.sync_every "
                          f"steps, but mesh.dp_replicate={m.dp_replicate}: set mesh.dp_replicate >= 2 (e.g. "
                          "mesh.dp_replicate=mesh.dp), or train.sync=\"step\"")
    f, n_layer = t.sync_fragments, cfg.model.n_layer
    if n_layer % f or t.sync_every % f:
        raise ConfigError(f"train.sync_fragments={f} must divide model.n_layer={n_layer} (a fragment is whole "
                          f"blocks) and train.sync_every={t.sync_every} (fragments sync sync_every / fragments "
                          "steps apart); choose a common divisor, e.g. train.sync_fragments=1")
    if t.sync_delay >= t.sync_every:
        raise ConfigError(f"train.sync_delay={t.sync_delay} must be < train.sync_every={t.sync_every}: a fragment's "
                          "result must land before its next synchronisation starts")
    refused = [
        (t.grad_compression != "none", f"train.grad_compression={toml_value(t.grad_compression)}",
         "the replicas' wire carries outer gradients, compressed by train.outer_compression",
         "train.grad_compression=\"none\""),
        (t.outer_compression == "int8" and (tp > 1 or t.zero == 3),
         f"train.outer_compression=\"int8\" with mesh.tp={tp}, train.zero={t.zero}",
         "its blocks follow the local arrays, which tp and ZeRO-3 cut differently from one process, so the "
         "result would depend on the layout", "train.outer_compression=\"bf16\", or mesh.tp=1 and train.zero <= 2"),
        (cfg.model.moe_expert_bias_rate > 0, f"model.moe_expert_bias_rate={cfg.model.moe_expert_bias_rate}",
         "the expert bias follows the whole global batch's loads every step, which would couple the replicas "
         "between their synchronisations", "model.moe_expert_bias_rate=0 (the aux loss balances each replica)"),
    ]
    for bad, what, why, fix in refused:
        if bad:
            raise ConfigError(f"{what} cannot be combined with {mode}: {why}; use {fix}")


def _check_tensor_parallel(cfg: Config, tp: int) -> None:
    """The rules the tensor-parallel layers guard (`parallel.tp.layers.check_config`), reported first
    and in the config's names. (4 * n_embd) % tp == 0, the MLP width, follows from n_head % tp == 0
    and n_embd % n_head == 0. The vocabulary need not divide: it is padded to a multiple of tp."""
    m = cfg.model
    require_divisible("model.n_head", m.n_head, "mesh.tp", tp, "(a tp rank holds whole heads)")
    if cfg.mesh.sequence_parallel:
        require_divisible("model.block_size", m.block_size, "mesh.tp", tp,
                          "with mesh.sequence_parallel=true (the sequence is split over tp)",
                          alternative="mesh.sequence_parallel=false")


def _check_context_parallel(cfg: Config, tp: int, cp: int) -> None:
    """The sequence must cut into the chunks of the cp layout (2cp zigzag chunks for ring, cp for
    Ulysses; times tp under sequence parallelism) and Ulysses needs whole heads on every tp x cp
    rank. One line each, naming the degrees that would fit."""
    if cp == 1:
        return
    m, ring = cfg.model, cfg.mesh.cp_impl == "ring"
    sp = cfg.mesh.sequence_parallel and tp > 1
    factor = (2 if ring else 1) * (tp if sp else 1)   # sequence pieces per cp rank
    if m.block_size % (factor * cp):
        pieces = "*".join((["2"] if ring else []) + ["mesh.cp"] + (["mesh.tp"] if sp else []))
        why = ("ring attention cuts the sequence into 2*cp zigzag chunks" if ring
               else "each cp rank holds block_size/cp tokens")
        if sp:
            why += ", each split over tp by sequence parallelism"
        fits = [c for c in divisors(m.block_size) if m.block_size % (factor * c) == 0]
        raise ConfigError(f"model.block_size={m.block_size} is not divisible by {pieces}={factor * cp} ({why}); "
                          f"choose cp in {{{', '.join(map(str, fits))}}} or use block_size="
                          f"{-(-m.block_size // (factor * cp)) * factor * cp}")
    if not ring and m.n_head % (tp * cp):
        fits = [c for c in divisors(m.n_head) if m.n_head % (tp * c) == 0]
        raise ConfigError(f"model.n_head={m.n_head} is not divisible by mesh.tp*mesh.cp={tp * cp} "
                          f"(mesh.cp_impl=\"ulysses\" gives every tp x cp rank whole heads); choose cp in "
                          f"{{{', '.join(map(str, fits))}}} or use n_head={-(-m.n_head // (tp * cp)) * tp * cp}, "
                          f"or mesh.cp_impl=\"ring\"")


def _check_experts(cfg: Config, dp: int, tp: int, cp: int) -> None:
    """Mixture of experts: top_k <= E, ep divides E and dp_shard, an expert bias only with experts
    (parameter servers, which never see the global loads, refuse experts), and the combinations
    not implemented with experts (context parallelism, sequence parallelism, ZeRO-3, gradient
    compression, 16-bit precision) refused, one line each."""
    m, ep, t = cfg.model, cfg.mesh.ep, cfg.train
    if m.moe_experts == 0:
        if ep > 1:
            raise ConfigError(f"mesh.ep={ep} divides the experts of a mixture-of-experts model, but "
                              "model.moe_experts=0 (dense); set model.moe_experts (e.g. 4) or mesh.ep=1")
        if m.moe_expert_bias_rate > 0:
            raise ConfigError(f"model.moe_expert_bias_rate={m.moe_expert_bias_rate} balances the experts of a "
                              "mixture-of-experts model, but model.moe_experts=0 (dense); set model.moe_experts "
                              "(e.g. 4) or model.moe_expert_bias_rate=0")
        return
    if m.moe_top_k > m.moe_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} exceeds model.moe_experts={m.moe_experts} (a token is "
                          f"routed to top_k different experts); choose moe_top_k in 1..{m.moe_experts}")
    require_divisible("model.moe_experts", m.moe_experts, "mesh.ep", ep, "(each ep rank holds E/ep whole experts)",
                      alternative="mesh.ep=1")
    shard = dp // cfg.mesh.dp_replicate
    if shard % ep:
        raise ConfigError(f"mesh.ep={ep} does not divide the {shard} dp_shard ranks (dp={dp}"
                          + (f" / dp_replicate={cfg.mesh.dp_replicate}" if cfg.mesh.dp_replicate > 1 else "")
                          + "; expert parallelism borrows data-parallel ranks); choose ep in "
                          f"{{{', '.join(str(d) for d in divisors(shard) if m.moe_experts % d == 0)}}}")
    unsupported = [(cp > 1, f"mesh.cp={cp}", "mesh.cp=1"),
                   (cfg.mesh.sequence_parallel and tp > 1, "mesh.sequence_parallel=true",
                    "mesh.sequence_parallel=false"),
                   (t.zero == 3, "train.zero=3", "train.zero <= 2"),
                   (t.grad_compression != "none", f"train.grad_compression={toml_value(t.grad_compression)}",
                    "train.grad_compression=\"none\""),
                   (t.precision != "full", f"train.precision={toml_value(t.precision)} (16-bit expert GEMMs)",
                    "train.precision=\"full\"")]
    for bad, what, fix in unsupported:
        if bad:
            raise ConfigError(f"{what} is not implemented with a mixture-of-experts model (model.moe_experts="
                              f"{m.moe_experts}); use {fix}, or model.moe_experts=0")


def _check_pipeline(cfg: Config, pp: int) -> None:
    p, t = cfg.pipeline, cfg.train
    # Schedule-level rules (chunks only with interleaved / fixed by zbv, interleaved needs
    # m % pp == 0, zbv needs pp >= 2, ...).
    schedules.validate(p.schedule, pp, t.microbatches, p.chunks)
    chunks = schedules.resolve_chunks(p.schedule, p.chunks)
    stages = pp * chunks
    if cfg.model.n_layer < stages:
        fixed = f" (pipeline.schedule={p.schedule} runs {chunks} per rank)" if p.schedule == "zbv" else ""
        raise ConfigError(f"model.n_layer={cfg.model.n_layer} is fewer than mesh.pp={pp} x pipeline.chunks="
                          f"{chunks}{fixed} = {stages} virtual stages (each needs a layer); use n_layer >= {stages} "
                          + ("or fewer stages" if cfg.mesh.pp else "or mesh.pp=1 (pp=2 is the auto default)"))


def doubts(cfg: Config) -> list[str]:
    """Legal but doubtful settings of a validated config (mesh resolved), a line each: what a run
    warns about once, on rank 0 (not `validate`, which the planner runs for every candidate and a
    run more than once)."""
    m, t = cfg.mesh, cfg.train
    out = []
    if t.microbatches < m.pp:
        out.append(f"train.microbatches={t.microbatches} < mesh.pp={m.pp}: most of each step is pipeline bubble, "
                   f"(p-1)/(m+p-1) = {100 * (m.pp - 1) / (t.microbatches + m.pp - 1):.0f}%; use microbatches >= "
                   f"{m.pp} (4 x pp is better)")
    if t.grad_compression != "none" and m.dp * m.cp == 1:
        out.append(f"train.grad_compression={t.grad_compression} has nothing to compress: dp x cp = 1 (no "
                   "data-parallel gradient averaging)")
    if t.warmup >= t.steps:
        out.append(f"train.warmup={t.warmup} >= train.steps={t.steps}: the learning rate never reaches train.lr")
    return out


def _fold_reduce_dtype(cfg: Config) -> Config:
    """train.grad_reduce_dtype = "bf16"/"fp16" is the 16-bit wire of train.grad_compression: the
    returned config names it there too (a different compressor beside it is a conflict)."""
    t = cfg.train
    if t.grad_reduce_dtype == "fp32" or t.grad_compression == t.grad_reduce_dtype:
        return cfg
    if t.grad_compression != "none":
        raise ConfigError(f"train.grad_reduce_dtype={toml_value(t.grad_reduce_dtype)} (16-bit gradients on the "
                          f"wire) conflicts with train.grad_compression={toml_value(t.grad_compression)}; keep "
                          "one: train.grad_reduce_dtype=\"fp32\" or train.grad_compression=\"none\"")
    return dataclasses.replace(cfg, train=dataclasses.replace(t, grad_compression=t.grad_reduce_dtype))


def _check_precision(cfg: Config) -> None:
    """bfloat16 arrays exist on the CPU only (ml_dtypes); CuPy has float16 but no bfloat16."""
    t = cfg.train
    if t.precision != "bf16":
        return
    gpu = cfg.run.backend == "cupy" or (cfg.run.backend == "auto" and backend.name() == "cupy")
    if gpu:
        raise ConfigError("train.precision=\"bf16\" stores activations as bfloat16, which CuPy arrays cannot "
                          "hold; on the GPU use train.precision=\"fp16\" (or run.backend=\"numpy\")")


def _check_checkpoint(c: CheckpointConfig) -> None:
    if c.format != "shared":
        return
    if c.location == "node-local":
        raise ConfigError("checkpoint.location=\"node-local\" needs checkpoint.format=\"per_rank\": a shared-file "
                          "save writes one file through MPI-IO, which needs one filesystem every node sees")
    if c.async_save:
        raise ConfigError("checkpoint.async_save=true needs checkpoint.format=\"per_rank\": a shared-file save "
                          "writes through collective MPI-IO, which cannot run in a background thread while training "
                          "communicates")
    import h5py

    if not h5py.get_config().mpi:
        raise ConfigError("checkpoint.format=\"shared\" needs h5py built with MPI (parallel HDF5), and this h5py "
                          "is not: install parallel HDF5 (e.g. apt-get install libhdf5-openmpi-dev) and build h5py "
                          "against it (HDF5_MPI=ON CC=mpicc pip install --no-binary=h5py h5py; README, Parallel "
                          "HDF5), or use checkpoint.format=\"per_rank\"")


def _check_resilience(cfg: Config) -> None:
    """In-memory snapshots and shrink-and-continue (training/resilience.py): what they cannot keep exact."""
    c, run = cfg.checkpoint, cfg.run
    if c.memory_dir and not c.memory_every:
        raise ConfigError(f"checkpoint.memory_dir={toml_value(c.memory_dir)} writes the in-memory partner snapshots "
                          "to node-local disks, but checkpoint.memory_every=0 takes none; set "
                          "checkpoint.memory_every=K (e.g. 5) or checkpoint.memory_dir=\"\"")
    if run.on_failure != "shrink" and not c.memory_every:
        return
    what = "run.on_failure=\"shrink\"" if run.on_failure == "shrink" else "checkpoint.memory_every"
    refused = [
        (cfg.ps.servers > 0, f"ps.servers={cfg.ps.servers}", "the servers hold the model, and a server lost is not "
         "a data-parallel replica lost", "ps.servers=0"),
        (run.on_failure == "shrink" and cfg.train.sync != "step", f"train.sync={toml_value(cfg.train.sync)}",
         "fewer replicas cannot take the diverged replicas' states exactly", "train.sync=\"step\""),
    ]
    off = "run.on_failure=\"abort\"" if run.on_failure == "shrink" else "checkpoint.memory_every=0"
    for bad, setting, why, fix in refused:
        if bad:
            raise ConfigError(f"{what} cannot be combined with {setting}: {why}; use {fix} or {off}")


def slow_ranks(cfg: Config) -> tuple[int, ...] | str:
    """run.debug_slow_ranks as ranks ("" = none), or "random"; ConfigError when it is neither a
    comma-separated list nor "random"."""
    text = cfg.run.debug_slow_ranks.strip()
    if text == "random":
        return text
    try:
        return tuple(sorted({int(r) for r in text.split(",")})) if text else ()
    except ValueError:
        raise ConfigError(f"run.debug_slow_ranks={toml_value(cfg.run.debug_slow_ranks)} is not a comma-separated "
                          "list of ranks or \"random\"; write e.g. \"1\", \"1,3\" or \"random\"") from None


def _check_parameter_server(cfg: Config, world_size: int) -> int:
    """The workers' share of the world (the mesh's ranks) and the combinations a parameter server does
    not support, refused one line each; also run.debug_slow_ranks against the world."""
    ranks = slow_ranks(cfg)
    bad = [r for r in ranks if not 0 <= r < world_size] if ranks != "random" else []
    if bad:
        raise ConfigError(f"run.debug_slow_ranks names rank {bad[0]}, outside the world of {world_size} ranks; "
                          f"use ranks 0..{world_size - 1}")
    s = cfg.ps.servers
    if s == 0:
        if cfg.ps.staleness or cfg.ps.mode != "bounded":
            raise ConfigError("ps.staleness / ps.mode configure a parameter server, but ps.servers=0; set "
                              "ps.servers >= 1 or leave ps.staleness=0 and ps.mode=\"bounded\"")
        return world_size
    if s >= world_size:
        raise ConfigError(f"ps.servers={s} leaves no worker: the world has {world_size} ranks and the last {s} would "
                          f"all be servers; use ps.servers <= {world_size - 1} or launch more ranks")
    if cfg.ps.mode == "async" and cfg.ps.staleness:
        raise ConfigError(f"ps.staleness={cfg.ps.staleness} bounds ps.mode=\"bounded\"; ps.mode=\"async\" has no "
                          "bound: set ps.staleness=0 with it, or ps.mode=\"bounded\"")
    m, t = cfg.mesh, cfg.train
    unsupported = [
        (t.zero > 0, f"train.zero={t.zero}", "the servers already hold the only optimizer state", "train.zero=0"),
        (t.grad_compression != "none", f"train.grad_compression={toml_value(t.grad_compression)}",
         "pushes are whole gradients", "train.grad_compression=\"none\""),
        (m.cp not in (0, 1), f"mesh.cp={m.cp}", "a replica's cp ranks push partial gradients a per-push norm "
         "cannot see", "mesh.cp=1"),
        (m.dp_replicate > 1, f"mesh.dp_replicate={m.dp_replicate}", "HSDP shards over dp, which servers replace",
         "mesh.dp_replicate=1"),
        (cfg.model.moe_experts > 0, f"model.moe_experts={cfg.model.moe_experts}",
         "expert weights are averaged over their own groups", "model.moe_experts=0"),
        (t.precision != "full", f"train.precision={toml_value(t.precision)}",
         "the servers keep no loss scale or 16-bit rounding", "train.precision=\"full\""),
    ]
    for refused, what, why, fix in unsupported:
        if refused:
            raise ConfigError(f"{what} is not supported with a parameter server (ps.servers={s}): {why}; use {fix} "
                              "or ps.servers=0")
    return world_size - s


def _human(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _check_memory(cfg: Config, available: int) -> None:
    """The memory estimate of a resolved config against `available` bytes: over it, one line with
    the two parts and the remedies that shrink the larger (activations or model state)."""
    dp, tp, pp = cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.pp
    state, act = memory_parts(cfg, dp, tp, pp)
    if state + act <= available:
        return
    remedies = []
    if act >= state:
        remedies.append("a smaller train.micro_batch_size or model.block_size")
        if cfg.pipeline.schedule == "gpipe" and pp > 1:
            remedies.append("pipeline.schedule=\"1f1b\" (stashes <= pp micro-batches, not all)")
        if tp > 1 and not cfg.mesh.sequence_parallel:
            remedies.append("mesh.sequence_parallel=true")
        remedies.append("more ranks for mesh.cp (splits the sequence)")
        if cfg.train.recompute != "full":
            remedies.append("train.recompute=\"full\" (keeps a block's input only, re-runs it in backward)")
        elif cfg.train.recompute_every > 1:
            remedies.append("train.recompute_every=1 (recompute every block)")
    if cfg.train.zero < 3 and dp * (cfg.mesh.cp or 1) > 1:
        stages = ", ".join(f"train.zero={z}" for z in range(cfg.train.zero + 1, 4))
        remedies.append(f"{stages} (shards optimizer state, then gradients, then parameters over dp)")
    remedies.append("more ranks for mesh.tp or mesh.pp")
    raise ConfigError(f"estimated memory per rank {_human(state + act)} (weights+grads+optimizer {_human(state)}, "
                      f"activations {_human(act)}) exceeds the available {_human(available)}; try "
                      + ", or ".join(remedies))


def validate(cfg: Config, world_size: int, available_memory_bytes: int | None = None) -> Config:
    """Check every value and combination for `world_size` ranks; return `cfg` with the mesh resolved.

    Pure (no communication, no I/O) so that every rank reaches the same verdict before any collective.
    The returned config has mesh.dp, mesh.tp, mesh.pp, mesh.cp >= 1 with product `world_size` and
    pipeline.chunks >= 1 (the schedule's own where it was 0); validating
    it again gives it back unchanged. `available_memory_bytes`, when given, is compared with
    `estimate_memory` (pass a value every rank agrees on, e.g. the smallest device's memory).
    Raises ConfigError / MeshError (one line); `doubts` names legal but doubtful settings.
    """
    _check_fields(cfg)
    _check_ranges(cfg)
    _check_model(cfg)
    _check_precision(cfg)
    cfg = _fold_reduce_dtype(cfg)
    world, world_size = world_size, _check_parameter_server(cfg, world_size)  # the mesh is the workers'
    try:
        dp, tp, pp, cp = resolve_degrees(world_size, cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.cp)
    except MeshError as err:
        if not cfg.ps.servers:
            raise
        raise MeshError(f"{err} (the worker ranks: the world of {world} less ps.servers={cfg.ps.servers})") from None
    _check_data_parallel(cfg, dp)
    _check_tensor_parallel(cfg, tp)
    _check_context_parallel(cfg, tp, cp)
    _check_packing(cfg)
    _check_pipeline(cfg, pp)
    _check_experts(cfg, dp, tp, cp)
    _check_outer_sync(cfg, tp)
    _check_checkpoint(cfg.checkpoint)
    _check_resilience(cfg)
    chunks = schedules.resolve_chunks(cfg.pipeline.schedule, cfg.pipeline.chunks)
    resolved = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp=dp, tp=tp, pp=pp, cp=cp),
                                   pipeline=dataclasses.replace(cfg.pipeline, chunks=chunks))
    if available_memory_bytes is not None:
        _check_memory(resolved, available_memory_bytes)
    return resolved
