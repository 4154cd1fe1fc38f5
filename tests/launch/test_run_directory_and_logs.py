"""`hpcpar train` as a batch job runs it: a fresh start in another run's directory is refused and
leaves that run as it was, and the output off a terminal is plain lines (results on stdout,
warnings on stderr), with an MFU that never passes 100 %."""

from __future__ import annotations

import json
import sys

TINY = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16", "train.micro_batch_size=2",
        "train.warmup=0", "run.eval_every=0"]


def train(mpirun, run_dir, *overrides: str, n: int = 2):
    args = [sys.executable, "-m", "hpcpar", "train"]
    for item in [*TINY, f"run.dir={run_dir}", *overrides]:
        args += ["--set", item]
    job = mpirun(n, args, timeout=180)
    assert not job.timed_out, job.output[-3000:]
    return job


def test_a_fresh_start_in_another_runs_directory_is_refused(mpirun, tmp_path):
    run = tmp_path / "run"
    first = train(mpirun, run, "train.steps=3")
    assert first.returncode == 0, first.output[-3000:]
    before = {p.name: p.read_bytes() for p in (run / "metrics.jsonl", run / "config.toml", run / "summary.json")}
    again = train(mpirun, run, "train.steps=3", "train.lr=0.01")        # `hpcpar train` again, a new config
    errors = [line for line in again.stderr.splitlines() if line.startswith("hpcpar: error")]
    assert again.returncode == 2 and "Traceback" not in again.output, again.output[-3000:]
    assert errors == [f"hpcpar: error: run.dir {str(run)!r} already holds a run (metrics.jsonl with 3 line(s), "
                      f"checkpoints up to {run / 'checkpoints' / 'step-0000003'}), and checkpoint.resume=\"\" would "
                      "start a new one over it; continue that run with --set checkpoint.resume=auto, start this one "
                      "in a new directory with --set run.dir=DIR, or replace it with --set run.overwrite=true"], \
        again.output[-3000:]
    assert {name: (run / name).read_bytes() for name in before} == before     # the first run is as it was
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-0000003"]
    resumed = train(mpirun, run, "train.steps=5", "checkpoint.resume=auto")    # continuing it is fine
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3, 4]
    replaced = train(mpirun, run, "train.steps=2", "run.overwrite=true")
    assert replaced.returncode == 0, replaced.output[-3000:]
    assert "run.overwrite=true: deleting the run that was in" in replaced.stderr
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-0000002"]


def test_a_batch_job_gets_plain_lines_on_stdout_and_warnings_on_stderr(mpirun, tmp_path):
    """stdout and stderr are pipes here, as a Slurm or PBS output file is not a terminal: no progress
    bar though run.progress is on, a plain line every run.log_every steps and at the last, each
    message on a line of its own; a peak far too low (run.mfu_peak=1e6 FLOP/s per rank) caps MFU at
    100 % with one warning."""
    run = tmp_path / "run"
    job = train(mpirun, run, "train.steps=5", "train.warmup=5", "run.log_every=2", "checkpoint.every=2",
                "run.progress=true", "run.mfu_peak=1e6")
    assert job.returncode == 0, job.output[-3000:]
    assert "\r" not in job.stdout and "\r" not in job.stderr
    out = job.stdout.splitlines()
    steps = [line for line in out if line.startswith("step ")]
    assert [line.split(" |")[0] for line in steps] == ["step     0 (1/5)", "step     2 (3/5)", "step     4 (5/5)"], \
        job.stdout
    assert all(" | MFU 100.0% | " in line and " elapsed, " in line for line in steps), steps
    assert any(line.startswith("hpcpar ") and line.endswith("MFU against the given peak, 2.0 MFLOP/s (run.mfu_peak: "
                                                             "1.0 MFLOP/s per rank x 2)") for line in out), job.stdout
    assert sum(line.startswith("checkpoint: ") for line in out) == 3, job.stdout    # steps 2 and 4, and the end
    summary = out[out.index(next(line for line in out if line.startswith("── summary"))):]
    assert "MFU              100.0% of the given peak, 2.0 MFLOP/s (run.mfu_peak: 1.0 MFLOP/s per rank x 2); capped " \
        "at 100% in 5 step(s)" in summary, summary
    assert any(line.startswith("run directory    ") for line in summary)
    err = job.stderr.splitlines()
    assert sum("train.warmup" in line for line in err) == 1, job.stderr               # the doubt: a warning
    assert sum(line.startswith("MFU: the model computed ") for line in err) == 1, job.stderr
    assert not any(line.startswith(("step ", "── summary", "checkpoint: ")) for line in err), job.stderr
