"""The memory model: bytes per rank of a layout, for config validation and the planner.

`estimate_memory(cfg, dp, tp, pp, cp)` is the busiest pipeline rank's peak during a step: its
model state (weights, gradients and optimizer state by ZeRO stage, `_model_state`) plus the
activations the schedule stashes (`peak_stash` chunk activations of the rank's T/cp tokens per
block, by recomputation mode) and the attention's working set in backward. `memory_parts` gives
the two apart; `stage_parameters` and `stage_units` count what a pipeline rank holds and gathers,
split as the executor splits it (`stages.split_layers`). docs/config.md, "Memory", derives the
formulas.

`optimizer_bytes_per_param` and `state_bytes_per_param` are the one rule for what a parameter
costs (AdamW two moments, SGD one momentum buffer or none; float32 state and master copy under
a 16-bit model): the planner sizes its lower bound on ranks with them too.

Pure: no MPI and no I/O (the schedules' closed forms or their simulator, the stage split).
"""

import functools
import math
from typing import NamedTuple

from hpcpar.config.sections import Config
from hpcpar.nn.gpt import DTYPES, recomputed
from hpcpar.parallel.pp import schedules, simulate, stages


def optimizer_bytes_per_param(cfg: Config) -> int:
    """Optimizer state per parameter: AdamW two moments, SGD one momentum buffer (none at 0);
    kept in float32 (plus a float32 master copy) under a 16-bit model.dtype."""
    s = DTYPES[cfg.model.dtype]
    half = s == 2
    n_state = 2 if cfg.train.optimizer == "adamw" else int(cfg.train.momentum > 0)
    return n_state * (4 if half else s) + (4 if half else 0)


def outer_bytes_per_param(cfg: Config) -> int:
    """train.sync = "local" / "diloco" (parallel/dp/outer.py): the anchor, DiLoCo's outer momentum,
    the error-feedback residual of a compressed outer gradient, and the flat outer gradient of
    a synchronisation, per parameter this rank holds."""
    t = cfg.train
    if t.sync == "step":
        return 0
    copies = 2 + int(t.sync == "diloco" and t.outer_momentum > 0) + int(t.outer_compression != "none")
    return copies * DTYPES[cfg.model.dtype]


def state_bytes_per_param(cfg: Config) -> int:
    """Weights, gradients and optimizer state per parameter (nothing sharded)."""
    return 2 * DTYPES[cfg.model.dtype] + optimizer_bytes_per_param(cfg)


def _rank_chunks(cfg: Config, pp: int, rank: int) -> list[tuple[int, range, bool]]:
    """(virtual stage, its blocks, holds the head) of each model chunk of pipeline rank `rank`:
    the executor's own split (`stages.split_layers` with the LM head's cost)."""
    place = schedules.placement(cfg.pipeline.schedule, pp, cfg.pipeline.chunks)
    ranges = stages.split_layers(cfg.model.n_layer, place.stages, stages.head_cost(cfg.model))
    return [(v, ranges[v], v == place.stages - 1)
            for v in (place.stage(rank, chunk) for chunk in range(place.chunks))]


def stage_parameters(cfg: Config, tp: int, pp: int, stage: int) -> int:
    """Parameters held by one tp rank of pipeline rank `stage` (all its chunks), counted by the model
    (MoE layers: the E / mesh.ep experts of one ep rank)."""
    return sum(cfg.model.stage_params(blocks, embed=v == 0, head=head, tp=tp, ep=cfg.mesh.ep)
               for v, blocks, head in _rank_chunks(cfg, pp, stage))


def stage_units(cfg: Config, tp: int, pp: int, stage: int) -> list[int]:
    """Elements each ZeRO-3 unit of pipeline rank `stage` gathers (per tp rank): the embedding,
    each block, the head (ln_f plus its LM-head weight: the embedding's, gathered again, when one
    stage holds both)."""
    m = cfg.model
    sizes = []
    for v, blocks, head in _rank_chunks(cfg, pp, stage):
        if v == 0:
            sizes.append(m.embedding_params(tp))
        sizes += [m.block_params(tp, i, cfg.mesh.ep) for i in blocks]
        if head:
            sizes.append(m.head_params(tp, tied=False) + (m.block_size * m.n_embd if v == 0 else 0))
    return sizes


def _model_state(cfg: Config, params: int, units: list[int], shards: int) -> int:
    """Bytes of weights, gradients and optimizer state of a rank holding `params` parameters (its
    ZeRO-3 units' sizes `units`) with ZeRO sharding over `shards` ranks (dp_shard x cp); see
    docs/config.md. Peaks during a step, not the state between steps:

        zero 0  P s + P s + P k              (k: optimizer bytes per parameter)
        zero 1  P s + P s + P k / n
        zero 2  P s + G + P s / n + P k / n  (G: full gradient buckets alive: up to 3 in flight
                                              with one micro-batch; all with accumulation)
        zero 3  P (s + s + k) / n + (1 + f) U s + G  (the current unit and f = train.prefetch_units
                                              prefetched ones gathered, or all
                                              P s with reshard_after_forward = false; G: full unit
                                              gradients, up to 4, all with accumulation)

    With local SGD / DiLoCo, `outer_bytes_per_param` more for every parameter held (P, ZeRO-3 P / n).
    """
    t = cfg.train
    s = DTYPES[cfg.model.dtype]
    k = optimizer_bytes_per_param(cfg)
    p, n, z = params, (shards if t.zero else 1), t.zero
    state = -(-p * k // n) + outer_bytes_per_param(cfg) * (-(-p // n) if z == 3 else p)
    accumulate = t.microbatches > 1
    if z <= 1:
        return 2 * p * s + state
    if z == 2:
        bucket = max(1, int(t.bucket_mb * 2**20) // s)
        live = p if accumulate else min(p, 3 * bucket)
        return p * s + live * s + -(-p * s // n) + state
    largest = max(units) if units else 0
    gathered = p * s if not t.reshard_after_forward else min(p, (1 + t.prefetch_units) * largest) * s
    grads = p if accumulate else min(p, 4 * largest)
    return 2 * -(-p * s // n) + state + gathered + grads * s


def activation_bytes(cfg: Config) -> int:
    """Bytes per stored activation element: 2 under train.precision bf16/fp16, else model.dtype's."""
    return 2 if cfg.train.precision != "full" else DTYPES[cfg.model.dtype]


class _Activations(NamedTuple):
    """Activation bytes of one micro-batch on one rank (see `_activations`)."""

    per_layer: float        # a block's stash without recomputation
    kept: dict              # train.recompute mode -> what a block under it stashes
    transient: float        # the attention's working set in backward, once per rank
    embed: float            # token + position embeddings (first stage)
    head: float             # ln_f, logits and softmax probabilities (last stage)


def _activations(cfg: Config, tp: int, cp: int) -> _Activations:
    """Activations kept for backward per block per micro-batch, in elements, for the n = T/cp
    tokens of a rank (context parallelism divides every token-wise activation by cp):

      (6 + 2d) B n C / r   LayerNorm inputs/outputs, residuals (+ dropout masks), r = tp under SP
      12 B n C / tp        q, k, v, attention output, MLP hidden before/after GELU
      (2 + d) B H T^2 / (tp u)  attention scores and probabilities (+ dropout mask); u = cp for
                           Ulysses (whole sequences of H/(tp cp) heads), 1 without cp;
      B H n / tp           ring attention instead: the row log-sum-exp only

    plus, once per rank (freed op by op, not stashed), the attention's working set in backward:

      (2 B H / (tp u) + 1) q^2   scores/probabilities and dS, and the causal mask, with q = n
                           for ring attention (one block of the ring), q = T otherwise

    Stored in s bytes (16 bits under mixed precision); an op's working arrays (attention scores
    while they are computed, the loss's probabilities) in f bytes (float32)."""
    m, t = cfg.model, cfg.train
    s = activation_bytes(cfg)
    f = 4 if t.precision != "full" else s
    bsz, seq, c, heads = t.micro_batch_size, m.block_size, m.n_embd, m.n_head
    n = seq / cp
    d = int(m.dropout > 0)
    r = tp if cfg.mesh.sequence_parallel else 1
    ring = cp > 1 and cfg.mesh.cp_impl == "ring"
    attention = heads / tp * (1 if ring else (2 + d) * seq * seq / (cp * n))  # per token of n
    per_layer = s * bsz * n * ((6 + 2 * d) * c / r + 12 * c / tp + attention)
    # Recomputation (train.recompute, for the blocks of `recomputed`): "full" keeps only the block's
    # input, B n C / r, plus once per rank one block's activations while it is re-run in backward;
    # "selective" drops the (2 + d) B H T^2 / (tp u) probabilities (ring attention keeps none).
    kept = {"none": per_layer, "full": s * bsz * n * c / r,
            "selective": per_layer - (0 if ring else s * bsz * heads / tp * (2 + d) * seq * seq / cp)}
    q = n if ring else seq
    transient = f * (2 * bsz * heads / (tp * (1 if ring else cp)) + 1) * q * q
    embed = s * bsz * n * 2 * c
    head = bsz * n * (s * 2 * c + (s + f) * m.vocab_size / tp)
    return _Activations(per_layer, kept, transient, embed, head)


def _stage_activations(cfg: Config, pp: int, stage: int, stash: int, chunks: int, act: _Activations) -> float:
    """Activation bytes of pipeline rank `stage`, which stashes at most `stash` chunk activations
    (of `chunks` per micro-batch)."""
    t = cfg.train

    def chunk_bytes(blocks) -> float:
        return sum(act.kept[t.recompute if recomputed(i, t.recompute_every) else "none"] for i in blocks)
    microbatches = -(-stash // chunks)
    # A stashed chunk activation holds the blocks of one chunk: the rank's largest, as a bound.
    rank_chunks = _rank_chunks(cfg, pp, stage)
    total = stash * max(chunk_bytes(blocks) for _, blocks, _ in rank_chunks)
    holds_embed, holds_head = any(v == 0 for v, _, _ in rank_chunks), any(h for _, _, h in rank_chunks)
    total += microbatches * ((act.embed if holds_embed else 0) + (act.head if holds_head else 0)) + act.transient
    if t.recompute == "full" and any(recomputed(i, t.recompute_every) for _, blocks, _ in rank_chunks
                                     for i in blocks):
        total += act.per_layer  # the block being re-run
    return total


def memory_parts(cfg: Config, dp: int, tp: int, pp: int, cp: int | None = None) -> tuple[int, int]:
    """(weights + grads + optimizer state, activations) in bytes on the busiest rank.
    `cp` defaults to the config's resolved `mesh.cp` (1 when auto)."""
    t = cfg.train
    cp = cp if cp is not None else (cfg.mesh.cp or 1)
    # ZeRO shards over dp_shard x cp (HSDP replicates the shards over dp_replicate).
    replicate = cfg.mesh.dp_replicate if dp % cfg.mesh.dp_replicate == 0 else 1
    shards = dp // replicate * cp
    act = _activations(cfg, tp, cp)
    # Peak stashed chunk activations per pipeline rank, from the schedule itself.
    place = schedules.placement(cfg.pipeline.schedule, pp, cfg.pipeline.chunks)
    stash = peak_stash(cfg.pipeline.schedule, pp, t.microbatches, place.chunks)
    worst_state, worst_act, worst = 0, 0, -1.0
    for stage in range(pp):
        p = stage_parameters(cfg, tp, pp, stage)
        state = _model_state(cfg, p, stage_units(cfg, tp, pp, stage), shards)  # weights + grads + optimizer
        activations = _stage_activations(cfg, pp, stage, stash[stage], place.chunks, act)
        if state + activations > worst:
            worst_state, worst_act, worst = state, math.ceil(activations), state + activations
    return worst_state, worst_act


@functools.lru_cache(maxsize=1024)
def peak_stash(name: str, pp: int, microbatches: int, chunks: int = 1) -> tuple[int, ...]:
    """Chunk activations each pipeline rank holds at most (the simulator's `peak_stash`), from the
    schedules' closed forms where they have one (their docstrings in parallel/pp/schedules.py; the
    tests hold them to the simulator), so that plans for thousands of ranks need no simulation."""
    m, v = microbatches, chunks
    if name == "gpipe":
        return (m * v,) * pp
    if name == "1f1b" or (name == "interleaved" and v == 1):
        return tuple(min(pp - r, m) for r in range(pp))
    if name == "interleaved":
        return tuple(min(2 * (pp - r - 1) + (v - 1) * pp + 1, m * v) for r in range(pp))
    return simulate.timeline(name, pp, m, v).peak_stash


def estimate_memory(cfg: Config, dp: int, tp: int, pp: int, cp: int | None = None) -> int:
    """Estimated bytes per rank on the busiest pipeline stage (see docs/config.md, "Memory").

    weights + grads + optimizer state by ZeRO stage (`_model_state`: 2 P s + 2 P s moments without
    ZeRO; sharded over n = dp_shard x cp: the moments with ZeRO-1, the gradients too with ZeRO-2,
    everything with ZeRO-3 plus two gathered units) + activations stashed by the schedule (peak
    micro-batches in flight x layers x per-layer activations of the rank's T/cp tokens; a layer
    under `train.recompute` counts what it keeps). P counts the rank's share of parameters under
    tp and pp (cp shards no weight); s is the dtype's size. `cp` defaults to the config's `mesh.cp`.
    """
    state, act = memory_parts(cfg, dp, tp, pp, cp)
    return state + act
