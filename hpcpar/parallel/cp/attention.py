"""Context parallelism: the sequence split over cp ranks, ring attention and DeepSpeed-Ulysses.

Every layer of a transformer but attention works token by token, so with the sequence split
over the `cp` ranks of a context-parallel group each rank runs embeddings, LayerNorms, MLPs,
dropout and the loss on its own tokens only, and its activations shrink by cp. Attention is
the one place where a token needs the others: two designs bring them together.

Sequence layouts (`positions`: the global positions of a rank's tokens, in its local order):

    zigzag       the sequence is cut into 2cp equal chunks; rank r holds chunks r and 2cp-1-r.
                 Under a causal mask chunk j attends to j+1 chunks' worth of keys, so pairing an
                 early chunk with a late one gives every rank the same work (Ring Attention's
                 causal balance, arXiv 2310.01889; Megatron-LM CP). Ring attention uses it.
                 Packed documents (below) deal the same 2cp chunks two per rank by their work.
    contiguous   cp equal chunks, rank r holds chunk r. Ulysses uses it (its all-to-all gathers
                 the chunks back in order); for ring attention it is the naive split, whose last
                 rank does (2cp-1)/cp times the mean work (bench/context.py measures both).

Ring attention (`ring_attention`): q, k, v of my tokens [B, T/cp, 3C]; the K/V blocks travel
around the ring (send to r+1, receive from r-1) with non-blocking messages posted *before* the
attention of the block in hand, so the transfer overlaps that compute. Each block's scores are
masked in global positions (a key chunk after the query chunk is skipped, the same chunk gets
the causal triangle, an earlier chunk is unmasked) and merged with the online-softmax rule: a
running row maximum m, sum l and unnormalised output, rescaled by exp(m_old - m_new). The
forward saves q, k, v, the output and the row log-sum-exp (no [T, T] probabilities); the
backward rotates K/V again, rebuilds each block's probabilities from the log-sum-exp,
P = exp(S - lse), and sends the dK/dV accumulators around the ring behind them, so after cp
steps every rank holds the complete gradient of its own K and V.

    per rank and layer, sent:  forward (cp-1) 2 B (T/cp) C/tp elements (K and V)
                               backward (cp-1) 2 B (T/cp) C/tp (K, V) + cp 2 B (T/cp) C/tp (dK, dV)
    kept for backward:         q, k, v, output [B, T/cp, C/tp] each + lse [B, H/tp, T/cp]

Packed documents (`data.packing = "documents"`): `ContextParallel.attention(..., documents=)` takes
the `Documents` of the whole windows, and each rank derives its masks from them and the layout's
positions (a query attends a key at or before it and not before its segment's start). A query at
in-segment position p then does p + 1 pairs, so token-zigzag no longer balances the ring: under
the zigzag layout a micro-batch whose windows hold document starts deals its 2cp chunks two per
rank by that work instead (`balance.py`: the lightest with the heaviest, optimal for pairs; the
same T/cp tokens per rank; windows of one segment keep zigzag exactly). `ContextParallel.
positions(t, documents)` gives every user the micro-batch's layout: the data's columns
(`data.balance.GlobalBatches`), wpe rows and dropout masks (`layers.py`, `GPT._embedding`), the
ring's blocks and K/V routing (`_plan`). The balance is of unmasked pairs, and the ring computes
close to them: with documents a block is cut by row of the micro-batch and by (my chunk, its
chunk), and each piece with a pair gets its own box, the smallest holding its pairs (a [1, H, n, m]
computation merged into that row's running maximum, sum and output; `_Block`). One box over all
rows and both chunks would compute the union of the rows' boxes and the gap between a rank's
chunks, and follow the layout's balance poorly (bench/varlen.py part 4 measures both). Ring:
every block is masked by documents as well as causally; a piece with no pair is skipped, a
block wholly masked (every row of the micro-batch) is not computed, and a K/V block travels the
ring only as far as the last rank that attends to it (`_Plan`), so the forward and backward K/V
figures above are upper bounds; the dK/dV accumulators always go the whole way. Ulysses:
`document_attention` on the whole sequences of my heads; the messages are unchanged.

Ulysses (`ulysses_attention`, arXiv 2309.14509): an all-to-all turns q, k, v from sequence-
sharded [B, T/cp, 3, H, D] into head-sharded [B, T, 3, H/cp, D]; ordinary causal attention
runs on whole sequences of my heads; a second all-to-all brings the output back to my tokens.
Its backward is the transposed all-to-all (`all_to_all_dim` with the dims swapped).

    per rank and layer, sent:  forward (cp-1)/cp (3 + 1) B (T/cp) C/tp, backward the same
    kept for backward:         the [B, H/(tp cp), T, T] probabilities and q, k, v of my heads
    constraint:                n_head divisible by tp * cp

Both are differentiable ops in the style of `mappings.py`, taking their group
(`ContextParallel`: the communicator, the design, what to record). NumPy or CuPy, from the
array module of the inputs.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from hpcpar.autograd import ops
from hpcpar.autograd.attention import causal_attention, document_attention
from hpcpar.backend import array_module
from hpcpar.backend.precision import down, up
from hpcpar.autograd.tensor import Tensor
from hpcpar.parallel.cp.balance import balanced_positions

if TYPE_CHECKING:  # annotations only: model code never needs MPI loaded
    from hpcpar.runtime.comm import Communicator

RING, ULYSSES = "ring", "ulysses"
IMPLS = (RING, ULYSSES)
ZIGZAG, CONTIGUOUS = "zigzag", "contiguous"
LAYOUT_OF = {RING: ZIGZAG, ULYSSES: CONTIGUOUS}
TRACE_TID = 99  # the timeline row (Chrome trace tid) of cp communication
_KEEP = 16      # work-balanced layouts kept, one per Documents (a pipeline has several micro-batches in flight)

# Message tags on the cp communicator (it carries nothing else).
_TAG_KV, _TAG_KV_BACK, _TAG_DKV = 1501, 1502, 1503


# ---------------------------------------------------------------------------------------------
# Sequence layouts
# ---------------------------------------------------------------------------------------------
def chunks_of(layout: str, cp: int, rank: int) -> tuple[int, ...]:
    """The sequence chunks rank `rank` of `cp` holds, in local order (see the module doc)."""
    if layout == ZIGZAG:
        return (rank, 2 * cp - 1 - rank)
    if layout == CONTIGUOUS:
        return (rank,)
    raise ValueError(f"unknown sequence layout {layout!r}; use {ZIGZAG!r} or {CONTIGUOUS!r}")


def n_chunks(layout: str, cp: int) -> int:
    """How many equal chunks the sequence is cut into: 2cp (zigzag) or cp (contiguous)."""
    return len(chunks_of(layout, cp, 0)) * cp


def positions(layout: str, t: int, cp: int, rank: int) -> np.ndarray:
    """Global positions (int64 [t/cp]) of rank `rank`'s tokens of a length-`t` sequence, in local
    order: the columns of [B, t] token ids it takes, the rows of wpe and of dropout masks it uses."""
    n = n_chunks(layout, cp)
    if t % n:
        raise ValueError(f"sequence length {t} does not split into {n} equal chunks ({layout} layout, cp={cp})")
    c = t // n
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks_of(layout, cp, rank)])


class _Box:
    """One rectangle of a block's scores that is computed: batch rows `rows` (a slice: all of them,
    or one row b as b:b+1), query rows [r0, r1) and key columns [c0, c1) of the local sequences,
    and its additive mask `bias` [n, m] (0 or -inf; None: nothing masked), broadcast over the
    rows and heads of the [rows, H, n, m] scores. Built from `allowed` [n', m'], the pairs of a
    sub-block whose first query and key are local rows `at` = (query, key): the smallest box
    holding them."""

    __slots__ = ("rows", "r0", "r1", "c0", "c1", "bias")

    def __init__(self, allowed: np.ndarray, rows: slice, at: tuple, xp, dtype):
        r = np.flatnonzero(allowed.any(axis=1))
        c = np.flatnonzero(allowed.any(axis=0))
        sub = allowed[r[0]:r[-1] + 1, c[0]:c[-1] + 1]
        self.rows = rows
        self.r0, self.r1 = at[0] + int(r[0]), at[0] + int(r[-1]) + 1
        self.c0, self.c1 = at[1] + int(c[0]), at[1] + int(c[-1]) + 1
        self.bias = None if sub.all() else xp.asarray(np.where(sub, 0.0, -np.inf).astype(dtype))


class _Block:
    """The part of the scores [my queries x the keys of one source rank] that the mask leaves, as
    the `_Box`es the kernels compute (in order), and the number of (query, key) pairs attended (the
    work, summed over the batch) and of score elements computed (per head; pairs <= elements).

    `allowed`: [Tl, Tl] bool, the causal mask every row of the batch shares (`batch` rows): one
    box over all rows, the smallest holding every allowed pair. Or [B, Tl, Tl] with packed
    documents (each row its own segments), with `runs`: the (query, key) sub-blocks [a0, a1) x
    [k0, k1) of local rows, one per (my chunk, its chunk) of the layout. Then one box per row and
    sub-block that holds an allowed pair, the smallest holding them (the others are skipped): one
    box over all rows, or over a rank's two chunks, would compute the union of the rows' boxes, or
    what lies between its chunks' pairs, which the balance of pairs (`balance.py`) does not see.
    Merge order: `runs` as given, my chunks in increasing order, so in my own block (step 0)
    every box row holds a pair: my first chunk's queries meet their own keys in its first box, and
    those of my second chunk that attend my first are the first of its rows (its first segment's).
    """

    __slots__ = ("boxes", "pairs", "elements")

    def __init__(self, allowed: np.ndarray, xp, dtype, batch: int = 1, runs: list | None = None):
        if allowed.ndim == 2:
            self.boxes = [_Box(allowed, slice(None), (0, 0), xp, dtype)]
        else:
            self.boxes = [_Box(a[a0:a1, k0:k1], slice(b, b + 1), (a0, k0), xp, dtype)
                          for (a0, a1), (k0, k1) in runs for b, a in enumerate(allowed) if a[a0:a1, k0:k1].any()]
        per_box = batch if allowed.ndim == 2 else 1                        # batch rows a box spans
        self.pairs = int(allowed.sum()) * per_box
        self.elements = per_box * sum((box.r1 - box.r0) * (box.c1 - box.c0) for box in self.boxes)




class _Plan:
    """What one rank computes and passes on in a ring pass (forward and backward alike).

    blocks[src]: my `_Block` against rank src's keys (None: wholly masked, not computed).
    send[step] / recv[step]: whether, in ring step `step` < cp-1, I pass the K/V I hold to the next
    rank / take the next one from the previous rank. A K/V block travels the ring from its owner
    only as far as the last rank that attends to it: rank r sends src's K/V on iff some rank after
    it on the way (r+1 .. src-1, ring order) has an unmasked pair with src's keys. `need[q, k]`
    (the same on every rank: each derives it from the whole windows' documents) says whether rank
    q's queries attend to any of rank k's keys.
    """

    def __init__(self, need: np.ndarray, rank: int, blocks: list):
        size = len(need)
        self.blocks = blocks

        def sends(r: int, step: int) -> bool:
            src = (r - step) % size
            return any(need[(r + j) % size, src] for j in range(1, size - step))
        self.send = [sends(rank, step) for step in range(size - 1)]
        self.recv = [sends((rank - 1) % size, step) for step in range(size - 1)]


def _needs(q_pos: np.ndarray, k_pos: np.ndarray, first: np.ndarray | None) -> bool:
    """Whether queries at global positions `q_pos` attend to any key at `k_pos`: causally, or
    (`first` [B, T]: each token's segment start) also only within their segment."""
    if first is None:
        return bool(q_pos.max() >= k_pos.min())
    keys = np.sort(k_pos)
    lo = np.searchsorted(keys, first[:, q_pos], side="left")     # first key >= my segment's start
    hi = np.searchsorted(keys, q_pos, side="right")              # past the keys <= me
    return bool((hi > lo).any())


class ContextParallel:
    """One rank's context-parallel group: its communicator, the design and what it records.

    Args:
        comm: the cp Communicator (`mesh.comm(Axis.CP)`); None or size 1: no context parallelism.
        impl: "ring" or "ulysses".
        layout: the sequence layout; default zigzag for ring, contiguous for ulysses (ring works
            on either: the contiguous one is the unbalanced baseline of the benchmark).
        tracer: a `trace.Tracer`; when enabled, cp communication and ring blocks become spans on
            timeline row `TRACE_TID` (`pipeline.trace = true`).

    Attributes:
        events: None, or a list the ring appends (what, step, time.perf_counter()) to: "post"
            (messages posted), "compute"/"computed" (the block's attention), "arrived" (receive
            waited), per ring step, forward and backward ("back_..."). For the overlap test.
        stats: counters since the last `reset_stats()`: "bytes_sent" (this rank, all cp messages),
            "pairs" (causal (query, key) pairs whose scores this rank's forwards computed: the
            attention work; a backward does the same pairs again), "elements" (score elements its ring
            forwards computed: the pairs plus the masked ones inside the computed boxes, `_Block`),
            "calls" (forwards), "skipped"
            (ring blocks of a forward wholly masked, so not computed, forward or backward).
    """

    def __init__(self, comm: Communicator | None = None, impl: str = RING, layout: str | None = None,
                 tracer=None):
        if impl not in IMPLS:
            raise ValueError(f"unknown context-parallel implementation {impl!r}; use one of {', '.join(IMPLS)}")
        self.comm = comm
        self.size = comm.size if comm is not None else 1
        self.rank = comm.rank if comm is not None else 0
        self.impl = impl
        self.layout = layout or LAYOUT_OF[impl]
        if impl == ULYSSES and self.layout != CONTIGUOUS:
            raise ValueError("ulysses needs the contiguous layout (its all-to-all gathers chunks in order)")
        self.tracer = tracer
        if tracer is not None and self.size > 1:
            tracer.thread_names[TRACE_TID] = f"context parallel ({impl})"
        self.events: list | None = None
        self._positions: dict[int, list] = {}
        self._balanced: list[tuple] = []         # (Documents, every rank's positions), newest first
        self._plans: dict[tuple, _Plan] = {}
        self._documents_plan: tuple | None = None
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"bytes_sent": 0, "pairs": 0, "elements": 0, "calls": 0, "skipped": 0}

    def positions(self, t: int, documents=None) -> np.ndarray:
        """My tokens' global positions (int64 [t/cp], local order) in a sequence of `t`: the layout's
        (the module's `positions`), or with packed `documents` (`data.packing.Documents` of the
        whole [B, t] windows) the micro-batch's work-balanced ones (`held`)."""
        return self.held(t, documents)[self.rank]

    @property
    def columns(self):
        """What the data layer selects a micro-batch's columns with (`data.balance.GlobalBatches`):
        `positions`, (T, Documents or None) -> my columns; None without context parallelism (all)."""
        return self.positions if self.size > 1 else None

    def held(self, t: int, documents=None) -> list:
        """Every rank's positions (rank order) of a sequence of `t`. Under the zigzag layout with
        `documents` that hold a document start, the 2cp chunks dealt by attention work
        (`balance.balanced_positions`); else the layout's. Cached per length, and for the last
        `_KEEP` Documents (every layer of a micro-batch, forward and backward, asks again)."""
        if documents is not None and documents.block_size != t:
            raise ValueError(f"packed documents of {documents.block_size}-token windows, but the sequence "
                             f"has {t} tokens")
        if t not in self._positions:
            self._positions[t] = [positions(self.layout, t, self.size, r) for r in range(self.size)]
        if documents is None or documents.whole or self.layout != ZIGZAG:
            return self._positions[t]
        for seen, held in self._balanced:
            if seen is documents:
                return held
        held = balanced_positions(documents, self.size)
        self._balanced = [(documents, held)] + self._balanced[:_KEEP - 1]
        return held

    def attention(self, qkv: Tensor, n_head: int, recompute: bool = False, documents=None) -> Tensor:
        """Causal self-attention of my tokens over the whole sequence: [B, T/cp, 3 n_head D] ->
        [B, T/cp, n_head D], as `causal_attention` of the full sequence would give my rows.
        `documents` (packed documents, a `data.packing.Documents` of the whole [B, T] windows):
        within segments only, as `document_attention` would give my rows. `recompute` (selective
        recomputation): Ulysses' inner attention keeps no probabilities; ring attention keeps
        none in any case (its backward rebuilds each block's from the saved log-sum-exp), so the
        flag changes nothing there."""
        if documents is not None and documents.whole:
            documents = None                     # one segment per window: the causal plan, cached
        if self.size == 1:
            return (causal_attention(qkv, n_head, recompute) if documents is None
                    else document_attention(qkv, n_head, documents, recompute))
        self.stats["calls"] += 1
        if self.impl == RING:
            return ring_attention(qkv, n_head, self, documents)
        return ulysses_attention(qkv, n_head, self, recompute, documents)

    # -- recording ---------------------------------------------------------------------------
    def _event(self, what: str, step: int) -> None:
        if self.events is not None:
            self.events.append((what, step, time.perf_counter()))

    def _span(self, name: str, category: str, start: float, args: dict | None = None) -> None:
        if self.tracer is not None and self.tracer.enabled:
            self.tracer.record(name, category, start, time.perf_counter(), tid=TRACE_TID, args=args)

    def _tracing(self) -> bool:
        return self.tracer is not None and self.tracer.enabled

    def _plan(self, t_local: int, batch: int, documents, xp, dtype) -> _Plan:
        """My blocks and messages of a ring pass over `batch` rows of cp*t_local tokens (see
        `_Plan`): causal (`documents` None; cached per shape) or within the segments of packed
        `documents` (cached for the last Documents seen: every layer of a micro-batch, forward
        and backward, uses the same)."""
        key = (t_local, batch, xp.__name__, str(dtype))
        if documents is None and key in self._plans:
            return self._plans[key]
        last = self._documents_plan
        if documents is not None and last is not None and last[0] is documents and last[1] == key:
            return last[2]
        t = t_local * self.size
        where = self.held(t, documents)          # every rank's positions (checks the documents' length)
        first = None if documents is None else np.arange(t) - documents.positions()   # [B, T] segment starts
        need = np.array([[_needs(q, k, first) for k in where] for q in where])
        q_pos, blocks = where[self.rank], []
        per_rank = len(chunks_of(self.layout, self.size, self.rank))
        c = t_local // per_rank
        chunks = [(i * c, (i + 1) * c) for i in range(per_rank)]           # my chunks' local rows, as a source's
        for src in range(self.size):
            if not need[self.rank, src]:
                blocks.append(None)
                continue
            allowed = q_pos[:, None] >= where[src][None, :]                        # [Tl, Tl] causal
            if first is None:
                blocks.append(_Block(allowed, xp, dtype, batch))
                continue
            allowed = allowed & (where[src][None, None, :] >= first[:, q_pos][:, :, None])   # and the same segment
            blocks.append(_Block(allowed, xp, dtype, batch, [(q, k) for q in chunks for k in chunks]))
        plan = _Plan(need, self.rank, blocks)
        if documents is None:
            self._plans[key] = plan
        else:
            self._documents_plan = (documents, key, plan)
        return plan


# ---------------------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------------------
def _heads(qkv, n_head: int):
    """[B, T, 3 H D] -> q [B, H, T, D] and kv [2, B, H, T, D] (contiguous: kv is the message)."""
    xp = array_module(qkv)
    b, t, three_c = qkv.shape
    d = three_c // 3 // n_head
    heads = qkv.reshape(b, t, 3, n_head, d).transpose(2, 0, 3, 1, 4)
    return xp.ascontiguousarray(heads[0]), xp.ascontiguousarray(heads[1:])


class _Rotation:
    """The K/V blocks passing through a rank: the one `held` now and the buffer the next one
    arrives in. Two buffers besides the rank's own K/V (which is saved for backward and never
    overwritten) suffice, because a step's send is waited before the next step reuses its buffer."""

    def __init__(self, own):
        self.own = self.held = own
        self._free: list = []
        self._incoming = None

    def next_buffer(self):
        xp = array_module(self.own)
        self._incoming = self._free.pop() if self._free else xp.empty_like(self.own)
        return self._incoming

    def pass_on(self, comm, send: bool, recv: bool, nxt: int, prv: int, tag: int) -> tuple:
        """Post this step's messages (`_Plan`): the block held to `nxt` (if `send`), the next one
        from `prv` (if `recv`). Returns the (send, receive) handles, None where not posted."""
        if send and recv:
            return comm.isend_irecv(self.held, nxt, self.next_buffer(), prv, tag, tag)
        return (comm.isend(self.held, nxt, tag) if send else None,
                comm.irecv(self.next_buffer(), prv, tag) if recv else None)

    def arrived(self, sent, received) -> None:
        """Wait for the step's messages; the received block becomes the one held (None: none
        came, as no rank from here on attends to it)."""
        if received is not None:
            received.wait()
        if sent is not None:
            sent.wait()
        if self.held is not self.own and self.held is not None:
            self._free.append(self.held)
        self.held, self._incoming = self._incoming, None


def _scores(q, k, box: _Box, scale: float):
    """Scaled, masked scores [rows, H, r1-r0, c1-c0] of one box (q, k: [B, H, Tl, D])."""
    s = q[box.rows, :, box.r0:box.r1] @ k[box.rows, :, box.c0:box.c1].swapaxes(-1, -2)
    s *= scale
    if box.bias is not None:
        s += box.bias
    return s


def ring_attention(qkv: Tensor, n_head: int, cp: ContextParallel, documents=None) -> Tensor:
    """Causal attention of my tokens against the whole sequence, K/V passed around the cp ring.

    In: qkv [B, T/cp, 3 H D] (my tokens in `cp.layout` order; H = the heads on this tp rank);
    `documents` (`data.packing.Documents` of the whole windows): attention within segments only.
    Out: [B, T/cp, H D], equal to my rows of `causal_attention` (`document_attention`) on the full
    sequence. Backward: dQ locally, dK/dV accumulated around the ring and delivered to their owners.

    Masked blocks (`_Plan`): a block with no unmasked pair is not computed, and a K/V block is
    passed on only while a rank further along the ring attends to it. A row with no unmasked key
    in a box scores -inf throughout: its running maximum is finite from step 0 on (my own block
    comes first, each of its box rows holds a pair, and its boxes hold each query's own key), so
    exp(-inf - m) = 0 adds nothing and the rescale factor is exp(0) = 1: the merge is unchanged,
    exactly.
    """
    xp = array_module(qkv.data)
    comm, size, rank = cp.comm, cp.size, cp.rank
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    b, tl, three_c = qkv.shape
    d = three_c // 3 // n_head
    scale = 1.0 / math.sqrt(d)
    q, kv = _heads(qkv.data, n_head)                                       # [B,H,Tl,D], [2,B,H,Tl,D]
    # 16-bit activations: K/V travel in 16 bits, every block is computed in float32.
    qf = up(q)
    dtype = qf.dtype
    row_max = xp.full((b, n_head, tl), -xp.inf, dtype=dtype)
    row_sum = xp.zeros((b, n_head, tl), dtype=dtype)
    acc = xp.zeros_like(qf)                                                # unnormalised output
    plan = cp._plan(tl, b, documents, xp, dtype)
    ring = _Rotation(kv)
    for step in range(size):
        src = (rank - step) % size                                         # whose K/V I hold
        held, handles = ring.held, (None, None)
        if step < size - 1 and (plan.send[step] or plan.recv[step]):       # pass it on before computing
            start = time.perf_counter()
            handles = ring.pass_on(comm, plan.send[step], plan.recv[step], nxt, prv, _TAG_KV)
            cp.stats["bytes_sent"] += held.nbytes if plan.send[step] else 0
            cp._event("post", step)
            cp._span("cp_kv_send_recv", "comm", start, {"step": step})
        block = plan.blocks[src]
        cp._event("compute", step)
        start = time.perf_counter()
        if block is not None:
            k, v = up(held[0]), up(held[1])
            for box in block.boxes:                                # all rows, or a row's sub-blocks
                rows, r0, r1 = box.rows, box.r0, box.r1
                s = _scores(qf, k, box, scale)
                new_max = xp.maximum(row_max[rows, :, r0:r1], s.max(axis=-1))
                alpha = xp.exp(row_max[rows, :, r0:r1] - new_max)          # rescale what came before
                s -= new_max[..., None]
                xp.exp(s, out=s)                                           # unnormalised probabilities
                row_sum[rows, :, r0:r1] = row_sum[rows, :, r0:r1] * alpha + s.sum(axis=-1)
                acc[rows, :, r0:r1] = acc[rows, :, r0:r1] * alpha[..., None] + s @ v[rows, :, box.c0:box.c1]
                row_max[rows, :, r0:r1] = new_max
                del s  # before the next box's scores exist: one [n, n] block at a time
            cp.stats["pairs"] += n_head * block.pairs
            cp.stats["elements"] += n_head * block.elements
            del k, v
        else:
            cp.stats["skipped"] += 1
        cp._event("computed", step)
        if cp._tracing():
            cp._span("cp_attention_block", "compute", start, {"step": step, "source": src})
        if step < size - 1:
            start = time.perf_counter()
            ring.arrived(*handles)
            cp._event("arrived", step)
            cp._span("cp_kv_wait", "comm", start, {"step": step})
    out_heads = acc / row_sum[..., None]                                   # [B, H, Tl, D]
    lse = row_max + xp.log(row_sum)                                        # [B, H, Tl]
    out = down(out_heads.transpose(0, 2, 1, 3).reshape(b, tl, n_head * d), qkv.dtype)

    def backward(g):
        return (down(_ring_backward(up(g), q, kv, out_heads, lse, n_head, scale, cp, plan), qkv.dtype),)
    return Tensor.from_op(out, (qkv,), backward)


def _ring_backward(g, q, kv, out_heads, lse, n_head: int, scale: float, cp: ContextParallel, plan: _Plan):
    """dqkv [B, T/cp, 3 H D] of `ring_attention` (see its doc and the module's), over the forward's
    `plan` (the same blocks computed, the same K/V messages). `g`, `out_heads`,
    `lse` and the result in float32 (or float64); q and the K/V blocks may be 16-bit (taken up to
    float32 block by block; the dK/dV accumulators travel in float32)."""
    xp = array_module(g)
    q = up(q)
    comm, size, rank = cp.comm, cp.size, cp.rank
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    b, h, tl, d = q.shape
    gy = xp.ascontiguousarray(g.reshape(b, tl, h, d).transpose(0, 2, 1, 3))   # dO [B, H, Tl, D]
    delta = (gy * out_heads).sum(axis=-1)                                   # rowsum(dO * O) [B, H, Tl]
    dq = xp.zeros_like(q)
    acc_dtype = q.dtype
    ring = _Rotation(kv)
    incoming = None      # the dK/dV accumulator of the K/V I hold, from the ranks before me
    pending = []         # send handles, waited at the end
    for step in range(size):
        src = (rank - step) % size
        held, kv_handles = ring.held, (None, None)
        if step < size - 1 and (plan.send[step] or plan.recv[step]):
            start = time.perf_counter()
            kv_handles = ring.pass_on(comm, plan.send[step], plan.recv[step], nxt, prv, _TAG_KV_BACK)
            cp.stats["bytes_sent"] += held.nbytes if plan.send[step] else 0
            cp._event("back_post", step)
            cp._span("cp_kv_send_recv", "comm", start, {"step": step, "backward": True})
        block = plan.blocks[src]
        cp._event("back_compute", step)
        start = time.perf_counter()
        part = xp.zeros(kv.shape, dtype=acc_dtype)                          # my dK, dV of src's keys
        if block is not None:
            k, v = up(held[0]), up(held[1])                                # float32 under 16 bits
            for box in block.boxes:               # all rows, or a row's sub-blocks (which may share keys)
                rows, r0, r1, c0, c1 = box.rows, box.r0, box.r1, box.c0, box.c1
                p = _scores(q, k, box, scale)
                p -= lse[rows, :, r0:r1, None]
                xp.exp(p, out=p)                                           # P from the saved log-sum-exp
                gy_rows = gy[rows, :, r0:r1]
                part[1][rows, :, c0:c1] += p.swapaxes(-1, -2) @ gy_rows    # dV = P^T dO
                ds = gy_rows @ v[rows, :, c0:c1].swapaxes(-1, -2)          # dP = dO V^T
                ds -= delta[rows, :, r0:r1, None]
                ds *= p
                ds *= scale                                                # dS = P (dP - delta) / sqrt(D)
                dq[rows, :, r0:r1] += ds @ k[rows, :, c0:c1]               # dQ += dS K
                part[0][rows, :, c0:c1] += ds.swapaxes(-1, -2) @ q[rows, :, r0:r1]  # dK = dS^T Q
                del p, ds  # one box's P and dS at a time
            del k, v
        cp._event("back_computed", step)
        if cp._tracing():
            cp._span("cp_attention_block", "compute", start, {"step": step, "source": src, "backward": True})
        start = time.perf_counter()
        if incoming is not None:
            part += incoming[1].wait()                                     # add the ranks before me
        # The accumulator goes on to the next rank (after the last step: to its owner, src).
        incoming_buf = xp.empty(kv.shape, dtype=acc_dtype)
        incoming = comm.isend_irecv(part, nxt, incoming_buf, prv, _TAG_DKV, _TAG_DKV)
        pending.append((incoming[0], part))
        cp.stats["bytes_sent"] += part.nbytes
        if step < size - 1:
            ring.arrived(*kv_handles)
        cp._event("back_arrived", step)
        cp._span("cp_dkv_send_recv", "comm", start, {"step": step, "backward": True})
    start = time.perf_counter()
    dkv = incoming[1].wait()                                               # my own dK, dV, complete
    for handle, _ in pending:
        handle.wait()
    cp._span("cp_dkv_wait", "comm", start, {"backward": True})
    dqkv = xp.concatenate([dq[None], dkv])                                 # [3, B, H, Tl, D]
    return dqkv.transpose(1, 3, 0, 2, 4).reshape(b, tl, 3 * h * d)


# ---------------------------------------------------------------------------------------------
# Ulysses: all-to-all between sequence shards and head shards
# ---------------------------------------------------------------------------------------------
def _all_to_all(a, comm: Communicator, split_dim: int, concat_dim: int):
    """Part j of `a` along `split_dim` goes to rank j; what arrives is concatenated along
    `concat_dim` in rank order: [.., n, .., m, ..] -> [.., n/cp, .., cp m, ..]."""
    xp = array_module(a)
    size, shape = comm.size, a.shape
    parts = a.reshape(shape[:split_dim] + (size, shape[split_dim] // size) + shape[split_dim + 1:])
    got = comm.all_to_all(xp.ascontiguousarray(xp.moveaxis(parts, split_dim, 0)), 0)   # [sources, ...]
    out_shape = list(shape)
    out_shape[split_dim] //= size
    out_shape[concat_dim] *= size
    return xp.moveaxis(got, 0, concat_dim).reshape(out_shape)


def all_to_all_dim(x: Tensor, comm: Communicator | None, split_dim: int, concat_dim: int,
                   on_exchange: Callable[[Any, float], None] | None = None) -> Tensor:
    """Re-shard: sharded(concat_dim) -> sharded(split_dim) over the ranks of `comm`.

    In: [.., n, .., m, ..] with my part of dim `concat_dim` (m each, rank order) and all of dim
    `split_dim` (n). Out: [.., n/size, .., size m, ..]: my part of `split_dim`, all of
    `concat_dim`. Backward: the transposed all-to-all (the same op with the dims swapped).
    `on_exchange(array, start_time)` is told about every exchange, forward and backward.
    """
    if comm is None or comm.size == 1:
        return x
    split_dim, concat_dim = split_dim % x.ndim, concat_dim % x.ndim

    def exchange(a, split, concat):
        start = time.perf_counter()
        out = _all_to_all(a, comm, split, concat)
        if on_exchange is not None:
            on_exchange(a, start)
        return out
    return Tensor.from_op(exchange(x.data, split_dim, concat_dim), (x,),
                          lambda g: (exchange(g, concat_dim, split_dim),))


def ulysses_attention(qkv: Tensor, n_head: int, cp: ContextParallel, recompute: bool = False,
                      documents=None) -> Tensor:
    """DeepSpeed-Ulysses: [B, T/cp, 3 H D] (contiguous chunk r) -> all-to-all -> [B, T, 3, H/cp, D]
    -> `causal_attention` on my H/cp heads (`recompute`: keeping no probabilities) -> all-to-all
    -> [B, T/cp, H D]. With packed `documents` (whole windows): `document_attention` instead, as
    the all-to-all leaves whole sequences, in order, on every rank; the messages are unchanged."""
    comm, size = cp.comm, cp.size
    if n_head % size:
        raise ValueError(f"ulysses: {n_head} heads do not split over cp={size} ranks")
    b, tl, three_c = qkv.shape
    d = three_c // 3 // n_head
    t, heads = tl * size, n_head // size

    def on_exchange(a, start):
        cp.stats["bytes_sent"] += a.nbytes * (size - 1) // size
        cp._span("cp_all_to_all", "comm", start, {"shape": list(a.shape)})

    x = all_to_all_dim(ops.reshape(qkv, (b, tl, 3, n_head, d)), comm, 3, 1, on_exchange)   # [B, T, 3, H/cp, D]
    x = ops.reshape(x, (b, t, 3 * heads * d))
    if documents is None:
        cp.stats["pairs"] += b * heads * t * (t + 1) // 2
        y = causal_attention(x, heads, recompute)                                          # [B, T, H/cp D]
    else:
        cp.stats["pairs"] += heads * sum(len(rows) * n * (n + 1) // 2 for n, rows, _ in documents.segments())
        y = document_attention(x, heads, documents, recompute)
    y = all_to_all_dim(ops.reshape(y, (b, t, heads, d)), comm, 1, 2, on_exchange)         # [B, T/cp, H, D]
    return ops.reshape(y, (b, tl, n_head * d))
