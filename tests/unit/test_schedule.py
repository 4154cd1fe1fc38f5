"""Pipeline schedules: structure, simulated bubble and stash against the formulas, and proof
that the simulator rejects broken schedules."""

import itertools

import pytest

from hpcpar.errors import ConfigError
from hpcpar.parallel.schedule import (
    RECVS, SENDS, Action, ScheduleError, build, check_in_order_transport, gpipe, in_order_safe, interleaved_1f1b,
    message_groups, message_tag, one_f_one_b, predict_step_time, simulate, validate,
)


def valid_cases(name):
    """Every (pp, m, chunks) with pp in 1..8, m in 1..16, chunks in 1..4 that `name` accepts."""
    for pp, m, v in itertools.product(range(1, 9), range(1, 17), range(1, 5)):
        try:
            validate(name, pp, m, v)
        except ConfigError:
            continue
        yield pp, m, v


def interleaved_warmup(r, p, m, v):
    """Megatron's warm-up forwards on rank r (arXiv 2104.04473 / Megatron-LM)."""
    return min(2 * (p - r - 1) + (v - 1) * p, v * m)


# ---------------------------------------------------------------- structure of the lists


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_each_rank_computes_every_microbatch_chunk_once(name):
    for pp, m, v in valid_cases(name):
        for rank, actions in enumerate(build(name, pp, m, v)):
            for kind in ("forward", "backward"):
                done = sorted((a.microbatch, a.chunk) for a in actions if a.kind == kind)
                assert done == sorted(itertools.product(range(m), range(v))), (name, pp, m, v, rank, kind)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
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


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_message_tags_match_between_sender_and_receiver_and_are_unique(name):
    for pp, m, v in valid_cases(name):
        schedules = build(name, pp, m, v)
        sent = []
        for rank, actions in enumerate(schedules):
            for a in (a for a in actions if a.kind.startswith("send")):
                stage = a.chunk * pp + rank
                to = stage + 1 if a.kind == "send_act" else stage - 1
                assert a.peer == to % pp
                want = Action("recv_act" if a.kind == "send_act" else "recv_grad", a.microbatch, to // pp, rank)
                assert want in schedules[a.peer], (name, pp, m, v, rank, a)
                tag = message_tag(a, pp, v, m)
                assert tag == message_tag(want, pp, v, m)
                assert 0 <= tag < 2 * (pp * v - 1) * m
                sent.append(tag)
        assert len(sent) == len(set(sent)) == 2 * (pp * v - 1) * m


def test_pp1_orders():
    f, b = (lambda mb: Action("forward", mb)), (lambda mb: Action("backward", mb))
    assert one_f_one_b(1, 3) == [[f(0), b(0), f(1), b(1), f(2), b(2)]]
    assert gpipe(1, 3) == [[f(0), f(1), f(2), b(0), b(1), b(2)]]


def test_1f1b_warmup_and_interleaved_with_one_chunk_is_1f1b():
    schedules = one_f_one_b(4, 8)
    for rank, actions in enumerate(schedules):
        computes = [a.kind[0] for a in actions if a.kind in ("forward", "backward")]
        warmup = 4 - rank - 1
        assert computes[:warmup + 2] == ["f"] * (warmup + 1) + ["b"]
    for pp, m in itertools.product(range(1, 9), range(1, 17)):
        assert interleaved_1f1b(pp, m, 1) == one_f_one_b(pp, m)


# ---------------------------------------------------------------- simulated bubble and stash


@pytest.mark.parametrize("t_backward", [2.0, 1.0])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_bubble_and_step_time_match_formulas(name, t_backward):
    for pp, m, v in valid_cases(name):
        res = simulate(build(name, pp, m, v), t_forward=1.0, t_backward=t_backward)
        assert res.busy == pytest.approx([m * (1.0 + t_backward)] * pp)
        assert res.makespan == pytest.approx((m + (pp - 1) / v) * (1.0 + t_backward)), (pp, m, v)
        assert res.bubble == pytest.approx((pp - 1) / (v * m + pp - 1)), (pp, m, v)
        assert res.bubble_per_rank == pytest.approx([res.bubble] * pp)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_peak_stash(name):
    for pp, m, v in valid_cases(name):
        peak = simulate(build(name, pp, m, v)).peak_stash
        if name == "gpipe":
            assert peak == [m] * pp
        elif name == "1f1b":
            assert peak == [min(pp - r, m) for r in range(pp)]
            assert max(peak) <= pp
        elif v > 1:
            assert peak == [min(interleaved_warmup(r, pp, m, v) + 1, v * m) for r in range(pp)]


def test_interleaving_shrinks_the_bubble():
    for pp, m, v in valid_cases("interleaved"):
        if v > 1 and pp > 1:
            assert simulate(interleaved_1f1b(pp, m, v)).bubble < simulate(one_f_one_b(pp, m)).bubble


def test_events_are_sequential_per_rank():
    res = simulate(interleaved_1f1b(4, 8, 2), t_forward=1.0, t_backward=2.0, t_comm=0.1)
    for events in res.events:
        for e in events:
            if e.action.kind in ("forward", "backward"):  # per chunk: t / v
                assert e.end - e.start == pytest.approx(0.5 if e.action.kind == "forward" else 1.0)
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


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize("args, words", [
    (("interleaved", 4, 6, 2), ["train.microbatches (6)", "multiple of mesh.pp (4)"]),
    (("interleaved", 1, 4, 2), ["mesh.pp >= 2"]),
    (("1f1b", 4, 8, 2), ["pipeline.chunks=1", "interleaved"]),
    (("zb", 4, 8, 1), ["pipeline.schedule='zb'", "gpipe, 1f1b, interleaved"]),
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


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
def test_grouped_messages_cannot_deadlock_on_an_in_order_transport(name, pp, m):
    check_in_order_transport(build(name, pp, m))  # raises on a deadlock
    assert in_order_safe(build(name, pp, m))


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
