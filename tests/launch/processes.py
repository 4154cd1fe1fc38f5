"""Processes shared by the launch and cluster tests: a job run with a hard timeout (`run`), and
whether a pid is alive (Linux /proc)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time


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


def run(argv: list[str], timeout: float, env: dict[str, str], cwd: str | os.PathLike) -> Job:
    """Run a launcher's command line in a session of its own; after `timeout` seconds kill the
    whole process group (the launcher and every rank it started): a hang shows as `timed_out`."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    return Job(proc.returncode, out, err, time.monotonic() - start, timed_out)


def alive(pid: int) -> bool:
    """True if `pid` runs (a zombie counts as gone: it has exited, only its status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
