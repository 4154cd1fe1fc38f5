"""The verbs run on a login node, where MPI_Init often fails: outside an MPI launcher `hpcpar job
render`, `plan --hardware <preset>`, `ckpt info|verify|export|import`, `plot`, `data prepare` and
`sample` never initialise MPI. Proven the hard way: each runs here with mpi4py made unimportable
(a stand-in package that raises on import comes first on the path) and no launcher's variables.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from hpcpar.data import prepare
from hpcpar.environment import LAUNCHER_VARIABLES

from tiny_run import texts_and_tiny_run

PY = sys.executable
REPO = pathlib.Path(__file__).resolve().parents[2]
NO_MPI = "raise ImportError('mpi4py is unimportable here: a login node whose MPI_Init would fail')\n"


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> pathlib.Path:
    """texts/ (two small files), run/ (a tiny run trained by one process, with MPI as usual) and
    no-mpi/mpi4py/__init__.py, the stand-in that fails to import."""
    tmp = texts_and_tiny_run(tmp_path_factory.mktemp("login-node"), files=2, size=2000, seed=1)
    (tmp / "no-mpi" / "mpi4py").mkdir(parents=True)
    (tmp / "no-mpi" / "mpi4py" / "__init__.py").write_text(NO_MPI)
    return tmp


def login(place: pathlib.Path, *args: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    """`python -m hpcpar ARGS` with mpi4py unimportable and no launcher in the environment."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(PYTHONPATH=os.pathsep.join([str(place / "no-mpi"), str(REPO)]), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    done = subprocess.run([PY, "-m", "hpcpar", *args], capture_output=True, text=True, env=env, cwd=cwd or REPO,
                          timeout=120)
    assert "Traceback" not in done.stderr and "mpi4py" not in done.stderr, done.stderr
    return done


def test_the_stand_in_makes_mpi4py_unimportable(place):
    env = dict(os.environ, PYTHONPATH=str(place / "no-mpi"))
    done = subprocess.run([PY, "-c", "import mpi4py"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0 and "unimportable here" in done.stderr


def test_job_render_checks_the_run_without_mpi(place, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[mesh]\ndp = 2\ntp = 2\n")
    done = login(place, "job", "render", "--scheduler", "slurm", "--nodes", "1", "--config", str(config))
    assert done.returncode == 0 and "#SBATCH" in done.stdout, done.stderr
    bad = login(place, "job", "render", "--scheduler", "slurm", "--nodes", "1", "--ranks-per-node", "3",
                "--config", str(config))
    assert bad.returncode == 2 and bad.stderr.startswith("hpcpar: error: ") and bad.stderr.count("\n") == 1, \
        bad.stderr


def test_plan_with_a_hardware_preset(place):
    done = login(place, "plan", "--preset", "gpt2-124m", "--ranks", "8", "--hardware", "a100", "--top", "2")
    assert done.returncode == 0 and "plans for 8 ranks on a100" in done.stdout, done.stderr


def test_ckpt_info_verify_export_and_import(place, tmp_path):
    ckpts = str(place / "run" / "checkpoints")
    info = login(place, "ckpt", "info", ckpts)
    assert info.returncode == 0 and "transformer.wte.weight" in info.stdout, info.stderr
    verify = login(place, "ckpt", "verify", ckpts)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    npz = login(place, "ckpt", "export", ckpts, "--out", str(tmp_path / "w.npz"))
    assert npz.returncode == 0 and (tmp_path / "w.npz").is_file(), npz.stderr
    st = login(place, "ckpt", "export", ckpts, "--format", "safetensors", "--out", str(tmp_path / "w.safetensors"))
    assert st.returncode == 0 and (tmp_path / "w.safetensors").is_file(), st.stderr
    back = login(place, "ckpt", "import", str(tmp_path / "w.safetensors"), "--n-head", "2",
                 "--out", str(tmp_path / "imported"))
    assert back.returncode == 0, back.stderr
    again = login(place, "ckpt", "verify", str(tmp_path / "imported"))
    assert again.returncode == 0, again.stdout + again.stderr


def test_sample(place):
    done = login(place, "sample", str(place / "run" / "checkpoints"), "--tokens", "5", "--prompt", "ab")
    assert done.returncode == 0 and done.stdout.startswith("ab"), done.stderr


def test_data_prepare(place, tmp_path):
    done = login(place, "data", "prepare", str(place / "texts"), "--out", str(tmp_path / "tok"), "--no-progress")
    assert done.returncode == 0 and "wrote 4,002 tokens" in done.stdout, done.stderr
    prepare.prepare([str(place / "texts")], str(tmp_path / "here"), progress=False)
    assert (tmp_path / "tok" / "tokens.bin").read_bytes() == (tmp_path / "here" / "tokens.bin").read_bytes()


def test_plot(place, tmp_path):
    pytest.importorskip("matplotlib")
    done = login(place, "plot", str(place / "run"), "--out", str(tmp_path / "loss.png"))
    assert done.returncode == 0 and (tmp_path / "loss.png").stat().st_size > 0, done.stderr


def test_a_user_error_is_one_line_without_mpi(place):
    done = login(place, "ckpt", "info", str(place / "nothing"))
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr.startswith(f"hpcpar: error: no checkpoint at {place / 'nothing'}") and \
        done.stderr.count("\n") == 1, done.stderr
