"""Row-sparse gradient synchronisation: an untied embedding's gradient sent as (row id, row) pairs.

With `model.tie_embeddings = false` the gradient of wte [V, C] (a tp rank's vocabulary shard
[ceil(V/tp), C] under tensor parallelism) is the lookup's scatter-add: on one rank it is nonzero
only in the k rows of the tokens its micro-batches held (`Parameter.sparse_grad`). DDP (ZeRO
stage 0, no compression, more than one replica) keeps such a parameter out of its dense buckets
and syncs it here once per step, after the buckets (`SparseRows.reduce`):

1. each rank finds its nonzero rows, k of them (a looked-up row whose gradient is exactly zero
   adds nothing to the sum, so leaving it out changes nothing), and the group all-gathers the
   counts (8 bytes per rank);
2. every rank takes the same decision from the same counts (`choose_sparse`): sparse when the
   mean bytes a rank sends for the pairs, (n-1)/n sum_r k_r (C s + 8), are fewer than the
   dense ring all-reduce's 2 (n-1)/n V C s (s = bytes per element, 8 = an int64 row id;
   `sparse_bytes`, `dense_bytes`); `train.sparse_embedding = "never"` always takes the dense path;
3. sparse: an all-gather-v of the ids and one of the rows (`Communicator.all_to_all_v`, each
   rank's k rows to every peer: (n-1) k (C s + 8) bytes leave a rank of k rows); the dense
   gradient is rebuilt as zeros plus every rank's rows added in rank order, then divided by n,
   the same average the dense all-reduce gives up to the order of the additions (float64:
   rounding). Dense: the all-reduce (`op="avg"`) of the whole array, as a bucket would.

Each step's figures (the path taken, the bytes this rank sent for the parameter, both formulas)
are kept in `SparseRows.last` and the totals in `SparseRows.steps` (`DDP.embedding_sync`), where
the data-parallel bytes are accounted: the collectives run on the gradient group, whose counters
(`DataParallel.sync_bytes`) include them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpar import backend
from hpcpar.errors import ConfigError
from hpcpar.runtime.comm import bytes_sent

# train.sparse_embedding: auto = choose each step by bytes, never = always dense.
SPARSE_MODES = ("auto", "never")
ID_BYTES = 8  # a row id travels as int64


def dense_bytes(rows: int, row_bytes: int, n: int) -> float:
    """Bytes one rank sends to all-reduce a [rows, ...] gradient of `row_bytes` per row over n
    ranks (ring): 2 (n-1)/n rows row_bytes."""
    return bytes_sent("all_reduce", rows * row_bytes, n)


def sparse_bytes(counts, row_bytes: int, n: int) -> float:
    """Mean bytes a rank sends to all-gather the (id, row) pairs of `counts` rows per rank:
    (n-1)/n sum(counts) (row_bytes + 8); rank r itself sends (n-1) counts[r] (row_bytes + 8)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * float(sum(int(c) for c in counts)) * (row_bytes + ID_BYTES)


def choose_sparse(mode: str, counts, rows: int, row_bytes: int, n: int) -> bool:
    """Whether a step with `counts` touched rows per rank (every rank's, rank order: the same list
    everywhere, so the same answer) sends pairs: mode "auto" and fewer bytes than dense."""
    if mode not in SPARSE_MODES:
        raise ConfigError(f"train.sparse_embedding={mode!r} is not one of " + ", ".join(map(repr, SPARSE_MODES)))
    return mode == "auto" and n > 1 and sparse_bytes(counts, row_bytes, n) < dense_bytes(rows, row_bytes, n)


class SparseRows:
    """One row-sparse parameter's gradient buffer and its per-step sync over `comm` (module doc).

    Args:
        param: the Parameter (`sparse_grad`), local array [rows, ...].
        comm: the gradient group (dp x cp, or the replica's group under local SGD).
        mode: "auto" or "never" (`SPARSE_MODES`).

    Attributes:
        grad: the gradient buffer, zeros each step (`begin_step`), `param.grad` points at it;
            after `reduce` the average over `comm`.
        last: the last step's figures: "sparse" (bool), "rows" (this rank's k), "counts" (every
            rank's), "sent" (bytes this rank sent for the parameter, counts included),
            "dense_bytes" and "sparse_bytes" (the formulas, mean per rank).
        steps: {"sparse": steps sent as pairs, "dense": steps all-reduced}.
    """

    def __init__(self, param: Any, comm, mode: str):
        if mode not in SPARSE_MODES:
            raise ConfigError(f"train.sparse_embedding={mode!r} is not one of " + ", ".join(map(repr, SPARSE_MODES)))
        self.param, self.comm, self.mode = param, comm, mode
        self.grad = backend.array_module(param.data).zeros_like(param.data)
        self.row_bytes = int(np.prod(param.data.shape[1:], dtype=np.int64)) * param.data.dtype.itemsize
        self.last: dict = {}
        self.steps = {"sparse": 0, "dense": 0}
        param.grad = self.grad

    def begin_step(self) -> None:
        """Zero the buffer and point `param.grad` at it (backward accumulates into it)."""
        self.grad.fill(0)
        self.param.grad = self.grad

    def reduce(self) -> None:
        """Average the gradient over `comm`, as pairs or dense (module doc; collective)."""
        g = self.param.grad
        if g is not self.grad:  # someone replaced .grad: take its values into the buffer
            self.grad[...] = g
            self.param.grad = g = self.grad
        xp = backend.array_module(g)
        n, rows = self.comm.size, g.shape[0]
        flat = g.reshape(rows, -1)
        ids = backend.to_host(xp.flatnonzero(xp.any(flat != 0, axis=1))).astype(np.int64)
        before = self.comm.bytes_sent_total()
        counts = [int(c) for c in self.comm.all_gather(np.array([ids.size], dtype=np.int64))]
        sparse = choose_sparse(self.mode, counts, rows, self.row_bytes, n)
        if sparse:
            mine = [ids.size] * n  # my rows to every rank (an all-gather-v)
            all_ids = self.comm.all_to_all_v(np.tile(ids, n), mine, counts)
            all_rows = self.comm.all_to_all_v(xp.tile(flat[xp.asarray(ids)], (n, 1)), mine, counts)
            flat[...] = 0
            at = 0
            for c in counts:  # rank order; a rank's ids are distinct, so += adds each row once
                flat[xp.asarray(all_ids[at:at + c])] += all_rows[at:at + c]
                at += c
            g /= n
        else:
            self.comm.iall_reduce(g, op="avg").wait()  # in place
        self.steps["sparse" if sparse else "dense"] += 1
        self.last = {"sparse": sparse, "rows": int(ids.size), "counts": counts,
                     "sent": self.comm.bytes_sent_total() - before,
                     "dense_bytes": dense_bytes(rows, self.row_bytes, n),
                     "sparse_bytes": sparse_bytes(counts, self.row_bytes, n)}
