"""PowerSGD (Vogels et al., NeurIPS 2019, arXiv 1905.13727): rank-r gradient compression by one
step of power iteration per training step, warm-started from the previous step.

For every gradient matrix M `[a, b]` of a bucket (a parameter of two or more dims, seen as
`[shape[0], rest]`), with r' = min(rank, a, b) and the factor Q `[b, r']` kept from the last step:

    x = grad + residual                 error feedback: what earlier steps' approximations dropped
    P = M Q                              [a, r'] per matrix, all packed in one buffer
    P = all_reduce_avg(P)                1st all-reduce (non-blocking, from the grad hook)
    P = orthogonalize(P)                 Gram-Schmidt, column by column: the same bits on every rank
    Q = M^T P                            [b, r']
    Q = all_reduce_avg(Q)                2nd all-reduce
    M_hat = P Q^T                        the average's rank-r' approximation, the same on every rank
    residual = x - M_hat;  Q is kept     (warm start: the next step's power iteration continues)

Since P spans (an approximation of) the average's leading column space and Q = mean(M)^T P,
`P Q^T = P P^T mean(M)`: with r' = min(a, b) P is a basis of the whole column space (a square
orthogonal matrix when a <= b) and the average comes back exactly, up to rounding. Bytes sent per
rank for the matrices of a bucket: `2 (n-1)/n · s · r' Σ (a + b)`, against `2 (n-1)/n · s Σ a b`
uncompressed. Vectors (biases, LayerNorm) would gain nothing: they travel uncompressed, in
buckets of their own (`Compression.bucket_group`), by one plain all-reduce.

The initial Q of a matrix is drawn from (seed, the parameter's global name) and orthogonalized,
so every dp rank (and every tp rank of a tp-replicated matrix, and both copies of a tied weight)
starts from the same Q. Q is state: checkpoints save it (`state()["powersgd_q"]`), so a resumed
run continues bitwise.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from hpcpar import backend
from hpcpar.runtime.comm import Communicator
from hpcpar.runtime.transports import Handle
from hpcpar.errors import ConfigError
from hpcpar.parallel.dp.compression.compressors import BucketSpec, Compressor, Residuals


def _project_out(p, i: int, col) -> bool:
    """Remove from `col` its components along the orthonormal columns `p[:, :i]`, twice (classical
    Gram-Schmidt with one reorthogonalisation); True when what is left is independent of them:
    the second projection kept more than half of its norm (Kahan's "twice is enough" test; else
    the rest is rounding noise inside their span). A zero column is not independent."""
    first = 0.0
    if i:
        col -= p[:, :i] @ (p[:, :i].T @ col)
        first = math.sqrt(float(col @ col))
        col -= p[:, :i] @ (p[:, :i].T @ col)
    norm = math.sqrt(float(col @ col))
    return norm > 0 and norm > 0.5 * first


def orthogonalize(p) -> None:
    """Make the columns of `p` `[a, r]` (r <= a) orthonormal in place, in column order
    (Gram-Schmidt, each column projected twice for stability). A column in the span of the earlier
    ones (or zero) leaves rounding noise, which normalised would be a unit column that is not
    orthogonal to them, and P Pᵀ would stretch the approximation P (Mᵀ P)ᵀ past the matrix (at full
    rank on a rank-deficient gradient, e.g. the embedding rows of tokens a batch lacks). It is
    replaced by the first coordinate axis independent of the earlier columns, made orthogonal to
    them: P stays an orthonormal basis, which adds nothing of M that M lacks, and its column keeps
    a direction in Q = Mᵀ P, so that the warm start can find the matrix's next step there (a zero
    column would stay zero in every later P = M Q). A NaN spreads, so a bad step shows.
    Deterministic: the same input gives the same bits."""
    for i in range(p.shape[1]):
        col = p[:, i]
        if not _project_out(p, i, col):
            if not bool(np.isfinite(float(col @ col))):
                col /= math.sqrt(float(col @ col))  # NaN (or inf) everywhere
                continue
            for k in range(p.shape[0]):
                col[...] = 0
                col[k] = 1
                if _project_out(p, i, col):
                    break
        col /= math.sqrt(float(col @ col))


def matrix_shape(shape: tuple) -> tuple[int, int] | None:
    """`[a, b]` PowerSGD sees for a parameter of `shape` (None for a vector)."""
    return (int(shape[0]), int(math.prod(shape[1:]))) if len(shape) >= 2 else None


def initial_q(key: str, b: int, r: int, seed: int, dtype, xp):
    """The first Q `[b, r]` of the matrix named `key`: normal from (seed, crc32 of the name),
    orthogonalized; the same on every rank that holds the matrix."""
    q = np.random.default_rng([seed, zlib.crc32(key.encode())]).standard_normal((b, r)).astype(dtype)
    orthogonalize(q)
    return xp.asarray(q)


class PowerSGD(Compressor):
    """Rank-`rank` PowerSGD with warm start and error feedback over `comm` (module docstring).

    A bucket holds matrices only (two all-reduces: P, then Q) or vectors only (one plain
    all-reduce, no residual)."""

    name = "powersgd"

    def __init__(self, comm: Communicator, rank: int = 4, error_feedback: bool = True, seed: int = 0):
        super().__init__(comm)
        self.rank = rank
        self.error_feedback = error_feedback
        self.seed = seed
        self.worker = Residuals()
        self.q: dict[tuple[int, int], Any] = {}        # committed Q per (bucket, matrix number)
        self._next_q: dict[tuple[int, int], Any] = {}  # this step's
        self._x: dict[int, Any] = {}                   # bucket -> this step's x, between the all-reduces
        self._whole: dict[int, Any] = {}
        self.matrices: dict[int, list[tuple[str, int, int, int, int]]] = {}  # (key, offset, a, b, r')

    def setup(self, specs: list[BucketSpec]) -> None:
        super().setup(specs)
        for spec in specs:
            shapes = [matrix_shape(s.shape) for s in spec.slots]
            if any(sh is None for sh in shapes) and any(sh is not None for sh in shapes):
                raise ConfigError(f"PowerSGD bucket {spec.index} mixes matrices and vectors "
                                  f"({[s.key for s in spec.slots][:4]}); plan buckets with Compression.bucket_group")
            self.matrices[spec.index] = [(s.key, s.offset, a, b, min(self.rank, a, b))
                                         for s, (a, b) in zip(spec.slots, shapes) if a is not None] \
                if shapes and shapes[0] is not None else []

    def _q(self, index: int, j: int, dtype, xp):
        q = self.q.get((index, j))
        if q is None:
            key, _, _, b, r = self.matrices[index][j]
            q = self.q[(index, j)] = initial_q(key, b, r, self.seed, dtype, xp)
        return q

    def compress(self, index: int, grad):
        matrices = self.matrices[index]
        if not matrices:
            return grad.copy()  # vectors: the plain average
        xp = backend.array_module(grad)
        x = self.worker.add(index, grad) if self.error_feedback else grad
        self._x[index] = x
        ps = [x[off:off + a * b].reshape(a, b) @ self._q(index, j, x.dtype, xp)
              for j, (key, off, a, b, r) in enumerate(matrices)]
        return xp.concatenate([p.reshape(-1) for p in ps])

    def exchange(self, payload) -> Handle:
        return self.comm.iall_reduce(payload, op="avg")

    def decompress(self, index: int, received):
        matrices = self.matrices[index]
        if not matrices:
            return self._keep(index, received)
        xp = backend.array_module(received)
        x = self._x.pop(index)
        ps, at = [], 0
        for key, off, a, b, r in matrices:
            p = received[at:at + a * r].reshape(a, r)
            orthogonalize(p)
            ps.append(p)
            at += a * r
        qs = xp.concatenate([(x[off:off + a * b].reshape(a, b).T @ p).reshape(-1)
                             for (key, off, a, b, r), p in zip(matrices, ps)])
        qs = self.comm.all_reduce(qs, op="avg")
        whole = xp.zeros(self.specs[index].size, dtype=x.dtype)
        at = 0
        for j, ((key, off, a, b, r), p) in enumerate(zip(matrices, ps)):
            q = qs[at:at + b * r].reshape(b, r).copy()
            whole[off:off + a * b] = (p @ q.T).reshape(-1)
            self._next_q[(index, j)] = q
            at += b * r
        if self.error_feedback:
            x -= whole  # x becomes the residual
        return self._keep(index, whole)

    def _keep(self, index: int, whole):
        if self.gathers:
            self._whole[index] = whole
        return self._part(whole)

    def all_gather(self, index: int, part):
        return self._whole.pop(index)  # both all-reduces delivered the whole average already

    def commit(self) -> None:
        self.worker.commit()
        self.q.update(self._next_q)
        self._next_q = {}

    def state(self) -> dict[str, dict]:
        return {"residual": dict(self.worker.current), "powersgd_q": dict(self.q)}

    def load_state(self, state: dict[str, dict]) -> None:
        for index, a in state.get("residual", {}).items():
            self.worker.load(index, a)
        for key, q in state.get("powersgd_q", {}).items():
            self.q[key] = q
        self._next_q = {}
