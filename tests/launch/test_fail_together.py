"""Fail together: a failing rank takes the whole job down, quickly and legibly.

Each test launches a real `mpiexec` job and must finish well inside its timeout;
a hang would show up as `timed_out`.
"""

import sys
import textwrap

PY = sys.executable


def write(tmp_path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_an_exception_on_rank_2_aborts_every_rank(mpirun, tmp_path):
    script = write(tmp_path, """
        from mpi4py import MPI
        from hpcpar.runtime import failure
        failure.install()

        def step(rank):
            if rank == 2:
                raise ValueError("rank 2 found a NaN")
            MPI.COMM_WORLD.Barrier()  # the others wait in a blocking collective, forever

        step(MPI.COMM_WORLD.Get_rank())
        print("finished", flush=True)
    """)
    job = mpirun(4, [PY, script], timeout=30)
    assert not job.timed_out and job.elapsed < 30
    assert job.returncode != 0
    assert "finished" not in job.stdout
    assert "[rank 2] Traceback (most recent call last):" in job.stderr
    assert "[rank 2] ValueError: rank 2 found a NaN" in job.stderr
    assert 'raise ValueError("rank 2 found a NaN")' in job.stderr
    assert "[rank 0]" not in job.stderr and "[rank 1]" not in job.stderr


def test_a_hung_collective_becomes_a_comm_timeout(mpirun, tmp_path):
    script = write(tmp_path, """
        import time
        import numpy as np
        from mpi4py import MPI
        from hpcpar.runtime import failure
        from hpcpar.runtime.comm import Communicator
        failure.install()
        comm = Communicator(MPI.COMM_WORLD.Dup(), "dp")
        comm.all_reduce(np.ones(4))
        if comm.rank == 0:
            time.sleep(60)  # never reaches the next collective
        comm.all_reduce(np.ones((2, 3), dtype=np.float32))
    """)
    job = mpirun(3, [PY, script], timeout=30, env={"HPCPAR_TIMEOUT": "2"})
    assert not job.timed_out and job.elapsed < 30 and job.returncode != 0
    assert "CommTimeout: all_reduce on communicator 'dp' (op #1, float32[2, 3]) waited" in job.stderr
    assert "done:    dp#0 all_reduce float64[4]" in job.stderr


def test_a_user_error_on_every_rank_is_printed_once_with_status_2(mpirun):
    job = mpirun(4, [PY, "-m", "hpcpar", "info", "--dp", "3", "--tp", "2"], timeout=60)
    assert not job.timed_out and job.returncode == 2
    expected = ("hpcpar: error: mesh dp=3 x tp=2 x pp=1 = 6 ranks, but the world has 4 ranks; the product of "
                "dp, tp and pp must equal the number of ranks (e.g. dp=2 x tp=2 x pp=1)")
    assert job.output.count("hpcpar: error") == 1 and expected in job.stderr
    assert "Traceback" not in job.output


def test_a_user_error_on_one_rank_aborts_with_that_rank_named(mpirun, tmp_path):
    script = write(tmp_path, """
        from mpi4py import MPI
        from hpcpar.runtime import failure
        from hpcpar.errors import DataError
        failure.install()
        if MPI.COMM_WORLD.Get_rank() == 1:
            try:
                raise DataError("corpus /nope is missing; give an existing file or '' for the built-in corpus")
            except DataError as err:
                failure.report_user_error(err)
        MPI.COMM_WORLD.Barrier()
    """)
    job = mpirun(3, [PY, script], timeout=30)
    assert not job.timed_out and job.elapsed < 30 and job.returncode != 0
    assert job.stderr.count("hpcpar: error (rank 1): corpus /nope is missing") == 1


def test_info_prints_the_mesh_once(mpirun):
    job = mpirun(4, [PY, "-m", "hpcpar", "info", "--dp", "2", "--tp", "2"], timeout=60)
    assert not job.timed_out and job.returncode == 0, job.output
    out = job.stdout
    assert out.count("world size: 4") == 1 and out.count("MPI library: ") == 1
    assert "mesh: pp=1 x dp=2 x tp=2" in out
    rows = [line.split()[:4] for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert rows == [["0", "0", "0", "0"], ["1", "0", "0", "1"], ["2", "0", "1", "0"], ["3", "0", "1", "1"]]
    assert "every tp group inside one node: yes" in out
