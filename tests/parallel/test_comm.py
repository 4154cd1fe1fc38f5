"""Every Communicator op against a NumPy reference computed from all ranks' inputs.

Each rank's input is a deterministic function of (seed, rank), so every rank can
build every other rank's input and the single-process answer locally.
"""

import time

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar.runtime import transports
from hpcpar.runtime import watchdog
from hpcpar.runtime.comm import Communicator

N = MPI.COMM_WORLD.Get_size()
DTYPES = [np.float64, np.float32, np.float16, np.int32, np.int64, np.uint8]


def make(shape, dtype, rank, seed=0):
    """Rank `rank`'s input: small integers for integer dtypes (so sums of 4 fit a uint8)."""
    rng = np.random.default_rng([seed, rank])
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 50, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def everyone(shape, dtype, seed=0):
    return [make(shape, dtype, r, seed) for r in range(N)]


def tolerance(dtype):
    return {np.float64: 1e-12, np.float32: 1e-5, np.float16: 5e-3}.get(dtype, 0)


def assert_matches(got, expected, dtype):
    assert got.dtype == np.dtype(dtype) and got.shape == expected.shape
    tol = tolerance(dtype)
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol)


def reference_reduce(parts, op, dtype):
    stacked = np.stack([p.astype(np.float64) for p in parts])
    if op == "max":
        return stacked.max(axis=0)
    if op == "min":
        return stacked.min(axis=0)
    total = stacked.sum(axis=0)
    return total / N if op == "avg" else total


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (1,), (0,), ()])
def test_all_reduce(world, dtype, op, shape):
    if op == "avg" and np.issubdtype(dtype, np.integer):
        pytest.skip("avg needs a floating dtype (tested below)")
    parts = everyone(shape, dtype)
    mine = parts[world.rank].copy()
    got = world.all_reduce(mine, op=op)
    assert_matches(got, reference_reduce(parts, op, dtype), dtype)
    assert np.array_equal(mine, parts[world.rank])  # the input is left alone


@pytest.fixture
def split_world(monkeypatch):
    """(a polling Communicator whose every all_reduce into a new result of at least one element
    per rank runs as reduce-scatter + all-gather, the list of those split all-reduces)."""
    monkeypatch.setenv("HPCPAR_MPI_WAIT", "poll")  # blocking waits keep MPI's own all-reduce
    monkeypatch.setattr(transports, "_SPLIT_ALL_REDUCE_BYTES", 1)
    splits = []

    class Counted(transports._SplitAllReduce):
        __slots__ = ()

        def __init__(self, *args):
            splits.append(args[1].shape)
            super().__init__(*args)
    monkeypatch.setattr(transports, "_SplitAllReduce", Counted)
    comm = Communicator(MPI.COMM_WORLD.Dup(), "split")
    yield comm, splits
    comm.free()


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, np.int32, np.uint8])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("shape", [(N,), (2 * N + 3,), (3, 5), (2, 3, 4), (max(N - 1, 0),), ()])
def test_all_reduce_split_into_reduce_scatter_and_all_gather(split_world, dtype, op, shape):
    # The parts of 2N+3 elements differ in length (the longer first); fewer elements than ranks,
    # and 16-bit floats (reduced in place on a float32 copy) keep MPI's all-reduce.
    if op == "avg" and np.issubdtype(dtype, np.integer):
        pytest.skip("avg needs a floating dtype")
    comm, splits = split_world
    parts = everyone(shape, dtype, seed=7)
    mine = parts[comm.rank].copy()
    got = comm.all_reduce(mine, op=op)
    assert_matches(got, reference_reduce(parts, op, dtype), dtype)
    assert np.array_equal(mine, parts[comm.rank])
    every = comm.all_gather(np.ascontiguousarray(got).reshape(1, -1).view(np.uint8))
    assert all(np.array_equal(every[0], row) for row in every)  # the same bits on every rank
    split = N > 1 and int(np.prod(shape)) >= N and dtype != np.float16
    assert len(splits) == split


@pytest.mark.parametrize("strided_ranks", [(0,), (1, 2, 3)])
def test_split_all_reduce_with_layouts_that_differ_between_ranks(split_world, strided_ranks):
    # Whether an all-reduce is split must not depend on a rank's layout of its input (a strided
    # input is copied first): ranks issuing different MPI calls would hang.
    comm, splits = split_world
    parts = everyone((6, 8), np.float64, seed=3)
    mine = np.asfortranarray(parts[comm.rank]) if comm.rank in strided_ranks else parts[comm.rank].copy()
    got = comm.all_reduce(mine, op="sum")
    assert_matches(got, reference_reduce(parts, "sum", np.float64), np.float64)
    assert len(splits) == (N > 1)


def test_all_reduce_non_contiguous(world):
    full = [make((6, 8), np.float64, r) for r in range(N)]
    got = world.all_reduce(full[world.rank][::2, 1::3], op="sum")
    expected = sum(f[::2, 1::3] for f in full)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    transposed = world.all_reduce(full[world.rank].T, op="max")
    np.testing.assert_array_equal(transposed, np.max(np.stack(full), axis=0).T)


def test_iall_reduce_in_place_and_overlapped(world):
    parts_a = everyone((5, 3), np.float64, seed=1)
    parts_b = everyone((4,), np.float32, seed=2)
    a, b = parts_a[world.rank].copy(), parts_b[world.rank].copy()
    ha, hb = world.iall_reduce(a, op="sum"), world.iall_reduce(b, op="avg")
    rb, ra = hb.wait(), ha.wait()  # completion in any order
    assert ra is a and rb is b  # contiguous inputs are reduced in place
    assert ha.wait() is ra  # wait() is idempotent
    np.testing.assert_allclose(a, sum(parts_a), rtol=1e-12)
    np.testing.assert_allclose(b, sum(p.astype(np.float64) for p in parts_b) / N, rtol=1e-5)
    strided = np.stack([parts_a[world.rank]] * 2, axis=1)[:, 0]  # non-contiguous
    got = world.iall_reduce(strided).wait()
    np.testing.assert_allclose(got, sum(parts_a), rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, np.int64])
@pytest.mark.parametrize("shape, dim", [((2 * N,), 0), ((3 * N, 5), 0), ((3, 2 * N), 1), ((3, 2 * N), -1),
                                        ((2, N, 5), 1), ((2, 3, N), 2)])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter(world, dtype, shape, dim, op):
    if op == "avg" and np.issubdtype(dtype, np.integer):
        pytest.skip("avg needs a floating dtype")
    parts = everyone(shape, dtype)
    got = world.reduce_scatter(parts[world.rank], dim=dim, op=op)
    full = reference_reduce(parts, op, dtype)
    expected = np.split(full, N, axis=dim)[world.rank]
    assert_matches(got, expected, dtype)
    assert got.flags.c_contiguous


def test_reduce_scatter_non_contiguous_input(world):
    parts = [make((4 * N, 6), np.float64, r) for r in range(N)]
    view = parts[world.rank][:, ::2].T  # [3, 4N], strided
    got = world.reduce_scatter(view, dim=1)
    expected = np.split(sum(p[:, ::2].T for p in parts), N, axis=1)[world.rank]
    np.testing.assert_allclose(got, expected, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, np.int32, np.int64, np.uint8])
@pytest.mark.parametrize("shape, dim", [((3,), 0), ((1,), 0), ((2, 5), 0), ((2, 5), 1), ((2, 3, 4), -2),
                                        ((0, 3), 1)])
def test_all_gather(world, dtype, shape, dim):
    parts = everyone(shape, dtype)
    got = world.all_gather(parts[world.rank], dim=dim)
    expected = np.concatenate(parts, axis=dim)
    assert got.shape == expected.shape and got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, expected)  # pure data movement: exact


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gather_and_reduce_scatter_into_given_out(world, dtype):
    """`out=`: the result lands in the caller's array (no recycled buffer), which wait() returns."""
    me = world.rank
    part = make((3, 2), dtype, me)
    out = np.empty((3 * N, 2), dtype=dtype)
    got = world.iall_gather(part, out=out).wait()
    assert got is out
    assert_matches(out, np.concatenate(everyone((3, 2), dtype)), dtype)
    whole = make((2 * N, 3), dtype, me, seed=1)
    mine = np.empty((2, 3), dtype=dtype)
    assert world.ireduce_scatter(whole, op="avg", out=mine).wait() is mine
    expected = sum(everyone((2 * N, 3), dtype, seed=1)) / N
    assert_matches(mine, expected[2 * me:2 * me + 2], dtype)
    with pytest.raises(ValueError, match="out must be a C-contiguous"):
        world.iall_gather(part, out=np.empty((3 * N + 1, 2), dtype=dtype))


def test_all_gather_non_contiguous(world):
    parts = [make((5, 7), np.int64, r) for r in range(N)]
    got = world.all_gather(parts[world.rank][1::2, ::3], dim=1)
    np.testing.assert_array_equal(got, np.concatenate([p[1::2, ::3] for p in parts], axis=1))


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, np.uint8])
@pytest.mark.parametrize("shape, dim", [((N,), 0), ((2 * N, 3), 0), ((3, 2 * N), 1), ((2, N, 3), -2)])
def test_all_to_all(world, dtype, shape, dim):
    parts = everyone(shape, dtype)
    got = world.all_to_all(parts[world.rank], dim=dim)
    # Part `rank` of every rank's input, in rank order along `dim`.
    expected = np.concatenate([np.split(p, N, axis=dim)[world.rank] for p in parts], axis=dim)
    assert got.shape == parts[world.rank].shape
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("root", range(N))
@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.uint8])
def test_broadcast_in_place(world, root, dtype):
    parts = everyone((3, 4), dtype, seed=root)
    buf = parts[world.rank].copy()
    out = world.broadcast(buf, root=root)
    assert out is buf
    np.testing.assert_array_equal(buf, parts[root])


def test_broadcast_into_non_contiguous_view(world):
    base = np.zeros((4, 6))
    if world.rank == 0:
        base[:] = np.arange(24.0).reshape(4, 6)
    view = base[:, ::2]
    world.broadcast(view, root=0)
    np.testing.assert_array_equal(base[:, ::2], np.arange(24.0).reshape(4, 6)[:, ::2])
    if world.rank != 0:
        assert not base[:, 1::2].any()  # only the view was written


@pytest.mark.skipif(N < 2, reason="point-to-point needs 2 ranks")
def test_send_recv_ring(world):
    right, left = (world.rank + 1) % N, (world.rank - 1) % N
    mine = make((3, 4), np.float32, world.rank)
    out = np.empty((3, 4), np.float32)
    recv = world.irecv(out, source=left, tag=7)
    send = world.isend(mine, dest=right, tag=7)
    got = recv.wait()
    send.wait()
    assert got is out
    np.testing.assert_array_equal(out, make((3, 4), np.float32, left))


@pytest.mark.skipif(N < 2, reason="point-to-point needs 2 ranks")
def test_blocking_send_recv_non_contiguous_and_tags(world):
    full = make((6, 6), np.int64, 0)
    if world.rank == 0:
        world.send(full[:, ::2], dest=1, tag=2)  # tag 2 first, tag 1 second
        world.send(full[::3], dest=1, tag=1)
    elif world.rank == 1:
        first = world.recv(np.empty((2, 6), np.int64), source=0, tag=1)  # matched by tag
        target = np.zeros((6, 12), np.int64)
        world.recv(target[:, ::4], source=0, tag=2)  # into a strided view
        np.testing.assert_array_equal(first, full[::3])
        np.testing.assert_array_equal(target[:, ::4], full[:, ::2])
    world.barrier()


def test_size_one_communicator_is_a_no_op():
    solo = Communicator(MPI.COMM_SELF, "solo")
    a = np.arange(6.0).reshape(2, 3)
    for result in (solo.all_reduce(a), solo.all_reduce(a, op="avg"), solo.reduce_scatter(a, dim=1),
                   solo.all_gather(a, dim=1), solo.all_to_all(a), solo.broadcast(a),
                   solo.iall_reduce(a).wait()):
        assert result is a
    assert np.array_equal(a, np.arange(6.0).reshape(2, 3))
    solo.barrier()


def test_argument_errors(world):
    a = np.ones((N + 1, 2 * N + 1), np.float32)
    with pytest.raises(ValueError, match=r"all_reduce on 'world': unknown op 'mean'; use one of sum, avg, max"):
        world.all_reduce(a, op="mean")
    with pytest.raises(ValueError, match="op 'avg' needs a floating dtype, got int32"):
        world.all_reduce(np.ones(3, np.int32), op="avg")
    with pytest.raises(ValueError, match="reduce_scatter on 'world': unknown op 'max'"):
        world.reduce_scatter(a, op="max")
    with pytest.raises(ValueError, match="dim 5 is out of range for shape"):
        world.all_gather(a, dim=5)
    if N > 1:
        with pytest.raises(ValueError, match=rf"dim 1 of shape \({N + 1}, {2 * N + 1}\) has size {2 * N + 1}, "
                                             rf"which does not divide into {N} equal parts"):
            world.reduce_scatter(a, dim=1)
        with pytest.raises(ValueError, match="all_to_all on 'world': dim 0 of shape"):
            world.all_to_all(a, dim=0)
    with pytest.raises(ValueError, match=rf"root {N} is not a rank of this communicator \(ranks 0..{N - 1}\)"):
        world.broadcast(a, root=N)
    with pytest.raises(ValueError, match="dest -1 is not a rank"):
        world.send(a, dest=-1)
    with pytest.raises(ValueError, match="source 99 is not a rank"):
        world.recv(a, source=99)


def test_flight_recorder_numbers_ops_per_communicator(world):
    comm = Communicator(MPI.COMM_WORLD.Dup(), "numbered")
    comm.all_reduce(np.ones(3))
    comm.all_gather(np.ones((2, 2)), dim=1)
    comm.barrier()
    snap = watchdog.recorder.snapshot()
    mine = [r for r in snap["done"] if r.comm == "numbered"]
    if N > 1:
        assert [(r.seq, r.op) for r in mine] == [(0, "all_reduce"), (1, "all_gather"), (2, "barrier")]
        assert mine[1].shape == (2, 2) and mine[1].nbytes == 32 and mine[1].end >= mine[1].start
    assert not [r for r in snap["pending"] if r.comm == "numbered"]
    comm.free()


# Communicators a test broke on purpose: kept, never used or freed again (an op abandoned after a
# CommTimeout may still be pending on them, and MPI_Comm_free would have to wait for it).
_BROKEN: list[Communicator] = []


@pytest.mark.skipif(N < 2, reason="a timeout needs a peer that is late")
def test_a_missing_peer_raises_comm_timeout_instead_of_hanging():
    comm = Communicator(MPI.COMM_WORLD.Dup(), "late")
    _BROKEN.append(comm)
    late_rank = 0
    try:
        watchdog.set_timeout(0.5)
        if comm.rank == late_rank:
            time.sleep(1.5)
            watchdog.set_timeout(30)
            comm.ibarrier().wait()  # completes: the other ranks' barriers are still posted
            error = None
        else:
            # A Handle.wait() raises; a blocking op would abort the job (the monitor's report).
            with pytest.raises(watchdog.CommTimeout) as info:
                comm.ibarrier().wait()
            error = str(info.value)
    finally:
        watchdog.set_timeout(60)
    if error is not None:
        assert "barrier on communicator 'late' (op #0" in error and "timeout" in error
        assert "pending: late#0 barrier" in error


def test_dtypes_without_an_mpi_type_reduce_in_float32(world, monkeypatch):
    # Pretend MPI has no float16 (as for bfloat16, or float16 on MPIs without it): the
    # reductions must upcast, reduce, and cast back; data movement goes as raw bytes.
    from hpcpar.runtime import buffers
    monkeypatch.setitem(buffers._mpi_types, np.dtype(np.float16), None)
    parts = everyone((2 * N, 3), np.float16, seed=5)
    expected = reference_reduce(parts, "sum", np.float16)
    assert_matches(world.all_reduce(parts[world.rank], op="sum"), expected, np.float16)
    inplace = parts[world.rank].copy()
    assert world.iall_reduce(inplace, op="avg").wait() is inplace
    assert_matches(inplace, expected / N, np.float16)
    assert_matches(world.reduce_scatter(parts[world.rank], dim=0), np.split(expected, N)[world.rank], np.float16)
    np.testing.assert_array_equal(world.all_gather(parts[world.rank], dim=1), np.concatenate(parts, axis=1))


def test_results_held_by_the_caller_are_never_recycled(world):
    # Large results come from a recycled-buffer pool: one still referenced (directly or
    # through a view) must never be reused for a later result.
    shape = (N * 64, 65)  # > 64 KiB of float64
    held, views, expected = [], [], []
    for seed in range(12):  # more results than the pool keeps
        parts = everyone(shape, np.float64, seed=seed)
        expected.append(sum(parts))
        result = world.all_reduce(parts[world.rank])
        if seed % 2:
            held.append(result)
        else:
            views.append(result[1:])  # only a view survives
        world.all_gather(parts[world.rank][:N], dim=0)  # unrelated results come and go
    for i, got in enumerate(held):
        np.testing.assert_allclose(got, expected[2 * i + 1], rtol=1e-12, atol=1e-12)
    for i, got in enumerate(views):
        np.testing.assert_allclose(got, expected[2 * i][1:], rtol=1e-12, atol=1e-12)


def test_recycled_results_take_the_shape_and_dtype_asked_for(world):
    # A pooled buffer's last view is handed out again when nobody holds it: a request of the same
    # bytes in another shape or dtype must get its own view, and a held result must stay intact.
    rows = N * 64
    a = everyone((rows, 65), np.float64, seed=20)
    first = world.all_reduce(a[world.rank])
    kept = first.copy()
    np.testing.assert_allclose(first, sum(a), rtol=1e-12, atol=1e-12)
    b = everyone((65, rows), np.float64, seed=21)  # same bytes, another shape
    second = world.all_reduce(b[world.rank])
    assert second.shape == (65, rows) and second is not first
    np.testing.assert_allclose(second, sum(b), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(first, kept)  # held while the second ran: untouched
    del first, second
    c = everyone((rows, 130), np.float32, seed=22)  # same bytes, another dtype
    third = world.all_reduce(c[world.rank])
    assert third.dtype == np.float32 and third.shape == (rows, 130)
    np.testing.assert_allclose(third, sum(p.astype(np.float64) for p in c), rtol=1e-5, atol=1e-4)
    again = world.all_reduce(c[world.rank] * 2)  # third still held: another buffer
    np.testing.assert_allclose(third, sum(p.astype(np.float64) for p in c), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(again, 2 * third, rtol=1e-5, atol=1e-4)


def test_isend_irecv_exchanges_around_a_ring(world):
    """Every rank sends to the next and receives from the previous in one call (the pipeline's
    paired messages): each gets its neighbour's array, and the send handle completes."""
    nxt, prv = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    mine = np.full((3, 5), float(world.rank))
    out = np.empty_like(mine)
    sent, received = world.isend_irecv(mine, nxt, out, prv, send_tag=7, recv_tag=7)
    got = received.wait()
    sent.wait()
    assert got is out and np.array_equal(out, np.full((3, 5), float(prv))), f"got {out[0, 0]} from {prv}"
