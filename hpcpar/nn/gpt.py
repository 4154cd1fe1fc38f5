"""GPT (nanoGPT architecture and parameter names), whole or as one pipeline stage.

Layout of activations: idx [B, T] int -> h [B, T, C] -> logits [B, T, V].
Pre-LayerNorm blocks: h = h + attn(ln_1(h)); h = h + mlp(ln_2(h)). The LM head is
tied to `transformer.wte.weight`.

With a tensor-parallel communicator of size tp > 1 the blocks, wte and the head are the
layers of `tensor_parallel.py` (same names, parameters are shards of the same global
tensors); with `sequence_parallel` the activations between blocks (and a stage's input
and output) are sequence shards [B, T/tp, C].

A pipeline stage is `GPT(config, layers=range(a, b), embed=..., head=...)`: blocks
keep their global index in their names (`transformer.h.5.attn.c_attn.weight`), so a
stage's parameters are named exactly as in the whole model. When the head lives on a
stage without the embedding, it owns a copy `lm_head.weight` with
`tied_to = "transformer.wte.weight"`, initialised identically; the pipeline keeps
the two equal by summing their gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpcpar import backend, ops
from hpcpar.layout import Layout
from hpcpar.nn import init
from hpcpar.nn.layers import Embedding, LayerNorm, Linear
from hpcpar.nn.module import Module, Parameter
from hpcpar.nn.tensor_parallel import TensorParallelPlan
from hpcpar.tensor import Tensor

DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256      # byte-level tokens
    block_size: int = 128      # maximum sequence length T
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = True          # biases in Linear and LayerNorm
    dropout: float = 0.0       # residual and embedding dropout (attention probabilities: none)
    dtype: str = "float32"     # parameter and compute dtype

    def non_embedding_params(self) -> int:
        """Parameters outside wte/wpe (the N of MFU's 6N): per block 12C^2 weights, 2 LayerNorm
        weights (2C) and with bias 11C biases; plus ln_f."""
        c, bias = self.n_embd, int(self.bias)
        return self.n_layer * (12 * c * c + 2 * c + 11 * c * bias) + c * (1 + bias)


class CausalSelfAttention(Module):
    """c_attn: [3C, C] rows [q; k; v] -> fused causal attention -> c_proj: [C, C]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, cfg.bias, cfg.dtype)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, cfg.bias, cfg.dtype)

    def forward(self, x):
        return self.c_proj(ops.causal_attention(self.c_attn(x), self.n_head))


class MLP(Module):
    """c_fc: [4C, C] -> GELU(tanh) -> c_proj: [C, 4C]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, cfg.bias, cfg.dtype)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, cfg.bias, cfg.dtype)

    def forward(self, x):
        return self.c_proj(ops.gelu(self.c_fc(x)))


class Block(Module):
    def __init__(self, index: int, ln_1: Module, attn: Module, ln_2: Module, mlp: Module, dropout_sites):
        super().__init__()
        self.index = index
        self.ln_1 = ln_1
        self.attn = attn
        self.ln_2 = ln_2
        self.mlp = mlp
        self._dropout = dropout_sites

    def forward(self, h):
        h = h + self._dropout(self.attn(self.ln_1(h)), 2 * self.index + 1)
        return h + self._dropout(self.mlp(self.ln_2(h)), 2 * self.index + 2)


class Blocks(Module):
    """Transformer blocks registered under their global layer index ("5", "6", ...)."""

    def __init__(self, blocks: list):
        super().__init__()
        for block in blocks:
            setattr(self, str(block.index), block)
        self.items = blocks


class Transformer(Module):
    """Container matching nanoGPT's `transformer.*` names."""


class PlainPlan:
    """The one-process layer plan: which module fills each role of a GPT, and how the head and
    the sequence are treated. `tensor_parallel.TensorParallelPlan` has the same methods (the
    Megatron plan); GPT is built from whichever plan its tensor-parallel degree calls for."""

    sequence_parallel = False

    def wte(self, cfg: GPTConfig) -> Module:
        return Embedding(cfg.vocab_size, cfg.n_embd, cfg.dtype)

    def attn(self, cfg: GPTConfig) -> Module:
        return CausalSelfAttention(cfg)

    def mlp(self, cfg: GPTConfig) -> Module:
        return MLP(cfg)

    def norm(self, cfg: GPTConfig) -> Module:
        return LayerNorm(cfg.n_embd, cfg.bias, cfg.dtype)

    def vocab_layout(self, cfg: GPTConfig) -> Layout:
        """Layout of wte / a stage's tied LM-head copy [V, C]."""
        return Layout.replicated((cfg.vocab_size, cfg.n_embd))

    def positions(self, pos: Tensor, t: int) -> Tensor:
        """The position embeddings [T, C] this rank adds to its activations."""
        return pos

    def dropout(self, x: Tensor, p: float, keys) -> Tensor:
        return ops.dropout(x, p, keys)

    def lm_head(self, h: Tensor, weight: Tensor, targets) -> Tensor:
        """ln_f output [B, T, C] -> the mean loss (with targets) or logits [B, T, V]."""
        logits = ops.linear(h, weight)
        return logits if targets is None else ops.cross_entropy(logits, targets)


class GPT(Module):
    """The model or one pipeline stage of it.

    Args:
        config: the architecture.
        tp_comm: tensor-parallel Communicator (None or size 1: plain layers).
        layers: global indices of the blocks on this stage (default: all).
        embed: this stage holds wte/wpe and takes token ids.
        head: this stage holds ln_f and the LM head and returns logits or the loss.
        sequence_parallel: Megatron-SP (with tp > 1).
        seed: initialisation seed (values depend only on seed, name and global shape).
    """

    def __init__(self, config: GPTConfig, tp_comm=None, layers=None, embed: bool = True,
                 head: bool = True, sequence_parallel: bool = False, seed: int = 0):
        super().__init__()
        if config.dtype not in DTYPES:
            raise ValueError(f"model dtype {config.dtype!r} not supported here; choose one of {DTYPES}")
        self.config = config
        self.embed, self.head = embed, head
        self.layer_ids = list(range(config.n_layer) if layers is None else layers)
        self.rng_context = None  # (seed, step, sample_ids) for dropout masks; set by the trainer
        cfg = config
        # Tensor parallelism only when there is more than one tp rank (size 1: the plain layers).
        self.tp_comm = tp_comm if tp_comm is not None and tp_comm.size > 1 else None
        self.plan = (PlainPlan() if self.tp_comm is None
                     else TensorParallelPlan(cfg, self.tp_comm, bool(sequence_parallel)))
        self.sequence_parallel = self.plan.sequence_parallel
        plan = self.plan
        self.transformer = Transformer()
        if embed:
            self.transformer.wte = plan.wte(cfg)
            self.transformer.wpe = Embedding(cfg.block_size, cfg.n_embd, cfg.dtype)
        self.transformer.h = Blocks([
            Block(i, plan.norm(cfg), plan.attn(cfg), plan.norm(cfg), plan.mlp(cfg), self._dropout)
            for i in self.layer_ids])
        if head:
            self.transformer.ln_f = plan.norm(cfg)
            if embed:
                object.__setattr__(self, "head_weight", self.transformer.wte.weight)
            else:
                layout = plan.vocab_layout(cfg)
                self.lm_head = Module()
                self.lm_head.weight = Parameter(backend.xp.zeros(layout.local_shape, dtype=cfg.dtype),
                                                layout, tied_to="transformer.wte.weight")
                object.__setattr__(self, "head_weight", self.lm_head.weight)
        self.init_weights(seed)

    # -- initialisation -----------------------------------------------------------------
    def init_weights(self, seed: int) -> None:
        """GPT-2 init: N(0, 0.02) weights and embeddings, residual projections
        N(0, 0.02/sqrt(2 n_layer)), zero biases, LayerNorm weight 1."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            key = p.tied_to or name
            if name.endswith(".bias") or ".ln_" in name or name.startswith("transformer.ln_f"):
                continue  # zeros / ones from construction
            std = resid_std if name.endswith("c_proj.weight") else 0.02
            full = init.normal(seed, key, p.layout.global_shape, std)
            p.data[...] = backend.to_device(p.layout.take(full).astype(p.dtype))

    # -- forward ------------------------------------------------------------------------
    def _dropout(self, x, site: int):
        p = self.config.dropout
        if p == 0.0 or not self.training:
            return x
        if self.rng_context is None:
            raise RuntimeError("dropout > 0 needs model.rng_context = (seed, step, sample_ids)")
        seed, step, sample_ids = self.rng_context
        return self.plan.dropout(x, p, [(seed, step, int(k), site) for k in sample_ids])

    def forward(self, x, targets=None):
        """x: idx int [B, T] (embed; host or device) or activations [B, T, C] ([B, T/tp, C] under
        sequence parallelism); targets int [B, T] (head). Returns the loss, logits [B, T, V] or
        activations (same layout as x). Token ids and targets move to the parameters' device here."""
        if self.embed:
            xp = backend.array_module(self.transformer.wpe.weight.data)
            idx = xp.asarray(x.data if isinstance(x, Tensor) else x)
            t = idx.shape[1]
            if t > self.config.block_size:
                raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
            tok = self.transformer.wte(idx)   # [B, T, C], or [B, T/tp, C] under sequence parallelism
            pos = self.plan.positions(ops.getitem(self.transformer.wpe.weight, slice(0, t)), t)
            h = self._dropout(tok + pos, 0)
        else:
            h = x
        for block in self.transformer.h.items:
            h = block(h)
        if not self.head:
            return h
        if targets is not None:
            targets = backend.array_module(self.head_weight.data).asarray(
                targets.data if isinstance(targets, Tensor) else targets)
        return self.plan.lm_head(self.transformer.ln_f(h), self.head_weight, targets)

    def num_params(self, non_embedding: bool = True) -> int:
        """Global parameter count of this module (non-embedding excludes wte/wpe/lm_head)."""
        total = 0
        for name, p in self.named_parameters():
            if non_embedding and (name.startswith("transformer.wte") or name.startswith("transformer.wpe")
                                  or p.tied_to):
                continue
            n = 1
            for d in p.layout.global_shape:
                n *= d
            total += n
        return total
