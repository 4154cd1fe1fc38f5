"""The context-parallel layers: a GPT whose sequence is split over the ranks of a cp group.

`ContextParallelLayers(config, base, cp, documents)` wraps the layers of the tp group (`gpt.PlainLayers` or
`parallel.tp.layers.TensorParallelLayers`) and changes only what depends on which tokens a rank
holds; every token-wise layer (embeddings, LayerNorm, MLP, the LM head and its loss) is the
base layers', run on this rank's T/cp tokens:

    attn        the base attention module, its attention computed by `cp.attention`
                (ring attention or Ulysses, `parallel/cp/attention.py`) instead of
                `causal_attention`; with packed documents (`data.packing`) the whole windows'
                `Documents` go with it, and each rank derives its masks from them and its positions;
    position_ids  my tokens' global positions (`cp.positions(T)`: zigzag chunks r and 2cp-1-r
                for ring, chunk r for Ulysses): wpe rows are gathered there, and the gradient
                scatter-adds back into those rows (unpacked windows; packed ones take their
                in-segment positions at `cp.positions(T, documents)`, `GPT._embedding`);
    dropout     my rows of the whole sequence's counter-based mask (then the base layers' part of
                them under sequence parallelism), so masks do not depend on cp. My rows are
                `cp.positions(T, documents)` of the micro-batch being run (`documents()`, the GPT's:
                packed ones under ring attention are dealt by attention work, `cp/balance.py`), the
                same the data's columns and the ring's blocks use.

Weights are replicated over cp: each rank's weight gradient is the sum over its tokens, the cp
ranks' gradients add up to the whole sequence's, and data parallelism averages them over
dp x cp (every cp rank holds the same number of tokens).
"""

from __future__ import annotations

from hpcpar.schema import require_divisible


class ContextParallelLayers:
    """A GPT's layers over a cp group (see the module doc); same methods as `gpt.PlainLayers`.

    Args:
        config: the GPTConfig (checked: Ulysses needs whole heads per rank).
        base: the layers of this rank's tp group (PlainLayers or TensorParallelLayers).
        cp: the `parallel.cp.attention.ContextParallel` group (size > 1).
        documents: () -> the `data.packing.Documents` of the micro-batch being run (None: not
            packed); the GPT's, which it sets for each forward and each recomputation.
    """

    def __init__(self, config, base, cp, documents=lambda: None):
        tp = base.comm.size if getattr(base, "comm", None) is not None else 1
        if cp.impl == "ulysses":
            require_divisible("n_head", config.n_head, "tp*cp", tp * cp.size,
                              "(Ulysses gives each rank whole heads)")
        self.base, self.cp, self.documents = base, cp, documents
        self.block_size = config.block_size
        self.sequence_parallel = base.sequence_parallel

    def wte(self, cfg):
        return self.base.wte(cfg)

    def attn(self, cfg, attend=None):
        """The base attention module over `attend` (default `cp.attention`; the GPT passes its own,
        which adds the micro-batch's packed documents)."""
        return self.base.attn(cfg, attend=attend or self.cp.attention)

    def mlp(self, cfg):
        return self.base.mlp(cfg)

    def norm(self, cfg):
        return self.base.norm(cfg)

    def vocab_layout(self, cfg):
        return self.base.vocab_layout(cfg)

    def position_ids(self, t: int):
        """Global positions (int64 [t]) of this rank's `t` tokens of a cp*t-token sequence."""
        if t * self.cp.size > self.block_size:
            raise ValueError(f"sequence length {t * self.cp.size} ({t} tokens on each of cp={self.cp.size} "
                             f"ranks) exceeds block_size {self.block_size}")
        return self.cp.positions(t * self.cp.size)

    def positions(self, weight, rows, t: int):
        return self.base.positions(weight, rows, t)

    def dropout(self, x, p: float, keys):
        """x [B, T/cp, ..] (or the base layers' sequence shard of it): my rows of the full mask."""
        t = x.shape[1] * self.cp.size * (self.base.comm.size if self.sequence_parallel else 1)
        return self.base.dropout(x, p, keys, rows=self.cp.positions(t, self.documents()), length=t)

    def lm_head(self, h, weight, targets):
        return self.base.lm_head(h, weight, targets)
