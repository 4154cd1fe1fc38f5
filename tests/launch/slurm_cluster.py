"""A Slurm cluster of a test's own: munged, slurmctld and slurmd from Debian's slurm-wlm,
configured in a temporary directory, on free ports, with their own munge key and socket.

One node (this host) by default; with `nodes`, one slurmd per node of a tests/cluster harness
(`node_exec` runs it in the node's namespaces, slurmctld listens on the bridge's address).

Nothing outside that directory is read or written (no /etc/slurm, /etc/munge, /run/munge), so it
can run beside a site's Slurm. `SlurmCluster.start()` waits until the node is idle; `stop()` ends
every job and every daemon it started and checks that none is left.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import textwrap
import time

from processes import alive

SBIN = os.pathsep.join(["/usr/sbin", "/sbin", os.environ.get("PATH", "")])
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel")


def missing() -> str | None:
    """Why no cluster can be started here (None if one can)."""
    absent = [tool for tool in TOOLS if shutil.which(tool, path=SBIN) is None]
    if absent:
        return f"slurm-wlm/munge not installed (no {', '.join(absent)}; apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs as their user"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """Nodes with `cpus` CPUs each, one partition `test`, MPI plugin `mpi_default`.

    `nodes`: `[(name, address), ...]` of nodes whose slurmd `node_exec NAME slurmd -N NAME`
    starts, the controller at `controller` (name, address); None: one node, this host.
    """

    def __init__(self, root: pathlib.Path, cpus: int = 4, mpi_default: str = "pmi2",
                 nodes: list[tuple[str, str]] | None = None, node_exec: str | None = None,
                 controller: tuple[str, str] | None = None):
        self.root = root
        self.cpus = cpus
        self.mpi_default = mpi_default
        self.host = socket.gethostname().split(".")[0]
        self.nodes, self.node_exec, self.controller = nodes, node_exec, controller
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf), PATH=SBIN)
        self._pid_files = {name: root / f"{name}.pid" for name in ("munged", "slurmctld")}
        for name, _ in nodes or [(self.host, None)]:
            self._pid_files[f"slurmd-{name}"] = root / f"slurmd-{name}.pid"

    def _write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)  # munged refuses keys and sockets in directories others can write
        for name, _ in self.nodes or [(self.host, None)]:
            (self.root / "spool" / name).mkdir(mode=0o700, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.socket = self.root / "munge" / "munge.socket"
        log = self.root / "log"
        if self.nodes:
            controller = f"{self.controller[0]}({self.controller[1]})"
            node_lines = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={self.cpus} State=UNKNOWN" for n, a in self.nodes)
            names = ",".join(n for n, _ in self.nodes)
        else:
            controller, names = self.host, self.host
            node_lines = f"NodeName={self.host} CPUs={self.cpus} State=UNKNOWN"
        self.conf.write_text(textwrap.dedent(f"""\
            ClusterName=hpcpartest
            SlurmctldHost={controller}
            SlurmctldPort={_free_port()}
            SlurmdPort={_free_port()}
            SlurmUser=root
            SlurmdUser=root
            AuthType=auth/munge
            AuthInfo=socket={self.socket}
            CredType=cred/munge
            StateSaveLocation={self.root / 'state'}
            SlurmdSpoolDir={self.root / 'spool' / '%n'}
            SlurmctldPidFile={self._pid_files['slurmctld']}
            SlurmdPidFile={self.root / 'slurmd-%n.pid'}
            SlurmctldLogFile={log / 'slurmctld.log'}
            SlurmdLogFile={log / 'slurmd-%n.log'}
            SlurmctldDebug=info
            SlurmdDebug=info
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            JobAcctGatherType=jobacct_gather/none
            AccountingStorageType=accounting_storage/none
            SelectType=select/cons_tres
            SelectTypeParameters=CR_CPU
            SlurmdParameters=config_overrides
            MpiDefault={self.mpi_default}
            ReturnToService=2
            SchedulerType=sched/builtin
            InactiveLimit=0
            KillWait=10
            MinJobAge=600
            MailProg=/bin/true
            PartitionName=test Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
            """) + node_lines + "\n")

    def _daemon(self, args: list[str]) -> None:
        result = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"{args[0]} did not start (exit {result.returncode}): {result.stderr.strip()}"
                               f"\n{self.logs()}")

    def start(self, timeout: float = 60.0) -> None:
        self._write_config()
        munge = self.root / "munge"
        self._daemon(["munged", f"--socket={self.socket}", f"--key-file={munge / 'munge.key'}",
                      f"--pid-file={self._pid_files['munged']}", f"--log-file={self.root / 'log' / 'munged.log'}",
                      f"--seed-file={munge / 'munged.seed'}",
                      "--force"])  # pytest's temporary directories are private (0700): fine for one user
        self._daemon(["slurmctld", "-i"])  # -i: no state to recover, start clean
        if self.nodes:
            for name, _ in self.nodes:
                self._daemon([self.node_exec, name, f"SLURM_CONF={self.conf} slurmd -N {name}"])
        else:
            self._daemon(["slurmd"])
        deadline = time.monotonic() + timeout
        while self.run("sinfo", "-h", "-o", "%T", check=False).strip() != "idle":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node did not become idle within {timeout:.0f} s\n{self.logs()}")
            time.sleep(0.5)

    def run(self, *args: str, check: bool = True, cwd: str | os.PathLike | None = None,
            env: dict[str, str] | None = None, timeout: float = 60) -> str:
        """A Slurm client command against this cluster; its stdout."""
        result = subprocess.run(list(args), env=dict(env or os.environ, SLURM_CONF=str(self.conf)),
                                capture_output=True, text=True, timeout=timeout, cwd=cwd)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed (exit {result.returncode}):\n{result.stdout[-3000:]}"
                               f"\n{result.stderr[-3000:]}")
        return result.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Reason, Restarts, ExitCode, ...)."""
        fields = {}
        for word in self.run("scontrol", "-o", "show", "job", job_id).split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def logs(self) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {path.name} (last lines) ---\n" + "\n".join(path.read_text().splitlines()[-30:]))
        return "\n".join(out)

    def _pids(self) -> dict[str, int]:
        pids = {}
        for name, path in self._pid_files.items():
            try:
                pids[name] = int(path.read_text().split()[0])
            except (FileNotFoundError, ValueError, IndexError):
                pass
        return pids

    def stop(self) -> list[str]:
        """Cancel every job, stop the daemons (slurmd, slurmctld, munged); the names of any left running."""
        if self._pid_files["slurmctld"].exists():
            self.run("scancel", "--full", "--user", "root", check=False)
        pids = self._pids()
        for name in [*(n for n in pids if n.startswith("slurmd")), "slurmctld", "munged"]:
            if name in pids and alive(pids[name]):
                os.kill(pids[name], signal.SIGTERM)
                deadline = time.monotonic() + 20
                while alive(pids[name]) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if alive(pids[name]):
                    os.kill(pids[name], signal.SIGKILL)
                    time.sleep(0.5)
        return [name for name, pid in pids.items() if alive(pid)]
