"""watchdog.py: timeout setting and the flight recorder (no MPI needed)."""

import numpy as np
import pytest

from hpcpar import watchdog
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
