"""watchdog.py: timeout setting and the flight recorder (no MPI needed)."""

import numpy as np
import pytest

from hpcpar.runtime import waiting, watchdog
from hpcpar import environment
from hpcpar.errors import ConfigError


@pytest.fixture(autouse=True)
def _reset():
    yield
    watchdog.set_timeout(None)


def test_timeout_from_environment_and_override(monkeypatch):
    monkeypatch.delenv("HPCPAR_TIMEOUT", raising=False)
    assert watchdog.timeout() == watchdog.DEFAULT_TIMEOUT_S
    monkeypatch.setenv("HPCPAR_TIMEOUT", "12.5")
    assert watchdog.timeout() == 12.5
    watchdog.set_timeout(3)
    assert watchdog.timeout() == 3.0
    watchdog.set_timeout(None)
    assert watchdog.timeout() == 12.5


@pytest.mark.parametrize("raw", ["soon", "0", "-4"])
def test_bad_timeout_environment(monkeypatch, raw):
    monkeypatch.setenv("HPCPAR_TIMEOUT", raw)
    with pytest.raises(ConfigError, match="HPCPAR_TIMEOUT"):
        watchdog.timeout()


@pytest.mark.parametrize("ranks, wait, blocks", [
    ("2", "", True), ("2", "auto", True), ("3", "auto", False), ("8", "", False),  # 2 cores
    ("8", "block", True), ("1", "poll", False), ("2", " Poll ", False)])
def test_blocking_ops_poll_where_ranks_share_cores(monkeypatch, ranks, wait, blocks):
    monkeypatch.setattr(waiting.os, "sched_getaffinity", lambda pid: {0, 1})
    for var in environment._LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MPI_LOCALNRANKS", ranks)
    monkeypatch.setenv("HPCPAR_MPI_WAIT", wait)
    assert waiting.mpi_waits_block() is blocks


def test_bad_wait_mode_environment(monkeypatch):
    monkeypatch.setenv("HPCPAR_MPI_WAIT", "spin")
    with pytest.raises(ConfigError, match="HPCPAR_MPI_WAIT='spin'.*auto, block or poll"):
        waiting.mpi_waits_block()


def test_set_timeout_rejects_non_positive():
    with pytest.raises(ValueError):
        watchdog.set_timeout(0)


def test_recorder_keeps_the_last_ops_and_the_pending_ones():
    rec = watchdog.FlightRecorder(capacity=3)
    records = [rec.begin("tp", seq, "all_reduce", (2, 3), np.dtype("float32"), 24) for seq in range(5)]
    for r in records[:4]:
        rec.end(r)
    snap = rec.snapshot()
    assert [r.seq for r in snap["done"]] == [1, 2, 3]
    assert [r.seq for r in snap["pending"]] == [4]
    assert snap["done"][0].end is not None and snap["pending"][0].end is None
    snap["done"][0].seq = 99  # snapshots are copies
    assert rec.snapshot()["done"][0].seq == 1
    text = rec.format(last=2)
    assert "tp#2 all_reduce float32[2, 3]" in text and "tp#3" in text and "tp#1 " not in text
    assert "pending: tp#4" in text


def test_comm_timeout_message_names_the_op():
    rec = watchdog.recorder.begin("dp", 7, "barrier", (), "", 0)
    err = watchdog.CommTimeout(rec, 12.0)
    watchdog.recorder.end(rec)
    text = str(err)
    assert "barrier on communicator 'dp' (op #7" in text and "waited 12.0s" in text
    assert isinstance(err, TimeoutError)


def test_overdue_lists_only_waited_unreported_ops_past_the_limit():
    rec = watchdog.FlightRecorder()
    issued = rec.begin("dp", 0, "all_reduce", (4,), np.dtype("float32"), 16)          # in flight, not waited on
    waited = rec.begin("dp", 1, "all_reduce", (4,), np.dtype("float32"), 16)
    blocking = rec.begin("tp", 0, "all_gather", (2,), np.dtype("float64"), 16, group="0,1", blocking=True)
    rec.waiting(waited)
    assert rec.overdue(60.0) == []
    assert {r.seq for r in rec.overdue(0.0)} == {1, 0} and issued not in rec.overdue(0.0)
    waited.report = "reported"
    assert rec.overdue(0.0) == [blocking]
    state = rec.state(rank=3, timed_out=True)
    assert state["rank"] == 3 and state["issued"] == {("dp", ""): 2, ("tp", "0,1"): 1}
    assert [w for _, w in state["pending"]] == [False, True, True]


def _state(rank, issued, pending=(), idle=0.5, done=()):
    return {"rank": rank, "host": "node", "pid": 100 + rank, "timed_out": False, "idle_s": idle,
            "issued": issued, "done": list(done), "pending": list(pending)}


def test_report_names_the_ranks_that_never_arrived():
    rec = watchdog.OpRecord("dp", 5, "all_reduce", (2, 3), np.dtype("float32"), 24, 0.0, group="0,2,4",
                            blocking=True, waiting=0.0)
    key = ("dp", "0,2,4")
    states = {0: _state(0, {key: 6}, [("dp#5 all_reduce float32[2, 3] (waiting 9.0s)", True)],
                        done=["dp#4 all_reduce float32[2, 3] (took 0.1s)"]),
              2: _state(2, {key: 5}, idle=12.5),                          # stalled in compute
              4: None,                                                    # never answered
              1: _state(1, {("tp", "0,1"): 3}, [("tp#3 all_gather (waiting 8s)", True)])}
    text = watchdog.format_report(rec, 9.0, 0, states, asked=True)
    lines = text.splitlines()
    assert lines[0].startswith("all_reduce on communicator 'dp' (op #5, float32[2, 3]) waited 9.0s")
    assert lines[1] == "Never arrived at dp#5 (communicator of world ranks 0,2,4):"
    assert lines[2] == ("  rank 2: stalled outside communication (compute or I/O): not waiting on any op, "
                        "last op began or ended 12.5s ago")
    assert lines[3].startswith("  rank 4: unresponsive")
    assert "rank 0:" not in "\n".join(lines[1:4]) and "rank 1:" not in "\n".join(lines[1:4])
    assert "  rank 1 (node, pid 101): waiting in tp#3 all_gather (waiting 8s)" in lines
    assert "    done:    dp#4 all_reduce float32[2, 3] (took 0.1s)" in lines


def test_report_for_a_receive_names_the_peer_in_world_ranks():
    rec = watchdog.OpRecord("pp", 7, "recv", (4,), np.dtype("float64"), 32, 0.0, peer=1, group="1,3",
                            waiting=0.0)
    states = {1: _state(1, {("pp", "1,3"): 8}), 3: _state(3, {("pp", "1,3"): 7}, idle=4.0)}
    text = watchdog.format_report(rec, 5.0, 1, states, asked=True)
    assert "Its peer for pp#7 recv: rank 3: stalled outside communication" in text


def test_report_without_install_says_it_is_one_rank_view():
    rec = watchdog.OpRecord("dp", 0, "barrier", (), "", 0, 0.0, group="0,1", waiting=0.0)
    text = watchdog.format_report(rec, 2.0, 0, {0: _state(0, {("dp", "0,1"): 1})}, asked=False)
    assert "Other ranks were not asked (watchdog.install() was not called)" in text
    assert "Never arrived" not in text


def test_check_interval_setting():
    watchdog.set_check_every(4)
    try:
        assert watchdog.check_every() == 4
        with pytest.raises(ValueError):
            watchdog.set_check_every(-1)
    finally:
        watchdog.set_check_every(0)


def test_a_large_report_details_the_named_ranks_and_groups_the_rest():
    group = ",".join(map(str, range(64)))
    key = ("world", group)
    rec = watchdog.OpRecord("world", 3, "all_reduce", (1,), np.dtype("int32"), 4, 0.0, group=group, waiting=0.0)
    waiting = [("world#3 all_reduce int32[1] (waiting 5.0s)", True)]
    states = {r: _state(r, {key: 4}, waiting) for r in range(64)}
    states[40] = _state(40, {key: 3}, idle=6.0)
    states[41] = None
    text = watchdog.format_report(rec, 5.0, 0, states, asked=True)
    assert "Never arrived at world#3 (communicator of world ranks 0-63):" in text
    assert "  rank 40: stalled outside communication" in text and "  rank 41: unresponsive (no reply" in text
    assert "  rank 0 (node, pid 100): waiting in world#3" in text and "  rank 41: unresponsive" in text
    assert "  ranks 1-39,42-63: waiting in world#3 all_reduce int32[1]" in text
    assert "rank 5 (" not in text and len(text.splitlines()) < 20


def test_report_names_a_node_whose_ranks_all_fell_silent():
    """Ranks 2 and 3 (node1) never answer: the report names node1 as lost, right under the
    headline, and each silent rank with its node; node0, with one rank answering, is not lost."""
    rec = watchdog.OpRecord("dp", 7, "all_reduce", (4,), np.dtype("float64"), 32, 0.0, group="0,1,2,3",
                            blocking=True, waiting=0.0)
    key = ("dp", "0,1,2,3")
    waiting = [("dp#7 all_reduce float64[4] (waiting 11.0s)", True)]
    states = {0: _state(0, {key: 8}, waiting), 1: None, 2: None, 3: None}
    hosts = ["node0", "node0", "node1", "node1"]
    text = watchdog.format_report(rec, 11.0, 0, states, asked=True, hosts=hosts)
    lines = text.splitlines()
    assert lines[1] == ("Node node1 (ranks 2-3): none of its ranks answered; the node is lost "
                        "(its processes died, or it is cut off from the network)")
    assert "Node node0" not in text
    assert "  rank 1 (node0): unresponsive (no reply within" in text
    assert "  rank 3 (node1): unresponsive (no reply within" in text
    assert watchdog.lost_nodes(states, None) == []  # hosts unknown (install() not called): no guess


def test_abandoned_ops_are_no_longer_pending_or_overdue():
    """After a failure the ops it ended are abandoned (training/resilience.py): a later timeout
    check does not find them, and the recorder keeps them among the finished ops."""
    rec = watchdog.FlightRecorder()
    record = rec.begin("world", 0, "all_reduce", (4,), "float64", 32)
    rec.waiting(record)
    record.waiting -= 100  # waited 100 s already
    entry = rec.enter("tp", 3, "all_gather", (2,), "float64", 16)
    assert rec.overdue(10.0)
    assert rec.abandon() == 2
    assert rec.overdue(10.0) == [] and rec.snapshot()["pending"] == []
    assert len(rec.snapshot()["done"]) == 2 and entry[1] == 3
