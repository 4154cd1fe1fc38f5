"""Checkpoint tools for one process, on any machine: `info` (what a checkpoint holds), `verify`
(every byte of it checked), `export` (every global tensor to one .npz) and `as_dtype`.

They read checkpoints without MPI (loading over a `SoloCommunicator`), so the `hpcpar ckpt`
verbs run on a login node.
"""

from __future__ import annotations

import json
import os

import h5py
import numpy as np

from hpcpar.checkpoint.directory import resolve
from hpcpar.checkpoint.format import (INDEX, SHARED, StoredBlock, StoredTensor, manifest_table, read_index,
                                      read_manifest, read_table, storage_of)
from hpcpar.checkpoint.load import RawBlock, load, read_checked
from hpcpar.data.untrusted import check_hdf5
from hpcpar.errors import CheckpointError
from hpcpar.layout import Layout
from hpcpar.runtime.solo import SoloCommunicator


def _sharding_summary(t: StoredTensor) -> str:
    cut = sorted({d for b in t.blocks for d, (s, e) in enumerate(b.region) if (s, e) != (0, t.shape[d])})
    ranks = sorted({b.rank for b in t.blocks})
    if not ranks:
        return "no blocks"
    if not cut:
        return f"whole, rank {ranks[0]}"
    dims = ",".join(str(d) for d in cut)
    return f"{len(t.blocks)} blocks over dim {dims}, ranks {_ranges(ranks)}"


def _ranges(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1 \
        else ",".join(map(str, ranks))


def info(path: str) -> str:
    """Human-readable summary: step, meta, files, tensors with global shapes, dtypes and sharding."""
    ckpt = resolve(path)
    manifest = read_manifest(ckpt)
    table, meta = read_table(ckpt, manifest)
    total = sum(v["size"] for v in manifest["files"].values())
    lines = [f"checkpoint {ckpt}",
             f"  step {meta.get('step')}  saved by {meta.get('world_size')} rank(s) at "
             f"{meta.get('timestamp')}  hpcpar {meta.get('hpcpar_version')}  format v{meta.get('format_version')}",
             f"  files: {len(manifest['files'])} ({total / 2**20:.1f} MiB), storage {storage_of(manifest)}"]
    shown = {k: v for k, v in meta.items()
             if k not in ("step", "world_size", "timestamp", "hpcpar_version", "format_version")}
    for key, value in sorted(shown.items()):
        text = json.dumps(value) if not isinstance(value, str) else value
        if "\n" in text or len(text) > 100:
            text = f"<{len(text)} chars, {text.count(chr(10)) + 1} lines>"
        lines.append(f"  meta.{key}: {text}")
    width = max((len(n) for n in table), default=0)
    lines.append(f"  tensors: {len(table)}")
    for name, t in sorted(table.items()):
        lines.append(f"    {name:<{width}}  {str(list(t.shape)):<16} {np.dtype(t.dtype).name:<8} "
                     f"{_sharding_summary(t)}")
    return "\n".join(lines) + "\n"


def verify(path: str) -> list[str]:
    """Check a whole checkpoint; returns the problems found (one line each, naming the file).

    The manifest must match its sha256 (format v2); every file in it must exist with its recorded
    size; every block of every tensor is read back and checked (v2 rank files: every segment's
    checksum, and HDF5 must describe each block where the manifest says it is; fletcher32 chunks
    or crc32 otherwise), checking HDF5's metadata checksums on the way; the index must match its
    sha256, open, and list the manifest's tensors.
    """
    try:
        ckpt = resolve(path)
        manifest = read_manifest(ckpt)  # every file it names inside ckpt, or refused here
        holds: dict[str, list[tuple[str, StoredBlock, str]]] = {}  # file -> [(tensor, block, dtype)]
        for name, t in manifest_table(ckpt, manifest).items():
            for b in t.blocks:
                holds.setdefault(b.file, []).append((name, b, t.dtype))
    except CheckpointError as err:
        return [str(err)]
    problems = []
    for file, entry in sorted(manifest["files"].items()):
        names = list(dict.fromkeys(n for n, _, _ in holds.get(file, []))) or ["the index"]
        what = f"{', '.join(names[:3])}{f' +{len(names) - 3} more' if len(names) > 3 else ''}"
        full = os.path.join(ckpt, file)
        if not os.path.exists(full):
            problems.append(f"{full}: missing (holds {what})")
        elif os.path.getsize(full) != entry["size"]:
            problems.append(f"{full}: {os.path.getsize(full)} bytes, manifest says {entry['size']} "
                            f"(truncated?; holds {what})")
        elif file == INDEX:
            try:
                table, _ = read_index(ckpt, manifest)
                if sorted(table) != sorted(manifest["tensors"]):
                    problems.append(f"{full}: lists other tensors than the manifest (corrupt index)")
                elif storage_of(manifest) == SHARED:  # the index holds the data: read all of it back
                    whole = [(n, StoredBlock(INDEX, n, tuple((0, k) for k in t.shape), -1), t.dtype)
                             for n, t in sorted(table.items())]
                    problems.extend(_verify_rank_file(full, whole))
            except CheckpointError as err:
                problems.append(str(err))
        else:
            problems.extend(_verify_rank_file(full, holds.get(file, [])))
    return problems


def _verify_rank_file(full: str, blocks: list[tuple[str, StoredBlock, str]]) -> list[str]:
    """Read every block of one file back, checking every checksum; the first failure per file is
    reported, naming the tensor and dataset (and for a v2 block the rows that fail). The file's
    links and virtual sources must stay in its directory (`check_hdf5`) before any is followed."""
    tensor = dataset = "?"
    fd = None
    try:
        with h5py.File(full, "r", locking=False) as f:
            check_hdf5(f, os.path.dirname(full), full, CheckpointError)
            for tensor, b, dtype in blocks:
                dataset = b.dataset
                ds = f[dataset]
                if b.extent is None:
                    read_checked(ds, tuple(e - s for s, e in b.region))
                    continue
                if ds.chunks is not None or ds.id.get_offset() != b.extent.offset or \
                        ds.shape != tuple(e - s for s, e in b.region) or ds.dtype != np.dtype(dtype):
                    raise ValueError("HDF5 describes the block otherwise than the manifest (layout, offset, "
                                     "shape or dtype)")
                fd = os.open(full, os.O_RDONLY) if fd is None else fd
                RawBlock(b, np.dtype(dtype), fd, os.fstat(fd).st_size).check()
    except CheckpointError as err:
        return [str(err)]
    except (OSError, KeyError, ValueError, TypeError, RuntimeError, OverflowError) as err:
        return [f"{full}: corrupt: checksum or structure error reading tensor {tensor} (dataset {dataset}): {err}"]
    finally:
        if fd is not None:
            os.close(fd)
    return []


def as_dtype(arrays: dict, dtype: str | None) -> dict:
    """Every floating-point array of `arrays` in `dtype` (None: as they are); others unchanged."""
    if dtype is None:
        return arrays
    return {k: a.astype(dtype) if a.dtype.kind == "f" else a for k, a in arrays.items()}


def export(path: str, out_npz: str, dtype: str | None = None) -> list[str]:
    """Write every global tensor to one .npz (keys are the global names), floating-point ones in
    `dtype` when given. Returns the names."""
    if dtype == "bfloat16":  # np.savez writes it as raw 2-byte voids that np.load cannot type again
        raise CheckpointError("ckpt export --dtype bfloat16 needs --format safetensors (an .npz cannot record "
                              "bfloat16); or export --dtype float16 / float32 to .npz")
    ckpt = resolve(path)
    table, _ = read_table(ckpt, read_manifest(ckpt))
    arrays, _ = load(ckpt, {name: Layout.replicated(t.shape) for name, t in table.items()}, SoloCommunicator())
    np.savez(out_npz, **as_dtype(arrays, dtype))
    return sorted(arrays)
