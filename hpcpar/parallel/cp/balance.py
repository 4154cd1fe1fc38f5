"""Ring attention's zigzag layout balanced by attention work, for packed documents.

The ring's zigzag layout (`attention.positions`) cuts the sequence into 2cp equal chunks and gives
rank r chunks r and 2cp-1-r: under one causal mask per window chunk j's queries attend to
(j + 1/2) chunks of keys on average, so every pair holds the same work. With packed documents
(`data.packing.Documents`) a query attends only the keys of its own segment, so a query at
in-segment position p does p + 1 (query, key) pairs, and the token split no longer balances them.

Here the chunks are dealt two per rank by that work instead (tokens stay balanced: T/cp per rank,
and every divisibility rule of the zigzag layout still holds):

    W_j        work of chunk j of a micro-batch: sum over its B rows and its queries of
               (in-segment position + 1), the unmasked pairs of its rows of the scores
    pairing    the chunks sorted by (W_j, j); the i-th lightest with the i-th heaviest, pair i to
               rank i, each rank's two chunks in increasing index (its local order)

Pairing the extremes of a sorted list minimises the largest pair sum over all ways of cutting it
into pairs (exchange argument: if the heaviest chunk h goes with x and the lightest l with y,
re-pairing them as (h, l) and (x, y) gives sums h + l <= h + x and x + y <= h + x, so the largest
sum does not grow; then the same on the rest), so no dealing of two chunks per rank has a busier
busiest rank. A window without document starts has W_j increasing with j, so
the pairing is zigzag's exactly (rank r: chunks r and 2cp-1-r): unpacked runs and windows of one
segment keep today's positions bit for bit.
"""

from __future__ import annotations

import numpy as np


def chunk_work(documents, chunks: int) -> np.ndarray:
    """int64 [chunks]: the attention work W_j of each of `chunks` equal chunks of the windows of
    `documents` (a `data.packing.Documents`, [B, T]): the sum over its queries of position + 1."""
    t = documents.block_size
    if t % chunks:
        raise ValueError(f"sequence length {t} does not split into {chunks} equal chunks")
    return (documents.positions() + 1).sum(axis=0).reshape(chunks, t // chunks).sum(axis=1)


def pair_chunks(work) -> list[tuple[int, int]]:
    """The 2cp chunks of `work` [2cp] dealt two per rank (the module doc): [cp] (chunk, chunk),
    increasing inside each pair, pair i being rank i's."""
    order = sorted(range(len(work)), key=lambda j: (int(work[j]), j))
    half = len(order) // 2
    return [tuple(sorted((order[i], order[-1 - i]))) for i in range(half)]


def balanced_positions(documents, cp: int) -> list[np.ndarray]:
    """Every rank's global positions (int64 [T/cp] each, rank order) of the windows of
    `documents` under the work-balanced zigzag layout: rank r's two chunks, in local order."""
    t = documents.block_size
    c = t // (2 * cp)
    return [np.concatenate([np.arange(j * c, (j + 1) * c) for j in pair])
            for pair in pair_chunks(chunk_work(documents, 2 * cp))]


def rank_work(documents, held: list[np.ndarray]) -> np.ndarray:
    """int64 [cp]: the attention work (unmasked (query, key) pairs, all rows) of each rank holding
    positions `held[r]` of the windows of `documents`."""
    per_position = (documents.positions() + 1).sum(axis=0)
    return np.array([int(per_position[p].sum()) for p in held], dtype=np.int64)
