"""Node-local checkpoints in one process: the copy plan (pure), the one-node answers, the config.

The copies between nodes are tested over MPI with two fake nodes in
tests/parallel/test_checkpoint_nodelocal.py.
"""

import os

import numpy as np
import pytest

from hpcpar.checkpoint.directory import latest
from hpcpar.checkpoint.load import load
from hpcpar.checkpoint.replicate import (Copy, plan_copies, probe_location, replicate, share_checkpoint,
                                         start_of_run)
from hpcpar.checkpoint.save import save
from hpcpar.checkpoint.tools import verify
from hpcpar.config.load import load_config
from hpcpar.config.sections import Config
from hpcpar.config.validate import validate
from hpcpar.errors import CheckpointError, ConfigError
from hpcpar.layout import Layout
from hpcpar.runtime.solo import SoloCommunicator

SOLO = SoloCommunicator()


def test_plan_sends_each_missing_file_from_the_lowest_holder():
    listings = [{"rank-00000.h5": 10, "index.h5": 3, "manifest.json": 5},
                {"rank-00002.h5": 7},
                {"rank-00002.h5": 7, "index.h5": 3}]
    assert plan_copies(listings) == [
        Copy("index.h5", 3, 0, (1,)),
        Copy("manifest.json", 5, 0, (1, 2)),
        Copy("rank-00000.h5", 10, 0, (1, 2)),
        Copy("rank-00002.h5", 7, 1, (0,)),
    ]


def test_plan_skips_what_every_node_has_and_copies_empty_files():
    assert plan_copies([{"a": 4, "b": 0}, {"a": 4}]) == [Copy("b", 0, 0, (1,))]
    assert plan_copies([{"a": 4}, {"a": 4}, {"a": 4}]) == []
    assert plan_copies([{}, {}]) == []


def test_plan_refuses_copies_of_different_sizes():
    with pytest.raises(CheckpointError, match=r"rank-00001.h5: the nodes' copies differ \(8 bytes on node 0, "
                                              r"9 bytes on node 2\)"):
        plan_copies([{"rank-00001.h5": 8}, {}, {"rank-00001.h5": 9}])


def test_one_process_is_one_node(tmp_path):
    """One process: shared, nothing probed (no file written), nothing copied."""
    where = tmp_path / "ckpt"
    assert probe_location(str(where), SOLO, SOLO) == "shared"
    assert replicate(str(where), SOLO, SOLO) == []
    assert share_checkpoint(str(where), SOLO, SOLO) is None
    assert start_of_run(str(where), "auto", "auto", SOLO) == "shared"
    assert start_of_run(str(where), "auto", "node-local", SOLO) == "node-local"
    assert not where.exists()
    with pytest.raises(CheckpointError, match="checkpoint.location='nodelocal': expected one of auto, shared, "
                                              "node-local"):
        start_of_run(str(where), "", "nodelocal", SOLO)


@pytest.mark.parametrize("location", ["node-local", "auto"])
def test_save_node_local_on_one_node_is_a_plain_checkpoint(tmp_path, location):
    w = np.arange(12.0).reshape(3, 4)
    for step in (1, 2):
        path = save(str(tmp_path), step, {"model/w": (w, Layout.replicated(w.shape))}, {}, SOLO, keep=1,
                    location=location)
    assert path == str(tmp_path / "step-0000002") and latest(str(tmp_path)) == path
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-0000002"] and verify(path) == []
    got, meta = load(path, {"model/w": Layout.replicated(w.shape)}, SOLO)
    assert np.array_equal(got["model/w"], w) and meta["step"] == 2


def test_save_refuses_an_unknown_location(tmp_path):
    w = np.zeros(2)
    with pytest.raises(CheckpointError, match="location='local': expected one of auto, shared, node-local"):
        save(str(tmp_path), 1, {"model/w": (w, Layout.replicated(w.shape))}, {}, SOLO, location="local")
    assert os.listdir(tmp_path) == []


def test_config_location():
    assert Config().checkpoint.location == "auto"
    assert validate(load_config(None, ["checkpoint.location=node-local"]), 1).checkpoint.location == "node-local"
    with pytest.raises(ConfigError, match="checkpoint.location"):
        validate(load_config(None, ["checkpoint.location=nodelocal"]), 1)


def test_config_refuses_node_local_with_a_shared_file(monkeypatch):
    import types

    import h5py
    monkeypatch.setattr(h5py, "get_config", lambda: types.SimpleNamespace(mpi=True))
    with pytest.raises(ConfigError, match='checkpoint.location="node-local" needs checkpoint.format="per_rank"'):
        validate(load_config(None, ["checkpoint.location=node-local", "checkpoint.format=shared"]), 1)
    assert validate(load_config(None, ["checkpoint.location=shared", "checkpoint.format=shared"]), 1)
