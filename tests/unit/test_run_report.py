"""What a run tells its user and where: the MFU peak and its cap, the summary's lines, the plain
step lines of a batch job, the plot of a run that repeated steps, the run directory a fresh start
claims, and the run directory `hpcpar plan --out` writes."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from hpcpar import metrics
from hpcpar.cli import main
from hpcpar.config.load import load_config
from hpcpar.errors import ConfigError
from hpcpar.runtime.comm import Communicator
from hpcpar.training import mfu, plot, report, rundir


def test_gemm_rates_are_each_timing_and_the_measurement_keeps_the_best():
    calls = []

    def matmul(a, b):
        calls.append(a.shape)
        return a @ b
    rates = metrics.gemm_rates("float32", n=64, seconds=0.01, tries=4, matmul=matmul)
    assert len(rates) == 4 and all(r > 0 for r in rates) and len(calls) >= 5   # a warm-up, then >= 1 per timing
    assert metrics.measure_gemm_flops("float32", n=64, seconds=0.01) > 0


def test_mfu_over_the_peak_is_capped_with_one_warning(caplog):
    peak = mfu.Peak(100e9, "measured GEMM", "best of 5 timings at start-up", speak=True)
    assert peak.mfu(50e9) == pytest.approx(0.5)
    with caplog.at_level(logging.WARNING, logger="hpcpar"):
        assert peak.mfu(154.5e9) == 1.0 and peak.mfu(120e9) == 1.0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("MFU: the model computed 154.5 GFLOP/s, more than the "
                                                         "measured GEMM peak of 100.0 GFLOP/s")
    assert "MFU is capped at 100%" in warnings[0] and "run.mfu_peak" in warnings[0]
    assert peak.capped == 2
    assert peak.text() == "measured GEMM peak, 100.0 GFLOP/s (best of 5 timings at start-up)"
    assert mfu.Peak(0.0).mfu(1e9) == 0.0                  # no peak: MFU 0
    silent = mfu.Peak(1.0)                                # a caller's peak (calibrate's dummy) never speaks
    with caplog.at_level(logging.WARNING, logger="hpcpar"):
        assert silent.mfu(5.0) == 1.0
    assert len(caplog.records) == 1


class _Mesh:
    """A one-rank mesh for `job_peak`: the world and the node are this process."""

    def __init__(self):
        self.world = self.node_comm = Communicator.local()


def test_the_peak_comes_from_run_mfu_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCPAR_CALIBRATION", str(tmp_path / "none.json"))
    cfg = load_config(None, ["run.mfu_peak=h100"])
    h100 = mfu.job_peak(cfg, _Mesh())
    assert (h100.flops, h100.source) == (989e12, "h100 preset's")
    assert h100.text() == "h100 preset's peak, 989.0 TFLOP/s (989.0 TFLOP/s per rank x 1)"
    given = mfu.job_peak(load_config(None, ["run.mfu_peak=2.5e11"]), _Mesh())
    assert (given.flops, given.source) == (2.5e11, "given")
    monkeypatch.setattr(mfu, "measure_peak", lambda mesh, dtype: 123e9)
    measured = mfu.job_peak(load_config(None, []), _Mesh())          # auto without a calibration: measured
    assert (measured.flops, measured.source) == (123e9, "measured GEMM")


def test_auto_takes_a_higher_calibration_made_for_this_dtype_and_ranks_per_node(tmp_path, monkeypatch):
    from hpcpar.planner import hardware
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("HPCPAR_CALIBRATION", str(path))
    monkeypatch.setattr(mfu, "measure_peak", lambda mesh, dtype: 123e9)
    calibrated = dataclasses.replace(hardware.PRESETS["a100"], name="this", peak_flops=500e9, ranks_per_node=1,
                                     model={"dtype": "float32"})
    hardware.save_hardware(calibrated, str(path))
    peak = mfu.job_peak(load_config(None, []), _Mesh())
    assert (peak.flops, peak.source) == (500e9, "calibrated")
    assert peak.text() == f"calibrated peak, 500.0 GFLOP/s (hpcpar plan --calibrate, {path}; 123.0 GFLOP/s " \
                          "measured at start-up)"
    assert mfu.job_peak(load_config(None, ["run.mfu_peak=measure"]), _Mesh()).source == "measured GEMM"
    float64 = mfu.job_peak(load_config(None, ["model.dtype=float64"]), _Mesh())   # another dtype: measured
    assert float64.source == "measured GEMM"
    hardware.save_hardware(dataclasses.replace(calibrated, peak_flops=50e9), str(path))
    assert mfu.job_peak(load_config(None, []), _Mesh()).flops == 123e9   # lower than measured: the measurement
    hardware.save_hardware(dataclasses.replace(calibrated, ranks_per_node=4), str(path))   # 4 x 500e9 would win
    assert mfu.job_peak(load_config(None, []), _Mesh()).source == "measured GEMM"   # another rank count
    path.write_text("{not json")
    assert mfu.job_peak(load_config(None, []), _Mesh()).source == "measured GEMM"   # unreadable: measured


def summary(**changes) -> dict:
    """A summary.json as a 1-rank run of the default model writes it."""
    s = {"steps": 12, "tokens_per_s": 1000.0, "mfu": 0.25, "gemm_peak_flops": 1e11,
         "mfu_peak": "measured GEMM peak, 100.0 GFLOP/s (best of 5 timings at start-up)", "mfu_capped_steps": 0,
         "first_loss": 5.4, "final_loss": 4.1, "val_loss": None, "mesh": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
         "cp_impl": "ring", "zero": 0, "dp_replicate": 1, "schedule": "1f1b", "microbatches": 2,
         "pipeline_bubble_predicted": 0.0, "pipeline_bubble_measured": 0.01, "grad_compression": "none",
         "bytes_sent_per_step": 0.0, "grad_bytes_sent_per_step": 0.0, "grad_bytes_uncompressed_per_step": 0.0,
         "compression_ratio": 1.0, "precision": "full", "peak_memory_bytes_per_rank": [200 * 2**20],
         "estimated_memory_bytes_per_rank": None, "run_dir": "runs/x"}
    return {**s, **changes}


def test_the_summary_names_its_peak_and_leaves_out_what_a_run_did_not_have():
    one_rank = report.format_summary(summary())
    assert "MFU              25.0% of the measured GEMM peak, 100.0 GFLOP/s (best of 5 timings at start-up)" \
        in one_rank
    assert "pipeline bubble" not in one_rank and "bytes sent" not in one_rank   # pp=1, one rank: neither
    capped = report.format_summary(summary(mfu=1.0, mfu_capped_steps=3))
    assert "MFU              100.0% of the measured GEMM peak" in capped and "capped at 100% in 3 step(s)" in capped
    mib = 2**20
    piped = report.format_summary(summary(mesh={"dp": 1, "tp": 1, "pp": 2, "cp": 1}, bytes_sent_per_step=0.5 * mib))
    assert "pipeline bubble  0.0% predicted, 1.0% measured" in piped
    assert "bytes sent       0.50 MiB per rank per step (no gradient sync)" in piped
    synced = report.format_summary(summary(mesh={"dp": 2, "tp": 1, "pp": 1, "cp": 1}, bytes_sent_per_step=2 * mib,
                                           grad_bytes_sent_per_step=2 * mib))
    assert "bytes sent       2.00 MiB per rank per step for gradients; 2.00 MiB in all" in synced


def test_off_a_terminal_each_logged_step_is_a_plain_line(monkeypatch, caplog):
    monkeypatch.setattr(report, "on_terminal", lambda: False)
    out = report.StepLog(True, True, None, None, log_every=5, end=12, first=0)
    assert out.bar.bar is None and out.log_lines              # asked for a bar, but no terminal: lines
    with caplog.at_level(logging.INFO, logger="hpcpar"):
        for step in range(12):
            record = {"step": step, "loss": 5.0 - step / 10, "lr": 1e-3, "tokens_per_s": 12345.0, "mfu": 0.123}
            if step == 7:
                record["val_loss"] = 4.5
            out.write(record, 0.0, last=step == 11)
    out.close()
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" |")[0] for line in lines] == ["step     0 (1/12)", "step     5 (6/12)", "step     7 (8/12)",
                                                       "step    10 (11/12)", "step    11 (12/12)"]
    assert lines[1].startswith("step     5 (6/12) | loss 4.5000 | lr 1.00e-03 | 12,345 tok/s | MFU 12.3% | ")
    assert " | val 4.5000 | " in lines[2] and lines[-1].endswith(" left")
    assert not any("\r" in line for line in lines)


def test_plot_draws_the_later_line_of_a_repeated_step_and_names_the_unit(tmp_path):
    records = [{"step": s, "loss": 5.0 - s} for s in range(4)] + [{"step": s, "loss": 9.0 + s} for s in range(2, 6)]
    assert [(r["step"], r["loss"]) for r in plot.latest_per_step(records)] == \
        [(0, 5.0), (1, 4.0), (2, 11.0), (3, 12.0), (4, 13.0), (5, 14.0)]
    byte_run, bpe_run, bare = tmp_path / "bytes", tmp_path / "bpe", tmp_path / "bare"
    for run in (byte_run, bpe_run, bare):
        run.mkdir()
    (byte_run / "config.toml").write_text("[data]\nformat = \"bytes\"\n")
    (bpe_run / "config.toml").write_text("[data]\nformat = \"bin\"\n")
    assert plot.loss_unit([str(byte_run)]) == "byte"
    assert plot.loss_unit([str(byte_run), str(bpe_run)]) == "token"
    assert plot.loss_unit([str(bare)]) == "token"


def run_config(tmp_path, *overrides):
    return load_config(None, [f"run.dir={tmp_path / 'run'}", *overrides])


def test_a_fresh_start_never_overwrites_another_run(tmp_path, caplog):
    comm = Communicator.local()
    cfg = run_config(tmp_path)
    rundir.claim(cfg, comm)                                   # nothing there: claimed
    run = tmp_path / "run"
    (run / "checkpoints" / "step-0000300").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-0000300\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(300)))
    with pytest.raises(ConfigError) as refused:
        rundir.claim(cfg, comm)
    assert str(refused.value) == (
        f"run.dir {str(run)!r} already holds a run (metrics.jsonl with 300 line(s), checkpoints up to "
        f"{run / 'checkpoints' / 'step-0000300'}), and checkpoint.resume=\"\" would start a new one over it; "
        "continue that run with --set checkpoint.resume=auto, start this one in a new directory with --set "
        "run.dir=DIR, or replace it with --set run.overwrite=true")
    rundir.claim(run_config(tmp_path, "checkpoint.resume=auto"), comm)      # a resume continues there
    (run / "summary.json").write_text("{}")
    (run / "checkpoints" / ".tmp-step-0000400-x").mkdir()
    with caplog.at_level(logging.WARNING, logger="hpcpar"):
        rundir.claim(run_config(tmp_path, "run.overwrite=true"), comm)
    assert "run.overwrite=true: deleting the run that was in" in caplog.text
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"] and not list((run / "checkpoints").iterdir())
    (run / "metrics.jsonl").write_text("")
    rundir.claim(cfg, comm)                                   # an empty metrics.jsonl holds no run


def test_plan_out_trains_in_a_run_directory_of_its_own(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["plan", "--ranks", "4", "--hardware", "a100", "--top", "1"]
    assert main.main([*args, "--out", "plan.toml"]) == 0
    assert load_config("plan.toml").run.dir == "runs/plan"
    assert capsys.readouterr().out.rstrip().endswith("wrote plan.toml: hpcpar train plan.toml runs plan 1 on 4 "
                                                     "ranks, in run directory runs/plan")
    assert main.main([*args, "--set", "run.dir=runs/mine", "--out", "b.toml"]) == 0
    assert load_config("b.toml").run.dir == "runs/mine"                     # given: kept


def test_the_guide_names_every_file_a_run_directory_gets():
    """docs/user-guide.md's run-directory table: every file `hpcpar train` writes into run.dir."""
    import pathlib
    guide = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "user-guide.md").read_text()
    table = guide.split("directory (`run.dir`, default `runs/default`) receives:")[1].split("\n\n")[1]
    named = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert named == {*rundir.RUN_FILES, "config.toml", "ranks.json", "checkpoints/"}
