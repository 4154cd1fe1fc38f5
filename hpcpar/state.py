"""The one contract between a checkpoint and the state it holds: `Checkpointable`.

Every part of a run whose state a checkpoint keeps answers the same two methods:

    checkpoint_state() -> SavedState        what this rank saves: global tensor name -> (local
                                            array, Layout), and the JSON metadata the part needs
    load_checkpoint_state(stored) -> None   take it back from a `StoredState`, in this run's
                                            layout (any layout: checkpoints hold global tensors)

The parts: the model and optimizer state (a gradient sync strategy, parallel/dp/sync.py, which
knows what it shards; the update's choice between it and the parameter servers,
training/update.py; a server's range, parallel/ps/server.py), the gradient compressor's
residuals and Qs (parallel/dp/compression/state.py), the fp16 loss scale (optim/loss_scale.py),
a whole `Module` for one-process tools (nn/module.py), and the run position, which the
`Trainer` and a server's `ServerRank` add around their parts. hpcpar/checkpoint/parts.py saves
a list of parts (their states merged) and loads them.

Loading has two phases so that a job reads a checkpoint once, however many parts each rank has
and whatever they are (a worker's are not a server's): each part's `load_checkpoint_state` asks
`stored.read(wanted, then)` for the tensors it needs, in the layouts it needs; when every part
has asked, the loader reads every rank's tensors in one collective read, which first checks that
the checkpoint holds exactly the tensors the whole job asked for (a larger model's checkpoint is
refused, not half loaded), and then calls each `then(arrays)` in the order asked. A part changes
its state only in `then` (a part that needs only metadata asks for no tensors), so a checkpoint
that cannot be read leaves every part as it was. `load_checkpoint_state` (and `checkpoint_state`)
may run collectives, matched on every rank of the job (a `ServerRank` matches the `Trainer`'s);
`then` runs none, since a worker's parts are not a server's.

Objects that hold state by object or by bucket rather than by global name (an optimizer's
`state_of(param)`, a compressor's residuals per bucket) are not parts: the part that owns them
names their arrays. This module is pure and sits at the package root so that every layer, the
model and the optimizers included, can implement the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol

from hpcpar.layout import Layout


def key_of(param: Any, name: str) -> str:
    """A parameter's name in checkpoints: a tied copy (`tied_to`, the LM head on the last pipeline
    stage) is stored and loaded under the weight it mirrors."""
    return getattr(param, "tied_to", None) or name


@dataclass
class SavedState:
    """What a part saves from this rank.

    Attributes:
        tensors: global name (`model/<param>`, `optim/<param>/<state>`, `compress/...`) ->
            (local array, its Layout). NumPy or device arrays, not copied: the save copies what
            this rank writes.
        meta: JSON-able metadata (rank 0's is stored: a worker's, whose parts hold the run's).
    """

    tensors: dict[str, tuple[Any, Layout]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def merged(states: Iterable[SavedState]) -> SavedState:
        """The states of several parts as one. Parts own disjoint names: a tensor name or
        metadata key given twice is a bug, and raises ValueError."""
        out = SavedState()
        for state in states:
            for kind, mine, theirs in (("tensor", out.tensors, state.tensors), ("metadata key", out.meta, state.meta)):
                twice = sorted(set(mine) & set(theirs))
                if twice:
                    raise ValueError(f"two checkpointed parts save the {kind} {twice[0]!r}")
                mine.update(theirs)
        return out


class StoredState(Protocol):
    """A checkpoint being loaded, as a part sees it (hpcpar/checkpoint/parts.py builds it).

    Attributes:
        path: the checkpoint as the caller named it (for messages).
        meta: the checkpoint's metadata (`step`, `optimizer_step`, `config`, ...).
        weights_only: load the parameters only; every other state stays as it is (a fresh
            optimizer, compressor and loss scale; the run position unchanged).
    """

    path: str
    meta: dict[str, Any]
    weights_only: bool

    def read(self, wanted: Mapping[str, Layout], then: Callable[[dict[str, Any]], None]) -> None:
        """Ask for the tensors `wanted` (global name -> the Layout this rank needs); once the
        job's one collective read is done, `then` gets {name: host NumPy array of the layout's
        local shape}. Raises, on every rank alike, what the read raises (`CheckpointError`)."""


class Checkpointable(Protocol):
    """A part of a run whose state checkpoints hold (module docstring)."""

    def checkpoint_state(self) -> SavedState:
        """What this rank saves of the part (collective where the part says so)."""

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """Ask `stored` for the part's tensors and take them, with its metadata, in `then`."""
