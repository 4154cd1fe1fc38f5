"""Saving and loading `Checkpointable` parts (hpcpar/state.py): what a trainer, a parameter
server's rank and the one-process tools call instead of `save` and `load` themselves.

`save_parts` merges the parts' `SavedState`s into one `save`. `load_parts` reads the metadata,
lets every part ask for its tensors (`_Stored.read`), then reads them all in one collective
`load` and hands each part its arrays: one read per rank however many parts ask, so worker and
server ranks, whose parts differ, take part in the same collectives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from hpcpar.checkpoint.load import load
from hpcpar.checkpoint.save import save
from hpcpar.layout import Layout
from hpcpar.state import Checkpointable, SavedState

if TYPE_CHECKING:
    from hpcpar.runtime.comm import Communicator
    from hpcpar.runtime.solo import SoloCommunicator


def save_parts(directory: str, step: int, parts: Iterable[Checkpointable], comm: Communicator | SoloCommunicator,
               **options: Any):
    """Save the parts' states as checkpoint `step` (collective over `comm`, and over each part's own
    collectives, in the order of `parts`). `options`: `save`'s keep, async_save, storage."""
    state = SavedState.merged(part.checkpoint_state() for part in parts)
    return save(directory, step, state.tensors, state.meta, comm, **options)


def load_parts(path: str, parts: Iterable[Checkpointable], comm: Communicator | SoloCommunicator,
               weights_only: bool = False) -> dict:
    """Load the parts from the checkpoint at `path` (or its parent's latest), in any layout
    (collective over `comm`); returns the checkpoint's metadata.

    With `weights_only`, or from a checkpoint that holds only weights (`hpcpar ckpt import`'s),
    the parts load the parameters only. Raises `CheckpointError` on every rank alike when the
    checkpoint is missing, corrupt, or of another model than the whole job's parts ask for.
    """
    _, meta = load(path, {}, comm)
    stored = _Stored(path, meta, weights_only or bool(meta.get("weights_only")))
    for part in parts:
        part.load_checkpoint_state(stored)
    stored.finish(comm)
    return meta


class _Stored:
    """The `StoredState` of one load: collects the parts' requests, then reads them at once."""

    def __init__(self, path: str, meta: dict, weights_only: bool):
        self.path, self.meta, self.weights_only = path, meta, weights_only
        self._asked: list[tuple[dict[str, Layout], Callable[[dict[str, Any]], None]]] = []

    def read(self, wanted: Mapping[str, Layout], then: Callable[[dict[str, Any]], None]) -> None:
        self._asked.append((dict(wanted), then))

    def finish(self, comm: Communicator | SoloCommunicator) -> None:
        """Read every part's tensors (collective), then hand each part its own, in the order asked."""
        wanted: dict[str, Layout] = {}
        for asked, _ in self._asked:
            twice = sorted(set(wanted) & set(asked))
            if twice:  # parts own disjoint names, as when saving (`SavedState.merged`)
                raise ValueError(f"two checkpointed parts load the tensor {twice[0]!r}")
            wanted.update(asked)
        names = set().union(*comm.all_gather_object(set(wanted)))  # every stage's (and server's) tensors
        stored = self.meta.get("compression")
        if not self.weights_only and stored:
            # Compressor state is optional (docs/checkpoint-format.md): a run that does not
            # compress ignores it, yet it belongs to the checkpoint.
            names |= set(stored["names"])
        arrays, _ = load(self.path, wanted, comm, all_names=names, only_prefix="model/" if self.weights_only else "")
        for asked, then in self._asked:
            then({name: arrays[name] for name in asked})
