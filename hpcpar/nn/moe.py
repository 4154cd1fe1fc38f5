"""Mixture of experts (Switch Transformer, arXiv 2101.03961; GShard; Megatron-Core MoE) with
expert parallelism: the MLP of a block replaced by E expert MLPs and a router.

Per token (N = B*T tokens of a micro-batch on this rank, C = n_embd, E experts, k = top_k):

    router      logits = x W_r^T [N, E], probs = softmax(logits)
    top-k       the k largest probs per token; ties go to the lower expert index. With an expert
                bias b [E] (`expert_bias`, model.moe_expert_bias_rate > 0: DeepSeek-V3's
                auxiliary-loss-free balancing, arXiv 2408.15664) the k largest probs[n] + b: the
                bias only chooses, every weight below stays the unbiased probs
    capacity    each expert takes at most ceil(capacity_factor * N * k / E) assignments of this
                rank's micro-batch (0 = unlimited), first the tokens' first choices in token order,
                then their second choices, ...; a dropped assignment adds nothing (the token keeps
                its residual only)
    experts     expert e: c_fc [4C, C] -> GELU -> c_proj [C, 4C], as the dense MLP
    combine     y_n = sum_j probs[n, e_j] * expert_{e_j}(x_n) over the kept choices (no renormalisation)
    aux loss    alpha * E * sum_i f_i P_i, f_i the fraction of the N k assignments routed to expert i
                (counted before any is dropped), P_i the mean of probs[:, i]; z-loss
                beta * mean_n logsumexp(logits_n)^2 (ST-MoE). Both join the graph through
                `ops.with_loss`, scaled like the main loss (`MoE.loss_scale`).

Expert parallelism over `ep_comm` (ep ranks): rank r holds experts [r E/ep, (r+1) E/ep), the
expert weights being slices of the global tensors [E, 4C, C], [E, 4C], [E, C, 4C], [E, C]
(`Layout.split` on dim 0). Dispatch: this rank's kept assignments sorted by expert (one stable
argsort, `dispatch_order`), their token rows gathered in that order (`dispatch_rows`), their
per-expert counts exchanged with an all-to-all (started first, so the aux loss and the gather
run while it travels), then the rows with an all-to-all-v (`mappings.all_to_all_v`); the
experts run on what arrived, grouped by expert by one permutation when a rank holds several
(`grouped_linear`, one GEMM per expert with rows); combine is the reverse all-to-all-v, and one
op (`combine_rows`) weights each choice's row by its probability and sums them per token. No
step loops over experts in Python but the GEMMs, and every gradient of the row movements is a
gather (`autograd.dispatch`). Routing, capacity and the aux loss depend only on this rank's
micro-batch, so any ep gives the one-process model's results. The router, like every dense
weight, is replicated; so is the expert bias, which the trainer updates from the global batch's
loads (training/routing.py `ExpertBias`) and sets here, the same on every rank.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from hpcpar import backend
from hpcpar.autograd import ops
from hpcpar.autograd.dispatch import Assignments, combine_rows, dispatch_rows, permute_rows
from hpcpar.autograd.functional import softmax
from hpcpar.autograd.linear import grouped_linear, linear
from hpcpar.layout import Layout
from hpcpar.nn.module import Module, Parameter
from hpcpar.parallel.mappings import all_to_all_v
from hpcpar.autograd.tensor import Tensor

if TYPE_CHECKING:  # annotations only: model code never needs MPI loaded
    from hpcpar.runtime.comm import Communicator


def top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """[N, E] -> int64 [N, k]: each row's k largest entries, largest first; equal values in
    ascending expert index (a stable sort of -probs), so routing is deterministic."""
    return np.argsort(-probs, axis=1, kind="stable")[:, :k].astype(np.int64)


def capacity(tokens: int, top_k: int, experts: int, factor: float) -> int | None:
    """Assignments one expert takes from `tokens` tokens: ceil(factor * tokens * top_k / experts);
    None (unlimited) when factor is 0."""
    return None if factor == 0 else math.ceil(factor * tokens * top_k / experts)


def dispatch_order(choices: np.ndarray, experts: int, cap: int | None) -> dict:
    """Which assignments are kept and in which order they travel.

    choices: int [N, k], the experts of each token (`top_k`). Assignment a = j * N + n is token
    n's j-th choice; that is also their priority for capacity. Returns (NumPy, host):
        routed [E]: assignments per expert before dropping (the f_i of the aux loss, times N k);
        order [K]: the kept assignments sorted by expert (stable: in priority order within one);
        kept [E]: kept assignments per expert (order holds kept[0] of expert 0, then expert 1, ...);
        row [N k]: for each assignment its row in `order`, or K when dropped.
    """
    n, k = choices.shape
    flat = choices.T.reshape(-1)                               # priority order: choice-major
    routed = np.bincount(flat, minlength=experts).astype(np.int64)
    by_expert = np.argsort(flat, kind="stable")
    starts = np.concatenate([[0], np.cumsum(routed)[:-1]])
    position = np.empty_like(flat)
    position[by_expert] = np.arange(flat.size) - starts[flat[by_expert]]
    keep = np.ones(flat.size, dtype=bool) if cap is None else position < cap
    order = by_expert[keep[by_expert]]
    kept = np.bincount(flat[order], minlength=experts).astype(np.int64)
    row = np.full(flat.size, order.size, dtype=np.int64)
    row[order] = np.arange(order.size)
    return {"routed": routed, "order": order, "kept": kept, "row": row}


def _expert_param(shape: tuple, comm, dtype, no_decay: bool = False) -> Parameter:
    rank, size = (0, 1) if comm is None else (comm.rank, comm.size)
    layout = Layout.split(shape, 0, rank, size)
    return Parameter(backend.xp.zeros(layout.local_shape, dtype=dtype), layout, no_decay=no_decay, expert=True)


class Experts(Module):
    """This rank's experts: c_fc.weight [E/ep, 4C, C], c_fc.bias [E/ep, 4C], c_proj.weight
    [E/ep, C, 4C], c_proj.bias [E/ep, C] (slices of the global [E, ...] tensors).

    In: x [M, C], the rows of each local expert back to back (`counts` per expert). Out: [M, C].
    """

    def __init__(self, cfg, comm):
        super().__init__()
        e, c = cfg.moe_experts, cfg.n_embd
        self.c_fc = Module()
        self.c_fc.weight = _expert_param((e, 4 * c, c), comm, cfg.dtype)
        self.c_fc.bias = _expert_param((e, 4 * c), comm, cfg.dtype, True) if cfg.bias else None
        self.c_proj = Module()
        self.c_proj.weight = _expert_param((e, c, 4 * c), comm, cfg.dtype)
        self.c_proj.bias = _expert_param((e, c), comm, cfg.dtype, True) if cfg.bias else None

    def forward(self, x: Tensor, counts) -> Tensor:
        h = ops.gelu(grouped_linear(x, self.c_fc.weight, self.c_fc.bias, counts))
        return grouped_linear(h, self.c_proj.weight, self.c_proj.bias, counts)


class MoE(Module):
    """The MoE layer in a block's MLP place: x [B, T, C] -> [B, T, C] (see the module doc).

    Args:
        cfg: a GPTConfig with moe_experts > 0.
        ep_comm: the expert-parallel group (None or size 1: every expert on this rank).
        index: the global index of its block (names its statistics).

    Attributes:
        loss_scale: the gradient the aux and z losses get, the main loss's scale (the pipeline
            sets 1/microbatches; 1 for a plain `loss.backward()`).
        record: append this forward's routing statistics to `stats` (training forwards only; off
            while a recomputed block re-runs its forward in backward).
        stats: (routed [E] tokens per expert before dropping, dropped assignments, assignments,
            aux + z loss value (a 0-d array)) per recorded forward; the trainer drains it.
        expert_bias: float64 host [E] added to the probs to choose the top-k (training and
            evaluation forwards alike), or None (no bias); set by `routing.ExpertBias`.
    """

    def __init__(self, cfg, ep_comm: Communicator | None = None, index: int = 0):
        super().__init__()
        self.cfg, self.index = cfg, index
        self.comm = ep_comm if ep_comm is not None and ep_comm.size > 1 else None
        self.router = Module()
        self.router.weight = Parameter(backend.xp.zeros((cfg.moe_experts, cfg.n_embd), dtype=cfg.dtype))
        self.experts = Experts(cfg, self.comm)
        self.loss_scale = 1.0
        self.record = True
        self.stats: list = []
        self.expert_bias: np.ndarray | None = None

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.cfg
        b, t, c = x.shape
        n, e, k = b * t, cfg.moe_experts, cfg.moe_top_k
        xp = backend.array_module(x.data)
        tokens = ops.reshape(x, (n, c))
        logits = linear(tokens, self.router.weight)                          # [N, E]
        probs = softmax(logits, axis=-1)
        scores = backend.to_host(probs.data)
        choices = top_k(scores if self.expert_bias is None else scores + self.expert_bias, k)  # [N, k], host
        routing = dispatch_order(choices, e, capacity(n, k, e, cfg.moe_capacity_factor))
        # Under expert parallelism the counts travel first; meanwhile the work that needs none.
        exchange = self._start_count_exchange(routing["kept"])
        where = Assignments.of(routing["order"], routing["row"], n, k, xp)
        aux = self._aux_loss(logits, probs, routing["routed"], n * k)
        if self.training and self.record:
            self.stats.append((routing["routed"], int(n * k - routing["order"].size), n * k, aux.data))

        # Dispatch: kept assignments sorted by expert -> the ranks holding their experts.
        sent = dispatch_rows(tokens, where)                                  # [K, C]
        arrived, counts, undo = self._dispatch(sent, routing["kept"], exchange)
        back = undo(self.experts(arrived, counts))                           # [K, C], order of `sent`
        # Combine: each kept choice's expert output times its probability, summed over k.
        y = ops.reshape(combine_rows(back, probs, xp.asarray(choices), where), (b, t, c))
        return ops.with_loss(y, aux, self.loss_scale) if aux.requires_grad else y

    def _aux_loss(self, logits: Tensor, probs: Tensor, routed: np.ndarray, assignments: int) -> Tensor:
        """alpha E sum_i f_i P_i + beta mean(logsumexp(logits)^2), a scalar."""
        cfg, xp = self.cfg, backend.array_module(probs.data)
        f = xp.asarray(routed / assignments, dtype=probs.dtype)
        loss = ops.sum(ops.mean(probs, axis=0) * f) * (cfg.moe_aux_loss * cfg.moe_experts)
        if cfg.moe_z_loss:
            shift = logits.data.max(axis=-1, keepdims=True)                 # cancels; guards exp()
            lse = ops.log(ops.sum(ops.exp(logits - shift), axis=-1)) + shift[:, 0]
            loss = loss + ops.mean(lse * lse) * cfg.moe_z_loss
        return loss

    def _start_count_exchange(self, kept: np.ndarray):
        """Start the all-to-all of this rank's kept assignments per expert (None without expert
        parallelism): its `wait()` gives what each source sends to each of my experts, [ep * E/ep]."""
        if self.comm is None:
            return None
        return self.comm.iall_to_all(backend.xp.asarray(kept), 0)

    def _dispatch(self, sent: Tensor, kept: np.ndarray, exchange=None):
        """Rows sorted by expert ([K, C], `kept` per expert) to the experts' ranks. Returns the rows
        that arrived grouped by local expert, their count per local expert, and `undo(out)`: the
        experts' outputs back on the rows' home ranks in the order of `sent`. `exchange`: the
        count exchange `_start_count_exchange(kept)` started (None: run it here). Any count may be
        0 (routing owes no expert a token): a rank may send or receive no rows, and then its
        gathers, experts and all-to-all-vs run, forward and backward, on [0, C] arrays."""
        if self.comm is None:
            return sent, kept, lambda out: out
        comm, xp = self.comm, backend.array_module(sent.data)
        local = kept.size // comm.size
        # What each source sends to each of my experts, [ep, E/ep].
        exchange = exchange if exchange is not None else self._start_count_exchange(kept)
        incoming = backend.to_host(exchange.wait()).reshape(comm.size, local)
        send, recv = kept.reshape(comm.size, local).sum(axis=1), incoming.sum(axis=1)
        arrived = all_to_all_v(sent, comm, send, recv)                      # by source, then expert
        if local == 1:  # one expert per rank: the rows arrived grouped
            return arrived, incoming.sum(axis=0), lambda out: all_to_all_v(out, comm, recv, send)
        # Group by expert (then source): one permutation of the rows, its inverse on the way back.
        # Block (s, j) (source s, expert j) starts at starts[s, j] in arrival order; perm lists
        # the blocks in (j, s) order, each block's rows in order.
        sizes = incoming.T.reshape(-1)
        starts = (np.cumsum(incoming.reshape(-1)) - incoming.reshape(-1)).reshape(comm.size, local).T.reshape(-1)
        perm = np.arange(sizes.sum()) + np.repeat(starts - (np.cumsum(sizes) - sizes), sizes)
        inverse = np.empty_like(perm)
        inverse[perm] = np.arange(perm.size)
        perm, inverse = xp.asarray(perm), xp.asarray(inverse)
        grouped = permute_rows(arrived, perm, inverse)

        def undo(out: Tensor) -> Tensor:
            return all_to_all_v(permute_rows(out, inverse, perm), comm, recv, send)
        return grouped, incoming.sum(axis=0), undo
