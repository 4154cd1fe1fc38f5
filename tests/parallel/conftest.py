"""Running pytest on every rank: `mpiexec -n 4 python -m pytest tests/parallel`.

- Collective verdicts: after each test, the ranks exchange pass/fail; a test that
  failed on any rank fails on every rank, with each failing rank's report. So every
  rank reaches the same verdict, the exit status is non-zero everywhere, and rank 0's
  report shows failures that happened elsewhere.
- Only rank 0 writes the terminal report; the other ranks' reports are kept in
  memory and printed only if their session ends abnormally (e.g. collection errors).
- The watchdog timeout is 60 s: a blocking op that waits longer aborts the job with the
  watchdog's report (run with `-s` to see it), a non-blocking wait raises CommTimeout, so
  a test that would hang ends instead.
- Tests must collect identically on every rank: skip on the world size, never on
  the rank.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar.runtime import watchdog
from hpcpar.runtime.comm import Communicator

TEST_TIMEOUT_S = 60.0

_verdict_comm = Communicator(MPI.COMM_WORLD.Dup(), "test-verdict")
_quiet_output: io.StringIO | None = None


@pytest.hookimpl(trylast=True)  # after the terminal plugin has made its reporter
def pytest_configure(config: pytest.Config) -> None:
    global _quiet_output
    watchdog.set_timeout(TEST_TIMEOUT_S)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if MPI.COMM_WORLD.Get_rank() > 0 and reporter is not None and _quiet_output is None:
        from _pytest.terminal import TerminalReporter
        _quiet_output = io.StringIO()
        config.pluginmanager.unregister(reporter)
        config.pluginmanager.register(TerminalReporter(config, _quiet_output), "terminalreporter")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Test failures are mirrored on rank 0; anything else (collection errors, crashes) is not.
    if _quiet_output is not None and exitstatus not in (0, 1, 5):
        sys.stderr.write(f"[rank {MPI.COMM_WORLD.Get_rank()}] pytest output:\n{_quiet_output.getvalue()}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    # One verdict per test on every rank: at "call", or at "setup" when the test never got there.
    if call.when == "call" or (call.when == "setup" and not report.passed):
        flags = _verdict_comm.all_gather(np.array([report.failed], dtype=np.int32))
        if flags.any():
            mine = str(report.longrepr)[-3000:] if report.failed else ""
            texts = _verdict_comm.mpi.allgather(mine)  # test-only: pickled strings are fine here
            failing = np.flatnonzero(flags).tolist()
            report.outcome = "failed"
            report.longrepr = f"failed on rank(s) {failing} of {_verdict_comm.size}\n" + "\n".join(
                f"----- rank {r} -----\n{texts[r]}" for r in failing)
    return report


@pytest.fixture(scope="session")
def world() -> Communicator:
    """A Communicator over all ranks (its own duplicate of COMM_WORLD)."""
    comm = Communicator(MPI.COMM_WORLD.Dup(), "world")
    yield comm
    comm.free()



@pytest.fixture
def shared_dir():
    """A temporary directory every rank sees (made by rank 0, removed after the test): under
    $HPCPAR_SHARED_TMP where set (ranks on several nodes: a directory on storage they share, since
    each node's /tmp is its own), else the system's temporary directory."""
    world = MPI.COMM_WORLD
    where = os.environ.get("HPCPAR_SHARED_TMP") or None
    path = world.bcast(tempfile.mkdtemp(prefix="hpcpar-test-", dir=where) if world.rank == 0 else None, root=0)
    yield path
    world.barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
