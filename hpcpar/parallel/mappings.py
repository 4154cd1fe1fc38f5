"""Collectives as autograd mappings: each forward collective paired with its adjoint.

Megatron's f and g and their sequence-parallel relatives (Megatron-LM
`tensor_parallel/mappings.py`), written over `hpcpar.runtime.comm`'s array collectives so that
tensor-parallel model code reads as plain math plus these calls. Each mapping takes the
`Communicator` of its group as an argument.

Layouts over the ranks of `comm`:
    replicated      every rank holds the same full value; ranks compute identically from it
                    unless it enters a sharded GEMM (then its gradient is a partial sum).
    partial-sum     the value is the sum of the ranks' arrays.
    sharded(dim)    rank r holds part r (equal parts, rank order) along `dim`.

    mapping              forward                      backward
    copy_to (f)          replicated -> replicated     all-reduce (partial-sum -> replicated)
    reduce_from (g)      partial-sum -> replicated    identity
    all_gather_dim       sharded(dim) -> full         reduce-scatter(dim)
    reduce_scatter_dim   partial-sum -> sharded(dim)  all-gather(dim)
    split_to             replicated -> sharded(dim)   all-gather(dim)
    gather_from          sharded(dim) -> replicated   keep my part
    all_to_all_v         rows to ranks by counts      all_to_all_v with the counts swapped

`sequence_parallel_param` is how a replicated parameter enters a sequence-sharded region: f,
or, when the training step sums its gradient over tp once per step instead, the parameter itself.

With `comm` None or of size 1 every mapping returns its input itself: no graph node, no cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpcpar import backend
from hpcpar.autograd.tensor import Tensor

if TYPE_CHECKING:  # annotations only: model code never needs MPI loaded
    from hpcpar.runtime.comm import Communicator


def _trivial(comm: Communicator | None) -> bool:
    return comm is None or comm.size == 1


def _part(a, comm: Communicator, dim: int):
    """Part `comm.rank` of `a` along `dim` (a C-contiguous copy); `a.shape[dim]` must divide evenly."""
    dim = dim % a.ndim
    n = a.shape[dim]
    if n % comm.size:
        raise ValueError(f"split on '{comm.name}': dim {dim} of shape {tuple(a.shape)} has size {n}, "
                         f"which does not divide into {comm.size} equal parts")
    part = n // comm.size
    index = (slice(None),) * dim + (slice(comm.rank * part, (comm.rank + 1) * part),)
    return backend.array_module(a).ascontiguousarray(a[index])


def copy_to(x: Tensor, comm: Communicator | None) -> Tensor:
    """Megatron's f, at the entry of a region whose ranks differ (sharded GEMMs).

    In: replicated. Out: replicated (the same array). Backward: all-reduce (sum), because
    each rank's gradient is only its shard's contribution (partial-sum -> replicated). On a
    parameter (sequence-parallel LayerNorm weights, row-parallel biases) the result reads the
    parameter's array when used (`Tensor.view_of_leaf`): the graph keeps no reference to it.
    """
    if _trivial(comm):
        return x
    if x.is_leaf:
        return Tensor.view_of_leaf(x, lambda g: (comm.all_reduce(g),))
    return Tensor.from_op(x.data, (x,), lambda g: (comm.all_reduce(g),))


def sequence_parallel_param(p: Tensor, comm: Communicator | None) -> Tensor:
    """A replicated parameter `p` applied to a sequence shard (`Parameter.sequence_parallel`: a
    LayerNorm weight or bias, a row-parallel bias), whose gradient on each rank is the part of its
    tokens. By default f (`copy_to`): the parts are summed over `comm` at every use, so `.grad` is
    whole after any backward. With `p.tp_partial_grad` (the training step owns the sum,
    `DataParallel`) `p` itself: `.grad` accumulates this rank's part over the step's micro-batches
    and is summed over tp once, after the last one (Megatron's all-reduce of the sequence-parallel
    gradients), instead of about six small all-reduces per block and micro-batch."""
    return p if getattr(p, "tp_partial_grad", False) else copy_to(p, comm)


def reduce_from(x: Tensor, comm: Communicator | None) -> Tensor:
    """Megatron's g, at the exit of a sharded region.

    In: partial-sum. Out: replicated (all-reduce, sum). Backward: identity (the gradient of
    a replicated value is already complete on every rank).
    """
    if _trivial(comm):
        return x
    return Tensor.from_op(comm.all_reduce(x.data), (x,), lambda g: (g,))


def all_gather_dim(x: Tensor, comm: Communicator | None, dim: int) -> Tensor:
    """Sequence-parallel entry: sharded(dim) -> full along `dim`, used by ranks that differ.

    In: [.., n, ..] sharded(dim). Out: [.., size*n, ..] (every rank's part, rank order).
    Backward: reduce-scatter along `dim` (partial-sum gradients -> sharded(dim)).
    """
    if _trivial(comm):
        return x
    return Tensor.from_op(comm.all_gather(x.data, dim), (x,), lambda g: (comm.reduce_scatter(g, dim),))


def reduce_scatter_dim(x: Tensor, comm: Communicator | None, dim: int) -> Tensor:
    """Sequence-parallel exit: partial-sum -> sharded(dim); the adjoint of `all_gather_dim`.

    In: [.., size*n, ..] partial-sum. Out: [.., n, ..], part `rank` of the sum.
    Backward: all-gather along `dim`.
    """
    if _trivial(comm):
        return x
    return Tensor.from_op(comm.reduce_scatter(x.data, dim), (x,), lambda g: (comm.all_gather(g, dim),))


def split_to(x: Tensor, comm: Communicator | None, dim: int) -> Tensor:
    """Keep my part: replicated -> sharded(dim), no communication forward.

    In: [.., size*n, ..] replicated. Out: [.., n, ..] part `rank`. Backward: all-gather along
    `dim`, so the replicated input's gradient is complete on every rank.
    """
    if _trivial(comm):
        return x
    return Tensor.from_op(_part(x.data, comm, dim), (x,), lambda g: (comm.all_gather(g, dim),))


def gather_from(x: Tensor, comm: Communicator | None, dim: int) -> Tensor:
    """Assemble the full tensor: sharded(dim) -> replicated (ranks then compute identically).

    In: [.., n, ..] sharded(dim). Out: [.., size*n, ..] replicated (all-gather).
    Backward: keep my part of the (replicated) gradient, no communication.
    """
    if _trivial(comm):
        return x
    return Tensor.from_op(comm.all_gather(x.data, dim), (x,), lambda g: (_part(g, comm, dim),))


def all_to_all_v(x: Tensor, comm: Communicator | None, send_counts, recv_counts) -> Tensor:
    """Rows to ranks (mixture-of-experts dispatch and combine): the first `send_counts[0]` rows of
    x [n, ...] go to rank 0, the next `send_counts[1]` to rank 1, ...; out [sum(recv_counts), ...]
    holds the rows from rank 0, then rank 1, ... (`Communicator.all_to_all_v`). The op is a
    permutation of rows across ranks, so its adjoint is the inverse permutation: backward sends
    each row's gradient back where the row came from, all_to_all_v with the counts swapped."""
    if _trivial(comm):
        return x
    send, recv = list(send_counts), list(recv_counts)
    return Tensor.from_op(comm.all_to_all_v(x.data, send, recv), (x,),
                          lambda g: (comm.all_to_all_v(g, recv, send),))
