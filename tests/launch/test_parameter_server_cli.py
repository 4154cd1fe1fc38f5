"""Parameter-server training through `hpcpar train`, as a user runs it (ps.servers > 0).

- Synchronous (ps.staleness = 0) gives the one-rank loss curve in float64 to 1e-10: 2, 3 and 4
  worker replicas with 1 and 2 servers, workers with tp=2 and with pp=2 (1F1B), with dropout and
  clipping (a small train.grad_clip, so every step clips).
- A synchronous run resumed from its step-3 checkpoint equals the uninterrupted run bitwise; the
  same checkpoint loads into dp=4 all-reduce training, which goes on with the same losses.
- The run summary names the servers and their ranges.
"""

import json
import sys
import time

import numpy as np
import pytest

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.block_size=32", "model.dtype=float64",
        "train.steps=6", "train.warmup=2", "train.micro_batch_size=2", "train.microbatches=2", "run.progress=false",
        "run.eval_every=3", "model.dropout=0.1", "train.grad_clip=0.1"]


def _sets(overrides) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def train(mpirun, n, run_dir, *overrides):
    job = mpirun(n, [sys.executable, "-m", "hpcpar", "train", *_sets(TINY), "--set", f"run.dir={run_dir}",
                     *_sets(overrides)], timeout=240)
    assert job.returncode == 0, job.output[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f], job


_REFERENCES: dict = {}


def reference(mpirun, tmp_path_factory, replicas: int) -> list[dict]:
    """The one-rank run of the same global batch (replicas x the micro-batches), once per size."""
    if replicas not in _REFERENCES:
        run = tmp_path_factory.mktemp(f"one-{replicas}")
        _REFERENCES[replicas] = train(mpirun, 1, run, f"train.microbatches={2 * replicas}")[0]
    return _REFERENCES[replicas]


def assert_same_curve(got: list[dict], want: list[dict], rtol: float) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(6))
    for key in ("loss", "grad_norm", "val_loss"):
        np.testing.assert_allclose([r.get(key, np.nan) for r in got], [r.get(key, np.nan) for r in want],
                                   rtol=rtol, equal_nan=True, err_msg=key)


@pytest.mark.parametrize("n, servers, mesh, replicas", [
    (3, 1, ["mesh.dp=2"], 2),
    (4, 1, ["mesh.dp=3"], 3),
    (5, 1, ["mesh.dp=4"], 4),
    (4, 2, ["mesh.dp=2"], 2),
    (6, 2, ["mesh.dp=4"], 4),
    (5, 1, ["mesh.dp=2", "mesh.tp=2"], 2),
    (6, 2, ["mesh.dp=2", "mesh.pp=2", "pipeline.schedule=1f1b"], 2),
])
def test_synchronous_ps_matches_one_rank(mpirun, tmp_path, tmp_path_factory, n, servers, mesh, replicas):
    got, job = train(mpirun, n, tmp_path / "ps", f"ps.servers={servers}", *mesh)
    assert_same_curve(got, reference(mpirun, tmp_path_factory, replicas), rtol=1e-10)
    assert all(r["staleness"] == 0 for r in got)
    summary = json.loads((tmp_path / "ps" / "summary.json").read_text())
    ps = summary["ps"]
    assert [s["rank"] for s in ps["servers"]] == list(range(n - servers, n))
    assert ps["servers"][0]["range"][0] == 0 and ps["staleness_max"] == 0
    assert ps["pushes_applied"] == 6 * replicas
    assert "parameter server" in job.output


def test_resume_is_bitwise_and_loads_into_all_reduce(mpirun, tmp_path):
    whole, _ = train(mpirun, 4, tmp_path / "whole", "ps.servers=2", "mesh.dp=2", "train.microbatches=4",
                     "checkpoint.every=3")
    step3 = tmp_path / "whole" / "checkpoints" / "step-0000003"
    assert step3.is_dir()
    resumed, _ = train(mpirun, 4, tmp_path / "resumed", "ps.servers=2", "mesh.dp=2", "train.microbatches=4",
                       f"checkpoint.resume={step3}")
    keys = ("step", "loss", "grad_norm", "val_loss")
    assert [[r.get(k) for k in keys] for r in resumed] == [[r.get(k) for k in keys] for r in whole[3:]]
    # The same global batch on dp=4 all-reduce (2 micro-batches each): the same losses.
    allreduce, _ = train(mpirun, 4, tmp_path / "allreduce", "mesh.dp=4", "mesh.pp=1",
                         f"checkpoint.resume={step3}")
    for key in ("loss", "grad_norm", "val_loss"):
        np.testing.assert_allclose([r.get(key, np.nan) for r in allreduce], [r.get(key, np.nan) for r in whole[3:]],
                                   rtol=1e-10, equal_nan=True, err_msg=key)


def test_info_shows_the_servers_and_their_ranges(mpirun):
    job = mpirun(3, [sys.executable, "-m", "hpcpar", "info", "--servers", "2", "--set", "model.n_layer=2"], timeout=120)
    assert job.returncode == 0, job.output
    assert "mesh: pp=1 x dp=1 x tp=1 on ranks 0..0" in job.output
    assert "parameter servers: 2 (ranks 1..2)" in job.output
    assert "server 0 (rank 1): [0, " in job.output and "server 1 (rank 2): [" in job.output


DRIVER = """
import os, signal, sys, time
from mpi4py import MPI
from hpcpar.cli import main as cli
from hpcpar.training import trainer as train
from hpcpar.parallel.ps.server import ParameterServer

train_step = train.Trainer.train_step

def signalled_step(self, step):
    if os.environ["FAULT"] == "sigterm" and MPI.COMM_WORLD.Get_rank() == 1 and step == 2:
        os.kill(os.getpid(), signal.SIGTERM)   # the handler sets a flag; the step goes on
    return train_step(self, step)

train.Trainer.train_step = signalled_step

step = ParameterServer._step
count = {"n": 0}

def faulty(self, grad, lr):
    count["n"] += 1
    if count["n"] == 3 and os.environ["FAULT"] in ("sigkill", "stall"):
        if os.environ["FAULT"] == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    return step(self, grad, lr)

ParameterServer._step = faulty
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("fault", ["sigkill", "stall"])
def test_a_dead_or_stalled_server_ends_the_job(mpirun, tmp_path, fault):
    """The server (rank 3 of 4) dies (SIGKILL) or stalls in its third update: every rank ends within
    the watchdog timeout; the start-up line and ranks.json say which rank is the server."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    started = time.monotonic()
    job = mpirun(4, [sys.executable, str(driver), "train", *_sets(TINY), "--set", f"run.dir={tmp_path / 'run'}",
                     "--set", "ps.servers=1", "--set", "mesh.dp=3", "--set", "run.timeout=10",
                     "--set", "train.steps=20"], timeout=150, env={"FAULT": fault})
    assert job.returncode != 0 and time.monotonic() - started < 120, job.output[-2000:]
    ranks = json.loads((tmp_path / "run" / "ranks.json").read_text())
    assert ranks["3"]["role"] == "server" and ranks["0"]["role"] == "worker"
    assert "3:" in job.output and "(s)" in job.output   # the start-up line marks the server
    if fault == "stall":
        assert "workers+servers" in job.output and "waited" in job.output, job.output[-2000:]


def test_sigterm_saves_requeues_and_resumes_exactly(mpirun, tmp_path):
    """A worker signalled during step 2 (synchronous, 1 server): every rank stops after that step with
    status 75 and a checkpoint of step 3; resumed, the run ends with the uninterrupted run's metrics, bitwise."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    whole, _ = train(mpirun, 4, tmp_path / "whole", "ps.servers=1", "mesh.dp=3")
    args = [sys.executable, str(driver), "train", *_sets(TINY), "--set", f"run.dir={tmp_path / 'cut'}",
            "--set", "ps.servers=1", "--set", "mesh.dp=3", "--set", "checkpoint.resume=auto"]
    job = mpirun(4, args, timeout=180, env={"FAULT": "sigterm"})
    assert job.returncode == 75, job.output[-2000:]
    assert (tmp_path / "cut" / "checkpoints" / "step-0000003").is_dir()
    job = mpirun(4, args, timeout=180, env={"FAULT": "none"})
    assert job.returncode == 0, job.output[-2000:]
    with open(tmp_path / "cut" / "metrics.jsonl") as f:
        cut = [json.loads(line) for line in f]
    keys = ("step", "loss", "grad_norm", "val_loss")
    assert [[r.get(k) for k in keys] for r in cut] == [[r.get(k) for k in keys] for r in whole]
