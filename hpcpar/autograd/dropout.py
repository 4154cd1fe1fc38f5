"""Differentiable dropout whose mask is a pure function of per-sample keys (`splitmix.counter_uniform`):
the same on any mesh, backend and batch composition, and drawable row by row for a sequence shard."""

from __future__ import annotations

from hpcpar.backend import array_module, splitmix
from hpcpar.backend.precision import down, is_low, up
from hpcpar.autograd.tensor import Tensor


def dropout(x: Tensor, p: float, mask_rng_keys=None, training: bool = True, rows=None,
            full_shape: tuple | None = None) -> Tensor:
    """Inverted dropout with a counter-based mask (see `splitmix.counter_uniform`).

    `mask_rng_keys` is one integer key tuple per row of dim 0 (e.g. per sample:
    (seed, step, sample_id, site)), so a sample's mask does not depend on which other samples
    share its batch, on the mesh or on the backend. A shard of the sequence passes
    `full_shape` (the per-sample shape [T, ..]) and its `rows` of T (a slice, or the positions it
    holds): it gets those rows of the mask the whole sequence would have.
    """
    if not training or p == 0.0:
        return x
    if mask_rng_keys is None:
        raise ValueError("dropout needs one rng key per sample (mask_rng_keys)")
    xp = array_module(x.data)
    keep = 1.0 - p
    shape = tuple(full_shape) if full_shape is not None else x.shape[1:]
    kept = splitmix.counter_uniform(xp, mask_rng_keys, shape, rows) < keep
    if is_low(x.dtype):  # the 1/keep scaling in float32 (1/keep is not a 16-bit number)
        def scaled(a):
            out = up(a) * kept
            out *= 1.0 / keep
            return down(out, x.dtype)
        return Tensor.from_op(scaled(x.data), (x,), lambda g: (scaled(g),))
    mask = kept.astype(x.dtype)
    mask *= 1.0 / keep
    return Tensor.from_op(x.data * mask, (x,), lambda g: (g * mask,))

