"""Training through a lost rank or node on the emulated cluster (hpcpar/training/resilience.py).

With ULFM (Open MPI 5 from PyPI, `mpirun --with-ft ulfm`: the interpreter HPCPAR_ULFM_PYTHON names,
a venv with `pip install -e .[ulfm,test]`), `run.on_failure = "shrink"`: a rank, a node, a node in
the middle of a partner exchange, two nodes that hold each other's copies. In each case the
survivors go on, and their losses from the rollback step r on equal a run restored at step r from
the run's own checkpoint on the smaller mesh (float64, 1e-12). Without ULFM (the MPICH wheel under
hydra) the job ends, and the requeued run resumes from the partner snapshots on the nodes' own
/tmp, later than the last checkpoint. Failures are `run.debug_fail_at`: the ranks SIGKILL
themselves at the start of a step (or right after starting a partner exchange).
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from conftest import PY, hydra_mpiexec, losses, run, train_args

STEPS = 12
BASE = ["checkpoint.memory_every=2", "train.microbatches=2", "run.timeout=20", "checkpoint.keep=20"]


def ulfm_python() -> str:
    python = os.environ.get("HPCPAR_ULFM_PYTHON", "")
    if not python or not pathlib.Path(python).exists():
        pytest.skip("HPCPAR_ULFM_PYTHON is not set (a venv with `pip install -e .[ulfm,test]`: Open MPI 5's mpirun)")
    return python


def _folder(cluster, tmp_path) -> pathlib.Path:
    """A folder every node sees (each node's /tmp is its own)."""
    folder = cluster.shared / tmp_path.name
    folder.mkdir(exist_ok=True)
    return folder


def _survive(cluster, tmp_path, corpus, nodes: list[str], rpn: int, mesh: list[str], fail: str, *extra: str):
    """Run STEPS steps on `nodes` x `rpn` ranks under ULFM with `fail`; returns (run dir, the failure event)."""
    python = ulfm_python()
    run_dir = _folder(cluster, tmp_path) / "run"
    args = train_args(python, run_dir, STEPS, corpus, *BASE, *mesh, "run.on_failure=shrink",
                      f"run.debug_fail_at={fail}", *extra)
    argv = cluster.ulfm(args, str(pathlib.Path(python).parent / "mpirun"), nodes=nodes, ranks_per_node=rpn,
                        env={"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
                             "PYTHONFAULTHANDLER": "1"})
    job = run(argv, timeout=240)
    out = job.stdout + job.stderr
    assert not job.timed_out, f"the survivors hung:\n{out[-4000:]}"
    assert (run_dir / "summary.json").exists(), f"no summary:\n{out[-4000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())  # mpirun exits 1 after any failure
    assert summary["steps"] == STEPS and len(summary["failures"]) == 1, out[-4000:]
    return run_dir, summary["failures"][0], out


def _reference(tmp_path, corpus, run_dir, step: int, ranks: int, mesh: list[str]) -> dict[int, float]:
    """Losses of a run restored at `step` from `run_dir`'s own checkpoint, on `ranks` ranks of one host."""
    ref = tmp_path / "reference"
    args = train_args(PY, ref, STEPS, corpus, *BASE, *mesh,
                      f"checkpoint.resume={run_dir / 'checkpoints' / f'step-{step:07d}'}")
    job = run([hydra_mpiexec(), "-n", str(ranks), *args], timeout=240)
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    return losses(ref)


def _same_from(step: int, got: dict[int, float], want: dict[int, float]) -> None:
    later = [s for s in want if s >= step]
    assert later and all(abs(got[s] - want[s]) <= 1e-12 * abs(want[s]) for s in later), \
        f"from step {step}: {[(s, got.get(s), want[s]) for s in later]}"


TWO_BY_TWO = ["mesh.dp=2", "mesh.tp=2", "checkpoint.every=2"]
AFTER = ["mesh.dp=1", "mesh.tp=2", "train.microbatches=4"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fail, lost", [("3@7", [3]), ("2,3@7", [2, 3]), ("2,3@6/exchange", [2, 3])],
                         ids=["one-rank", "a-node", "a-node-during-the-exchange"])
def test_the_survivors_go_on_from_the_last_complete_partner_snapshot(cluster, tmp_path, corpus, fail, lost):
    """dp=2 x tp=2 on two nodes, snapshots of steps 2, 4, 6: the replica that lost a rank leaves,
    the other rolls back to the newest step every rank's snapshot survived and goes on as dp=1 x
    tp=2 with the same global batch; its losses equal a restore at that step from the checkpoint on
    disk. That step is 6 when the lost ranks' last copies reached node0, 4 when they died with them
    still on the wire (their send completes before the bytes leave: which one is timing; step 4's
    pair is kept until every rank is known to hold step 6's, so one of the two always survives)."""
    run_dir, event, out = _survive(cluster, tmp_path, corpus, ["node0", "node1"], 2, TWO_BY_TWO, fail)
    rollback = event["rollback_to"]
    assert rollback in (4, 6) and event["lost_ranks"] == lost, event
    assert event["source"] == "partner snapshots in memory" and event["mesh"].startswith("dp=1 x tp=2"), event
    assert f"roll back to the partner snapshots of step {rollback}" in out
    _same_from(rollback, losses(run_dir), _reference(tmp_path, corpus, run_dir, rollback, 2, AFTER))


@pytest.mark.timeout(600)
def test_losing_two_nodes_that_hold_each_others_copies_falls_back_to_disk(cluster, tmp_path, corpus):
    """Three nodes of one rank (dp=3): node1's copy lives on node2 and node2's on node0. Losing node1
    and node2 loses node1's every copy: the survivor says so and goes on from the checkpoint of
    step 4 as dp=1, with the losses of a restore from it."""
    run_dir, event, out = _survive(cluster, tmp_path, corpus, ["node0", "node1", "node2"], 1,
                                   ["mesh.dp=3", "checkpoint.every=4"], "1,2@7")
    assert event["rollback_to"] is None and event["source"].startswith("checkpoint ") and \
        event["source"].endswith("step-0000004"), event
    assert "every in-memory copy of rank(s) [1]" in out and "falling back to the checkpoint on disk" in out, out[-3000:]
    _same_from(4, losses(run_dir), _reference(tmp_path, corpus, run_dir, 4, 1, ["mesh.dp=1", "train.microbatches=6"]))


@pytest.mark.timeout(600)
def test_without_ulfm_a_requeued_run_resumes_from_the_node_local_copies(cluster, tmp_path, corpus):
    """Hydra (MPICH: no ULFM): node1 dies at step 7 and the job ends. The snapshots of step 6 sit
    in each node's own /tmp (node0: ranks 0-1 and its copies of 2-3; node1 the others); the
    requeued run finds a complete set there, newer than the checkpoint of step 4, and resumes at
    step 6 with the losses of a run never interrupted."""
    run_dir = _folder(cluster, tmp_path) / "run"
    keys = [*BASE, "mesh.dp=2", "mesh.tp=2", "checkpoint.every=4", "checkpoint.memory_dir=/tmp/hpcpar-memory",
            "checkpoint.resume=auto"]
    first = run(cluster.hydra(train_args(PY, run_dir, STEPS, corpus, *keys, "run.debug_fail_at=2,3@7"),
                              hydra_mpiexec(), nodes=["node0", "node1"], ranks_per_node=2), timeout=240)
    assert first.returncode != 0 and not first.timed_out, (first.stdout + first.stderr)[-3000:]
    second = run(cluster.hydra(train_args(PY, run_dir, STEPS, corpus, *keys), hydra_mpiexec(),
                               nodes=["node0", "node1"], ranks_per_node=2), timeout=240)
    out = second.stdout + second.stderr
    assert second.returncode == 0 and "resumed from the partner snapshots of step 6" in out, out[-3000:]
    assert "2 step(s) after the last checkpoint" in out, out[-3000:]
    reference = tmp_path / "reference"
    straight = run([hydra_mpiexec(), "-n", "4",
                    *train_args(PY, reference, STEPS, corpus, *BASE, "mesh.dp=2", "mesh.tp=2")], timeout=240)
    assert straight.returncode == 0, (straight.stdout + straight.stderr)[-3000:]
    _same_from(6, losses(run_dir), losses(reference))
