"""Tensor-parallel layers (Megatron-LM, arXiv 1909.08053; sequence parallelism, arXiv 2205.05198).

Every GEMM of a transformer layer is split over the ranks of a tensor-parallel
`Communicator` (`tp` ranks); communication happens only through the differentiable
collectives of `hpcpar.parallel.mappings`, so the model reads as math plus f/g:

    attention:  x -f-> c_attn (column: my heads' q, k, v) -> attention on my heads
                  -> c_proj (row) -g-> + bias
    MLP:        x -f-> c_fc (column) -> GELU -> c_proj (row) -g-> + bias

f (`copy_to`) is identity forward / all-reduce backward and g (`reduce_from`) the
reverse: 2 all-reduces forward and 2 backward per layer. A shard is always the slice
of the global tensor the single-process model initialises (`Layout.split`).

Sequence parallelism (`sequence_parallel=True`): between the sharded regions the
activations are split along the sequence, [B, T/tp, C]; LayerNorm, dropout and the
residual adds work on that shard. f becomes an all-gather along T (backward:
reduce-scatter) and g a reduce-scatter along T (backward: all-gather). Replicated
parameters used on a sequence shard (LayerNorm weights/biases, row-parallel biases, the
rows of wpe) receive only this shard's part of their gradient (`Parameter.sequence_parallel`).
On their own they enter the computation through f (`copy_to`), so the gradient arrives
summed over tp at every use and `.grad` is whole after any backward. Under the training
step `DataParallel` sets `tp_partial_grad` on them: each rank then accumulates its part over
the step's micro-batches, and one all-reduce over tp per step sums them all, before
clipping (Megatron's sequence-parallel gradient all-reduce; `mappings.sequence_parallel_param`).

The vocabulary is split too: `VocabParallelEmbedding` holds rows [V/tp, C] of wte,
the tied LM head computes logits [B, T, V/tp] from that shard, and
`vocab_parallel_cross_entropy` reduces max and sums over tp without gathering logits.
A vocabulary that tp does not divide is padded as Megatron pads GPT-2's 50257: every rank
holds ceil(V/tp) rows, the rows past V are zero padding (`Layout.split_padded`: the global
tensor stays [V, C], so checkpoints do not depend on tp), their logits are -inf in the loss
(no probability, no gradient) and gathered logits are cut back to V columns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpcpar import backend
from hpcpar.autograd import ops
from hpcpar.autograd.attention import causal_attention
from hpcpar.autograd.dropout import dropout
from hpcpar.autograd.functional import embedding, layer_norm
from hpcpar.autograd.linear import add_bias, linear
from hpcpar.layout import Layout
from hpcpar.nn.layers import LayerNorm
from hpcpar.nn.module import Module, Parameter
from hpcpar.parallel.mappings import (all_gather_dim, copy_to, gather_from, reduce_from, reduce_scatter_dim,
                                     sequence_parallel_param, split_to)
from hpcpar.backend.precision import down, up, up_dtype
from hpcpar.schema import require_divisible
from hpcpar.autograd.tensor import Tensor

if TYPE_CHECKING:  # annotations only: model code never needs MPI loaded
    from hpcpar.runtime.comm import Communicator

SEQ_DIM = 1  # activations are [B, T, C]


# Why each size must divide by tp (the hint of `require_divisible`'s message).
_WHOLE_HEADS = "(a tp rank holds whole heads)"
_MLP_SPLIT = "(the MLP width is split)"


def check_config(config, tp: int) -> None:
    """Raise ConfigError unless n_head and 4*n_embd divide by `tp` (a GPTConfig); the vocabulary
    need not (it is padded).

    A guard: `config.validate` reports the same rules (in the same words) before any collective.
    """
    require_divisible("n_head", config.n_head, "tp", tp, _WHOLE_HEADS)
    require_divisible("4*n_embd", 4 * config.n_embd, "tp", tp, _MLP_SPLIT)


def _zeros(layout: Layout, dtype, no_decay: bool = False) -> Parameter:
    return Parameter(backend.xp.zeros(layout.local_shape, dtype=dtype), layout, no_decay=no_decay)


def _on_sequence_shard(p: Parameter | None) -> Parameter | None:
    """Mark `p` (replicated) as applied to the sequence shard: its gradient is a part per tp rank."""
    if p is not None:
        p.sequence_parallel = True
    return p


def vocab_layout(vocab_size: int, n_embd: int, comm: Communicator) -> Layout:
    """wte / LM-head shard: rows [rank*P, (rank+1)*P) of the global [V, C], P = ceil(V/tp); the
    rows past V are padding (zero, never saved)."""
    return Layout.split_padded((vocab_size, n_embd), 0, comm.rank, comm.size)


class ColumnParallelLinear(Module):
    """y = x W^T + b with W [out, in] split on out features: this rank holds W [out/tp, in].

    In: x [.., in] replicated (entered through f), or [B, T/tp, in] under sequence
    parallelism (all-gathered along T). Out: [.., out/tp] sharded(-1), or [.., out]
    replicated with `gather_output`. With `groups=3` (the fused c_attn, rows [q; k; v])
    the out dim is split group by group, so the shard holds rows [q_r; k_r; v_r].
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator, bias: bool = True,
                 dtype="float32", groups: int = 1, gather_output: bool = False,
                 sequence_parallel: bool = False):
        super().__init__()
        # Each group of rows is split on its own: out_features / groups must divide by tp.
        require_divisible("out_features" if groups == 1 else f"out_features/{groups}", out_features // groups,
                          "tp", comm.size)
        if gather_output and groups > 1:
            raise ValueError("gather_output needs groups=1: gathered grouped shards are not in global order")
        self.comm, self.gather_output, self.sequence_parallel = comm, gather_output, sequence_parallel
        self.weight = _zeros(Layout.split((out_features, in_features), 0, comm.rank, comm.size, groups), dtype)
        self.bias = (_zeros(Layout.split((out_features,), 0, comm.rank, comm.size, groups), dtype, True)
                     if bias else None)

    def forward(self, x: Tensor, activation: str | None = None) -> Tensor:
        """`activation="gelu"`: gelu of my output columns, fused into the linear (`linear`)."""
        x = all_gather_dim(x, self.comm, SEQ_DIM) if self.sequence_parallel else copy_to(x, self.comm)
        y = linear(x, self.weight, self.bias, activation=activation)
        return gather_from(y, self.comm, -1) if self.gather_output else y


class RowParallelLinear(Module):
    """y = x W^T + b with W [out, in] split on in features: this rank holds W [out, in/tp].

    In: x [.., in/tp] sharded(-1) (a column-parallel output). Out: [.., out] replicated
    (g: all-reduce), or [B, T/tp, out] under sequence parallelism (reduce-scatter along T).
    The bias is replicated and added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator, bias: bool = True,
                 dtype="float32", sequence_parallel: bool = False):
        super().__init__()
        require_divisible("in_features", in_features, "tp", comm.size)
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = _zeros(Layout.split((out_features, in_features), 1, comm.rank, comm.size), dtype)
        self.bias = _zeros(Layout.replicated((out_features,)), dtype, True) if bias else None
        if sequence_parallel:
            _on_sequence_shard(self.bias)

    def forward(self, x_shard: Tensor) -> Tensor:
        # 16-bit activations: the partial sums stay float32 through the reduction and are rounded
        # once, after the bias, as the one-rank layer rounds its whole sum.
        partial = linear(x_shard, self.weight, out_dtype=up_dtype(x_shard.dtype))
        if self.sequence_parallel:
            y = reduce_scatter_dim(partial, self.comm, SEQ_DIM)
            # Added to my tokens only: the bias gradient is my part of the sum over the sequence.
            bias = sequence_parallel_param(self.bias, self.comm) if self.bias is not None else None
        else:
            y = reduce_from(partial, self.comm)
            bias = self.bias
        return add_bias(y, bias, x_shard.dtype)


class ParallelSelfAttention(Module):
    """Causal self-attention with the heads split over tp: this rank runs n_head/tp heads.

    In/out: [B, T, C] replicated, or [B, T/tp, C] under sequence parallelism.
    """

    def __init__(self, config, comm: Communicator, sequence_parallel: bool = False, attend=causal_attention):
        super().__init__()
        require_divisible("n_head", config.n_head, "tp", comm.size, _WHOLE_HEADS)
        c = config.n_embd
        self.n_head_local = config.n_head // comm.size
        self.attend = attend  # causal_attention, or context-parallel attention over my heads
        self.recompute_scores = False  # selective recomputation (GPT.set_recompute)
        self.c_attn = ColumnParallelLinear(c, 3 * c, comm, config.bias, config.dtype, groups=3,
                                           sequence_parallel=sequence_parallel)
        self.c_proj = RowParallelLinear(c, c, comm, config.bias, config.dtype, sequence_parallel)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.c_attn(x)                                    # [B, T, 3C/tp]: my heads' q, k, v
        return self.c_proj(self.attend(qkv, self.n_head_local, recompute=self.recompute_scores))


class ParallelMLP(Module):
    """c_fc (column, [4C/tp, C]) -> GELU -> c_proj (row, [C, 4C/tp]); layouts as attention."""

    def __init__(self, config, comm: Communicator, sequence_parallel: bool = False):
        super().__init__()
        c = config.n_embd
        require_divisible("4*n_embd", 4 * c, "tp", comm.size, _MLP_SPLIT)
        self.c_fc = ColumnParallelLinear(c, 4 * c, comm, config.bias, config.dtype,
                                         sequence_parallel=sequence_parallel)
        self.c_proj = RowParallelLinear(4 * c, c, comm, config.bias, config.dtype, sequence_parallel)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.c_fc(x, activation="gelu"))


class SequenceParallelLayerNorm(LayerNorm):
    """LayerNorm on a sequence shard [B, T/tp, C]; weight and bias replicated.

    Each rank sees only its tokens, so its weight/bias gradient is a partial sum over tp
    (`mappings.sequence_parallel_param`: summed at each use, or once per training step).
    """

    def __init__(self, dim: int, comm: Communicator, bias: bool = True, dtype="float32", eps: float = 1e-5):
        super().__init__(dim, bias, dtype, eps)
        self.comm = comm
        _on_sequence_shard(self.weight)
        _on_sequence_shard(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        bias = sequence_parallel_param(self.bias, self.comm) if self.bias is not None else None
        return layer_norm(x, sequence_parallel_param(self.weight, self.comm), bias, self.eps)


class VocabParallelEmbedding(Module):
    """Token embedding with wte split by rows: this rank holds W [V/tp, C], ids [lo, lo+V/tp)
    (V padded to a multiple of tp: padding rows are never looked up).

    In: idx int [B, T] (replicated). Out: [B, T, C] replicated (ids outside my rows
    contribute 0, then g sums the ranks), or [B, T/tp, C] under sequence parallelism
    (reduce-scatter along T instead of the all-reduce).
    """

    def __init__(self, vocab_size: int, n_embd: int, comm: Communicator, dtype="float32",
                 sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = _zeros(vocab_layout(vocab_size, n_embd, comm), dtype)

    def forward(self, idx) -> Tensor:
        xp = backend.array_module(self.weight.data)
        ids = xp.asarray(idx.data if isinstance(idx, Tensor) else idx)   # ids on the weight's device
        lo = self.comm.rank * self.weight.shape[0]
        mine = (ids >= lo) & (ids < lo + self.weight.shape[0])
        rows = embedding(xp.where(mine, ids - lo, 0), self.weight)
        partial = rows * mine[..., None].astype(rows.dtype)   # zero for ids another rank owns
        if self.sequence_parallel:
            return reduce_scatter_dim(partial, self.comm, SEQ_DIM)
        return reduce_from(partial, self.comm)


def vocab_parallel_cross_entropy(logits_shard: Tensor, targets, comm: Communicator,
                                 ignore_index: int = -100, vocab_size: int | None = None) -> Tensor:
    """Mean NLL of `targets` under softmax over the full vocabulary, from vocabulary shards.

    logits_shard [.., V/tp] holds columns [rank*V/tp, (rank+1)*V/tp); targets int [..]
    replicated. Forward: one all-reduce (max) for the row maxima and one (sum) carrying both
    the sum of exponentials and the target's logit (from the rank that owns it). Full logits
    are never gathered. Backward is local: softmax of my columns minus 1 at my targets.
    Returns a replicated scalar. Positions equal to `ignore_index` are left out of the mean.
    `vocab_size`: the true vocabulary when the shards are padded past it; padding columns get
    -inf logits, so no probability and no gradient.
    """
    xp = backend.array_module(logits_shard.data)
    ld = up(logits_shard.data)    # 16-bit logits: the softmax and the loss in float32
    v_local = ld.shape[-1]
    lo = comm.rank * v_local
    real = v_local if vocab_size is None else max(0, min(v_local, vocab_size - lo))  # my non-padding columns
    z = ld.reshape(-1, v_local)
    t = xp.asarray(targets.data if isinstance(targets, Tensor) else targets).reshape(-1)
    valid = t != ignore_index
    mine = valid & (t >= lo) & (t < lo + v_local)
    local_t = xp.where(mine, t - lo, 0)
    rows = xp.arange(z.shape[0])
    # The shift only guards exp() against overflow; it cancels, so it needs no gradient.
    row_max = z[:, :real].max(axis=1) if real else xp.full(z.shape[0], -xp.inf, dtype=z.dtype)
    shifted = z - comm.all_reduce(row_max, op="max")[:, None]
    if real < v_local:
        shifted[:, real:] = -xp.inf   # padding: exp() gives 0 below
    picked = xp.where(mine, shifted[rows, local_t], 0.0)
    xp.exp(shifted, out=shifted)
    total, picked = comm.all_reduce(xp.stack([shifted.sum(axis=1), picked]), op="sum")
    count = xp.maximum(valid.sum(), 1).astype(ld.dtype)   # targets are replicated: a global count
    loss = ((xp.log(total) - picked) * valid).sum() / count

    def backward(g):
        grad = shifted / total[:, None]
        grad[rows, local_t] -= mine                     # -1 at the target, on the rank that owns it
        grad *= (valid * (g / count))[:, None].astype(grad.dtype)
        return (down(grad.reshape(ld.shape), logits_shard.dtype),)
    return Tensor.from_op(loss.astype(ld.dtype), (logits_shard,), backward)


def parallel_lm_head(h: Tensor, weight_shard: Parameter, targets, comm: Communicator,
                     sequence_parallel: bool = False) -> Tensor:
    """Tied LM head on the vocabulary shard [V/tp, C].

    In: h [B, T, C] replicated, or [B, T/tp, C] under sequence parallelism (all-gathered
    along T here). With targets: the mean loss (replicated scalar) via
    `vocab_parallel_cross_entropy`. Without: full logits [B, T, V] replicated (gathered, and
    cut back to V when padded; for evaluation and sampling only).
    """
    h = all_gather_dim(h, comm, SEQ_DIM) if sequence_parallel else copy_to(h, comm)
    logits = linear(h, weight_shard)                            # [B, T, V/tp]
    vocab = weight_shard.layout.global_shape[0]                 # V; the shards may be padded past it
    if targets is None:
        full = gather_from(logits, comm, -1)
        return full if full.shape[-1] == vocab else ops.getitem(full, (Ellipsis, slice(0, vocab)))
    return vocab_parallel_cross_entropy(logits, targets, comm, vocab_size=vocab)


def sequence_parallel_dropout(x_shard: Tensor, p: float, mask_rng_keys, comm: Communicator, rows=None,
                              length: int | None = None) -> Tensor:
    """Dropout on a sequence shard [B, T/tp, ..] with the single-process model's mask: my rows
    of the mask the full sequence [T, ..] would get (drawn directly, never the whole mask), so
    results do not depend on tp. `rows` (positions in a sequence of `length`): the tokens the tp
    group holds when that is not the whole sequence (context parallelism); I hold part `rank`."""
    n = x_shard.shape[SEQ_DIM]
    mine = slice(comm.rank * n, (comm.rank + 1) * n)
    full = ((n * comm.size,) if rows is None else (length,)) + x_shard.shape[SEQ_DIM + 1:]
    return dropout(x_shard, p, mask_rng_keys, rows=mine if rows is None else rows[mine], full_shape=full)


class TensorParallelLayers:
    """Megatron's layers for a GPT over `comm` (tp ranks): which tensor-parallel module fills
    each role, and how the head and the sequence are split. Same methods as `gpt.PlainLayers`.

    Building it checks that the model divides over tp (heads, MLP width; the vocabulary is padded).
    """

    def __init__(self, config, comm: Communicator, sequence_parallel: bool = False):
        check_config(config, comm.size)
        self.comm, self.sequence_parallel = comm, sequence_parallel

    def wte(self, cfg) -> Module:
        return VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, self.comm, cfg.dtype, self.sequence_parallel)

    def attn(self, cfg, attend=causal_attention) -> Module:
        return ParallelSelfAttention(cfg, self.comm, self.sequence_parallel, attend)

    def mlp(self, cfg) -> Module:
        return ParallelMLP(cfg, self.comm, self.sequence_parallel)

    def norm(self, cfg) -> Module:
        if self.sequence_parallel:  # LayerNorm on the sequence shard: its weight/bias grads are summed over tp
            return SequenceParallelLayerNorm(cfg.n_embd, self.comm, cfg.bias, cfg.dtype)
        return LayerNorm(cfg.n_embd, cfg.bias, cfg.dtype)

    def vocab_layout(self, cfg) -> Layout:
        return vocab_layout(cfg.vocab_size, cfg.n_embd, self.comm)

    def position_ids(self, t: int):
        """The rows of wpe that the tp group's `t` tokens use: positions 0 .. t-1."""
        return slice(0, t)

    def positions(self, weight: Parameter, rows, t: int) -> Tensor:
        """The position embeddings of the tp group's `t` tokens (`rows` of wpe `weight`: a slice,
        positions [T], or per-sequence positions [B, T] (packed documents)): all of them [T, C]
        ([B, T, C]), or under sequence parallelism my part [T/tp, C] ([B, T/tp, C]). That part is
        cut from the whole lookup (its gradient all-gathered back: whole on every rank), or, when
        the training step sums wpe's gradient over tp (`tp_partial_grad`), looked up alone: the
        gradient reaches my rows only, and the sum over tp fills in the others."""
        if not self.sequence_parallel:
            return ops.getitem(weight, rows)
        # config checks block_size; a shorter batch is checked here
        require_divisible("sequence length T", t, "tp", self.comm.size, "with sequence parallelism")
        if not weight.tp_partial_grad:
            return split_to(ops.getitem(weight, rows), self.comm, 0 if isinstance(rows, slice) else rows.ndim - 1)
        n = t // self.comm.size
        lo = self.comm.rank * n
        start = (rows.start or 0) if isinstance(rows, slice) else 0
        mine = slice(start + lo, start + lo + n) if isinstance(rows, slice) else rows[..., lo:lo + n]
        return ops.getitem(weight, mine)

    def dropout(self, x: Tensor, p: float, keys, rows=None, length: int | None = None) -> Tensor:
        """As `PlainLayers.dropout`; under sequence parallelism x is my part of the group's tokens."""
        if self.sequence_parallel:  # x is a sequence shard: use my rows of the full-sequence mask
            return sequence_parallel_dropout(x, p, keys, self.comm, rows, length)
        full = None if rows is None else (length,) + tuple(x.shape[2:])
        return dropout(x, p, keys, rows=rows, full_shape=full)

    def lm_head(self, h: Tensor, weight: Tensor, targets) -> Tensor:
        return parallel_lm_head(h, weight, targets, self.comm, self.sequence_parallel)
