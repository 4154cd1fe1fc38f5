"""Module and Parameter: named, possibly sharded, trainable tensors.

A `Parameter` is a leaf Tensor that knows how its local array maps onto the global
tensor (`layout`), whether weight decay applies (`no_decay`) and, for a copy of a
weight that lives on another pipeline stage, the global name it mirrors (`tied_to`).
"""

from __future__ import annotations

from typing import Iterator

from hpcpar.backend import array_module
from hpcpar.layout import Layout
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
    """

    __slots__ = ("layout", "no_decay", "tied_to", "expert", "sequence_parallel", "tp_partial_grad")

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

    def state_dict(self) -> dict:
        """Global name -> this rank's local array (not a copy)."""
        return {name: p.data for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy arrays in by global name; shapes must match the local shards."""
        params = dict(self.named_parameters())
        if strict:
            missing = sorted(set(params) - set(state))
            unexpected = sorted(set(state) - set(params))
            if missing or unexpected:
                raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        for name, p in params.items():
            if name not in state:
                continue
            value = state[name]
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)} does not match {tuple(p.shape)}")
            p.data[...] = array_module(p.data).asarray(value)  # host arrays onto a GPU parameter
