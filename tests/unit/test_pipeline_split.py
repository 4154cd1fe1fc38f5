"""Pipeline stages in one process: the layer-split rule, stage construction for every virtual
stage, the forward-only action lists, the executor at pp = 1 and the trace writer."""

import itertools
import json

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar import backend
from hpcpar.runtime.comm import Communicator
from hpcpar.errors import ConfigError
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.parallel.pp import schedules
from hpcpar.parallel.pp.executor import PipelineExecutor
from hpcpar.parallel.pp.stages import build_stages, head_cost, split_layers
from hpcpar.runtime.trace import Tracer


class StubMesh:
    """The slice of Mesh that build_stages/PipelineExecutor use, for pipeline rank `rank` of `pp`
    (no messages are sent unless pp > 1, which these tests never run)."""

    def __init__(self, pp: int = 1, rank: int = 0):
        self.pp, self.pp_rank = pp, rank
        self.self_comm = Communicator(MPI.COMM_SELF, "self")

    def size(self, axis):
        return self.pp if axis == "pp" else 1

    def rank(self, axis):
        return self.pp_rank if axis == "pp" else 0

    def comm(self, axis):
        return self.self_comm


def stage_costs(ranges, h):
    return [len(r) + (h if i == len(ranges) - 1 else 0) for i, r in enumerate(ranges)]


def brute_force_best(n, stages, h):
    """Minimum over every contiguous split with >= 1 layer per stage of the costliest stage."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0,) + cuts + (n,)
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        best = min(best, max(sizes[:-1] + [sizes[-1] + h]))
    return best


@pytest.mark.parametrize("h", [0.0, 0.17, 0.5, 1.0, 2.5, 5.5])
def test_split_is_contiguous_complete_and_optimal(h):
    for n in range(1, 13):
        for stages in range(1, n + 1):
            ranges = split_layers(n, stages, h)
            assert len(ranges) == stages
            assert [i for r in ranges for i in r] == list(range(n))
            assert all(len(r) >= 1 for r in ranges)
            assert max(stage_costs(ranges, h)) == pytest.approx(brute_force_best(n, stages, h)), (n, stages)


def test_split_without_head_cost_is_even_with_extra_layers_first():
    assert [len(r) for r in split_layers(10, 4)] == [3, 3, 2, 2]
    assert [len(r) for r in split_layers(8, 4)] == [2, 2, 2, 2]
    assert split_layers(5, 1) == [range(5)]


def test_split_expensive_head_takes_fewer_layers():
    # 12 layers over 4 stages with a head worth 5.5 blocks: the head stage keeps one block.
    sizes = [len(r) for r in split_layers(12, 4, head_cost=5.5)]
    assert sizes[-1] == 1 and sum(sizes) == 12
    assert max(stage_costs(split_layers(12, 4, 5.5), 5.5)) == 6.5


def test_head_cost_is_flops_ratio():
    cfg = GPTConfig(vocab_size=50257, n_embd=768)
    # LM head 2 C V FLOPs per token vs a block's 24 C^2.
    assert head_cost(cfg) == pytest.approx(2 * 768 * 50257 / (24 * 768 ** 2))


def test_split_rejects_too_few_layers():
    with pytest.raises(ConfigError, match="n_layer=3"):
        split_layers(3, 4)


CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=6, n_head=2, n_embd=16, dtype="float64")


@pytest.mark.parametrize("pp,chunks,shape", [(1, 1, "loop"), (2, 1, "loop"), (3, 1, "loop"), (2, 2, "loop"),
                                            (3, 2, "loop"), (2, 2, "v"), (3, 2, "v")])
def test_stages_partition_the_model(pp, chunks, shape):
    """Every global parameter lives on exactly one virtual stage (the head's tied copy aside),
    with the whole model's initial values; embed on v = 0, head on v = V - 1 (under ZB-V's V
    both on rank 0)."""
    whole = dict(GPT(CFG, seed=5).named_parameters())
    seen = {}
    place = schedules.Placement(pp, chunks, shape)
    for rank in range(pp):
        stages = build_stages(CFG, StubMesh(pp, rank), chunks, seed=5, placement=place)
        assert len(stages) == chunks
        for c, stage in enumerate(stages):
            v = place.stage(rank, c)
            assert stage.embed == (v == 0) and stage.head == (v == pp * chunks - 1)
            for name, p in stage.named_parameters():
                key = p.tied_to or name
                np.testing.assert_array_equal(backend.to_host(p.data), backend.to_host(whole[key].data))
                if not p.tied_to:
                    assert name not in seen, f"{name} on virtual stages {seen[name]} and {v}"
                    seen[name] = v
    assert set(seen) == set(whole)


@pytest.mark.parametrize("shape", ["loop", "v"])
def test_forward_only_schedules_send_what_is_received(shape):
    for pp, m, chunks in itertools.product((1, 2, 3, 4), (1, 3), (1, 2)):
        place = schedules.Placement(pp, chunks, shape)
        lists = [schedules.forward_only(pp, r, m, chunks, place) for r in range(pp)]
        tags = {k: sorted(schedules.message_tag(a, r, place, m) for r, acts in enumerate(lists) for a in acts
                          if a.kind == k)
                for k in ("send_act", "recv_act")}
        assert tags["send_act"] == tags["recv_act"]
        local = sum(place.local(r, c, +1) is not None for r in range(pp) for c in range(chunks))
        assert len(tags["recv_act"]) == (pp * chunks - 1 - local) * m
        assert sum(a.kind == "forward" for acts in lists for a in acts) == pp * chunks * m


def batches_for(m, mbs=2, t=8, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 32, (mbs, t)), rng.integers(0, 32, (mbs, t))) for _ in range(m)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_executor_single_stage_matches_plain_loop(name):
    m = 3
    batches = batches_for(m)
    stages = build_stages(CFG, StubMesh(), 1, seed=2)
    tracer = Tracer(rank=0)
    ex = PipelineExecutor(stages, StubMesh(), schedules.build(name, 1, m)[0], m, tracer=tracer)
    losses = ex.run(batches)
    ref = GPT(CFG, seed=2)
    ref_losses = []
    for x, y in batches:
        loss = ref(x, y)
        ref_losses.append(loss.item())
        loss.backward(backend.array_module(loss.data).asarray(1.0 / m, dtype=loss.dtype))  # as the executor does
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-13)
    ref_params = dict(ref.named_parameters())
    for n, p in stages[0].named_parameters():
        np.testing.assert_allclose(backend.to_host(p.grad), backend.to_host(ref_params[n].grad), rtol=1e-12, atol=1e-15)
    assert 0.0 <= ex.measured_bubble() < 1.0
    assert ex.run(batches[:2], forward_only=True) == pytest.approx(
        [ref(x, y).item() for x, y in batches[:2]], rel=1e-13)
    assert sum(e[0] == "forward" for e in tracer.events) == m + 2
    assert sum(e[0] == "backward" for e in tracer.events) == m


def test_executor_rejects_wrong_batch_count():
    stages = build_stages(CFG, StubMesh(), 1, seed=2)
    ex = PipelineExecutor(stages, StubMesh(), schedules.build("1f1b", 1, 2)[0], 2)
    with pytest.raises(ValueError, match="schedule has 2"):
        ex.run(batches_for(3))


def test_disabled_tracer_records_nothing_and_trace_is_json(tmp_path):
    stages = build_stages(CFG, StubMesh(), 1, seed=2)
    tracer = Tracer(rank=0, enabled=False)
    PipelineExecutor(stages, StubMesh(), schedules.build("1f1b", 1, 2)[0], 2, tracer=tracer).run(batches_for(2))
    assert tracer.events == []
    tracer.enabled = True
    tracer.record("forward", "compute", 1.0, 1.5, tid=1, args={"mb": 0})
    path = tmp_path / "trace.json"
    tracer.write_chrome_trace(path, Communicator.local())
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert spans == [{"name": "forward", "cat": "compute", "ph": "X", "pid": 0, "tid": 1, "ts": 0.0,
                      "dur": pytest.approx(5e5), "args": {"mb": 0}}]
