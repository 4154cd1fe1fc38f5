"""The predicted step time of one layout (`predict`), built from the pieces hpcpar runs.

    compute    per layer and micro-batch, forward F and backward B on one tp shard of b T/cp
               tokens: measured by `--calibrate` on this machine (a + c * tokens, per tp), or
               for a GPU preset  GEMM FLOPs / (peak * GEMM efficiency)
                                 + elementwise bytes / memory bandwidth   (activations' traffic)
               recomputation adds the forward again (full) or the attention scores (selective);
               embedding, LM head and loss the same way on the first and last stage
    tp, cp     per layer: 2 all-reduces forward and 2 backward of b T C s bytes (ring, on the
               link inside a node when tp fits one); cp's ring passes K and V cp-1 times,
               hidden behind attention where it is shorter
    pipeline   the schedule simulator (`simulate.timeline`) on the busiest stage's F and B, with
               one point-to-point message of b T C s bytes per boundary
    dp         the gradient reduction of the rank's parameters (all-reduce, or reduce-scatter +
               all-gather under ZeRO; HSDP: over dp_shard, then dp_replicate), ZeRO-3's parameter
               all-gathers per micro-batch; the part the bucketed reduction cannot hide behind the
               last micro-batch's backward is exposed (`Hardware.overlap`)
    optimizer  the update of the rank's (sharded) parameters, plus the step's one small world
               all-gather (and under sequence parallelism one tp all-reduce of the LayerNorm and
               bias gradients)

A mixture-of-experts model (`model.moe_experts > 0`) has its MoE layers costed as dense MLPs of
the active parameters (top_k experts), without the dispatch all-to-alls.

The simulator sees one representative rank per role (a pipeline stage; dp replicas and tp ranks
are alike), and each schedule shape is built and compiled once (`simulate.timeline`: the
simulator's order, replayed for each candidate's times, bitwise `simulate`'s makespan);
schedules of more than `_SIMULATE_MAX` actions are simulated shorter and extrapolated, or use
the closed forms the simulator agrees with (tests/unit/test_plan.py). Where ranks share cores
(calibrated `Hardware.cores_per_rank` < 1), a pipeline step is its schedule at a whole core's
speed or its work over the cores, whichever is longer, since a rank waiting in the bubble leaves
its share of the core to others.

`predict` is `StepModel(cfg, hw).prediction(cfg)`. The planner's search asks one `StepModel`
for every candidate `Layout` of an allocation: each term cached by the layout fields it reads,
and `StepModel.bound`, a lower bound on the step that simulates nothing (`pipeline_bound`), so
that it simulates only the candidates that could make its best plans.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

from hpcpar import metrics
from hpcpar.config.sections import Config
from hpcpar.nn.gpt import DTYPES, GPTConfig
from hpcpar.parallel.pp import schedules, simulate
from hpcpar.parallel.pp.stages import head_cost, split_layers
from hpcpar.planner.hardware import Hardware, all_gather_time, all_reduce_time


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


class Layout(NamedTuple):
    """What a plan chooses (`search.candidates` varies these; every other field is the config's):
    the mesh with its HSDP split and sequence parallelism, the micro-batching, the pipeline
    schedule with its chunks, the ZeRO stage and recomputation."""

    tp: int
    pp: int
    cp: int
    dp: int
    micro_batch_size: int
    microbatches: int
    schedule: str
    chunks: int
    zero: int
    dp_replicate: int
    recompute: str
    sequence_parallel: bool

    @classmethod
    def of(cls, cfg: Config) -> Layout:
        mesh, t, p = cfg.mesh, cfg.train, cfg.pipeline
        return cls(mesh.tp, mesh.pp, mesh.cp, mesh.dp, t.micro_batch_size, t.microbatches, p.schedule, p.chunks,
                   t.zero, mesh.dp_replicate, t.recompute, mesh.sequence_parallel)

    def apply(self, cfg: Config) -> Config:
        """`cfg` with this layout."""
        return dataclasses.replace(
            cfg,
            mesh=dataclasses.replace(cfg.mesh, dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp,
                                     dp_replicate=self.dp_replicate, sequence_parallel=self.sequence_parallel),
            train=dataclasses.replace(cfg.train, micro_batch_size=self.micro_batch_size,
                                      microbatches=self.microbatches, zero=self.zero, recompute=self.recompute),
            pipeline=dataclasses.replace(cfg.pipeline, schedule=self.schedule, chunks=self.chunks))


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
    return bool(hw.model) and hw.model == model_key(cfg)


def model_key(cfg: Config) -> dict:
    """The model keys a calibration's layer times belong to (`Hardware.model`)."""
    m = cfg.model
    return {"n_layer": m.n_layer, "n_head": m.n_head, "n_embd": m.n_embd, "block_size": m.block_size,
            "vocab_size": m.vocab_size, "dtype": m.dtype, "bias": m.bias}


@functools.lru_cache(maxsize=4096)
def _busiest(n_layer: int, name: str, pp: int, chunks: int, head_cost: float) -> tuple[int, bool, bool]:
    """(blocks, holds the embedding, holds the head) of the pipeline rank with most work."""
    place = schedules.placement(name, pp, chunks)
    ranges = split_layers(n_layer, place.stages, head_cost)
    best = None
    for rank in range(pp):
        stages = [place.stage(rank, c) for c in range(place.chunks)]
        blocks = sum(len(ranges[v]) for v in stages)
        head = place.stages - 1 in stages
        cost = blocks + (head_cost if head else 0)
        if best is None or cost > best[0]:
            best = (cost, blocks, 0 in stages, head)
    return best[1], best[2], best[3]


def _stage_params(m: GPTConfig, tp: int, pp: int, schedule: str, chunks: int) -> int:
    """Parameters of the pipeline rank that holds most (one tp shard): its blocks, and the
    embedding or the head's own copy of it."""
    if pp == 1:
        return m.stage_params(m.n_layer, True, True, tp)
    blocks = _busiest(m.n_layer, schedule, pp, chunks, head_cost(m))[0]
    return max(m.stage_params(blocks, True, False, tp), m.stage_params(blocks, False, True, tp))


_SIMULATE_MAX = 4_000   # actions; longer schedules are simulated shorter and extrapolated
_SIMULATE_LIMIT = 6_000  # actions; beyond even the shortened simulation, the closed forms


def pipeline_time(name: str, pp: int, microbatches: int, chunks: int, t_f: float, t_b: float,
                  t_msg: float, t_w: float = 0.0) -> float:
    """Makespan of one step's schedule, given one micro-batch's forward, backward (B: input
    gradients; with `t_w` = 0 the whole backward) and weight-gradient (W) times through a rank's
    whole share, and one message's time. Zero-bubble schedules run B and W apart; the others a
    backward of t_b + t_w. Schedules longer than `_SIMULATE_MAX` actions are simulated with
    m0 = 2 pp + m mod pp and m0 + pp micro-batches and extended linearly by their difference,
    the steady state's (tests/unit/test_plan.py holds this to full simulations); pipelines too
    deep for even that (> `_SIMULATE_LIMIT` actions) take `rough_pipeline_time`. ZB-V is
    simulated whole (`_pipeline_method`)."""
    if pp == 1:
        return microbatches * (t_f + t_b + t_w)
    if t_f <= 0:
        return 0.0
    ratios = _ratios(name, t_f, t_b, t_msg, t_w)
    how, m0 = _pipeline_method(name, pp, microbatches, chunks)
    if how == "simulate":
        return t_f * _simulated(name, pp, microbatches, chunks, *ratios)
    if how == "rough":
        return rough_pipeline_time(name, pp, microbatches, chunks, t_f, t_b, t_msg, t_w)
    # Steady state: each further group of pp micro-batches repeats the same pattern of work and
    # messages, so the makespan grows by a fixed amount per micro-batch (read off m0 and m0 + pp).
    t0, t1 = (_simulated(name, pp, m, chunks, *ratios) for m in (m0, m0 + pp))
    return t_f * (t0 + (microbatches - m0) * (t1 - t0) / pp)


def _ratios(name: str, t_f: float, t_b: float, t_msg: float, t_w: float) -> tuple[float, float, float]:
    """(B, W, message) over F, to 3 significant digits: the makespan scales with the times
    together, so one simulation per shape and ratios serves every candidate that has them.
    Zero-bubble schedules run B and W apart; the others a whole backward of B + W."""
    b, w = (t_b, t_w) if name in ("zbh1", "zbv") else (t_b + t_w, 0.0)
    return tuple(float(f"{x / t_f:.3g}") for x in (b, w, t_msg))


def _pipeline_method(name: str, pp: int, microbatches: int, chunks: int) -> tuple[str, int]:
    """How `pipeline_time` times this shape (pp >= 2): "simulate" (the whole schedule),
    "extrapolate" (m0 and m0 + pp micro-batches, m0 returned) or "rough" (the closed forms).
    ZB-V is always simulated whole: its list-scheduled steady state is not affine in m (neither
    extrapolation nor the textbook bubble gives its step), so the planner bounds its length instead
    (`search._ZBV_MAX_ACTIONS`). `chunks` 0 is the schedule's own (`schedules.resolve_chunks`)."""
    m0 = 2 * pp + microbatches % pp
    actions = 4 * pp * schedules.resolve_chunks(name, chunks)   # per micro-batch
    if name == "zbv" or actions * microbatches <= _SIMULATE_MAX or microbatches <= m0 + pp:
        return "simulate", m0
    if actions * (m0 + pp) > _SIMULATE_LIMIT:
        return "rough", m0
    return "extrapolate", m0


_BOUND_SLACK = 1 - 1e-9   # the bounds' sums are rounded differently from the simulator's clocks


def pipeline_bound(name: str, pp: int, microbatches: int, chunks: int, t_f: float, t_b: float,
                   t_msg: float, t_w: float = 0.0) -> tuple[float, bool]:
    """(a lower bound on `pipeline_time` with these arguments, whether it is `pipeline_time`
    itself), without simulating: where `pipeline_time` is a closed form (pp = 1, `rough`) its
    value, else, for the ratios the simulator would run (F = 1):

        work    m (1 + B + W): every F, B and W of the last rank, after its first input, which
                comes through p - 1 forwards of 1/v and p - 1 messages (v chunks per rank):
                fill = (p - 1)(1/v + msg)
        drain   the last rank's last B (of its first stage) comes after its every F and B (and
                under ZB-H1 the m - p W's it runs before it), then that gradient goes down
                p - 1 ranks, (p - 1)(B/v + msg), and ZB-H1 and ZB-V run rank 0's last W after it:
                GPipe, 1F1B, interleaved   fill + m (1 + B) + (p - 1)(B/v + msg)
                ZB-H1   fill + m (1 + B) + max(0, m - p) W + (p - 1)(B + msg) + W (its textbook
                        step, m (1 + B + W) + (p - 1)(1 + B - W), plus the messages)
                ZB-V    fill + m (1 + B) + (p - 1)(B/2 + msg) + W/2

    tests/unit/test_plan.py holds the bound to the simulator (and to the extrapolation, which
    equals it) over schedules, depths and ratios; the planner's search skips a layout whose bound
    cannot beat the plans it keeps, and checks the bound against every layout it does simulate."""
    if pp == 1 or t_f <= 0:
        return pipeline_time(name, pp, microbatches, chunks, t_f, t_b, t_msg, t_w), True
    how, _ = _pipeline_method(name, pp, microbatches, chunks)
    if how == "rough":
        return rough_pipeline_time(name, pp, microbatches, chunks, t_f, t_b, t_msg, t_w), True
    return t_f * _pipeline_floor(name, pp, microbatches, chunks, *_ratios(name, t_f, t_b, t_msg, t_w)), False


def _pipeline_floor(name: str, pp: int, microbatches: int, chunks: int, b: float, w: float, msg: float) -> float:
    """`pipeline_bound`'s bound on the simulator's makespan with F = 1 (and these B, W, message)."""
    m, v = microbatches, schedules.resolve_chunks(name, chunks)
    fill = (pp - 1) * (1.0 / v + msg)
    bound = fill + m * (1.0 + b + w)
    if name in ("gpipe", "1f1b", "interleaved"):
        bound = max(bound, fill + m * (1.0 + b) + (pp - 1) * (b / v + msg))
    elif name == "zbh1":
        bound = max(bound, fill + m * (1.0 + b) + max(0, m - pp) * w + (pp - 1) * (b + msg) + w)
    elif name == "zbv":
        bound = max(bound, fill + m * (1.0 + b) + (pp - 1) * (b / 2 + msg) + w / 2)
    return bound * _BOUND_SLACK


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
    return simulate.timeline(name, pp, microbatches, chunks).makespan(1.0, t_b, t_msg, t_w)




class _Microbatch(NamedTuple):
    """Seconds of one micro-batch through the busiest pipeline rank's share of the model."""

    blocks: int             # the rank's transformer blocks
    t_f: float              # forward: blocks with their tp and cp traffic, the head's share, overhead
    t_b: float              # backward, B and W together, with recomputation
    t_w: float              # the weight gradients (W) a zero-bubble schedule defers; 0 for the others
    t_msg: float            # one pipeline message
    tp_per_block: float     # a block's tp traffic, forward + backward + recomputed forward
    cp_per_block: float     # a block's cp ring, forward + backward
    sp_grad_sum: float      # the step's tp all-reduce of LayerNorm and bias gradients (sequence parallel)


def _recompute_seconds(recompute: str, every: int, blocks: int, forward: float, scores: float) -> float:
    """What recomputation adds to a micro-batch's backward: the forward of every recomputed block
    (full, every `every`-th block) or the attention scores of every block (selective)."""
    if recompute == "full":
        recomputed = sum(1 for i in range(blocks) if i % every == 0)
        return recomputed * forward
    if recompute == "selective":
        return blocks * scores
    return 0.0


def _tensor_parallel_seconds(m: GPTConfig, hw: Hardware, tp: int, sp: bool, blocks: int,
                             act_bytes: int) -> tuple[float, float]:
    """(a block's tp traffic in one direction, forward or backward; the step's sum of the
    sequence-parallel LayerNorm and bias gradients), scaled by the calibrated tp factor."""
    tp_link = hw.link(tp, 1)
    tp_scale = hw.tp_scales.get(tp, hw.tp_scale)
    if sp and tp > 1:
        # all-gather before, reduce-scatter after attention and MLP; backward the mirror image.
        # The LayerNorm and bias gradients (6 of size C per block, + ln_f) are summed over tp once
        # per step (DataParallel), after the pipeline.
        per_direction = 4 * all_gather_time(act_bytes, tp, tp_link)
        sp_sum = all_reduce_time((6 * blocks + 2) * m.n_embd * DTYPES[m.dtype], tp, tp_link) * tp_scale
        return per_direction * tp_scale, sp_sum
    return 2 * all_reduce_time(act_bytes, tp, tp_link) * tp_scale, 0.0


def _context_parallel_seconds(hw: Hardware, tp: int, cp: int, act_bytes: int, scores: float) -> float:
    """A block's cp ring forward: K and V of the rank's tokens pass cp - 1 hops (their gradients
    backward, twice this), the part attention does not hide, scaled by the calibrated cp factor."""
    if cp == 1:
        return 0.0
    link = hw.link(cp, tp)
    hop = link.alpha + 2 * act_bytes / tp / link.beta
    hidden = hw.overlap if hw.cp_hidden is None else hw.cp_hidden
    return max((cp - 1) * hop - hidden * scores, (1 - hidden) * (cp - 1) * hop) * hw.cp_scale


def _zero_shards(lay: Layout) -> int:
    """Ranks the optimizer state is sharded over: dp_shard x cp under ZeRO, else 1."""
    return lay.dp * lay.cp // lay.dp_replicate if lay.zero else 1


def _data_parallel_seconds(hw: Hardware, lay: Layout, grad_bytes: int, reshard_after_forward: bool,
                           t_b: float) -> tuple[float, float]:
    """(the gradient reduction's exposed part, ZeRO-3's parameter all-gathers' exposed part) of a
    rank holding `grad_bytes` of gradients, whose last micro-batch's backward (`t_b`) hides some of it."""
    dp, tp, cp, replicate = lay.dp, lay.tp, lay.cp, lay.dp_replicate
    shards = _zero_shards(lay)
    shard_link = hw.link(dp // replicate * cp, tp)
    replicate_link = hw.link(replicate, dp // replicate * cp * tp)
    if replicate > 1:
        n = dp // replicate * cp
        reduce = (all_gather_time(grad_bytes, n, shard_link) * 2
                  + all_reduce_time(grad_bytes / n, replicate, replicate_link))
    else:
        reduce = all_reduce_time(grad_bytes, dp * cp, hw.link(dp * cp, tp))
    gathers = 0.0
    if lay.zero == 3 and shards > 1:
        per = 2 if reshard_after_forward else 1
        gathers = lay.microbatches * per * all_gather_time(grad_bytes, shards, shard_link) \
            - all_gather_time(grad_bytes, shards, shard_link)   # the step's last reduce-scatter stands in
    hidden = hw.overlap * t_b
    exposed = max(reduce - hidden, (1 - hw.overlap) * reduce)
    return exposed, gathers * (1 - hw.overlap)


class StepModel:
    """`predict`'s terms for one config's model (and its other fixed fields) on one machine, as
    functions of the `Layout`, each cached by the layout fields it depends on. `predict` is
    `StepModel(cfg, hw).prediction(cfg)`, and the planner's search (`search.py`) asks one
    `StepModel` for the bounds and step times of every candidate: the same operations in the same
    order, so the search's step times are `predict`'s bitwise."""

    def __init__(self, cfg: Config, hw: Hardware):
        self.cfg, self.hw = cfg, hw
        self._layers: dict = {}
        self._microbatches: dict = {}
        self._params: dict = {}
        self._pipelines: dict = {}

    def layer_seconds(self, tokens: int, tp: int) -> tuple[float, float, float, float]:
        key = (tokens, tp)
        got = self._layers.get(key)
        if got is None:
            got = self._layers[key] = _layer_seconds(self.cfg, self.hw, tokens, tp)
        return got

    def microbatch(self, lay: Layout) -> _Microbatch:
        """One micro-batch's forward, backward and message times on the busiest pipeline rank."""
        key = (lay.tp, lay.pp, lay.cp, lay.dp, lay.micro_batch_size, lay.schedule, lay.chunks, lay.recompute,
               lay.sequence_parallel)
        got = self._microbatches.get(key)
        if got is None:
            got = self._microbatches[key] = self._microbatch(lay)
        return got

    def _microbatch(self, lay: Layout) -> _Microbatch:
        m, hw = self.cfg.model, self.hw
        tp, pp, cp = lay.tp, lay.pp, lay.cp
        tokens = lay.micro_batch_size * m.block_size // cp          # a rank's tokens per micro-batch
        blocks, _, head = _busiest(m.n_layer, lay.schedule, pp, lay.chunks, head_cost(m))
        f, b, scores, t_head = self.layer_seconds(tokens, tp)
        b_extra = _recompute_seconds(lay.recompute, self.cfg.train.recompute_every, blocks, f, scores)
        act_bytes = lay.micro_batch_size * m.block_size * m.n_embd * DTYPES[m.dtype] // cp
        tp_each, sp_sum = _tensor_parallel_seconds(m, hw, tp, lay.sequence_parallel, blocks, act_bytes)
        recompute_tp = tp_each if lay.recompute == "full" else 0.0
        cp_f = _context_parallel_seconds(hw, tp, cp, act_bytes, scores)
        cp_b = 2 * cp_f
        t_f = blocks * (f + tp_each + cp_f) + (t_head / 3 if head else 0.0) + hw.microbatch_overhead
        t_b = blocks * (b + tp_each + cp_b) + b_extra + recompute_tp * blocks + (2 * t_head / 3 if head else 0.0)
        pp_link = hw.link(pp, lay.dp * cp * tp)
        split = tp if lay.sequence_parallel else 1   # messages carry a tp shard under sequence parallelism
        t_msg = (pp_link.alpha + act_bytes / split / pp_link.beta) if pp > 1 else 0.0
        # Weight gradients (W) are half a block's backward GEMMs: what a zero-bubble schedule defers.
        t_w = blocks * b / 2 if lay.schedule in ("zbh1", "zbv") else 0.0
        return _Microbatch(blocks, t_f, t_b, t_w, t_msg, tp_each + tp_each + recompute_tp, cp_f + cp_b, sp_sum)

    def stage_params(self, lay: Layout) -> int:
        key = (lay.tp, lay.pp, lay.schedule, lay.chunks)
        got = self._params.get(key)
        if got is None:
            got = self._params[key] = _stage_params(self.cfg.model, *key)
        return got

    def pipeline(self, lay: Layout, mb: _Microbatch, exact: bool = True) -> float:
        """The step's pipeline part: the schedule's makespan over every micro-batch (`exact`
        False: the closed forms, `rough_pipeline_time`)."""
        key = (mb, lay.schedule, lay.pp, lay.microbatches, lay.chunks, exact)
        got = self._pipelines.get(key)
        if got is None:
            value = (pipeline_time if exact else rough_pipeline_time)(*self._timing(lay, mb))
            got = self._pipelines[key] = max(value, lay.microbatches * (mb.t_f + mb.t_b)) if self._shared(lay) \
                else value
        return got

    def pipeline_bound(self, lay: Layout, mb: _Microbatch) -> tuple[float, bool]:
        """(a lower bound on `pipeline`, whether it is `pipeline` itself): `pipeline_bound`."""
        key = (mb, lay.schedule, lay.pp, lay.microbatches, lay.chunks, None)
        got = self._pipelines.get(key)
        if got is None:
            value, exact = pipeline_bound(*self._timing(lay, mb))
            got = self._pipelines[key] = \
                (max(value, lay.microbatches * (mb.t_f + mb.t_b)) if self._shared(lay) else value), exact
        return got

    def _shared(self, lay: Layout) -> bool:
        """Ranks sharing cores (calibrated with every rank busy, each at c of a core): a rank that
        waits in the pipeline's bubble leaves its share to the others, so the step is the schedule
        at a whole core's speed, or the work over the cores, whichever is longer."""
        return lay.pp > 1 and self.hw.cores_per_rank < 1

    def _timing(self, lay: Layout, mb: _Microbatch) -> tuple:
        """`pipeline_time`'s arguments: the schedule, F, B, message and W times (at a whole core's speed)."""
        c = self.hw.cores_per_rank
        if self._shared(lay):
            return lay.schedule, lay.pp, lay.microbatches, lay.chunks, c * mb.t_f, c * (mb.t_b - mb.t_w), mb.t_msg, \
                c * mb.t_w
        return lay.schedule, lay.pp, lay.microbatches, lay.chunks, mb.t_f, mb.t_b - mb.t_w, mb.t_msg, mb.t_w

    def rest(self, lay: Layout, mb: _Microbatch) -> tuple[float, float, float, float]:
        """(the data-parallel reduction's exposed part, ZeRO-3's gathers, the optimizer, the
        step's fixed part): the closed forms after the pipeline."""
        hw, params = self.hw, self.stage_params(lay)
        exposed, gathers = _data_parallel_seconds(hw, lay, params * DTYPES[self.cfg.model.dtype],
                                                  self.cfg.train.reshard_after_forward, mb.t_b)
        optimizer = hw.optimizer_seconds_per_param * params / _zero_shards(lay)
        world = lay.dp * lay.tp * lay.pp * lay.cp
        # The step's one world collective: an all-gather of a few float64 per rank (Trainer._agree).
        fixed = all_gather_time(64 * world, world, hw.inter if world > hw.ranks_per_node else hw.intra) \
            + hw.step_overhead
        return exposed, gathers, optimizer, fixed

    def step(self, lay: Layout, exact: bool = True) -> float:
        """`predict(...).step_time` of the layout."""
        mb = self.microbatch(lay)
        return _step(self.pipeline(lay, mb, exact), *self.rest(lay, mb), mb.sp_grad_sum)

    def bound(self, lay: Layout) -> tuple[float, bool]:
        """(a lower bound on `step(lay)`, whether it is `step(lay)` itself), no simulation: the
        pipeline's `pipeline_bound` plus the closed forms, added in `step`'s order (rounding is
        monotone, so a lower pipeline part gives a lower sum)."""
        mb = self.microbatch(lay)
        pipe, exact = self.pipeline_bound(lay, mb)
        return _step(pipe, *self.rest(lay, mb), mb.sp_grad_sum), exact

    def prediction(self, cfg: Config, exact: bool = True) -> Prediction:
        """`predict(cfg)`: cfg is this model's, with its own layout."""
        m, hw, lay = cfg.model, self.hw, Layout.of(cfg)
        mb = self.microbatch(lay)
        step_pipe = self.pipeline(lay, mb, exact)
        exposed, gathers, optimizer, fixed = self.rest(lay, mb)
        step = _step(step_pipe, exposed, gathers, optimizer, fixed, mb.sp_grad_sum)
        world = lay.dp * lay.tp * lay.pp * lay.cp
        seqs = lay.dp * lay.micro_batch_size * lay.microbatches
        tokens_per_s = seqs * m.block_size / step
        mfu = _flops_per_token(cfg) * tokens_per_s / (world * hw.peak_flops)
        # tp and cp traffic inside the pipeline part (for calibration and the reasons), per step.
        comm = {"tp_in_pipeline": lay.microbatches * mb.blocks * mb.tp_per_block,
                "cp_in_pipeline": lay.microbatches * mb.blocks * mb.cp_per_block}
        parts = {"pipeline": step_pipe, "dp_exposed": exposed, "zero3_gathers": gathers, "optimizer": optimizer,
                 "fixed": fixed, "sp_grad_sum": mb.sp_grad_sum, "t_forward": mb.t_f, "t_backward": mb.t_b, **comm}
        return Prediction(cfg, step, tokens_per_s, mfu, 0, parts)


def _step(pipeline: float, exposed: float, gathers: float, optimizer: float, fixed: float, sp_sum: float) -> float:
    return pipeline + exposed + gathers + optimizer + fixed + sp_sum


def predict(cfg: Config, hw: Hardware, exact: bool = True) -> Prediction:
    """The predicted step of `cfg`, a validated config (mesh resolved), on `hw`. `exact` False:
    the pipeline from closed forms instead of the simulator (`rough_pipeline_time`), for ranking
    many candidates before the best are simulated."""
    return StepModel(cfg, hw).prediction(cfg, exact)


def _flops_per_token(cfg: Config) -> float:
    return metrics.flops_per_token(cfg.model.non_embedding_params(), cfg.model.n_layer, cfg.model.n_embd,
                                   cfg.model.block_size)
