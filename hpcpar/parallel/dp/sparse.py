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

ZeRO-1/2 (`OwnedRows`, the shard group's n ranks; ZeRO-3: fsdp.py's `FlatParameter.rows`, the
same exchange, `reduce_to_owners`): rank r owns rows [r R, (r + 1) R) of wte,
R = ceil(V/n) (`row_owners`); its optimizer segment of wte is those rows (wte has a flat buffer
[n R, ...] of its own, padded like a bucket, so `zero.Part` cuts it at the row partition). Each
step the owner of each row receives only its rows:

1. each rank splits its k nonzero rows by owner, k_{r,d} rows for owner d, and the shard group
   all-gathers the count rows (8 n bytes per rank): the [n, n] matrix k, the same everywhere;
2. sparse when the mean bytes a rank sends, 1/n sum_{r != d} k_{r,d} (C s + 8) (rows a rank owns
   itself never leave it), are fewer than the dense reduce-scatter's (n-1)/n n R C s
   (`owned_sparse_bytes`, `owned_dense_bytes`);
3. sparse: an all-to-all-v of the ids and one of the rows, each to its owner; the owner sums them
   in rank order into zeros [R, ...] and divides by n. Dense: the reduce-scatter (`op="avg"`) of
   the padded gradient, as a bucket would. With HSDP the owner's rows are then averaged over the
   replicas (an all-reduce, as `ReduceScatterAvg` does). The optimizer step on the owner's rows
   and the all-gather of the updated rows are ZeRO's, unchanged (the all-gather stays dense).

Each step's figures (the path taken, the bytes this rank sent for the parameter, both formulas)
are kept in `last` and the totals in `steps` (`BucketedDataParallel.embedding_sync`), where
the data-parallel bytes are accounted: the collectives run on the gradient group, whose counters
(`DataParallel.sync_bytes`) include them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpar import backend
from hpcpar.errors import ConfigError
from hpcpar.parallel.dp.buckets import BucketAssignment, Slot
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


def check_mode(mode: str) -> None:
    """`mode` is one of `SPARSE_MODES`, else a one-line ConfigError."""
    if mode not in SPARSE_MODES:
        raise ConfigError(f"train.sparse_embedding={mode!r} is not one of " + ", ".join(map(repr, SPARSE_MODES)))


class _RowGradient:
    """What `SparseRows` and `OwnedRows` share: the buffer `grad` that `param.grad` points at,
    zeroed each step, and the figures `last` (the last step's) and `steps` (per path)."""

    def __init__(self, param: Any, comm, mode: str, grad):
        check_mode(mode)
        self.param, self.comm, self.mode, self.grad = param, comm, mode, grad
        self.last: dict = {}
        self.steps = {"sparse": 0, "dense": 0}
        param.grad = grad

    def begin_step(self) -> None:
        """Zero the buffer and point `param.grad` at it (backward accumulates into it)."""
        self.grad.fill(0)
        self.param.grad = self.grad

    def _gathered_grad(self):
        """The buffer, holding the step's gradient (someone who replaced `.grad`: its values)."""
        if self.param.grad is not self.grad:
            self.grad[...] = self.param.grad
            self.param.grad = self.grad
        return self.grad


def choose_sparse(mode: str, counts, rows: int, row_bytes: int, n: int) -> bool:
    """Whether a step with `counts` touched rows per rank (every rank's, rank order: the same list
    everywhere, so the same answer) sends pairs: mode "auto" and fewer bytes than dense."""
    check_mode(mode)
    return mode == "auto" and n > 1 and sparse_bytes(counts, row_bytes, n) < dense_bytes(rows, row_bytes, n)


class SparseRows(_RowGradient):
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
        super().__init__(param, comm, mode, backend.array_module(param.data).zeros_like(param.data))
        self.row_bytes = int(np.prod(param.data.shape[1:], dtype=np.int64)) * param.data.dtype.itemsize

    def reduce(self) -> None:
        """Average the gradient over `comm`, as pairs or dense (module doc; collective)."""
        g = self._gathered_grad()
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


def row_owners(rows: int, n: int) -> list[tuple[int, int]]:
    """Rank r's rows [lo, hi) of a [rows, ...] array over n ranks: R = ceil(rows/n) each, the
    last ones fewer (or none)."""
    per = -(-rows // n)
    return [(min(rows, r * per), min(rows, (r + 1) * per)) for r in range(n)]


def owned_dense_bytes(rows: int, row_bytes: int, n: int) -> float:
    """Bytes one rank sends to reduce-scatter a [n R, ...] (padded) gradient: (n-1)/n n R row_bytes."""
    return bytes_sent("reduce_scatter", n * -(-rows // n) * row_bytes, n)


def owned_sparse_bytes(matrix, row_bytes: int) -> float:
    """Mean bytes a rank sends for the (id, row) pairs of `matrix` [n, n] (rows of sender r for
    owner d): 1/n sum_{r != d} k_{r,d} (row_bytes + 8)."""
    k = np.asarray(matrix, dtype=np.int64)
    n = k.shape[0]
    return 0.0 if n <= 1 else float(k.sum() - np.trace(k)) / n * (row_bytes + ID_BYTES)


class OwnedRows(_RowGradient):
    """ZeRO-1/2: a row-sparse parameter's gradient, each row's average delivered to its owner only
    (module doc). Looks like a gradient bucket to `zero.Part`: `assignment` (one slot, padded to
    n R rows), `params`, `part` (after `reduce`: this rank's averaged rows, flat [R row elements]).

    Args:
        name: the parameter's global name; param: the Parameter (`sparse_grad`), [rows, ...].
        comm: the shard group (n ranks); replicate: HSDP's replica group (or one rank).
        mode: "auto" or "never" (`SPARSE_MODES`).

    Attributes:
        grad: [rows, ...], the unreduced local gradient (a view of a flat buffer [n R ...] whose
            padding stays zero), `param.grad` points at it.
        last, steps: as `SparseRows`' ("counts": the [n, n] matrix as lists).
    """

    def __init__(self, name: str, param: Any, comm, replicate, mode: str):
        self.params = [param]
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        n, rows = comm.size, param.data.shape[0]
        self.rows, self.width = rows, int(np.prod(param.data.shape[1:], dtype=np.int64))
        self.row_bytes = self.width * param.data.dtype.itemsize
        self.per = -(-rows // n)
        self.assignment = BucketAssignment((Slot(name, 0, 0, rows * self.width),), n * self.per * self.width,
                                           str(param.data.dtype))
        xp = backend.array_module(param.data)
        self._flat = xp.zeros(self.assignment.size, dtype=param.data.dtype)
        super().__init__(param, comm, mode, self._flat[:rows * self.width].reshape(param.data.shape))
        self.part_buffer = xp.zeros(self.per * self.width, dtype=param.data.dtype)
        self.part = None

    def begin_step(self) -> None:
        super().begin_step()
        self.part = None

    def reduce(self) -> None:
        """Leave this rank's rows of the average in `part`, as pairs or dense (module doc; collective)."""
        self._gathered_grad()
        self.last = reduce_to_owners(self._flat, self.rows, self.width, self.comm, self.mode, self.part_buffer)
        if self.replicate is not None:
            self.replicate.iall_reduce(self.part_buffer, op="avg").wait()  # in place
        self.part = self.part_buffer
        self.steps["sparse" if self.last["sparse"] else "dense"] += 1

    def uncompressed_bytes(self) -> float:
        """The dense path's bytes per step: the reduce-scatter, HSDP's all-reduce of the rows, the
        all-gather of the updated rows (ZeRO's, counted by the bucket formula)."""
        part = self.per * self.row_bytes
        return (owned_dense_bytes(self.rows, self.row_bytes, self.comm.size)
                + (bytes_sent("all_reduce", part, self.replicate.size) if self.replicate is not None else 0.0)
                + bytes_sent("all_gather", part, self.comm.size))


def reduce_to_owners(flat, rows: int, width: int, comm, mode: str, out) -> dict:
    """Average a row-sparse gradient over `comm`, each owner receiving its rows only (module doc).

    Args:
        flat: [n R width], the local gradient, rows [0, rows) of `width` elements back to back,
            the padding zero (R = ceil(rows/n)).
        out: [R width], receives this rank's rows [rank R, (rank + 1) R) of the average.
    Returns the step's figures (`OwnedRows.last`). Collective over `comm`.
    """
    xp = backend.array_module(flat)
    n, per = comm.size, -(-rows // comm.size)
    dense, row_bytes = flat[:rows * width].reshape(rows, width), width * flat.dtype.itemsize
    ids = backend.to_host(xp.flatnonzero(xp.any(dense != 0, axis=1))).astype(np.int64)  # ascending
    mine = np.bincount(ids // per, minlength=n).astype(np.int64)  # rows for each owner
    before = comm.bytes_sent_total()
    matrix = comm.all_gather(mine[None, :]).reshape(n, n)   # [sender, owner]
    sparse = mode == "auto" and owned_sparse_bytes(matrix, row_bytes) < owned_dense_bytes(rows, row_bytes, n)
    if sparse:
        got = matrix[:, comm.rank]
        all_ids = comm.all_to_all_v(ids, mine, got)  # ascending ids: grouped by owner, in rank order
        all_rows = comm.all_to_all_v(dense[xp.asarray(ids)], mine, got)
        part = out.reshape(per, width)
        part[...] = 0
        lo, at = row_owners(rows, n)[comm.rank][0], 0
        for c in got:  # rank order; a rank's ids are distinct, so += adds each row once
            part[xp.asarray(all_ids[at:at + c] - lo)] += all_rows[at:at + c]
            at += c
        part /= n
    else:
        comm.ireduce_scatter(flat, dim=0, op="avg", out=out).wait()
    return {"sparse": sparse, "rows": int(ids.size), "counts": matrix.tolist(),
            "sent": comm.bytes_sent_total() - before, "dense_bytes": owned_dense_bytes(rows, row_bytes, n),
            "sparse_bytes": owned_sparse_bytes(matrix, row_bytes)}
