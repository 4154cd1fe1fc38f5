"""Pipeline schedules as data, and a simulator that replays them without MPI.

A schedule is, for each pipeline rank, the list of `Action`s that rank performs in one
training step. The executor (`pipeline.py`) only replays these lists: non-blocking Isend for
every send, a blocking receive (Irecv + wait) for every recv, and all sends waited at the end
of the step. Every list puts each recv right before the compute that needs it and each send
right after the compute that produced it, so a rank never waits for something it could have
sent first.

Virtual stages. With `chunks` = v model chunks per rank (Megatron interleaving), rank r holds
the layer chunks of virtual stages r, r + pp, r + 2 pp, ...: chunk c of rank r is virtual stage
`c * pp + r`, and there are `pp * v` virtual stages. The first virtual stage reads the tokens
(no recv_act); the last computes the loss (no send_act, no recv_grad).

The three schedules are one loop with a different warm-up length (`_rank_actions`):
    warm-up:   W forwards;
    steady:    one forward, then one backward (1F1B), until the forwards run out;
    cool-down: the remaining backwards.
GPipe is W = all forwards. 1F1B (PipeDream-Flush) is W = min(pp - r - 1, m): rank r keeps
just enough microbatches in flight to fill the pipe below it. Interleaved 1F1B walks the
(chunk, microbatch) pairs in Megatron's order with Megatron's warm-up.

Bubble (idle fraction of the step, t_comm = 0, every rank busy m (t_f + t_b)):
    GPipe, 1F1B:  (p - 1) / (m + p - 1)       step = (m + p - 1)(t_f + t_b)
    interleaved:  (p - 1) / (v m + p - 1)     step = (m + (p - 1)/v)(t_f + t_b)
i.e. the bubble time (p - 1)(t_f + t_b) shrinks by v (arXiv 2104.04473, section 2.2).
Peak stashed activations on rank r (counted in chunk activations, each 1/v of the rank's layers):
    GPipe: m;  1F1B: min(p - r, m) <= p;  interleaved: min(W_r + 1, v m) with Megatron's W_r.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from hpcpar.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Kind(str, enum.Enum):
    """What an action does. A str too, so traces, tests and files can say "forward"."""

    RECV_ACT = "recv_act"    # receive the input activation of (microbatch, chunk)
    FORWARD = "forward"
    SEND_ACT = "send_act"    # send the output activation
    RECV_GRAD = "recv_grad"  # receive the gradient of the output
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"  # send the gradient of the input

    __str__ = str.__str__
    __format__ = str.__format__


COMPUTE = (Kind.FORWARD, Kind.BACKWARD)
SENDS = (Kind.SEND_ACT, Kind.SEND_GRAD)
RECVS = (Kind.RECV_ACT, Kind.RECV_GRAD)
KINDS = tuple(Kind)


@dataclass(frozen=True)
class Action:
    """One step of one rank: compute a (microbatch, chunk), or move its activation/gradient.

    `peer` is the pipeline rank sent to / received from (None for forward/backward).
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


def stage_of(rank: int, chunk: int, pp: int) -> int:
    """Virtual stage of model chunk `chunk` held by pipeline rank `rank`."""
    return chunk * pp + rank


def message_tag(action: Action, pp: int, chunks: int, microbatches: int) -> int:
    """MPI tag of the message a send/recv action moves; equal on both sides, unique in a step.

    A message crosses the boundary b between virtual stages b and b + 1 (b < pp*chunks - 1):
    activations go b -> b+1, gradients b+1 -> b. tag = ((direction * (V - 1)) + b) * m + mb,
    direction 0 for activations and 1 for gradients, so tags lie in [0, 2 (V - 1) m).
    The acting rank is not in the action; it is the peer's neighbour (receive activations from
    rank - 1, send them to rank + 1, gradients the other way).
    """
    if action.kind in (Kind.RECV_ACT, Kind.SEND_GRAD):  # the stage below us is the peer
        boundary = stage_of((action.peer + 1) % pp, action.chunk, pp) - 1
    elif action.kind in (Kind.SEND_ACT, Kind.RECV_GRAD):  # the stage above us is the peer
        boundary = stage_of((action.peer - 1) % pp, action.chunk, pp)
    else:
        raise ValueError(f"{action} moves no message")
    direction = 0 if action.kind in (Kind.RECV_ACT, Kind.SEND_ACT) else 1
    return (direction * (pp * chunks - 1) + boundary) * microbatches + action.microbatch


# --------------------------------------------------------------------------- schedules


def _forward(rank: int, chunk: int, mb: int, pp: int, chunks: int) -> list[Action]:
    """Receive the input activation (unless first stage), forward, send the output (unless last)."""
    stage = stage_of(rank, chunk, pp)
    actions = [Action(Kind.FORWARD, mb, chunk)]
    if stage > 0:
        actions.insert(0, Action(Kind.RECV_ACT, mb, chunk, (rank - 1) % pp))
    if stage < pp * chunks - 1:
        actions.append(Action(Kind.SEND_ACT, mb, chunk, (rank + 1) % pp))
    return actions


def _backward(rank: int, chunk: int, mb: int, pp: int, chunks: int) -> list[Action]:
    """Receive the output gradient (unless last stage), backward, send the input gradient."""
    stage = stage_of(rank, chunk, pp)
    actions = [Action(Kind.BACKWARD, mb, chunk)]
    if stage < pp * chunks - 1:
        actions.insert(0, Action(Kind.RECV_GRAD, mb, chunk, (rank + 1) % pp))
    if stage > 0:
        actions.append(Action(Kind.SEND_GRAD, mb, chunk, (rank - 1) % pp))
    return actions


def _rank_actions(rank: int, pp: int, chunks: int, forwards: list[tuple[int, int]],
                  backwards: list[tuple[int, int]], warmup: int) -> list[Action]:
    """Warm-up forwards, then 1F1B pairs, then cool-down backwards; orders are (chunk, mb)."""
    actions: list[Action] = []
    for chunk, mb in forwards[:warmup]:
        actions += _forward(rank, chunk, mb, pp, chunks)
    steady = len(forwards) - warmup
    for i in range(steady):
        actions += _forward(rank, *forwards[warmup + i], pp, chunks)
        actions += _backward(rank, *backwards[i], pp, chunks)
    for chunk, mb in backwards[steady:]:
        actions += _backward(rank, chunk, mb, pp, chunks)
    return actions


def gpipe(pp: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
    """GPipe: all forwards, then all backwards. Stashes all m activations; bubble (p-1)/(m+p-1)."""
    validate("gpipe", pp, microbatches, chunks)
    order = [(0, mb) for mb in range(microbatches)]
    return [_rank_actions(r, pp, 1, order, order, warmup=microbatches) for r in range(pp)]


def one_f_one_b(pp: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
    """1F1B (PipeDream-Flush): same bubble as GPipe, (p-1)/(m+p-1), but rank r stashes min(p-r, m).

    Rank r runs W = min(p - r - 1, m) warm-up forwards. The last rank has W = 0 and alternates
    F0 B0 F1 B1 ...; each rank above it has one more microbatch in flight, which is exactly what
    keeps it busy while the gradient of its oldest microbatch travels down and back.
    """
    validate("1f1b", pp, microbatches, chunks)
    order = [(0, mb) for mb in range(microbatches)]
    return [_rank_actions(r, pp, 1, order, order, warmup=min(pp - r - 1, microbatches))
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


def interleaved_1f1b(pp: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
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
    if chunks == 1:
        return one_f_one_b(pp, microbatches)
    forwards = _interleaved_order(pp, microbatches, chunks, forward=True)
    backwards = _interleaved_order(pp, microbatches, chunks, forward=False)
    total = microbatches * chunks
    schedules = []
    for r in range(pp):
        warmup = min(2 * (pp - r - 1) + (chunks - 1) * pp, total)
        schedules.append(_rank_actions(r, pp, chunks, forwards, backwards, warmup))
    return schedules


def forward_only(pp: int, rank: int, microbatches: int, chunks: int = 1) -> list[Action]:
    """Rank `rank`'s actions for forwards alone (evaluation): recv_act, forward, send_act per
    (chunk, microbatch) in lexicographic order. Deadlock-free: every recv waits on an action that
    comes earlier in the global order (chunk, microbatch, rank), and sends never block."""
    last = pp * chunks - 1
    actions = []
    for chunk in range(chunks):
        v = stage_of(rank, chunk, pp)
        for mb in range(microbatches):
            if v > 0:
                actions.append(Action(Kind.RECV_ACT, mb, chunk, (rank - 1) % pp))
            actions.append(Action(Kind.FORWARD, mb, chunk))
            if v < last:
                actions.append(Action(Kind.SEND_ACT, mb, chunk, (rank + 1) % pp))
    return actions


_BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}


def validate(name: str, pp: int, microbatches: int, chunks: int = 1) -> None:
    """Raise ConfigError (one line: what is wrong, what would be right) unless the schedule can run."""
    if name not in _BUILDERS:
        raise ConfigError(f"pipeline.schedule={name!r} is not one of {', '.join(SCHEDULES)}")
    for key, value in (("mesh.pp", pp), ("train.microbatches", microbatches), ("pipeline.chunks", chunks)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r} must be a positive integer")
    if name != "interleaved" and chunks != 1:
        raise ConfigError(f"pipeline.schedule={name} runs one chunk per rank: set pipeline.chunks=1 "
                          f"(got {chunks}) or pipeline.schedule=interleaved")
    if name == "interleaved" and chunks > 1:
        if pp == 1:
            raise ConfigError(f"pipeline.schedule=interleaved with pipeline.chunks={chunks} needs "
                              "mesh.pp >= 2 (on one stage chunks only add work); set pipeline.chunks=1")
        if microbatches % pp:
            raise ConfigError(f"pipeline.schedule=interleaved needs train.microbatches ({microbatches}) "
                              f"to be a multiple of mesh.pp ({pp}), e.g. {-(-microbatches // pp) * pp}")


def build(name: str, pp: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
    """The action lists of schedule `name` ("gpipe" | "1f1b" | "interleaved"), one per pp rank."""
    validate(name, pp, microbatches, chunks)
    return _BUILDERS[name](pp, microbatches, chunks)


# --------------------------------------------------------------------------- simulator


class ScheduleError(RuntimeError):
    """A schedule that cannot run: deadlock, unmatched message, or broken data dependency."""


class Event(NamedTuple):
    """When one action ran on its rank; a recv starts when it begins waiting."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What one simulated step did. Lists are indexed by pipeline rank.

    bubble_per_rank[r] = 1 - busy[r] / makespan (busy = forward + backward time only);
    `bubble` is their mean. peak_stash[r] counts activations held from a forward until its
    backward, in chunk activations.
    """

    makespan: float
    busy: list[float]
    bubble_per_rank: list[float]
    peak_stash: list[int]
    events: list[list[Event]]

    @property
    def bubble(self) -> float:
        return sum(self.bubble_per_rank) / len(self.bubble_per_rank)


def _expected_peer(rank: int, action: Action, pp: int, last_stage: int) -> int:
    """The peer a send/recv must name; raises if the stage has no such neighbour."""
    stage = stage_of(rank, action.chunk, pp)
    downward = action.kind in (Kind.RECV_ACT, Kind.SEND_GRAD)  # talks to the previous stage
    if (downward and stage == 0) or (not downward and stage == last_stage):
        raise ScheduleError(f"rank {rank}: {action} on virtual stage {stage}, which has no "
                            f"{'previous' if downward else 'next'} stage")
    return (rank - 1) % pp if downward else (rank + 1) % pp


def _match_messages(schedules: list[list[Action]], chunks: int, microbatches: int) -> None:
    """Every send/recv names the right peer, and every send meets exactly one recv."""
    pp = len(schedules)
    sends: dict[int, tuple[int, Action]] = {}
    recvs: dict[int, tuple[int, Action]] = {}
    for rank, actions in enumerate(schedules):
        for action in actions:
            if action.kind in COMPUTE:
                continue
            expected = _expected_peer(rank, action, pp, pp * chunks - 1)
            if action.peer != expected:
                raise ScheduleError(f"rank {rank}: {action} names the wrong peer; expected {expected}")
            side = sends if action.kind in SENDS else recvs
            tag = message_tag(action, pp, chunks, microbatches)
            if tag in side:
                raise ScheduleError(f"rank {rank}: {action} duplicates {side[tag][1]} on rank {side[tag][0]}")
            side[tag] = (rank, action)
    for tag in recvs.keys() - sends.keys():
        raise ScheduleError(f"rank {recvs[tag][0]}: {recvs[tag][1]} has no matching send")
    for tag in sends.keys() - recvs.keys():
        raise ScheduleError(f"rank {sends[tag][0]}: {sends[tag][1]} is never received")


def simulate(schedules: list[list[Action]], t_forward: float = 1.0, t_backward: float = 2.0,
             t_comm: float = 0.0) -> SimResult:
    """Replay every rank's actions in virtual time, as the executor would run them with MPI.

    A forward of one chunk takes t_forward / chunks and a backward t_backward / chunks, so
    t_forward and t_backward are one microbatch's time through a rank's whole share of the
    model, whatever v. Sends never block (they are Isends); a recv blocks until the matching
    send was issued, plus t_comm. The number of chunks and microbatches is read off the actions.
    Raises ScheduleError naming rank and action on deadlock, an unmatched or mis-addressed
    message, a backward before its forward, or a forward/backward missing or duplicated.
    """
    pp = len(schedules)
    chunks = 1 + max((a.chunk for actions in schedules for a in actions), default=0)
    microbatches = 1 + max((a.microbatch for actions in schedules for a in actions), default=0)
    last_stage = pp * chunks - 1
    _match_messages(schedules, chunks, microbatches)

    arrival: dict[int, float] = {}  # message tag -> time the receiver can have it
    clock, busy, stash, peak = [0.0] * pp, [0.0] * pp, [0] * pp, [0] * pp
    done: list[set[tuple[str, int, int]]] = [set() for _ in range(pp)]  # (kind, mb, chunk)
    events: list[list[Event]] = [[] for _ in range(pp)]
    position = [0] * pp

    def run(rank: int, action: Action) -> None:
        """Check the action's data dependencies on `rank`, then advance that rank's clock."""
        stage, key = stage_of(rank, action.chunk, pp), (action.microbatch, action.chunk)
        needs = {Kind.FORWARD: [Kind.RECV_ACT] if stage > 0 else [], Kind.SEND_ACT: [Kind.FORWARD],
                 Kind.BACKWARD: [Kind.FORWARD] + ([Kind.RECV_GRAD] if stage < last_stage else []),
                 Kind.SEND_GRAD: [Kind.BACKWARD]}.get(action.kind, [])
        for need in needs:
            if (need, *key) not in done[rank]:
                raise ScheduleError(f"rank {rank}: {action} comes before its {need}")
        if (action.kind, *key) in done[rank]:
            raise ScheduleError(f"rank {rank}: {action} is duplicated")
        done[rank].add((action.kind, *key))
        start = clock[rank]
        if action.kind in COMPUTE:
            forward = action.kind == Kind.FORWARD
            clock[rank] += (t_forward if forward else t_backward) / chunks
            busy[rank] += clock[rank] - start
            stash[rank] += 1 if forward else -1
            peak[rank] = max(peak[rank], stash[rank])
        elif action.kind in SENDS:
            arrival[message_tag(action, pp, chunks, microbatches)] = start + t_comm
        else:
            clock[rank] = max(start, arrival[message_tag(action, pp, chunks, microbatches)])
        events[rank].append(Event(action, start, clock[rank]))

    # Ranks never wait on sends, so running each rank as far as it can, round after round,
    # gives the same times as a real event order; a round with no progress is a deadlock.
    while any(position[r] < len(schedules[r]) for r in range(pp)):
        progressed = False
        for rank in range(pp):
            while position[rank] < len(schedules[rank]):
                action = schedules[rank][position[rank]]
                if action.kind in RECVS and message_tag(action, pp, chunks, microbatches) not in arrival:
                    break  # its send has not been issued yet
                run(rank, action)
                position[rank] += 1
                progressed = True
        if not progressed:
            stuck = [f"rank {r} at {schedules[r][position[r]]}" for r in range(pp)
                     if position[r] < len(schedules[r])]
            raise ScheduleError("deadlock: " + "; ".join(stuck))

    for rank in range(pp):
        for kind in COMPUTE:
            missing = [(mb, c) for mb in range(microbatches) for c in range(chunks)
                       if (kind, mb, c) not in done[rank]]
            if missing:
                raise ScheduleError(f"rank {rank}: no {kind} for (microbatch, chunk) {missing}")
    makespan = max(clock)
    return SimResult(makespan, busy, [1 - b / makespan if makespan else 0.0 for b in busy], peak, events)


def message_groups(actions: Sequence[Action]) -> list[list[Action]]:
    """A rank's actions as the executor issues them: a send together with the recv that follows
    it (one NCCL group: both progress at once), every other action alone."""
    groups: list[list[Action]] = []
    for action in actions:
        if action.kind in RECVS and groups and len(groups[-1]) == 1 and groups[-1][0].kind in SENDS:
            groups[-1].append(action)
        else:
            groups.append([action])
    return groups


def check_in_order_transport(schedules: list[list[Action]], grouped: bool = True) -> None:
    """Raise ScheduleError if the schedule can deadlock on NCCL-like point-to-point messages.

    NCCL matches messages in posting order on one stream per communicator, and a send does not
    finish before its receiver has reached the matching recv; everything queued behind waits.
    So rank A posting [send to B, recv from B] while B posts [send to A, recv from A] hangs,
    where MPI's tagged non-blocking sends would not. Model: each rank's host walks its actions
    (`message_groups` when `grouped`, else one action at a time), posts messages to its stream
    and waits only for receives; the head group of every stream is active, and an active
    message completes when its counterpart is active on the peer.
    """
    pp = len(schedules)
    chunks = 1 + max((a.chunk for actions in schedules for a in actions), default=0)
    microbatches = 1 + max((a.microbatch for actions in schedules for a in actions), default=0)
    units = [message_groups(a) if grouped else [[x] for x in a] for a in schedules]
    host = [0] * pp                                   # next unit each host issues
    waiting: list[int | None] = [None] * pp           # stream index of the group a host waits for
    streams: list[list[set]] = [[] for _ in range(pp)]  # per rank: posted groups of message tags
    popped = [0] * pp                                 # groups already finished on each stream

    def tag(action: Action) -> int:
        return message_tag(action, pp, chunks, microbatches)

    owner = {}  # tag -> (sending rank, receiving rank)
    for rank, actions in enumerate(schedules):
        for a in actions:
            if a.kind in SENDS:
                owner[tag(a)] = (rank, a.peer)
    while True:
        progressed = False
        for rank in range(pp):  # hosts run until they wait for a receive
            while waiting[rank] is None and host[rank] < len(units[rank]):
                unit = [a for a in units[rank][host[rank]] if a.kind not in COMPUTE]
                host[rank] += 1
                progressed = True
                if unit:
                    streams[rank].append({(a.kind in SENDS, tag(a)) for a in unit})
                    if any(a.kind in RECVS for a in unit):
                        waiting[rank] = popped[rank] + len(streams[rank]) - 1
        heads = [s[0] if s else set() for s in streams]
        done = set()
        for rank in range(pp):
            for is_send, t in heads[rank]:
                sender, receiver = owner[t]
                peer = receiver if is_send else sender
                if (not is_send, t) in heads[peer]:
                    done.add((rank, is_send, t))
        for rank, is_send, t in done:
            heads[rank].discard((is_send, t))
            progressed = True
        for rank in range(pp):
            if streams[rank] and not streams[rank][0]:
                streams[rank].pop(0)
                popped[rank] += 1
                if waiting[rank] is not None and popped[rank] > waiting[rank]:
                    waiting[rank] = None
        if all(host[r] == len(units[r]) and not streams[r] for r in range(pp)):
            return
        if not progressed:
            stuck = [f"rank {r} at {units[r][host[r] - 1][-1] if host[r] else 'start'}" for r in range(pp)
                     if streams[r]]
            raise ScheduleError("deadlock with in-order point-to-point messages (NCCL): " + "; ".join(stuck))


def in_order_safe(schedules: list[list[Action]]) -> bool:
    """Whether `check_in_order_transport` finds no deadlock (GPU arrays may then use NCCL)."""
    try:
        check_in_order_transport(schedules)
    except ScheduleError:
        return False
    return True


def predict_step_time(name: str, pp: int, microbatches: int, chunks: int, t_forward: float,
                      t_backward: float, t_comm: float = 0.0) -> float:
    """Simulated step time of a schedule, given one microbatch's forward/backward time per rank
    (all of a rank's chunks together) and the time of one point-to-point message."""
    return simulate(build(name, pp, microbatches, chunks), t_forward, t_backward, t_comm).makespan
