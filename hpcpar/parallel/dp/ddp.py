"""DDP (ZeRO stage 0): every replica keeps everything; whole gradient buckets are all-reduced.

Each dp x cp rank holds all parameters, their whole gradients and the whole optimizer state.
Every bucket is averaged in place over dp x cp (`AllReduceAvg`, or a compressor's all-reduce
form), so after `finish_backward` each `.grad` holds the averaged gradient and every replica
takes the identical optimizer step (PyTorch DDP, arXiv 2006.15704).
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


class DDP(BucketedDataParallel):
    """Replicated data parallelism: bucketed all-reduce, the optimizer over whole parameters.

    Args: those of `BucketedDataParallel`, and `make_optimizer`, which builds the optimizer
    from the list of parameters.
    """

    shards_parts = False

    def __init__(self, named_params: Iterable[tuple[str, Any]], mesh, make_optimizer: Callable[[list], Any] = AdamW,
                 *, bucket_mb: float = 25.0, compression: Compression = Compression(), overlap: bool = True,
                 local_tied: bool = False, groups: tuple | None = None):
        super().__init__(named_params, mesh, bucket_mb=bucket_mb, compression=compression, overlap=overlap,
                         local_tied=local_tied, groups=groups)
        self.optimizer = make_optimizer(list(self.params))
        # Replicas are identical after the average: dp rank 0 counts for all of them.
        self._norm_items = [p for p in self.params if counts_toward_norm(p, self.tp_rank)] if self.dp_rank == 0 else []

    def _plain_reduction(self) -> AllReduceAvg:
        return AllReduceAvg(self.dp_comm)

    def _grad_buffers(self) -> list:
        return [b.grad for b in self.buckets]

    def uncompressed_bytes(self) -> float:
        """Bytes this rank sends per step to synchronise gradients without compression: an
        all-reduce of every bucket over dp x cp (`comm.bytes_sent`)."""
        return sum((bytes_sent("all_reduce", b.plan.size * np.dtype(b.plan.dtype).itemsize, self.dp_comm.size)
                   for b in self.buckets), 0.0)

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """{parameter name: {state name: array of the parameter's local shape}} (copies)."""
        names = self.state_names()
        return {n: {k: self.optimizer.state_of(p)[k].copy() for k in names} for n, p in zip(self.names, self.params)}

    def _load_state(self, state: dict[str, dict[str, Any]]) -> None:
        xp = backend.array_module(*(p.data for p in self.params))
        for n, p in zip(self.names, self.params):
            for k, dst in self.optimizer.state_of(p).items():
                dst[...] = xp.asarray(state[n][k])
