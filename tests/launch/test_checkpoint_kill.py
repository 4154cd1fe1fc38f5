"""A rank SIGKILLed in the middle of a save leaves the previous checkpoint as `latest`, loadable.

Launches `mpiexec -n 4` on a small script that saves step 1, then step 2 with one rank killing
itself part-way (while writing its rank file, or rank 0 just before the commit rename).
"""

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hpcpar.checkpoint.directory import latest
from hpcpar.checkpoint.load import load
from hpcpar.checkpoint.tools import verify
from hpcpar.runtime.comm import Communicator
from hpcpar.layout import Layout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
NP = 4

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import h5py
    import numpy as np
    from mpi4py import MPI
    from hpcpar.checkpoint import save as saving
    from hpcpar.runtime.comm import Communicator
    from hpcpar.layout import Layout

    comm = Communicator(MPI.COMM_WORLD, "world")
    rank, size = comm.rank, comm.size
    directory, step = sys.argv[1], int(sys.argv[2])
    kill = os.environ.get("KILL_AT", "")  # "<rank>:write" or "<rank>:commit"

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if kill == f"{rank}:write":
        def dying_write(path, items):  # a half-written rank file, then death
            with h5py.File(path, "w") as f:
                f.create_dataset("partial", data=items[0][2][: len(items[0][2]) // 2])
                f.flush()
            die()
        saving.write_rank_file = dying_write
    if kill == f"{rank}:commit":
        saving.commit_dir = lambda *args: die()  # index and manifest written, not yet renamed

    rng = np.random.default_rng(step)
    w, b = rng.standard_normal((8 * size, 16)), rng.standard_normal(16)
    lw = Layout.split(w.shape, 0, rank, size)
    saving.save(directory, step, {"model/w": (lw.take(w), lw), "model/b": (b, Layout.replicated(b.shape))},
                {"note": "kill test"}, comm, keep=3)
""")


def launch(script, directory, step, kill=""):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", KILL_AT=kill)
    return subprocess.run([MPIEXEC, "-n", str(NP), sys.executable, str(script), str(directory), str(step)],
                          env=env, capture_output=True, text=True, timeout=180)


def expected(step):
    rng = np.random.default_rng(step)
    return rng.standard_normal((8 * NP, 16)), rng.standard_normal(16)


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
@pytest.mark.parametrize("kill", ["1:write", "0:commit"])
def test_kill_mid_save_keeps_previous_latest(tmp_path, kill):
    script = tmp_path / "save.py"
    script.write_text(SCRIPT)
    ckpt_dir = tmp_path / "ckpt"
    first = launch(script, ckpt_dir, 1)
    assert first.returncode == 0, first.stdout + first.stderr
    killed = launch(script, ckpt_dir, 2, kill=kill)
    assert killed.returncode != 0, "the killed save should fail the job"
    assert latest(str(ckpt_dir)) == str(ckpt_dir / "step-0000001")
    assert any(e.startswith(".tmp-step-0000002") for e in os.listdir(ckpt_dir)), "the partial save is gone?"
    w, b = expected(1)
    got, meta = load(str(ckpt_dir), {"model/w": Layout.replicated(w.shape),
                                     "model/b": Layout.replicated(b.shape)}, Communicator.local())
    assert np.array_equal(got["model/w"], w) and np.array_equal(got["model/b"], b) and meta["step"] == 1
    assert verify(str(ckpt_dir)) == []
    # The next save succeeds and removes the killed save's temporary directory.
    again = launch(script, ckpt_dir, 3)
    assert again.returncode == 0, again.stdout + again.stderr
    assert sorted(os.listdir(ckpt_dir)) == ["latest", "step-0000001", "step-0000003"]
