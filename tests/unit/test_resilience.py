"""The pure parts of training through a failure (hpcpar/training/resilience.py): the partner of
each rank, the debug failure, the smaller mesh's config, and the snapshots in memory
(checkpoint/memory.py) on one process. The failures themselves: tests/cluster/test_resilience.py."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpar.checkpoint.memory import MemoryStored, Snapshot, pack_state
from hpcpar.config.load import load_config
from hpcpar.config.validate import validate
from hpcpar.errors import CheckpointError, HpcparError
from hpcpar.layout import Layout
from hpcpar.runtime.comm import Communicator
from hpcpar.state import SavedState
from hpcpar.training import resilience


def test_debug_failures_parse():
    assert resilience.debug_failure("") is None
    assert resilience.debug_failure("2,3@7") == ({2, 3}, 7, "")
    assert resilience.debug_failure("1@6/exchange") == ({1}, 6, "exchange")


@pytest.mark.parametrize("before, dp, after", [
    (["mesh.dp=2", "mesh.tp=2", "train.micro_batch_size=2", "train.microbatches=2"], 1, (1, 1, 2, 4)),
    (["mesh.dp=4", "train.zero=1", "mesh.dp_replicate=2", "train.micro_batch_size=4", "train.microbatches=1"], 2,
     (2, 1, 4, 2)),
    (["mesh.dp=3", "train.micro_batch_size=2", "train.microbatches=2"], 2, (2, 1, 2, 3)),
])
def test_the_smaller_mesh_keeps_the_global_batch(before, dp, after):
    cfg = load_config(None, before + ["mesh.pp=1"])
    cfg = validate(cfg, cfg.mesh.dp * max(cfg.mesh.tp, 1))
    old_dp = cfg.mesh.dp
    new = resilience._smaller(cfg, dp, old_dp)
    m, t = new.mesh, new.train
    assert (m.dp, m.dp_replicate, t.micro_batch_size, t.microbatches) == after
    assert m.dp * t.micro_batch_size * t.microbatches == old_dp * cfg.train.micro_batch_size * cfg.train.microbatches


def test_a_batch_that_does_not_split_over_the_survivors_is_refused_in_one_line():
    cfg = validate(load_config(None, ["mesh.dp=4", "mesh.pp=1", "train.micro_batch_size=1",
                                      "train.microbatches=1"]), 4)
    with pytest.raises(HpcparError) as err:
        resilience._smaller(cfg, 3, 4)
    assert "global batch of 4 sequences does not split over 3" in str(err.value) and "\n" not in str(err.value)


def _state(step: int) -> SavedState:
    whole = np.arange(24, dtype=np.float64).reshape(4, 6)
    return SavedState({"model/w": (whole[:2], Layout.split((4, 6), 0, 0, 2)),
                       "model/b": (np.ones(3, dtype=np.float32), Layout.replicated((3,)))}, {"step": step, "x": [1]})


def test_a_packed_state_unpacks_to_the_same_tensors_and_meta():
    snap = Snapshot.unpack(pack_state(5, _state(7)))
    assert (snap.owner, snap.step, snap.meta) == (5, 7, {"step": 7, "x": [1]})
    assert np.array_equal(snap.tensors["model/w"][0], np.arange(12.0).reshape(2, 6))
    assert snap.tensors["model/w"][1] == Layout.split((4, 6), 0, 0, 2)
    assert snap.tensors["model/b"][0].dtype == np.float32
    assert np.array_equal(Snapshot.unpack(snap.pack()).tensors["model/b"][0], np.ones(3, np.float32))


def test_a_restore_reshards_what_the_snapshots_hold_and_refuses_what_none_holds():
    """Rows 0-1 from one snapshot, rows 2-3 from another (a lost rank's copy): a whole-tensor layout
    is assembled from both, a quarter from one of them; a tensor nobody holds is refused."""
    whole = np.arange(24, dtype=np.float64).reshape(4, 6)
    halves = [Snapshot(r, 3, {"step": 3}, {"model/w": (whole[2 * r:2 * r + 2].copy(), Layout.split((4, 6), 0, r, 2))})
              for r in range(2)]
    got = {}
    stored = MemoryStored(halves, Communicator.local(), {"step": 3})
    stored.read({"model/w": Layout.replicated((4, 6))}, lambda a: got.update(whole=a["model/w"]))
    stored.read({"model/w": Layout.split((4, 6), 0, 3, 4)}, lambda a: got.update(quarter=a["model/w"]))
    stored.finish()
    assert np.array_equal(got["whole"], whole) and np.array_equal(got["quarter"], whole[3:4])
    missing = MemoryStored(halves[:1], Communicator.local(), {"step": 3})
    missing.read({"model/w": Layout.replicated((4, 6)), "model/v": Layout.replicated((2,))}, lambda a: None)
    with pytest.raises(CheckpointError, match="tensor model/v is held by no surviving rank"):
        missing.finish()
