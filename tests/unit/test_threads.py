"""BLAS threads per rank: cores shared among the ranks the launcher put on this node."""

import os

from hpcpar.backend import threads


def test_ranks_on_a_node_share_its_cores(monkeypatch):
    for var in threads._THREAD_VARS:
        monkeypatch.setenv(var, "")          # empty counts as unset
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert threads.set_default_threads() == 2
    assert os.environ["OPENBLAS_NUM_THREADS"] == "2" and threads.blas_threads() == 2


def test_the_users_setting_wins(monkeypatch):
    for var in threads._THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    assert threads.set_default_threads() == 3
    assert os.environ["MKL_NUM_THREADS"] == "3"


def test_no_launcher_means_one_rank(monkeypatch):
    for var in threads._LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    assert threads.local_ranks() == 1
