"""`hpcpar train` as a user runs it: the loss curve does not depend on the mesh, and the run
directory holds what the README promises."""

import json
import sys

import numpy as np
import pytest

TINY = ["--set", "model.n_layer=2", "--set", "model.n_embd=32", "--set", "model.n_head=4",
        "--set", "model.block_size=32", "--set", "model.dtype=float64", "--set", "train.steps=6",
        "--set", "train.warmup=2", "--set", "train.micro_batch_size=4", "--set", "run.progress=false",
        "--set", "run.eval_every=3"]


def train(mpirun, n, run_dir, *extra):
    job = mpirun(n, [sys.executable, "-m", "hpcpar", "train", *TINY, "--set", f"run.dir={run_dir}", *extra],
                 timeout=180)
    assert job.returncode == 0, job.output[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f], job


def _sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


@pytest.mark.parametrize("n, mesh, same_global_batch", [
    (2, ["--set", "mesh.tp=2"], []),
    (2, ["--set", "mesh.tp=2", "--set", "mesh.sequence_parallel=true"], []),
    # 4 ranks: the default dp=2 x pp=2; one rank sees the same global batch as 4 micro-batches.
    (4, [], ["--set", "train.microbatches=4"]),
    # context parallelism with dropout (both runs): each design over 4 ranks, and ring cp=2 x dp=2.
    (4, ["--set", "mesh.cp=4", "--set", "model.dropout=0.1"], ["--set", "model.dropout=0.1"]),
    (4, ["--set", "mesh.cp=4", "--set", "mesh.cp_impl=ulysses", "--set", "model.dropout=0.1"],
     ["--set", "model.dropout=0.1"]),
    (4, ["--set", "mesh.cp=2", "--set", "mesh.dp=2", "--set", "model.dropout=0.1"],
     ["--set", "model.dropout=0.1", "--set", "train.microbatches=4"]),
    # ZeRO-3 (FSDP) over dp=4, and HSDP (2 replicas x 2 shards) with ZeRO-2, with dropout.
    (4, ["--set", "mesh.dp=4", "--set", "mesh.pp=1", "--set", "train.zero=3", "--set", "model.dropout=0.1"],
     ["--set", "model.dropout=0.1", "--set", "train.microbatches=8"]),
    (4, ["--set", "mesh.dp=2", "--set", "mesh.pp=2", "--set", "mesh.dp_replicate=2", "--set", "train.zero=2",
         "--set", "model.dropout=0.1"], ["--set", "model.dropout=0.1", "--set", "train.microbatches=4"]),
    # Zero-bubble schedules (backward split into B and W): pp=4 and pp=2 (with dp, tp), micro-batches
    # below, at, above and not a multiple of pp, with dropout; ZB-V's V needs 2 layers per rank.
    *[(n, ["--set", f"pipeline.schedule={name}", *_sets(mesh), "--set", f"train.microbatches={m}", *_sets(model)],
       ["--set", f"train.microbatches={m * dp}", *_sets(model)])
      for n, name, mesh, m, dp, model in [
          (4, "zbv", ["mesh.pp=4", "mesh.dp=1"], 3, 1, ["model.n_layer=8", "model.dropout=0.1"]),
          (4, "zbh1", ["mesh.pp=4", "mesh.dp=1"], 6, 1, ["model.n_layer=4"]),
          (4, "zbv", ["mesh.pp=2", "mesh.dp=2"], 5, 2, ["model.n_layer=4", "model.dropout=0.1"]),
          (4, "zbh1", ["mesh.pp=2", "mesh.tp=2", "mesh.dp=1"], 1, 1, ["model.dropout=0.1"]),
          (2, "zbv", ["mesh.pp=2", "mesh.dp=1"], 2, 1, ["model.n_layer=4"]),
          (4, "zbv", ["mesh.pp=4", "mesh.dp=1"], 4, 1, ["model.n_layer=8"]),
          (4, "zbh1", ["mesh.pp=2", "mesh.dp=2"], 3, 2, ["model.n_layer=4", "model.dropout=0.1"])]]])
def test_loss_curve_matches_the_one_rank_run(mpirun, tmp_path, n, mesh, same_global_batch):
    reference, _ = train(mpirun, 1, tmp_path / "one", *same_global_batch)
    parallel, job = train(mpirun, n, tmp_path / "many", *mesh)
    assert [r["step"] for r in parallel] == [r["step"] for r in reference] == list(range(6))
    for key in ("loss", "grad_norm", "val_loss"):
        ref = np.array([r.get(key, np.nan) for r in reference])
        got = np.array([r.get(key, np.nan) for r in parallel])
        np.testing.assert_allclose(got, ref, rtol=1e-10, equal_nan=True, err_msg=key)
    assert "── summary" in job.output


def test_recomputation_is_bitwise_none_through_the_cli(mpirun, tmp_path):
    """`hpcpar train` on tp=2 (sequence parallel) x pp=2 with dropout: recompute = full (every 2nd
    block) and selective give exactly the metrics of none on the same mesh, which match one rank."""
    common = ["--set", "model.dropout=0.1", "--set", "train.microbatches=4"]
    mesh = ["--set", "mesh.tp=2", "--set", "mesh.pp=2", "--set", "mesh.sequence_parallel=true"]
    reference, _ = train(mpirun, 1, tmp_path / "one", *common)
    runs = {mode: train(mpirun, 4, tmp_path / mode, *common, *mesh, "--set", f"train.recompute={mode}",
                        "--set", "train.recompute_every=2")[0]
            for mode in ("none", "full", "selective")}
    keys = ("loss", "grad_norm", "val_loss")
    for mode in ("full", "selective"):
        assert [[r.get(k) for k in keys] for r in runs[mode]] == [[r.get(k) for k in keys] for r in runs["none"]], mode
    for key in keys:
        np.testing.assert_allclose([r.get(key, np.nan) for r in runs["none"]],
                                   [r.get(key, np.nan) for r in reference], rtol=1e-10, equal_nan=True, err_msg=key)


def test_run_directory_contents(mpirun, tmp_path):
    _, job = train(mpirun, 4, tmp_path / "run", "--set", "pipeline.trace=true")
    run = tmp_path / "run"
    for name in ("config.toml", "metrics.jsonl", "summary.json", "trace.json", "ranks.json", "checkpoints/latest"):
        assert (run / name).exists(), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mesh"] == {"dp": 2, "tp": 1, "pp": 2, "cp": 1}
    assert len(summary["peak_memory_bytes_per_rank"]) == 4
    assert summary["final_loss"] < summary["first_loss"]
    assert 0.0 < summary["pipeline_bubble_predicted"] < 1.0


def test_sample_and_plot_from_a_run(mpirun, tmp_path):
    train(mpirun, 1, tmp_path / "run")
    job = mpirun(1, [sys.executable, "-m", "hpcpar", "sample", str(tmp_path / "run" / "checkpoints"),
                     "--prompt", "import ", "--tokens", "40"], timeout=120)
    assert job.returncode == 0, job.output
    assert job.stdout.startswith("import ") and len(job.stdout.strip()) > len("import ")
    pytest.importorskip("matplotlib")
    out = tmp_path / "loss.png"
    job = mpirun(1, [sys.executable, "-m", "hpcpar", "plot", str(tmp_path / "run"), "--out", str(out)],
                 timeout=120)
    assert job.returncode == 0, job.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sample_from_a_context_parallel_run(mpirun, tmp_path):
    """Context parallelism shards no weight: `hpcpar sample` on one rank reads a cp=2 checkpoint."""
    _, job = train(mpirun, 2, tmp_path / "run", "--set", "mesh.cp=2", "--set", "train.steps=2")
    assert "mesh             dp=1 x cp=2 (ring) x tp=1 x pp=1" in job.output
    job = mpirun(1, [sys.executable, "-m", "hpcpar", "sample", str(tmp_path / "run" / "checkpoints"),
                     "--prompt", "def ", "--tokens", "20"], timeout=120)
    assert job.returncode == 0, job.output
    assert job.stdout.startswith("def ") and len(job.stdout.strip()) > len("def ")


def test_fp16_run_reports_its_loss_scale_and_samples(mpirun, tmp_path):
    records, job = train(mpirun, 2, tmp_path / "run", *_sets(["train.precision=fp16", "train.loss_scale_window=2",
                                                            "mesh.pp=2"]))
    # The tiny model never overflows at these scales: the scale doubles every two clean steps.
    assert [r["loss_scale"] for r in records] == [65536.0 * 2 ** (i // 2) for i in range(6)]
    assert not any(r["overflow"] or r["skipped"] for r in records)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["precision"], summary["activation_dtype"]) == ("fp16", "float16")
    assert (summary["loss_scale"], summary["overflow_steps"]) == (65536.0 * 2 ** 3, 0)
    assert "precision        fp16: activations float16" in job.output
    sample = mpirun(1, [sys.executable, "-m", "hpcpar", "sample", str(tmp_path / "run" / "checkpoints"),
                        "--prompt", "import ", "--tokens", "10"], timeout=120)
    assert sample.returncode == 0 and sample.stdout.startswith("import "), sample.output


def test_mixture_of_experts_run(mpirun, tmp_path):
    """`hpcpar train` with experts divided over ep=2 of dp=4 ranks, a capacity factor that drops
    tokens and dropout: losses, gradient norms, validation losses and the routing metrics
    (aux loss, load, dropped fraction) equal one rank running the same 8 micro-batches; the
    progress log and the summary report the experts; `hpcpar plot` draws the expert load,
    `hpcpar sample` reads the ep=2 checkpoint on one rank and `ckpt export` (HF GPT-2) refuses it."""
    moe = ["--set", "model.moe_experts=4", "--set", "model.moe_capacity_factor=1.0", "--set", "model.dropout=0.1",
           "--set", "model.moe_z_loss=0.001", "--set", "run.log_every=1"]
    reference, _ = train(mpirun, 1, tmp_path / "one", *moe, "--set", "train.microbatches=8")
    parallel, job = train(mpirun, 4, tmp_path / "many", *moe, "--set", "mesh.dp=4", "--set", "mesh.pp=1",
                          "--set", "mesh.ep=2", "--set", "train.microbatches=2")
    for key in ("loss", "grad_norm", "val_loss", "moe_aux_loss", "moe_load_imbalance", "moe_dropped_fraction"):
        ref = np.array([r.get(key, np.nan) for r in reference])
        got = np.array([r.get(key, np.nan) for r in parallel])
        np.testing.assert_allclose(got, ref, rtol=1e-10, equal_nan=True, err_msg=key)
    assert all(len(r["moe_layer_imbalance"]) == 2 and r["moe_load_imbalance"] >= 1.0 for r in parallel)
    assert max(r["moe_dropped_fraction"] for r in parallel) > 0
    assert "| aux " in job.output and "| dropped " in job.output
    assert "experts          ep=2; last step: aux loss" in job.output
    summary = json.loads((tmp_path / "many" / "summary.json").read_text())
    assert summary["ep"] == 2 and summary["moe_dropped_fraction"] == parallel[-1]["moe_dropped_fraction"]
    job = mpirun(1, [sys.executable, "-m", "hpcpar", "sample", str(tmp_path / "many" / "checkpoints"),
                     "--prompt", "def ", "--tokens", "20"], timeout=120)
    assert job.returncode == 0, job.output
    assert job.stdout.startswith("def ") and len(job.stdout.strip()) > len("def ")
    job = mpirun(1, [sys.executable, "-m", "hpcpar", "ckpt", "export", str(tmp_path / "many" / "checkpoints"),
                     "--format", "safetensors", "--out", str(tmp_path / "hf")], timeout=120)
    assert job.returncode == 2 and "is a mixture-of-experts model" in job.stderr and "Traceback" not in job.stderr
    pytest.importorskip("matplotlib")
    out = tmp_path / "load.png"
    job = mpirun(1, [sys.executable, "-m", "hpcpar", "plot", str(tmp_path / "many"), "--out", str(out)], timeout=120)
    assert job.returncode == 0, job.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
