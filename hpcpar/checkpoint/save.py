"""Saving a checkpoint: agree on who writes what, write the files (in the background if asked), commit.

A save is collective over all ranks and takes these steps (`save`):

1. describe: every rank's shapes, dtypes and regions are gathered (no data is touched); rank 0
   makes the temporary directory.
2. assign: which rank writes which block (`writers.assign_writers`), the same on every rank.
3. snapshot: the blocks this rank writes, cut from its arrays (host copies when asynchronous).
4. write: this rank's file, and on one rank the index (`writers`); with `async_save` in a
   background thread, returning a `SaveHandle` whose `wait()` does the rest.
5. commit (`_Commit`): rank 0 writes the manifest, renames the directory to `step-NNNNNNN` and
   moves `latest` (`directory.commit_dir`); every rank then helps delete old checkpoints.

On node-local disks (`location="node-local"`, `replicate.py`) every node leader makes the same
temporary directory on its own disk in step 1, each rank writes its file there, and the commit
first copies every file to every node (`replicate`), then each leader commits its node's copy
and each node's ranks prune it.

Every failure is collective (`collective`): all ranks raise the same CheckpointError, and an
uncommitted save never becomes `latest`.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import secrets
import shutil
import threading
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any, Callable, Mapping

import h5py
import numpy as np

import hpcpar
from hpcpar.checkpoint.collective import collective
from hpcpar.checkpoint.directory import TMP_PREFIX, commit_dir, doomed_shards, fsync_path, prune, step_dir_name
from hpcpar.checkpoint.format import (FORMAT, FORMAT_VERSION, INDEX, MANIFEST, PER_RANK, SHARED, STORAGES,
                                      Extent, StoredTensor, chunk_shape, crc32, manifest_digest, rank_file_name)
from hpcpar.checkpoint.replicate import AUTO, LOCATIONS, NODE_LOCAL, probe_location, replicate
from hpcpar.checkpoint.writers import (Background, Item, assign_writers, blocks_to_write, check_space, index_bytes,
                                       in_shared_file, index_writer, write_rank_file, write_shared)
from hpcpar.errors import CheckpointError
from hpcpar.layout import Layout, bounds

if TYPE_CHECKING:
    from hpcpar.runtime.comm import Communicator
    from hpcpar.runtime.solo import SoloCommunicator


class SaveHandle:
    """A save in flight: rank files written by a background thread; `.wait()` commits.

    `.wait()` is collective (every rank must call it, from the thread that does MPI): it joins
    the writer thread (rank files, and on one rank the index), then runs the commit (manifest,
    rename, `latest`, pruning).
    """

    def __init__(self, write: Callable[[], tuple[dict, dict]], commit: Callable[[Callable], str],
                 background: bool):
        self._write, self._commit, self._path = write, commit, None
        self._result: tuple[dict, dict] | None = None
        self._error: BaseException | None = None
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="hpcpar-ckpt-write", daemon=True)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        try:  # no MPI here: this may run in the background thread
            self._result = self._write()
        except BaseException as err:  # noqa: BLE001 - re-raised from wait() on the main thread
            self._error = err

    def _written(self) -> tuple[dict, dict]:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def done(self) -> bool:
        """True once the rank file of this rank is written (the commit still needs `.wait()`)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str:
        """Finish and commit the checkpoint (collective); returns the `step-NNNNNNN` path."""
        if self._path is None:
            self._path = self._commit(self._written)
        return self._path


def save(directory: str, step: int, tensors: Mapping[str, tuple[Any, Layout]], meta: dict,
         comm: Communicator | SoloCommunicator, keep: int | None = 3, async_save: bool = False,
         storage: str = PER_RANK, location: str = "shared",
         node_comm: Communicator | SoloCommunicator | None = None):
    """Save a sharded checkpoint of global tensors (collective over `comm`).

    Args:
        directory: this rank's path to the run's checkpoint directory (created if missing): one
            directory every rank sees, or with `location="node-local"` each node's own (the
            paths may then differ between ranks: how a test on one host fakes node-local disks).
        step: training step; the checkpoint becomes `<directory>/step-NNNNNNN`.
        tensors: global name (e.g. `model/transformer.wte.weight`,
            `optim/transformer.wte.weight/exp_avg`) -> `(local array, Layout)` on this rank.
            NumPy or CuPy arrays; `array.shape == layout.local_shape`.
        meta: JSON-able dict from the caller (config, mesh, rng/data/lr positions, ...). Must be
            the same on every rank; rank 0's copy is stored with `step`, `format_version`,
            `world_size`, `timestamp` and `hpcpar_version` added.
        comm: the Communicator over all ranks (e.g. `mesh.world`; one process: `SoloCommunicator()`).
        keep: committed checkpoints to keep (older ones are deleted); None keeps all.
        async_save: copy the blocks this rank writes (only those) to host memory now, write the
            rank file in a background thread and return a `SaveHandle`; `handle.wait()`
            (collective, main thread) commits, and raises what failed on any rank.
        storage: "per_rank" (a file per writing rank + an index of virtual datasets) or "shared"
            (one file, `index.h5`, written collectively through MPI-IO over `comm`: needs h5py
            built with MPI; not with `async_save`, since MPI-IO cannot run in a background thread).
        location: "shared" (one filesystem every rank sees), "node-local" (each node's own disk:
            every node ends with a full copy, `replicate.replicate`; per_rank storage only) or
            "auto" (probed now: `replicate.probe_location`).
        node_comm: with node-local, the ranks of this rank's node (default `comm.split_by_node()`).
    Returns:
        The committed checkpoint's path, or a `SaveHandle` when `async_save`.
    """
    _check_options(keep, async_save, storage)
    directory = os.path.abspath(directory)
    # The default, location="shared", makes no call of this; node-local saves get a node communicator.
    node_comm = _node_local(directory, storage, location, comm, node_comm) if location != "shared" else None
    # Collectives cost (an object all-gather through the watched Communicator took ~7 ms on the busy
    # shared 2-core machine, where a 64 MiB-per-rank save takes ~0.2 s): a save makes three
    # all-gathers (the last two after a non-spinning barrier, `agreement.arrive`) and a barrier.
    holdings, tmp = _describe(directory, step, tensors, comm, node_comm)
    assignment = _assignment(holdings, storage, tmp, comm.rank if node_comm is None else node_comm.rank)
    try:
        items, failed = blocks_to_write(assignment, tensors, comm.rank, private=async_save), None
    except Exception as err:  # noqa: BLE001 - raised where the ranks next agree (the write's outcome)
        items, failed = [], err
    # Rank 0's meta, stamped now (the snapshot's time); the ranks that write it need rank 0's copy.
    stored_meta = dict(meta, step=step, format_version=FORMAT_VERSION, world_size=comm.size,
                       hpcpar_version=hpcpar.__version__,
                       timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat())
    writer = index_writer(assignment, comm.size, storage)
    if storage == SHARED or writer != 0:
        stored_meta = comm.broadcast_object(stored_meta if comm.rank == 0 else None, root=0)
    commit = _Commit(directory, tmp, step, keep, storage, assignment, stored_meta, comm, node_comm)
    if storage == SHARED:
        return _save_shared(os.path.join(tmp, INDEX), assignment, items, failed, stored_meta, commit, comm)
    write = functools.partial(_write_files, tmp, assignment, items, failed, stored_meta, comm.rank, writer)
    handle = SaveHandle(write, commit.written, background=async_save)
    return handle if async_save else handle.wait()


def _check_options(keep: int | None, async_save: bool, storage: str) -> None:
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep={keep}: must keep at least 1 checkpoint (or None for all)")
    if storage not in STORAGES:
        raise CheckpointError(f"storage={storage!r}: expected one of {', '.join(STORAGES)}")
    if storage == SHARED and not h5py.get_config().mpi:
        raise CheckpointError("a shared-file checkpoint needs h5py built with MPI (parallel HDF5); this h5py is "
                              "not: see README, Parallel HDF5, or save per_rank")
    if storage == SHARED and async_save:
        raise CheckpointError("async_save needs per_rank storage: a shared-file save writes through "
                              "collective MPI-IO, which cannot run in a background thread")


def _node_local(directory: str, storage: str, location: str, comm: Communicator | SoloCommunicator,
                node_comm: Communicator | SoloCommunicator | None) -> Communicator | SoloCommunicator | None:
    """The node communicator of a node-local save, None for a shared one ("auto": probed now)."""
    if location not in LOCATIONS:
        raise CheckpointError(f"location={location!r}: expected one of {', '.join(LOCATIONS)}")
    node_comm = node_comm if node_comm is not None else comm.split_by_node()
    if location == AUTO:
        location = probe_location(directory, comm, node_comm)
    if location != NODE_LOCAL:
        return None
    if storage == SHARED:  # the same verdict on every rank (the probe's is)
        raise CheckpointError("a shared-file checkpoint (storage=\"shared\", one file through MPI-IO) needs one "
                              "filesystem every node sees, not node-local disks: save per_rank")
    return node_comm


def _describe(directory: str, step: int, tensors: Mapping[str, tuple[Any, Layout]],
              comm: Communicator | SoloCommunicator,
              node_comm: Communicator | SoloCommunicator | None = None) -> tuple[list[dict], str]:
    """Every rank's `{name: (global shape, dtype, [global regions])}` (no data is touched), and the
    temporary directory rank 0 makes for the save (collective). Node-local (`node_comm`): rank 0
    picks its name and every node leader makes it on its own disk; returns this rank's path."""
    def work():
        held = {}
        for name, (array, layout) in tensors.items():
            if tuple(array.shape) != tuple(layout.local_shape):
                raise CheckpointError(f"tensor {name}: local array has shape {list(array.shape)} but its "
                                      f"layout says {list(layout.local_shape)}")
            held[name] = (tuple(layout.global_shape), np.dtype(array.dtype).str,
                          [bounds(b.glob) for b in layout.blocks])
        if comm.rank != 0:
            return held, None
        name = f"{TMP_PREFIX}{step:07d}-{secrets.token_hex(4)}"
        if node_comm is not None:
            return held, name
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, name)
        os.mkdir(tmp)
        return held, tmp

    answers = collective(comm, work, share=True)
    if node_comm is None:
        return [held for held, _ in answers], answers[0][1]
    tmp = os.path.join(directory, answers[0][1])

    def make() -> None:
        if node_comm.rank != 0:
            return
        os.makedirs(directory, exist_ok=True)
        try:
            os.mkdir(tmp)
        except FileExistsError:  # the name is new: another node's leader made it on the same disk
            raise CheckpointError(f"{directory} is one filesystem that several nodes see, not node-local disks "
                                  "(another node made this save's directory there): set checkpoint.location to "
                                  "\"shared\" or \"auto\"") from None

    collective(comm, make)
    return [held for held, _ in answers], tmp


def _assignment(holdings: list[dict], storage: str, tmp: str, rank: int) -> dict[str, StoredTensor]:
    """Who writes what (`assign_writers`); an assignment that fails removes the temporary directory
    (on rank 0; node-local: `rank` is the rank on the node, and each node's leader removes its own)."""
    try:  # the same input everywhere: it fails (or not) on every rank alike
        assignment = assign_writers(holdings)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return in_shared_file(assignment) if storage == SHARED else assignment


def _write_files(tmp: str, assignment: dict[str, StoredTensor], items: list[Item], failed: Exception | None,
                 meta: dict, rank: int, writer: int) -> tuple[dict, dict]:
    """This rank's part of a per-rank save: its rank file (when it writes blocks) and, on the index
    writer, the index. No MPI here: this may run in the background thread. Returns its files'
    manifest entries and its blocks' extents."""
    if failed is not None:
        raise failed
    files, extents = {}, {}
    # The index writer writes it in a second thread, beside its own data: HDF5 and h5py hold
    # the GIL there while the data's pwrite, checksums and fsync release it.
    index = Background(functools.partial(_write_index, tmp, assignment, meta)) if rank == writer else None
    try:
        if items:
            files[rank_file_name(rank)], extents = write_rank_file(os.path.join(tmp, rank_file_name(rank)), items)
    finally:
        if index is not None:  # joined whatever happens: a thread left inside h5py hangs the exit
            index.join()
    if index is not None:
        files[INDEX] = index.result()
    return files, extents


def _write_index(tmp: str, assignment: dict[str, StoredTensor], meta: dict) -> dict:
    """The per-rank index file, durable; returns its manifest entry."""
    data = index_bytes(assignment, meta)
    with open(os.path.join(tmp, INDEX), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _save_shared(path: str, assignment: dict[str, StoredTensor], items: list[Item], failed: Exception | None,
                 meta: dict, commit: "_Commit", comm: Communicator) -> str:
    """`save` for storage="shared": the index file holds the data, written collectively (MPI-IO)."""
    # What every rank must write identically: rank 0's meta (`meta`), the crc32 of every unchunked block.
    crcs: dict[str, int] = {}
    for part in comm.all_gather_object({name: crc32(data) for _, name, data in items
                                        if chunk_shape(data.shape, data.dtype.itemsize) is None}):
        crcs.update(part)
    nbytes = sum(prod(t.shape) * np.dtype(t.dtype).itemsize for t in assignment.values())

    # The snapshot, the free-space check and the write fail together: a rank that raised before a
    # collective write would leave the others waiting in it.
    def check():
        if failed is not None:
            raise failed
        if comm.rank == 0:
            check_space(path, nbytes, len(assignment))

    collective(comm, check)
    digest = collective(comm, lambda: write_shared(path, assignment, items, json.dumps(meta), crcs, comm.io_comm()))
    if comm.rank == 0:
        fsync_path(path)
    return commit.finish({INDEX: {"size": os.path.getsize(path), "attrs_sha256": digest}}, {})


@dataclass
class _Commit:
    """The end of a save (collective): rank 0 writes the manifest, renames the temporary directory
    to `step-NNNNNNN` and moves `latest`, checked collectively; then every rank prunes.
    Node-local (`node_comm`): rank 0 writes the manifest, every file is copied to every node, then
    each node's leader renames and moves `latest` on its disk, and each node's ranks prune it."""

    directory: str
    tmp: str
    step: int
    keep: int | None
    storage: str
    assignment: dict[str, StoredTensor]
    meta: dict
    comm: Any
    node_comm: Any = None

    def written(self, written: Callable[[], tuple[dict, dict]]) -> str:
        """Commit a per-rank save once every rank's files are (`written` joins this rank's writer)."""
        parts = collective(self.comm, written, share=True, patient=True)
        return self.finish({k: v for files, _ in parts for k, v in sorted(files.items())},
                           {k: v for _, extents in parts for k, v in extents.items()})

    def finish(self, file_table: dict, extents: Mapping[tuple, Extent]) -> str:
        """Commit, given every file's manifest entry and every rank-file block's extent; returns the path."""
        if self.node_comm is not None:
            return self._finish_node_local(file_table, extents)
        work = functools.partial(self._manifest_and_rename, file_table, extents)
        final, doomed, shards = collective(self.comm, work, share=True, patient=True)[0]
        prune(doomed, shards, self.comm)
        return final

    def _manifest_and_rename(self, file_table: dict, extents: Mapping[tuple, Extent]) -> tuple | None:
        if self.comm.rank != 0:
            return None
        self._manifest(file_table, extents)
        final, doomed = commit_dir(self.directory, self.tmp, self.step, self.keep)
        return final, doomed, doomed_shards(doomed)

    def _manifest(self, file_table: dict, extents: Mapping[tuple, Extent]) -> None:
        """Rank 0: the manifest, durable with the directory's entries."""
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "storage": self.storage,
                    "meta": self.meta, "files": file_table, "tensors": _tensor_table(self.assignment, extents)}
        _write_json(os.path.join(self.tmp, MANIFEST), dict(manifest, sha256=manifest_digest(manifest)))
        fsync_path(self.tmp)

    def _finish_node_local(self, file_table: dict, extents: Mapping[tuple, Extent]) -> str:
        """Commit on node-local disks: manifest (rank 0), every file to every node, then each node's
        leader commits its copy and each node's ranks prune it; returns this rank's path."""
        collective(self.comm, lambda: self._manifest(file_table, extents) if self.comm.rank == 0 else None,
                   patient=True)
        replicate(self.tmp, self.comm, self.node_comm)

        def commit() -> tuple | None:
            if self.node_comm.rank != 0:
                return None
            _, doomed = commit_dir(self.directory, self.tmp, self.step, self.keep)
            return doomed, doomed_shards(doomed)

        mine = collective(self.comm, commit, patient=True)
        doomed, shards = self.node_comm.broadcast_object(mine, root=0)
        prune(doomed, shards, self.node_comm)
        return os.path.join(self.directory, step_dir_name(self.step))


def _tensor_table(assignment: dict[str, StoredTensor], extents: Mapping[tuple, Extent]) -> dict:
    """The manifest's tensor table: the assignment, each rank-file block with its `Extent`."""
    return {name: {"shape": list(t.shape), "dtype": t.dtype,
                   "blocks": [dict(b.to_json(), **(extents[(b.file, b.dataset)].to_json()
                                                  if (b.file, b.dataset) in extents else {}))
                              for b in t.blocks]} for name, t in assignment.items()}


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
