"""The parameter server's pure parts: the flat space of global tensors, the servers' ranges, the
element routes of sharded layouts, and the sync points."""

import numpy as np
import pytest

from hpcpar.layout import Layout
from hpcpar.parallel.parameter_server import FlatSpace, server_ranges, sync_points


@pytest.mark.parametrize("total, servers", [(10, 1), (10, 3), (7, 7), (1000003, 4)])
def test_server_ranges_tile_the_vector_evenly(total, servers):
    ranges = server_ranges(total, servers)
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_flat_space_orders_by_name_and_finds_pieces():
    space = FlatSpace({"b": (2, 3), "a": (4,)})
    assert space.names == ["a", "b"] and space.offsets == {"a": 0, "b": 4} and space.total == 10
    assert space.pieces(0, 10) == [("a", 0, 4), ("b", 0, 6)]
    assert space.pieces(3, 7) == [("a", 3, 4), ("b", 0, 3)]
    assert space.pieces(5, 5) == []


def test_local_indices_of_split_and_padded_layouts():
    """Each rank's elements map to the global flat offsets they hold; every element has exactly
    one owner over the ranks of a split; padding rows map to -1."""
    space = FlatSpace({"w": (3, 4), "z": (5, 2)})
    glob = np.arange(space.total).reshape(-1)
    seen = []
    for rank in range(2):
        layout = Layout.split((3, 4), 1, rank, 2)                # columns split over 2 ranks
        idx = space.local_indices("w", layout)
        want = glob[:12].reshape(3, 4)[:, 2 * rank:2 * rank + 2].reshape(-1)
        np.testing.assert_array_equal(idx, want)
        seen.extend(idx)
    assert sorted(seen) == list(range(12))
    padded = Layout.split_padded((5, 2), 0, 1, 2)                 # rows 3..4 of 5, padded to 3 rows
    idx = space.local_indices("z", padded)
    np.testing.assert_array_equal(idx, [18, 19, 20, 21, -1, -1])


def test_sync_points():
    assert sync_points(0, 10, every=4, eval_every=0) == {4, 8, 10}
    assert sync_points(5, 12, every=0, eval_every=3) == {6, 9, 12}
    assert sync_points(0, 3, every=0, eval_every=0) == {3}
