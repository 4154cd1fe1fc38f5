"""Pipeline schedules as data: the builders (`build`) of every rank's actions, and their checks.

A schedule is, for each pipeline rank, the list of `Action`s that rank performs in one
training step (`simulate.py` replays the lists in virtual time and checks them). The executor
(`executor.py`) only replays these lists: non-blocking Isend for
every send, a blocking receive (Irecv + wait) for every recv, and all sends waited at the end
of the step. Every list puts each recv right before the compute that needs it and each send
right after the compute that produced it, so a rank never waits for something it could have
sent first.

Virtual stages (`Placement`). With `chunks` = v model chunks per rank there are `pp * v`
virtual stages. Megatron's interleaving ("loop") gives chunk c of rank r virtual stage
`c * pp + r` (`Placement.stage`): every chunk runs down the ranks 0 .. pp-1. ZB-V ("v", two chunks)
runs chunk 0 down and chunk 1 back up: rank r holds stages r and 2 pp - 1 - r, so rank 0 holds
the first and the last stage and the hand-over between the chunks happens inside rank pp - 1,
with no message. The first virtual stage reads the tokens (no recv_act); the last computes the
loss (no send_act, no recv_grad).

Backward in two halves (Kind.WEIGHT). A schedule may split a backward into B (`backward`: the
gradient of the input, which the previous stage waits for) and W (`weight`: the gradients of
the parameters, which nobody waits for). Where a (microbatch, chunk) has a `weight` action its
`backward` is B only; without one `backward` is the whole backward.

GPipe, 1F1B and interleaved 1F1B are one loop with a different warm-up length (`_rank_actions`):
    warm-up:   W forwards;
    steady:    one forward, then one backward (1F1B), until the forwards run out;
    cool-down: the remaining backwards.
GPipe is W = all forwards. 1F1B (PipeDream-Flush) is W = min(pp - r - 1, m): rank r keeps
just enough microbatches in flight to fill the pipe below it. Interleaved 1F1B walks the
(chunk, microbatch) pairs in Megatron's order with Megatron's warm-up. ZB-H1 (Qi et al.,
arXiv 2401.10241) is 1F1B with each backward split and rank r's weight passes r micro-batches
late, so the last W's fill the cool-down; ZB-V is built by list scheduling (`zbv`).

Bubble (idle fraction of the step, t_comm = 0, every rank busy m (t_f + t_b + t_w); t_b is B
and t_w W, a whole backward is t_b + t_w):
    GPipe, 1F1B:  (p - 1) / (m + p - 1)       step = (m + p - 1)(t_f + t_b + t_w)
    interleaved:  (p - 1) / (v m + p - 1)     step = (m + (p - 1)/v)(t_f + t_b + t_w)
    ZB-H1:        step = m (t_f + t_b + t_w) + (p - 1)(t_f + t_b - t_w)   (m >= p, t_w <= t_f, t_b)
    ZB-V:         step >= m (t_f + t_b + t_w) + (p - 1) t_f / 2  (the last rank's first input)
i.e. the bubble time (p - 1)(t_f + t_b + t_w) shrinks by v (arXiv 2104.04473, section 2.2), to
a third with ZB-H1 at t_f = t_b = t_w, and to the fill of the first forward with ZB-V.
Peak stashed activations on rank r (counted in chunk activations, each 1/v of the rank's
layers, held from the forward until the weight pass, or the backward without one):
    GPipe: m;  1F1B: min(p - r, m) <= p;  interleaved: min(W_r + 1, v m) with Megatron's W_r;
    ZB-H1: min(p, m);  ZB-V: <= 2 p (p micro-batches of the rank's layers, 1F1B's peak).
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass

from hpcpar.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")


class ScheduleError(RuntimeError):
    """A schedule that cannot run: deadlock, unmatched message, or broken data dependency (raised
    by the simulator's checks, `simulate.py`, and by `zbv`'s list scheduling)."""


class Kind(str, enum.Enum):
    """What an action does. A str too, so traces, tests and files can say "forward"."""

    RECV_ACT = "recv_act"    # receive the input activation of (microbatch, chunk)
    FORWARD = "forward"
    SEND_ACT = "send_act"    # send the output activation
    RECV_GRAD = "recv_grad"  # receive the gradient of the output
    BACKWARD = "backward"    # the whole backward, or B (input gradient) when a weight action follows
    SEND_GRAD = "send_grad"  # send the gradient of the input
    WEIGHT = "weight"        # W: the parameters' gradients that the backward (B) left

    __str__ = str.__str__
    __format__ = str.__format__


COMPUTE = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)
SENDS = (Kind.SEND_ACT, Kind.SEND_GRAD)
RECVS = (Kind.RECV_ACT, Kind.RECV_GRAD)
KINDS = tuple(Kind)


@dataclass(frozen=True)
class Action:
    """One step of one rank: compute a (microbatch, chunk), or move its activation/gradient.

    `peer` is the pipeline rank sent to / received from (None for forward/backward/weight).
    """

    kind: Kind
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {', '.join(KINDS)}")
        object.__setattr__(self, "kind", Kind(self.kind))  # "forward" -> Kind.FORWARD
        if (self.peer is None) != (self.kind in COMPUTE):
            want = "no peer" if self.kind in COMPUTE else "a peer rank"
            raise ValueError(f"Action {self.kind} takes {want}, got peer={self.peer}")

    def __str__(self) -> str:
        peer = "" if self.peer is None else f" peer={self.peer}"
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk}{peer})"


PLACEMENTS = ("loop", "v")


@dataclass(frozen=True)
class Placement:
    """Which pipeline rank and model chunk hold each virtual stage (see the module doc).

    shape "loop": chunk c of rank r is virtual stage c * pp + r (Megatron's interleaving, and
    every schedule with one chunk). shape "v": chunks alternate direction,
    stage c * pp + r for even c and c * pp + pp - 1 - r for odd c (ZB-V's two chunks). Two
    consecutive stages on one rank hand over activations and gradients without a message.
    """

    pp: int
    chunks: int = 1
    shape: str = "loop"

    def __post_init__(self) -> None:
        if self.shape not in PLACEMENTS:
            raise ValueError(f"placement shape {self.shape!r} is not one of {', '.join(PLACEMENTS)}")

    @property
    def stages(self) -> int:
        return self.pp * self.chunks

    def stage(self, rank: int, chunk: int) -> int:
        """Virtual stage of `chunk` on `rank`."""
        if self.shape == "v" and chunk % 2:
            return chunk * self.pp + self.pp - 1 - rank
        return chunk * self.pp + rank

    def holder(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage `stage`."""
        chunk, i = divmod(stage, self.pp)
        return (self.pp - 1 - i if self.shape == "v" and chunk % 2 else i), chunk

    def neighbour(self, rank: int, chunk: int, step: int) -> tuple[int, int] | None:
        """(rank, chunk) of the stage `step` (-1: previous, +1: next) from `chunk` on `rank`;
        None past either end of the pipeline."""
        other = self.stage(rank, chunk) + step
        return self.holder(other) if 0 <= other < self.stages else None

    def local(self, rank: int, chunk: int, step: int) -> int | None:
        """The chunk of this rank that holds the neighbouring stage, if this rank holds it: the
        hand-over is then local, with no message. None when it is remote or there is none."""
        other = self.neighbour(rank, chunk, step)
        return other[1] if other is not None and other[0] == rank else None


def message_tag(action: Action, rank: int, placement: Placement, microbatches: int) -> int:
    """MPI tag of the message a send/recv action of `rank` moves; equal on both sides, unique in a step.

    A message crosses the boundary b between virtual stages b and b + 1 (b < V - 1):
    activations go b -> b+1, gradients b+1 -> b. tag = ((direction * (V - 1)) + b) * m + mb,
    direction 0 for activations and 1 for gradients, so tags lie in [0, 2 (V - 1) m).
    """
    stage = placement.stage(rank, action.chunk)
    if action.kind in (Kind.RECV_ACT, Kind.SEND_GRAD):  # the stage below us is the peer
        boundary = stage - 1
    elif action.kind in (Kind.SEND_ACT, Kind.RECV_GRAD):  # the stage above us is the peer
        boundary = stage
    else:
        raise ValueError(f"{action} moves no message")
    direction = 0 if action.kind in (Kind.RECV_ACT, Kind.SEND_ACT) else 1
    return (direction * (placement.stages - 1) + boundary) * microbatches + action.microbatch


# --------------------------------------------------------------------------- schedules


def _forward(rank: int, chunk: int, mb: int, place: Placement) -> list[Action]:
    """Receive the input activation (unless first stage, or the previous stage is on this rank),
    forward, send the output (unless last stage, or the next one is here)."""
    actions = [Action(Kind.FORWARD, mb, chunk)]
    prev, nxt = place.neighbour(rank, chunk, -1), place.neighbour(rank, chunk, +1)
    if prev is not None and prev[0] != rank:
        actions.insert(0, Action(Kind.RECV_ACT, mb, chunk, prev[0]))
    if nxt is not None and nxt[0] != rank:
        actions.append(Action(Kind.SEND_ACT, mb, chunk, nxt[0]))
    return actions


def _backward(rank: int, chunk: int, mb: int, place: Placement) -> list[Action]:
    """Receive the output gradient (unless last stage, or the next stage is on this rank),
    backward, send the input gradient (unless first stage, or the previous one is here)."""
    actions = [Action(Kind.BACKWARD, mb, chunk)]
    prev, nxt = place.neighbour(rank, chunk, -1), place.neighbour(rank, chunk, +1)
    if nxt is not None and nxt[0] != rank:
        actions.insert(0, Action(Kind.RECV_GRAD, mb, chunk, nxt[0]))
    if prev is not None and prev[0] != rank:
        actions.append(Action(Kind.SEND_GRAD, mb, chunk, prev[0]))
    return actions


def _rank_actions(rank: int, place: Placement, forwards: list[tuple[int, int]],
                  backwards: list[tuple[int, int]], warmup: int) -> list[Action]:
    """Warm-up forwards, then 1F1B pairs, then cool-down backwards; orders are (chunk, mb)."""
    actions: list[Action] = []
    for chunk, mb in forwards[:warmup]:
        actions += _forward(rank, chunk, mb, place)
    steady = len(forwards) - warmup
    for i in range(steady):
        actions += _forward(rank, *forwards[warmup + i], place)
        actions += _backward(rank, *backwards[i], place)
    for chunk, mb in backwards[steady:]:
        actions += _backward(rank, chunk, mb, place)
    return actions


def gpipe(pp: int, microbatches: int, chunks: int = 0) -> list[list[Action]]:
    """GPipe: all forwards, then all backwards. Stashes all m activations; bubble (p-1)/(m+p-1)."""
    validate("gpipe", pp, microbatches, chunks)
    order = [(0, mb) for mb in range(microbatches)]
    return [_rank_actions(r, Placement(pp), order, order, warmup=microbatches) for r in range(pp)]


def one_f_one_b(pp: int, microbatches: int, chunks: int = 0) -> list[list[Action]]:
    """1F1B (PipeDream-Flush): same bubble as GPipe, (p-1)/(m+p-1), but rank r stashes min(p-r, m).

    Rank r runs W = min(p - r - 1, m) warm-up forwards. The last rank has W = 0 and alternates
    F0 B0 F1 B1 ...; each rank above it has one more microbatch in flight, which is exactly what
    keeps it busy while the gradient of its oldest microbatch travels down and back.
    """
    validate("1f1b", pp, microbatches, chunks)
    order = [(0, mb) for mb in range(microbatches)]
    return [_rank_actions(r, Placement(pp), order, order, warmup=min(pp - r - 1, microbatches))
            for r in range(pp)]


def _interleaved_order(pp: int, microbatches: int, chunks: int, forward: bool) -> list[tuple[int, int]]:
    """Megatron's (chunk, mb) order: groups of pp microbatches go through chunk 0, 1, ..., v-1
    (backwards: v-1, ..., 0) before the next group starts."""
    order = []
    for k in range(microbatches * chunks):
        group, within = divmod(k, pp * chunks)
        chunk = within // pp
        order.append((chunk if forward else chunks - 1 - chunk, group * pp + within % pp))
    return order


def interleaved_1f1b(pp: int, microbatches: int, chunks: int = 0) -> list[list[Action]]:
    """Megatron's interleaved 1F1B with v = chunks model chunks per rank (arXiv 2104.04473).

    Each chunk costs 1/v of a stage, so the fill and drain shrink by v: bubble (p-1)/(v m + p-1).
    Needs m % p == 0 so that microbatches move through the chunks in whole groups of p.
    Rank r runs W_r = min(2 (p - r - 1) + (v - 1) p, v m) warm-up forwards (Megatron's count)
    and so stashes min(W_r + 1, v m) chunk activations. With instant messages (p - r - 1) + (v - 1) p
    would give the same bubble; the extra p - r - 1 forwards in flight hide message latency
    (simulate with t_comm > 0 to see it). Megatron also makes every forward warm-up when m == p,
    which its paired blocking send/recv needs but our Isend executor does not, so we do not.
    chunks == 1 is exactly `one_f_one_b`.
    """
    validate("interleaved", pp, microbatches, chunks)
    chunks = resolve_chunks("interleaved", chunks)
    if chunks == 1:
        return one_f_one_b(pp, microbatches)
    forwards = _interleaved_order(pp, microbatches, chunks, forward=True)
    backwards = _interleaved_order(pp, microbatches, chunks, forward=False)
    total = microbatches * chunks
    place = Placement(pp, chunks)
    schedules = []
    for r in range(pp):
        warmup = min(2 * (pp - r - 1) + (chunks - 1) * pp, total)
        schedules.append(_rank_actions(r, place, forwards, backwards, warmup))
    return schedules


def zbh1(pp: int, microbatches: int, chunks: int = 0) -> list[list[Action]]:
    """ZB-H1 (Qi et al., arXiv 2401.10241, section 3): 1F1B with every backward split into B
    and W, and rank r's W passes r micro-batches late.

    The forwards and B's are 1F1B's (warm-up min(p - r - 1, m)); W of micro-batch k comes right
    after B of micro-batch k + r, the last r at the end. The B's now travel down the pipe without
    their W's, so the cool-down shrinks, and the W's left over fill what remains of it: the step
    is m (t_f + t_b + t_w) + (p - 1)(t_f + t_b - t_w) (m >= p, W no slower than F or B): a
    bubble of a third of 1F1B's when the three cost the same. A micro-batch stays stashed until
    its W, so every rank holds up to min(p, m) micro-batches: 1F1B's peak (on its rank 0).
    """
    validate("zbh1", pp, microbatches, chunks)
    place = Placement(pp)
    order = [(0, mb) for mb in range(microbatches)]
    schedules = []
    for r in range(pp):
        actions, weights = [], 0
        for a in _rank_actions(r, place, order, order, warmup=min(pp - r - 1, microbatches)):
            actions.append(a)
            # W(k) after the B of k + r (and after its send: never hold a message back).
            if (a.kind == Kind.BACKWARD and r == 0) or a.kind == Kind.SEND_GRAD:
                if a.microbatch - r >= 0:
                    actions.append(Action(Kind.WEIGHT, a.microbatch - r, 0))
                    weights += 1
        actions += [Action(Kind.WEIGHT, mb, 0) for mb in range(weights, microbatches)]
        schedules.append(actions)
    return schedules


def zbv(pp: int, microbatches: int, chunks: int = 0) -> list[list[Action]]:
    """ZB-V (Qi et al., arXiv 2401.10241, section 6): two chunks per rank in a V, B and W split.

    Placement "v": rank r holds stages r and 2p - 1 - r. The order comes from list scheduling
    in virtual time with F = B = W (each a chunk's share): whenever a rank is free it runs a
    ready B (chunk 0 first: the previous rank waits for it), else a ready F (chunk 1 first: it
    brings a micro-batch to its loss) if memory allows, else the oldest pending W, else it
    waits for the next input. Memory: a chunk activation is held from F to W; a rank holds at
    most 2p (p micro-batches of its layers, 1F1B's peak), and an F of chunk 0 leaves room for
    the F of chunk 1 that every micro-batch in flight will still need. The W's fill what would
    be bubble, so the step is m (t_f + t_b + t_w) plus about the fill of the first forward,
    (p - 1) t_f / 2, for m >= 2p. F, B and W of each chunk run in micro-batch order.
    """
    validate("zbv", pp, microbatches, chunks)
    place = Placement(pp, 2, "v")
    order = _ZbvListScheduler(place, microbatches).run()
    return [_expand(rank, order[rank], place) for rank in range(pp)]


class _ZbvListScheduler:
    """`zbv`'s list scheduling: every rank's (kind, mb, chunk) order, in virtual time with unit
    F, B and W costs. Per rank it tracks its clock, the next F and B of each chunk, the W's ready
    (oldest first) and the chunk activations held (F until W, at most `limit` = 2 pp)."""

    def __init__(self, place: Placement, microbatches: int):
        pp = place.pp
        self.pp, self.m, self.limit = pp, microbatches, 2 * pp
        self.done: dict[tuple[str, int, int, int], int] = {}   # (kind, mb, chunk, rank) -> end time (unit costs)
        self.clock = [0] * pp
        self.next_f, self.next_b = [[0, 0] for _ in range(pp)], [[0, 0] for _ in range(pp)]
        self.pending: list[list[tuple[int, int]]] = [[] for _ in range(pp)]  # W's ready, oldest first
        self.held = [0] * pp
        self.order: list[list[tuple[Kind, int, int]]] = [[] for _ in range(pp)]
        # (rank, chunk) of the stage an F (below) or a B (above) of each (rank, chunk) waits for.
        self.inputs = {(kind, rank, chunk): place.neighbour(rank, chunk, -1 if kind == Kind.FORWARD else +1)
                       for kind in (Kind.FORWARD, Kind.BACKWARD) for rank in range(pp) for chunk in (0, 1)}

    def ready(self, kind: Kind, mb: int, chunk: int, rank: int) -> int | None:
        """When (kind, mb, chunk) can start on `rank`: its input's producer has finished."""
        other = self.inputs[kind, rank, chunk]
        if other is None:  # stage 0's forward needs nothing; the loss stage's B its own forward
            return 0 if kind == Kind.FORWARD else self.done.get((Kind.FORWARD, mb, chunk, rank))
        return self.done.get((kind, mb, other[1], other[0]))

    def choice(self, rank: int) -> tuple[int, Kind, int, int] | None:
        """(start, kind, mb, chunk) this rank would run next: a ready B (chunk 0 first), else a
        ready F (chunk 1 first) that memory allows, else the oldest pending W, else the earliest
        B or F to become ready."""
        t, now, later = self.clock[rank], [], []
        for chunk in (0, 1):  # B's: chunk 0 first
            mb = self.next_b[rank][chunk]
            start = self.ready(Kind.BACKWARD, mb, chunk, rank) if mb < self.m else None
            if start is not None:
                (now if start <= t else later).append((max(start, t), Kind.BACKWARD, mb, chunk))
        held = self.held[rank]
        reserved = self.next_f[rank][0] - self.next_f[rank][1]  # micro-batches that still need chunk 1 here
        for chunk in (1, 0):  # F's: chunk 1 first
            mb = self.next_f[rank][chunk]
            room = held + 1 <= self.limit if chunk == 1 else held + reserved + 2 <= self.limit
            start = self.ready(Kind.FORWARD, mb, chunk, rank) if mb < self.m and room else None
            if start is not None:
                (now if start <= t else later).append((max(start, t), Kind.FORWARD, mb, chunk))
        if now:
            return now[0]
        if self.pending[rank]:
            return (t, Kind.WEIGHT, *self.pending[rank][0])
        return min(later, key=lambda c: c[0]) if later else None

    def run(self) -> list[list[tuple[Kind, int, int]]]:
        """Run the earliest choice of any rank until every F, B and W has run; every rank's order.

        A rank's choice depends on its own state and on what its neighbours in the V (ranks r - 1
        and r + 1; the turn at rank p - 1 is local) have done, so after each pick only those three
        are asked again: O(actions), not O(actions x pp), which 10,000-rank plans need. The
        earliest (start, rank) comes off a heap whose stale entries (a rank asked again since)
        are skipped.
        """
        choices = [self.choice(r) for r in range(self.pp)]
        heap = [(c[0], r) for r, c in enumerate(choices) if c is not None]
        heapq.heapify(heap)
        for _ in range(3 * 2 * self.m * self.pp):
            while heap and (choices[heap[0][1]] is None or choices[heap[0][1]][0] != heap[0][0]):
                heapq.heappop(heap)
            if not heap:
                raise ScheduleError(f"zbv({self.pp}, {self.m}): list scheduling found no runnable action")
            rank = heapq.heappop(heap)[1]
            self._commit(rank, *choices[rank])
            for r in range(max(0, rank - 1), min(self.pp, rank + 2)):
                choices[r] = self.choice(r)
                if choices[r] is not None:
                    heapq.heappush(heap, (choices[r][0], r))
        return self.order

    def _commit(self, rank: int, start: int, kind: Kind, mb: int, chunk: int) -> None:
        """`rank` runs (kind, mb, chunk) from `start` for one unit of time."""
        self.clock[rank] = start + 1
        self.done[(kind, mb, chunk, rank)] = self.clock[rank]
        self.order[rank].append((kind, mb, chunk))
        if kind == Kind.FORWARD:
            self.next_f[rank][chunk] += 1
            self.held[rank] += 1
        elif kind == Kind.BACKWARD:
            self.next_b[rank][chunk] += 1
            self.pending[rank].append((mb, chunk))
        else:
            self.pending[rank].pop(0)
            self.held[rank] -= 1


def _expand(rank: int, order: list[tuple[Kind, int, int]], place: Placement) -> list[Action]:
    """A rank's compute order as actions: each F and B with its messages, each W alone."""
    actions = []
    for kind, mb, chunk in order:
        if kind == Kind.FORWARD:
            actions += _forward(rank, chunk, mb, place)
        elif kind == Kind.BACKWARD:
            actions += _backward(rank, chunk, mb, place)
        else:
            actions.append(Action(Kind.WEIGHT, mb, chunk))
    return actions


def forward_only(pp: int, rank: int, microbatches: int, chunks: int = 1,
                 placement: Placement | None = None) -> list[Action]:
    """Rank `rank`'s actions for forwards alone (evaluation): recv_act, forward, send_act per
    (chunk, microbatch) in lexicographic order. Deadlock-free: every recv waits on an action that
    comes earlier in the global order (chunk, microbatch, rank), and sends never block; a
    hand-over inside the rank (ZB-V's chunk 0 -> 1) comes from an earlier chunk."""
    place = placement if placement is not None else Placement(pp, chunks)
    actions = []
    for chunk in range(place.chunks):
        for mb in range(microbatches):
            actions += _forward(rank, chunk, mb, place)
    return actions


_BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zbh1": zbh1, "zbv": zbv}
_FIXED_CHUNKS = {"zbv": 2}  # schedules whose shape fixes the chunks per rank


def resolve_chunks(name: str, chunks: int = 0) -> int:
    """The model chunks per rank schedule `name` runs: `chunks`, or with 0 ("auto") the
    schedule's own (2 for zbv, else 1). Raises ConfigError where the schedule fixes them."""
    fixed = _FIXED_CHUNKS.get(name)
    if fixed is not None:
        if chunks not in (0, fixed):
            raise ConfigError(f"pipeline.schedule={name} runs {fixed} chunks per rank (a V), fixed by the "
                              f"schedule: leave pipeline.chunks unset (0) or {fixed}, not {chunks}")
        return fixed
    return chunks or 1


def placement(name: str, pp: int, chunks: int = 0) -> Placement:
    """Where schedule `name` puts the virtual stages (the V of zbv; else the loop)."""
    return Placement(pp, resolve_chunks(name, chunks), "v" if name == "zbv" else "loop")


def validate(name: str, pp: int, microbatches: int, chunks: int = 0) -> None:
    """Raise ConfigError (one line: what is wrong, what would be right) unless the schedule can run.
    `chunks` 0 means the schedule's own (`resolve_chunks`)."""
    if name not in _BUILDERS:
        raise ConfigError(f"pipeline.schedule={name!r} is not one of {', '.join(SCHEDULES)}")
    for key, value, least in (("mesh.pp", pp, 1), ("train.microbatches", microbatches, 1),
                              ("pipeline.chunks", chunks, 0)):
        if not isinstance(value, int) or value < least:
            raise ConfigError(f"{key}={value!r} must be a {'positive' if least else 'non-negative'} integer")
    chunks = resolve_chunks(name, chunks)
    if name not in ("interleaved", *_FIXED_CHUNKS) and chunks != 1:
        raise ConfigError(f"pipeline.schedule={name} runs one chunk per rank: set pipeline.chunks=1 "
                          f"(got {chunks}) or pipeline.schedule=interleaved")
    if name == "interleaved" and chunks > 1:
        if pp == 1:
            raise ConfigError(f"pipeline.schedule=interleaved with pipeline.chunks={chunks} needs "
                              "mesh.pp >= 2 (on one stage chunks only add work); set pipeline.chunks=1")
        if microbatches % pp:
            raise ConfigError(f"pipeline.schedule=interleaved needs train.microbatches ({microbatches}) "
                              f"to be a multiple of mesh.pp ({pp}), e.g. {-(-microbatches // pp) * pp}")
    if name == "zbv" and pp == 1:
        raise ConfigError("pipeline.schedule=zbv needs mesh.pp >= 2 (its V runs down and back up the "
                          "pipeline ranks); use pipeline.schedule=zbh1 or 1f1b")


def build(name: str, pp: int, microbatches: int, chunks: int = 0) -> list[list[Action]]:
    """The action lists of schedule `name` (one of `SCHEDULES`), one per pp rank. Their virtual
    stages are placed by `placement(name, pp, chunks)`."""
    validate(name, pp, microbatches, chunks)
    return _BUILDERS[name](pp, microbatches, chunks)
