"""Autograd-lite: a Tensor that records the ops that made it, and reverse-mode backward.

A Tensor holds an array (`data`, NumPy or CuPy), an optional gradient (`grad`, same
shape and module) and, when it was produced by an op while gradients are enabled,
its parents and a `_backward` closure mapping the output gradient to one gradient
per parent. Ops live in `ops.py`, each forward next to its gradient rule; an op
outside it (a collective mapping, a fused kernel) makes its result with `Tensor.from_op`.

Leaf gradients accumulate in place into an existing `.grad` array, so data
parallelism can point `.grad` at a view of a flat bucket; a leaf's grad hooks fire
once per `backward()` as soon as all uses of that leaf in the graph are done.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

_grad_enabled = True


def is_grad_enabled() -> bool:
    return _grad_enabled


@contextlib.contextmanager
def _grad_mode(enabled: bool) -> Iterator[None]:
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, enabled
    try:
        yield
    finally:
        _grad_enabled = previous


def no_grad():
    """Ops inside record no graph (evaluation, optimizer updates)."""
    return _grad_mode(False)


def enable_grad():
    """Ops inside record a graph even where the caller disabled it (`ops.recompute`'s re-run)."""
    return _grad_mode(True)


class Tensor:
    """An array plus the graph that produced it.

    Attributes:
        data: the array (numpy.ndarray or cupy.ndarray).
        grad: gradient of the last backward's root w.r.t. this tensor (leaves only), or None.
        requires_grad: whether gradients flow to (leaves) or through (op results) this tensor.
    """

    __slots__ = ("data", "grad", "requires_grad", "_parents", "_backward", "_hooks", "__weakref__")

    def __init__(self, data, requires_grad: bool = False):
        self.data = data
        self.grad = None
        self.requires_grad = requires_grad
        self._parents: tuple = ()
        self._backward: Callable | None = None
        self._hooks: list | None = None

    @staticmethod
    def from_op(data, parents: tuple, backward: Callable, always: bool = False) -> "Tensor":
        """The result of an op: `data`, with `backward(g) -> one gradient (or None) per parent`
        attached when gradients are enabled and some parent requires them (else a plain
        Tensor, so evaluation keeps no graph). `parents` may hold None for non-Tensor inputs.
        `always`: attach it whenever gradients are enabled, for an op whose backward reaches
        leaves that are not among its parents (`ops.recompute`: the parameters inside)."""
        if not _grad_enabled:
            return Tensor(data)
        if not always:  # a plain loop: this runs for every op
            for p in parents:
                if p is not None and p.requires_grad:
                    break
            else:
                return Tensor(data)
        out = Tensor(data, True)
        out._parents = parents
        out._backward = backward
        return out

    @staticmethod
    def view_of_leaf(leaf: "Tensor", backward: Callable) -> "Tensor":
        """An op whose result *is* the leaf's array (an identity such as tensor parallelism's f on
        a parameter), with `backward(g)` as its gradient rule. The result reads `leaf.data` on
        every access instead of holding the array, so the graph keeps no reference to it: ZeRO-3
        frees a gathered parameter between forward and backward and gathers it again, and the
        ops that consume this result read it at backward time. A plain Tensor of the array when
        no gradient is recorded."""
        if _grad_enabled and leaf.requires_grad:
            return _LeafView(leaf, backward)
        return Tensor(leaf.data)

    # -- array-like facts -------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def is_leaf(self) -> bool:
        return self._backward is None

    def numpy(self):
        from hpcpar.backend import to_host
        return to_host(self.data)

    def item(self) -> float:
        if self.data.size != 1:
            raise ValueError(f"item() needs a single value, this tensor has shape {self.shape}")
        return float(self.data.reshape(()).item())

    def detach(self) -> "Tensor":
        return Tensor(self.data)

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"

    # -- hooks and backward -------------------------------------------------------------
    def register_grad_hook(self, fn: Callable[["Tensor"], None]) -> None:
        """Call `fn(self)` when this leaf's gradient for a backward pass is complete."""
        if self._hooks is None:
            self._hooks = []
        self._hooks.append(fn)

    def backward(self, grad=None) -> None:
        """Reverse-mode sweep from this tensor; `grad` defaults to ones (scalar loss)."""
        if grad is None:
            grad = self.data * 0 + 1
        order, leaf_uses = _topological_order(self)
        grads = {id(self): grad}
        for node in reversed(order):
            g = grads.pop(id(node), None)
            if node._backward is None:  # a leaf: fed by its consumers, except a leaf root
                if node is self:
                    _accumulate_leaf(node, g, leaf_uses)
                continue
            parent_grads = node._backward(g) if g is not None else (None,) * len(node._parents)
            for parent, pg in zip(node._parents, parent_grads):
                if parent is None or not parent.requires_grad:
                    continue
                if parent._backward is None:
                    _accumulate_leaf(parent, pg, leaf_uses)
                elif pg is not None:
                    key = id(parent)
                    prev = grads.get(key)
                    grads[key] = pg if prev is None else prev + pg
            # Free the closure (and the activations it stashed) as soon as it has run.
            node._backward = None
            node._parents = ()

    # -- operators (implemented in ops.py) ------------------------------------------------
    def __add__(self, other):
        return _ops.add(self, other)

    def __radd__(self, other):
        return _ops.add(other, self)

    def __sub__(self, other):
        return _ops.sub(self, other)

    def __rsub__(self, other):
        return _ops.sub(other, self)

    def __mul__(self, other):
        return _ops.mul(self, other)

    def __rmul__(self, other):
        return _ops.mul(other, self)

    def __truediv__(self, other):
        return _ops.div(self, other)

    def __rtruediv__(self, other):
        return _ops.div(other, self)

    def __neg__(self):
        return _ops.neg(self)

    def __pow__(self, exponent):
        return _ops.pow(self, exponent)

    def __matmul__(self, other):
        return _ops.matmul(self, other)

    def __getitem__(self, index):
        return _ops.getitem(self, index)

    def sum(self, axis=None, keepdims=False):
        return _ops.sum(self, axis, keepdims)

    def mean(self, axis=None, keepdims=False):
        return _ops.mean(self, axis, keepdims)

    def max(self, axis=None, keepdims=False):
        return _ops.max(self, axis, keepdims)

    def reshape(self, *shape):
        return _ops.reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)

    def transpose(self, *axes):
        return _ops.transpose(self, axes[0] if len(axes) == 1 and isinstance(axes[0], tuple) else (axes or None))


class _LeafView(Tensor):
    """See `Tensor.view_of_leaf`: an op result whose `data` is its leaf parent's current array."""

    __slots__ = ("leaf",)

    def __init__(self, leaf: Tensor, backward: Callable):  # noqa: D107 - fields as Tensor.from_op sets them
        self.leaf = leaf
        self.grad = None
        self.requires_grad = True
        self._parents = (leaf,)
        self._backward = backward
        self._hooks = None

    @property
    def data(self):  # noqa: D102 - read through the leaf, never stored
        return self.leaf.data


def _topological_order(root: Tensor) -> tuple[list, dict]:
    """Nodes reachable from `root` in topological order (parents first), and for each
    leaf the number of graph edges that reach it (its pending uses)."""
    order: list = []
    seen: set = set()
    leaf_uses: dict = {}
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for parent in node._parents:
            if parent is None or not parent.requires_grad:
                continue
            if parent._backward is None:
                leaf_uses[id(parent)] = leaf_uses.get(id(parent), 0) + 1
            if id(parent) not in seen:
                stack.append((parent, False))
    if root._backward is None:
        leaf_uses[id(root)] = leaf_uses.get(id(root), 0) + 1
    return order, leaf_uses


def _accumulate_leaf(leaf: Tensor, g, leaf_uses: dict) -> None:
    if g is not None:
        if leaf.grad is None:
            # Copy: an op may hand the same array to several parents.
            leaf.grad = g.astype(leaf.data.dtype, copy=True)
        else:
            leaf.grad += g
    remaining = leaf_uses[id(leaf)] - 1
    leaf_uses[id(leaf)] = remaining
    if remaining == 0 and leaf._hooks:
        for hook in leaf._hooks:
            hook(leaf)


# The operators above are ops.py's functions; ops builds on Tensor, so it is bound last.
from hpcpar import ops as _ops  # noqa: E402
