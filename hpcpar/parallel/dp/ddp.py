"""DDP (ZeRO stage 0): every replica keeps everything; whole gradient buckets are all-reduced.

Each dp x cp rank holds all parameters, their whole gradients and the whole optimizer state.
Every bucket is averaged in place over dp x cp (`AllReduceAvg`, or a compressor's all-reduce
form), so after `finish_backward` each `.grad` holds the averaged gradient and every replica
takes the identical optimizer step (PyTorch DDP, arXiv 2006.15704). A checkpoint gets every
parameter and its optimizer state whole from every replica, and writes each block once.

A row-sparse gradient (`Parameter.sparse_grad`: an untied wte) stays out of the buckets when
`sparse_embedding = "auto"`, there is more than one replica and no compressor: each step it is
averaged as (row id, row) pairs when those are fewer bytes than the dense all-reduce, else
dense (sparse.py; `embedding_sync` has the figures).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from hpcpar import backend
from hpcpar.runtime.comm import bytes_sent
from hpcpar.optim.optimizers import AdamW
from hpcpar.parallel.dp.bucketed import BucketedDataParallel
from hpcpar.parallel.dp.buckets import AllReduceAvg
from hpcpar.parallel.dp.clipping import counts_toward_norm
from hpcpar.parallel.dp.compression.compressors import Compression
from hpcpar.parallel.dp.sparse import SparseRows, dense_bytes
from hpcpar.state import key_of


class DDP(BucketedDataParallel):
    """Replicated data parallelism: bucketed all-reduce, the optimizer over whole parameters.

    Args: those of `BucketedDataParallel`, `make_optimizer`, which builds the optimizer from
    the list of parameters, and `sparse_embedding` ("auto" or "never", `train.sparse_embedding`).
    """

    shards_parts = False

    def __init__(self, named_params: Iterable[tuple[str, Any]], mesh, make_optimizer: Callable[[list], Any] = AdamW,
                 *, bucket_mb: float = 25.0, compression: Compression = Compression(), overlap: bool = True,
                 local_tied: bool = False, groups: tuple | None = None, sparse_embedding: str = "auto"):
        self.sparse_embedding = sparse_embedding  # read by `_sparse_rows` during the base's construction
        super().__init__(named_params, mesh, bucket_mb=bucket_mb, compression=compression, overlap=overlap,
                         local_tied=local_tied, groups=groups)
        self.optimizer = make_optimizer(list(self.params))
        # Replicas are identical after the average: dp rank 0 counts for all of them.
        self._norm_items = [p for p in self.params if counts_toward_norm(p, self.tp_rank)] if self.dp_rank == 0 else []

    def _plain_reduction(self) -> AllReduceAvg:
        return AllReduceAvg(self.dp_comm)

    def _sparse_rows(self, named: list[tuple[str, Any]]) -> list[SparseRows]:
        """The untied embedding's gradient, unless "never", one replica (nothing to sync; a
        parameter-server replica pushes its buckets) or compression (the buckets' own wire)."""
        if self.sparse_embedding == "never" or self.dp_comm.size == 1 or self.compressor is not None:
            return []
        return [SparseRows(p, self.dp_comm, self.sparse_embedding) for _, p in named
                if getattr(p, "sparse_grad", False)]

    def _grad_buffers(self) -> list:
        return [b.grad for b in self.buckets] + [r.grad for r in self._sparse]

    def uncompressed_bytes(self) -> float:
        """Bytes this rank sends per step to synchronise gradients without compression: an
        all-reduce of every bucket over dp x cp (`comm.bytes_sent`), and of a row-sparse gradient
        kept apart (its dense formula)."""
        return sum((bytes_sent("all_reduce", b.assignment.size * np.dtype(b.assignment.dtype).itemsize,
                               self.dp_comm.size) for b in self.buckets), 0.0) + sum(
            dense_bytes(r.grad.shape[0], r.row_bytes, self.dp_comm.size) for r in self._sparse)

    def _saved_tensors(self) -> dict[str, tuple[Any, Any]]:
        """Every parameter and its optimizer state, whole local tensors in the parameter's layout.
        Every replica gives them and the save writes each block once, copying (or moving to the
        host) only the blocks this rank writes: hence the live arrays."""
        tensors = {}
        for name, p in zip(self.names, self.params):
            key = key_of(p, name)
            tensors[f"model/{key}"] = (p.data, p.layout)
            for k, array in self.optimizer.state_of(p).items():
                tensors[f"optim/{key}/{k}"] = (array, p.layout)
        return tensors

    def _wanted_tensors(self, weights_only: bool) -> dict[str, Any]:
        wanted = {}
        for name, p in zip(self.names, self.params):
            key = key_of(p, name)
            wanted[f"model/{key}"] = p.layout
            if not weights_only:
                wanted.update({f"optim/{key}/{k}": p.layout for k in self.state_names()})
        return wanted

    def _take_tensors(self, arrays: dict[str, Any], step_count: int | None) -> None:
        for name, p in zip(self.names, self.params):
            p.data[...] = backend.to_device(arrays[f"model/{key_of(p, name)}"])
        if step_count is None:
            return
        xp = backend.array_module(*(p.data for p in self.params))
        for name, p in zip(self.names, self.params):
            for k, dst in self.optimizer.state_of(p).items():
                dst[...] = xp.asarray(arrays[f"optim/{key_of(p, name)}/{k}"])
        self.optimizer.step_count = int(step_count)
