"""Launching real MPI jobs from a one-process pytest: `mpirun(n, args)` with a hard timeout."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# The mpiexec of the MPI that mpi4py uses: next to this Python (the `mpich` extra), else on PATH.
MPIEXEC = next((str(p) for p in (pathlib.Path(sys.executable).parent / "mpiexec",) if p.exists()),
               shutil.which("mpiexec"))


@dataclasses.dataclass
class Job:
    """What a finished (or killed) job left: exit status, output and wall time."""

    returncode: int
    stdout: str
    stderr: str
    elapsed: float
    timed_out: bool

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_job(n: int, args: list[str], timeout: float = 60.0, env: dict[str, str] | None = None,
            cwd: str | os.PathLike | None = None) -> Job:
    """Run `mpiexec -n n <args>`; kill the whole process group after `timeout` seconds."""
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                    OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    start = time.monotonic()
    proc = subprocess.Popen([MPIEXEC, "-n", str(n), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=full_env, cwd=cwd or REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and every rank it started
        out, err = proc.communicate()
        timed_out = True
    return Job(proc.returncode, out, err, time.monotonic() - start, timed_out)


@pytest.fixture(scope="session")
def mpi_family() -> str:
    """Whose mpiexec MPIEXEC is: "openmpi" (Open MPI) or "hydra" (MPICH, Intel MPI); skips without one."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec found")
    version = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True, timeout=60)
    text = version.stdout + version.stderr
    return "openmpi" if "OpenRTE" in text or "Open MPI" in text else "hydra"  # Open MPI 4 says OpenRTE


@pytest.fixture
def mpirun():
    """`mpirun(n, [cmd, ...], timeout=60, env=None) -> Job`; skips when there is no mpiexec."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec found")
    return run_job

