"""The pipeline-schedule simulator: replays `schedules.build`'s action lists in virtual time, without MPI.

`simulate` runs every rank's actions as the executor would (Isends never block, a recv waits for
its send plus t_comm) and checks them on the way: matched and well-addressed messages, data
dependencies, every forward and backward exactly once. It returns a `SimResult`: the makespan,
each rank's busy time and bubble, and the peak of stashed chunk activations. `Timeline` compiles
one schedule's execution order once and replays it for many costs (bitwise `simulate`'s makespan;
the planner's inner loop). `check_in_order_transport` asks whether the lists can deadlock on
NCCL-like in-order point-to-point messages (`message_groups`: what the executor posts together).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from hpcpar.parallel.pp.schedules import (
    COMPUTE, RECVS, SENDS, Action, Kind, Placement, ScheduleError, build, message_tag, placement,
)


class Event(NamedTuple):
    """When one action ran on its rank; a recv starts when it begins waiting."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What one simulated step did. Lists are indexed by pipeline rank.

    bubble_per_rank[r] = 1 - busy[r] / makespan (busy = forward + backward + weight time only);
    `bubble` is their mean, `idle` the mean idle seconds. peak_stash[r] counts activations held
    from a forward until its weight pass (its backward when it has none), in chunk activations;
    `peak_memory` in micro-batches of the rank's whole share of layers (peak_stash / chunks).
    """

    makespan: float
    busy: list[float]
    bubble_per_rank: list[float]
    peak_stash: list[int]
    events: list[list[Event]]
    chunks: int = 1

    @property
    def bubble(self) -> float:
        return sum(self.bubble_per_rank) / len(self.bubble_per_rank)

    @property
    def idle(self) -> float:
        """Mean idle time per rank: makespan - busy (the bubble in seconds, not as a fraction)."""
        return self.makespan - sum(self.busy) / len(self.busy)

    @property
    def peak_memory(self) -> list[float]:
        return [s / self.chunks for s in self.peak_stash]


def _infer_placement(schedules: list[list[Action]], placement: Placement | None) -> Placement:
    chunks = 1 + max((a.chunk for actions in schedules for a in actions), default=0)
    if placement is None:
        return Placement(len(schedules), chunks)
    if placement.pp != len(schedules) or placement.chunks < chunks:
        raise ScheduleError(f"{len(schedules)} ranks with chunks up to {chunks - 1} do not fit {placement}")
    return placement


def _expected_peer(rank: int, action: Action, place: Placement) -> int:
    """The peer a send/recv must name; raises if the stage has no such neighbour, or it is local."""
    downward = action.kind in (Kind.RECV_ACT, Kind.SEND_GRAD)  # talks to the previous stage
    other = place.neighbour(rank, action.chunk, -1 if downward else +1)
    if other is None:
        raise ScheduleError(f"rank {rank}: {action} on virtual stage {place.stage(rank, action.chunk)}, which has "
                            f"no {'previous' if downward else 'next'} stage")
    if other[0] == rank:
        raise ScheduleError(f"rank {rank}: {action} moves what stays on this rank (chunk {other[1]} holds the "
                            f"{'previous' if downward else 'next'} stage)")
    return other[0]


def _match_messages(schedules: list[list[Action]], place: Placement, microbatches: int) -> None:
    """Every send/recv names the right peer, and every send meets exactly one recv."""
    sends: dict[int, tuple[int, Action]] = {}
    recvs: dict[int, tuple[int, Action]] = {}
    for rank, actions in enumerate(schedules):
        for action in actions:
            if action.kind in COMPUTE:
                continue
            expected = _expected_peer(rank, action, place)
            if action.peer != expected:
                raise ScheduleError(f"rank {rank}: {action} names the wrong peer; expected {expected}")
            side = sends if action.kind in SENDS else recvs
            tag = message_tag(action, rank, place, microbatches)
            if tag in side:
                raise ScheduleError(f"rank {rank}: {action} duplicates {side[tag][1]} on rank {side[tag][0]}")
            side[tag] = (rank, action)
    for tag in recvs.keys() - sends.keys():
        raise ScheduleError(f"rank {recvs[tag][0]}: {recvs[tag][1]} has no matching send")
    for tag in sends.keys() - recvs.keys():
        raise ScheduleError(f"rank {sends[tag][0]}: {sends[tag][1]} is never received")


def simulate(schedules: list[list[Action]], t_forward: float = 1.0, t_backward: float = 2.0,
             t_comm: float = 0.0, t_weight: float = 0.0, placement: Placement | None = None) -> SimResult:
    """Replay every rank's actions in virtual time, as the executor would run them with MPI.

    Costs are one microbatch's time through a rank's whole share of the model, whatever v: a
    forward of one chunk takes t_forward / chunks, a B (a backward followed by a weight action)
    t_backward / chunks, a W t_weight / chunks, and a whole backward (no weight action)
    (t_backward + t_weight) / chunks. Sends never block (they are Isends); a recv blocks until
    the matching send was issued, plus t_comm; a hand-over between two chunks of one rank is
    free. The number of chunks and microbatches is read off the actions; `placement` (default:
    the loop) says where the virtual stages are. Raises ScheduleError naming rank and action on
    deadlock, an unmatched or mis-addressed message, a backward before its forward, a weight
    pass before its backward, or a forward/backward missing or duplicated.
    """
    pp = len(schedules)
    place = _infer_placement(schedules, placement)
    chunks = place.chunks
    microbatches = 1 + max((a.microbatch for actions in schedules for a in actions), default=0)
    _match_messages(schedules, place, microbatches)
    split = [{(a.microbatch, a.chunk) for a in actions if a.kind == Kind.WEIGHT} for actions in schedules]

    arrival: dict[int, float] = {}  # message tag -> time the receiver can have it
    clock, busy, stash, peak = [0.0] * pp, [0.0] * pp, [0] * pp, [0] * pp
    done: list[set[tuple[str, int, int]]] = [set() for _ in range(pp)]  # (kind, mb, chunk)
    events: list[list[Event]] = [[] for _ in range(pp)]

    def tag(rank: int, action: Action) -> int:
        return message_tag(action, rank, place, microbatches)

    def run(rank: int, action: Action) -> None:
        """Check the action's data dependencies on `rank`, then advance that rank's clock."""
        key = (action.microbatch, action.chunk)
        _check_dependencies(rank, action, place, done[rank])
        done[rank].add((action.kind, *key))
        start = clock[rank]
        if action.kind in COMPUTE:
            if action.kind == Kind.FORWARD:
                cost, held = t_forward, 1
            elif action.kind == Kind.WEIGHT:
                cost, held = t_weight, -1
            else:
                deferred = key in split[rank]
                cost, held = (t_backward, 0) if deferred else (t_backward + t_weight, -1)
            clock[rank] += cost / chunks
            busy[rank] += clock[rank] - start
            stash[rank] += held
            peak[rank] = max(peak[rank], stash[rank])
        elif action.kind in SENDS:
            arrival[tag(rank, action)] = start + t_comm
        else:
            clock[rank] = max(start, arrival[tag(rank, action)])
        events[rank].append(Event(action, start, clock[rank]))

    for rank, action in _execution_order(schedules, tag):
        run(rank, action)
    _check_complete(done, microbatches, chunks)
    makespan = max(clock)
    return SimResult(makespan, busy, [1 - b / makespan if makespan else 0.0 for b in busy], peak, events, chunks)


def _check_dependencies(rank: int, action: Action, place: Placement, done: set[tuple[str, int, int]]) -> None:
    """Raise ScheduleError unless what `action` needs has run on `rank` (`done`: its (kind, mb,
    chunk) so far) and `action` itself has not: a forward its input (received, or handed over by
    the rank's previous chunk), a backward its forward and its output gradient, a send the compute
    that produced it, a weight pass its backward."""
    stage = place.stage(rank, action.chunk)
    needs: list[tuple[Kind, int]] = []  # (kind, chunk) done on this rank before
    if action.kind == Kind.FORWARD and stage > 0:
        below = place.local(rank, action.chunk, -1)
        needs = [(Kind.RECV_ACT, action.chunk) if below is None else (Kind.FORWARD, below)]
    elif action.kind == Kind.BACKWARD:
        needs = [(Kind.FORWARD, action.chunk)]
        if stage < place.stages - 1:
            above = place.local(rank, action.chunk, +1)
            needs.append((Kind.RECV_GRAD, action.chunk) if above is None else (Kind.BACKWARD, above))
    elif action.kind == Kind.SEND_ACT:
        needs = [(Kind.FORWARD, action.chunk)]
    elif action.kind in (Kind.SEND_GRAD, Kind.WEIGHT):
        needs = [(Kind.BACKWARD, action.chunk)]
    for need, chunk in needs:
        if (need, action.microbatch, chunk) not in done:
            what = need if chunk == action.chunk else f"{need} of chunk {chunk}"
            raise ScheduleError(f"rank {rank}: {action} comes before its {what}")
    if (action.kind, action.microbatch, action.chunk) in done:
        raise ScheduleError(f"rank {rank}: {action} is duplicated")


def _check_complete(done: list[set[tuple[str, int, int]]], microbatches: int, chunks: int) -> None:
    """Raise ScheduleError unless every rank ran a forward and a backward of every (mb, chunk)."""
    for rank, ran in enumerate(done):
        for kind in (Kind.FORWARD, Kind.BACKWARD):
            missing = [(mb, c) for mb in range(microbatches) for c in range(chunks) if (kind, mb, c) not in ran]
            if missing:
                raise ScheduleError(f"rank {rank}: no {kind} for (microbatch, chunk) {missing}")


def _execution_order(schedules: list[list[Action]], tag: Callable[[int, Action], int]):
    """(rank, action) in the order `simulate` runs them. Ranks never wait on sends, so running
    each rank as far as it can, round after round, gives the same times as a real event order:
    a recv runs once its send has; a round with no progress is a deadlock (ScheduleError)."""
    pp = len(schedules)
    position, sent = [0] * pp, set()
    while any(position[r] < len(schedules[r]) for r in range(pp)):
        progressed = False
        for rank in range(pp):
            while position[rank] < len(schedules[rank]):
                action = schedules[rank][position[rank]]
                if action.kind in RECVS and tag(rank, action) not in sent:
                    break  # its send has not been issued yet
                if action.kind in SENDS:
                    sent.add(tag(rank, action))
                yield rank, action
                position[rank] += 1
                progressed = True
        if not progressed:
            stuck = [f"rank {r} at {schedules[r][position[r]]}" for r in range(pp)
                     if position[r] < len(schedules[r])]
            raise ScheduleError("deadlock: " + "; ".join(stuck))


class Timeline:
    """`simulate`'s makespan of one schedule, compiled once and then evaluated for many costs.

    The planner times thousands of layouts that share a few schedule shapes and differ only in
    their F, B, W and message times. Compiling keeps the order `simulate` runs the actions in, as
    (rank, op, slot) triples; `makespan` replays it with the same additions in the same order, so
    it equals `simulate(...).makespan` bitwise at a small fraction of the cost. `peak_stash` is
    `simulate`'s too: it depends on each rank's order alone, not on the times. Unlike `simulate`,
    compiling trusts the schedule's data dependencies (`build`'s schedules: the tests simulate
    them); a deadlock still raises ScheduleError.
    """

    _FORWARD, _BACKWARD, _WHOLE_BACKWARD, _WEIGHT, _SEND, _RECV = range(6)
    _STASH = (1, 0, -1, -1, 0, 0)    # chunk activations an op adds to its rank's stash

    def __init__(self, schedules: list[list[Action]], placement: Placement | None = None):
        place = _infer_placement(schedules, placement)
        microbatches = 1 + max((a.microbatch for actions in schedules for a in actions), default=0)
        split = [{(a.microbatch, a.chunk) for a in actions if a.kind == Kind.WEIGHT} for actions in schedules]
        slots: dict[int, int] = {}
        program = []
        for rank, action in _execution_order(schedules, lambda r, a: message_tag(a, r, place, microbatches)):
            if action.kind == Kind.FORWARD:
                op, slot = self._FORWARD, 0
            elif action.kind == Kind.WEIGHT:
                op, slot = self._WEIGHT, 0
            elif action.kind == Kind.BACKWARD:
                deferred = (action.microbatch, action.chunk) in split[rank]
                op, slot = (self._BACKWARD if deferred else self._WHOLE_BACKWARD), 0
            else:
                op = self._SEND if action.kind in SENDS else self._RECV
                slot = slots.setdefault(message_tag(action, rank, place, microbatches), len(slots))
            program.append((rank, op, slot))
        self.pp, self.chunks, self.messages, self.program = len(schedules), place.chunks, len(slots), program
        stash, peak = [0] * self.pp, [0] * self.pp
        for rank, op, _ in program:
            stash[rank] += self._STASH[op]
            peak[rank] = max(peak[rank], stash[rank])
        self.peak_stash = tuple(peak)

    def makespan(self, t_forward: float = 1.0, t_backward: float = 2.0, t_comm: float = 0.0,
                 t_weight: float = 0.0) -> float:
        """`simulate(schedules, t_forward, t_backward, t_comm, t_weight).makespan`."""
        v = self.chunks
        cost = (t_forward / v, t_backward / v, (t_backward + t_weight) / v, t_weight / v)
        clock, arrival = [0.0] * self.pp, [0.0] * self.messages
        send = self._SEND
        for rank, op, slot in self.program:
            if op < send:
                clock[rank] += cost[op]
            elif op == send:
                arrival[slot] = clock[rank] + t_comm
            elif arrival[slot] > clock[rank]:
                clock[rank] = arrival[slot]
        return max(clock)


@functools.lru_cache(maxsize=256)
def timeline(name: str, pp: int, microbatches: int, chunks: int = 0) -> Timeline:
    """Schedule `name`'s `Timeline`, built and compiled once per shape (the planner and the
    memory estimate ask for the same few shapes thousands of times)."""
    place = placement(name, pp, chunks)
    return Timeline(build(name, pp, microbatches, place.chunks), place)


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


def check_in_order_transport(schedules: list[list[Action]], grouped: bool = True,
                             placement: Placement | None = None) -> None:
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
    place = _infer_placement(schedules, placement)
    microbatches = 1 + max((a.microbatch for actions in schedules for a in actions), default=0)
    units = [message_groups(a) if grouped else [[x] for x in a] for a in schedules]
    host = [0] * pp                                   # next unit each host issues
    waiting: list[int | None] = [None] * pp           # stream index of the group a host waits for
    streams: list[list[set]] = [[] for _ in range(pp)]  # per rank: posted groups of message tags
    popped = [0] * pp                                 # groups already finished on each stream

    def tag(rank: int, action: Action) -> int:
        return message_tag(action, rank, place, microbatches)

    owner = {}  # tag -> (sending rank, receiving rank)
    for rank, actions in enumerate(schedules):
        for a in actions:
            if a.kind in SENDS:
                owner[tag(rank, a)] = (rank, a.peer)
    while True:
        progressed = False
        for rank in range(pp):  # hosts run until they wait for a receive
            while waiting[rank] is None and host[rank] < len(units[rank]):
                unit = [a for a in units[rank][host[rank]] if a.kind not in COMPUTE]
                host[rank] += 1
                progressed = True
                if unit:
                    streams[rank].append({(a.kind in SENDS, tag(rank, a)) for a in unit})
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


def in_order_safe(schedules: list[list[Action]], placement: Placement | None = None) -> bool:
    """Whether `check_in_order_transport` finds no deadlock (GPU arrays may then use NCCL)."""
    try:
        check_in_order_transport(schedules, placement=placement)
    except ScheduleError:
        return False
    return True


def predict_step_time(name: str, pp: int, microbatches: int, chunks: int, t_forward: float,
                      t_backward: float, t_comm: float = 0.0, t_weight: float = 0.0) -> float:
    """Simulated step time of a schedule, given one microbatch's forward, B and W times per rank
    (all of a rank's chunks together; a schedule without weight actions runs B + W as one
    backward) and the time of one point-to-point message."""
    return simulate(build(name, pp, microbatches, chunks), t_forward, t_backward, t_comm, t_weight,
                    placement(name, pp, chunks)).makespan
