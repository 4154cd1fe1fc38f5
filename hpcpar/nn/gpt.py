"""GPT (nanoGPT architecture and parameter names), whole or as one pipeline stage.

Layout of activations: idx [B, T] int -> h [B, T, C] -> logits [B, T, V].
Pre-LayerNorm blocks: h = h + attn(ln_1(h)); h = h + mlp(ln_2(h)). The LM head is
tied to `transformer.wte.weight` (`model.tie_embeddings`, the default), or with
`tie_embeddings = false` a weight of its own, `lm_head.weight` [V, C] (vocab-parallel under tp
like wte), initialised N(0, 0.02) from its own name's seed stream: wte's gradient then comes
from the lookup alone and is nonzero only in the rows of the tokens seen (`Parameter.sparse_grad`,
which the data-parallel sync may send as rows: parallel/dp/sparse.py).

With a tensor-parallel communicator of size tp > 1 the blocks, wte and the head are the
layers of `parallel/tp/layers.py` (same names, parameters are shards of the same global
tensors); with `sequence_parallel` the activations between blocks (and a stage's input
and output) are sequence shards [B, T/tp, C].

A pipeline stage is `GPT(config, layers=range(a, b), embed=..., head=...)`: blocks
keep their global index in their names (`transformer.h.5.attn.c_attn.weight`), so a
stage's parameters are named exactly as in the whole model. When the (tied) head lives on a
stage without the embedding, it owns a copy `lm_head.weight` with
`tied_to = "transformer.wte.weight"`, initialised identically; the pipeline keeps
the two equal by summing their gradients. An untied head's `lm_head.weight` is a plain
parameter on whichever stage holds the head.

Packed documents (`data.packing`): `forward(x, targets, documents=...)` with a
`data.packing.Documents` runs every segment of a window as its own sequence: positions from its
start (wpe gathered per token) and `document_attention` (no attention across a boundary).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpcpar import backend
from hpcpar.autograd import ops
from hpcpar.autograd.attention import causal_attention, document_attention
from hpcpar.autograd.dropout import dropout
from hpcpar.data.packing import IGNORE
from hpcpar.autograd.functional import cross_entropy
from hpcpar.autograd.linear import linear
from hpcpar.autograd.recompute import recompute
from hpcpar.errors import ConfigError
from hpcpar.layout import Layout
from hpcpar.nn import init
from hpcpar.nn.layers import Embedding, LayerNorm, Linear
from hpcpar.parallel.cp.layers import ContextParallelLayers
from hpcpar.nn.module import Module, Parameter
from hpcpar.nn.moe import MoE
from hpcpar.parallel.tp.layers import TensorParallelLayers
from hpcpar.backend.precision import PRECISIONS, activation_dtype
from hpcpar.schema import field
from hpcpar.autograd.tensor import Tensor

# model.dtype: bytes per element of each dtype name (the memory estimate's s). A model's own dtype
# (its master weights) is float32 or float64; the 16-bit ones are what activations are stored in
# under train.precision = "bf16" / "fp16" (see backend/precision.py), and what the planner's 16-bit
# what-ifs assume.
DTYPES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
MASTER_DTYPES = ("float32", "float64")

# model.preset: named architectures. `config.load.load_config` fills in a preset's fields wherever the
# file and the --set overrides leave them out. gpt2 is GPT-2 small (124M parameters), the shapes
# of HuggingFace's "gpt2" (what `hpcpar ckpt import` reads and `ckpt export` writes).
PRESETS = {
    "gpt2": {"vocab_size": 50257, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768, "bias": True},
}


@dataclass(frozen=True)
class GPTConfig:
    """The architecture, and the `[model]` section of the run configuration (`config.sections.Config.model`).

    nanoGPT's field names. Each field documents itself (`metadata["doc"]`, `["choices"]`) for
    `config.load.to_toml` and docs/config.md; value ranges and the rules that involve the mesh are
    checked by `config.validate`. The parameter counts below are the single source for MFU and
    the memory estimate; a unit test holds them equal to the elements of a built GPT.

    Parameters of one block (C = n_embd, b = 1 with bias), by layout under tensor parallelism:
        replicated    ln_1, ln_2 (weight, bias): 2 C (1 + b); attn.c_proj.bias, mlp.c_proj.bias
                      (row-parallel: added after the reduction): 2 C b
        split over tp c_attn [3C, C], attn.c_proj [C, C], mlp.c_fc [4C, C], mlp.c_proj [C, 4C]:
                      12 C^2; c_attn.bias [3C], mlp.c_fc.bias [4C]: 7 C b
    """

    vocab_size: int = field(256, "number of token ids, > every id in the data (>= 256 for data.format = "
                                 "\"bytes\"); split over mesh.tp, padded to a multiple of tp when it does "
                                 "not divide (the padding never gets probability)")
    block_size: int = field(128, "context length T in tokens (>= 2); divisible by mesh.tp with "
                                 "mesh.sequence_parallel")
    n_layer: int = field(4, "transformer blocks; at least one per virtual pipeline stage "
                            "(n_layer >= mesh.pp * pipeline.chunks)")
    n_head: int = field(4, "attention heads; divides n_embd; divisible by mesh.tp (a tp rank holds whole heads)")
    n_embd: int = field(128, "model width C")
    bias: bool = field(True, "biases in Linear and LayerNorm layers")
    dropout: float = field(0.0, "dropout probability, 0 <= dropout < 1")
    dtype: str = field("float32", "parameter dtype: the master weights, optimizer state and checkpoints, and "
                                  "the activations in full precision (16-bit training: train.precision)",
                       tuple(DTYPES))
    moe_experts: int = field(0, "mixture of experts: experts per MoE layer, E (0 = dense MLPs everywhere); "
                                "divisible by mesh.ep")
    moe_top_k: int = field(2, "experts each token is routed to, 1 <= moe_top_k <= moe_experts")
    moe_every: int = field(1, "block i's MLP is an MoE layer when i % moe_every == 0 (1 = every block)")
    moe_capacity_factor: float = field(0.0, "assignments an expert takes per rank's micro-batch: "
                                            "ceil(factor * tokens * top_k / experts), the rest dropped (the "
                                            "token keeps its residual); 0 = unlimited")
    moe_aux_loss: float = field(0.01, "load-balancing loss weight alpha: alpha * E * sum_i f_i P_i (Switch), f_i "
                                      "counted before dropping; 0 = off")
    moe_z_loss: float = field(0.0, "router z-loss weight beta: beta * mean(logsumexp(router logits)^2); 0 = off")
    moe_expert_bias_rate: float = field(0.0, "auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias "
                                             "b, added to the router probs only to choose the top-k, updated after "
                                             "every step by b_e += rate * sign(mean load - load_e) over the global "
                                             "batch; 0 = off")
    tie_embeddings: bool = field(True, "the LM head is wte (GPT-2); false: a weight of its own, lm_head.weight "
                                       "[V, C] (init N(0, 0.02)), so wte's gradient is nonzero only in the rows of "
                                       "the tokens a batch holds (train.sparse_embedding)")
    preset: str = field("", "named architecture whose shape keys (vocab_size, block_size, n_layer, n_head, "
                            "n_embd, bias) apply unless given explicitly: \"gpt2\" = GPT-2 small, 124M "
                            "(50257, 1024, 12, 12, 768, true); \"\" = none", ("", *PRESETS))

    def check_dtype(self) -> None:
        """Raise ConfigError unless `dtype` is a master dtype (16-bit training is train.precision)."""
        if self.dtype in DTYPES and self.dtype not in MASTER_DTYPES:
            raise ConfigError(f"model.dtype=\"{self.dtype}\" is the master weights' dtype and must be \"float32\" or "
                              f"\"float64\"; for {self.dtype} activations set train.precision="
                              f"\"{'bf16' if self.dtype == 'bfloat16' else 'fp16'}\"")
        if self.dtype not in MASTER_DTYPES:
            raise ConfigError(f"model.dtype=\"{self.dtype}\" is not one of "
                              + ", ".join(f'"{d}"' for d in MASTER_DTYPES))

    def is_moe(self, index: int) -> bool:
        """Whether block `index` (global layer index) has an MoE layer in its MLP's place."""
        return self.moe_experts > 0 and index % self.moe_every == 0

    # -- parameter counts (elements on one tp rank of `tp`; tp = 1: the global count) ----------
    def block_params(self, tp: int = 1, index: int = -1, ep: int = 1, active: bool = False) -> int:
        """One transformer block: 2C(1+b) + 2Cb replicated + (12C^2 + 7Cb) / tp split. Block
        `index` with an MoE layer: the attention's (4C^2 + 3Cb) / tp + 2C(1+b) + Cb, the router
        E C, and E / ep experts of 8C^2 + 5Cb each (whole, replicated over tp); `active`: the k
        experts a token uses instead of those held (for MFU's 6N)."""
        c, b = self.n_embd, int(self.bias)
        if index < 0 or not self.is_moe(index):
            return 2 * c * (1 + b) + 2 * c * b + (12 * c * c + 7 * c * b) // tp
        experts = self.moe_top_k if active else self.moe_experts // ep
        return (2 * c * (1 + b) + c * b + (4 * c * c + 3 * c * b) // tp + self.moe_experts * c
                + experts * (8 * c * c + 5 * c * b))

    def vocab_rows(self, tp: int = 1) -> int:
        """Rows of wte on one tp rank: ceil(V / tp), padding included (tp = 1: V)."""
        return -(-self.vocab_size // tp)

    def embedding_params(self, tp: int = 1) -> int:
        """wte (vocab-parallel: [ceil(V/tp), C]) + wpe ([T, C], replicated)."""
        return self.vocab_rows(tp) * self.n_embd + self.block_size * self.n_embd

    def head_params(self, tp: int = 1, tied: bool = True) -> int:
        """ln_f, plus the LM head's own weight ([ceil(V/tp), C]) unless it is `tied` to the wte
        of the same module (a pipeline stage with the head but not the embedding holds a copy; an
        untied model's head always holds its own: `stage_params` passes tied=False then)."""
        return self.n_embd * (1 + int(self.bias)) + (0 if tied else self.vocab_rows(tp) * self.n_embd)

    def stage_params(self, n_blocks, embed: bool = True, head: bool = True, tp: int = 1, ep: int = 1) -> int:
        """One rank's parameters of `GPT(self, layers=<blocks>, embed=embed, head=head)` with a tp
        communicator of size `tp` and an expert-parallel one of size `ep`; `n_blocks`: the blocks'
        global indices (a range), or their number (blocks 0 .. n-1)."""
        blocks = range(n_blocks) if isinstance(n_blocks, int) else n_blocks
        moe = self._moe_blocks(blocks)
        return ((len(blocks) - moe) * self.block_params(tp) + moe * self.block_params(tp, 0, ep)
                + (self.embedding_params(tp) if embed else 0)
                + (self.head_params(tp, tied=embed and self.tie_embeddings) if head else 0))

    def _moe_blocks(self, blocks) -> int:
        """How many of `blocks` (global indices) have an MoE layer (block 0 has one when any does)."""
        return sum(1 for i in blocks if self.is_moe(i)) if self.moe_experts else 0

    def num_params(self, tp: int = 1, ep: int = 1) -> int:
        """The whole model (+ V C for an untied head), on one tp rank of `tp` (and ep rank of `ep`); tp = 1: nanoGPT's
        12 L C^2 + 13 L C + V C + T C + 2 C with bias (tied)."""
        return self.stage_params(self.n_layer, tp=tp, ep=ep)

    def non_embedding_params(self) -> int:
        """The N of MFU's 6 N: every parameter outside wte/wpe and the LM head's weight (tied or
        not: the count does not change with `tie_embeddings`) that a token uses: of an MoE layer,
        the router and top_k experts."""
        moe = self._moe_blocks(range(self.n_layer))
        return ((self.n_layer - moe) * self.block_params() + moe * self.block_params(1, 0, active=True)
                + self.head_params())


class CausalSelfAttention(Module):
    """c_attn: [3C, C] rows [q; k; v] -> fused causal attention -> c_proj: [C, C].

    `attend(qkv, n_head, recompute=False)` is the attention itself: `causal_attention`, or
    under context parallelism ring attention / Ulysses over the cp group
    (`parallel.cp.attention.ContextParallel`). `recompute_scores` (selective recomputation, set by
    `GPT.set_recompute`) asks it to keep no [T, T] probabilities for backward.
    """

    def __init__(self, cfg: GPTConfig, attend=causal_attention):
        super().__init__()
        self.n_head = cfg.n_head
        self.attend = attend
        self.recompute_scores = False
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, cfg.bias, cfg.dtype)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, cfg.bias, cfg.dtype)

    def forward(self, x):
        return self.c_proj(self.attend(self.c_attn(x), self.n_head, recompute=self.recompute_scores))


class MLP(Module):
    """c_fc: [4C, C] -> GELU(tanh) -> c_proj: [C, 4C]; c_fc and the GELU are one fused op (`linear`)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, cfg.bias, cfg.dtype)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, cfg.bias, cfg.dtype)

    def forward(self, x):
        return self.c_proj(self.c_fc(x, activation="gelu"))


class Block(Module):
    """h + attn(ln_1(h)), then + mlp(ln_2(h)), each branch through dropout site 2i+1 / 2i+2.

    `recompute` ("none", "full" or "selective"; set by `GPT.set_recompute`) is how this block's
    activations are kept for backward; GPT.forward applies "full", the attention "selective".
    """

    def __init__(self, index: int, ln_1: Module, attn: Module, ln_2: Module, mlp: Module, dropout_sites):
        super().__init__()
        self.index = index
        self.recompute = "none"
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


class PlainLayers:
    """The one-process layers: which module fills each role of a GPT, and how the head and the
    sequence are treated. `parallel.tp.layers.TensorParallelLayers` has the same methods (Megatron's
    layers); GPT is built from whichever layer set its tensor-parallel degree calls for, and
    `parallel.cp.layers.ContextParallelLayers` wraps either when the sequence is split over cp ranks."""

    sequence_parallel = False

    def wte(self, cfg: GPTConfig) -> Module:
        return Embedding(cfg.vocab_size, cfg.n_embd, cfg.dtype)

    def attn(self, cfg: GPTConfig, attend=causal_attention) -> Module:
        return CausalSelfAttention(cfg, attend)

    def mlp(self, cfg: GPTConfig) -> Module:
        return MLP(cfg)

    def norm(self, cfg: GPTConfig) -> Module:
        return LayerNorm(cfg.n_embd, cfg.bias, cfg.dtype)

    def vocab_layout(self, cfg: GPTConfig) -> Layout:
        """Layout of wte / a stage's tied LM-head copy [V, C]."""
        return Layout.replicated((cfg.vocab_size, cfg.n_embd))

    def position_ids(self, t: int):
        """The rows of wpe that a rank's `t` tokens use: positions 0 .. t-1."""
        return slice(0, t)

    def positions(self, weight: Tensor, rows, t: int) -> Tensor:
        """The position embeddings [T, C] this rank adds to its activations: `rows` (a slice or
        positions) of wpe `weight`."""
        return ops.getitem(weight, rows)

    def dropout(self, x: Tensor, p: float, keys, rows=None, length: int | None = None) -> Tensor:
        """Dropout on x [B, T, ..]; `rows` (positions in a sequence of `length`) when x holds
        only those tokens (context parallelism): their rows of the whole sequence's mask."""
        full = None if rows is None else (length,) + tuple(x.shape[2:])
        return dropout(x, p, keys, rows=rows, full_shape=full)

    def lm_head(self, h: Tensor, weight: Tensor, targets) -> Tensor:
        """ln_f output [B, T, C] -> the mean loss (with targets) or logits [B, T, V]."""
        logits = linear(h, weight)
        return logits if targets is None else cross_entropy(logits, targets)


# train.recompute: how blocks keep their activations for backward (see GPT.set_recompute).
RECOMPUTE_MODES = ("none", "full", "selective")


def recomputed(index: int, every: int) -> bool:
    """Whether block `index` (its global layer index) is recomputed under `recompute_every = every`:
    every k-th block, counting from block 0 (index % every == 0), whatever the pipeline split."""
    return index % every == 0


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
        cp: the context-parallel group (`parallel.cp.attention.ContextParallel`; None or size 1: the
            whole sequence on this rank). With cp > 1 token ids, targets and activations are this
            rank's tokens only, [B, T/cp(, C)] (`cp.positions(T)`).
        precision: train.precision: "full", or "bf16"/"fp16" (activations in 16 bits from the
            embedding sum on, parameters in config.dtype; see `backend/precision.py`).
        ep_comm: the expert-parallel group of the MoE layers (`moe.MoE`; None or size 1: every
            expert here). Experts are whole and replicated over tp (docs/parallelism.md).
    """

    def __init__(self, config: GPTConfig, tp_comm=None, layers=None, embed: bool = True,
                 head: bool = True, sequence_parallel: bool = False, seed: int = 0, cp=None, ep_comm=None,
                 precision: str = "full"):
        super().__init__()
        config.check_dtype()
        if precision not in PRECISIONS:
            raise ConfigError(f"train.precision={precision!r} is not one of " + ", ".join(map(repr, PRECISIONS)))
        self.config = config
        # Parameters are config.dtype (the masters); activations between ops are this dtype.
        self.activation_dtype = activation_dtype(precision, config.dtype)
        self.embed, self.head = embed, head
        self.layer_ids = list(range(config.n_layer) if layers is None else layers)
        self.rng_context = None  # (seed, step, sample_ids) for dropout masks; set by the trainer
        self.documents = None    # the micro-batch's `data.packing.Documents` during its forward
        self.unit_hooks = None  # ZeRO-3 (`parallel.dp.fsdp.ShardedUnits`): gathers around each unit
        cfg = config
        # Tensor parallelism only when there is more than one tp rank (size 1: the plain layers).
        self.tp_comm = tp_comm if tp_comm is not None and tp_comm.size > 1 else None
        self.layer_set = (PlainLayers() if self.tp_comm is None
                          else TensorParallelLayers(cfg, self.tp_comm, bool(sequence_parallel)))
        self.cp = cp if cp is not None and cp.size > 1 else None
        if self.cp is not None:
            self.layer_set = ContextParallelLayers(cfg, self.layer_set, self.cp, lambda: self.documents)
        self.sequence_parallel = self.layer_set.sequence_parallel
        layer_set = self.layer_set
        self.transformer = Transformer()
        if embed:
            self.transformer.wte = layer_set.wte(cfg)
            # Untied: wte's gradient is the lookup's scatter, nonzero only in the rows looked up.
            self.transformer.wte.weight.sparse_grad = not cfg.tie_embeddings
            self.transformer.wpe = Embedding(cfg.block_size, cfg.n_embd, cfg.dtype)
            # Under sequence parallelism a tp rank adds only its tokens' rows (`layer_set.positions`).
            self.transformer.wpe.weight.sequence_parallel = self.sequence_parallel
        # The attention reads `self.documents` (under context parallelism it hands them to `cp.attention`).
        self.transformer.h = Blocks([
            Block(i, layer_set.norm(cfg), layer_set.attn(cfg, attend=self._attend), layer_set.norm(cfg),
                  MoE(cfg, ep_comm, i) if cfg.is_moe(i) else layer_set.mlp(cfg), self._dropout)
            for i in self.layer_ids])
        if head:
            self.transformer.ln_f = layer_set.norm(cfg)
            if embed and cfg.tie_embeddings:
                object.__setattr__(self, "head_weight", self.transformer.wte.weight)
            else:  # the tied copy of a stage without the embedding, or an untied head's own weight
                layout = layer_set.vocab_layout(cfg)
                self.lm_head = Module()
                self.lm_head.weight = Parameter(backend.xp.zeros(layout.local_shape, dtype=cfg.dtype), layout,
                                                tied_to="transformer.wte.weight" if cfg.tie_embeddings else None)
                object.__setattr__(self, "head_weight", self.lm_head.weight)
        self.init_weights(seed)

    # -- activation recomputation ---------------------------------------------------------
    def set_recompute(self, mode: str = "none", every: int = 1) -> None:
        """Activation recomputation for the blocks with `recomputed(index, every)` (the others keep
        everything, "none"). Results are bitwise those of "none" in every mode.

        "full": the block keeps only its input [B, T, C]; its forward runs without a graph and is
        run again inside backward (`recompute`), collectives and dropout masks included.
        "selective": the attention keeps no [B, H, T, T] probabilities and recomputes them from
        q and k in backward (`causal_attention(recompute=True)`; ring attention keeps none
        anyway).
        """
        if mode not in RECOMPUTE_MODES:
            raise ConfigError(f"train.recompute={mode!r} is not one of " + ", ".join(map(repr, RECOMPUTE_MODES)))
        if every < 1:
            raise ConfigError(f"train.recompute_every={every} is invalid: must be >= 1")
        for block in self.transformer.h.items:
            block.recompute = mode if recomputed(block.index, every) else "none"
            block.attn.recompute_scores = block.recompute == "selective"

    def moe_layers(self) -> list[MoE]:
        """This module's MoE layers, in block order."""
        return [block.mlp for block in self.transformer.h.items if isinstance(block.mlp, MoE)]

    # -- initialisation -----------------------------------------------------------------
    def init_weights(self, seed: int) -> None:
        """GPT-2 init: N(0, 0.02) weights and embeddings, residual projections
        N(0, 0.02/sqrt(2 n_layer)), zero biases, LayerNorm weight 1. Each tensor's values come
        from the stream of its global name (a tied copy: the weight it mirrors'), so an untied
        `lm_head.weight` is N(0, 0.02) of its own."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            key = p.tied_to or name
            if name.endswith(".bias") or ".ln_" in name or name.startswith("transformer.ln_f"):
                continue  # zeros / ones from construction
            std = resid_std if name.endswith("c_proj.weight") else 0.02
            full = init.normal(seed, key, p.layout.global_shape, std)
            p.data[...] = backend.to_device(p.layout.take(full).astype(p.dtype))

    # -- ZeRO-3 units ---------------------------------------------------------------------
    def fsdp_units(self) -> list[tuple[str, list]]:
        """The units ZeRO-3 gathers as one, in forward order: (name, [(global name, Parameter)]
        it uses): "embedding" (wte, wpe), "h.<i>" per block, "head" (ln_f and the LM head's
        weight: wte itself when this module holds the embedding too and it is tied)."""
        units = []
        if self.embed:
            units.append(("embedding", [(f"transformer.wte.{n}", p) for n, p in self.transformer.wte.named_parameters()]
                          + [("transformer.wpe.weight", self.transformer.wpe.weight)]))
        for block in self.transformer.h.items:
            units.append((f"h.{block.index}", [(f"transformer.h.{block.index}.{n}", p)
                                               for n, p in block.named_parameters()]))
        if self.head:
            head = [(f"transformer.ln_f.{n}", p) for n, p in self.transformer.ln_f.named_parameters()]
            name = "transformer.wte.weight" if self.embed and self.config.tie_embeddings else "lm_head.weight"
            units.append(("head", head + [(name, self.head_weight)]))
        return units

    def _unit(self, name: str, fn, *args, **kw):
        """`fn(*args)` as ZeRO-3 unit `name`: its parameters gathered around its forward, and again
        when its output's gradient arrives (an identity op whose backward calls the hook)."""
        hooks = self.unit_hooks
        if hooks is None:
            return fn(*args, **kw)
        hooks.pre_forward(name)
        out = fn(*args, **kw)
        backward = isinstance(out, Tensor) and out.requires_grad
        hooks.post_forward(name, backward)
        if not backward:
            return out
        return Tensor.from_op(out.data, (out,), lambda g: (hooks.pre_backward(name), g)[1:])

    # -- forward ------------------------------------------------------------------------
    def _dropout(self, x, site: int):
        p = self.config.dropout
        if p == 0.0 or not self.training:
            return x
        if self.rng_context is None:
            raise RuntimeError("dropout > 0 needs model.rng_context = (seed, step, sample_ids)")
        seed, step, sample_ids = self.rng_context
        return self.layer_set.dropout(x, p, [(seed, step, int(k), site) for k in sample_ids])

    def _attend(self, qkv: Tensor, n_head: int, recompute: bool = False) -> Tensor:
        """The blocks' attention: causal, or within the documents of a packed micro-batch; under
        context parallelism over the cp group (the documents of the whole windows go with it)."""
        if self.cp is not None:
            return self.cp.attention(qkv, n_head, recompute, self.documents)
        if self.documents is None:
            return causal_attention(qkv, n_head, recompute)
        return document_attention(qkv, n_head, self.documents, recompute)

    def _recomputed(self, block: Block, h: Tensor) -> Tensor:
        """`block(h)` keeping only h (`recompute`). The re-run in backward uses this
        micro-batch's dropout context and documents: by then a pipeline schedule may have set the
        next one's."""
        context, documents = self.rng_context, self.documents
        runs = []

        def run(x):
            # The re-run in backward repeats the routing: its statistics were recorded once already.
            if isinstance(block.mlp, MoE):
                block.mlp.record = not runs
            runs.append(True)
            current, self.rng_context = self.rng_context, context
            current_documents, self.documents = self.documents, documents
            try:
                return block(x)
            finally:
                self.rng_context, self.documents = current, current_documents
                if isinstance(block.mlp, MoE):
                    block.mlp.record = True
        return recompute(run, h)

    def forward(self, x, targets=None, documents=None):
        """x: idx int [B, T] (embed; host or device) or activations [B, T, C] ([B, T/tp, C] under
        sequence parallelism); targets int [B, T] (head). Returns the loss, logits [B, T, V] or
        activations (same layout as x). Token ids and targets move to the parameters' device here.
        Under context parallelism T is this rank's share of the sequence, T/cp. `documents`: the
        segments of a packed micro-batch (`data.packing.Documents`; targets crossing a boundary
        are -100 already), None: each row one sequence."""
        self.documents = documents
        try:
            return self._forward(x, targets)
        finally:
            self.documents = None

    def _forward(self, x, targets):
        if self.embed:
            h = self._unit("embedding", self._embedding, x)
        else:
            h = x
        for block in self.transformer.h.items:
            # The unit's gathers sit outside the recomputation: the re-run inside backward reads
            # the parameters that the unit's pre-backward gather brought in.
            if block.recompute == "full":
                h = self._unit(f"h.{block.index}", self._recomputed, block, h)
            else:
                h = self._unit(f"h.{block.index}", block, h)
        if not self.head:
            return h
        return self._unit("head", self._head, h, targets)

    def _embedding(self, x):
        xp = backend.array_module(self.transformer.wpe.weight.data)
        idx = xp.asarray(x.data if isinstance(x, Tensor) else x)
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        tok = self.transformer.wte(idx)   # [B, T, C], or [B, T/tp, C] under sequence parallelism
        if self.documents is not None and not self.documents.whole:  # (whole: positions 0..T-1 as unpacked)
            rows = self.documents.positions()                  # [B, T] of the whole windows
            if self.cp is not None:                            # my tokens' columns (`cp.positions`)
                rows = rows[:, self.cp.positions(rows.shape[1], self.documents)]
            pos = self.layer_set.positions(self.transformer.wpe.weight, xp.asarray(rows), rows.shape[1])
        else:
            rows = self.layer_set.position_ids(t)   # slice(0, t), or my positions under context parallelism
            rows = rows if isinstance(rows, slice) else xp.asarray(rows)
            pos = self.layer_set.positions(self.transformer.wpe.weight, rows, t)
        h = tok + pos
        if h.dtype != self.activation_dtype:  # mixed precision: 16 bits from here to the loss
            h = ops.cast(h, self.activation_dtype)
        return self._dropout(h, 0)

    def _head(self, h, targets):
        if targets is not None:
            targets = backend.array_module(self.head_weight.data).asarray(
                targets.data if isinstance(targets, Tensor) else targets)
        out = self.layer_set.lm_head(self.transformer.ln_f(h), self.head_weight, targets)
        if targets is None or self.documents is None:
            return out
        # The trainer averages the micro-batch (and cp ranks') losses, each the mean over its own
        # targets; packed, they keep different numbers of them, so mine counts by its share of the
        # batch's kept targets: the per-token loss (data/balance.py).
        cp = self.cp.size if self.cp is not None else 1
        return out * (int((targets != IGNORE).sum()) * cp * self.documents.losses / self.documents.targets)
