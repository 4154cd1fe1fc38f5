"""Checkpoints on a cluster's two kinds of storage, loaded on another set of nodes.

- shared: `checkpoint.dir` on storage every node sees (here `cluster.shared`);
- node-local: `checkpoint.dir` under /tmp, each node's own disk. `checkpoint.location = "auto"`
  probes which it is at start-up; a node-local save leaves a full copy on every node that took
  part (replicated over MPI), and a resume copies the checkpoint to nodes that lack it.

Each run trains 2 nodes x 2 ranks (mesh dp=2 x tp=2) for STEPS steps, saving every SAVE_EVERY;
the resumes load the middle checkpoint on other nodes, in another number of ranks (mesh auto:
elastic resume keeps the global batch) or another layout, and must continue the loss curve.
"""

from __future__ import annotations

import filecmp
import os

import pytest

from conftest import PY, hydra_mpiexec, losses, run, train_args
from hpcpar.checkpoint.tools import verify

STEPS, SAVE_EVERY = 20, 10
MIDDLE = f"step-{SAVE_EVERY:07d}"
# Resumes: on one node (2 ranks, mesh auto: dp=2 x tp=1, the same global batch), and on two
# other nodes in another layout (a pipeline instead of tp).
RESHAPED = ("mesh.dp=2", "mesh.pp=2")


def _train(cluster, run_dir, nodes, *extra, ranks_per_node=None):
    job = run(cluster.hydra(train_args(PY, run_dir, STEPS, cluster.shared / "corpus.txt", *extra), hydra_mpiexec(),
                            nodes, ranks_per_node), timeout=300)
    assert job.returncode == 0 and not job.timed_out, job.output[-4000:]
    return job


def _continues(first: dict, resumed: dict) -> None:
    assert sorted(resumed) == list(range(SAVE_EVERY, STEPS))
    assert resumed == pytest.approx({s: first[s] for s in resumed}, rel=1e-10, abs=0)


def test_shared_storage_checkpoint_resumes_on_another_node_count(cluster, corpus):
    ckpt = cluster.shared / "ckpt-shared"
    first = cluster.shared / "shared-first"
    job = _train(cluster, first, ["node0", "node1"], "mesh.dp=2", "mesh.tp=2", f"checkpoint.dir={ckpt}",
                 f"checkpoint.every={SAVE_EVERY}")
    assert "checkpoint storage: shared" in job.output, job.output[-3000:]
    assert verify(str(ckpt / MIDDLE)) == []
    for nodes, mesh in ((["node2"], ()), (["node1", "node2"], RESHAPED)):
        again = cluster.shared / f"shared-resumed-{len(nodes)}"
        resumed = _train(cluster, again, nodes, f"checkpoint.dir={ckpt}", f"checkpoint.resume={ckpt / MIDDLE}",
                         "checkpoint.every=0", *mesh)
        assert f"resumed from {ckpt / MIDDLE} at step {SAVE_EVERY}" in resumed.output, resumed.output[-3000:]
        _continues(losses(first), losses(again))


def test_node_local_checkpoints_are_on_every_node_and_resume_where_they_never_were(cluster, corpus):
    ckpt = "/tmp/ckpt-local"  # each node's own /tmp
    first = cluster.shared / "local-first"
    job = _train(cluster, first, ["node0", "node1"], "mesh.dp=2", "mesh.tp=2", f"checkpoint.dir={ckpt}",
                 f"checkpoint.every={SAVE_EVERY}")
    assert "checkpoint storage: node-local" in job.output, job.output[-3000:]
    copies = {node: cluster.node_tmp(node) / "ckpt-local" for node in ("node0", "node1")}
    assert not (cluster.node_tmp("node2") / "ckpt-local").exists()  # not part of the job
    for step in (MIDDLE, f"step-{STEPS:07d}"):
        a, b = (copies[n] / step for n in ("node0", "node1"))
        names = sorted(os.listdir(a))
        assert names == sorted(os.listdir(b)) and any(n.startswith("rank-") for n in names), names
        # Every node holds the whole checkpoint (all 4 ranks' files), byte for byte the same.
        assert all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)
        assert verify(str(a)) == [] and verify(str(b)) == []
    assert (copies["node1"] / "latest").read_text().strip() == f"step-{STEPS:07d}"

    # node1 + node2 (node2 never saw it: it gets a copy), then node2 alone (2 ranks).
    for nodes, mesh in ((["node1", "node2"], RESHAPED), (["node2"], ())):
        again = cluster.shared / f"local-resumed-{'-'.join(nodes)}"
        resumed = _train(cluster, again, nodes, f"checkpoint.dir={ckpt}", f"checkpoint.resume={ckpt}/{MIDDLE}",
                         "checkpoint.every=0", *mesh)
        assert f"at step {SAVE_EVERY}" in resumed.output, resumed.output[-3000:]
        _continues(losses(first), losses(again))
    assert verify(str(cluster.node_tmp("node2") / "ckpt-local" / MIDDLE)) == []
