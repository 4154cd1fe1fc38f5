"""NumPy references of the gradient compressors, written from the papers' descriptions on one
process from every rank's input (shared by tests/unit/test_compression.py, on simulated ranks,
and tests/parallel/test_compression.py, under mpiexec), and the driver that runs a compressor's
steps on one rank.

Inputs are lists over ranks of `x` = gradient + the rank's error-feedback residual, flat `[size]`
(size a multiple of n = len(xs)); rank j owns part j, elements `[j m, (j + 1) m)`, m = size / n.
"""

from __future__ import annotations

import numpy as np


def run_steps(c, grads: list) -> list[tuple]:
    """Bucket 0 through compressor `c` (set up) for each gradient of this rank in `grads`, each
    step committed: per step (this rank's averaged part, the whole average, {kind: {key: array}}
    of the state the step computed (before commit), copied)."""
    out = []
    for g in grads:
        part = c.decompress(0, c.exchange(c.compress(0, g)).wait())
        whole = c.all_gather(0, part)
        pending = {"residual": getattr(c, "worker", None), "owner_residual": getattr(c, "owner", None)}
        state = {k: {i: a.copy() for i, a in r.pending.items()} for k, r in pending.items() if r is not None}
        if hasattr(c, "_next_q"):
            state["powersgd_q"] = {k: q.copy() for k, q in c._next_q.items()}
        out.append((part.copy(), np.array(whole, copy=True), state))
        c.commit()
    return out


# -- int8 -------------------------------------------------------------------------------------------

def ref_quantize(row, b: int) -> np.ndarray:
    """One row, block by block of b values: scale = absmax / 127 rounded to float32 (zero below
    float32's smallest normal), q = rint(x / scale) in [-127, 127]; the dequantized row q * scale in
    float32 or the row's wider dtype."""
    dt = np.result_type(np.float32, row.dtype)
    out = np.empty(row.size, dtype=dt)
    for lo in range(0, row.size, b):
        blk = row[lo:lo + b]
        s = np.float32(np.max(np.abs(blk)) / 127)
        s = np.float32(0) if s < np.finfo(np.float32).tiny else s
        q = np.clip(np.rint(blk.astype(dt) / dt.type(s)), -127, 127) if s > 0 else np.zeros(blk.size, dtype=dt)
        out[lo:lo + b] = q.astype(np.int8).astype(dt) * dt.type(s)
    return out


def ref_int8(xs: list, owners: list | None, b: int):
    """Both phases -> (whole average, new worker residuals, new owner residuals). Phase 1: every
    rank quantizes its row j for rank j; rank j sums the dequantized rows in rank order and averages
    (its part). Phase 2 (`owners` given: the all-reduce case): the part plus the owner's residual is
    quantized again, and the whole is the concatenation of the dequantized parts; without `owners`
    (ZeRO's reduce-scatter case) the whole is the concatenation of the averaged parts."""
    n, size = len(xs), xs[0].size
    m = size // n
    deq = [np.concatenate([ref_quantize(x[j * m:(j + 1) * m], b) for j in range(n)]) for x in xs]
    dt = deq[0].dtype
    whole, new_owners = np.empty(size, dtype=dt), []
    for j in range(n):
        part = np.zeros(m, dtype=dt)
        for i in range(n):  # rank order
            part += deq[i][j * m:(j + 1) * m]
        part /= n
        if owners is None:
            whole[j * m:(j + 1) * m] = part
            continue
        y = part + owners[j]
        back = ref_quantize(y, b)
        whole[j * m:(j + 1) * m] = back
        new_owners.append(y - back)
    return whole, [x - d for x, d in zip(xs, deq)], new_owners


# -- top-k ------------------------------------------------------------------------------------------

def ref_topk(xs: list, k: int):
    """-> (whole average, new residuals): each rank sends its k largest |x| (ties: the lower
    index); every rank adds all ranks' pairs into zeros in rank order and divides by n; a rank's
    residual is its x with the sent entries zeroed."""
    whole = np.zeros_like(xs[0])
    residuals = []
    for x in xs:  # rank order
        idx = np.sort(np.argsort(-np.abs(x), kind="stable")[:k])
        whole[idx] += x[idx]
        r = x.copy()
        r[idx] = 0
        residuals.append(r)
    whole /= len(xs)
    return whole, residuals


# -- PowerSGD ---------------------------------------------------------------------------------------

def ref_orthogonalize(p):
    """Orthonormal columns spanning p's leading columns in order: Householder QR, signs fixed so
    R's diagonal is positive (what Gram-Schmidt gives)."""
    q, r = np.linalg.qr(p)
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def ref_powersgd(xs: list, qs: list, matrices: list):
    """One step -> (whole average approximation, new residuals, new Qs). `matrices`: (offset, a, c)
    per matrix of the bucket, `qs` their Qs `[c, r']`. Per matrix M_i of each rank: P = mean(M_i Q),
    orthogonalized; Q' = mean(M_i^T P); the approximation P Q'^T (zero outside the matrices)."""
    n = len(xs)
    whole, new_qs = np.zeros_like(xs[0]), []
    for (off, a, c), q in zip(matrices, qs):
        ms = [x[off:off + a * c].reshape(a, c) for x in xs]
        p = ref_orthogonalize(sum(m @ q for m in ms) / n)
        q = sum(m.T @ p for m in ms) / n
        whole[off:off + a * c] = (p @ q.T).reshape(-1)
        new_qs.append(q)
    return whole, [x - whole for x in xs], new_qs
