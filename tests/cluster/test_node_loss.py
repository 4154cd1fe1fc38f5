"""A node lost in the middle of a run: the job ends within the watchdog's timeout naming the node
and its ranks, no process is left behind on any node, the last checkpoint verifies, and an elastic
resume on the node that is left continues the loss curve of a run that was never interrupted.

Two ways to lose node1 of a 2-node x 2-rank run (mesh dp=2 x tp=2) under hydra:
- killed: its ranks get SIGKILL (a crash, the OOM killer). The launcher sees them die and ends
  the job at once, naming the node ("RUNNING AT node1").
- cut off: its link goes down (a dead switch port, a node that froze). Nothing dies and no socket
  closes: the ranks on node0 wait in a collective until the watchdog's timeout, and its report
  names node1 and ranks 2-3 as lost; node1's ranks, cut off as well, time out on their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from conftest import PY, hydra_mpiexec, losses, run, train_args
from hpcpar.checkpoint.directory import latest
from hpcpar.checkpoint.tools import verify

STEPS = 400
FAULT_AFTER = 25  # steps logged before node1 is lost (checkpoints every 10)
TIMEOUT_S = 10    # run.timeout: the watchdog's limit on a collective
MESH = ["mesh.dp=2", "mesh.tp=2"]


def _processes(cluster, node: str) -> list[int]:
    return [int(p) for p in subprocess.run(["ip", "netns", "pids", cluster.netns(node)], capture_output=True,
                                           text=True).stdout.split()]


def _ranks(cluster, node: str) -> list[int]:
    """The hpcpar ranks running on `node` (not the launcher's daemons)."""
    found = []
    for pid in _processes(cluster, node):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except FileNotFoundError:
            continue
        if b"hpcpar" in command and b"hydra_pmi_proxy" not in command and not command.startswith(b"/bin/sh"):
            found.append(pid)
    return found


def _wait_for_steps(run_dir, count: int, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the job ended before the fault:\n{proc.stdout.read()[-3000:]}{proc.stderr.read()[-3000:]}")
        if (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= count:
            return
        time.sleep(0.1)
    pytest.fail(f"{count} steps not logged within {timeout} s")


@pytest.fixture(scope="module")
def reference(cluster, corpus):
    """The uninterrupted run's losses (one host, the same mesh)."""
    run_dir = cluster.shared / "loss-reference"
    job = run([hydra_mpiexec(), "-n", "4", *train_args(PY, run_dir, STEPS, corpus, *MESH)], timeout=300)
    assert job.returncode == 0, job.output[-3000:]
    return losses(run_dir)


@pytest.mark.parametrize("how", ["killed", "cut off"])
def test_a_lost_node_ends_the_job_named_and_the_run_resumes_on_the_node_left(cluster, corpus, reference, how):
    mpiexec = hydra_mpiexec()
    run_dir = cluster.shared / f"loss-{how.replace(' ', '-')}"
    argv = cluster.hydra(train_args(PY, run_dir, STEPS, corpus, *MESH, "checkpoint.every=10",
                                    f"run.timeout={TIMEOUT_S}"), mpiexec, ["node0", "node1"])
    env = dict(os.environ, **__import__("conftest").ENV)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _wait_for_steps(run_dir, FAULT_AFTER, proc)
        lost_at = time.monotonic()
        if how == "killed":
            for pid in _ranks(cluster, "node1"):
                os.kill(pid, signal.SIGKILL)
        else:
            cluster.link("node1", up=False)
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {TIMEOUT_S + 30} s of losing node1 (a hang)")
        ended = time.monotonic() - lost_at
        # No rank is left: node0's at once, node1's (cut off, it learns nothing) after its own
        # timeout and abort (watchdog.abort_job ends a rank whose MPI_Abort cannot reach the launcher).
        deadline = time.monotonic() + 2 * TIMEOUT_S + 20
        while (_ranks(cluster, "node0") or _ranks(cluster, "node1")) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = {n: _ranks(cluster, n) for n in ("node0", "node1")}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        cluster.link("node1", up=True)
    # The launcher's daemon on node1 ends once its link is back (it learns that mpiexec is gone).
    deadline = time.monotonic() + 30
    while _processes(cluster, "node1") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _processes(cluster, "node1"), "hydra's proxy outlived the job on node1"
    output = out + err
    assert proc.returncode != 0, output[-3000:]
    assert ended < TIMEOUT_S + 15, f"ended {ended:.1f} s after node1 was lost\n{output[-3000:]}"
    assert not any(left.values()), f"processes outlived the job: {left}"
    if how == "killed":
        assert "RUNNING AT node1" in output, output[-3000:]
    else:
        assert ("Node node1 (ranks 2-3): none of its ranks answered; the node is lost" in output), output[-4000:]
        assert "Traceback" not in output, output[-4000:]
    assert "ranks (rank:pid@host): 0:" in output and "2:" in output  # rank -> node, printed at start-up

    checkpoint = latest(run_dir / "checkpoints")
    assert checkpoint is not None and verify(checkpoint) == [], checkpoint
    saved = int(os.path.basename(checkpoint).split("-")[1])
    # checkpoint-N holds the state after steps 0..N-1; step N-1's record is written before it, and the
    # loss may come at once after, so step N itself need not be logged.
    assert 10 <= saved <= max(losses(run_dir)) + 1

    # Elastic resume on node0 alone: 2 ranks, every mesh degree auto, the checkpoint's global batch.
    resumed = run(cluster.hydra(train_args(PY, run_dir, STEPS, corpus, "checkpoint.resume=auto"), mpiexec,
                                ["node0"]), timeout=300)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"resumed from {checkpoint} at step {saved}" in resumed.output, resumed.output[-3000:]
    got = losses(run_dir)
    assert sorted(got) == list(range(STEPS))
    after = {s: loss for s, loss in got.items() if s >= saved}
    assert after == pytest.approx({s: reference[s] for s in after}, rel=1e-10, abs=0)
