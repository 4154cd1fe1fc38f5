"""`runtime.agreement.agree`: one outcome on every rank, in both of its ways to raise; the one-process
communicator it runs over without MPI (`runtime.solo`)."""

import pathlib

import pytest

from hpcpar.errors import CheckpointError, DataError
from hpcpar.runtime.agreement import agree
from hpcpar.runtime.solo import SoloCommunicator

REPO = pathlib.Path(__file__).resolve().parents[2]


class RankZeroOfTwo(SoloCommunicator):
    """Rank 0 of 2, rank 1's side of the all-gather given: `(result, failure)`."""

    size = 2

    def __init__(self, other: tuple):
        self.other = other

    def all_gather_object(self, obj):
        return [obj, self.other]


def test_every_rank_gets_its_result_or_all_results():
    solo = SoloCommunicator()
    assert agree(solo, lambda: 3) == 3
    assert agree(solo, lambda: 3, share=True, patient=True) == [3]
    assert agree(solo, None) is None
    assert agree(RankZeroOfTwo((4, None)), lambda: 3, share=True) == [3, 4]


def test_with_an_error_type_every_failure_becomes_that_error_in_one_line():
    def bug():
        raise ValueError("bad\n  value")
    with pytest.raises(CheckpointError, match=r"^ValueError: bad value$"):
        agree(SoloCommunicator(), bug, error=CheckpointError)
    with pytest.raises(CheckpointError, match=r"^custom: bad"):
        agree(SoloCommunicator(), bug, error=CheckpointError, describe=lambda err: f"custom: {err}")
    # Rank 0 succeeded, rank 1 failed: rank 0 raises rank 1's error too, naming it.
    with pytest.raises(CheckpointError, match=r"^rank 1: disk gone$"):
        agree(RankZeroOfTwo((None, "disk gone")), lambda: 3, error=CheckpointError)

    def refused():
        raise CheckpointError("mine")
    with pytest.raises(CheckpointError, match=r"^rank 0: mine \(and 1 other rank\(s\)\)$"):
        agree(RankZeroOfTwo((None, "theirs")), refused, error=CheckpointError)


def test_without_an_error_type_the_first_user_error_itself_is_raised_everywhere():
    with pytest.raises(DataError, match="^tokenizers differ$"):
        agree(RankZeroOfTwo((None, DataError("tokenizers differ"))), None)

    def bug():
        raise KeyError("x")
    with pytest.raises(KeyError):  # not a user error: raised on its own rank, with its traceback
        agree(SoloCommunicator(), bug)
