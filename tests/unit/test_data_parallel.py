"""Data parallelism in one process: the bucket assignment, the bucket manager's launch order, the
16-bit wire (also as a compressor between simulated ranks), ZeRO's segments, the clipping rule,
and dp = 1 (same API, no communication) against plain AdamW on the whole batch."""

import threading

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar import backend
from hpcpar.checkpoint.parts import load_parts, save_parts
from hpcpar.checkpoint.save import save
from hpcpar.data import corpus
from hpcpar.runtime.comm import Communicator
from hpcpar.runtime.transports import Handle
from hpcpar.errors import CheckpointError, ConfigError
from hpcpar.layout import Layout
from hpcpar.runtime.mesh import Mesh
from hpcpar.runtime.solo import SoloCommunicator
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.nn.module import Parameter
from hpcpar.optim.optimizers import SGD, AdamW, clip_grad_norm
from hpcpar.parallel.dp.buckets import Bucket, BucketManager, CompressedReduction, assign_buckets
from hpcpar.parallel.dp.clipping import clip_global_norm, counts_toward_norm
from hpcpar.parallel.dp.compression.compressors import Wire16, decode16, encode16, make_compressor
from hpcpar.parallel.dp.ddp import DDP
from hpcpar.parallel.dp.experts import ExpertDataParallel
from hpcpar.parallel.dp.fsdp import FSDP
from hpcpar.parallel.dp.sync import GradientSync, make_gradient_sync
from hpcpar.parallel.dp.zero import ZeRO
from hpcpar.parallel.dp.zero import ZeroOptimizer

CFG = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=16, dtype="float64")
TOKENS = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)


# -- assignment -------------------------------------------------------------------------------

def test_assignment_reverse_order_cap_and_padding():
    params = [("a", 10, "float32"), ("b", 3, "float32"), ("c", 300, "float32"), ("d", 5, "float32")]
    assignments = assign_buckets(params, bucket_bytes=40, pad_to=4)
    assert [[s.name for s in b.slots] for b in assignments] == [["d", "c"], ["b", "a"]]
    assert [b.size for b in assignments] == [308, 16]   # 305 -> 308, 13 -> 16 (multiples of 4)
    assert [b.used for b in assignments] == [305, 13]
    assert [(s.offset, s.numel) for s in assignments[0].slots] == [(0, 5), (5, 300)]
    assert [s.index for s in assignments[1].slots] == [1, 0]


def test_assignment_large_parameter_alone_and_dtype_change_splits():
    params = [("a", 4, "float64"), ("b", 1000, "float32"), ("c", 4, "float32")]
    assignments = assign_buckets(params, bucket_bytes=64)
    assert [[s.name for s in b.slots] for b in assignments] == [["c", "b"], ["a"]]
    assert [b.dtype for b in assignments] == ["float32", "float64"]
    assignments = assign_buckets([("a", 1000, "float32"), ("b", 4, "float32")], bucket_bytes=64)
    assert [[s.name for s in b.slots] for b in assignments] == [["b", "a"]]  # closed once past the cap


def test_assignment_tied_weights_go_last_sorted():
    params = [("wte", 8, "float64"), ("x", 2, "float64"), ("lm_head", 8, "float64")]
    assignments = assign_buckets(params, bucket_bytes=1 << 20, pad_to=3, tied={"wte", "lm_head"})
    assert [s.name for s in assignments[0].slots] == ["x"] and not assignments[0].tied
    assert [s.name for s in assignments[1].slots] == ["lm_head", "wte"] and assignments[1].tied
    assert assignments[1].size == 18


# -- bucket manager -----------------------------------------------------------------------------

class FakeComm:
    """Stands in for the dp (or tied) communicator: a size, progress() calls counted, and an
    in-place iall_reduce that only logs (the tied bucket's sum across stages)."""

    def __init__(self, log, size=2, rank=0):
        self.log, self.size, self.rank, self.progressed = log, size, rank, 0

    def progress(self):
        self.progressed += 1

    def iall_reduce(self, a, op="sum"):
        self.log.append(("tied_sum", op))
        return Handle.ready(a)


class FakeReduction:
    """Logs what the manager asks of a reduction, in order; a sharding one returns a marker part."""

    def __init__(self, comm, log, shards):
        self.comm, self.log, self.shards = comm, log, shards

    def start(self, bucket):
        self.log.append(("start", bucket.index))
        return Handle.ready(bucket.index)

    def finish(self, bucket, handle):
        self.log.append(("finish", handle.wait()))
        return ("part", bucket.index) if self.shards else None


def make_manager(shards=False, overlap=True, size=2):
    log = []
    comm = FakeComm(log, size)
    named = [(n, Parameter(np.zeros(4))) for n in "abcdt"]
    assignments = assign_buckets([(n, 4, "float64") for n, _ in named], bucket_bytes=64, tied={"t"})
    manager = BucketManager(named, assignments, FakeReduction(comm, log, shards), tied_comm=FakeComm(log),
                            overlap=overlap)
    return manager, dict(named), comm, log


def test_manager_launches_complete_buckets_in_index_order_on_the_last_microbatch():
    manager, p, comm, log = make_manager()
    assert [[s.name for s in b.assignment.slots] for b in manager.buckets] == [["d", "c"], ["b", "a"], ["t"]]
    manager.begin_step(microbatches=2)
    for n in "dcbat":          # first micro-batch: no parameter has all its contributions
        manager.on_grad(p[n])
    assert log == [] and comm.progressed == 0
    for n in "bad":            # bucket 1 is complete, but waits for bucket 0
        manager.on_grad(p[n])
    assert log == [] and comm.progressed == 0
    manager.on_grad(p["c"])    # bucket 0 complete: it goes, then the waiting bucket 1
    assert log == [("start", 0), ("start", 1)] and comm.progressed == 1
    manager.on_grad(p["t"])    # the tied bucket waits for finish_backward; progress goes on
    assert log == [("start", 0), ("start", 1)] and comm.progressed == 2
    manager.finish_backward()
    assert log == [("start", 0), ("start", 1), ("tied_sum", "sum"), ("start", 2),
                   ("finish", 0), ("finish", 1), ("finish", 2)]
    assert [i for kind, i, _ in manager.events if kind == "bucket_start"] == [0, 1, 2]
    assert [n for kind, n, _ in manager.events if kind == "grad_ready"] == list("badct")
    with pytest.raises(RuntimeError, match="begin_step"):
        manager.finish_backward()


@pytest.mark.parametrize("overlap, fired", [(False, "abcdt"), (True, "bcdt")])
def test_manager_launches_the_rest_in_finish_backward(overlap, fired):
    """Without overlap nothing leaves from the hooks; with it, a bucket whose parameter got no
    gradient ("a") still goes, as zeros, in finish_backward, in its place in the order."""
    manager, p, comm, log = make_manager(overlap=overlap)
    manager.begin_step(microbatches=1)
    for n in fired:
        manager.on_grad(p[n])
    from_hooks = list(log)
    manager.finish_backward()
    assert from_hooks == ([("start", 0)] if overlap else [])
    assert log == [("start", 0), ("start", 1), ("tied_sum", "sum"), ("start", 2),
                   ("finish", 0), ("finish", 1), ("finish", 2)]

def test_manager_keeps_sharded_results_and_does_not_communicate_on_one_rank():
    manager, p, _, log = make_manager(shards=True)
    p["a"].grad = None   # someone reset a .grad: begin_step points it at its bucket view again
    manager.buckets[1].grad.fill(7.0)
    manager.begin_step(microbatches=1)
    assert np.shares_memory(p["a"].grad, manager.buckets[1].grad) and not manager.buckets[1].grad.any()
    manager.finish_backward()
    assert [b.part for b in manager.buckets] == [("part", 0), ("part", 1), ("part", 2)]

    manager, p, _, log = make_manager(shards=True, size=1)
    manager.begin_step(microbatches=1)
    for n in "abcdt":
        manager.on_grad(p[n])
    manager.finish_backward()
    assert all(kind == "tied_sum" for kind, _ in log)  # no reduction started or finished
    assert all(b.part is b.grad for b in manager.buckets)  # one rank: all of a bucket is its part


# -- wire formats -----------------------------------------------------------------------------

def test_float16_wire_roundtrip():
    x = np.random.default_rng(1).standard_normal(1000)
    got = decode16(encode16(x, "float16"), "float16")
    np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))


def test_bfloat16_wire_rounds_like_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(5000).astype(np.float32) * 10.0 ** rng.integers(-20, 20, 5000),
                        np.float32([0.0, -0.0, np.inf, -np.inf, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8])])
    got = decode16(encode16(x, "bfloat16"), "bfloat16")
    want = torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(got, want)
    assert np.isnan(decode16(encode16(np.float32([np.nan]), "bfloat16"), "bfloat16")).all()


# -- the 16-bit wire as a compressor, between simulated ranks ------------------------------------

class ThreadComm:
    """Rank `rank` of an in-process group of threads: the collectives that the compressor and
    ZeRO use, completed at once (a barrier stands in for the network)."""

    def __init__(self, rank, slots, barrier):
        self.rank, self.size, self.slots, self.barrier = rank, len(slots), slots, barrier

    def _everyone(self, a):
        self.slots[self.rank] = a
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return got

    def progress(self):
        pass

    def iall_to_all(self, a, dim=0):
        return Handle.ready(np.stack([theirs[self.rank] for theirs in self._everyone(a)]))

    def all_gather(self, a, dim=0):
        return np.concatenate(self._everyone(a))

    def iall_gather(self, a, dim=0, out=None):
        whole = self.all_gather(a)
        if out is None:
            return Handle.ready(whole)
        out[...] = whole
        return Handle.ready(out)

    def ireduce_scatter(self, a, dim=0, op="sum", out=None):
        total = sum(self._everyone(a.copy()))
        part = total.reshape(self.size, -1)[self.rank] / (self.size if op == "avg" else 1)
        if out is None:
            return Handle.ready(part)
        out[...] = part
        return Handle.ready(out)

    def iall_reduce(self, a, op="sum"):
        total = sum(self._everyone(a.copy()))  # in rank order
        a[...] = total / (self.size if op == "avg" else 1)
        return Handle.ready(a)

    def all_reduce(self, a, op="sum"):
        return self.iall_reduce(a.copy(), op).wait()


def run_ranks(n, fn):
    """fn(ThreadComm) on n threads; their results in rank order (a failure breaks the barrier)."""
    slots, barrier, results, errors = [None] * n, threading.Barrier(n, timeout=30), [None] * n, []

    def body(r):
        try:
            results[r] = fn(ThreadComm(r, slots, barrier))
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_wire16_compressor_averages_parts_in_float32_and_gathers_the_same_bytes(wire):
    n, size = 3, 12
    grads = np.random.default_rng(3).standard_normal((n, size))

    def rank(comm):
        c = Wire16(comm, wire)
        part = c.decompress(0, c.exchange(c.compress(0, grads[comm.rank])).wait())
        return part, c.all_gather(0, part)

    results = run_ranks(n, rank)
    sent = decode16(encode16(grads, wire), wire)    # each rank's bucket as it went on the wire
    mean = sent.sum(axis=0) / n                       # float32 sum of the 16-bit addends
    assert mean.dtype == np.float32
    for r, (part, whole) in enumerate(results):
        np.testing.assert_array_equal(part, mean[r * 4:(r + 1) * 4])  # rank r got row r of every rank
        np.testing.assert_array_equal(whole, decode16(encode16(mean, wire), wire))
    tol = 2e-3 if wire == "float16" else 1.6e-2
    assert np.max(np.abs(results[0][1] - grads.mean(axis=0))) < tol * np.max(np.abs(grads))
    assert make_compressor("float32", None) is None


@pytest.mark.parametrize("shards", [False, True])
def test_manager_with_compressed_reduction_on_simulated_ranks(shards):
    """The manager + CompressedReduction: all-reduce case writes the same whole average into
    every rank's bucket, the reduce-scatter case leaves each rank its part in the bucket dtype."""
    n = 3
    grads = np.random.default_rng(5).standard_normal((n, 2, 6))

    def rank(comm):
        named = [("w", Parameter(np.zeros(6))), ("v", Parameter(np.zeros(6)))]
        assignments = assign_buckets([(name, 6, "float64") for name, _ in named], bucket_bytes=1 << 20, pad_to=n)
        manager = BucketManager(named, assignments, CompressedReduction(Wire16(comm, "float16"), shards))
        manager.begin_step(microbatches=1)
        for (_, p), g in zip(named, grads[comm.rank]):
            p.grad += g
            manager.on_grad(p)
        manager.finish_backward()
        b = manager.buckets[0]
        return b.part, b.grad.copy()

    results = run_ranks(n, rank)
    sent = decode16(encode16(grads[:, ::-1].reshape(n, -1), "float16"), "float16")  # bucket order: v, w
    mean = sent.sum(axis=0) / n
    for r, (part, whole) in enumerate(results):
        if shards:
            assert part.dtype == np.float64
            np.testing.assert_array_equal(part, mean[r * 4:(r + 1) * 4])
        else:
            assert part is None
            np.testing.assert_array_equal(whole, decode16(encode16(mean, "float16"), "float16"))


# -- ZeRO ---------------------------------------------------------------------------------------

def test_zero_segments_cut_parameters_at_part_boundaries():
    named = [("a", Parameter(np.arange(5.0))), ("b", Parameter(np.arange(3.0) + 10, no_decay=True)),
             ("c", Parameter(np.arange(4.0) + 20))]
    assignments = assign_buckets([(n, p.data.size, "float64") for n, p in named], bucket_bytes=1 << 20, pad_to=3)
    bucket = Bucket(0, assignments[0], [p for _, p in named], np)  # c [0, 4), b [4, 7), a [7, 12)
    zo = ZeroOptimizer([bucket], FakeComm([], size=3, rank=1), lambda ps: SGD(ps, lr=0.1))
    assert [(s.name, s.lo, s.hi, s.part_lo, s.no_decay) for s in zo.segments] == [
        ("b", 0, 3, 0, True), ("a", 0, 1, 3, False)]                # rank 1's part is [4, 8)
    np.testing.assert_array_equal(zo.parts[0].data, [10.0, 11.0, 12.0, 0.0])
    assert zo.optimizer.params == zo.segments
    assert all(np.shares_memory(s.data, zo.parts[0].data) for s in zo.segments)


def test_zero_step_and_state_match_the_unsharded_optimizer_on_simulated_ranks():
    shapes = [("a", (5,)), ("b", (3,)), ("c", (2, 2))]
    rng = np.random.default_rng(4)
    init = {n: rng.standard_normal(s) for n, s in shapes}
    grad = {n: rng.standard_normal(s) for n, s in shapes}     # the dp-averaged gradient

    def make(ps):
        return SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)

    def params(values):
        return [(n, Parameter(values[n].copy(), no_decay=n == "b")) for n, _ in shapes]

    ref = dict(params(init))
    opt = make(list(ref.values()))
    for _ in range(2):
        for n, p in ref.items():
            p.grad = grad[n]
        opt.step()

    def rank(comm):
        def zero(named):
            assignments = assign_buckets([(n, p.data.size, "float64") for n, p in named], bucket_bytes=48,
                                         pad_to=comm.size)
            buckets = [Bucket(i, assignment, [p for _, p in named], np) for i, assignment in enumerate(assignments)]
            return buckets, ZeroOptimizer(buckets, comm, make)

        named = params(init)
        buckets, zo = zero(named)
        assert len(buckets) == 2
        for _ in range(2):
            for b in buckets:  # what the reduce-scatter leaves: this rank's part of the average
                full = np.zeros(b.assignment.size)
                for s in b.assignment.slots:
                    full[s.offset:s.offset + s.numel] = grad[s.name].reshape(-1)
                k = b.assignment.size // comm.size
                b.part = full[comm.rank * k:(comm.rank + 1) * k]
            zo.attach_grads()
            zo.step()
        state = zo.state(("momentum_buffer",))
        named2 = params({n: p.data for n, p in named})
        _, zo2 = zero(named2)
        zo2.load_state(state)
        return {n: p.data for n, p in named}, state, zo2.state(("momentum_buffer",))

    for got, state, reloaded in run_ranks(3, rank):
        for n, p in ref.items():
            np.testing.assert_array_equal(got[n], p.data, err_msg=n)
            np.testing.assert_array_equal(state[n]["momentum_buffer"], opt.state_of(p)["momentum_buffer"])
            np.testing.assert_array_equal(reloaded[n]["momentum_buffer"], state[n]["momentum_buffer"])


# -- clipping -----------------------------------------------------------------------------------

def test_norm_counts_split_parameters_on_every_tp_rank_replicated_ones_once_tied_copies_never():
    split = Parameter(np.ones(2), layout=Layout.split((4,), 0, 1, 2))
    replicated = Parameter(np.ones(2))
    tied = Parameter(np.ones(2), tied_to="transformer.wte.weight")
    assert [counts_toward_norm(p, 0) for p in (split, replicated, tied)] == [True, True, False]
    assert [counts_toward_norm(p, 1) for p in (split, replicated, tied)] == [True, False, False]


def test_clip_scales_every_buffer_by_the_norm_of_the_counted_items():
    counted = Parameter(np.zeros(2))
    counted.grad = np.array([3.0, 4.0])
    tied_copy = np.array([1.0, 1.0])  # not counted, but clipped like every gradient
    world = Communicator.local()
    assert clip_global_norm([counted], [counted.grad, tied_copy], 10.0, world) == 5.0
    np.testing.assert_array_equal(tied_copy, [1.0, 1.0])
    assert clip_global_norm([counted], [counted.grad, tied_copy], 1.0, world) == 5.0
    coef = 1.0 / (5.0 + 1e-6)
    np.testing.assert_array_equal(counted.grad, np.array([3.0, 4.0]) * coef)
    np.testing.assert_array_equal(tied_copy, np.array([1.0, 1.0]) * coef)


# -- dp = 1 -----------------------------------------------------------------------------------

def make_dp(zero=0, bucket_mb=0.002, **kw):
    model = GPT(CFG, seed=5)
    mesh = Mesh(comm=MPI.COMM_SELF)
    dp = make_gradient_sync(list(model.named_parameters()), mesh, bucket_mb=bucket_mb, zero=zero,
                            make_optimizer=lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1), **kw)
    return model, dp


def run_dp(model, dp, steps=3, m=2, mbs=2, clip=0.5):
    losses = []
    for step in range(steps):
        dp.begin_step(microbatches=m)
        total = 0.0
        for j in range(m):
            x, y = corpus.get_batch(TOKENS, 7, step, corpus.microbatch_sample_ids(0, 1, mbs, j), CFG.block_size)
            loss = model(x, y)
            loss.backward(backend.array_module(loss.data).asarray(1.0 / m, dtype=loss.dtype))
            total += loss.item() / m
        dp.finish_backward()
        dp.clip_grad_norm(clip)
        dp.step(1e-2)
        losses.append(total)
    return losses


def run_reference(steps=3, batch=4, clip=0.5):
    model = GPT(CFG, seed=5)
    params = model.parameters()
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        for p in params:
            p.grad = None
        x, y = corpus.get_batch(TOKENS, 7, step, range(batch), CFG.block_size)
        loss = model(x, y)
        loss.backward()
        clip_grad_norm(params, clip)
        opt.step(1e-2)
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("zero", [0, 1])
def test_dp1_accumulation_matches_whole_batch(zero):
    ref, ref_losses = run_reference()
    model, dp = make_dp(zero=zero)
    assert len(dp.buckets) > 2
    losses = run_dp(model, dp)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(backend.to_host(p.data), backend.to_host(want[name].data), rtol=1e-10, atol=1e-14,
                                   err_msg=name)
    assert dp.optimizer_step_count() == 3


def test_hooks_launch_buckets_during_backward_in_order():
    model, dp = make_dp()
    dp.begin_step(microbatches=1)
    x, y = corpus.get_batch(TOKENS, 7, 0, range(2), CFG.block_size)
    model(x, y).backward()
    starts = [i for kind, i, _ in dp.events if kind == "bucket_start"]
    assert starts == list(range(len(dp.buckets)))  # all launched from hooks, in order
    dp.finish_backward()


def test_second_backward_beyond_microbatches_is_an_error():
    model, dp = make_dp()
    dp.begin_step(microbatches=1)
    x, y = corpus.get_batch(TOKENS, 7, 0, range(2), CFG.block_size)
    model(x, y).backward()
    with pytest.raises(RuntimeError, match="micro-batch"):
        model(x, y).backward()


def test_optimizer_state_roundtrip_zero(tmp_path):
    model, dp = make_dp(zero=1)
    run_dp(model, dp, steps=2)
    state = dp.checkpoint_state()
    assert {n.split("/")[1] for n in state.tensors if n.startswith("optim/")} == {n for n, _ in model.named_parameters()}
    path = save_parts(str(tmp_path / "good"), 2, [dp], SoloCommunicator())
    model2, dp2 = make_dp(zero=1)
    load_parts(path, [dp2], SoloCommunicator())
    for name, (v, _) in dp2.checkpoint_state().tensors.items():
        np.testing.assert_array_equal(backend.to_host(v), backend.to_host(state.tensors[name][0]))
    assert dp2.optimizer_step_count() == 2
    bad = dict(state.tensors, **{"optim/transformer.wpe.weight/exp_avg": (np.zeros(3), Layout.replicated((3,)))})
    path = save(str(tmp_path / "bad"), 2, bad, state.meta, SoloCommunicator())
    with pytest.raises(CheckpointError, match="wpe"):
        load_parts(path, [dp2], SoloCommunicator())


def test_every_strategy_answers_the_whole_gradient_sync_interface():
    members = [n for n in dir(GradientSync) if not n.startswith("_")]
    for strategy in (DDP, ZeRO, FSDP, ExpertDataParallel):
        assert not [m for m in members if not hasattr(strategy, m)], strategy.__name__
    for zero, strategy in [(0, DDP), (1, ZeRO), (2, ZeRO)]:
        assert type(make_dp(zero=zero)[1]) is strategy


@pytest.mark.parametrize("kw, match", [({"compression": "int4"}, "compression 'int4' is unknown"),
                                       ({"zero": 4}, "ZeRO"), ({"bucket_mb": 0}, "bucket_mb")])
def test_bad_arguments(kw, match):
    with pytest.raises(ConfigError, match=match):
        make_dp(**kw)
