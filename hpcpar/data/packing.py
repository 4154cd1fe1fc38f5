"""Packed documents: each window's document starts, the loss rule, and the batches that carry them.

``data.packing = "documents"`` samples windows exactly as ``"none"`` does (the same seed, the same
offsets: the token stream already is documents back to back, `corpus.get_batch`) and adds, per
window, where documents start inside it. Every *segment* of a window (from the window's start or a
document start to the next start) is attended as its own sequence:

- no token attends across a boundary (`autograd.attention.document_attention`);
- positions restart at 0 at each segment start (`Documents.positions`);
- a target that crosses a boundary (the token before a document start predicting that start,
  the window's last target included) is left out of the loss: it is set to -100, which
  `cross_entropy` ignores; a step's loss is the mean over the global batch's remaining targets
  (the per-token loss, data/balance.py: each micro-batch's mean weighted by its share of them).

So a packed batch's per-segment losses and gradients are those of the segments run alone.

Document starts come with the data (`formats.Dataset.train_starts` / ``val_starts``): a sorted
int64 array of offsets into the split's token stream, beginning with 0 (a split may begin inside
a document: it is then a cut document).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass

import numpy as np

from hpcpar.data import corpus
from hpcpar.errors import CheckpointError, DataError

PACKING = ("none", "documents")
IGNORE = -100   # the target `cross_entropy` leaves out


@dataclass
class Documents:
    """Where segments start inside each window of a micro-batch.

    starts: one sorted int64 array per window (row), each beginning with 0, every entry in
        [0, block_size): the row's segment starts (window start, then document starts).
    block_size: T, the window length.
    targets: how many targets the loss keeps (not crossing a boundary) in the batch the loss is the
        per-token mean of: these windows (`of_windows`), or a step's global batch (data/balance.py).
    losses: how many micro-batch losses the trainer averages over that batch (cp ranks not counted:
        1 for these windows, dp * microbatches for a global batch). `GPT._head` weights a loss over
        kept_here targets by kept_here * losses * cp / targets.
    """

    starts: list
    block_size: int
    targets: int
    losses: int = 1

    @classmethod
    def of_windows(cls, doc_starts: np.ndarray, window_starts: np.ndarray, block_size: int
                   ) -> tuple["Documents", np.ndarray]:
        """The Documents of windows beginning at stream offsets `window_starts` [B] (x covers
        [s, s + T), y [s + 1, s + T]) in a stream whose documents begin at `doc_starts`, and the
        [B, T] mask of targets that cross a boundary (y[t] is the start of a document)."""
        s = np.asarray(window_starts, dtype=np.int64)
        lo = np.searchsorted(doc_starts, s, side="right")                # first document start > s
        hi = np.searchsorted(doc_starts, s + block_size, side="right")   # past those <= s + T
        crossing = np.zeros((len(s), block_size), dtype=bool)
        starts = []
        for b in range(len(s)):
            inside = doc_starts[lo[b]:hi[b]] - s[b]                      # in (0, T]
            crossing[b, inside - 1] = True
            starts.append(np.concatenate([[0], inside[inside < block_size]]).astype(np.int64))
        return cls(starts, block_size, int(crossing.size - crossing.sum())), crossing

    @property
    def whole(self) -> bool:
        """Every window is one segment (no document starts inside any)."""
        return all(len(st) == 1 for st in self.starts)

    def positions(self) -> np.ndarray:
        """[B, T] int64: each token's position in its segment (0 at every segment start)."""
        t = np.arange(self.block_size, dtype=np.int64)
        out = np.empty((len(self.starts), self.block_size), dtype=np.int64)
        for b, st in enumerate(self.starts):
            out[b] = t - st[np.searchsorted(st, t, side="right") - 1]
        return out

    def segments(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """The segments grouped by length: [(L, rows [n], offsets [n])], segment k of a group being
        tokens offsets[k] .. offsets[k] + L - 1 of row rows[k]; every token is in exactly one."""
        groups: dict[int, tuple[list, list]] = {}
        for b, st in enumerate(self.starts):
            ends = np.append(st[1:], self.block_size)
            for a, e in zip(st.tolist(), ends.tolist()):
                rows, offsets = groups.setdefault(e - a, ([], []))
                rows.append(b)
                offsets.append(a)
        return [(length, np.array(rows, dtype=np.int64), np.array(offsets, dtype=np.int64))
                for length, (rows, offsets) in sorted(groups.items())]


def get_batch(dataset, split: str, seed: int, index: int, sample_ids, block_size: int,
              positions=None, packing: str = "none") -> tuple:
    """Samples `sample_ids` of training step `index` (`split` "train") or validation batch
    `index` ("val") of `dataset` (a `formats.Dataset`).

    Returns ``(x, y)`` as `corpus.get_batch` / `corpus.get_eval_batch` (int64 [B, T]) with
    packing "none"; with "documents" ``(x, y, Documents)``, y's boundary-crossing targets set
    to -100 (the module doc). `positions` (context parallelism's columns): x and y hold only those
    columns [B, len(positions)]; the Documents stay those of the whole windows. `positions` may be
    a callable (T, Documents or None) -> columns (`ContextParallel.positions`): the columns then
    follow each micro-batch's documents (ring attention deals packed windows by attention work).
    """
    train = split == "train"
    tokens = dataset.train if train else dataset.val
    sample = corpus.get_batch if train else corpus.get_eval_batch
    documents = crossing = None
    if packing != "none":
        starts = corpus.window_starts(len(tokens), seed, index, sample_ids, block_size, stream=0 if train else 1)
        documents, crossing = Documents.of_windows(document_starts(dataset, split), starts, block_size)
    if callable(positions):
        positions = positions(block_size, documents)
    x, y = sample(tokens, seed, index, sample_ids, block_size, positions)
    if documents is None:
        return x, y
    y[crossing if positions is None else crossing[:, positions]] = IGNORE
    return x, y, documents


def document_starts(dataset, split: str) -> np.ndarray:
    """The document starts of `dataset`'s `split` ("train" or "val"); a one-line DataError without."""
    doc_starts = dataset.train_starts if split == "train" else dataset.val_starts
    if doc_starts is None:
        raise DataError(f"data.packing = \"documents\" needs document boundaries, and {dataset.description} "
                        "has none; use a corpus directory, a token directory from `hpcpar data prepare`, "
                        "or data.packing = \"none\"")
    return doc_starts


def split_starts(starts: np.ndarray, n_tokens: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The document starts of `corpus.split`'s two parts of a stream of `n_tokens` whose documents
    start at `starts` (each part's offsets its own, beginning with 0)."""
    cut = n_tokens - int(n_tokens * val_fraction)
    train = starts[starts < cut]
    val = starts[starts >= cut] - cut
    return train, np.concatenate([[0], val[val > 0]]).astype(np.int64)


def check_starts(starts: np.ndarray, n_tokens: int, where: str) -> np.ndarray:
    """`starts` as int64 once it is a document index of a stream of `n_tokens`: begins with 0,
    strictly increasing, every offset below `n_tokens`; else a one-line DataError naming `where`."""
    starts = np.asarray(starts)
    if starts.ndim != 1 or starts.size == 0 or starts[0] != 0:
        raise DataError(f"{where}: a document index must begin with offset 0 (crafted or damaged); prepare the "
                        "data again")
    step = np.diff(starts)
    if step.size and step.min() <= 0:
        k = int(np.argmin(step))
        raise DataError(f"{where}: document offsets out of order ({int(starts[k])} then {int(starts[k + 1])}); "
                        "prepare the data again")
    if int(starts[-1]) >= n_tokens:
        raise DataError(f"{where}: document offset {int(starts[-1])} is beyond the end of its {n_tokens:,} tokens: "
                        "the index does not match its token file; prepare the data again")
    return starts.astype(np.int64)


def require_resumable(stored, packing: str) -> None:
    """A resumed run keeps its packing: `stored` (a `state.StoredState`) must record data.packing ==
    `packing` in its config (none recorded: "none"), unless only its weights are loaded; else a
    one-line CheckpointError."""
    if stored.weights_only:
        return
    try:
        data = tomllib.loads(stored.meta.get("config") or "").get("data", {})
    except tomllib.TOMLDecodeError as err:
        raise CheckpointError(f"checkpoint {stored.path}: its stored config is not TOML ({err})") from None
    was = data.get("packing", "none") if isinstance(data, dict) else "none"
    if was != packing:
        raise CheckpointError(f"checkpoint {stored.path} was trained with data.packing = \"{was}\" and this run sets "
                              f"\"{packing}\": resuming would silently change the loss; set data.packing = "
                              f"\"{was}\" (or load its weights only)")
