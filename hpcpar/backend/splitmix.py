"""SplitMix64 (Steele, Lea, Flood 2014) as a counter-based hash: random numbers that are pure
functions of integer keys, with no generator state, vectorised over uint64 arrays (NumPy or CuPy).

    mix(z)                          SplitMix64's finaliser: a bijection of uint64 with full avalanche
    splitmix64(z)                   SplitMix64's output for states z: the golden-ratio step, then mix
    stream_seeds(keys)              one 64-bit stream id per key tuple (dropout masks)
    counter_uniform(xp, keys, ..)   uniform [0, 1) floats [len(keys), *shape], element i of row n a
                                    hash of (keys[n], i) (dropout masks)
    hash_keys(words, ks)            the hash of the key (*words, k) for every k in ks (the corpus's
                                    sample offsets)

A key's words are chained into one hash in two ways. Each is frozen by what it produced (the
dropout masks of a seed, the batches of a training run), so both stay, under their own names:

    stream_seeds:   h = 0; for w in key:            h = splitmix64(h ^ w)
    hash_keys:      h = 0; for w in (*words, k):    h = mix(h ^ splitmix64(w))

Arithmetic wraps modulo 2^64: that is the point of the hash, and NumPy and CuPy do not check
integer overflow on arrays.
"""

from __future__ import annotations

import math

import numpy as np

from hpcpar.backend import array_module

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / the golden ratio: the state's step
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def mix(z):
    """SplitMix64's finaliser, in place on the uint64 array z (NumPy or CuPy); returns z."""
    xp = array_module(z)
    t = xp.empty_like(z)
    for shift, multiplier in ((30, _MIX1), (27, _MIX2)):
        xp.right_shift(z, np.uint64(shift), out=t)
        z ^= t
        z *= multiplier
    xp.right_shift(z, np.uint64(31), out=t)
    z ^= t
    return z


def splitmix64(z):
    """SplitMix64's output for the states in the uint64 array z, in place; returns z."""
    z += _GOLDEN
    return mix(z)


def stream_seeds(keys) -> np.ndarray:
    """uint64 [len(keys)]: a stream id per integer key tuple, e.g. (seed, step, sample id, site).
    Each word is folded in through a SplitMix64 step, so (1, 2) and (2, 1) differ; words are taken
    modulo 2^64 (a negative one as its two's complement). The keys of one call have one length."""
    words = np.array([[int(w) & _MASK64 for w in key] for key in keys], dtype=np.uint64)
    h = np.zeros(len(keys), dtype=np.uint64)
    for column in words.T:
        h ^= column
        splitmix64(h)
    return h


def counter_uniform(xp, keys, shape: tuple, rows=None):
    """Uniform [0, 1) floats [len(keys), *shape]: element i of row n is a hash of (keys[n], i).

    Counter-based (no generator state): the value of an element depends only on its key and its
    flat index in `shape`, so NumPy and CuPy draw identical numbers, a sample's values do not
    depend on its batch-mates, and `rows` (a slice of dim 0 of `shape`, or the indices of the rows
    wanted, in any order) draws just those rows of the full array, exactly as the full draw would
    have them (a sequence shard's part; under context parallelism, the positions a rank holds).
    """
    inner = math.prod(shape[1:])
    if rows is None or isinstance(rows, slice):
        lo, hi = (0, shape[0]) if rows is None else (rows.start, rows.stop)
        index = xp.arange(lo * inner, hi * inner, dtype=xp.uint64)
        n = hi - lo
    else:
        picked = xp.asarray(rows, dtype=xp.uint64)
        index = (picked[:, None] * xp.uint64(inner) + xp.arange(inner, dtype=xp.uint64)[None, :]).reshape(-1)
        n = int(picked.size)
    seeds = xp.asarray(stream_seeds(keys))
    z = splitmix64(seeds[:, None] + (index * _GOLDEN)[None, :])
    z >>= xp.uint64(11)  # the top 53 bits: a double in [0, 1) with every bit random
    u = z.astype(xp.float64)
    u *= 1.0 / (1 << 53)
    return u.reshape((len(keys), n) + tuple(shape[1:]))


def hash_keys(words, ks: np.ndarray) -> np.ndarray:
    """uint64 [len(ks)]: the hash of the key (*words, k) for every k in ks (non-negative integers)."""
    h = np.zeros(len(ks), dtype=np.uint64)
    for w in words:
        h = mix(h ^ splitmix64(np.full(len(ks), w, dtype=np.uint64)))
    return mix(h ^ splitmix64(ks.astype(np.uint64)))
