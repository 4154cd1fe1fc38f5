"""The product across nodes: placement, MPI's network path, training under hydra and Open MPI.

Every run here has 2 nodes x 2 ranks (mesh dp=2 x tp=2: tp inside a node, dp across) and is
compared with the same run on one host (`mpiexec -n 4`, shared memory).
"""

from __future__ import annotations

import textwrap

import pytest

from conftest import PY, hydra_mpiexec, losses, openmpi_python, run, train_args

ALLREDUCE = textwrap.dedent("""
    import numpy as np
    from mpi4py import MPI
    x = np.full(1 << 21, MPI.COMM_WORLD.rank + 1.0)  # 16 MiB of float64
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, x)
    assert (x == sum(range(1, MPI.COMM_WORLD.size + 1))).all()
    size = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).size
    names = MPI.COMM_WORLD.gather(f"{MPI.Get_processor_name()}:{size}")
    if MPI.COMM_WORLD.rank == 0:
        print("nodes", " ".join(names), flush=True)
""")
MIB = 1 << 20


def _launch(cluster, launcher: str, args_for, nodes=None, ranks_per_node=None, timeout=180):
    """Run `args_for(python)` across `nodes` with `launcher` ("hydra" or "openmpi")."""
    if launcher == "hydra":
        mpiexec = hydra_mpiexec()
        return run(cluster.hydra(args_for(PY), mpiexec, nodes, ranks_per_node), timeout=timeout)
    python = openmpi_python()
    return run(cluster.openmpi(args_for(python), nodes=nodes, ranks_per_node=ranks_per_node), timeout=timeout)


@pytest.mark.parametrize("launcher", ["hydra", "openmpi"])
def test_inter_node_bytes_travel_the_link(cluster, launcher):
    """A 16 MiB all-reduce between two one-rank nodes moves at least 16 MiB each way on every
    node's eth0: the bytes took the network, not shared memory."""
    script = cluster.shared / "allreduce.py"
    script.write_text(ALLREDUCE)
    before = cluster.traffic()
    job = _launch(cluster, launcher, lambda py: [py, str(script)], nodes=["node0", "node1"], ranks_per_node=1)
    after = cluster.traffic()
    assert job.returncode == 0 and not job.timed_out, job.output[-3000:]
    assert "nodes node0:1 node1:1" in job.stdout, job.stdout  # MPI sees two nodes of one rank
    for node in ("node0", "node1"):
        received, sent = (a - b for a, b in zip(after[node], before[node]))
        assert received >= 16 * MIB and sent >= 16 * MIB, (node, received, sent)
    assert after["node2"][0] - before["node2"][0] < MIB  # a node not in the job: ARP broadcasts at most


def test_a_shaped_link_has_its_rate(cluster):
    """`shape` puts a token bucket of the given rate on both ends of a node's link (and removes it)."""
    cluster.shape("node2", "100mbit")
    try:
        inside = cluster.run_on("node2", "tc qdisc show dev eth0")
        outside = run(["tc", "qdisc", "show", "dev", cluster.veth("node2")]).stdout
        assert "tbf" in inside and "rate 100Mbit" in inside, inside
        assert "tbf" in outside and "rate 100Mbit" in outside, outside
    finally:
        cluster.shape("node2", None)
    assert "tbf" not in cluster.run_on("node2", "tc qdisc show dev eth0")


def test_info_reports_two_nodes_and_every_tp_group_inside_one(cluster):
    mpiexec = hydra_mpiexec()
    job = run(cluster.hydra([PY, "-m", "hpcpar", "info", "--dp", "2", "--tp", "2"], mpiexec, ["node0", "node1"]),
              timeout=120)
    assert job.returncode == 0, job.output[-3000:]
    assert "placement: 2 node(s); every tp group inside one node: yes" in job.stdout, job.stdout
    assert "tp group ranks [0, 1]: one node (node0)" in job.stdout
    assert "tp group ranks [2, 3]: one node (node1)" in job.stdout


@pytest.fixture(scope="module")
def one_host(cluster, corpus):
    """The reference: the run on one host (`mpiexec -n 4`, shared memory), its losses."""
    mpiexec = hydra_mpiexec()
    run_dir = cluster.shared / "one-host"
    job = run([mpiexec, "-n", "4", *train_args(PY, run_dir, 12, corpus, "mesh.dp=2", "mesh.tp=2")])
    assert job.returncode == 0, job.output[-3000:]
    return losses(run_dir)


@pytest.mark.parametrize("launcher", ["hydra", "openmpi"])
def test_training_across_nodes_equals_the_one_host_run(cluster, corpus, one_host, launcher):
    run_dir = cluster.shared / f"across-{launcher}"
    job = _launch(cluster, launcher,
                  lambda py: train_args(py, run_dir, 12, corpus, "mesh.dp=2", "mesh.tp=2"), ["node0", "node1"])
    assert job.returncode == 0 and not job.timed_out, job.output[-3000:]
    got = losses(run_dir)
    assert sorted(got) == sorted(one_host) == list(range(12))
    assert got == pytest.approx(one_host, rel=1e-12, abs=0)


@pytest.mark.timeout(900)  # two runs of the main job: 2-3 minutes on a quiet 2-core machine
def test_the_main_job_across_nodes_equals_the_one_host_run(cluster):
    """README's main job (`mpiexec -n 4 hpcpar train`, no arguments: the default model on the
    standard library's source, mesh dp=2 x pp=2) on 2 nodes x 2 ranks: the stages' activations
    cross the link (pp=2: stage 0 on node0, stage 1 on node1); every loss as on one host."""
    mpiexec = hydra_mpiexec()
    runs = {}
    for where in ("one-host", "two-nodes"):
        work = cluster.shared / f"main-{where}"
        work.mkdir()
        argv = [PY, "-m", "hpcpar", "train", "--set", "run.progress=false"]
        job = run([mpiexec, "-n", "4", *argv] if where == "one-host" else
                  cluster.hydra(argv, mpiexec, ["node0", "node1"]), timeout=900, cwd=work)
        assert job.returncode == 0 and not job.timed_out, job.output[-3000:]
        runs[where] = losses(work / "runs" / "default")
    assert sorted(runs["two-nodes"]) == list(range(300))
    assert runs["two-nodes"] == pytest.approx(runs["one-host"], rel=1e-12, abs=0)


def test_tp_across_nodes_is_warned_about_and_still_exact(cluster, corpus, one_host):
    """Ranks placed round robin (0, 2 on node0; 1, 3 on node1): both tp groups span the nodes. The
    job says so once, at start-up, and trains to the same losses (placement changes time only)."""
    mpiexec = hydra_mpiexec()
    run_dir = cluster.shared / "tp-across"
    job = run(cluster.hydra(train_args(PY, run_dir, 12, corpus, "mesh.dp=2", "mesh.tp=2"), mpiexec,
                            ["node0", "node1"], ranks_per_node=1, ranks=4))
    assert job.returncode == 0, job.output[-3000:]
    assert job.output.count("placement: 2 of 2 tp group(s) span nodes (first: ranks [0, 1] on node0, node1)") == 1, \
        job.output[-3000:]
    assert losses(run_dir) == pytest.approx(one_host, rel=1e-12, abs=0)
