"""BLAS threads per rank: cores shared among the ranks the launcher put on this node."""

import os
import pathlib
import subprocess
import sys

from hpcpar import environment

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_ranks_on_a_node_share_its_cores(monkeypatch):
    for var in environment._THREAD_VARS:
        monkeypatch.setenv(var, "")          # empty counts as unset
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert environment.set_default_threads() == 2
    assert os.environ["OPENBLAS_NUM_THREADS"] == "2" and environment.blas_threads() == 2


def test_the_users_setting_wins(monkeypatch):
    for var in environment._THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    assert environment.set_default_threads() == 3
    assert os.environ["MKL_NUM_THREADS"] == "3"


def test_no_launcher_means_one_rank(monkeypatch):
    for var in environment._LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    assert environment.local_ranks() == 1


def test_the_cli_sets_the_thread_variables_before_numpy_loads():
    """`hpcpar` sets each rank's BLAS threads before NumPy starts its BLAS, which reads them once: a
    watcher on the import of numpy sees OMP_NUM_THREADS already set (to this rank's share)."""
    code = ("import importlib.abc, os, sys\n"
            "class Watch(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'numpy':\n"
            "            print(os.environ.get('OMP_NUM_THREADS'))\n"
            "            sys.meta_path.remove(self)\n"
            "sys.meta_path.insert(0, Watch())\n"
            "import hpcpar.cli.main\n"
            "import numpy\n")                                  # if the CLI did not load it
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_NUM_THREADS", "_MAXIMUM_THREADS"))}
    env.update(MPI_LOCALNRANKS="2", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, check=True)
    assert out.stdout.strip() == str(max(1, environment.cores() // 2)), out.stdout + out.stderr
