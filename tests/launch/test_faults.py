"""Fault injection under `mpiexec -n 4`: every fault ends in a fast, clear exit; no work is lost.

Each test runs `hpcpar train` (tiny float64 GPT, mesh dp=1 x tp=2 x pp=2) through DRIVER, a
script that monkeypatches hpcpar from the outside (no fault hooks live in production code):
  raise     rank FAULT_RANK raises at step FAULT_STEP          -> status != 0, its traceback
  sigkill   rank FAULT_RANK SIGKILLs itself at step FAULT_STEP -> every rank ends, no hang
  skip      rank FAULT_RANK skips the step's world all-gather  -> watchdog names it
  stall     rank FAULT_RANK sleeps in compute at step FAULT_STEP -> watchdog names it as stalled
  sigterm   rank FAULT_RANK gets SIGTERM during step FAULT_STEP -> checkpoint, status 75, exact resume
  killsave  rank FAULT_RANK dies while writing the 2nd checkpoint -> the 1st stays `latest`, intact
  nan       a NaN in one gradient at steps FAULT_STEPS         -> skipped steps, then an abort
Every job has a hard timeout; a hang shows up as `timed_out`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import time

import h5py
import numpy as np
import pytest

from hpcpar.checkpoint.directory import latest as latest_checkpoint
from hpcpar.checkpoint.format import INDEX
from hpcpar.checkpoint.tools import verify
from processes import alive

PY = sys.executable
NP = 4

DRIVER = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    from mpi4py import MPI
    from hpcpar.checkpoint import save as saving
    from hpcpar.cli import main as cli
    from hpcpar.training import trainer as train
    from hpcpar.parallel.dp.data_parallel import DataParallel

    fault = os.environ["FAULT"]
    rank = MPI.COMM_WORLD.Get_rank()
    target = int(os.environ.get("FAULT_RANK", "1"))
    at = int(os.environ.get("FAULT_STEP", "2"))
    nan_steps = {int(s) for s in os.environ.get("FAULT_STEPS", "").split(",") if s}
    current = {"step": -1, "trainer": None}
    train_step = train.Trainer.train_step

    def faulty_train_step(self, step):
        current["step"], current["trainer"] = step, self
        if rank == target and step == at:
            if fault == "raise":
                raise RuntimeError(f"injected fault at step {step}")
            if fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "stall":
                time.sleep(120)
            if fault == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)  # the handler sets a flag; the step goes on
        if fault == "nan" and step in nan_steps:  # compare the state around a poisoned step
            before = self.global_parameters()
            moments = self.dp.optimizer_step_count()
            result = train_step(self, step)
            after = self.global_parameters()
            same = all(np.array_equal(before[n], after[n]) for n in before)
            if rank == 0:
                print(f"NAN-STEP {step}: skipped={result.skipped} params_unchanged={same} "
                      f"optimizer_steps={moments}->{self.dp.optimizer_step_count()}", flush=True)
            return result
        return train_step(self, step)

    train.Trainer.train_step = faulty_train_step

    if fault == "nan":
        finish_backward = DataParallel.finish_backward

        def poisoned_finish_backward(self):
            finish_backward(self)
            if rank == target and current["step"] in nan_steps:
                params = current["trainer"].named_parameters
                name, p = next((n, p) for n, p in params if p.grad is not None)
                p.grad.flat[0] = np.nan
                print(f"POISONED {name} on rank {rank} at step {current['step']}", flush=True)
        DataParallel.finish_backward = poisoned_finish_backward

    if fault == "skip" and rank == target:
        gather, calls = train.Trainer._gather_step, {"n": 0}

        def skipping_gather(self, row):
            calls["n"] += 1
            if calls["n"] == at + 1:  # step `at`: this rank never joins the step's all-gather
                return np.tile(row, (self.mesh.world.size, 1))
            return gather(self, row)
        train.Trainer._gather_step = skipping_gather

    if fault == "killsave" and rank == target:
        write, saves = saving.write_rank_file, {"n": 0}

        def dying_write(path, items):
            saves["n"] += 1
            if saves["n"] == 2:  # half a rank file of the second checkpoint, then death
                with open(path, "wb") as f:
                    f.write(b"\\x89HDF\\r\\n\\x1a\\n" + bytes(1000))
                os.kill(os.getpid(), signal.SIGKILL)
            return write(path, items)
        saving.write_rank_file = dying_write

    sys.exit(cli.main(["train", *sys.argv[1:]]))
""")

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16", "model.dtype=float64",
        "train.micro_batch_size=2", "train.microbatches=2", "train.warmup=0", "train.lr=0.01",
        "mesh.dp=1", "mesh.tp=2", "mesh.pp=2", "run.progress=false", "run.eval_every=0", "run.log_every=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    rng = np.random.default_rng(0)
    path.write_bytes(rng.integers(32, 127, size=20_000, dtype=np.uint8).tobytes())
    return str(path)


@pytest.fixture
def train(mpirun, tmp_path, corpus):
    """train(fault, run_dir, *overrides, timeout=90, **env) -> Job for `hpcpar train` with a fault."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)

    def run(fault: str, run_dir, *overrides: str, timeout: float = 90, **env: str):
        args = [PY, str(driver)]
        for item in [*TINY, f"data.corpus={corpus}", f"run.dir={run_dir}", *overrides]:
            args += ["--set", item]
        return mpirun(NP, args, timeout=timeout, env={"FAULT": fault, **env})
    return run


def losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def tensors(ckpt: str) -> dict[str, np.ndarray]:
    with h5py.File(os.path.join(ckpt, INDEX), "r") as f:
        out = {}
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


def test_an_exception_on_one_rank_ends_the_job_naming_it(train, tmp_path):
    job = train("raise", tmp_path / "run", "train.steps=6", FAULT_RANK="1", FAULT_STEP="2")
    assert not job.timed_out and job.elapsed < 60, job.output
    assert job.returncode != 0
    assert "[rank 1] RuntimeError: injected fault at step 2" in job.stderr, job.output
    assert "[rank 1] Traceback (most recent call last):" in job.stderr, job.output


def test_a_rank_killed_with_sigkill_ends_the_job(train, tmp_path):
    # What "the job ends" means, whatever the launcher prints about it (MPICH's hydra and Open
    # MPI's mpiexec word it differently): a failing status soon after the kill, no rank trained
    # to the end, and not one rank process left running. ranks.json maps each rank to its PID.
    run = tmp_path / "run"
    job = train("sigkill", run, "train.steps=6", FAULT_RANK="2", FAULT_STEP="2")
    assert not job.timed_out and job.elapsed < 60, job.output
    assert job.returncode != 0, job.output
    with open(run / "ranks.json") as f:
        pids = {int(r): v["pid"] for r, v in json.load(f).items()}
    assert sorted(pids) == list(range(NP)), pids
    assert all(s < 2 for s in losses(run)), job.output  # step 2 never finished on the pipeline
    assert not (run / "summary.json").exists()
    deadline = time.monotonic() + 10  # a rank being killed may take a moment to exit on a busy machine
    while (survivors := [r for r, pid in pids.items() if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not survivors, f"ranks {survivors} outlived the job\n{job.output}"


# Blocking ops wait in MPI's blocking calls or poll (waiting.mpi_waits_block: polling where ranks share
# cores); either way a timeout gives one report and an abort.
WAIT_MODES = pytest.mark.parametrize("wait", ["block", "poll"])


@WAIT_MODES
def test_a_rank_that_skips_a_collective_is_named_by_the_watchdog(train, tmp_path, wait):
    job = train("skip", tmp_path / "run", "train.steps=6", "run.timeout=3", FAULT_RANK="3", FAULT_STEP="2",
                HPCPAR_MPI_WAIT=wait)
    assert not job.timed_out and job.elapsed < 60, job.output
    assert job.returncode != 0
    assert job.output.count("CommTimeout: all_gather on communicator 'world'") == 1, job.output
    never = job.stderr.split("Never arrived at world#")[1].split("Last ops of each rank")[0]
    assert "rank 3: waiting in" in never, job.output  # it went on and waits for something else
    assert all(f"rank {r}:" not in never for r in (0, 1, 2))
    assert "hpcpar watchdog: aborting the job" in job.stderr


@WAIT_MODES
def test_a_rank_stalled_in_compute_is_named_by_the_watchdog(train, tmp_path, wait):
    job = train("stall", tmp_path / "run", "train.steps=6", "run.timeout=3", FAULT_RANK="2", FAULT_STEP="2",
                HPCPAR_MPI_WAIT=wait)
    assert not job.timed_out and job.elapsed < 60, job.output
    assert job.returncode != 0
    assert job.output.count("CommTimeout: ") == 1, job.output
    # Whoever reports (a rank waiting in a collective or in a recv), rank 2 is the one it names.
    named = job.stderr.split("CommTimeout: ")[1].split("Last ops of each rank")[0]
    # "rank 2 (<host>): ..." once the watchdog knows every rank's host (it does after install()).
    assert re.search(r"rank 2(?: \([^)]*\))?: stalled outside communication \(compute or I/O\)", named), job.output
    assert not re.search(r"rank [013](?: \([^)]*\))?: stalled", named)


@pytest.mark.parametrize("compression", ["none", "powersgd"])  # PowerSGD: residuals and Q saved on preemption
def test_sigterm_mid_step_checkpoints_exits_75_and_resumes_exactly(train, tmp_path, compression):
    kind = f"train.grad_compression={compression}"
    straight = train("none", tmp_path / "straight", "train.steps=6", kind)
    assert straight.returncode == 0, straight.output
    run = tmp_path / "preempted"
    marker = tmp_path / "requeue-marker"  # the job scripts' fallback for a launcher that loses the 75
    job = train("sigterm", run, "train.steps=6", kind, FAULT_RANK="1", FAULT_STEP="2",
                HPCPAR_REQUEUE_MARKER=str(marker))
    assert not job.timed_out and job.returncode == 75, job.output
    assert marker.read_text() == "75\n" and straight.returncode == 0
    assert "preemption signal received: saving a checkpoint at step 3" in job.output
    assert job.output.count("preemption signal received") == 1, job.output  # every rank agreed; rank 0 says so
    assert latest_checkpoint(str(run / "checkpoints")).endswith("step-0000003")
    resumed = train("none", run, "train.steps=6", "checkpoint.resume=auto", kind)
    assert resumed.returncode == 0 and "resumed from" in resumed.output, resumed.output
    expected, got = losses(tmp_path / "straight"), losses(run)
    assert sorted(got) == list(range(6)) and got == expected  # bitwise: the same float64 losses
    a = tensors(latest_checkpoint(str(tmp_path / "straight" / "checkpoints")))
    b = tensors(latest_checkpoint(str(run / "checkpoints")))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_resuming_a_finished_run_trains_nothing_and_rewrites_nothing(train, tmp_path):
    run = tmp_path / "run"
    assert train("none", run, "train.steps=3").returncode == 0
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name not in ("config.toml", "ranks.json")}
    again = train("none", run, "train.steps=3", "checkpoint.resume=auto")
    assert again.returncode == 0, again.output
    assert again.output.count("the checkpoint is at step 3 and train.steps=3: nothing to train") == 1, again.output
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name not in ("config.toml", "ranks.json")}
    assert after == before  # summary.json, metrics.jsonl and the checkpoint as the finished run left them
    # (config.toml and ranks.json describe the latest launch)


def test_resume_auto_with_a_dangling_latest_takes_the_newest_checkpoint(train, tmp_path):
    run = tmp_path / "run"
    assert train("none", run, "train.steps=3").returncode == 0
    (run / "checkpoints" / "latest").write_text("step-0009999\n")  # names a checkpoint deleted by hand
    again = train("none", run, "train.steps=4", "checkpoint.resume=auto")
    assert again.returncode == 0, again.output
    assert again.output.count("latest names 'step-0009999', which is not a checkpoint; resuming from the newest "
                              "checkpoint there, step-0000003") == 1, again.output
    assert "at step 3" in again.output and sorted(losses(run)) == [0, 1, 2, 3]  # went on, not from step 0


def test_sigkill_mid_save_keeps_the_previous_checkpoint(train, tmp_path):
    run = tmp_path / "run"
    job = train("killsave", run, "train.steps=6", "checkpoint.every=2", FAULT_RANK="1")
    assert not job.timed_out and job.elapsed < 60 and job.returncode != 0, job.output
    latest = latest_checkpoint(str(run / "checkpoints"))
    assert latest is not None and latest.endswith("step-0000002"), os.listdir(run / "checkpoints")
    assert verify(latest) == []
    resumed = train("none", run, "train.steps=4", "checkpoint.resume=auto")
    assert resumed.returncode == 0 and "resumed from" in resumed.output and "at step 2" in resumed.output


def test_a_nan_gradient_skips_the_step_without_touching_the_state(train, tmp_path):
    job = train("nan", tmp_path / "run", "train.steps=5", FAULT_RANK="2", FAULT_STEPS="2")
    assert not job.timed_out and job.returncode == 0, job.output
    poisoned = next(line for line in job.stdout.splitlines() if line.startswith("POISONED"))
    name = poisoned.split()[1]
    assert (f"step 2: non-finite gradient norm (first bad parameter gradient: {name}); "
            "step skipped (1/3)") in job.output, job.output
    assert "NAN-STEP 2: skipped=True params_unchanged=True" in job.stdout
    steps = job.stdout.split("NAN-STEP 2: ")[1].split()[2]
    before, after = steps.removeprefix("optimizer_steps=").split("->")
    assert before == after  # no optimizer step: moments and step count untouched
    assert [s for s, _ in sorted(losses(tmp_path / "run").items())] == [0, 1, 2, 3, 4]


def test_consecutive_nan_steps_abort_naming_the_parameter(train, tmp_path):
    job = train("nan", tmp_path / "run", "train.steps=8", "train.max_bad_steps=2", FAULT_RANK="2",
                FAULT_STEPS="2,3")
    assert not job.timed_out and job.returncode == 2, job.output
    name = next(line for line in job.stdout.splitlines() if line.startswith("POISONED")).split()[1]
    assert job.stderr.count("hpcpar: error: 2 consecutive steps with a non-finite loss or gradient "
                            f"(last: step 3, first bad parameter: {name})") == 1, job.output
    assert "Traceback" not in job.output


def test_debug_mode_names_the_rank_whose_collectives_diverge(mpirun, tmp_path):
    script = tmp_path / "diverge.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        from mpi4py import MPI
        from hpcpar.runtime import failure, watchdog
        from hpcpar.runtime.comm import Communicator
        failure.install()
        watchdog.set_check_every(2)
        comm = Communicator(MPI.COMM_WORLD.Dup(), "dp")
        for i in range(2):
            comm.all_reduce(np.ones(4))
        comm.barrier()
        comm.all_reduce(np.ones(5 if comm.rank == 1 else 4))  # checked before it is issued
        print("not reached", flush=True)
    """))
    job = mpirun(NP, [PY, str(script)], timeout=60)
    assert not job.timed_out and job.returncode != 0, job.output
    assert "not reached" not in job.stdout
    assert ("OpSequenceMismatch: the ranks of communicator 'dp' issued different collectives; the first "
            "that differs is collective 2 since the last check: rank 0: #3 all_reduce float64[4]; "
            "rank 1: #3 all_reduce float64[5];") in job.stderr, job.output
