"""Module and Parameter: named, possibly sharded, trainable tensors.

A `Parameter` is a leaf Tensor that knows how its local array maps onto the global
tensor (`layout`), whether weight decay applies (`no_decay`) and, for a copy of a
weight that lives on another pipeline stage, the global name it mirrors (`tied_to`).
A `Module` saves and loads its parameters as checkpoint tensors (`Checkpointable`, hpcpar/state.py).
"""

from __future__ import annotations

from typing import Iterator

from hpcpar.backend import array_module
from hpcpar.layout import Layout
from hpcpar.state import SavedState, StoredState, key_of
from hpcpar.autograd.tensor import Tensor


class Parameter(Tensor):
    """A trainable leaf tensor.

    Attributes:
        layout: local shard <-> global tensor map (replicated unless a TP layer says otherwise).
        no_decay: True for biases and LayerNorm weights (AdamW skips their decay).
        tied_to: global name of the weight this one mirrors on another stage, else None.
        expert: a mixture-of-experts expert weight: split over the expert-parallel group (its
            layout) and replicated over the ranks holding the same experts, whose average its
            gradient takes (the expert-data-parallel group), not over dp.
        sequence_parallel: replicated over tp but applied to the sequence shard (Megatron-SP's
            LayerNorm weights and biases, row-parallel biases, wpe): a tp rank's backward gives
            only its tokens' part of the gradient, and the parts add up over tp.
        tp_partial_grad: (sequence_parallel only) `.grad` stays this tp rank's part, and the
            training step sums it over tp once per step (`DataParallel`); False: the model sums
            it at every use (f, `mappings.sequence_parallel_param`).
        sparse_grad: the gradient is nonzero only in the rows of [rows, ...] the forward looked up
            (an untied embedding, `model.tie_embeddings = false`): the data-parallel sync may send
            those rows alone (parallel/dp/sparse.py).
    """

    __slots__ = ("layout", "no_decay", "tied_to", "expert", "sequence_parallel", "tp_partial_grad", "sparse_grad")

    def __init__(self, data, layout: Layout | None = None, no_decay: bool = False,
                 tied_to: str | None = None, expert: bool = False):
        super().__init__(data, requires_grad=True)
        self.layout = layout if layout is not None else Layout.replicated(data.shape)
        if tuple(self.layout.local_shape) != tuple(data.shape):
            raise ValueError(f"parameter array {data.shape} does not match its layout's local shape "
                             f"{self.layout.local_shape}")
        self.no_decay = no_decay
        self.tied_to = tied_to
        self.expert = expert
        self.sequence_parallel = False
        self.tp_partial_grad = False
        self.sparse_grad = False

    def __repr__(self) -> str:
        return f"Parameter(shape={self.shape}, global={self.layout.global_shape}, dtype={self.dtype})"


class Module:
    """Base class: attributes that are Parameters or Modules are registered by name."""

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._children[name] = value
        object.__setattr__(self, name, value)

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        yield prefix, self
        for name, child in self._children.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        """(global name, parameter) pairs in registration order; a tied weight appears once."""
        seen: set = set()
        for prefix, module in self.named_modules():
            for name, p in module._parameters.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{prefix}.{name}" if prefix else name), p

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def train(self, mode: bool = True) -> "Module":
        for _, m in self.named_modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def checkpoint_state(self) -> SavedState:
        """`model/<global name>` -> (this rank's local array, its layout) of every parameter, a
        tied copy under the weight it mirrors (`Checkpointable`, hpcpar/state.py). A training run
        saves the model through its gradient sync instead, which knows what it shards: this is for
        a whole model on one process (`hpcpar sample`)."""
        return SavedState({f"model/{key_of(p, name)}": (p.data, p.layout) for name, p in self.named_parameters()})

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """Every parameter's slice of its stored global tensor, in its layout."""
        params = list(self.named_parameters())

        def take(arrays: dict) -> None:
            for name, p in params:
                p.data[...] = array_module(p.data).asarray(arrays[f"model/{key_of(p, name)}"])  # onto a GPU parameter
        stored.read({f"model/{key_of(p, name)}": p.layout for name, p in params}, take)
