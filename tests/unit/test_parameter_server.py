"""The parameter server's pure parts: the flat space of global tensors, the servers' ranges, the
element routes of sharded layouts, and the sync points."""

import numpy as np
import pytest

from hpcpar.layout import Layout
from hpcpar.parallel.ps.ownership import FlatSpace, row_runs, run_positions, server_ranges, sync_points
from hpcpar.parallel.ps.server import ParameterServer, _Segment


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


def test_row_runs_of_a_vocabulary_shard_cut_by_a_server_boundary():
    """A padded vocabulary shard (rows 3..5 of a [5, 4] table, a padding row): each row's run in a
    range that starts inside row 3 and ends inside row 4; the runs' positions back to back."""
    space = FlatSpace({"a": (6,), "w": (5, 4)})                   # w at offsets 6 .. 25
    idx = space.local_indices("w", Layout.split_padded((5, 4), 0, 1, 2))   # rows 3, 4 and padding
    np.testing.assert_array_equal(idx[:8], np.arange(18, 26))
    local, at, count = row_runs(idx, 4, 20, 23)                   # [20, 23): row 3's last 2, row 4's first
    np.testing.assert_array_equal(count, [2, 1, 0])
    np.testing.assert_array_equal(local, [2, 4, 0])               # local flat index of each run's start
    np.testing.assert_array_equal(at, [0, 2, 0])                  # its position in the range
    np.testing.assert_array_equal(run_positions(local, count, np.array([1, 0])), [4, 2, 3])
    np.testing.assert_array_equal(run_positions(at, count, np.array([0, 1, 2])), [0, 1, 2])
    assert run_positions(at, count, np.zeros(0, np.int64)).size == 0
    local, at, count = row_runs(idx, 4, 0, space.total)           # one range: whole rows
    np.testing.assert_array_equal(count, [4, 4, 0])
    with pytest.raises(ValueError, match="not whole global rows"):
        row_runs(space.local_indices("w", Layout.split((5, 4), 1, 0, 2)), 4, 0, space.total)   # columns split


def test_sync_points():
    assert sync_points(0, 10, every=4, eval_every=0) == {4, 8, 10}
    assert sync_points(5, 12, every=0, eval_every=3) == {6, 9, 12}
    assert sync_points(0, 3, every=0, eval_every=0) == {3}


class _Recorder:
    """An optimizer stand-in that records the gradient of each step."""

    def __init__(self, segments):
        self.segments, self.steps, self.step_count = segments, [], 0

    def step(self, lr):
        self.step_count += 1
        self.steps.append(np.concatenate([s.grad for s in self.segments]).copy())


class _OneServer:
    """The servers' communicator of a lone server: the all-gather of the norm is the value."""

    def all_gather(self, a):
        return a


@pytest.mark.parametrize("weight", [0.0, 0.25, 1.0])
def test_a_late_push_weighs_stale_weight_to_its_lateness(weight):
    """SSP/async on 3 replicas (quorum 2): a push computed on parameters the server sent two steps
    ago enters the open step with weight w^2; the step is the weighted mean of its pushes (the
    fresh ones weigh 1), taken once two replicas have pushed the open step's clock."""
    n = 6
    ps = ParameterServer.__new__(ParameterServer)   # the step arithmetic alone, without routes
    seg = _Segment("w", 0, n, np.zeros(n), False, Layout.replicated((n,)))
    ps.segments, ps.optimizer = [seg], _Recorder([seg])
    ps.server_comm, ps.lr_at, ps.max_norm, ps.microbatches = _OneServer(), lambda step: 0.1, 0.0, 1
    ps.replicas, ps.quorum, ps.stale_weight = 3, 2, weight
    ps.open, ps.fresh, ps.pending, ps.sent, ps.late = 7, 0, 0.0, [7, 7, 5], []
    ps.last_norm, ps.last_skipped = 0.0, False
    ps.total = np.zeros(n)
    rng = np.random.default_rng(0)
    g = [rng.standard_normal(n) for _ in range(3)]
    ps.grads = [x.copy() for x in g]
    ps._apply_replica(2, 5, 1.0)     # the straggler's push of clock 5, read at step 5: two steps late
    ps._apply_replica(0, 7, 1.0)
    assert ps.optimizer.steps == [] and ps.open == 7
    ps._apply_replica(1, 7, 1.0)     # the second fresh push of clock 7: the step is taken
    assert ps.open == 8 and ps.late == [2, 0, 0] and len(ps.optimizer.steps) == 1
    want = (g[0] + g[1] + weight ** 2 * g[2]) / (2 + weight ** 2)
    np.testing.assert_allclose(ps.optimizer.steps[0], want, rtol=1e-15, atol=0)
