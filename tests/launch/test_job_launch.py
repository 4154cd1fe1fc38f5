"""Rendered job scripts, run on this machine: the launch line trains, and the script's
signal forwarding and requeue logic work end to end under a real mpiexec.

No scheduler here: `srun` and `scontrol` are small fakes on PATH (srun runs `mpiexec -n 2`,
scontrol records its arguments), and PBS's `$PBS_O_WORKDIR`/`$PBS_JOBID` are set by hand.
(tests/launch/test_slurm.py runs a script under a real Slurm.) The mpiexec launch lines run in
the syntax of the MPI at hand: MPICH's hydra or Open MPI's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import shutil

import pytest

from hpcpar.launch import jobs

REPO = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
# The mpiexec of the MPI that mpi4py uses: next to this Python (the `mpich` extra), else on PATH.
MPIEXEC = shutil.which("mpiexec", path=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
# The job-script launcher that speaks the syntax of each family of mpiexec (see mpi_family).
OWN_MPIEXEC = {"hydra": "mpiexec", "openmpi": "mpiexec-openmpi"}
TINY = ["train.steps=3", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
        "train.warmup=1", "mesh.dp=2", "mesh.tp=1", "mesh.pp=1"]

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason=f"no mpiexec next to {sys.executable} or on PATH")

# Stands in for `hpcpar`: checks the command line it was given, reports the environment the
# script set, then waits for USR1/TERM (exit 75, as hpcpar does after its checkpoint) or, in
# mode "done"/"fail", exits at once with 0/3.
STUB = textwrap.dedent("""\
    import json, os, signal, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    rank = next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK") if v in os.environ), "0")
    got = []
    signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"argv": sys.argv[3:], "omp": os.environ.get("OMP_NUM_THREADS"),
                   "hdf5": os.environ.get("HDF5_USE_FILE_LOCKING")}, fh)
    if mode != "wait":
        sys.exit(0 if mode == "done" else 3)
    deadline = time.time() + 60
    while not got and time.time() < deadline:
        time.sleep(0.05)
    with open(os.path.join(out, f"signal{rank}"), "w") as fh:
        fh.write(str(got[0]) if got else "none")
    if got and rank == "0" and os.environ.get("HPCPAR_REQUEUE_MARKER"):  # as hpcpar train does
        with open(os.environ["HPCPAR_REQUEUE_MARKER"], "w") as fh:
            fh.write("75\\n")
    sys.exit(75 if got else 1)
""")


def _env(tmp: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PATH=f"{tmp / 'bin'}{os.pathsep}{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               SLURM_JOB_ID="4242", PBS_JOBID="4242.pbs", PBS_O_WORKDIR=str(tmp))
    return env


def _fake_scheduler_tools(tmp: pathlib.Path) -> None:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        # Drop srun's own options, run the program on 2 local ranks.
        while [ "${{1#--}}" != "$1" ]; do shift; done
        exec {shlex.quote(str(MPIEXEC))} -n 2 "$@"
        """))
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {shlex.quote(str(tmp / "scontrol.log"))}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)


def _launch_block(script: str) -> tuple[list[str], list[str]]:
    """(launcher words, program words) from between the launch markers."""
    lines = script.splitlines()
    block = lines[lines.index("# >>> launch") + 1: lines.index("# <<< launch")]
    return shlex.split(block[0].removesuffix(" \\")), shlex.split(block[1].removesuffix(" &"))


@pytest.mark.skipif(importlib.util.find_spec("hpcpar.training.trainer") is None, reason="hpcpar.training.trainer not written yet")
@pytest.mark.parametrize("scheduler", jobs.SCHEDULERS)
def test_launch_line_trains_locally(tmp_path, scheduler):
    (tmp_path / "run.toml").write_text("# everything this test needs comes from --set\n")
    script = jobs.render(scheduler, "cpu", hpcpar=f"{sys.executable} -m hpcpar",
                         overrides=TINY + [f"run.dir={tmp_path / 'run'}"])
    _, program = _launch_block(script)
    result = subprocess.run([str(MPIEXEC), "-n", "2", *program], cwd=tmp_path, env=_env(tmp_path),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _run_script(tmp: pathlib.Path, script: str, send_usr1: bool) -> tuple[int, str]:
    """Run `script` with bash in `tmp`; optionally USR1 it once both ranks are up. (status, stderr)"""
    path = tmp / "job.sh"
    path.write_text(script)
    proc = subprocess.Popen(["bash", str(path)], cwd=tmp, env=_env(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if send_usr1:
            deadline = time.time() + 60
            while not all((tmp / f"rank{r}.json").exists() for r in range(2)):
                assert time.time() < deadline and proc.poll() is None, "ranks did not start"
                time.sleep(0.1)
            proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session only
            proc.wait()
    return proc.returncode, err


def _stub_script(tmp: pathlib.Path, scheduler: str, mode: str, family: str, launcher: str | None = None,
                 **options) -> str:
    """The script around the stub; launcher "mpiexec" (PBS's, and Slurm's second) is the mpiexec
    line in the syntax of the MPI at hand (`family`, as the mpi_family fixture names it)."""
    stub = tmp / "stub.py"
    stub.write_text(STUB)
    _fake_scheduler_tools(tmp)
    command = shlex.join([sys.executable, str(stub), str(tmp), mode])
    launcher = launcher or jobs.LAUNCHERS[scheduler][0]
    return jobs.render(scheduler, "cpu", ranks_per_node=2, cpus_per_task=1, hpcpar=command,
                       overrides=["train.steps=7"], launcher=OWN_MPIEXEC[family] if launcher == "mpiexec" else launcher,
                       **options)


def _check_ranks(tmp: pathlib.Path) -> None:
    for rank in range(2):
        seen = json.loads((tmp / f"rank{rank}.json").read_text())
        assert seen["argv"] == ["train", "run.toml", "--set", "checkpoint.resume=auto", "--set", "train.steps=7"]
        assert seen["omp"] == "1" and seen["hdf5"] == "FALSE"


@pytest.mark.parametrize("scheduler,launcher", [("slurm", "srun"), ("slurm", "mpiexec"), ("pbs", "mpiexec")])
def test_usr1_reaches_ranks_and_requeues(tmp_path, mpi_family, scheduler, launcher):
    script = _stub_script(tmp_path, scheduler, "wait", mpi_family, launcher=launcher)
    status, err = _run_script(tmp_path, script, send_usr1=True)
    assert status == jobs.REQUEUE_STATUS, err
    _check_ranks(tmp_path)
    assert [(tmp_path / f"signal{r}").read_text() for r in range(2)] == [str(int(signal.SIGUSR1))] * 2
    if scheduler == "slurm":
        assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    else:
        assert "submit this script again (qsub)" in err and "qrerun 4242.pbs" in err


def test_pbs_timer_signals_before_walltime(tmp_path, mpi_family):
    # Walltime 60 s, USR1 50 s before it: the script's own timer stops the ranks after ~10 s.
    script = _stub_script(tmp_path, "pbs", "wait", mpi_family, time="00:01:00", signal_seconds=50)
    start = time.monotonic()
    status, err = _run_script(tmp_path, script, send_usr1=False)
    assert status == jobs.REQUEUE_STATUS, err
    assert 9 <= time.monotonic() - start < 45
    assert [(tmp_path / f"signal{r}").read_text() for r in range(2)] == [str(int(signal.SIGUSR1))] * 2


@pytest.mark.parametrize("scheduler", jobs.SCHEDULERS)
@pytest.mark.parametrize("mode,expected", [("done", 0), ("fail", 3)])
def test_exit_status_passes_through_without_requeue(tmp_path, mpi_family, scheduler, mode, expected):
    status, err = _run_script(tmp_path, _stub_script(tmp_path, scheduler, mode, mpi_family), send_usr1=False)
    assert status == expected, err
    _check_ranks(tmp_path)
    assert not (tmp_path / "scontrol.log").exists()
    assert "hpcpar: checkpoint saved" not in err
