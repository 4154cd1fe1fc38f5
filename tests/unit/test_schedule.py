"""Pipeline schedules: structure, simulated bubble and stash against the formulas, and proof
that the simulator rejects broken schedules."""

import itertools
import random

import pytest

from hpcpar.errors import ConfigError
from hpcpar.parallel.pp.schedules import (
    RECVS, SENDS, Action, Placement, ScheduleError, build, gpipe, interleaved_1f1b, message_tag, one_f_one_b,
    placement, resolve_chunks, validate, zbh1, zbv,
)
from hpcpar.parallel.pp.simulate import (
    check_in_order_transport, in_order_safe, message_groups, predict_step_time, simulate, timeline,
)

ALL = ["gpipe", "1f1b", "interleaved", "zbh1", "zbv"]


def valid_cases(name):
    """Every (pp, m, chunks) with pp in 1..8, m in 1..16, chunks in 1..4 that `name` accepts
    (chunks resolved: zbv's fixed 2 once)."""
    seen = set()
    for pp, m, v in itertools.product(range(1, 9), range(1, 17), range(0, 5)):
        try:
            validate(name, pp, m, v)
        except ConfigError:
            continue
        case = (pp, m, resolve_chunks(name, v))
        if case not in seen:
            seen.add(case)
            yield case


def sim(name, pp, m, v, **costs):
    return simulate(build(name, pp, m, v), placement=placement(name, pp, v), **costs)


def interleaved_warmup(r, p, m, v):
    """Megatron's warm-up forwards on rank r (arXiv 2104.04473 / Megatron-LM)."""
    return min(2 * (p - r - 1) + (v - 1) * p, v * m)


# ---------------------------------------------------------------- structure of the lists


@pytest.mark.parametrize("name", ALL)
def test_each_rank_computes_every_microbatch_chunk_once(name):
    for pp, m, v in valid_cases(name):
        for rank, actions in enumerate(build(name, pp, m, v)):
            for kind in ("forward", "backward") + (("weight",) if name.startswith("zb") else ()):
                done = sorted((a.microbatch, a.chunk) for a in actions if a.kind == kind)
                assert done == sorted(itertools.product(range(m), range(v))), (name, pp, m, v, rank, kind)
            if not name.startswith("zb"):
                assert not any(a.kind == "weight" for a in actions)


@pytest.mark.parametrize("name", ALL)
def test_each_chunk_runs_its_microbatches_in_order(name):
    """Per chunk, forwards, backwards and weight passes go micro-batch by micro-batch: every
    parameter accumulates its m gradients in the order 1F1B does (bitwise the same sums)."""
    for pp, m, v in valid_cases(name):
        for actions in build(name, pp, m, v):
            for kind, chunk in itertools.product(("forward", "backward", "weight"), range(v)):
                mbs = [a.microbatch for a in actions if a.kind == kind and a.chunk == chunk]
                assert mbs == sorted(mbs), (name, pp, m, v, kind, chunk)


@pytest.mark.parametrize("name", ALL)
def test_recv_right_before_and_send_right_after_their_compute(name):
    """The executor's contract: never wait before sending what is ready."""
    for pp, m, v in valid_cases(name):
        for actions in build(name, pp, m, v):
            for i, a in enumerate(actions):
                if a.kind.startswith("recv"):
                    nxt = actions[i + 1]
                    assert (nxt.kind, nxt.microbatch, nxt.chunk) == (
                        "forward" if a.kind == "recv_act" else "backward", a.microbatch, a.chunk)
                if a.kind.startswith("send"):
                    prev = actions[i - 1]
                    assert (prev.kind, prev.microbatch, prev.chunk) == (
                        "forward" if a.kind == "send_act" else "backward", a.microbatch, a.chunk)


@pytest.mark.parametrize("name", ALL)
def test_message_tags_match_between_sender_and_receiver_and_are_unique(name):
    for pp, m, v in valid_cases(name):
        schedules, place = build(name, pp, m, v), placement(name, pp, v)
        sent = []
        for rank, actions in enumerate(schedules):
            for a in (a for a in actions if a.kind.startswith("send")):
                stage = place.stage(rank, a.chunk)
                to_rank, to_chunk = place.holder(stage + 1 if a.kind == "send_act" else stage - 1)
                assert a.peer == to_rank != rank
                want = Action("recv_act" if a.kind == "send_act" else "recv_grad", a.microbatch, to_chunk, rank)
                assert want in schedules[a.peer], (name, pp, m, v, rank, a)
                tag = message_tag(a, rank, place, m)
                assert tag == message_tag(want, a.peer, place, m)
                assert 0 <= tag < 2 * (pp * v - 1) * m
                sent.append(tag)
        local = sum(place.local(r, c, +1) is not None for r in range(pp) for c in range(v))  # ZB-V's turn
        assert len(sent) == len(set(sent)) == 2 * (pp * v - 1 - local) * m


def test_placements():
    loop, vee = Placement(4, 2), Placement(4, 2, "v")
    assert [loop.stage(r, c) for c in (0, 1) for r in range(4)] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [vee.stage(r, c) for c in (0, 1) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    for place in (loop, vee):
        assert all(place.holder(place.stage(r, c)) == (r, c) for r in range(4) for c in (0, 1))
    assert vee.local(3, 0, +1) == 1 and vee.local(3, 1, -1) == 0 and vee.local(2, 0, +1) is None
    assert vee.neighbour(0, 1, +1) is None and vee.neighbour(0, 0, -1) is None
    assert loop.local(3, 0, +1) is None and loop.neighbour(3, 0, +1) == (0, 1)
    assert placement("zbv", 4) == vee and placement("interleaved", 4, 2) == loop
    assert placement("1f1b", 4) == Placement(4)


def test_pp1_orders():
    f, b = (lambda mb: Action("forward", mb)), (lambda mb: Action("backward", mb))
    assert one_f_one_b(1, 3) == [[f(0), b(0), f(1), b(1), f(2), b(2)]]
    assert gpipe(1, 3) == [[f(0), f(1), f(2), b(0), b(1), b(2)]]


def test_zb_orders_on_one_rank_and_zbh1_is_1f1b_with_late_weights():
    f, b, w = (lambda mb: Action("forward", mb)), (lambda mb: Action("backward", mb)), (lambda mb: Action("weight", mb))
    assert zbh1(1, 2) == [[f(0), b(0), w(0), f(1), b(1), w(1)]]
    for pp, m in itertools.product(range(1, 9), range(1, 17)):
        for rank, (zb, base) in enumerate(zip(zbh1(pp, m), one_f_one_b(pp, m))):
            assert [a for a in zb if a.kind != "weight"] == base
            computes = [(a.kind, a.microbatch) for a in zb if a.kind in ("backward", "weight")]
            for k in range(m):  # W(k) right after B(k + rank) (or after the last B)
                i = computes.index(("weight", k))
                assert computes[i - 1] == ("backward", min(k + rank, m - 1)) or computes[i - 1][0] == "weight"


def test_1f1b_warmup_and_interleaved_with_one_chunk_is_1f1b():
    schedules = one_f_one_b(4, 8)
    for rank, actions in enumerate(schedules):
        computes = [a.kind[0] for a in actions if a.kind in ("forward", "backward")]
        warmup = 4 - rank - 1
        assert computes[:warmup + 2] == ["f"] * (warmup + 1) + ["b"]
    for pp, m in itertools.product(range(1, 9), range(1, 17)):
        assert interleaved_1f1b(pp, m, 1) == one_f_one_b(pp, m)


# ---------------------------------------------------------------- simulated bubble and stash


@pytest.mark.parametrize("t_backward, t_weight", [(2.0, 0.0), (1.0, 0.0), (1.0, 1.0), (1.5, 0.5)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_bubble_and_step_time_match_formulas(name, t_backward, t_weight):
    """Without weight actions a backward costs t_backward + t_weight (B and W as one)."""
    t_b = t_backward + t_weight
    for pp, m, v in valid_cases(name):
        res = simulate(build(name, pp, m, v), t_forward=1.0, t_backward=t_backward, t_weight=t_weight)
        assert res.busy == pytest.approx([m * (1.0 + t_b)] * pp)
        assert res.makespan == pytest.approx((m + (pp - 1) / v) * (1.0 + t_b)), (pp, m, v)
        assert res.bubble == pytest.approx((pp - 1) / (v * m + pp - 1)), (pp, m, v)
        assert res.bubble_per_rank == pytest.approx([res.bubble] * pp)


@pytest.mark.parametrize("t_f, t_b, t_w", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.0, 0.5)])
def test_zbh1_step_time_matches_the_paper(t_f, t_b, t_w):
    """ZB-H1 (arXiv 2401.10241, section 3.1): m (F + B + W) + (p - 1)(F + B - W) for m >= p
    (W <= F, B); at F = B = W the bubble time is a third of 1F1B's (p - 1)(F + B + W)."""
    for pp, m, _ in valid_cases("zbh1"):
        res = sim("zbh1", pp, m, 1, t_forward=t_f, t_backward=t_b, t_weight=t_w)
        assert res.busy == pytest.approx([m * (t_f + t_b + t_w)] * pp)
        if m >= pp:
            assert res.makespan == pytest.approx(m * (t_f + t_b + t_w) + (pp - 1) * (t_f + t_b - t_w)), (pp, m)
        one_f = sim("1f1b", pp, m, 1, t_forward=t_f, t_backward=t_b, t_weight=t_w)
        assert res.makespan <= one_f.makespan + 1e-12
        if t_f == t_b == t_w and m >= pp:
            assert res.idle == pytest.approx(one_f.idle / 3)


def test_zbv_bubble_is_near_zero_at_1f1b_memory():
    """ZB-V at F = B = W never holds more than 1F1B's peak; from m = 2p on it idles at most half
    as long as 1F1B, and at p = 4, m = 8 and 16 (the bench's cases) only the fill of the first
    forward through chunk 0, (p - 1) F / 2: a sixth of 1F1B's idle time."""
    for pp, m, _ in valid_cases("zbv"):
        res, one_f = sim("zbv", pp, m, 2, t_weight=1.0, t_backward=1.0), sim("1f1b", pp, m, 1, t_weight=1.0,
                                                                           t_backward=1.0)
        assert res.busy == pytest.approx([3.0 * m] * pp)
        assert max(res.peak_memory) <= max(one_f.peak_memory), (pp, m)  # p micro-batches' activations
        assert res.makespan <= one_f.makespan, (pp, m)
        if m >= 2 * pp:
            assert res.idle <= one_f.idle / 2, (pp, m, res.idle)
    for m in (8, 16):
        res, one_f = sim("zbv", 4, m, 2, t_weight=1.0, t_backward=1.0), sim("1f1b", 4, m, 1, t_weight=1.0,
                                                                          t_backward=1.0)
        assert res.idle == pytest.approx(1.5) and res.idle == pytest.approx(one_f.idle / 6)
        assert res.bubble <= 0.22 * one_f.bubble
        assert sim("zbh1", 4, m, 1, t_weight=1.0, t_backward=1.0).idle == pytest.approx(one_f.idle / 3)


@pytest.mark.parametrize("name", ALL)
def test_peak_stash(name):
    for pp, m, v in valid_cases(name):
        peak = sim(name, pp, m, v).peak_stash
        if name == "gpipe":
            assert peak == [m] * pp
        elif name == "1f1b":
            assert peak == [min(pp - r, m) for r in range(pp)]
            assert max(peak) <= pp
        elif name == "interleaved" and v > 1:
            assert peak == [min(interleaved_warmup(r, pp, m, v) + 1, v * m) for r in range(pp)]
        elif name == "zbh1":  # held until W: 1F1B's rank-0 peak on every rank
            assert peak == [min(pp, m)] * pp
        elif name == "zbv":
            assert max(peak) <= 2 * pp and max(peak) <= 2 * m


@pytest.mark.parametrize("name", ALL)
def test_a_compiled_timeline_is_the_simulator_bitwise(name):
    """The planner's `timeline(...).makespan` replays `simulate`'s order: the same floats for any
    costs, and the same peak stash."""
    rng = random.Random(name)
    for pp, m, v in valid_cases(name):
        schedules, place = build(name, pp, m, v), placement(name, pp, v)
        compiled = timeline(name, pp, m, v)
        assert compiled.peak_stash == tuple(simulate(schedules, placement=place).peak_stash)
        costs = [rng.uniform(0.1, 3.0) for _ in range(3)] + [rng.choice([0.0, rng.uniform(0.1, 2.0)])]
        t_f, t_b, t_w, t_comm = costs[0], costs[1], costs[3] if name.startswith("zb") else 0.0, costs[2] * (pp > 1)
        expected = simulate(schedules, t_f, t_b, t_comm, t_w, placement=place).makespan
        assert compiled.makespan(t_f, t_b, t_comm, t_w) == expected, (pp, m, v)


def test_interleaving_shrinks_the_bubble():
    for pp, m, v in valid_cases("interleaved"):
        if v > 1 and pp > 1:
            assert simulate(interleaved_1f1b(pp, m, v)).bubble < simulate(one_f_one_b(pp, m)).bubble


@pytest.mark.parametrize("name", ["interleaved", "zbv"])
def test_events_are_sequential_per_rank(name):
    res = sim(name, 4, 8, 2, t_forward=1.0, t_backward=2.0, t_comm=0.1, t_weight=0.6)
    whole = 1.3 if name == "interleaved" else 1.0  # B + W as one, or B alone (W: 0.3)
    for events in res.events:
        for e in events:
            if e.action.kind in ("forward", "backward", "weight"):  # per chunk: t / v
                want = {"forward": 0.5, "backward": whole, "weight": 0.3}[e.action.kind]
                assert e.end - e.start == pytest.approx(want)
            else:
                assert e.end >= e.start
        assert all(a.end <= b.start + 1e-12 for a, b in zip(events, events[1:]))
        assert events[-1].end <= res.makespan


def test_comm_time_on_a_single_microbatch():
    """m = 1 is a pure chain: p forwards, p backwards and 2 (p - 1) messages."""
    for pp in range(1, 9):
        for name in ("gpipe", "1f1b"):
            t = predict_step_time(name, pp, 1, 1, t_forward=1.0, t_backward=2.0, t_comm=0.25)
            assert t == pytest.approx(pp * 3.0 + 2 * (pp - 1) * 0.25)


def test_predict_step_time():
    assert predict_step_time("1f1b", 4, 8, 1, 0.1, 0.2) == pytest.approx((8 + 3) * 0.3)
    assert predict_step_time("interleaved", 4, 8, 2, 0.1, 0.2) == pytest.approx((8 + 1.5) * 0.3)
    assert predict_step_time("1f1b", 4, 8, 1, 0.1, 0.2, t_comm=0.01) > (8 + 3) * 0.3
    assert predict_step_time("1f1b", 4, 8, 1, 0.1, 0.1, t_weight=0.1) == pytest.approx((8 + 3) * 0.3)
    assert predict_step_time("zbh1", 4, 8, 1, 0.1, 0.1, t_weight=0.1) == pytest.approx(8 * 0.3 + 3 * 0.1)
    assert predict_step_time("zbv", 4, 8, 0, 0.1, 0.1, t_weight=0.1) == pytest.approx(8 * 0.3 + 3 * 0.05)


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize("args, words", [
    (("interleaved", 4, 6, 2), ["train.microbatches (6)", "multiple of mesh.pp (4)"]),
    (("interleaved", 1, 4, 2), ["mesh.pp >= 2"]),
    (("1f1b", 4, 8, 2), ["pipeline.chunks=1", "interleaved"]),
    (("zb", 4, 8, 1), ["pipeline.schedule='zb'", "gpipe, 1f1b, interleaved, zbh1, zbv"]),
    (("zbv", 4, 8, 3), ["zbv runs 2 chunks per rank (a V)", "leave pipeline.chunks unset (0) or 2"]),
    (("zbv", 1, 8, 0), ["zbv needs mesh.pp >= 2"]),
    (("zbh1", 4, 8, 2), ["pipeline.chunks=1"]),
    (("gpipe", 4, 0, 1), ["train.microbatches=0"]),
])
def test_validate_explains(args, words):
    with pytest.raises(ConfigError) as err:
        build(*args)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_fewer_microbatches_than_stages_works():
    for name in ("gpipe", "1f1b"):
        validate(name, 8, 3, 1)
        assert simulate(build(name, 8, 3, 1)).bubble == pytest.approx(7 / 10)


# ---------------------------------------------------------------- the simulator can fail


def _find(actions, kind, mb=None):
    return next(i for i, a in enumerate(actions) if a.kind == kind and mb in (None, a.microbatch))


def test_detects_deadlock():
    schedules = one_f_one_b(4, 8)
    r0 = schedules[0]
    i, j = _find(r0, "send_act"), _find(r0, "recv_grad")
    r0[i], r0[j] = r0[j], r0[i]  # rank 0 waits for a gradient of an activation it has not sent
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 at recv_grad\(mb=0"):
        simulate(schedules)


def test_detects_dropped_send_and_recv():
    schedules = gpipe(3, 4)
    del schedules[1][_find(schedules[1], "send_act", 2)]
    with pytest.raises(ScheduleError, match=r"rank 2: recv_act\(mb=2.*has no matching send"):
        simulate(schedules)
    schedules = gpipe(3, 4)
    del schedules[0][_find(schedules[0], "recv_grad", 1)]
    with pytest.raises(ScheduleError, match=r"rank 1: send_grad\(mb=1.*never received"):
        simulate(schedules)


def test_detects_weight_before_backward_and_messages_inside_a_rank():
    schedules = zbh1(2, 2)
    last = schedules[1]
    i, j = _find(last, "backward", 0), _find(last, "weight", 0)
    last.insert(i, last.pop(j))
    with pytest.raises(ScheduleError, match=r"rank 1: weight\(mb=0.*before its backward"):
        simulate(schedules)
    schedules = zbv(2, 2)  # rank 1 hands chunk 0's output to its chunk 1: no message may cross
    schedules[1].insert(0, Action("send_act", 0, 0, peer=0))
    with pytest.raises(ScheduleError, match="rank 1: send_act.*stays on this rank"):
        simulate(schedules, placement=placement("zbv", 2))
    schedules = zbv(2, 2)
    i, j = _find(schedules[1], "forward", 0), _find(schedules[1], "forward", 1)
    k = next(k for k, a in enumerate(schedules[1]) if a.kind == "forward" and a.chunk == 1)
    schedules[1].insert(0, schedules[1].pop(k))  # chunk 1's forward before the chunk 0 one it takes over
    with pytest.raises(ScheduleError, match="before its forward of chunk 0"):
        simulate(schedules, placement=placement("zbv", 2))


def test_detects_backward_before_forward():
    schedules = one_f_one_b(2, 2)
    last = schedules[1]
    i, j = _find(last, "forward", 0), _find(last, "backward", 0)
    last[i], last[j] = last[j], last[i]
    with pytest.raises(ScheduleError, match=r"rank 1: backward\(mb=0.*before its forward"):
        simulate(schedules)


def test_detects_missing_and_duplicated_compute():
    schedules = one_f_one_b(1, 3)
    with pytest.raises(ScheduleError, match=r"rank 0: no forward for .*\[\(1, 0\)\]"):
        simulate([[a for a in schedules[0] if a.microbatch != 1]])
    with pytest.raises(ScheduleError, match=r"rank 0: forward\(mb=0, chunk=0\) is duplicated"):
        simulate([[Action("forward", 0)] + schedules[0]])


def test_detects_wrong_peer_and_impossible_messages():
    schedules = one_f_one_b(4, 4)
    i = _find(schedules[1], "send_act")
    schedules[1][i] = Action("send_act", schedules[1][i].microbatch, 0, peer=3)
    with pytest.raises(ScheduleError, match=r"rank 1: send_act\(mb=0.*wrong peer; expected 2"):
        simulate(schedules)
    schedules = one_f_one_b(4, 4)
    schedules[0].insert(0, Action("recv_act", 0, 0, peer=3))
    with pytest.raises(ScheduleError, match="rank 0: recv_act.*no previous stage"):
        simulate(schedules)


def test_action_checks_its_fields():
    with pytest.raises(ValueError):
        Action("fwd", 0)
    with pytest.raises(ValueError):
        Action("send_act", 0)
    with pytest.raises(ValueError):
        Action("forward", 0, peer=1)


def test_message_groups_join_a_send_with_the_next_receive_only():
    for actions in build("1f1b", 4, 8)[1], build("interleaved", 2, 4, 2)[0]:
        groups = message_groups(actions)
        assert [a for g in groups for a in g] == actions
        for g in groups:
            assert len(g) == 1 or (len(g) == 2 and g[0].kind in SENDS and g[1].kind in RECVS)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbh1", "zbv"])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
def test_grouped_messages_cannot_deadlock_on_an_in_order_transport(name, pp, m):
    check_in_order_transport(build(name, pp, m), placement=placement(name, pp))  # raises on a deadlock
    assert in_order_safe(build(name, pp, m), placement(name, pp))


def test_one_by_one_1f1b_would_deadlock_on_nccl():
    """1F1B posts "send activation, receive gradient" on one side of a boundary and "send
    gradient, receive activation" on the other: one at a time, NCCL's in-order matching hangs."""
    with pytest.raises(ScheduleError, match="deadlock with in-order point-to-point messages"):
        check_in_order_transport(build("1f1b", 2, 4), grouped=False)
    crossing = [[Action("send_act", 0, 0, 1), Action("recv_grad", 0, 0, 1)],
                [Action("send_grad", 0, 0, 0), Action("recv_act", 0, 0, 0)]]
    with pytest.raises(ScheduleError, match="rank 0 at .*rank 1 at"):
        check_in_order_transport(crossing, grouped=False)


def test_interleaved_beyond_pp_microbatches_is_flagged_unsafe():
    assert in_order_safe(build("interleaved", 2, 2, 2))
    assert not in_order_safe(build("interleaved", 2, 4, 2))  # the executor then stages via host and MPI
