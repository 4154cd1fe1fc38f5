"""Which windows of a global batch each (dp rank, micro-batch) gets (``data.balance``), and the per-token loss.

A step's global batch is the windows of sample ids 0 .. N - 1, N = dp * microbatches * micro_batch_size:
a window depends only on (seed, step, sample id) (`corpus.window_starts`), so every rank knows every
window without communication. Packed (``data.packing = "documents"``) every window still holds T
tokens; what differs between windows is the attention work, sum over its segments of len^2
(`window_work`), and slightly how many targets the loss keeps.

Dealing, ids [dp, microbatches, micro_batch_size]:

- ``"none"``: in sample-id order, ids (j * dp + d) * mbs .. of dp rank d's micro-batch j
  (`corpus.microbatch_sample_ids`, today's dealing);
- ``"attention"``: greedy longest-first. The windows by work, largest first (ties: smaller sample
  id), each onto the dp rank with the least work so far that still has room for it (ties: lower
  rank); then each rank's windows, in the same order, onto its micro-batches alike. Every slot gets
  exactly micro_batch_size windows (ascending ids inside it); deterministic on every rank.

The per-token loss (Megatron's), for packed runs: a step's loss is the NLL summed over the kept
targets of the whole global batch / their number. Each micro-batch loss (each cp rank's) is the
mean over its own kept targets, and the trainer averages L = dp * microbatches * cp of them: the
logged loss (`Trainer._global_mean_loss`, `_agree`), the gradient (the executor's 1/microbatches,
the dp and cp gradient mean). So `GPT._head` weights each by kept_here * L / kept_global
(`Documents.losses` = dp * microbatches, `Documents.targets` = kept_global), and both are the
per-token mean over the global batch whatever its grouping: the same on every mesh and dealing.
A validation batch is a global batch of its own: the validation loss is the mean of their per-token
means.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from hpcpar.data import corpus, packing
from hpcpar.errors import DataError

BALANCE = ("none", "attention")


@dataclass
class Dealing:
    """A global batch dealt to the dp ranks' micro-batches.

    ids: int64 [dp, microbatches, micro_batch_size], the sample ids of each slot.
    targets: the global batch's kept targets (packed; None: not packed).
    work: int64 [dp], attention work of each dp rank's windows (packed; None: not packed).
    kept: int64 [dp], kept targets of each dp rank's windows (packed; None: not packed).
    """

    ids: np.ndarray
    targets: int | None = None
    work: np.ndarray | None = None
    kept: np.ndarray | None = None

    def figures(self) -> dict:
        """The metrics record's balance fields: max / mean over the dp ranks of attention work
        (``work_imbalance``) and of kept targets (``target_imbalance``; every rank holds the same
        tokens); {} unpacked."""
        if self.work is None:
            return {}
        return {"work_imbalance": float(self.work.max() / self.work.mean()),
                "target_imbalance": float(self.kept.max() / self.kept.mean())}


def window_work(documents: packing.Documents) -> np.ndarray:
    """int64 [B]: each window's attention work, the sum over its segments of len^2."""
    ends = [np.append(st[1:], documents.block_size) for st in documents.starts]
    return np.array([int(((e - st) ** 2).sum()) for st, e in zip(documents.starts, ends)], dtype=np.int64)


def in_order(dp: int, microbatches: int, micro_batch_size: int) -> np.ndarray:
    """``"none"``'s ids [dp, microbatches, micro_batch_size]: the sample-id order."""
    return np.array([[list(corpus.microbatch_sample_ids(d, dp, micro_batch_size, j)) for j in range(microbatches)]
                     for d in range(dp)], dtype=np.int64).reshape(dp, microbatches, micro_batch_size)


def by_work(work: np.ndarray, dp: int, microbatches: int, micro_batch_size: int) -> np.ndarray:
    """``"attention"``'s ids [dp, microbatches, micro_batch_size] for windows of `work` [N] (sample id
    k's at k, N = dp * microbatches * micro_batch_size): greedy longest-first (the module doc)."""
    order = np.lexsort((np.arange(len(work)), -np.asarray(work)))   # work descending, then id
    out = np.empty((dp, microbatches, micro_batch_size), dtype=np.int64)
    for d, mine in enumerate(_greedy(work, order, dp, microbatches * micro_batch_size)):
        for j, ids in enumerate(_greedy(work, mine, microbatches, micro_batch_size)):
            out[d, j] = sorted(ids)
    return out


def _greedy(work: np.ndarray, order, groups: int, size: int) -> list[list[int]]:
    """Each id of `order` in turn onto the group with the least work so far among those holding
    fewer than `size` ids (ties: lower group); returns each group's ids in the order they came."""
    members: list[list[int]] = [[] for _ in range(groups)]
    heap = [(0, g) for g in range(groups)]        # (work so far, group) of the groups with room
    for k in order:
        load, g = heapq.heappop(heap)
        members[g].append(int(k))
        if len(members[g]) < size:
            heapq.heappush(heap, (load + int(work[k]), g))
    return members


def deal(dataset, split: str, seed: int, index: int, dp: int, microbatches: int, micro_batch_size: int,
         block_size: int, packing_mode: str = "none", balance: str = "none") -> Dealing:
    """The Dealing of training step `index` (`split` "train") or validation batch `index` ("val") of
    `dataset` (a `formats.Dataset`); packed, with each window's work and kept targets."""
    if packing_mode == "none":
        return Dealing(in_order(dp, microbatches, micro_batch_size))
    n = dp * microbatches * micro_batch_size
    train = split == "train"
    tokens = dataset.train if train else dataset.val
    starts = corpus.window_starts(len(tokens), seed, index, range(n), block_size, stream=0 if train else 1)
    documents, crossing = packing.Documents.of_windows(packing.document_starts(dataset, split), starts, block_size)
    work, kept = window_work(documents), block_size - crossing.sum(axis=1)
    ids = (by_work(work, dp, microbatches, micro_batch_size) if balance == "attention"
           else in_order(dp, microbatches, micro_batch_size))
    if not kept.sum():  # every target crosses a boundary: documents of one token each
        raise DataError(f"{split} batch {index}: no target is left once those crossing a document boundary are "
                        "left out (documents of one token?): the per-token loss has nothing to average; check the "
                        "document index, or set data.packing = \"none\"")
    per_rank = ids.reshape(dp, -1)
    return Dealing(ids, int(kept.sum()), work[per_rank].sum(axis=1), kept[per_rank].sum(axis=1))


class GlobalBatches:
    """One dp rank's micro-batches of each step's (and validation batch's) global batch, dealt by
    `data.balance`, packed ones weighted for the per-token loss (the module doc).

    Args:
        dataset: a `formats.Dataset`.
        data: the run's data section (packing, balance); train: its train section (seed,
            micro_batch_size, microbatches).
        block_size: T. dp, dp_rank: the data-parallel size and this rank's place in it.
        positions: context parallelism's columns of this rank (None: all), or a callable (T, Documents
            or None) -> columns giving each micro-batch's, as `packing.get_batch`.
    """

    def __init__(self, dataset, data, train, block_size: int, dp: int, dp_rank: int, positions=None):
        self.dataset, self.data, self.train, self.block_size = dataset, data, train, block_size
        self.dp, self.dp_rank, self.positions = dp, dp_rank, positions
        # (split, index) -> Dealing of the last two asked: a step asks for its dealing several times, and
        # a parameter-server worker also for the next step's (the rows its pull brings, update.py).
        self._last: dict = {}

    def dealing(self, split: str, index: int) -> Dealing:
        """The Dealing of training step `index` (`split` "train") or validation batch `index` ("val")."""
        key = (split, index)
        if key not in self._last:
            t = self.train
            dealing = deal(self.dataset, split, t.seed, index, self.dp, t.microbatches, t.micro_batch_size,
                           self.block_size, self.data.packing, self.data.balance)
        else:
            dealing = self._last.pop(key)
        self._last = {**dict(list(self._last.items())[-1:]), key: dealing}   # the two most recently asked
        return dealing

    def sample_ids(self, split: str = "train", index: int | None = None) -> list[np.ndarray]:
        """This rank's sample ids, one int64 array of micro_batch_size per micro-batch, of training step
        (validation batch) `index`; None: the sample-id order, which does not depend on the step."""
        t = self.train
        if index is None:
            return list(in_order(self.dp, t.microbatches, t.micro_batch_size)[self.dp_rank])
        return list(self.dealing(split, index).ids[self.dp_rank])

    def batches(self, split: str, index: int, sample_ids=None) -> list:
        """This rank's micro-batches of training step (validation batch) `index`, `packing.get_batch`'s
        (x, y) or (x, y, Documents) each, of `sample_ids` (one sequence per micro-batch; None: the
        dealing's); packed, the Documents count the global batch's kept targets and its dp *
        microbatches micro-batches (the per-token loss)."""
        dealing = self.dealing(split, index)
        mine = dealing.ids[self.dp_rank] if sample_ids is None else sample_ids
        out = [packing.get_batch(self.dataset, split, self.train.seed, index, ids, self.block_size, self.positions,
                                 self.data.packing) for ids in mine]
        if dealing.targets is not None:
            for _, _, documents in out:
                documents.targets, documents.losses = dealing.targets, self.dp * self.train.microbatches
        return out

    def figures(self, step: int) -> dict:
        """Training step `step`'s balance figures for its metrics record (`Dealing.figures`)."""
        return self.dealing("train", step).figures()
