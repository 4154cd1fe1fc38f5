"""Full activation recomputation (gradient checkpointing) as a differentiable op: `recompute(fn, *inputs)`
keeps only the inputs and re-runs `fn` inside its backward."""

from __future__ import annotations

from hpcpar.autograd.tensor import Tensor, enable_grad, is_grad_enabled, no_grad


def recompute(fn, *inputs: Tensor) -> Tensor:
    """fn(*inputs) keeping only `inputs` for backward (full activation recomputation, a.k.a.
    gradient checkpointing; Chen et al. 2016, Korthikanti et al. 2022).

    Forward runs `fn` under `no_grad`: none of its intermediates outlive it. Backward re-runs
    `fn` with the graph recorded on fresh leaves holding the saved inputs' arrays and backpropagates
    the incoming gradient through that graph; the leaves' gradients are this op's. The re-run
    must compute what the first run did: `fn` may read no state that changed in between (a
    caller that keys dropout masks on a per-micro-batch context captures it in `fn`, see
    `nn.gpt.GPT`), and the same arithmetic in the same order then gives bitwise the same
    gradients as running `fn` without this op.

    Parameters used inside `fn` are not parents of this op: they are leaves of the re-run's
    graph, so each receives its gradient and fires its grad hooks (data parallelism's counting)
    once per backward of this op, inside it (under a split backward: in the weight pass, W,
    which then holds what the re-run's weight gradients need, as a block kept whole would).
    Collectives inside `fn` are issued again by the re-run, so every rank of their group must
    recompute the same `fn` at the same point.

    Under `no_grad` this is just `fn(*inputs)`. Returns a Tensor that requires grad (whenever
    gradients are enabled: `fn`'s parameters may need them though no input does).
    """
    if not is_grad_enabled():
        return fn(*inputs)
    with no_grad():
        out = fn(*inputs)

    def backward(g):
        leaves = tuple(Tensor(x.data, requires_grad=x.requires_grad) for x in inputs)
        with enable_grad():
            y = fn(*leaves)
        # Inside a split backward (B) only the leaves' gradients are wanted now; the parameters'
        # join the enclosing backward's weight pass (tensor.WeightGrads), in order.
        y.backward(g, inputs=leaves)
        return tuple(leaf.grad for leaf in leaves)
    return Tensor.from_op(out.data, tuple(inputs), backward, always=True)
