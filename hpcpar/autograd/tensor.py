"""Autograd-lite: a Tensor that records the ops that made it, and reverse-mode backward.

A Tensor holds an array (`data`, NumPy or CuPy), an optional gradient (`grad`, same
shape and module) and, when it was produced by an op while gradients are enabled,
its parents and a `_backward` closure mapping the output gradient to one gradient
per parent. Ops live in `ops.py` and its sibling modules by family (linear, functional,
attention, dropout, recompute), each forward next to its gradient rule; an op outside them
(a collective mapping, a fused kernel) makes its result with `Tensor.from_op`.

Leaf gradients accumulate in place into an existing `.grad` array, so data
parallelism can point `.grad` at a view of a flat bucket; a leaf's grad hooks fire
once per `backward()` as soon as all uses of that leaf in the graph are done.

B and W (zero-bubble pipelines, Qi et al. 2024). `backward(g, inputs=..., defer=WeightGrads())`
splits the sweep in two: B computes the gradients that flow to the `inputs` leaves (and every
activation gradient on the way) now; everything that only feeds the other leaves (the
parameters) is left in the `WeightGrads` list, and `WeightGrads.run()` (W) does it later, in the
sweep's order, accumulating into `.grad` and firing the grad hooks exactly as the one-pass
backward would have (same arithmetic, same order: bitwise the same gradients). Ops mark the
parameter side of their gradient with `weight_grad(fn)` (`linear`'s dW and db,
`layer_norm`'s, `embedding`'s scatter): `fn()` runs at once in a plain backward and in W
under B. A node that only leads to parameters (a parameter view such as tensor parallelism's f
on a LayerNorm weight, or a node fed by such a gradient) runs in W as a whole.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

_grad_enabled = True
_deferring: "WeightGrads | None" = None  # the W list of the backward (B) running now, if it defers


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
    """Ops inside record a graph even where the caller disabled it (`recompute`'s re-run)."""
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
        leaves that are not among its parents (`recompute`: the parameters inside)."""
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

    def backward(self, grad=None, inputs=None, defer: "WeightGrads | None" = None) -> None:
        """Reverse-mode sweep from this tensor; `grad` defaults to ones (scalar loss).

        `defer`: run B only (see the module doc): the leaves in `inputs` get their gradients
        now, every other leaf's gradient work goes into `defer` for `defer.run()`. Inside a
        deferring backward (an op's backward that runs a nested one, `recompute`) `defer`
        defaults to the enclosing one's list, so nested work lands in the same W, in order.
        Without deferral `inputs` changes nothing: every leaf gets its gradient.
        """
        if grad is None:
            grad = self.data * 0 + 1
        defer = defer if defer is not None else _deferring
        order, leaf_uses = _topological_order(self)
        if defer is not None:
            _backward_input(self, grad, order, leaf_uses, inputs or (), defer)
            return
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

    # -- operators (implemented in ops.py, @ in linear.py) ------------------------------
    def __add__(self, other):
        return ops.add(self, other)

    def __radd__(self, other):
        return ops.add(other, self)

    def __sub__(self, other):
        return ops.sub(self, other)

    def __rsub__(self, other):
        return ops.sub(other, self)

    def __mul__(self, other):
        return ops.mul(self, other)

    def __rmul__(self, other):
        return ops.mul(other, self)

    def __truediv__(self, other):
        return ops.div(self, other)

    def __rtruediv__(self, other):
        return ops.div(other, self)

    def __neg__(self):
        return ops.neg(self)

    def __pow__(self, exponent):
        return ops.pow(self, exponent)

    def __matmul__(self, other):
        return linear.matmul(self, other)

    def __getitem__(self, index):
        return ops.getitem(self, index)

    def sum(self, axis=None, keepdims=False):
        return ops.sum(self, axis, keepdims)

    def mean(self, axis=None, keepdims=False):
        return ops.mean(self, axis, keepdims)

    def max(self, axis=None, keepdims=False):
        return ops.max(self, axis, keepdims)

    def reshape(self, *shape):
        return ops.reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)

    def transpose(self, *axes):
        return ops.transpose(self, axes[0] if len(axes) == 1 and isinstance(axes[0], tuple) else (axes or None))


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
    if isinstance(g, Deferred):
        g = g.fn()
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


# --------------------------------------------------------------------------- B and W


class Deferred:
    """A gradient an op leaves for the weight pass: `fn()` computes it (see `weight_grad`)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable):
        self.fn = fn


def weight_grad(fn: Callable):
    """The parameter side of an op's gradient (its dW): `fn()` now in a plain backward; inside
    a deferring backward (B) a `Deferred` that W evaluates. `fn` must read only arrays that
    nothing changes in between (the op's saved inputs and its output gradient)."""
    return fn() if _deferring is None else Deferred(fn)


def defers_weight_grads() -> bool:
    """Whether the backward running now defers its dW (`weight_grad` returns `Deferred`s): an op
    whose dX and dW come cheapest from one pass computes both at once when it does not."""
    return _deferring is not None


def _value(c):
    """A contribution's array: computed now if it was deferred, the late node's result if a slot."""
    if isinstance(c, Deferred):
        return c.fn()
    if isinstance(c, _Slot):
        return _value(c.value)
    return c


class _Slot:
    """Where a late node's W delivers its gradient for one parent (filled when W runs it)."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = None


class _LeafGrad:
    """W event: one graph edge's gradient for a leaf (a parameter), accumulated and counted then."""

    __slots__ = ("leaf", "value", "leaf_uses")

    def __init__(self, leaf: Tensor, value, leaf_uses: dict):
        self.leaf, self.value, self.leaf_uses = leaf, value, leaf_uses

    def run(self) -> None:
        _accumulate_leaf(self.leaf, _value(self.value), self.leaf_uses)


class _LateNode:
    """W event: a node that only leads to parameters. Its gradient is the sum of `contribs` in
    the order they arrived; running it calls the node's backward, accumulates into leaf parents
    and fills the slots of the non-leaf ones (late nodes too, run after it)."""

    __slots__ = ("node", "contribs", "slots", "leaf_uses")

    def __init__(self, node: Tensor, leaf_uses: dict):
        self.node, self.contribs, self.slots, self.leaf_uses = node, [], None, leaf_uses

    def run(self) -> None:
        node, g = self.node, None
        for c in self.contribs:  # the one-pass sweep's `prev + pg`, in the same order
            pg = _value(c)
            if pg is not None:
                g = pg if g is None else g + pg
        parent_grads = node._backward(g) if g is not None else (None,) * len(node._parents)
        for parent, pg, slot in zip(node._parents, parent_grads, self.slots):
            if parent is None or not parent.requires_grad:
                continue
            if slot is None:
                _accumulate_leaf(parent, pg, self.leaf_uses)
            else:
                slot.value = pg
        node._backward = None
        node._parents = ()
        self.contribs = self.slots = None


class WeightGrads:
    """The W half of one or more deferring backwards: events in the order the one-pass sweep
    would have done them. `run()` does them all (and empties the list); running them leaves
    `.grad` of every parameter as the plain backward would, and fires its grad hooks then."""

    def __init__(self):
        self.events: list = []

    def __len__(self) -> int:
        return len(self.events)

    def run(self) -> None:
        events, self.events = self.events, []
        for event in events:
            event.run()


def _needs_inputs(order: list, inputs) -> set:
    """ids of the nodes whose gradient reaches a leaf in `inputs` (B must compute those)."""
    wanted = {id(x) for x in inputs}
    needed = set(wanted)
    for node in order:  # parents first
        if any(p is not None and id(p) in needed for p in node._parents):
            needed.add(id(node))
    return needed


def _backward_input(root: Tensor, grad, order: list, leaf_uses: dict, inputs, defer: WeightGrads) -> None:
    """B: the sweep of `Tensor.backward`, leaving to `defer` what only feeds leaves outside `inputs`.

    A node runs now unless it is late: a parameter view (`Tensor.view_of_leaf`), or a node some
    consumer gave a `Deferred` gradient or a late node feeds; a late node's backward runs in W.
    Nodes whose gradient reaches `inputs` are never late (a `Deferred` for them is computed now).
    """
    global _deferring
    needed = _needs_inputs(order, inputs)
    grads = {id(root): grad}
    late: dict = {}  # id(node) -> _LateNode
    previous, _deferring = _deferring, defer
    try:
        for node in reversed(order):
            key = id(node)
            if node._backward is None:  # a leaf root
                if node is root:
                    if key in needed:
                        _accumulate_leaf(node, grads.pop(key, None), leaf_uses)
                    else:
                        defer.events.append(_LeafGrad(node, grads.pop(key, None), leaf_uses))
                continue
            if key not in late and key not in needed and isinstance(node, _LeafView):
                late[key] = _LateNode(node, leaf_uses)
                if key in grads:
                    late[key].contribs.append(grads.pop(key))
            if key in late:
                event = late.pop(key)
                event.slots = []
                for parent in node._parents:
                    slot = None
                    if parent is not None and parent.requires_grad and parent._backward is not None:
                        slot = _Slot()
                        _late(parent, late, grads, leaf_uses).contribs.append(slot)
                    event.slots.append(slot)
                defer.events.append(event)
                continue
            g = grads.pop(key, None)
            parent_grads = node._backward(g) if g is not None else (None,) * len(node._parents)
            for parent, pg in zip(node._parents, parent_grads):
                if parent is None or not parent.requires_grad:
                    continue
                pkey = id(parent)
                if pkey in needed:
                    if isinstance(pg, Deferred):
                        pg = pg.fn()
                    if parent._backward is None:
                        _accumulate_leaf(parent, pg, leaf_uses)
                    elif pg is not None:
                        prev = grads.get(pkey)
                        grads[pkey] = pg if prev is None else prev + pg
                elif parent._backward is None:
                    defer.events.append(_LeafGrad(parent, pg, leaf_uses))
                elif pkey in late or isinstance(pg, Deferred):
                    _late(parent, late, grads, leaf_uses).contribs.append(pg)
                elif pg is not None:
                    prev = grads.get(pkey)
                    grads[pkey] = pg if prev is None else prev + pg
            node._backward = None
            node._parents = ()
    finally:
        _deferring = previous


def _late(node: Tensor, late: dict, grads: dict, leaf_uses: dict) -> _LateNode:
    """`node`'s late record, made on first need; the sum it got so far becomes its first contribution."""
    event = late.get(id(node))
    if event is None:
        event = late[id(node)] = _LateNode(node, leaf_uses)
        if id(node) in grads:
            event.contribs.append(grads.pop(id(node)))
    return event


# The operators above are ops.py's and linear.py's functions; they build on Tensor, so they are bound last.
from hpcpar.autograd import linear, ops  # noqa: E402
