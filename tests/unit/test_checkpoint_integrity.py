"""Never silent garbage: a flipped byte anywhere in a checkpoint file is caught or harmless.

The save path computes no file digest of the rank files; integrity rests on the checksum of
every ~1 MiB segment of a block (kept in the manifest, which is checked against its own
sha256), HDF5's checksummed metadata (format 1.10) and the index's sha256 (in a shared-storage
checkpoint, where the index holds the data: fletcher32 chunks, crc32 of unchunkable blocks and
the sha256 of its JSON attributes). This flips bytes throughout a rank file, the index and the
manifest (every 31st offset) and loads everything: each load must raise CheckpointError or
return exactly the saved tensors and meta (a flip in bytes load never reads, e.g. a rank file's
HDF5 metadata or free space, changes nothing). `verify` must agree with load wherever load fails.
"""

import os

import h5py
import numpy as np
import pytest

from hpcpar.checkpoint.format import INDEX, MANIFEST
from hpcpar.checkpoint.load import load
from hpcpar.checkpoint.save import save
from hpcpar.checkpoint.tools import verify
from hpcpar.errors import CheckpointError
from hpcpar.layout import Layout
from hpcpar.runtime.comm import Communicator

COMM = Communicator.local()


def tensors():
    rng = np.random.default_rng(5)
    return {
        "model/w": rng.standard_normal((64, 40)),                  # rank file: contiguous, segment checksums
        "model/b": rng.standard_normal(40).astype(np.float32),
        "optim/count": np.array(11, dtype=np.int64),              # a scalar (shared file: contiguous + crc32)
        "optim/empty": np.zeros((0, 3)),
    }


@pytest.mark.parametrize("storage,file", [("per_rank", "rank-00000.h5"), ("per_rank", INDEX),
                                          ("per_rank", MANIFEST),
                                          pytest.param("shared", INDEX, marks=pytest.mark.skipif(
                                              not h5py.get_config().mpi, reason="h5py is not built with MPI: "
                                              "no shared-file checkpoints (parallel HDF5)"))])
def test_flipped_bytes_are_caught_or_harmless(tmp_path, storage, file):
    glob = tensors()
    path = save(str(tmp_path), 4, {n: (a, Layout.replicated(a.shape)) for n, a in glob.items()},
                   {"note": "integrity", "count": 12345}, COMM, storage=storage)
    wanted = {n: Layout.replicated(a.shape) for n, a in glob.items()}
    target = os.path.join(path, file)
    with open(target, "rb") as f:
        original = f.read()
    caught = silent = 0
    for offset in range(0, len(original), 31):
        damaged = bytearray(original)
        damaged[offset] ^= 0x5A
        with open(target, "wb") as f:
            f.write(damaged)
        try:
            got, meta = load(path, wanted, COMM)
        except CheckpointError:
            caught += 1
            assert verify(path), f"offset {offset}: load fails but verify finds nothing"
            continue
        same = all(got[n].dtype == a.dtype and np.array_equal(got[n], a) for n, a in glob.items())
        silent += not (same and meta["count"] == 12345 and meta["step"] == 4)
    with open(target, "wb") as f:
        f.write(original)
    assert silent == 0, f"{silent} flipped bytes in {file} changed what loads without an error"
    assert caught > 0
    assert verify(path) == []
