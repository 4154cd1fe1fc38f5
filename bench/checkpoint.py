"""Checkpoint save/load throughput vs plain NumPy files, side by side in one run.

    mpiexec -n 4 python bench/checkpoint.py [--mib 256] [--repeats 7] [--dir /scratch/x]

`--mib` MiB of float32 tensors (16 tensors, split on dim 0 across the ranks) are saved and
loaded with `hpcpar.checkpoint` (format v2: HDF5 rank files whose blocks are written with
pwrite and read with pread, a checksum per ~1 MiB segment, index + sha256-checked manifest,
one fsync per file, atomic commit, the previous checkpoint pruned; every load checks every
segment it reads) and, as the reference, with `np.save` + fsync / `np.load` of the same local
arrays into one file per rank (np.load checks nothing). A load keeps every array it read, as
a load must ("numpy load"); "numpy load, arrays dropped" is the reference of earlier runs,
which dropped each array as soon as it was read, so its 4 MiB buffer was recycled: no page
faults, cache-hot (informational). The resharded load reads the checkpoint split on dim 1
instead of dim 0 (every rank reads every stored block, a quarter of each row). When h5py is
built with MPI (parallel HDF5) the shared storage (`checkpoint.format = "shared"`: one file
written collectively through MPI-IO) is measured too ("hpcpar ... shared" rows). Throughput
is global bytes / wall time of the slowest rank (barrier to barrier); best of `--repeats`
(the machine may be shared: noisy). Reads are mostly served from the page cache for both.
Results are printed and merged into bench/results/checkpoint.json under "ranks=N".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import h5py
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hpcpar.checkpoint.format import FORMAT_VERSION  # noqa: E402
from hpcpar.checkpoint.load import load  # noqa: E402
from hpcpar.checkpoint.save import save  # noqa: E402
from hpcpar.runtime.comm import Communicator  # noqa: E402
from hpcpar.layout import Layout  # noqa: E402

N_TENSORS = 16


def timed(comm, fn) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    comm.Barrier()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="total MiB of float32 tensors")
    parser.add_argument("--repeats", type=int, default=7, help="best of N (the machine may be shared)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir in /tmp)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "checkpoint.json"))
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    world = Communicator(comm, "world")  # what hpcpar's checkpoint functions take
    rank, size = comm.Get_rank(), comm.Get_size()
    base = comm.bcast(tempfile.mkdtemp(prefix="hpcpar-bench-ckpt-", dir=args.dir) if rank == 0 else None)

    cols = 1024  # each tensor [rows, 1024] float32, rows a multiple of the world size
    rows = max(size, (args.mib << 20) // (N_TENSORS * cols * 4) // size * size)
    nbytes = N_TENSORS * rows * cols * 4
    rng = np.random.default_rng(rank)
    tensors = {}
    for i in range(N_TENSORS):
        layout = Layout.split((rows, cols), 0, rank, size)
        tensors[f"model/layer{i}.weight"] = (rng.standard_normal(layout.local_shape, dtype=np.float32), layout)
    wanted = {name: layout for name, (_, layout) in tensors.items()}
    resharded = {name: Layout.split((rows, cols), 1, (rank + 1) % size, size) for name in tensors}
    ckpt_dir = os.path.join(base, "ckpt")
    npy_file = os.path.join(base, f"numpy-rank{rank:05d}.npy")

    def np_save():
        with open(npy_file, "wb") as f:
            for array, _ in tensors.values():
                np.save(f, array)
            f.flush()
            os.fsync(f.fileno())

    def np_load():  # keeps every array, as a load does
        with open(npy_file, "rb") as f:
            return [np.load(f) for _ in tensors]

    def np_load_dropped():  # each array dropped as soon as read: one recycled, cache-hot buffer
        with open(npy_file, "rb") as f:
            for _ in tensors:
                np.load(f)

    def async_save():
        t0 = time.perf_counter()
        handle = save(ckpt_dir, step, tensors, {}, world, keep=1, async_save=True)
        # What training waits for before it may go on: the snapshot and the writers' assignment.
        times["hpcpar async: call returns"].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        handle.wait()

    shared = h5py.get_config().mpi
    shared_dir = os.path.join(base, "ckpt-shared")
    times: dict[str, list[float]] = {k: [] for k in
                                     ("numpy save", "hpcpar save", "hpcpar save async", "hpcpar async: call returns",
                                      "numpy load", "numpy load, arrays dropped", "hpcpar load",
                                      "hpcpar load resharded")}
    if shared:
        times.update({k: [] for k in ("hpcpar save shared", "hpcpar load shared", "hpcpar load shared resharded")})
    for step in range(args.repeats):
        times["numpy save"].append(timed(comm, np_save))
        times["hpcpar save"].append(timed(comm, lambda: save(ckpt_dir, step, tensors, {}, world, keep=1)))
        times["hpcpar save async"].append(timed(comm, async_save))
        times["numpy load"].append(timed(comm, np_load))
        times["numpy load, arrays dropped"].append(timed(comm, np_load_dropped))
        times["hpcpar load"].append(timed(comm, lambda: load(ckpt_dir, wanted, world)))
        times["hpcpar load resharded"].append(timed(comm, lambda: load(ckpt_dir, resharded, world)))
        if shared:
            times["hpcpar save shared"].append(timed(comm, lambda: save(shared_dir, step, tensors, {}, world,
                                                                keep=1, storage="shared")))
            times["hpcpar load shared"].append(timed(comm, lambda: load(shared_dir, wanted, world)))
            times["hpcpar load shared resharded"].append(timed(comm, lambda: load(shared_dir, resharded, world)))

    comm.Barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        best = {k: min(v) for k, v in times.items()}
        gbs = {k: nbytes / t / 1e9 for k, t in best.items()}
        ratio = {"save": gbs["hpcpar save"] / gbs["numpy save"],
                 "load": gbs["hpcpar load"] / gbs["numpy load"],
                 "load resharded": gbs["hpcpar load resharded"] / gbs["numpy load"],
                 "load vs numpy load, arrays dropped": gbs["hpcpar load"] / gbs["numpy load, arrays dropped"]}
        if shared:
            ratio.update({"save shared": gbs["hpcpar save shared"] / gbs["numpy save"],
                          "load shared": gbs["hpcpar load shared"] / gbs["numpy load"],
                          "load shared resharded": gbs["hpcpar load shared resharded"] / gbs["numpy load"]})
        print(f"checkpoint throughput: {nbytes / 2**20:.0f} MiB float32 in {N_TENSORS} tensors, "
              f"{size} rank(s), best of {args.repeats}")
        print(f"{'method':<32}{'seconds':>10}{'GB/s':>10}{'vs numpy':>10}")
        for k in times:
            ref = gbs["numpy load" if "load" in k else "numpy save"]
            print(f"{k:<32}{best[k]:>10.3f}{gbs[k]:>10.2f}{gbs[k] / ref:>10.2f}")
        if not shared:
            print("shared storage not measured: h5py is not built with MPI (parallel HDF5)")
        result = {"ranks": size, "mpi": MPI.Get_library_version().split(",")[0].strip(),
                  "format_version": FORMAT_VERSION, "load_average": os.getloadavg()[0],
                  "shared_storage": shared, "bytes": nbytes, "tensors": N_TENSORS, "repeats": args.repeats,
                  "seconds_best": best, "gb_per_s": gbs, "ratio_vs_numpy": ratio,
                  "seconds_all": times}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        merged = {}
        if os.path.exists(args.out):
            with open(args.out) as f:
                merged = json.load(f)
        merged[f"ranks={size}"] = result
        with open(args.out, "w") as f:
            json.dump(merged, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
