"""Copies of a checkpoint directory on every node, for checkpoints on node-local disks.

`checkpoint.location = "node-local"`: the checkpoint directory is each node's own disk (`/tmp`,
`$TMPDIR`, a local NVMe), the same path on every node and a different disk on each. A save then
writes each rank's file on its own node, and `replicate` copies every file to every node before
the commit (`save.py`), so each node holds the whole checkpoint; at the start of a run,
`start_of_run` copies the checkpoint to resume onto the nodes that lack it, so a job resumes on
any set of nodes (fewer, more, others).

    probe_location    one filesystem every node sees ("shared") or each node its own ("node-local")?
    replicate         every node ends with every regular file of a directory that any node has
    share_checkpoint  the checkpoint a resume names on every node, `latest` included
    start_of_run      the run-start step: the location resolved, the checkpoint to resume shared

A node is the ranks of a `node_comm` (`Communicator.split_by_node()`, or any split of the ranks
into groups: tests fake nodes with directories of their own), its leader is its rank 0. The
leaders do the file work and the copies; the other ranks wait for the verdict. A file moves as
uint8 buffers broadcast over the leaders' communicator in chunks of at most `CHUNK_BYTES` (never
pickled: an object above 2 GiB cannot be), from one leader that holds it to the others. Every
failure is collective: the same CheckpointError on every rank.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hpcpar.checkpoint.collective import collective
from hpcpar.checkpoint.directory import fsync_path, latest, pointer, step_of, write_pointer
from hpcpar.checkpoint.format import INDEX
from hpcpar.errors import CheckpointError

if TYPE_CHECKING:
    from hpcpar.runtime.comm import Communicator
    from hpcpar.runtime.solo import SoloCommunicator

AUTO, SHARED, NODE_LOCAL = "auto", "shared", "node-local"
LOCATIONS = (AUTO, SHARED, NODE_LOCAL)
CHUNK_BYTES = 64 << 20  # the largest broadcast of a copy
PROBE_PREFIX = ".location-probe-"
PART_SUFFIX = ".part"  # a file being received: `.<name>.part`, renamed once every node has its copy


class Copy(NamedTuple):
    """One file to copy: its `name` and `size`, the leader that sends it (`source`, a rank of the
    leaders' communicator) and the leaders that lack it (`to`)."""

    name: str
    size: int
    source: int
    to: tuple[int, ...]


def _one_node(comm: Communicator | SoloCommunicator, node_comm: Communicator | SoloCommunicator) -> bool:
    """Every rank on one node (the same answer on every rank): nothing to probe or copy."""
    return comm.size == 1 or node_comm.size == comm.size


def probe_location(directory: str, comm: Communicator | SoloCommunicator,
                   node_comm: Communicator | SoloCommunicator) -> str:
    """"shared" when every node sees `directory` as one filesystem, else "node-local" (collective).

    Rank 0 creates `directory` and writes a probe file with a random token into it; then every
    node leader looks for it in its own `directory` (this rank's path); shared iff every leader
    reads the token. Rank 0 removes the probe. One process or one node: "shared", with no file
    written. A probe that cannot be written raises the same CheckpointError on every rank.
    """
    if _one_node(comm, node_comm):
        return SHARED

    def write() -> str | None:
        if comm.rank != 0:
            return None
        token = secrets.token_hex(8)
        try:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, PROBE_PREFIX + token), "w") as f:
                f.write(token)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            raise CheckpointError(f"checkpoint directory {directory}: cannot write a probe file there to tell whether "
                                  f"every node sees it ({err.strerror or err}); set checkpoint.dir to a writable "
                                  "directory") from None
        return token

    token = collective(comm, write, share=True)[0]
    seen = collective(comm, lambda: _sees(directory, token) if node_comm.rank == 0 else None, share=True)
    if comm.rank == 0:  # every leader has looked (the all-gather above)
        try:
            os.unlink(os.path.join(directory, PROBE_PREFIX + token))
        except OSError:
            pass  # a probe left behind is a dot-file nobody reads
    return SHARED if all(s is not False for s in seen) else NODE_LOCAL


def _sees(directory: str, token: str, tries: int = 3) -> bool:
    """Whether this node reads rank 0's probe file in `directory`. A network filesystem may answer
    from a stale cache of the directory: re-read it and look again a few times before saying no."""
    path = os.path.join(directory, PROBE_PREFIX + token)
    for attempt in range(tries):
        try:
            with open(path) as f:
                return f.read() == token
        except (FileNotFoundError, NotADirectoryError):
            if attempt + 1 < tries:
                time.sleep(0.05)
                try:
                    os.listdir(directory)
                except OSError:
                    return False
        except OSError:
            return False
    return False


def plan_copies(listings: list[dict[str, int] | None]) -> list[Copy]:
    """The copies that give every leader every file (pure): for each file some leader lacks, the
    lowest leader that has it sends it to those that lack it; files every leader has are skipped.
    `listings`: each leader's `{file name: size}`. Raises CheckpointError when two leaders hold a
    file with different sizes (one of them damaged: which is unknown)."""
    names = sorted(set().union(*listings))
    plan = []
    for name in names:
        holders = [r for r, held in enumerate(listings) if name in held]
        sizes = {listings[r][name] for r in holders}
        if len(sizes) > 1:
            found = ", ".join(f"{listings[r][name]} bytes on node {r}" for r in holders)
            raise CheckpointError(f"{name}: the nodes' copies differ ({found}): a damaged or half-copied "
                                  "checkpoint; delete the bad copy, or resume from another checkpoint")
        lacking = tuple(r for r in range(len(listings)) if name not in listings[r])
        if lacking:
            plan.append(Copy(name, sizes.pop(), holders[0], lacking))
    return plan


def replicate(path: str, comm: Communicator | SoloCommunicator, node_comm: Communicator | SoloCommunicator,
              chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    """Give every node every regular file of the directory `path` (collective over `comm`).

    Every node leader lists the files in `path`, this rank's path to it (created where missing;
    names starting with "." are left out: probes, unfinished copies); the leaders agree on what
    each holds (`plan_copies`), and every file a node lacks is broadcast from one leader that has
    it, in chunks of at most `chunk_bytes`, into `.<name>.part`; once every leader received all
    of its files, each renames them to their names and makes them and the directory durable.
    Returns the names of the files this rank's node received (on its leader; [] on the others).
    Any failure raises the same CheckpointError on every rank, and then no copy takes its name.
    """
    if _one_node(comm, node_comm):
        return []
    leader = node_comm.rank == 0
    leaders = comm.split(0 if leader else 1, comm.rank, name="node-leaders")
    try:
        received, failure = _exchange(path, leaders, chunk_bytes) if leader else ([], None)
    finally:
        leaders.free()

    def verdict() -> None:
        if failure is not None:
            raise failure

    collective(comm, verdict, patient=True)
    return received


def _listing(path: str) -> dict[str, int]:
    """This node's regular files in `path` (made when missing) and their sizes; dot-files left out."""
    os.makedirs(path, exist_ok=True)
    return {e.name: e.stat(follow_symlinks=False).st_size for e in os.scandir(path)
            if not e.name.startswith(".") and e.is_file(follow_symlinks=False)}


def _exchange(path: str, leaders: Communicator, chunk_bytes: int) -> tuple[list[str], BaseException | None]:
    """The leaders' part of `replicate`: list, plan, copy, agree, rename. Never raises between
    the leaders' collectives: returns this leader's received files and its failure, if any."""
    failure: BaseException | None = None
    try:
        held = _listing(path)
    except OSError as err:
        held, failure = None, CheckpointError(f"{path}: cannot create or list it on this node ({err})")
    listings = leaders.all_gather_object(held)
    if any(h is None for h in listings):  # the leader that failed says why
        return [], failure
    try:
        plan = plan_copies(listings)
    except CheckpointError as err:  # the same on every leader
        return [], err
    buffer = np.empty(max(1, min(chunk_bytes, max((c.size for c in plan), default=1))), dtype=np.uint8)
    mine = [c for c in plan if leaders.rank in c.to]
    for copy in plan:
        error = _copy(path, copy, leaders, buffer, failure is not None)
        failure = failure or error
    # Rename only once every copy arrived everywhere: a sender's read error travels as garbage.
    failed = any(leaders.all_gather_object(failure is not None))
    try:
        for copy in mine:
            part = os.path.join(path, f".{copy.name}{PART_SUFFIX}")
            if failed:
                _unlink(part)
            else:
                os.replace(part, os.path.join(path, copy.name))
        if mine and not failed:
            fsync_path(path)
    except OSError as err:
        failure = failure or err
    return ([c.name for c in mine] if not failed else []), failure


def _copy(path: str, copy: Copy, leaders: Communicator, buffer: np.ndarray, failed: bool) -> BaseException | None:
    """One file from its source leader into `.<name>.part` on the leaders that lack it (fsynced).
    Every leader takes part in every broadcast; a leader that failed (now or before: `failed`)
    goes on broadcasting without touching files. Returns this leader's error, if any."""
    me, error = leaders.rank, None
    try:
        with contextlib.ExitStack() as files:
            src = dst = None
            try:
                if not failed and me == copy.source:
                    src = files.enter_context(open(os.path.join(path, copy.name), "rb"))
                if not failed and me in copy.to:
                    dst = files.enter_context(open(os.path.join(path, f".{copy.name}{PART_SUFFIX}"), "wb"))
            except OSError as err:
                error = err
            for offset in range(0, copy.size, buffer.size):
                view = buffer[:min(buffer.size, copy.size - offset)]
                if src is not None and error is None:
                    error = _read_into(src, view)
                leaders.broadcast(view, root=copy.source)
                if dst is not None and error is None:
                    error = _write(dst, view)
            if dst is not None and error is None:
                error = _write(dst, None)
    except OSError as err:  # closing a file (everything was broadcast by then)
        error = error or err
    if error is not None:
        return CheckpointError(f"{os.path.join(path, copy.name)}: copying it to every node failed ({error})")
    return None


def _write(f, view: np.ndarray | None) -> BaseException | None:
    """Append `view` to `f`, or with None make `f` durable; the error, if it fails."""
    try:
        if view is not None:
            f.write(memoryview(view))
        else:
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return err
    return None


def _read_into(f, view: np.ndarray) -> BaseException | None:
    """Fill `view` from `f`; the error, if it fails or the file ends first."""
    raw, got = memoryview(view), 0
    try:
        while got < len(raw):
            n = f.readinto(raw[got:])
            if not n:
                return ValueError(f"the file ends after {f.tell()} bytes (changed while copied?)")
            got += n
    except OSError as err:
        return err
    return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _held(path: str) -> tuple[str, str | None]:
    """What this node has at `path`: ("checkpoint", None) when it is a checkpoint (has its index),
    ("parent", "step-NNNNNNN") when it is a directory whose `directory.latest` is that checkpoint,
    else ("none", None)."""
    if os.path.isfile(os.path.join(path, INDEX)):
        return "checkpoint", None
    found = latest(path) if os.path.isdir(path) else None
    return ("parent", os.path.basename(found)) if found else ("none", None)


def share_checkpoint(path: str, comm: Communicator | SoloCommunicator,
                     node_comm: Communicator | SoloCommunicator) -> str | None:
    """Make the checkpoint `path` names visible on every node (collective over `comm`).

    `path` is what `checkpoint.resume` names, this rank's path to it: a `step-NNNNNNN` directory,
    or a checkpoint directory (the run's, for resume = "auto"). The leaders report what they hold
    there; for a checkpoint directory the ranks agree on the newest step any node's
    `directory.latest` gives, copy that step's directory to every node that lacks it (or lacks
    files of it: `replicate`) and point `latest` at it on every node, so that every rank then
    resolves the same checkpoint. Returns the checkpoint's path (this rank's), or None when no
    node holds one (the load then says so) or all ranks are on one node (nothing to copy).
    """
    if _one_node(comm, node_comm):
        return None
    held = [h for h in collective(comm, lambda: _held(path) if node_comm.rank == 0 else None, share=True)
            if h is not None]
    if any(kind == "checkpoint" for kind, _ in held):
        replicate(path, comm, node_comm)
        return path
    names = [name for kind, name in held if kind == "parent"]
    if not names:
        return None
    name = max(names, key=step_of)
    replicate(os.path.join(path, name), comm, node_comm)

    def point() -> None:
        if node_comm.rank == 0 and pointer(path) != name:
            write_pointer(path, name)

    collective(comm, point)
    return os.path.join(path, name)


def start_of_run(checkpoint_dir: str, resume: str, location: str, comm: Communicator | SoloCommunicator,
                 node_comm: Communicator | SoloCommunicator | None = None) -> str:
    """The run-start step of `checkpoint.location` (collective over `comm`, before anything
    reads the checkpoint to resume): "auto" is probed on `checkpoint_dir` (`probe_location`), and
    on node-local disks with `resume` set ("auto": the newest checkpoint in `checkpoint_dir`, else
    a path) that checkpoint is copied onto every node that lacks it (`share_checkpoint`).
    `node_comm`: the ranks of this rank's node (default `comm.split_by_node()`). Returns the
    location: "shared" or "node-local"."""
    if location not in LOCATIONS:
        raise CheckpointError(f"checkpoint.location={location!r}: expected one of {', '.join(LOCATIONS)}")
    node_comm = node_comm if node_comm is not None else comm.split_by_node()
    if location == AUTO:
        location = probe_location(checkpoint_dir, comm, node_comm)
    if location == NODE_LOCAL and resume:
        share_checkpoint(checkpoint_dir if resume == "auto" else resume, comm, node_comm)
    return location
