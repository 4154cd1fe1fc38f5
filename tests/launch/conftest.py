"""Launching real MPI jobs from a one-process pytest: `mpirun(n, args)` with a hard timeout."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import processes
from processes import Job

REPO = pathlib.Path(__file__).resolve().parents[2]
# The mpiexec of the MPI that mpi4py uses: next to this Python (the `mpich` extra), else on PATH.
MPIEXEC = next((str(p) for p in (pathlib.Path(sys.executable).parent / "mpiexec",) if p.exists()),
               shutil.which("mpiexec"))


def run_job(n: int, args: list[str], timeout: float = 60.0, env: dict[str, str] | None = None,
            cwd: str | os.PathLike | None = None) -> Job:
    """Run `mpiexec -n n <args>`; kill the whole process group after `timeout` seconds."""
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                    OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    return processes.run([MPIEXEC, "-n", str(n), *args], timeout, full_env, cwd or REPO)


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

