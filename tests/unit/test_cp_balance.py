"""Ring attention's zigzag layout dealt by attention work for packed documents (hpcpar/parallel/cp/balance.py).

- windows of one segment: exactly token-zigzag (rank r: chunks r and 2cp-1-r), so unpacked runs keep
  their positions bit for bit;
- Pareto-length documents: every position on exactly one rank, T/cp on each; the busiest rank's
  work (unmasked pairs) is never above token-zigzag's, and equals the optimum over every dealing
  of two chunks per rank (brute force, cp = 2, 3, 4), below zigzag's on many batches;
- `ContextParallel.positions(t, documents)`: the balanced positions under ring's zigzag layout, the
  layout's own for Ulysses (contiguous), without documents and for windows of one segment;
- the data layer selects a packed micro-batch's columns from its own documents (a callable).
"""

import types

import numpy as np
import pytest

from hpcpar.data import balance as data_balance
from hpcpar.data import corpus, formats, packing
from hpcpar.parallel.cp.attention import ContextParallel, positions
from hpcpar.parallel.cp.balance import balanced_positions, chunk_work, pair_chunks, rank_work


class _Rank:
    """A stand-in cp communicator: positions need only the group's size and my rank."""

    def __init__(self, size, rank):
        self.size, self.rank = size, rank


def pareto_documents(seed: int, b: int, t: int, scale: float = 4.0) -> packing.Documents:
    """B windows of T tokens over a stream of Pareto(a=1.2) document lengths (median ~scale)."""
    rng = np.random.default_rng(seed)
    lengths = np.ceil(rng.pareto(1.2, 40 * t) * scale).astype(np.int64)
    doc_starts = np.unique(np.concatenate([[0], np.cumsum(lengths)]))
    windows = rng.integers(0, int(doc_starts[len(doc_starts) // 2]), b)
    return packing.Documents.of_windows(doc_starts, windows, t)[0]


def pairings(items: list):
    """Every way of cutting `items` (even length) into unordered pairs."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for i, other in enumerate(rest):
        for tail in pairings(rest[:i] + rest[i + 1:]):
            yield [(first, other)] + tail


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_windows_of_one_segment_keep_token_zigzag(cp):
    t = 4 * cp
    whole = packing.Documents([np.array([0])] * 3, t, 3 * t)
    zigzag = [positions("zigzag", t, cp, r) for r in range(cp)]
    got = balanced_positions(whole, cp)
    assert all(np.array_equal(a, b) for a, b in zip(got, zigzag))
    assert pair_chunks(chunk_work(whole, 2 * cp)) == [(r, 2 * cp - 1 - r) for r in range(cp)]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_balanced_layout_is_the_optimal_dealing_of_two_chunks_per_rank(cp):
    t, better = 8 * cp, 0
    for seed in range(30):
        documents = pareto_documents(seed, 2, t)
        held = balanced_positions(documents, cp)
        assert sorted(np.concatenate(held).tolist()) == list(range(t))
        assert all(len(p) == t // cp and np.all(np.diff(p) > 0) for p in held)
        work = rank_work(documents, held)
        zigzag = rank_work(documents, [positions("zigzag", t, cp, r) for r in range(cp)])
        assert work.sum() == zigzag.sum() == int((documents.positions() + 1).sum())
        assert work.max() <= zigzag.max()
        w = chunk_work(documents, 2 * cp)
        best = min(max(int(w[a] + w[b]) for a, b in p) for p in pairings(list(range(2 * cp))))
        assert work.max() == best, (seed, w.tolist())
        better += int(work.max() < zigzag.max())
    assert better >= 5, f"token-zigzag was optimal on {30 - better} of 30 batches: the test shows nothing"


def test_chunk_work_counts_each_querys_unmasked_pairs():
    d = packing.Documents([np.array([0, 3]), np.array([0])], 8, 14)
    # row 0: positions 0 1 2 0 1 2 3 4, row 1: 0 .. 7; chunks of 2
    assert chunk_work(d, 4).tolist() == [(1 + 2) + (1 + 2), (3 + 1) + (3 + 4), (2 + 3) + (5 + 6), (4 + 5) + (7 + 8)]
    with pytest.raises(ValueError, match="does not split"):
        chunk_work(d, 3)


def test_context_parallel_positions_follow_the_documents():
    t, cp = 32, 4
    documents = pareto_documents(3, 2, t)
    held = balanced_positions(documents, cp)
    assert any(not np.array_equal(h, positions("zigzag", t, cp, r)) for r, h in enumerate(held))
    for r in range(cp):
        ring = ContextParallel(_Rank(cp, r), "ring")
        assert np.array_equal(ring.positions(t, documents), held[r])
        assert ring.positions(t, documents) is ring.positions(t, documents)            # cached per Documents
        assert np.array_equal(ring.positions(t), positions("zigzag", t, cp, r))        # unpacked: zigzag
        whole = packing.Documents([np.array([0])] * 2, t, 2 * t)
        assert np.array_equal(ring.positions(t, whole), positions("zigzag", t, cp, r))
        ulysses = ContextParallel(_Rank(cp, r), "ulysses")
        assert np.array_equal(ulysses.positions(t, documents), positions("contiguous", t, cp, r))
        contiguous_ring = ContextParallel(_Rank(cp, r), "ring", "contiguous")
        assert np.array_equal(contiguous_ring.positions(t, documents), positions("contiguous", t, cp, r))
    with pytest.raises(ValueError, match="16-token windows"):
        ContextParallel(_Rank(cp, 0), "ring").positions(t, packing.Documents([np.array([0, 3])], 16, 15))


def test_packed_batches_take_their_columns_from_their_documents():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, 3000).astype(np.uint16)
    starts = np.unique(np.concatenate([[0], np.cumsum(np.ceil(rng.pareto(1.2, 600) * 3)).astype(np.int64)]))
    data = formats.from_tokens(tokens, 0.1, starts[starts < len(tokens)])
    t, cp, seen = 16, 2, []
    ring = ContextParallel(_Rank(cp, 1), "ring")

    def columns(length, documents):
        seen.append(documents)
        return ring.positions(length, documents)
    x, y, documents = packing.get_batch(data, "train", 5, 2, range(4), t, columns, "documents")
    wx, wy, _ = packing.get_batch(data, "train", 5, 2, range(4), t, None, "documents")
    cols = ring.positions(t, documents)
    assert seen == [documents] and not documents.whole
    assert np.array_equal(x, wx[:, cols]) and np.array_equal(y, wy[:, cols])
    ux, _ = packing.get_batch(data, "train", 5, 2, range(4), t, columns)         # unpacked: zigzag
    assert seen[-1] is None
    assert np.array_equal(ux, corpus.get_batch(data.train, 5, 2, range(4), t, positions("zigzag", t, cp, 1))[0])
    cfg = types.SimpleNamespace(data=types.SimpleNamespace(packing="documents", balance="none"),
                                train=types.SimpleNamespace(seed=5, micro_batch_size=2, microbatches=2))
    batches = data_balance.GlobalBatches(data, cfg.data, cfg.train, t, 1, 0, ring.columns).batches("train", 1)
    whole = data_balance.GlobalBatches(data, cfg.data, cfg.train, t, 1, 0).batches("train", 1)
    for (bx, by, bd), (fx, fy, _) in zip(batches, whole):
        assert np.array_equal(bx, fx[:, ring.positions(t, bd)]) and np.array_equal(by, fy[:, ring.positions(t, bd)])
    assert ContextParallel(None, "ring").columns is None
