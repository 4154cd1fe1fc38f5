"""`hpcpar plan`: the cost model's pieces against the simulator, its plans against validation and
the memory estimate, its predictions against published figures (Narayanan et al., SC'21), and
its bounded search against the exhaustive one."""

from __future__ import annotations

import dataclasses
import random

import pytest

from hpcpar.config.load import load_config
from hpcpar.config.memory import estimate_memory, peak_stash
from hpcpar.config.sections import Config
from hpcpar.config.validate import validate
from hpcpar.planner.hardware import PRESETS, Link, all_gather_time, all_reduce_time
from hpcpar.planner.predict import Layout, StepModel, pipeline_bound, pipeline_time, predict
from hpcpar.planner.search import (
    MODEL_PRESETS, Search, _global_batch, _Memory, _peak_stash, _validate, candidates, fastest_layouts, plan,
    reasons, write_plan,
)
from hpcpar.errors import ConfigError
from hpcpar.parallel.pp import schedules, simulate

A100 = PRESETS["a100"]


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 6), (4, 4), (4, 8), (3, 9), (4, 12)])
def test_peak_stash_closed_forms_are_the_simulators(name, chunks, pp, m):
    if name == "interleaved" and m % pp:
        pytest.skip("interleaved needs m % pp == 0")
    if name == "1f1b" and m < pp:
        pytest.skip("1f1b with m < pp: gpipe's case")
    simulated = simulate.simulate(schedules.build(name, pp, m, chunks)).peak_stash
    assert list(peak_stash(name, pp, m, chunks)) == list(simulated)


@pytest.mark.parametrize("name,chunks", [("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zbh1", 1),
                                         ("zbv", 0)])
@pytest.mark.parametrize("pp,m", [(2, 40), (4, 64), (4, 72), (8, 128)])
def test_long_schedules_extrapolate_to_the_simulators_makespan(name, chunks, pp, m, monkeypatch):
    """Above `_SIMULATE_MAX` actions `pipeline_time` simulates m0 = 2 pp + m mod pp and m0 + pp
    micro-batches and extends their difference (the steady state): the full simulation's makespan."""
    if name == "interleaved" and m % pp:
        pytest.skip("interleaved needs m % pp == 0")
    t_f, t_b, t_w, t_msg = 1.0, 1.3, 0.9, 0.05
    place = schedules.placement(name, pp, chunks)
    zero_bubble = name.startswith("zb")
    full = simulate.simulate(schedules.build(name, pp, m, place.chunks), t_f, t_b if zero_bubble else t_b + t_w,
                            t_msg, t_w if zero_bubble else 0.0, placement=place).makespan
    monkeypatch.setattr("hpcpar.planner.predict._SIMULATE_MAX", 1)
    assert pipeline_time(name, pp, m, chunks, t_f, t_b, t_msg, t_w) == pytest.approx(full, rel=1e-9)


def cfg_of(*overrides: str) -> Config:
    return load_config(None, list(overrides))


def test_collective_costs_follow_the_ring_model():
    link = Link(alpha=1e-5, beta=1e9)
    assert all_reduce_time(4e6, 1, link) == 0
    assert all_reduce_time(4e6, 4, link) == pytest.approx(2 * 3 * (1e-5 + 1e6 / 1e9))
    assert all_gather_time(4e6, 4, link) == pytest.approx(all_reduce_time(4e6, 4, link) / 2)
    hw = dataclasses.replace(A100, ranks_per_node=8)
    assert hw.link(8, 1) == hw.intra and hw.link(2, 8) == hw.inter


def test_ranks_sharing_cores_run_the_schedule_at_a_whole_core_or_the_work_over_the_cores():
    """cores_per_rank c < 1 (calibrated with every rank busy): a pipeline's step is its schedule
    at c of the calibrated times, or its work m (F + B), whichever is longer; pp = 1 is unchanged."""
    cfg = validate(cfg_of("model.n_layer=4", "model.n_head=4", "model.n_embd=64", "model.block_size=64",
                                 "mesh.dp=1", "mesh.pp=4", "train.microbatches=3", "pipeline.schedule=1f1b"), 4)
    shared = dataclasses.replace(A100, cores_per_rank=0.5)
    alone, busy = predict(cfg, A100), predict(cfg, shared)
    f, b = alone.parts["t_forward"], alone.parts["t_backward"]
    bubbly = pipeline_time("1f1b", 4, 3, 1, 0.5 * f, 0.5 * b, _msg(cfg))
    assert busy.parts["pipeline"] == pytest.approx(max(bubbly, 3 * (f + b)))
    assert busy.parts["pipeline"] < alone.parts["pipeline"]      # the bubble is others' core time
    flat = validate(cfg_of("model.n_layer=4", "model.n_head=4", "model.n_embd=64", "model.block_size=64",
                                  "mesh.dp=4", "mesh.pp=1"), 4)
    assert predict(flat, shared).step_time == predict(flat, A100).step_time


def _msg(cfg):
    """The pipeline message time `predict` uses for cfg on A100 (one activation over the link)."""
    m, t = cfg.model, cfg.train
    link = A100.link(cfg.mesh.pp, cfg.mesh.dp * cfg.mesh.cp * cfg.mesh.tp)
    return link.alpha + t.micro_batch_size * m.block_size * m.n_embd * 4 / link.beta


def test_tp_scale_per_degree_falls_back_to_the_common_one():
    cfg = validate(cfg_of("model.n_layer=2", "model.n_head=4", "model.n_embd=64", "model.block_size=64",
                                 "mesh.dp=2", "mesh.tp=2"), 4)
    base = predict(cfg, A100).parts["tp_in_pipeline"]
    assert base > 0
    assert predict(cfg, dataclasses.replace(A100, tp_scale=3.0)).parts["tp_in_pipeline"] == pytest.approx(3 * base)
    own = dataclasses.replace(A100, tp_scale=3.0, tp_scales={2: 0.5, 4: 9.0})
    assert predict(cfg, own).parts["tp_in_pipeline"] == pytest.approx(0.5 * base)


def test_plans_validate_fit_and_come_fastest_first(tmp_path):
    cfg = cfg_of("model.n_layer=4", "model.n_head=4", "model.n_embd=64", "model.block_size=64")
    hw = dataclasses.replace(A100, ranks_per_node=4, memory_bytes=2**30)
    plans = fastest_layouts(cfg, 4, hw, top=0)
    assert len(plans) > 10
    times = [p.step_time for p in plans]
    assert times == sorted(times)
    for p in plans:
        m = p.cfg.mesh
        assert m.dp * m.tp * m.pp * m.cp == 4
        assert m.dp * p.cfg.train.micro_batch_size * p.cfg.train.microbatches == 48   # auto dp=2 x 12 x 2
        assert validate(p.cfg, 4) == p.cfg
        assert p.memory_bytes == estimate_memory(p.cfg, m.dp, m.tp, m.pp, m.cp) <= hw.memory_bytes
        assert sum(v for k, v in p.parts.items() if not k.startswith("t_") and "_in_" not in k) == \
            pytest.approx(p.step_time)
    out = tmp_path / "plan.toml"
    write_plan(plans[0], str(out))
    assert validate(load_config(str(out)), 4) == plans[0].cfg
    why = reasons(plans[0], plans[1:])
    assert any(line.startswith("tp=") for line in why) and all("x slower" in line or "only value" in line
                                                            for line in why)


def test_memory_limit_drops_layouts_that_do_not_fit():
    cfg = cfg_of("model.n_layer=8", "model.n_head=8", "model.n_embd=512", "model.block_size=256")
    roomy = fastest_layouts(cfg, 8, dataclasses.replace(A100, memory_bytes=2**34), top=0, keep=10**6)
    tight_bytes = sorted(p.memory_bytes for p in roomy)[len(roomy) // 2]
    tight = fastest_layouts(cfg, 8, dataclasses.replace(A100, memory_bytes=tight_bytes), top=0, keep=10**6)
    assert tight and all(p.memory_bytes <= tight_bytes for p in tight)
    assert len(tight) < len(roomy)


def test_a_model_that_fits_nowhere_says_how_many_ranks_it_needs():
    cfg = cfg_of(*(f"model.{k}={v}" for k, v in MODEL_PRESETS["70b"].items()))
    with pytest.raises(ConfigError, match=r"no layout of 8 ranks fits .* need >= \d+ such ranks"):
        fastest_layouts(cfg, 8, A100)


# Narayanan et al., SC'21 (arXiv 2104.04473), Table 1 / Megatron-LM README: GPT with s = 2048,
# V = 51200, mixed precision, full recomputation, micro-batch 1, on A100s (Selene).
# (billions of parameters, heads, hidden, layers, tp, pp, GPUs, global batch, TFLOP/s per GPU)
NARAYANAN = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
             (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
             (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
             (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
             (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def narayanan_config(heads, hidden, layers, tp, pp, gpus, batch) -> Config:
    dp = gpus // (tp * pp)
    return cfg_of(f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={hidden}",
                  "model.block_size=2048", "model.vocab_size=51200", "model.dtype=bfloat16", f"mesh.dp={dp}",
                  f"mesh.tp={tp}", f"mesh.pp={pp}", "mesh.cp=1", "train.micro_batch_size=1",
                  f"train.microbatches={batch // dp}", "train.recompute=full")


def paper_tflops_per_gpu(step_time, heads, hidden, layers, gpus, batch) -> float:
    """The paper's count: F = 96 B s l h^2 (1 + s / 6h + V / 16 l h) per step (recomputation included)."""
    s, v = 2048, 51200
    flops = 96 * batch * s * layers * hidden**2 * (1 + s / (6 * hidden) + v / (16 * layers * hidden))
    return flops / step_time / gpus / 1e12


@pytest.mark.parametrize("row", NARAYANAN, ids=[f"{r[0]}B" for r in NARAYANAN])
def test_predicted_tflops_per_gpu_within_20_percent_of_the_paper(row):
    _, heads, hidden, layers, tp, pp, gpus, batch, published = row
    predicted = predict(narayanan_config(heads, hidden, layers, tp, pp, gpus, batch), A100)
    tflops = paper_tflops_per_gpu(predicted.step_time, heads, hidden, layers, gpus, batch)
    assert tflops == pytest.approx(published, rel=0.20)


def test_plans_for_ten_thousand_ranks():
    """One representative rank per role: a 175B model on 16,384 GPUs plans without simulating them all."""
    cfg = cfg_of(*(f"model.{k}={v}" for k, v in MODEL_PRESETS["175b"].items()))
    hw = dataclasses.replace(A100, ranks_per_node=8)
    best = fastest_layouts(cfg, 16384, hw, top=3, global_batch=4096)
    assert len(best) == 3 and all(p.cfg.mesh.dp * p.cfg.mesh.tp * p.cfg.mesh.pp * p.cfg.mesh.cp == 16384
                                  for p in best)


def test_a_16_bit_what_if_is_written_as_float32_masters_with_train_precision(tmp_path):
    cfg = cfg_of("model.dtype=bfloat16")
    best = fastest_layouts(cfg, 4, dataclasses.replace(A100, ranks_per_node=4), top=1)[0]
    out = tmp_path / "plan.toml"
    write_plan(best, str(out))
    written = validate(load_config(str(out)), 4)
    assert (written.model.dtype, written.train.precision) == ("float32", "bf16")
    assert written.mesh == best.cfg.mesh


# --------------------------------------------------------------------------- the search against exhaustion

CALIBRATED = dataclasses.replace(   # a calibration's figures: ranks sharing cores, measured layer times, tp scales
    A100, name="this", ranks_per_node=4, memory_bytes=2**30, cores_per_rank=0.5, tp_scales={2: 1.3, 4: 2.0},
    cp_hidden=0.3, step_overhead=1e-3, microbatch_overhead=1e-4,
    model={"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128, "vocab_size": 256, "dtype": "float32",
           "bias": True},
    layer_times={1: [1e-4, 1e-6, 2e-4, 2e-6, 1e-4, 3e-7], 2: [6e-5, 5e-7, 1e-4, 1e-6, 5e-5, 2e-7],
                 4: [4e-5, 3e-7, 7e-5, 6e-7, 3e-5, 1e-7]})
# (config overrides, ranks, hardware, global batch): small enough to predict, validate and size every candidate.
SEARCH_SHAPES = {
    "default model, 4 ranks": ([], 4, dataclasses.replace(A100, ranks_per_node=4, memory_bytes=2**30), None),
    "calibrated, ranks sharing cores": ([], 4, CALIBRATED, None),
    "tight memory, 8 ranks": (["model.n_layer=8", "model.n_head=8", "model.n_embd=512", "model.block_size=256"], 8,
                              dataclasses.replace(A100, ranks_per_node=4, memory_bytes=300 * 2**20), 32),
    "16-bit, recompute_every, 2 nodes": (["model.n_layer=8", "model.n_head=8", "model.n_embd=256",
                                          "model.block_size=256", "model.dtype=bfloat16", "train.recompute_every=2",
                                          "model.vocab_size=4096"], 8,
                                         dataclasses.replace(A100, ranks_per_node=4, memory_bytes=2**27), 16),
    "mixture of experts, ep=2": (["model.moe_experts=4", "mesh.ep=2", "model.moe_top_k=1"], 8,
                                 dataclasses.replace(A100, ranks_per_node=8, memory_bytes=2**30), 32),
}


def _ranking(plans):
    return [(p.cfg, p.step_time, p.memory_bytes, p.parts) for p in plans]


@pytest.mark.parametrize("shape", SEARCH_SHAPES)
def test_the_search_ranks_as_the_exhaustive_search(shape):
    """The bounded search (`search.Search`) returns the exhaustive search's plans: the same configs,
    step times (bitwise: the same `predict`), memory estimates and order (ties in `candidates`' order),
    for the first few, for every plan that fits, and for `plan`'s per-axis reasons."""
    overrides, world, hw, batch = SEARCH_SHAPES[shape]
    cfg = cfg_of(*overrides)
    every = fastest_layouts(cfg, world, hw, top=0, keep=10**6, global_batch=batch, exhaustive=True)
    assert len(every) > 10 and [p.step_time for p in every] == sorted(p.step_time for p in every)
    assert _ranking(fastest_layouts(cfg, world, hw, top=0, keep=10**6, global_batch=batch)) == _ranking(every)
    for top in (1, 5, 12):
        assert _ranking(fastest_layouts(cfg, world, hw, top=top, global_batch=batch)) == _ranking(every[:top])
    plans, why = plan(cfg, world, hw, top=5, global_batch=batch)
    assert _ranking(plans) == _ranking(every[:5])
    assert why == reasons(every[0], every[1:])
    search = Search(cfg, world, hw, batch or _global_batch(cfg, world))   # and it prunes: few are sized or timed
    search.best(5)
    assert len(search._fits) < len(search.layouts) / 10 and len(search._times) < len(search.layouts) / 10


@pytest.mark.parametrize("shape", SEARCH_SHAPES)
def test_the_search_times_and_sizes_every_candidate_as_predict_and_estimate_memory(shape):
    """What the search ranks by: `StepModel.step` is `predict`'s step time bitwise, `StepModel.bound`
    is at most it (equal where the pipeline is a closed form), and the search's memory estimate is
    `estimate_memory`'s, on every candidate."""
    overrides, world, hw, batch = SEARCH_SHAPES[shape]
    cfg = cfg_of(*overrides)
    batch = batch or _global_batch(cfg, world)
    model, sizes = StepModel(cfg, hw), _Memory(cfg)
    for c in candidates(cfg, world, hw, batch):
        lay = Layout.of(c)
        step = predict(c, hw).step_time
        bound, exact = model.bound(lay)
        assert model.step(lay) == step and (bound == step if exact else bound <= step)
        try:
            valid = _validate(c, world)
        except ConfigError:
            continue
        mesh = valid.mesh
        assert sizes.estimate(lay) == estimate_memory(valid, mesh.dp, mesh.tp, mesh.pp, mesh.cp), lay


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8])
def test_zero_bubble_peak_stash_closed_forms_are_the_simulators(pp):
    """ZB-H1 stashes min(pp, m) chunk activations on every rank, ZB-V 2 min(pp, m): the search's
    memory estimate uses these instead of simulating schedules of many micro-batches."""
    for m in range(1, 3 * pp + 2):
        assert _peak_stash("zbh1", pp, m, 1) == simulate.timeline("zbh1", pp, m, 1).peak_stash
        assert _peak_stash("zbv", pp, m, 2) == simulate.timeline("zbv", pp, m, 2).peak_stash


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4),
                                         ("zbh1", 1), ("zbv", 0)])
def test_the_pipeline_bound_is_below_the_simulated_step(name, chunks):
    """`pipeline_bound` (work, fill and drain) never exceeds `pipeline_time`, whatever the depth,
    micro-batches (simulated, extrapolated or closed-form) and ratios of F, B, W and messages."""
    rng = random.Random(f"{name}{chunks}")
    for pp in (2, 3, 4, 8, 16):
        for m in sorted({1, pp - 1, pp, pp + 1, 2 * pp, 3 * pp + 1, 4 * pp, 8 * pp + 3} - {0}):
            if (name == "interleaved" and (m % pp or pp * chunks > 32)) or (name == "1f1b" and m < pp) \
                    or (name == "gpipe" and m >= pp) or (name == "zbv" and pp * m > 512):
                continue
            for _ in range(3):
                t_f = rng.uniform(0.01, 3)
                t_b = t_f * rng.uniform(0.2, 3)
                t_w = t_b * rng.uniform(0.05, 1.5) if name.startswith("zb") else 0.0
                t_msg = t_f * rng.choice([0.0, 1e-4, 0.02, 0.3, 1.0, 4.0])
                bound, exact = pipeline_bound(name, pp, m, chunks, t_f, t_b, t_msg, t_w)
                step = pipeline_time(name, pp, m, chunks, t_f, t_b, t_msg, t_w)
                assert bound == step if exact else bound <= step, (pp, m, t_f, t_b, t_msg, t_w)


ONE_T = {"n_layer": 128, "n_embd": 25600, "n_head": 160, "block_size": 2048, "vocab_size": 51200}


@pytest.mark.parametrize("world,batch", [(3072, 3072), (3072, None), (16384, 4096), (16384, None)])
def test_plans_for_a_trillion_parameters_on_thousands_of_ranks(world, batch):
    """The 1T row of Narayanan et al. (and its model on 16,384 GPUs), with and without a global
    batch (the config's: 36,864 and 196,608 sequences): `hpcpar plan`'s search answers (bench/plan.py
    times it)."""
    cfg = cfg_of(*(f"model.{k}={v}" for k, v in ONE_T.items()))
    plans, why = plan(cfg, world, dataclasses.replace(A100, ranks_per_node=8), top=5, global_batch=batch)
    assert len(plans) == 5 and len(why) == 8
    times = [p.step_time for p in plans]
    assert times == sorted(times)
    for p in plans:
        mesh = p.cfg.mesh
        assert mesh.dp * mesh.tp * mesh.pp * mesh.cp == world and p.memory_bytes <= A100.memory_bytes
        assert mesh.dp * p.cfg.train.micro_batch_size * p.cfg.train.microbatches == (batch or world // 2 * 24)
