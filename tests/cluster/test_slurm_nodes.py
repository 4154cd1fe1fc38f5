"""A multi-node Slurm runs `hpcpar job render`'s script: `sbatch -N 2`, the ranks started through
`srun`, the stop signal, a checkpoint, `scontrol requeue`, and a finished run with the one-host
run's losses.

The ranks (the MPICH wheel's) start with the script's `--launcher mpiexec`: hydra, inside the
allocation, starts its proxy on each node with `srun`. Started by `srun --mpi=pmi2` directly, they
failed in MPI_Init about one run in five here (Slurm 22.05's PMI-2 plugin garbled the long UCX
addresses: "mpi/pmi2: value not properly terminated in client request"), and the ranks left waited
until `--kill-on-bad-exit`, now in the script, ended the step.

The Slurm (slurmctld here, a slurmd in each node namespace) is the cluster harness's. The stop
signal is the one the script's `--signal=B:USR1@...` gets before the time limit, sent at a
chosen step with `scancel --batch --signal=USR1` (tests/launch/test_slurm.py waits for Slurm's own
time-limit signal on one node; here the point is two nodes).
"""

from __future__ import annotations

import time

import pytest

from conftest import PY, TINY, hydra_mpiexec, losses, run, train_args
from hpcpar.launch import jobs

STEPS = 300
STOP_AFTER = 20  # steps logged before the stop signal is sent
JOB_TIMEOUT_S = 200  # below pytest's 300 s: the failure then shows the job's state and log


@pytest.fixture(scope="module")
def slurm(cluster):
    missing = __import__("slurm_cluster").missing() if _importable() else "tests/launch/slurm_cluster.py missing"
    if missing:
        pytest.skip(missing)
    hydra_mpiexec()  # the wheel's MPICH, whose mpiexec the job script runs
    yield cluster.start_slurm(mpi_default="pmi2")
    left = cluster.slurm.stop()
    cluster.slurm = None
    assert not left, f"Slurm daemons still running after stop: {left}"


def _importable() -> bool:
    import sys

    from conftest import REPO
    sys.path.insert(0, str(REPO / "tests" / "launch"))
    try:
        __import__("slurm_cluster")
    except ImportError:
        return False
    return True


def _wait(slurm, job_id: str, run_dir, log) -> dict:
    """Poll until the job ends; send the stop signal once STOP_AFTER steps are logged (first run
    only), and start a requeued job at once (Slurm holds it back ~2 minutes) once its previous
    batch step has gone."""
    deadline, signalled, pending_since = time.monotonic() + JOB_TIMEOUT_S, False, None
    while time.monotonic() < deadline:
        info = slurm.job(job_id)
        state = info["JobState"]
        if state in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY") \
                and not (state == "CANCELLED" and info.get("Restarts") == "0" and signalled):
            return info
        logged = len(losses(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0
        if not signalled and state == "RUNNING" and logged >= STOP_AFTER:
            slurm.run("scancel", "--batch", "--signal=USR1", job_id)
            signalled = True
        if state == "PENDING" and info.get("Restarts") != "0":
            pending_since = pending_since or time.monotonic()
            if time.monotonic() - pending_since > 3:
                slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
        time.sleep(0.5)
    slurm.run("scancel", job_id, check=False)
    text = log.read_text()[-4000:] if log.exists() else "(no job log)"
    pytest.fail(f"job {job_id} did not end within {JOB_TIMEOUT_S} s: {info}\n{text}\n{slurm.logs()}")


def test_sbatch_on_two_nodes_stops_checkpoints_requeues_and_finishes_like_one_host(cluster, slurm, corpus):
    mpiexec = hydra_mpiexec()
    reference = cluster.shared / "slurm-reference"
    job = run([mpiexec, "-n", "4", *train_args(PY, reference, STEPS, corpus, "mesh.dp=2", "mesh.tp=2")])
    assert job.returncode == 0, job.output[-3000:]
    expected = losses(reference)

    work = cluster.shared / "slurm-job"
    work.mkdir()
    run_dir = work / "run"
    script = jobs.render("slurm", "cpu", nodes=2, ranks_per_node=2, cpus_per_task=1, time="00:10:00",
                         signal_seconds=60, hpcpar=f"{PY} -m hpcpar", launcher="mpiexec",
                         overrides=[*TINY, f"data.corpus={corpus}", f"train.steps={STEPS}", f"run.dir={run_dir}",
                                    "mesh.dp=2", "mesh.tp=2"])
    assert "#SBATCH --nodes=2" in script and "mpiexec -n 4 -ppn 2" in script
    (work / "train.sh").write_text(script)
    (work / "run.toml").write_text("# the job passes everything with --set\n")
    # The ranks' variables travel with sbatch (--export=ALL): MPICH's network path between nodes.
    env = {"UCX_TLS": "self,tcp", "UCX_NET_DEVICES": "eth0", "PYTHONPATH": str(__import__("conftest").REPO),
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PATH": __import__("os").environ["PATH"]}
    job_id = slurm.run("sbatch", "--parsable", "train.sh", cwd=work, env=env).strip().split(";")[0]
    log = work / f"hpcpar-{job_id}.out"
    info = _wait(slurm, job_id, run_dir, log)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-4000:]}"
    assert info["NodeList"] == "node[0-1]", info
    placed = [line for line in text.splitlines() if line.startswith("ranks (rank:pid@host): ")]
    assert placed and all("@node0, 1:" in line and "@node1, 3:" in line and line.endswith("@node1")
                          for line in placed), placed  # 2 ranks per node, tp inside each
    assert info["Restarts"] == "1", f"{info}\n{text[-4000:]}"
    assert text.count(f"checkpoint saved before the time limit; requeueing job {job_id}") == 1, text[-4000:]
    assert text.count("resumed from") == 1, text[-4000:]
    got = losses(run_dir)
    assert sorted(got) == list(range(STEPS))  # every step once: none lost, none repeated
    assert got == pytest.approx(expected, rel=1e-12, abs=0)
