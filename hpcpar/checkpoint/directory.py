"""A run's checkpoint directory: `step-NNNNNNN` names, the `latest` pointer, commit, pruning.

    <directory>/step-0000200/       a committed checkpoint (complete once it has this name)
    <directory>/latest              "step-0000200\\n": the last one committed
    <directory>/.tmp-step-0000300-* a save in progress (or killed): renamed when committed

A save writes into a temporary directory, then rank 0 commits it: rename to its step name,
replace `latest`, each durable (fsync) before the next; the oldest checkpoints beyond `keep`
and leftovers of killed saves are then deleted by all ranks together (`prune`). On node-local
disks (`checkpoint.location`, `replicate.py`) every node holds such a directory and its leader
commits its own copy; its ranks prune it together.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import TYPE_CHECKING

from hpcpar.checkpoint.format import INDEX
from hpcpar.data.untrusted import contained
from hpcpar.errors import CheckpointError
from hpcpar.runtime.agreement import arrive

if TYPE_CHECKING:
    from hpcpar.runtime.comm import Communicator
    from hpcpar.runtime.solo import SoloCommunicator

LATEST = "latest"
TMP_PREFIX = ".tmp-step-"
_POINTER_BYTES = 4096  # `latest` holds one step name
_STEP_DIR = re.compile(r"^step-(\d{7,})$")


def step_dir_name(step: int) -> str:
    """`step-NNNNNNN` (7 digits, more when the step needs them)."""
    return f"step-{step:07d}"


def fsync_path(path: str) -> None:
    """Make a file's (or a directory's entries') last changes durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_dirs(directory: str) -> list[str]:
    """Committed `step-NNNNNNN` directories, oldest first."""
    names = [e for e in os.listdir(directory) if _STEP_DIR.match(e)
             and os.path.isdir(os.path.join(directory, e))]
    return sorted(names, key=lambda e: int(_STEP_DIR.match(e).group(1)))


def pointer(directory: str) -> str | None:
    """The name `latest` in `directory` holds ("step-0000200"), or None when it has none. At most
    `_POINTER_BYTES` are read: a larger file is no pointer (CheckpointError)."""
    path = os.path.join(directory, LATEST)
    try:
        with open(path, "rb") as f:
            raw = f.read(_POINTER_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise CheckpointError(f"{path}: unreadable checkpoint pointer ({err.strerror or err})") from None
    if len(raw) > _POINTER_BYTES:
        raise CheckpointError(f"{path}: more than {_POINTER_BYTES} bytes, not a checkpoint pointer (it holds one "
                              "step-NNNNNNN name); delete it to resume from the newest checkpoint")
    return raw.decode("utf-8", errors="replace").strip()


def latest(directory: str) -> str | None:
    """The checkpoint `latest` points to in `directory`; when the pointer is missing or names no
    committed checkpoint (deleted by hand, or a save killed between its rename and the pointer:
    a `step-NNNNNNN` directory is complete once it has its name), the newest committed one; None
    when there is none yet. The pointer names a directory beside it, and the one chosen must
    resolve inside `directory` (`data.untrusted.contained`: no path, no link that leads out)."""
    name = pointer(directory)
    where = f"{os.path.join(directory, LATEST)}: checkpoint"
    if name is not None and not _STEP_DIR.match(name) and ("/" in name or "\\" in name or name.startswith("..")):
        contained(directory, name, where, CheckpointError)  # a path: refused when it leads out
    if name is not None and _STEP_DIR.match(name) and os.path.isdir(os.path.join(directory, name)):
        return contained(directory, name, where, CheckpointError)
    steps = _step_dirs(directory) if os.path.isdir(directory) else []
    return contained(directory, steps[-1], f"{directory}: checkpoint", CheckpointError) if steps else None


def resolve(path: str) -> str:
    """A checkpoint directory: `path` itself when it has an index, else its `latest`."""
    if os.path.isfile(os.path.join(path, INDEX)):
        return path
    found = latest(path) if os.path.isdir(path) else None
    if found is None and _STEP_DIR.match(os.path.basename(os.path.normpath(path))) and os.path.isdir(path):
        raise CheckpointError(f"{os.path.join(path, INDEX)}: missing (incomplete or damaged checkpoint)")
    if found is None:
        raise CheckpointError(f"no checkpoint at {path}: expected a step-NNNNNNN directory with "
                              f"{INDEX}, or a directory with a '{LATEST}' pointer")
    return found


def write_pointer(directory: str, name: str) -> None:
    """Make `latest` in `directory` name `name` ("step-0000200"), durably: written beside it,
    then renamed over it."""
    temporary = os.path.join(directory, LATEST + ".tmp")
    with open(temporary, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(directory, LATEST))
    fsync_path(directory)


def step_of(name: str) -> int | None:
    """The step of a `step-NNNNNNN` name, None for any other name."""
    found = _STEP_DIR.match(name)
    return int(found.group(1)) if found else None


def commit_dir(directory: str, tmp: str, step: int, keep: int | None) -> tuple[str, list[str]]:
    """Rank 0 (node-local: each node's leader, on its disk): rename tmp -> step-NNNNNNN, replace
    `latest`. Each step is durable first.
    Returns the checkpoint's path and the directories to delete (`prune`)."""
    final = os.path.join(directory, step_dir_name(step))
    if os.path.exists(final):  # the same step saved again (e.g. after a resume): replace it
        os.rename(final, f"{tmp}-replaced")
    os.rename(tmp, final)
    fsync_path(directory)
    write_pointer(directory, step_dir_name(step))
    # Every .tmp-* left now is from a killed save (or the replaced copy): delete it.
    doomed = [e for e in os.listdir(directory) if e.startswith(TMP_PREFIX)]
    if keep is not None:
        # Oldest first by step; the checkpoint just committed is never deleted, even when newer
        # step numbers exist (a run resumed from an earlier checkpoint).
        others = [n for n in _step_dirs(directory) if n != step_dir_name(step)]
        doomed += others[:max(0, len(others) - (keep - 1))]
    return final, [os.path.join(directory, e) for e in doomed]


def doomed_shards(doomed: list[str]) -> list[str]:
    """Rank 0, after the commit: empty the directories to prune of everything but their rank
    files (the bulk of their bytes, which the ranks delete together: `prune`); returns those."""
    shards = []
    for d in doomed:
        for entry in os.scandir(d) if os.path.isdir(d) else ():
            if entry.name.startswith("rank-") and entry.is_file(follow_symlinks=False):
                shards.append(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass  # pruning never fails a committed save (what is left goes at the next one)
    return sorted(shards)


def prune(doomed: list[str], shards: list[str], comm: Communicator | SoloCommunicator) -> None:
    """Delete the `doomed` directories (collective, after the commit): every rank unlinks its
    share of their rank files (freeing their space is what deleting costs, as truncating the
    file a plain NumPy save overwrites costs each rank) and then tries to remove each directory,
    which succeeds for whoever unlinks last; a barrier: every rank returns with the directory as
    the commit left it."""
    if not doomed:
        return
    for path in shards[comm.rank::comm.size]:
        try:
            os.unlink(path)
        except OSError:
            pass  # already gone
    for d in doomed:
        try:
            os.rmdir(d)
        except OSError:
            pass  # not empty yet: another rank still unlinks its share, and removes it after
    arrive(comm)
