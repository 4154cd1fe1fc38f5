"""layout.py: shards cut from a global tensor and put back give the global tensor again."""

import numpy as np
import pytest

from hpcpar.layout import Layout


def _global(shape):
    return np.arange(np.prod(shape), dtype=np.float64).reshape(shape)


def test_replicated_round_trip():
    g = _global((4, 6))
    lay = Layout.replicated(g.shape)
    assert lay.is_replicated and lay.split_dim is None and lay.local_shape == (4, 6)
    local = lay.take(g)
    assert np.array_equal(local, g) and local is not g
    out = np.zeros_like(g)
    lay.put(local, out)
    assert np.array_equal(out, g)


@pytest.mark.parametrize("shape, dim, count, groups", [
    ((8, 6), 0, 4, 1), ((8, 6), 1, 3, 1), ((8, 6), -1, 2, 1), ((2, 3, 12), 2, 2, 3),
    ((12, 4), 0, 2, 3), ((6,), 0, 1, 1), ((6, 5), 0, 6, 1)])
def test_split_parts_cover_the_global_tensor(shape, dim, count, groups):
    g = _global(shape)
    rebuilt = np.full_like(g, np.nan)
    parts = []
    for index in range(count):
        lay = Layout.split(shape, dim, index, count, groups=groups)
        local = lay.take(g)
        assert local.shape == lay.local_shape
        lay.put(local, rebuilt)
        parts.append(local)
    assert np.array_equal(rebuilt, g)
    d = dim % len(shape)
    assert sum(p.shape[d] for p in parts) == shape[d]
    assert Layout.split(shape, dim, 0, count, groups=groups).split_dim == (d if count > 1 else None)


def test_grouped_split_takes_the_same_part_of_every_group():
    # c_attn-like [3C, C] with C = 4, tp = 2: rank 1 holds rows 2:4 of q, k and v.
    g = _global((12, 4))
    lay = Layout.split(g.shape, 0, 1, 2, groups=3)
    expected = np.concatenate([g[2:4], g[6:8], g[10:12]])
    assert np.array_equal(lay.take(g), expected)
    assert len(lay.blocks) == 3


@pytest.mark.parametrize("lay", [
    Layout.replicated((3, 4)), Layout.split((8, 6), 1, 2, 3), Layout.split((12, 4), 0, 1, 2, groups=3)])
def test_json_round_trip(lay):
    import json
    back = Layout.from_json(json.loads(json.dumps(lay.to_json())))
    assert back == lay


def test_split_that_does_not_divide():
    with pytest.raises(ValueError, match="does not split"):
        Layout.split((10, 4), 0, 0, 3)
    with pytest.raises(ValueError, match="does not split"):
        Layout.split((12, 4), 0, 0, 5, groups=3)


@pytest.mark.parametrize("parent", [
    Layout.replicated((6, 5)), Layout.replicated((7,)), Layout.split((6, 8), 1, 1, 2),
    Layout.split((12, 4), 0, 1, 2, groups=3), Layout.split((2, 3, 4), 0, 1, 2)])
def test_flat_range_of_a_local_array(parent):
    """ZeRO shards: every flat range [lo, hi) of the local array is a layout of its own whose flat
    blocks hold rectangles of the global tensor (at most 3 per block of a 2-D parent)."""
    g = _global(parent.global_shape)
    local = parent.take(g).reshape(-1)
    n = local.size
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            lay = parent.flat_range(lo, hi)
            assert lay.local_shape == (hi - lo,)
            assert np.array_equal(lay.take(g), local[lo:hi]), (lo, hi)
            covered = np.zeros_like(g)
            lay.put(np.ones(hi - lo), covered)
            assert covered.sum() == hi - lo
            if len(parent.global_shape) == 2 and len(parent.blocks) == 1:
                assert len(lay.blocks) <= 3
    # The shards of a partition tile the global tensor exactly once.
    rebuilt = np.full_like(g, np.nan)
    cuts = [0, n // 3, n // 3 + 1, n]
    for lo, hi in zip(cuts, cuts[1:]):
        lay = parent.flat_range(lo, hi)
        lay.put(lay.take(g), rebuilt)
    parent_mask = np.zeros_like(g)
    parent.put(np.ones(parent.local_shape), parent_mask)
    assert np.array_equal(rebuilt[parent_mask == 1], g[parent_mask == 1])
    import json
    inner = parent.flat_range(1, n - 1)
    assert Layout.from_json(json.loads(json.dumps(inner.to_json()))) == inner
    with pytest.raises(ValueError, match="outside a local array"):
        parent.flat_range(0, n + 1)


def test_flat_range_of_a_padded_split_skips_the_padding():
    """A ZeRO shard of a padded vocabulary shard (`split_padded`, tp not dividing V): the flat range's
    blocks cover only real rows, the layout is `padded`, `take` gives zeros on the padding and
    `put` never writes it; the real elements tile the global tensor as with any flat range."""
    g = _global((5, 3))
    parent = Layout.split_padded(g.shape, 0, 1, 2)   # rows 3, 4 and one padding row: local [3, 3]
    local = parent.take(g).reshape(-1)
    assert parent.padded and np.array_equal(local[6:], np.zeros(3))
    for lo, hi in [(0, 9), (2, 8), (5, 9), (6, 9), (0, 4)]:
        lay = parent.flat_range(lo, hi)
        covered = np.zeros(hi - lo, dtype=bool)
        for b in lay.blocks:
            covered[b.local[0]] = True
        assert lay.padded == (not covered.all()), (lo, hi)
        assert np.array_equal(lay.take(g), local[lo:hi]), (lo, hi)
        out = np.full_like(g, -1.0)
        lay.put(np.arange(hi - lo, dtype=g.dtype), out)
        assert (out != -1).sum() == covered.sum()
    assert Layout.split_padded(g.shape, 0, 1, 2).flat_range(6, 9).blocks == ()
