"""`hpcpar plan`: which mesh and micro-batching to run, from a cost model of hpcpar itself.

    hpcpar plan [CONFIG] [--set KEY=VALUE ...] [--preset 7b] (--ranks N | --nodes N --gpus-per-node G)
                [--hardware a100|h100|this] [--top K] [--out plan.toml]
    mpiexec -n 4 hpcpar plan --calibrate [CONFIG] [--set ...]     # measure this machine ("this")

For an allocation of `world` ranks and a model with a global batch of G sequences, `plan`
enumerates every layout hpcpar runs — dp (and its dp_replicate x dp_shard split), tp, pp with
each schedule and its chunks, cp, the ZeRO stage, recomputation, the micro-batch size b and
count m = G / (dp b) — keeps those `config.validate` accepts and whose `config.estimate_memory`
fits a rank, predicts each one's step time and ranks them by it.

The step time of a layout (`predict`) is built from the same pieces the engine runs:

    compute    per layer and micro-batch, forward F and backward B on one tp shard of b T/cp
               tokens: measured by `--calibrate` on this machine (a + c * tokens, per tp), or
               for a GPU preset  GEMM FLOPs / (peak * GEMM efficiency)
                                 + elementwise bytes / memory bandwidth   (activations' traffic)
               recomputation adds the forward again (full) or the attention scores (selective);
               embedding, LM head and loss the same way on the first and last stage
    tp, cp     per layer: 2 all-reduces forward and 2 backward of b T C s bytes (ring, on the
               link inside a node when tp fits one); cp's ring passes K and V cp-1 times,
               hidden behind attention where it is shorter
    pipeline   the schedule simulator (`schedule.timeline`) on the busiest stage's F and B, with
               one point-to-point message of b T C s bytes per boundary
    dp         the gradient reduction of the rank's parameters (all-reduce, or reduce-scatter +
               all-gather under ZeRO; HSDP: over dp_shard, then dp_replicate), ZeRO-3's parameter
               all-gathers per micro-batch; the part the bucketed reduction cannot hide behind the
               last micro-batch's backward is exposed (`Hardware.overlap`)
    optimizer  the update of the rank's (sharded) parameters, plus the step's one small world
               all-gather (and under sequence parallelism one tp all-reduce of the LayerNorm and
               bias gradients)

A mixture-of-experts model (`model.moe_experts > 0`) is planned with the configured `mesh.ep`
kept fixed (layouts whose dp_shard it does not divide fail validation and drop out); its MoE
layers are costed as dense MLPs of the active parameters (top_k experts), without the
dispatch all-to-alls. Planning ep itself is future work.

Collectives follow the alpha-beta model of a ring over n ranks: all-reduce 2(n-1)(alpha +
bytes/(n beta)), all-gather and reduce-scatter half that, a message alpha + bytes/beta; a group
that spans nodes runs at the inter-node link's figures. The simulator sees one representative
rank per role (a pipeline stage; dp replicas and tp ranks are alike), and each schedule shape is
built and compiled once (`schedule.timeline`: the simulator's order, replayed for each
candidate's times, bitwise `simulate`'s makespan), so plans for 10,000+ ranks take seconds;
schedules of more than `_SIMULATE_MAX` actions are simulated shorter and extrapolated, or use
the closed forms the simulator agrees with (tests/unit/test_plan.py).

Calibrated machines (`--calibrate`) add what the pieces leave out, each fitted to real steps:
per-step and per-micro-batch overheads; the tp traffic's scale for each tp degree and the cp
ring's (not assumed hidden behind attention: the measured ratio says what is); and, where ranks
share cores (`cores_per_rank` = cores / ranks < 1, the layer times measured with every rank
busy), a pipeline step is its schedule at a whole core's speed or its work over the cores,
whichever is longer, since a rank waiting in the bubble leaves its share of the core to others.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field

from hpcpar.config import config
from hpcpar.config.config import DTYPES, Config, estimate_memory
from hpcpar.errors import ConfigError, HpcparError
from hpcpar.parallel.pp import pipeline, schedules
from hpcpar.backend.precision import LOW_DTYPES

# --------------------------------------------------------------------------- hardware


@dataclass(frozen=True)
class Link:
    """A link level's ring figures: `alpha` seconds per message, `beta` bytes/s per rank."""

    alpha: float
    beta: float


@dataclass(frozen=True)
class Hardware:
    """What a plan knows about the machine, per rank.

    `layer_times` (calibrated only): {tp: [a_f, c_f, a_b, c_b, a_h, c_h]}, seconds of one block's
    forward (a_f + c_f * tokens) and backward, and of the LM head + loss forward and backward
    together (a_h + c_h * tokens), for the calibrated model's tp shard; `model` names that model.
    """

    name: str
    peak_flops: float            # dense GEMM FLOP/s of the model's dtype
    gemm_efficiency: float       # fraction of the peak a transformer's GEMMs reach
    memory_bandwidth: float      # bytes/s of elementwise work (activations in and out)
    memory_bytes: int            # memory a rank may fill
    ranks_per_node: int
    intra: Link
    inter: Link
    overlap: float               # fraction of the data-parallel reduction hidden behind backward
    optimizer_seconds_per_param: float
    layer_times: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    tp_scale: float = 1.0             # measured / modelled tp and cp traffic of a real step (calibrated)
    cp_scale: float = 1.0
    tp_scales: dict = field(default_factory=dict)   # tp degree -> its own tp_scale (calibrated)
    cp_hidden: float | None = None    # share of the cp ring hidden behind attention (None: `overlap`)
    cores_per_rank: float = 1.0       # < 1: ranks share cores (calibrated); see `predict`'s pipeline
    step_overhead: float = 0.0        # seconds per step the model above leaves out (calibrated)
    microbatch_overhead: float = 0.0  # seconds per micro-batch and stage likewise

    def link(self, group: int, stride: int) -> Link:
        """The link a ring of `group` ranks spaced `stride` apart in rank order runs on."""
        return self.intra if group * stride <= self.ranks_per_node else self.inter


GiB = 2**30
# Vendor peak dense 16-bit tensor-core FLOP/s and HBM bandwidth; NVLink per direction per GPU;
# one 200 Gb/s (A100, Selene as in Narayanan et al.) or 400 Gb/s (H100) HCA per GPU. The GEMM
# efficiency is the fraction of the peak cuBLAS reaches on transformer-sized 16-bit GEMMs.
PRESETS: dict[str, Hardware] = {
    "a100": Hardware("a100", 312e12, 0.70, 2.0e12, 80 * GiB, 8, Link(5e-6, 300e9), Link(10e-6, 25e9),
                     overlap=0.9, optimizer_seconds_per_param=16 / 2.0e12),
    "h100": Hardware("h100", 989e12, 0.70, 3.35e12, 80 * GiB, 8, Link(5e-6, 450e9), Link(10e-6, 50e9),
                     overlap=0.9, optimizer_seconds_per_param=16 / 3.35e12),
}
MODEL_PRESETS: dict[str, dict] = {   # n_layer, n_head, n_embd, block_size, vocab_size
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
    "gpt2-1.5b": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50304),
    "7b": dict(n_layer=32, n_head=32, n_embd=4096, block_size=4096, vocab_size=32000),
    "70b": dict(n_layer=80, n_head=64, n_embd=8192, block_size=4096, vocab_size=32000),
    "175b": dict(n_layer=96, n_head=96, n_embd=12288, block_size=2048, vocab_size=51200),
}


def calibration_path() -> str:
    """Where `--calibrate` stores this machine's figures ($HPCPAR_CALIBRATION, else the user cache)."""
    return os.environ.get("HPCPAR_CALIBRATION") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hpcpar", "calibration.json")


def load_hardware(name: str, path: str | None = None) -> Hardware:
    """A preset, or "this": the figures `--calibrate` stored."""
    if name in PRESETS:
        return PRESETS[name]
    if name != "this":
        raise ConfigError(f"--hardware={name!r} is not one of {', '.join([*PRESETS, 'this'])}")
    path = path or calibration_path()
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--hardware=this needs a calibration, and {path} does not exist; run "
                          "`mpiexec -n N hpcpar plan --calibrate` first (same model keys), or use "
                          "--hardware a100 or h100") from None
    except (OSError, ValueError) as err:   # unreadable, empty, cut short, not UTF-8 or not JSON
        raise _bad_calibration(path, err) from None
    try:
        raw["intra"], raw["inter"] = Link(**raw["intra"]), Link(**raw["inter"])
        raw["layer_times"] = {int(k): v for k, v in raw["layer_times"].items()}
        raw["tp_scales"] = {int(k): v for k, v in raw.get("tp_scales", {}).items()}
        return Hardware(**raw)
    except (KeyError, TypeError, ValueError, AttributeError) as err:   # JSON, but not what --calibrate writes
        raise _bad_calibration(path, err) from None


def _bad_calibration(path: str, err: Exception) -> ConfigError:
    what = (err.strerror if isinstance(err, OSError) else f"no {err.args[0]!r} entry" if isinstance(err, KeyError)
            else f"not valid JSON: {err}" if isinstance(err, json.JSONDecodeError) else f"{type(err).__name__}: {err}")
    return ConfigError(f"calibration file {path} cannot be used ({what}); run `mpiexec -n N hpcpar plan --calibrate` "
                       "again to rewrite it (same model keys), or use --hardware a100 or h100")


def save_hardware(hw: Hardware, path: str | None = None) -> str:
    path = path or calibration_path()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(hw), f, indent=1, sort_keys=True)
    return path


# --------------------------------------------------------------------------- collectives


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` over n ranks: reduce-scatter then all-gather."""
    return 0.0 if n <= 1 else 2 * (n - 1) * (link.alpha + nbytes / (n * link.beta))


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) whose full result is `nbytes`."""
    return 0.0 if n <= 1 else (n - 1) * (link.alpha + nbytes / (n * link.beta))


# --------------------------------------------------------------------------- one layout


@dataclass(frozen=True)
class Prediction:
    """One layout's predicted step. `parts`: seconds by cause (they add up to `step_time`)."""

    cfg: Config
    step_time: float
    tokens_per_s: float
    mfu: float
    memory_bytes: int
    parts: dict

    @property
    def layout(self) -> str:
        m, t, p = self.cfg.mesh, self.cfg.train, self.cfg.pipeline
        dp = f"dp={m.dp}" + (f" ({m.dp_replicate}x{m.dp // m.dp_replicate})" if m.dp_replicate > 1 else "")
        sched = p.schedule + (f"/{p.chunks}" if p.chunks > 1 else "")
        ep = f" ep={m.ep}" if self.cfg.model.moe_experts else ""
        return (f"{dp} tp={m.tp} pp={m.pp} cp={m.cp}{' sp' if m.sequence_parallel else ''}{ep} {sched} "
                f"zero={t.zero} recompute={t.recompute} b={t.micro_batch_size} m={t.microbatches}")


def layer_flops(cfg: Config, tokens: int, tp: int) -> tuple[float, float]:
    """(GEMM FLOPs of one block's forward on a tp shard of `tokens` tokens, of its attention
    scores and weighted sum alone). Attention counts the whole [T, T] (hpcpar computes it)."""
    c, t = cfg.model.n_embd, cfg.model.block_size
    attention = 4.0 * tokens * t * c / tp
    return 24.0 * tokens * c * c / tp + attention, attention


def _analytic_layer(cfg: Config, hw: Hardware, tokens: int, tp: int) -> tuple[float, float, float]:
    """(forward, backward, attention-score forward) seconds of one block from FLOPs and traffic.
    Elementwise traffic per forward: ~16 C s bytes per token (LayerNorms, GELU, residuals,
    dropout) and ~3 T s bytes per token and head (softmax in and out, mask); backward twice."""
    m = cfg.model
    s = DTYPES[m.dtype]
    gemm, attention = layer_flops(cfg, tokens, tp)
    rate = hw.peak_flops * hw.gemm_efficiency
    elem = tokens * s * (16 * m.n_embd + 3 * m.block_size * m.n_head / tp) / hw.memory_bandwidth
    scores = attention / 2 / rate + tokens * s * 3 * m.block_size * m.n_head / tp / hw.memory_bandwidth
    return gemm / rate + elem, 2 * (gemm / rate + elem), scores


def _analytic_head(cfg: Config, hw: Hardware, tokens: int, tp: int) -> float:
    """Forward + backward of ln_f, LM head and loss on a tp shard (logits in and out three times)."""
    m = cfg.model
    vocab = m.vocab_rows(tp)
    return 3 * (2.0 * tokens * m.n_embd * vocab / (hw.peak_flops * hw.gemm_efficiency)
                + 3 * tokens * vocab * DTYPES[m.dtype] / hw.memory_bandwidth)


def _layer_seconds(cfg: Config, hw: Hardware, tokens: int, tp: int) -> tuple[float, float, float, float]:
    """(block forward, block backward, attention-score forward, head fwd+bwd) seconds."""
    f, b, scores = _analytic_layer(cfg, hw, tokens, tp)
    head = _analytic_head(cfg, hw, tokens, tp)
    measured = hw.layer_times.get(tp) if _same_model(cfg, hw) else None
    if measured:
        a_f, c_f, a_b, c_b, a_h, c_h = measured
        scale = (a_f + c_f * tokens) / f if f else 1.0   # the score share of the measured forward
        f, b, head = a_f + c_f * tokens, a_b + c_b * tokens, a_h + c_h * tokens
        scores *= scale
    return f, b, scores, head


def _same_model(cfg: Config, hw: Hardware) -> bool:
    return bool(hw.model) and hw.model == _model_key(cfg)


def _model_key(cfg: Config) -> dict:
    m = cfg.model
    return {"n_layer": m.n_layer, "n_head": m.n_head, "n_embd": m.n_embd, "block_size": m.block_size,
            "vocab_size": m.vocab_size, "dtype": m.dtype, "bias": m.bias}


def _busiest_stage(cfg: Config) -> tuple[int, bool, bool]:
    """(blocks, holds the embedding, holds the head) of the pipeline rank with most work."""
    return _busiest(cfg.model.n_layer, cfg.pipeline.schedule, cfg.mesh.pp, cfg.pipeline.chunks,
                    pipeline.head_cost(cfg.model))


@functools.lru_cache(maxsize=4096)
def _busiest(n_layer: int, name: str, pp: int, chunks: int, head_cost: float) -> tuple[int, bool, bool]:
    place = schedules.placement(name, pp, chunks)
    ranges = pipeline.split_layers(n_layer, place.stages, head_cost)
    best = None
    for rank in range(pp):
        stages = [place.stage(rank, c) for c in range(place.chunks)]
        blocks = sum(len(ranges[v]) for v in stages)
        head = place.stages - 1 in stages
        cost = blocks + (head_cost if head else 0)
        if best is None or cost > best[0]:
            best = (cost, blocks, 0 in stages, head)
    return best[1], best[2], best[3]


def _stage_params(cfg: Config) -> int:
    """Parameters of the pipeline rank that holds most (one tp shard): its blocks, and the
    embedding or the head's own copy of it."""
    m, tp = cfg.model, cfg.mesh.tp
    if cfg.mesh.pp == 1:
        return m.stage_params(m.n_layer, True, True, tp)
    blocks = _busiest_stage(cfg)[0]
    return max(m.stage_params(blocks, True, False, tp), m.stage_params(blocks, False, True, tp))


_SIMULATE_MAX = 4_000   # actions; longer schedules are simulated shorter and extrapolated
_SIMULATE_LIMIT = 6_000  # actions; beyond even the shortened simulation, the closed forms
_SIMULATED_CANDIDATES = 300   # plans ranked by the simulator (the rest by closed forms, after them)


def pipeline_time(name: str, pp: int, microbatches: int, chunks: int, t_f: float, t_b: float,
                  t_msg: float, t_w: float = 0.0) -> float:
    """Makespan of one step's schedule, given one micro-batch's forward, backward (B: input
    gradients; with `t_w` = 0 the whole backward) and weight-gradient (W) times through a rank's
    whole share, and one message's time. Zero-bubble schedules run B and W apart; the others a
    backward of t_b + t_w. Schedules longer than `_SIMULATE_MAX` actions are simulated with
    m0 = 2 pp + m mod pp and m0 + pp micro-batches and extended linearly by their difference,
    the steady state's (tests/unit/test_plan.py holds this to full simulations); pipelines too
    deep for even that (> `_SIMULATE_LIMIT` actions) take `rough_pipeline_time`."""
    if pp == 1:
        return microbatches * (t_f + t_b + t_w)
    if t_f <= 0:
        return 0.0
    zero_bubble = name in ("zbh1", "zbv")
    b, w = (t_b, t_w) if zero_bubble else (t_b + t_w, 0.0)
    # The makespan scales with the times together: simulate once per shape and ratios.
    ratios = tuple(float(f"{x / t_f:.3g}") for x in (b, w, t_msg))
    m0 = 2 * pp + microbatches % pp
    if 4 * pp * microbatches * chunks <= _SIMULATE_MAX or microbatches <= m0 + pp:
        return t_f * _simulated(name, pp, microbatches, chunks, *ratios)
    if 4 * pp * (m0 + pp) * schedules.resolve_chunks(name, chunks) > _SIMULATE_LIMIT:
        return rough_pipeline_time(name, pp, microbatches, chunks, t_f, t_b, t_msg, t_w)
    # Steady state: each further group of pp micro-batches repeats the same pattern of work and
    # messages, so the makespan grows by a fixed amount per micro-batch (read off m0 and m0 + pp).
    t0, t1 = (_simulated(name, pp, m, chunks, *ratios) for m in (m0, m0 + pp))
    return t_f * (t0 + (microbatches - m0) * (t1 - t0) / pp)


def rough_pipeline_time(name: str, pp: int, microbatches: int, chunks: int, t_f: float, t_b: float,
                        t_msg: float, t_w: float = 0.0) -> float:
    """`pipeline_time` from the textbook bubbles, no simulation: every rank works m (F + B + W);
    the fill and drain add (pp - 1) (F + B + W) / v for GPipe, 1F1B and interleaved (v chunks),
    (pp - 1) (F + B - W) for ZB-H1 and half that for ZB-V (Qi et al.), plus two messages per stage."""
    work = t_f + t_b + t_w
    if pp == 1:
        return microbatches * work
    v = schedules.resolve_chunks(name, chunks)
    fill = {"zbh1": max(0.0, t_f + t_b - t_w), "zbv": max(0.0, t_f + t_b - t_w) / 2}.get(name, work / v)
    return microbatches * work + (pp - 1) * (fill + 2 * t_msg)


@functools.lru_cache(maxsize=8192)
def _simulated(name: str, pp: int, microbatches: int, chunks: int, t_b: float, t_w: float, t_msg: float) -> float:
    return schedules.timeline(name, pp, microbatches, chunks).makespan(1.0, t_b, t_msg, t_w)


def predict(cfg: Config, hw: Hardware, exact: bool = True) -> Prediction:
    """The predicted step of `cfg`, a validated config (mesh resolved), on `hw`. `exact` False:
    the pipeline from closed forms instead of the simulator (`rough_pipeline_time`), for ranking
    many candidates before the best are simulated."""
    m, t, mesh = cfg.model, cfg.train, cfg.mesh
    s = DTYPES[m.dtype]
    dp, tp, pp, cp = mesh.dp, mesh.tp, mesh.pp, mesh.cp
    world = dp * tp * pp * cp
    tokens = t.micro_batch_size * m.block_size // cp          # a rank's tokens per micro-batch
    blocks, embed, head = _busiest_stage(cfg)
    f, b, scores, t_head = _layer_seconds(cfg, hw, tokens, tp)
    if t.recompute == "full":
        recomputed = sum(1 for i in range(blocks) if i % t.recompute_every == 0)
        b_extra = recomputed * f
    elif t.recompute == "selective":
        b_extra = blocks * scores
    else:
        b_extra = 0.0
    act_bytes = t.micro_batch_size * m.block_size * m.n_embd * s // cp
    tp_link = hw.link(tp, 1)
    sp_sum = 0.0
    if mesh.sequence_parallel and tp > 1:
        # all-gather before, reduce-scatter after attention and MLP; backward the mirror image.
        # The LayerNorm and bias gradients (6 of size C per block, + ln_f) are summed over tp once
        # per step (DataParallel), after the pipeline.
        fwd_tp = bwd_tp = 4 * all_gather_time(act_bytes, tp, tp_link)
        sp_sum = all_reduce_time((6 * blocks + 2) * m.n_embd * s, tp, tp_link) * hw.tp_scales.get(tp, hw.tp_scale)
    else:
        fwd_tp = bwd_tp = 2 * all_reduce_time(act_bytes, tp, tp_link)
    tp_scale = hw.tp_scales.get(tp, hw.tp_scale)
    fwd_tp, bwd_tp = fwd_tp * tp_scale, bwd_tp * tp_scale
    recompute_tp = fwd_tp if t.recompute == "full" else 0.0
    cp_f = cp_b = 0.0
    if cp > 1:   # K and V of the rank's tokens pass cp - 1 hops forward, their gradients backward
        link = hw.link(cp, tp)
        hop = link.alpha + 2 * act_bytes / tp / link.beta
        hidden = hw.overlap if hw.cp_hidden is None else hw.cp_hidden
        cp_f = max((cp - 1) * hop - hidden * scores, (1 - hidden) * (cp - 1) * hop)
        cp_f *= hw.cp_scale
        cp_b = 2 * cp_f
    t_f = blocks * (f + fwd_tp + cp_f) + (t_head / 3 if head else 0.0) + hw.microbatch_overhead
    t_b = blocks * (b + bwd_tp + cp_b) + b_extra + recompute_tp * blocks + (2 * t_head / 3 if head else 0.0)
    pp_link = hw.link(pp, dp * cp * tp)
    t_msg = (pp_link.alpha + act_bytes / _message_split(tp, mesh) / pp_link.beta) if pp > 1 else 0.0
    # Weight gradients (W) are half a block's backward GEMMs: what a zero-bubble schedule defers.
    t_w = blocks * b / 2 if cfg.pipeline.schedule in ("zbh1", "zbv") else 0.0
    timing = pipeline_time if exact else rough_pipeline_time
    c = hw.cores_per_rank
    if pp > 1 and c < 1:
        # Ranks sharing cores (calibrated with every rank busy, each at c of a core): a rank that
        # waits in the pipeline's bubble leaves its share to the others, so the step is the
        # schedule at a whole core's speed, or the work over the cores, whichever is longer.
        step_pipe = max(timing(cfg.pipeline.schedule, pp, t.microbatches, cfg.pipeline.chunks, c * t_f,
                               c * (t_b - t_w), t_msg, c * t_w), t.microbatches * (t_f + t_b))
    else:
        step_pipe = timing(cfg.pipeline.schedule, pp, t.microbatches, cfg.pipeline.chunks, t_f, t_b - t_w, t_msg, t_w)

    params = _stage_params(cfg)
    shards = dp * cp // mesh.dp_replicate if t.zero else 1
    grad_bytes = params * s
    shard_link = hw.link(dp // mesh.dp_replicate * cp, tp)
    replicate_link = hw.link(mesh.dp_replicate, dp // mesh.dp_replicate * cp * tp)
    if mesh.dp_replicate > 1:
        n = dp // mesh.dp_replicate * cp
        reduce = (all_gather_time(grad_bytes, n, shard_link) * 2
                  + all_reduce_time(grad_bytes / n, mesh.dp_replicate, replicate_link))
    else:
        reduce = all_reduce_time(grad_bytes, dp * cp, hw.link(dp * cp, tp))
    gathers = 0.0
    if t.zero == 3 and shards > 1:
        per = 2 if t.reshard_after_forward else 1
        gathers = t.microbatches * per * all_gather_time(grad_bytes, shards, shard_link) \
            - all_gather_time(grad_bytes, shards, shard_link)   # the step's last reduce-scatter stands in
    hidden = hw.overlap * t_b
    exposed = max(reduce - hidden, (1 - hw.overlap) * reduce)
    optimizer = hw.optimizer_seconds_per_param * params / (shards if t.zero else 1)
    # The step's one world collective: an all-gather of a few float64 per rank (Trainer._agree).
    fixed = all_gather_time(64 * world, world, hw.inter if world > hw.ranks_per_node else hw.intra) + hw.step_overhead
    step = step_pipe + exposed + gathers * (1 - hw.overlap) + optimizer + fixed + sp_sum
    seqs = dp * t.micro_batch_size * t.microbatches
    tokens_per_s = seqs * m.block_size / step
    flops = _flops_per_token(cfg)
    mfu = flops * tokens_per_s / (world * hw.peak_flops)
    # tp and cp traffic inside the pipeline part (for calibration and the reasons), per step.
    comm = {"tp_in_pipeline": t.microbatches * blocks * (fwd_tp + bwd_tp + recompute_tp),
            "cp_in_pipeline": t.microbatches * blocks * (cp_f + cp_b)}
    parts = {"pipeline": step_pipe, "dp_exposed": exposed, "zero3_gathers": gathers * (1 - hw.overlap),
             "optimizer": optimizer, "fixed": fixed, "sp_grad_sum": sp_sum, "t_forward": t_f, "t_backward": t_b,
             **comm}
    return Prediction(cfg, step, tokens_per_s, mfu, 0, parts)


def _message_split(tp: int, mesh) -> int:
    """Pipeline messages carry a rank's tp shard under sequence parallelism, else the whole activation."""
    return tp if mesh.sequence_parallel else 1


def _flops_per_token(cfg: Config) -> float:
    from hpcpar import metrics
    return metrics.flops_per_token(cfg.model.non_embedding_params(), cfg.model.n_layer, cfg.model.n_embd,
                                   cfg.model.block_size)


# --------------------------------------------------------------------------- search


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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


def plan(cfg: Config, world: int, hw: Hardware, top: int = 5, global_batch: int | None = None,
         keep: int = 400) -> list[Prediction]:
    """The fastest layouts that `config.validate` accepts and that fit `hw.memory_bytes`, fastest
    first: `top` of them (0: up to `keep`, enough for `reasons`). Every candidate is predicted
    (cheap); validation and the memory estimate then run in that order until enough fit."""
    if global_batch is None:
        global_batch = _global_batch(cfg, world)
    if _state_bytes_per_param(cfg) * cfg.model.num_params() / world > hw.memory_bytes:
        raise ConfigError(_nothing_fits(cfg, world, hw, global_batch, 1))   # not even fully sharded
    rough = sorted((predict(c, hw, exact=False) for c in candidates(cfg, world, hw, global_batch)),
                   key=lambda p: p.step_time)
    # The simulator only for the candidates the closed forms put near the front.
    preds = sorted((predict(p.cfg, hw) for p in rough[:_SIMULATED_CANDIDATES]), key=lambda p: p.step_time)
    preds += rough[_SIMULATED_CANDIDATES:]
    found = []
    quiet = logging.getLogger("hpcpar.config.config")
    level = quiet.level
    quiet.setLevel(logging.ERROR)   # doubtful-but-legal warnings would come once per candidate
    try:
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
    finally:
        quiet.setLevel(level)
    if not found:
        raise ConfigError(_nothing_fits(cfg, world, hw, global_batch, len(preds)))
    return sorted(found, key=lambda p: p.step_time)


def _validate(cfg: Config, world: int) -> Config:
    """`config.validate`, except that a 16-bit model.dtype (a 16-bit model: what `train.precision`
    bf16/fp16 runs, with 16-bit GEMM rates and bytes) is planned as such: every other rule still
    applies, and `write_plan` writes it as float32 masters with `train.precision`."""
    if DTYPES[cfg.model.dtype] != 2:
        return config.validate(cfg, world)
    as32 = config.validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="float32")), world)
    return dataclasses.replace(as32, model=cfg.model)


def _global_batch(cfg: Config, world: int) -> int:
    from hpcpar.runtime.mesh import resolve_degrees
    try:
        dp = resolve_degrees(world, cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.cp)[0]
    except Exception:  # noqa: BLE001 - degrees that do not fit this world: the batch per rank as given
        dp = 1
    return dp * cfg.train.micro_batch_size * cfg.train.microbatches


def _state_bytes_per_param(cfg: Config) -> int:
    """Weights, gradients and AdamW moments (with a float32 master under 16-bit storage)."""
    s = DTYPES[cfg.model.dtype]
    return 2 * s + 2 * max(4, s) + (4 if s == 2 else 0)


def _nothing_fits(cfg: Config, world: int, hw: Hardware, global_batch: int, tried: int) -> str:
    """One line: why no layout fits, and how many ranks of this hardware the model state alone needs."""
    if tried == 0:
        return (f"no layout of {world} ranks divides the global batch of {global_batch} sequences and the model "
                f"(n_head={cfg.model.n_head}, n_layer={cfg.model.n_layer}); use a global batch or a rank count "
                "with common divisors")
    need = math.ceil(cfg.model.num_params() * _state_bytes_per_param(cfg) / hw.memory_bytes)
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
    lines = [f"plans for {world} ranks on {hw.name} (predicted; memory is config.estimate_memory)",
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


def write_plan(pred: Prediction, path: str) -> None:
    """A config `hpcpar train` runs as is: the planned config with its mesh degrees."""
    with open(path, "w") as f:
        f.write(f"# hpcpar plan: {pred.layout}\n# predicted {pred.step_time * 1e3:.1f} ms/step, "
                f"{pred.tokens_per_s:,.0f} tokens/s\n")
        f.write(config.to_toml(runnable(pred.cfg)))


# --------------------------------------------------------------------------- calibration


def calibrate(cfg: Config, world_comm, repeats: int = 3) -> Hardware:
    """Measure this machine with every rank of `world_comm` (an mpi4py communicator) working at
    once, as they would in training: GEMM rate, collectives' alpha and beta inside the world,
    the model's block and head times for each tp shard, and the optimizer's update rate; then,
    from real training steps (`Trainer.train`) against their predictions, the share of the
    gradient reduction hidden behind backward, the per-step and per-micro-batch overheads, and
    the factors on tp and cp traffic (`Hardware`)."""
    import numpy as np

    from hpcpar import metrics
    from hpcpar.runtime.comm import Communicator
    world = world_comm.Get_size()
    comm = Communicator(world_comm, "world")
    comm.barrier()
    gemm = float(np.median(comm.all_gather_object(metrics.measure_gemm_flops(cfg.model.dtype, 512, 0.3))))
    sizes = [2**k for k in range(10, 23, 3)]               # 1 KiB .. 4 MiB
    alpha, beta = 20e-6, 1e9
    if world > 1:
        # Measured as training meets them: each collective right after some compute, so that a
        # rank that was descheduled (ranks sharing cores) or is late costs what it costs there.
        work = np.random.default_rng(0).standard_normal((160, 160))

        def loop(nbytes: int | None) -> float:
            buf = np.zeros(max(1, (nbytes or 8) // 8))
            comm.barrier()
            start = time.perf_counter()
            for _ in range(repeats * 4):
                work @ work
                if nbytes is not None:
                    comm.all_reduce(buf)
            return (time.perf_counter() - start) / (repeats * 4)
        loop(sizes[-1])
        compute = float(np.median(comm.all_gather_object(loop(None))))
        times = [max(comm.all_gather_object(loop(nbytes) - compute)) for nbytes in sizes]
        # all-reduce time = 2(n-1) alpha + 2(n-1)/n bytes / beta: fit alpha and 1/beta.
        x = np.array([[2 * (world - 1), 2 * (world - 1) / world * s] for s in sizes])
        coef, *_ = np.linalg.lstsq(x, np.array(times), rcond=None)
        alpha, beta = max(float(coef[0]), 1e-7), 1.0 / max(float(coef[1]), 1e-12)
    layer_times = {}
    for tp in divisors(world):
        if cfg.model.n_head % tp:
            continue
        layer_times[tp] = _measure_layer(cfg, tp, comm)
    opt = _measure_optimizer(comm)
    memory = metrics.available_memory_bytes() or 8 * GiB
    hw = Hardware("this", gemm, 1.0, 10e9, int(memory // world), world, Link(alpha, beta), Link(alpha, beta),
                  overlap=0.0, optimizer_seconds_per_param=opt, layer_times=layer_times, model=_model_key(cfg),
                  cores_per_rank=min(1.0, (os.cpu_count() or world) / world))
    # What the pieces leave out (data, loss, Python between ops, the step's bookkeeping): two
    # real training steps on dp = world, 1 and 3 micro-batches of one sequence, against their
    # predictions; the difference per micro-batch and the rest per step.
    def on_dp(microbatches: int, size: int) -> Config:
        return config.validate(dataclasses.replace(
            cfg, mesh=dataclasses.replace(cfg.mesh, dp=world, tp=1, pp=1, cp=1, dp_replicate=1,
                                          sequence_parallel=False),
            train=dataclasses.replace(cfg.train, micro_batch_size=size, microbatches=microbatches, zero=0,
                                      recompute="none"),
            pipeline=dataclasses.replace(cfg.pipeline, schedule="1f1b", chunks=1)), world)
    # How much of the gradient reduction the engine hides behind backward here: the same step
    # with the bucketed reduction overlapped and not.
    if world > 1:
        run = on_dp(1, cfg.train.micro_batch_size)
        hidden = _measure_step(run, world_comm, comm, overlap=False) - _measure_step(run, world_comm, comm)
        reduce = predict(run, hw).parts["dp_exposed"]
        hw = dataclasses.replace(hw, overlap=min(max(hidden / reduce, 0.0), 1.0) if reduce > 0 else 0.0)
    residual = []
    for microbatches in (1, 3):
        run = on_dp(microbatches, 1)
        residual.append(_measure_step(run, world_comm, comm) - predict(run, hw).step_time)
    per_mb = max(0.0, (residual[1] - residual[0]) / 2)
    hw = dataclasses.replace(hw, microbatch_overhead=per_mb, step_overhead=max(0.0, residual[0] - per_mb))
    # The tensor- and context-parallel traffic of a real step (with everything around it: the
    # mappings, vocabulary-parallel loss, ring bookkeeping) against the alpha-beta model's:
    # the ratio scales those terms. On the whole world, one micro-batch of the config's size.
    # The cp ring is scaled whole (cp_hidden 0): what of it the attention hides here is in the
    # measured ratio, not assumed to be the data-parallel reduction's share.
    # tp: each degree of its own (the rest of the world in dp), since a pair's traffic and a
    # quartet's differ by more than the ring model says when ranks share cores.
    hw = dataclasses.replace(hw, cp_hidden=0.0)
    tp_scales = {}
    for axis, key, degree in [("tp", "tp_in_pipeline", d) for d in divisors(world) if d > 1] + \
            [("cp", "cp_in_pipeline", world)]:
        degrees = {"tp": 1, "cp": 1, axis: degree}
        run = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp=world // degree, pp=1, dp_replicate=1,
                                                                sequence_parallel=False, **degrees),
                                  train=dataclasses.replace(cfg.train, microbatches=1, zero=0, recompute="none"),
                                  pipeline=dataclasses.replace(cfg.pipeline, schedule="1f1b", chunks=1))
        try:
            run = config.validate(run, world)
        except HpcparError:
            continue    # the model does not split over the whole world on this axis: keep 1
        pred = predict(run, dataclasses.replace(hw, tp_scale=1.0, tp_scales={}, cp_scale=1.0))   # unscaled
        if world > 1 and pred.parts[key] > 0:
            rest = pred.step_time - pred.parts[key]
            scale = (_measure_step(run, world_comm, comm) - rest) / pred.parts[key]
            scale = min(max(scale, 0.05), 20.0)
            if axis == "tp":
                tp_scales[degree] = scale
                hw = dataclasses.replace(hw, tp_scale=scale, tp_scales=dict(tp_scales))
            else:
                hw = dataclasses.replace(hw, cp_scale=scale)
    return hw


def _measure_step(cfg: Config, world_comm, comm, steps: int = 4, overlap: bool = True) -> float:
    """The slowest rank's median step time of `cfg` through `Trainer.train` (no files); `overlap`
    False: data-parallel reductions wait for the end of backward."""
    import numpy as np

    from hpcpar.training.trainer import Trainer

    tokens = np.random.default_rng(0).integers(0, 256, 1 << 16).astype(np.uint8)
    trainer = Trainer(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, eval_every=0)), world_comm,
                      tokens=tokens)
    trainer.dp.overlap = overlap
    times = []

    def on_step(record: dict) -> None:
        slowest = comm.all_reduce(np.array([record["step_time_s"]]), op="max")
        if record["step"]:
            times.append(float(slowest[0]))
    trainer.train(steps + 1, files=False, progress=False, on_step=on_step, peak_flops=1.0)
    return float(np.median(times))


def _measure_layer(cfg: Config, tp: int, comm) -> list[float]:
    """[a_f, c_f, a_b, c_b, a_h, c_h]: a block's forward and backward and the head's forward +
    backward seconds on a tp shard, fitted to a + c * tokens from two micro-batch sizes, every
    rank measuring at once (the shapes are the shard's: heads / tp, widths 3C/tp and 4C/tp); the
    best of 5 repeats, the median over ranks."""
    import numpy as np

    from hpcpar.autograd import ops
    from hpcpar.autograd.tensor import Tensor

    m = cfg.model
    c, t, heads = m.n_embd, m.block_size, m.n_head // tp
    rng = np.random.default_rng(0)
    dtype = m.dtype

    def w(*shape):
        return Tensor(rng.standard_normal(shape).astype(dtype) * 0.02, requires_grad=True)

    ln = (Tensor(np.ones(c, dtype), requires_grad=True), Tensor(np.zeros(c, dtype), requires_grad=True))
    w_qkv, w_o, w_fc, w_pr = w(3 * c // tp, c), w(c, c // tp), w(4 * c // tp, c), w(c, 4 * c // tp)
    b_qkv, b_fc = w(3 * c // tp), w(4 * c // tp)
    w_head = w(m.vocab_rows(tp), c)

    def block(x):
        h = ops.linear(ops.layer_norm(x, *ln), w_qkv, b_qkv)
        y = ops.causal_attention(h, heads)
        x = x + ops.linear(y, w_o)
        h = ops.linear(ops.layer_norm(x, *ln), w_fc, b_fc, activation="gelu")
        return x + ops.linear(h, w_pr)

    def timed(b: int) -> tuple[float, float, float]:
        x = Tensor(rng.standard_normal((b, t, c)).astype(dtype), requires_grad=True)
        targets = rng.integers(0, m.vocab_size, (b, t)) % m.vocab_rows(tp)
        best = [math.inf] * 3
        for _ in range(5):
            comm.barrier()
            t0 = time.perf_counter()
            out = block(x)
            t1 = time.perf_counter()
            out.backward(np.ones(out.shape, dtype))
            t2 = time.perf_counter()
            loss = ops.cross_entropy(ops.linear(ops.layer_norm(x, *ln), w_head).reshape(b * t, -1),
                                     targets.reshape(-1))
            loss.backward()
            t3 = time.perf_counter()
            best = [min(best[0], t1 - t0), min(best[1], t2 - t1), min(best[2], t3 - t2)]
        return tuple(float(np.median([r[i] for r in comm.all_gather_object(best)])) for i in range(3))

    small, large = 4, 16
    lo, hi = timed(small), timed(large)
    n_lo, n_hi = small * t, large * t
    out = []
    for i in range(3):
        slope = max((hi[i] - lo[i]) / (n_hi - n_lo), 0.0)
        out += [max(lo[i] - slope * n_lo, 0.0), slope]
    return out


def _measure_optimizer(comm) -> float:
    """Seconds per parameter of one AdamW update (every rank at once)."""
    import numpy as np

    from hpcpar.optim.optimizers import AdamW
    from hpcpar.autograd.tensor import Tensor

    p = Tensor(np.zeros(1 << 20), requires_grad=True)
    p.grad = np.ones(1 << 20)
    opt = AdamW([p], lr=1e-3)
    opt.step()
    comm.barrier()
    start = time.perf_counter()
    for _ in range(5):
        opt.step()
    return float(np.median(comm.all_gather_object((time.perf_counter() - start) / 5 / (1 << 20))))


# --------------------------------------------------------------------------- command line


def cli(args) -> int:
    """`hpcpar plan`: print the best plans (rank 0), or `--calibrate` and store the figures."""
    overrides = list(args.overrides)
    if args.preset:
        if args.preset not in MODEL_PRESETS:
            raise ConfigError(f"--preset={args.preset!r} is not one of {', '.join(MODEL_PRESETS)}")
        overrides += [f"model.{k}={v}" for k, v in MODEL_PRESETS[args.preset].items()]
    cfg = config.load_config(args.config, overrides)
    if cfg.ps.servers:
        raise ConfigError(f"ps.servers={cfg.ps.servers}: hpcpar plan models all-reduce data parallelism, not parameter "
                          "servers; plan the workers' mesh with ps.servers=0 and --ranks set to the worker count")
    if args.calibrate:
        from mpi4py import MPI
        hw = calibrate(cfg, MPI.COMM_WORLD)
        if MPI.COMM_WORLD.Get_rank() == 0:
            path = save_hardware(hw, args.calibration)
            print(f"calibrated {hw.ranks_per_node} ranks: GEMM {hw.peak_flops / 1e9:.1f} GFLOP/s per rank, "
                  f"all-reduce alpha {hw.intra.alpha * 1e6:.1f} us, beta {hw.intra.beta / 1e9:.2f} GB/s; "
                  f"block times for tp in {sorted(hw.layer_times)}; wrote {path}")
        return 0
    if (args.ranks is None) == (args.nodes is None):
        raise ConfigError("give the allocation as --ranks N or as --nodes N --gpus-per-node G (one of the two)")
    hw = load_hardware(args.hardware, args.calibration)
    if args.nodes is not None:
        if not args.gpus_per_node or args.gpus_per_node < 1 or args.nodes < 1:
            raise ConfigError("--nodes needs --gpus-per-node G, both >= 1")
        hw = dataclasses.replace(hw, ranks_per_node=args.gpus_per_node)
        world = args.nodes * args.gpus_per_node
    else:
        world = args.ranks
    if world < 1:
        raise ConfigError(f"--ranks={world} is invalid: use a positive number of ranks")
    if args.global_batch is not None and args.global_batch < 1:
        raise ConfigError(f"--global-batch={args.global_batch} is invalid: use a positive number of sequences")
    plans = plan(cfg, world, hw, top=0, global_batch=args.global_batch)
    print(format_plans(plans[:args.top], world, hw, reasons(plans[0], plans[1:])))
    if args.out:
        write_plan(plans[0], args.out)
        print(f"wrote {args.out}: hpcpar train {args.out} runs plan 1 on {world} ranks")
    return 0
