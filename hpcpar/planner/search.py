"""The search of `hpcpar plan`: every layout of an allocation, ranked by predicted step time.

For an allocation of `world` ranks and a model with a global batch of G sequences, the
candidates (`candidates`) are every layout hpcpar runs: dp (and its dp_replicate x dp_shard
split), tp, pp with each schedule and its chunks, cp, the ZeRO stage, recomputation, the
micro-batch size b and count m = G / (dp b). `fastest_layouts` returns, fastest first, those
`config.validate` accepts whose `config.memory.estimate_memory` fits a rank, by their predicted
step (`predict.predict`); `plan` adds, per axis, the fastest plan with another value (`reasons`).
`format_plans` prints the table, and `write_plan` writes the best as a config `hpcpar train`
runs as is (`runnable`: a 16-bit what-if becomes float32 masters with train.precision).

The answer is the exhaustive search's (`fastest_layouts(..., exhaustive=True)`, which predicts,
validates and sizes every candidate; tests/unit/test_plan.py holds the two equal), found by
branch and bound (`Search`): a lower bound on every candidate's step without simulating its
pipeline, then exact times (the simulator, memoised) and memory estimates only for the
candidates whose bound could still beat the plans kept, so that 16,384 ranks plan in seconds.

A mixture-of-experts model (`model.moe_experts > 0`) is planned with the configured `mesh.ep`
kept fixed (layouts whose dp_shard it does not divide fail validation and drop out). Planning ep
itself is future work. Pure: with a hardware preset, planning loads no MPI (login nodes).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math

from hpcpar.backend.precision import LOW_DTYPES
from hpcpar.config import memory
from hpcpar.config.load import to_toml
from hpcpar.config.memory import estimate_memory, state_bytes_per_param
from hpcpar.config.sections import Config
from hpcpar.config.validate import validate
from hpcpar.errors import ConfigError, HpcparError
from hpcpar.nn.gpt import DTYPES, recomputed
from hpcpar.parallel.pp import schedules
from hpcpar.parallel.pp.stages import head_cost, split_layers
from hpcpar.planner.hardware import GiB, Hardware
from hpcpar.planner.predict import Layout, Prediction, StepModel, predict
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


def _layouts(cfg: Config, world: int, hw: Hardware, global_batch: int):
    """`candidates` as `Layout`s, in the same order (the order that breaks ties between plans)."""
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
                                    yield Layout(tp, pp, cp, dp, b, mb, sched, chunks, zero, replicate, recompute, sp)


def candidates(cfg: Config, world: int, hw: Hardware, global_batch: int):
    """Every layout of `world` ranks for cfg's model and `global_batch` sequences (not yet
    validated). Micro-batch sizes are the powers of two up to 64 that divide a dp rank's share
    (and the share itself when smaller); HSDP's dp_replicate is 1 or the value that keeps each
    shard group inside a node."""
    for lay in _layouts(cfg, world, hw, global_batch):
        yield lay.apply(cfg)


# ZB-V's step is its list-scheduled order simulated (`predict.pipeline_time`): its steady state is
# not affine in the micro-batches (so not extrapolated) and, when B and W differ from F, far from
# the textbook bubble. Building that order costs ~0.1 ms per micro-batch and pipeline rank, so
# longer ZB-V schedules than this (4 pp m chunk-actions: pp m <= 4096) are not planned.
_ZBV_MAX_ACTIONS = 32_768


def _schedules(pp: int, microbatches: int, n_layer: int):
    """(schedule, chunks) pairs to try: 1F1B (GPipe when m < pp, where they tie), interleaved,
    ZB-H1 and ZB-V (chunks 0: the schedule's own; up to `_ZBV_MAX_ACTIONS`)."""
    if pp == 1:
        yield "1f1b", 1
        return
    yield ("1f1b" if microbatches >= pp else "gpipe"), 1
    for chunks in (2, 4):
        if microbatches % pp == 0 and n_layer >= pp * chunks:
            yield "interleaved", chunks
    yield "zbh1", 1
    if n_layer >= 2 * pp and 4 * pp * microbatches * 2 <= _ZBV_MAX_ACTIONS:
        yield "zbv", 0


def fastest_layouts(cfg: Config, world: int, hw: Hardware, top: int = 5, global_batch: int | None = None,
                    keep: int = 400, exhaustive: bool = False) -> list[Prediction]:
    """The fastest layouts that `config.validate` accepts and that fit `hw.memory_bytes`, fastest
    first (ties in `candidates`' order): `top` of them (0: up to `keep`), found by `Search`.
    `exhaustive`: by predicting, validating and sizing every candidate instead, the reference the
    tests hold `Search` to (small allocations only: it simulates every pipeline)."""
    global_batch = _check(cfg, world, hw, global_batch)
    if exhaustive:
        return _exhaustive(cfg, world, hw, global_batch, top or keep)
    search = Search(cfg, world, hw, global_batch)
    return search.plans(search.best(top or keep), required=True)


def plan(cfg: Config, world: int, hw: Hardware, top: int = 5,
         global_batch: int | None = None) -> tuple[list[Prediction], list[str]]:
    """`hpcpar plan`: the `top` fastest plans (as `fastest_layouts`) and, per axis, why the first
    has its value (`reasons`, against the fastest plan with each other value, each found by the
    same search: the exhaustive search's runners-up)."""
    global_batch = _check(cfg, world, hw, global_batch)
    search = Search(cfg, world, hw, global_batch)
    plans = search.plans(search.best(top), required=True)
    best = Layout.of(plans[0].cfg)
    runners = set()
    for axis in _AXES:
        value = getattr(best, axis)
        runners.update(search.best(1, lambda lay, axis=axis, value=value: getattr(lay, axis) != value))
    return plans, reasons(plans[0], search.plans(sorted(runners)))


def _check(cfg: Config, world: int, hw: Hardware, global_batch: int | None) -> int:
    """The global batch to plan (the config's by default); ConfigError when the model's state alone,
    sharded over every rank, does not fit one."""
    if global_batch is None:
        global_batch = _global_batch(cfg, world)
    if state_bytes_per_param(cfg) * cfg.model.num_params() / world > hw.memory_bytes:
        raise ConfigError(_nothing_fits(cfg, world, hw, global_batch, 1))   # not even fully sharded
    return global_batch


def _exhaustive(cfg: Config, world: int, hw: Hardware, global_batch: int, k: int) -> list[Prediction]:
    """Every candidate predicted (the simulator's pipelines), then validated and sized in order of
    step time until `k` fit: the reference for `Search`."""
    preds = sorted(((predict(c, hw).step_time, i, c) for i, c in enumerate(candidates(cfg, world, hw, global_batch))),
                   key=lambda x: x[:2])
    found = []
    for _, _, c in preds:
        try:
            cand = _validate(c, world)
        except HpcparError:
            continue
        memory = estimate_memory(cand, cand.mesh.dp, cand.mesh.tp, cand.mesh.pp, cand.mesh.cp)
        if memory <= hw.memory_bytes:
            found.append(dataclasses.replace(predict(c, hw), cfg=cand, memory_bytes=memory))
            if len(found) >= k:
                break
    if not found:
        raise ConfigError(_nothing_fits(cfg, world, hw, global_batch, len(preds)))
    return found


class Search:
    """Branch and bound over every candidate layout of an allocation (`candidates`).

    Every layout gets a lower bound on its step time first (`StepModel.bound`: the closed forms
    of everything but the pipeline, which is exact too where `pipeline_time` is a closed form,
    and otherwise bounded below by its busiest rank's work plus the fill and drain its data
    dependencies force). `best` walks the layouts in order of that bound and stops at the first
    whose bound exceeds the k-th best step time found so far; on the way it times a layout
    exactly (the simulator, memoised by schedule shape and cost ratios) only when its bound
    could still make the k best, and validates and sizes it (`config.validate`,
    `config.memory.estimate_memory`) only when its exact time does. So the result is the
    exhaustive search's, with its ties broken the same way (`candidates`' order), while
    simulating and sizing a few hundred layouts rather than every one.
    """

    def __init__(self, cfg: Config, world: int, hw: Hardware, global_batch: int):
        self.cfg, self.world, self.hw, self.global_batch = cfg, world, hw, global_batch
        self.layouts = list(_layouts(cfg, world, hw, global_batch))
        if not self.layouts:
            raise ConfigError(_nothing_fits(cfg, world, hw, global_batch, 0))
        self.model = StepModel(cfg, hw)
        self.memory = _Memory(cfg)
        self.bounds = [self.model.bound(lay) for lay in self.layouts]   # (seconds, is the exact step time)
        self.order = sorted(range(len(self.layouts)), key=lambda i: self.bounds[i][0])   # stable: ties by index
        self._times: dict[int, float] = {}
        self._fits: dict[int, tuple[Config, int] | None] = {}
        self.trust_bounds = True    # False once a bound was found above its step: then nothing is skipped

    def time(self, i: int) -> float:
        """Layout i's step time, `predict`'s."""
        t = self._times.get(i)
        if t is None:
            bound, exact = self.bounds[i]
            t = bound if exact else self.model.step(self.layouts[i])
            if t < bound and self.trust_bounds:
                logging.getLogger(__name__).warning(
                    "hpcpar plan: the step-time bound of %s (%.6g s) exceeds its simulated step (%.6g s); "
                    "searching every remaining layout", self.layouts[i], bound, t)
                self.trust_bounds = False
            self._times[i] = t
        return t

    def fit(self, i: int) -> tuple[Config, int] | None:
        """(the validated config, its memory estimate) of layout i when it validates and fits, else None."""
        if i not in self._fits:
            self._fits[i] = self._fit(self.layouts[i])
        return self._fits[i]

    def _fit(self, lay: Layout) -> tuple[Config, int] | None:
        memory = self.memory.estimate(lay, self.hw.memory_bytes)   # validation resolves nothing it reads
        if memory is None:
            return None
        try:
            return _validate(lay.apply(self.cfg), self.world), memory
        except HpcparError:
            return None         # a layout the engine refuses is simply not a candidate

    def best(self, k: int, accept=None) -> list[int]:
        """Indices of the k fastest layouts that validate and fit (and that `accept`, a predicate
        on the `Layout`, takes), fastest first, ties in `candidates`' order."""
        kept: list[tuple[float, int]] = []      # a max-heap of (-time, -index): the k best so far
        for i in self.order:
            if len(kept) == k and self.trust_bounds and self.bounds[i][0] > -kept[0][0]:
                break           # this bound, and every later one, is above the k-th best time
            if accept is not None and not accept(self.layouts[i]):
                continue
            full = len(kept) == k
            if full and self.bounds[i][1] and (self.bounds[i][0], i) >= (-kept[0][0], -kept[0][1]):
                continue        # its time is its bound (a closed form): not among the k best
            # Whether it fits first (cheap: most fast layouts do not), then its time (a simulation).
            if self.fit(i) is None:
                continue
            t = self.time(i)
            if full and (t, i) >= (-kept[0][0], -kept[0][1]):
                continue
            heapq.heappush(kept, (-t, -i))
            if len(kept) > k:
                heapq.heappop(kept)
        return [i for _, i in sorted((-t, -i) for t, i in kept)]

    def plans(self, indices: list[int], required: bool = False) -> list[Prediction]:
        """The predictions of layouts that fit, with their validated configs and memory estimates
        (`required`: none is an error, which says why)."""
        if required and not indices:
            raise ConfigError(_nothing_fits(self.cfg, self.world, self.hw, self.global_batch, len(self.layouts)))
        out = []
        for i in indices:
            cand, estimate = self.fit(i)
            # The search's copy of the memory model against the original, where that simulates nothing.
            if cand.pipeline.schedule not in ("zbh1", "zbv"):
                mesh = cand.mesh
                original = estimate_memory(cand, mesh.dp, mesh.tp, mesh.pp, mesh.cp)
                if estimate != original:
                    raise AssertionError(f"hpcpar plan: the search's memory estimate of {self.layouts[i]} "
                                         f"({estimate} bytes) is not config.memory.estimate_memory's ({original})")
            pred = self.model.prediction(self.layouts[i].apply(self.cfg))
            out.append(dataclasses.replace(pred, cfg=cand, memory_bytes=estimate))
        return out


class _Memory:
    """`config.memory.memory_parts`' estimate for the search: the same terms, from the module's own
    `_activations` and `_model_state` (each asked once per combination of the layout fields it
    reads), with what only the layout's shape decides (the layer split per pipeline rank, its
    parameters and ZeRO-3 units) computed once per shape instead of once per candidate, and
    ZB-H1's and ZB-V's peak stash from their closed forms (min(pp, m), 2 min(pp, m) on every
    rank, held to the simulator by tests/unit/test_plan.py) instead of simulating a schedule of
    every micro-batch. tests/unit/test_plan.py holds it to `estimate_memory` on every candidate
    of its shapes, and `Search.plans` to it on every plan it returns."""

    def __init__(self, cfg: Config):
        self.cfg, self.model, self.ep = cfg, cfg.model, cfg.mesh.ep
        self._chunks: dict = {}
        self._stages: dict = {}
        self._acts: dict = {}
        self._states: dict = {}
        self._ranks: dict = {}

    def rank_chunks(self, schedule: str, pp: int, chunks: int) -> list[list[tuple[int, range, bool]]]:
        """`memory._rank_chunks` of every pipeline rank: (virtual stage, its blocks, holds the head) per chunk."""
        key = (schedule, pp, chunks)
        ranks = self._chunks.get(key)
        if ranks is None:
            place = schedules.placement(schedule, pp, chunks)
            ranges = split_layers(self.model.n_layer, place.stages, head_cost(self.model))
            ranks = self._chunks[key] = [
                [(v, ranges[v], v == place.stages - 1) for v in (place.stage(r, c) for c in range(place.chunks))]
                for r in range(pp)]
        return ranks

    def stages(self, schedule: str, pp: int, chunks: int, tp: int) -> list[tuple[int, list[int]]]:
        """(`memory.stage_parameters`, `memory.stage_units`) of every pipeline rank."""
        key = (schedule, pp, chunks, tp)
        got = self._stages.get(key)
        if got is None:
            m, ep = self.model, self.ep
            got = self._stages[key] = []
            for held in self.rank_chunks(schedule, pp, chunks):
                params = sum(m.stage_params(blocks, embed=v == 0, head=head, tp=tp, ep=ep) for v, blocks, head in held)
                units = []
                for v, blocks, head in held:
                    if v == 0:
                        units.append(m.embedding_params(tp))
                    units += [m.block_params(tp, i, ep) for i in blocks]
                    if head:
                        units.append(m.head_params(tp, tied=False) + (m.block_size * m.n_embd if v == 0 else 0))
                got.append((params, units))
        return got

    def _activations(self, key: tuple):
        """`memory._activations`, which reads the micro-batch size, tp, cp and sequence parallelism (`key`)."""
        got = self._acts.get(key)
        if got is None:
            b, tp, cp, sp = key
            cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(self.cfg.train, micro_batch_size=b),
                                      mesh=dataclasses.replace(self.cfg.mesh, tp=tp, cp=cp, sequence_parallel=sp))
            got = self._acts[key] = memory._activations(cfg, tp, cp)
        return got

    def _state(self, zero: int, microbatches: int, params: int, units: list[int], shards: int) -> int:
        """`memory._model_state`, which reads the ZeRO stage and the micro-batch count of the layout."""
        key = (zero, microbatches, params, id(units), shards)
        got = self._states.get(key)
        if got is None:
            cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(self.cfg.train, zero=zero,
                                                                          microbatches=microbatches))
            got = self._states[key] = memory._model_state(cfg, params, units, shards)
        return got

    def _held(self, schedule: str, pp: int, chunks: int, recompute: str, act_key: tuple, act, rank: int) -> tuple:
        """What `memory._stage_activations` of pipeline rank `rank` reads besides the stash: (its largest
        chunk's activations, holds the embedding, holds the head, re-runs a block in backward)."""
        key = (schedule, pp, chunks, recompute, act_key)
        ranks = self._ranks.get(key)
        if ranks is None:
            ranks = self._ranks[key] = [None] * pp
        got = ranks[rank]
        if got is None:
            every = self.cfg.train.recompute_every
            held = self.rank_chunks(schedule, pp, chunks)[rank]

            def chunk_bytes(blocks) -> float:
                return sum(act.kept[recompute if recomputed(i, every) else "none"] for i in blocks)
            got = ranks[rank] = (
                max(chunk_bytes(blocks) for _, blocks, _ in held), any(v == 0 for v, _, _ in held),
                any(h for _, _, h in held),
                recompute == "full" and any(recomputed(i, every) for _, blocks, _ in held for i in blocks))
        return got

    def estimate(self, lay: Layout, limit: float | None = None) -> int | None:
        """`estimate_memory` of the layout (`memory_parts`' busiest rank, the same sums in the same
        order); None as soon as one rank is over `limit` (then so is the estimate)."""
        pp, chunks = lay.pp, schedules.resolve_chunks(lay.schedule, lay.chunks)
        replicate = lay.dp_replicate if lay.dp % lay.dp_replicate == 0 else 1
        shards = lay.dp // replicate * lay.cp
        act_key = (lay.micro_batch_size, lay.tp, lay.cp, lay.sequence_parallel)
        act = self._activations(act_key)
        stash = _peak_stash(lay.schedule, pp, lay.microbatches, chunks)
        worst_state, worst_act, worst = 0, 0, -1.0
        for rank, (params, units) in enumerate(self.stages(lay.schedule, pp, lay.chunks, lay.tp)):
            state = self._state(lay.zero, lay.microbatches, params, units, shards)
            # memory._stage_activations: the stash of the largest chunk, the embedding's and head's
            # activations per micro-batch stashed, the attention's working set, a re-run block.
            largest, holds_embed, holds_head, rerun = self._held(lay.schedule, pp, lay.chunks, lay.recompute, act_key,
                                                                 act, rank)
            activations = stash[rank] * largest
            activations += -(-stash[rank] // chunks) * ((act.embed if holds_embed else 0)
                                                        + (act.head if holds_head else 0)) + act.transient
            if rerun:
                activations += act.per_layer
            if state + activations > worst:
                worst_state, worst_act, worst = state, math.ceil(activations), state + activations
                if limit is not None and worst > limit:
                    return None
        return worst_state + worst_act


def _peak_stash(name: str, pp: int, microbatches: int, chunks: int) -> tuple[int, ...]:
    """`memory.peak_stash`, with ZB-H1's and ZB-V's closed forms (no simulation)."""
    if name == "zbh1":
        return (min(pp, microbatches),) * pp
    if name == "zbv":
        return (2 * min(pp, microbatches),) * pp
    return memory.peak_stash(name, pp, microbatches, chunks)


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


_AXES = ("tp", "pp", "cp", "dp", "zero", "recompute", "schedule", "micro_batch_size")   # what `reasons` explains


def reasons(best: Prediction, others: list[Prediction]) -> list[str]:
    """Per axis, why the best plan's value: the fastest plan with another value, and how much slower."""
    out = []
    mine = Layout.of(best.cfg)
    for axis in _AXES:
        value = getattr(mine, axis)
        alt = [p for p in others if getattr(Layout.of(p.cfg), axis) != value]
        if not alt:
            out.append(f"{axis}={value}: the only value that validates and fits")
            continue
        runner = min(alt, key=lambda p: p.step_time)
        out.append(f"{axis}={value}: the best plan with {axis}={getattr(Layout.of(runner.cfg), axis)} is "
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
