"""bench/run_all.py's report: key figures and docs/benchmarks.md from sample results JSON (no timing)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


@pytest.fixture(scope="module")
def run_all():
    spec = importlib.util.spec_from_file_location("bench_run_all", ROOT / "bench" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def allreduce_row(nbytes: int, hpcpar_us: float, raw_us: float) -> dict:
    def impl(us: float) -> dict:
        return {"time_us": us, "algbw_GBps": nbytes / us / 1e3, "busbw_GBps": 1.5 * nbytes / us / 1e3}
    return {"op": "all_reduce", "bytes": nbytes, "iters": 10, "hpcpar": impl(hpcpar_us), "raw": impl(raw_us),
            "raw_nb": impl(raw_us * 1.25), "ratio": raw_us / hpcpar_us, "ratio_nb": 1.25 * raw_us / hpcpar_us}


def mesh_row(mesh: str, ranks: int, tokens_per_s: float, baseline: float, cores: int = 2) -> dict:
    speedup = tokens_per_s / baseline
    return {"mesh": mesh, "ranks": ranks, "oversubscribed": ranks > cores, "tokens_per_s": tokens_per_s,
            "speedup": speedup, "efficiency": speedup / ranks, "efficiency_cores": speedup / min(ranks, cores),
            "cpu_speedup": 1.1 * speedup}


def compression_row(kind: str, ef: bool, nbytes: float, formula: float, loss: float, step_s: float = 0.5) -> dict:
    none_bytes, none_loss, none_s = 4.8 * MiB, 2.0, 0.5
    return {"kind": kind, "error_feedback": ef, "params": 840_000, "bytes_per_step": nbytes, "formula_bytes": formula,
            "formula_error": nbytes / formula - 1, "ratio_to_none": nbytes / none_bytes, "final_loss": loss,
            "ratio": 0.01, "rank": 4,
            "loss_vs_none": loss / none_loss - 1, "step_s": step_s, "step_time_vs_none": step_s / none_s}


SAMPLES = {
    "allreduce": {"meta": {"ranks": 4}, "rows": [allreduce_row(8, 80.0, 20.0), allreduce_row(MiB, 400.0, 300.0),
                                                 allreduce_row(64 * MiB, 5e4, 4.5e4)]},
    "gemm": {"n=2": {"ranks": 2, "cores": 2, "peak_gflops": 40.0, "sizes": [
        {"m": 64, "k": 64, "n": 256, "column_gemm_fraction_of_peak": 0.9, "row_gemm_fraction_of_peak": 0.8,
         "column_fraction_of_peak": 0.3, "row_fraction_of_peak": 0.45, "column_speedup": 0.7,
         "row_speedup": 1.2}]}},
    "pipeline": {"tolerance": 0.1, "cases": [
        {"schedule": "1f1b", "pp": 4, "chunks": 1, "microbatches": m, "predicted_s": p, "measured_s": p * (1 + e),
         "error": e, "predicted_bubble": 0.3, "measured_bubble": 0.35, "t_forward": 0.1, "t_backward": 0.1,
         "t_weight": 0.1, "measured_peak_stash": 4.0}
        for m, p, e in ((4, 1.0, 0.02), (8, 2.0, -0.03), (16, 3.0, 0.15))],
        "against_1f1b": [{"schedule": "zbh1", "microbatches": 8, "idle_ratio": 0.36, "predicted_idle_ratio": 1 / 3,
                          "step_idle_ratio": 0.38, "bubble_fraction_ratio": 0.45, "step_time_ratio": 0.82,
                          "peak_stash": 4.0, "peak_stash_1f1b": 4.0, "bound": 0.4, "ok": True},
                         {"schedule": "zbv", "microbatches": 8, "idle_ratio": 0.25, "predicted_idle_ratio": 1 / 6,
                          "step_idle_ratio": 0.3, "bubble_fraction_ratio": 0.33, "step_time_ratio": 0.8,
                          "peak_stash": 4.0, "peak_stash_1f1b": 4.0, "bound": 0.2, "ok": False}]},
    "pipeline_gpt": {"ranks": 4, "model": ["model.n_layer=8"], "meshes": [
        {"mesh": "pp4", "dp": 1, "pp": 4, "rows": [
            {"schedule": s, "chunks": c, "step_s": t, "tokens_per_s": 2048 / t, "tokens_per_s_vs_1f1b": 1.0 / t,
             "pipeline_bubble": b, "check_s": 0.001, "check_fraction": 0.001 / t, "check_with_wait_s": 0.02,
             "loss_rel_diff_vs_1f1b": 0.0}
            for s, c, t, b in (("1f1b", 1, 1.0, 0.3), ("zbh1", 1, 0.8, 0.1), ("zbv", 2, 0.8, 0.05))]}]},
    "checkpoint": {"ranks=4": {"ranks": 4, "bytes": 64 * MiB, "repeats": 3,
                               "gb_per_s": {"hpcpar save": 0.5, "numpy save": 2.0, "hpcpar load": 1.0,
                                            "numpy load": 4.0},
                               "ratio_vs_numpy": {"save": 0.25, "load": 0.25, "load resharded": 0.2}}},
    "scaling": {"rows": [{"dp": 1, "speedup": 1.0, "efficiency": 1.0, "cpu_speedup": 1.0, "hidden_fraction": None},
                         {"dp": 2, "speedup": 1.8, "efficiency": 0.9, "cpu_speedup": 1.9,
                          "hidden_fraction": 0.6}]},
    "mesh_scaling": {
        "meta": {"n_layer": 4, "n_embd": 128, "block_size": 64, "microbatches": 4, "global_batch": 16,
                 "rank_batch": 16, "repeats": 2, "steps": 4, "cores": 2,
                 "note": "the machine has 2 cores: 4-rank runs are oversubscribed"},
        "baseline_tokens_per_s": 1000.0,
        "strong": [mesh_row("1x1x1", 1, 1000.0, 1000.0), mesh_row("dp=2", 2, 1600.0, 1000.0),
                   mesh_row("tp=2", 2, 1200.0, 1000.0), mesh_row("dp=2xpp=2", 4, 1700.0, 1000.0),
                   {"mesh": "tp=4", "ranks": 4, "oversubscribed": True, "error": "exit status 1"}],
        "weak": [mesh_row("1x1x1", 1, 1000.0, 1000.0), mesh_row("dp=2", 2, 1900.0, 1000.0),
                 mesh_row("tp=2", 2, 1100.0, 1000.0), mesh_row("dp=2xpp=2", 4, 1500.0, 1000.0),
                 {"mesh": "tp=4", "ranks": 4, "oversubscribed": True, "error": "exit status 1"}],
        "torch": None, "torch_note": "torch is not installed"},
    "context": {
        "meta": {"ranks": 4, "seq": 2048, "batch": 1, "n_embd": 64, "n_head": 4, "n_layer": 2, "dtype": "float32",
                 "limit_bytes": 64 * MiB},
        "attention": [{"design": d, "k": k, "saved_bytes_per_rank": b, "work_max_over_mean": w,
                       "saved_x_k_over_reference": 1.0}
                      for d, k, b, w in (("ring", 1, 64 * MiB, 1.0), ("ring", 4, MiB // 2, 1.0),
                                         ("ulysses", 4, 16 * MiB, 1.0), ("tp+sp", 4, 16 * MiB, 1.0))],
        "naive": [{"design": "ring", "k": 4, "saved_bytes_per_rank": MiB // 2, "work_max_over_mean": 1.749}],
        "bytes": [{"design": d, "k": 4, "bytes_sent_per_layer": b, "formula_bytes": b}
                  for d, b in (("ring", 2560 * 1024), ("ulysses", 768 * 1024), ("tp+sp", 3074 * 1024))],
        "throughput": [{"design": d, "tokens_per_s": t} for d, t in (("ring", 15000.0), ("ulysses", 7000.0),
                                                                      ("tp+sp", 7100.0))],
        "longest": [{"cp": cp, "block_size": t, "estimate_bytes": 60 * MiB, "measured_peak_bytes": 58 * MiB}
                    for cp, t in ((1, 1664), (2, 4352), (4, 8704))],
        "checks": {"activations_proportional_to_1_over_k_within_10pct": True, "measured_peak_within_limit": True}},
    "memory": {
        "meta": {"generated_s": 10.0},
        "activations": {
            "config": {"batch": 2, "seq": 512, "n_embd": 128, "n_head": 4, "n_layer": 3, "dropout": 0.1,
                       "dtype": "float32", "repeats": 8},
            "rows": [{"recompute": m, "measured_bytes_per_layer": b * 1.001, "formula_bytes_per_layer": b,
                      "ratio": 1.001, "saved_vs_none": 1 - b / (22 * MiB), "estimate_bytes_per_layer": e,
                      "backward_peak_above_held_bytes": p, "step_time_vs_none": t}
                     for m, b, e, p, t in (("none", 22 * MiB, 34 * MiB, 13 * MiB, 1.0),
                                           ("full", MiB // 2, MiB // 2, 36 * MiB, 1.33),
                                           ("selective", 14 * MiB, 10 * MiB, 21 * MiB, 1.17))]},
        "model_state": {
            "model": {"layers": 4, "embd": 128, "heads": 4, "block": 64, "batch": 2, "dtype": "float32",
                      "optimizer": "adamw"},
            "rows": [{"zero": z, "n": 4, "params": 830_000, "measured": m, "formula": f,
                      "formula_bytes_per_param": e, "unit_bytes_per_param": u, "error": m / e - 1}
                     for z, m, f, e, u in ((0, 16.02, "4 + 4 + 8", 16.0, 0.0), (1, 10.0, "4 + 4 + 8/N", 10.0, 0.0),
                                           (2, 7.0, "4 + 12/N", 7.0, 0.0), (3, 4.95, "16/N + unit", 4.95, 0.95))],
            "within_10_percent": True,
            "fit": {"limit_bytes": 45.6 * MiB, "params": {"small": 830_000, "big": 3_240_000}, "param_ratio": 3.9,
                    "estimates": {"small_zero0": 19 * MiB, "big_zero0": 60.5 * MiB, "big_zero3": 41.5 * MiB},
                    "big_zero3_peak_bytes": 42.4 * MiB}},
        "checks": {"activations: none within 10% of its formula": True,
                   "model_state: zero=3 within 10% of its formula": True}},
    "plan": {"median_abs_error": 0.12, "spearman": 0.9, "first_choice_gap": 0.02, "plans_that_fit": 500,
             "rows": [{"layout": "dp=4 tp=1 pp=1", "predicted_s": 0.9, "measured_s": 1.0},
                      {"layout": "dp=1 tp=4 pp=1", "predicted_s": 1.7, "measured_s": 1.5}],
             "narayanan": [{"params_b": 1.7, "gpus": 32, "tp": 1, "pp": 1, "dp": 32, "batch": 512,
                            "published_tflops": 137, "predicted_tflops": 150.7, "ratio": 1.1}]},
    "compression": {
        "meta": {"ranks": 4, "steps": 300, "time_steps": 6, "rounds": 2, "wide_embd": 384, "ratio": 0.01, "rank": 4,
                 "alpha_us": 10.0, "global_sequences": 48, "shared_memory_gbps": 3.4, "warm_up": 100,
                 "meet_ratio": [0.1], "meet_rank": [8, 16]},
        "loss": [compression_row(k, ef, nbytes, formula, loss) for k, ef, nbytes, formula, loss in (
            ("none", True, 4.8 * MiB, 4.8 * MiB, 2.0), ("int8", True, 1.22 * MiB, 1.2 * MiB, 2.01),
            ("topk", False, 0.2 * MiB, 0.2 * MiB, 2.2))] + [
            {**compression_row("topk", True, 0.2 * MiB, 0.2 * MiB, 2.1), "start_step": 100}],
        "default": [compression_row(k, True, nbytes, nbytes, 2.0, step_s) for k, nbytes, step_s in (
            ("none", 4.8 * MiB, 0.5), ("int8", 1.2 * MiB, 0.6))],
        "wide": [compression_row(k, True, nbytes, nbytes, 2.0, 2.0) for k, nbytes in (("none", 40 * MiB),
                                                                                      ("int8", 10 * MiB))],
        "where_it_pays": {model: [{"kind": "none", "predicted_step_s": {"1": 0.54, "10": 0.504, "100": 0.5},
                                   "crossover_gbps": None},
                                  {"kind": "int8", "predicted_step_s": {"1": 0.61, "10": 0.601, "100": 0.6},
                                   "crossover_gbps": 0.29 if model == "default" else "any"}]
                          for model in ("default", "wide")}},
    "zero": {"ratio_zero3_over_zero1": 0.95, "hidden_fraction": 0.3,
             "best": {"dp": 4, "zero1": {"tokens_per_s": 7000.0, "gather_wait_s": 0.0},
                      "zero3": {"tokens_per_s": 6650.0, "gather_wait_s": 0.07},
                      "zero3_no_prefetch": {"tokens_per_s": 6000.0, "gather_wait_s": 0.1}}},
    "step_overhead": {"model": {"n_layer": 4, "n_embd": 64, "block_size": 64, "batch": 2, "microbatches": 4,
                                "dtype": "float32", "dropout": 0.1},
                      "rows": [{"mesh": "dp2xtp2-sp", "speedup": 1.25, "loss_rel_diff": 1e-8,
                                "before": {"step_s": 0.05, "ops_per_step": {"world": {"all_reduce": 2, "all_gather": 2},
                                                                            "tp": {"all_reduce": 112, "all_gather": 84},
                                                                            "dp": {"all_reduce": 1}}},
                                "after": {"step_s": 0.04, "ops_per_step": {"world": {"all_gather": 1},
                                                                           "tp": {"all_reduce": 9, "all_gather": 80},
                                                                           "dp": {"all_reduce": 1}}}}]},
}


def machine(load: float = 3.0) -> dict:
    return {"cpu": "Test CPU", "cores": 2, "virtual_machine": True, "os": "Linux", "python": "3.11",
            "mpi": "MPICH Version: 5.0.2", "mpi4py": "4.1", "numpy": "2.0", "h5py": "3.0", "torch": None,
            "date": "2025-01-01T00:00:00+00:00", "load_average_start": [load, load, load],
            "load_average_end": [load, load, load], "note": ""}


@pytest.fixture()
def summary(run_all, tmp_path):
    for name, data in SAMPLES.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    entries = {name: {"command": f"python bench/{name}.py", "status": "ok", "wall_s": 1.0,
                      "started": "2025-01-01T00:00:00+00:00", "load_average_before": [3.0, 3.0, 3.0]}
               for name in SAMPLES}
    entries["vs_torch"] = {"command": "python bench/vs_torch.py", "returncode": None,
                           "status": "skipped: PyTorch is not installed (pip install torch)"}
    return run_all.collect(tmp_path, machine(), entries, quick=False)


def test_key_figures_computed_from_the_json(run_all):
    allreduce = " ".join(run_all.key_figures("allreduce", SAMPLES["allreduce"]))
    assert "0.75 at 1 MiB" in allreduce and "0.90 at 64 MiB" in allreduce
    assert "80.0 µs vs 20.0 µs" in allreduce
    gemm = " ".join(run_all.key_figures("gemm", SAMPLES["gemm"], 2))
    assert "peak 40.0 GFLOP/s" in gemm and "column 0.30, row 0.45" in gemm
    pipeline = " ".join(run_all.key_figures("pipeline", SAMPLES["pipeline"]))
    assert "-3.0% … +15.0%" in pipeline and "2/3 within 10%" in pipeline
    assert "e.g. 1f1b m=8" in pipeline
    assert "zbh1 m=8: bubble 0.36x 1F1B's (bound 0.4, predicted 0.33x), peak stash 4 vs 4: ok" in pipeline
    assert "zbv m=8: bubble 0.25x 1F1B's (bound 0.2, predicted 0.17x), peak stash 4 vs 4: MISSED" in pipeline
    gpt = run_all.key_figures("pipeline_gpt", SAMPLES["pipeline_gpt"])
    assert gpt == ["pp4: 1f1b 2,048 tok/s (1.00x), zbh1 2,560 tok/s (1.25x), zbv 2,560 tok/s (1.25x)"]
    checkpoint = " ".join(run_all.key_figures("checkpoint", SAMPLES["checkpoint"], 4))
    assert "save 0.50 GB/s vs numpy 2.00 GB/s (0.25x)" in checkpoint
    scaling = " ".join(run_all.key_figures("scaling", SAMPLES["scaling"]))
    assert "1.80x tokens/s (efficiency 90%)" in scaling and "60%" in scaling
    mesh = run_all.key_figures("mesh_scaling", SAMPLES["mesh_scaling"])
    assert mesh[0].startswith("strong tokens/s vs 1x1x1: 2 ranks: dp=2 1.60x, tp=2 1.20x; best dp=2 (1.76x per CPU-s)")
    assert "4 ranks*: dp=2xpp=2 1.70x; best dp=2xpp=2" in mesh[0] and "failed: tp=4" in mesh[0]
    assert "PyTorch peer skipped: torch is not installed" in mesh
    context = run_all.key_figures("context", SAMPLES["context"])
    assert context[0] == ("T=2048, k=4: attention activations per rank ring 0.50 MiB, ulysses 16.00 MiB, "
                          "tp+sp 16.00 MiB (x k constant within 10%: yes)")
    assert "ring 2560 KiB (formula 2560)" in context[1]
    assert "zigzag 1.000, contiguous split 1.749 ((2cp-1)/cp = 1.750)" in context[2]
    assert context[3] == "tokens/s: ring 15,000, ulysses 7,000, tp+sp 7,100"
    assert "cp=1 1664, cp=2 4352, cp=4 8704; measured peak within the limit: yes" in context[4]
    memory = run_all.key_figures("memory", SAMPLES["memory"])
    assert memory[0].endswith("measured / formula MiB: none 22.02 / 22.00, full 0.50 / 0.50, "
                              "selective 14.01 / 14.00")
    assert memory[1] == "forward + backward time vs none: full 1.33x, selective 1.17x"
    assert "zero=1 10.00 (10.00)" in memory[2]
    assert "3.24M params (3.9x the 0.83M plain DP fits) refused by zero=0, trains under zero=3" in memory[3]
    assert memory[4] == "every figure within 10% of its formula: yes"
    plan = run_all.key_figures("plan", SAMPLES["plan"])
    assert plan[0] == ("4 ranks, 2 meshes: median |predicted - measured| / measured 12% (goal <= 15 %), "
                       "Spearman 0.90 (goal >= 0.8), first choice +2% from the fastest (goal <= 5 %)")
    assert plan[1].startswith("Narayanan et al. table, A100 preset: predicted TFLOP/s per GPU within 10%")
    compression = run_all.key_figures("compression", SAMPLES["compression"])
    assert compression[0] == ("bytes/step/rank vs none, default model, dp=4: int8 0.250x; every measurement within "
                              "1.7% of its formula")
    assert compression[1] == ("final loss vs none after 300 steps: int8 +0.5%, topk 0.01 (no EF) +10.0%, "
                              "topk 0.01 (warm-up 100) +5.0%")
    assert compression[2] == ("link speed below which each wins (Gb/s): int8 0.29; this machine's shared memory: "
                              "3.4 Gb/s")
    zero = run_all.key_figures("zero", SAMPLES["zero"])
    assert zero[0].startswith("zero=3 / zero=1 tokens/s on 4 ranks: 0.95x") and "30% hidden" in zero[1]
    overhead = run_all.key_figures("step_overhead", SAMPLES["step_overhead"])
    assert overhead == ["dp2xtp2-sp: step 50.0 -> 40.0 ms (1.25x); world collectives/step 4 -> 1; "
                        "tp all-reduces/step 112 -> 9"]


def test_malformed_results_are_reported_not_raised(run_all):
    assert run_all.key_figures("scaling", {"rows": []})[0].startswith("results not in the expected form")


def test_markdown_table(run_all, summary):
    text = run_all.render_markdown(summary)
    table = [line for line in text.splitlines() if line.startswith("| ") and "benchmark" not in line]
    main = table[:len(run_all.BENCHMARKS)]
    assert [row.split(" | ")[0][2:] for row in main] == [b.name for b in run_all.BENCHMARKS]
    # Every row of the main table has its five cells (escaped pipes inside cells do not count).
    assert all(row.replace("\\|", "").count("|") == 6 for row in main)
    vs_torch = next(row for row in main if row.startswith("| vs_torch |"))
    assert "skipped: PyTorch is not installed" in vs_torch
    assert "`python bench/allreduce.py`" in main[0]
    assert "Test CPU" in text and "MPICH Version: 5.0.2" in text and "PyTorch not installed" in text
    assert "the machine was shared with other work" in text and "load average 3.0 on 2 cores" in text
    assert "| dp=2xpp=2 | 4\\* | 1,700 | 1.70x | 42% (85%) | 1.87x | 1,500 | 1.50x | 38% (75%) | 1.65x |" in text
    assert "| tp=4 | 4\\* | failed | – | – | – | failed | – | – | – |" in text
    assert "PyTorch peer skipped: torch is not installed." in text
    assert "| 1f1b | 1 | 16 | 3.000 | 3.450 | +15.0% | 30.0% | 35.0% | 4 |" in text
    assert "| zbv | 8 | 0.25 | 0.17 | 0.2 | 0.30 | 0.33 | 0.80 | 4 (4) | no |" in text
    assert "## Pipeline schedules training a GPT" in text
    assert "| pp4 | zbh1 | 1 | 0.800 | 2,560 | 1.25x | 10.0% | 1.00 (0.12%) | 20.00 | 0.0e+00 |" in text
    assert "## Context parallelism" in text and "| ring (contiguous) | 4 | 0.500 | – | 1.749 | – | – |" in text
    assert "| 4 | 8704 | 60.0 | 58.0 |" in text
    assert "## Memory" in text and "| selective | 14.014 | 14.000 | 1.001 | 36.4% | 10.000 | 21.00 | 1.17x |" in text
    assert "| 3 | 16/N + unit | 4.95 | 4.95 | 0.95 | +0.0% |" in text
    assert "## Plan" in text and "| dp=1 tp=4 pp=1 | 1700.0 | 1500.0 | 13% |" in text
    assert "| 1.7B | 32 | 1 | 1 | 32 | 512 | 137 | 150.7 | 1.10 |" in text
    assert "## Gradient compression" in text
    assert "| topk 0.01 (no EF) | 0.200 | 0.200 | +0.0% | 0.042x | 2.2000 | +10.00% |" in text
    assert "top-k ratio 0.1, PowerSGD rank 8, 16." in text
    assert "Within 3 % of none with error feedback (the loss criterion): int8; not: topk 0.01 (warm-up 100)." in text
    assert "| wide | int8 | 610 | 601 | 600 | any |" in text
    assert "## Per-step overhead" in text and "| dp2xtp2-sp | after | 40.00 | 1 | 9 | 80 | 1 | 1.0e-08 |" in text


def test_quiet_machine_and_missing_results(run_all, tmp_path):
    summary = run_all.collect(tmp_path, machine(load=0.1), {}, quick=True)
    text = run_all.render_markdown(summary)
    assert "shared with other work" not in text
    assert "quick run" in text
    assert all(e["figures"] == ["no results"] for e in summary["benchmarks"].values())
    assert "## Mesh scaling" not in text


def test_commands_are_shown_as_typed(run_all, tmp_path):
    bench = run_all.BY_NAME["allreduce"]
    argv = run_all.command(bench, quick=True, out=run_all.DEFAULT_RESULTS / "allreduce.json")
    shown = run_all.display(argv)
    assert shown == ("OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 mpiexec -n 4 python bench/allreduce.py "
                     "--max-bytes 1M --budget 0.1 --rounds 2")
    elsewhere = run_all.display(run_all.command(run_all.BY_NAME["scaling"], quick=False, out=tmp_path / "s.json"))
    assert elsewhere.endswith(f"python bench/scaling.py --steps 12 --repeats 4 --out {tmp_path / 's.json'}")


def test_report_only_rebuilds_the_page_from_the_json(run_all, tmp_path):
    for name, data in SAMPLES.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "summary.json").write_text(json.dumps({"machine": machine(), "benchmarks": {
        "gemm": {"command": "mpiexec -n 2 python bench/gemm.py", "status": "ok", "figures": ["stale"]}}}))
    page = tmp_path / "benchmarks.md"
    assert run_all.main(["--report-only", "--results-dir", str(tmp_path), "--docs", str(page)]) == 0
    text = page.read_text()
    assert "Test CPU" in text and "`mpiexec -n 2 python bench/gemm.py`" in text and "stale" not in text
    assert "0.75 at 1 MiB" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["benchmarks"]["vs_torch"]["figures"] == ["no results"]
