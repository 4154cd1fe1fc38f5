"""Mesh coordinates and sub-communicators against hand-computed tables.

Shapes are written dp x tp x pp. Each table lists, for every world rank, its
(pp, dp, tp) coordinates and, per axis set, the groups of world ranks in
sub-communicator rank order. Shapes that do not fit the world size are skipped.
"""

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar import backend
from hpcpar.cli import info
from hpcpar.runtime import topology
from hpcpar.errors import MeshError
from hpcpar.runtime.mesh import Mesh
from hpcpar.runtime.topology import Placement

N = MPI.COMM_WORLD.Get_size()
ONE = lambda n: [[r] for r in range(n)]  # noqa: E731 - every rank alone
ALL = lambda n: [list(range(n))]  # noqa: E731 - every rank together

CASES = {
    # dp, tp, pp: coords (pp, dp, tp) per rank; groups per axis key; embedding groups
    (1, 1, 1): dict(coords=[(0, 0, 0)],
                    groups={"pp": ONE(1), "dp": ONE(1), "tp": ONE(1), ("dp", "tp"): ONE(1)}, embedding=None),
    (2, 1, 1): dict(coords=[(0, 0, 0), (0, 1, 0)],
                    groups={"pp": ONE(2), "dp": [[0, 1]], "tp": ONE(2), ("pp", "tp"): ONE(2)}, embedding=None),
    (1, 2, 1): dict(coords=[(0, 0, 0), (0, 0, 1)],
                    groups={"pp": ONE(2), "dp": ONE(2), "tp": [[0, 1]], ("dp", "tp"): [[0, 1]]}, embedding=None),
    (1, 1, 2): dict(coords=[(0, 0, 0), (1, 0, 0)],
                    groups={"pp": [[0, 1]], "dp": ONE(2), "tp": ONE(2)}, embedding=[[0, 1]]),
    (3, 1, 1): dict(coords=[(0, 0, 0), (0, 1, 0), (0, 2, 0)],
                    groups={"pp": ONE(3), "dp": [[0, 1, 2]], "tp": ONE(3), ("dp", "tp"): [[0, 1, 2]]},
                    embedding=None),
    (2, 2, 1): dict(coords=[(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)],
                    groups={"pp": ONE(4), "dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]],
                            ("dp", "tp"): ALL(4), ("pp", "dp"): [[0, 2], [1, 3]], ("pp", "tp"): [[0, 1], [2, 3]]},
                    embedding=None),
    (1, 2, 2): dict(coords=[(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)],
                    groups={"pp": [[0, 2], [1, 3]], "dp": ONE(4), "tp": [[0, 1], [2, 3]],
                            ("dp", "tp"): [[0, 1], [2, 3]], ("pp", "dp"): [[0, 2], [1, 3]], ("pp", "tp"): ALL(4)},
                    embedding=[[0, 2], [1, 3]]),
    (4, 1, 1): dict(coords=[(0, 0, 0), (0, 1, 0), (0, 2, 0), (0, 3, 0)],
                    groups={"pp": ONE(4), "dp": ALL(4), "tp": ONE(4), ("pp", "dp"): ALL(4), ("pp", "tp"): ONE(4)},
                    embedding=None),
    (1, 1, 4): dict(coords=[(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0)],
                    groups={"pp": ALL(4), "dp": ONE(4), "tp": ONE(4), ("dp", "tp"): ONE(4)},
                    embedding=[[0, 3]]),
    (2, 1, 2): dict(coords=[(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)],
                    groups={"pp": [[0, 2], [1, 3]], "dp": [[0, 1], [2, 3]], "tp": ONE(4),
                            ("pp", "dp"): ALL(4), ("dp", "tp"): [[0, 1], [2, 3]]},
                    embedding=[[0, 2], [1, 3]]),
}
FITTING = [shape for shape in CASES if np.prod(shape) == N]


def members(comm) -> list[int]:
    """World ranks of a Communicator's members, in its rank order."""
    return comm.all_gather(np.array([MPI.COMM_WORLD.Get_rank()], dtype=np.int64)).tolist()


@pytest.fixture
def make_mesh():
    made = []

    def build(*args, **kw):
        m = Mesh(*args, **kw)
        made.append(m)
        return m
    yield build
    for m in made:
        m.free()


@pytest.mark.skipif(not FITTING, reason=f"no hand-computed shape for {N} ranks")
@pytest.mark.parametrize("shape", list(CASES), ids=lambda s: "dp%dxtp%dxpp%d" % s)
def test_coordinates_and_sub_communicators(make_mesh, shape):
    if np.prod(shape) != N:
        pytest.skip(f"{shape} needs {np.prod(shape)} ranks")
    dp, tp, pp = shape
    case = CASES[shape]
    m = make_mesh(dp=dp, tp=tp, pp=pp)
    me = MPI.COMM_WORLD.Get_rank()
    assert m.coords == {**dict(zip(("pp", "dp", "tp"), case["coords"][me])), "cp": 0}
    assert (m.size("pp"), m.size("dp"), m.size("tp")) == (pp, dp, tp)
    assert (m.rank("pp"), m.rank("dp"), m.rank("tp")) == case["coords"][me]
    seen = {key: members(m.comm(key)) for key in case["groups"]}
    for key, groups in case["groups"].items():
        mine = [g for g in groups if me in g]
        assert seen[key] == mine[0], f"axis {key}"
        assert m.comm(key).size == len(mine[0])
    assert members(m.world) == list(range(N))
    stage = case["coords"][me][0]
    assert m.prev_stage == (stage - 1 if stage > 0 else None)
    assert m.next_stage == (stage + 1 if stage < pp - 1 else None)
    if case["embedding"] is None:
        assert m.embedding_comm is None
    else:
        mine = [g for g in case["embedding"] if me in g]
        got = members(m.embedding_comm) if m.embedding_comm is not None else None
        assert got == (mine[0] if mine else None)


@pytest.mark.skipif(N != 4, reason="needs 4 ranks")
def test_sub_communicator_collectives_match_the_reference(make_mesh):
    m = make_mesh(dp=2, tp=2, pp=1)
    me = MPI.COMM_WORLD.Get_rank()
    x = np.full(3, float(me + 1))
    tp_sum = m.comm("tp").all_reduce(x)
    dp_max = m.comm("dp").all_reduce(x, op="max")
    everyone = m.comm(("tp", "dp")).all_reduce(x)
    # tp groups {0,1},{2,3}: sums 1+2, 3+4; dp groups {0,2},{1,3}: max 3, 4.
    assert tp_sum.tolist() == [[3.0, 7.0][me // 2]] * 3
    assert dp_max.tolist() == [[3.0, 4.0][me % 2]] * 3
    assert everyone.tolist() == [10.0] * 3


def test_axis_sets_are_canonical_and_cached(make_mesh):
    m = make_mesh(dp=N)
    assert m.comm(("tp", "dp")) is m.comm(("dp", "tp"))
    assert m.comm(("tp", "dp")).name == "dp+tp"
    assert m.comm("dp") is m.comm(["dp"])
    assert m.comm(("pp", "dp", "cp", "tp")) is m.world and m.world.name == "world"
    assert m.comm(("cp", "dp")).name == "dp+cp" and m.comm(("cp", "dp")).size == N
    assert m.size(("dp", "tp")) == N and m.rank("dp") == MPI.COMM_WORLD.Get_rank()


def test_node_communicator_and_placement(make_mesh):
    m = make_mesh(tp=N)
    p = m.placement()
    # One machine (every rank one host) or several (tests/cluster runs this suite across nodes).
    hosts = tuple(MPI.COMM_WORLD.allgather(MPI.Get_processor_name()))
    order = list(dict.fromkeys(hosts))
    assert m.node_comm.size == hosts.count(MPI.Get_processor_name()) and m.node_comm.name == "node"
    assert p.hostnames == hosts
    assert p.nodes == tuple(order.index(h) for h in hosts)
    assert p.tp_groups == (tuple(range(N)),)
    one_node = len(order) == 1
    assert p.ok == one_node
    assert f"every tp group inside one node: {'yes' if one_node else 'NO'}" in p.report()


def test_placement_report_flags_tp_groups_that_span_nodes():
    p = Placement(hostnames=("a", "a", "b", "b"), nodes=(0, 0, 1, 1), tp_groups=((0, 1), (2, 3)),
                  tp_in_one_node=(True, True))
    assert p.ok and "2 node(s)" in p.report()
    bad = Placement(hostnames=("a", "b", "a", "b"), nodes=(0, 1, 0, 1), tp_groups=((0, 1), (2, 3)),
                    tp_in_one_node=(False, False))
    assert not bad.ok
    assert "inside one node: NO" in bad.report() and "tp group ranks [0, 1]: SPANS NODES (a, b)" in bad.report()
    assert p.warning() is None
    assert bad.warning().startswith("placement: 2 of 2 tp group(s) span nodes (first: ranks [0, 1] on a, b): ")


@pytest.mark.parametrize("degrees, message", [
    (dict(dp=N + 1), rf"mesh dp={N + 1} x tp=1 x pp=1 = {N + 1} ranks, but the world has {N} ranks; "
                     rf"the product of dp, tp and pp must equal the number of ranks \(e.g. dp={N} x tp=1 x pp=1\)"),
    (dict(dp=1, tp=2 * N), rf"mesh dp=1 x tp={2 * N} x pp=1 = {2 * N} ranks, but the world has {N} ranks"),
    (dict(dp=0, tp=N), rf"mesh dp=0 x tp={N} x pp=1: dp must be a positive integer; .* \({N}\), "
                       rf"e.g. dp=1 x tp={N} x pp=1"),
    (dict(dp=N, tp=-1, pp=0), rf"mesh dp={N} x tp=-1 x pp=0: tp, pp must be a positive integer"),
    (dict(dp=1.5), "mesh dp=1.5 x tp=1 x pp=1: dp must be a positive integer"),
    (dict(dp=True), "mesh dp=True x tp=1 x pp=1: dp must be a positive integer"),
])
def test_bad_degrees_raise_mesh_error_on_every_rank(degrees, message):
    with pytest.raises(MeshError, match=message):
        Mesh(**degrees)


def test_unknown_axes(make_mesh):
    m = make_mesh(dp=N)
    for axes in ("xp", ("dp", "sp"), (), ("dp", "dp"), ("dp", "ep")):
        with pytest.raises(MeshError, match="the axes are pp, dp, cp and tp"):
            m.comm(axes)
    with pytest.raises(MeshError, match=r"unknown or repeated mesh axes \['xp'\]"):
        m.size("xp")
    assert m.size("cp") == 1 and m.rank("cp") == 0
    with pytest.raises(MeshError):
        m.rank("x")


# Expert groups on 4 ranks: (mesh kwargs) -> {axis: groups of world ranks in sub-communicator order}.
EXPERT_CASES = [
    (dict(dp=4, ep=2), {"ep": [[0, 1], [2, 3]], "edp": [[0, 2], [1, 3]], "edp_shard": [[0, 2], [1, 3]]}),
    (dict(dp=4, ep=4), {"ep": ALL(4), "edp": ONE(4), "edp_shard": ONE(4)}),
    (dict(dp=4, ep=1), {"ep": ONE(4), "edp": ALL(4), "edp_shard": ALL(4)}),
    (dict(dp=2, tp=2, ep=2), {"ep": [[0, 2], [1, 3]], "edp": ONE(4), "edp_shard": ONE(4)}),
    (dict(dp=2, pp=2, ep=2), {"ep": [[0, 1], [2, 3]], "edp": ONE(4), "edp_shard": ONE(4)}),
    # HSDP: ep inside dp_shard; the edp group spans the replicas, edp_shard does not.
    (dict(dp=4, dp_replicate=2, ep=2), {"ep": [[0, 1], [2, 3]], "edp": [[0, 2], [1, 3]], "edp_shard": ONE(4)}),
]


@pytest.mark.skipif(N != 4, reason="the expert-group tables are for 4 ranks")
@pytest.mark.parametrize("case", range(len(EXPERT_CASES)))
def test_expert_groups(make_mesh, case):
    kw, expected = EXPERT_CASES[case]
    m = make_mesh(**kw)
    rank = MPI.COMM_WORLD.Get_rank()
    for axis, groups in expected.items():
        mine = next(g for g in groups if rank in g)
        comm = m.comm(axis)
        members = comm.all_gather_object(rank)
        assert members == mine and m.size(axis) == len(mine) and m.rank(axis) == mine.index(rank), (axis, members)


def test_ep_must_divide_dp_shard():
    with pytest.raises(MeshError, match=rf"mesh.ep={N + 1} does not divide dp_shard \(dp / dp_replicate\)={N}"):
        Mesh(dp=N, ep=N + 1)


def test_info_fills_dp_with_the_config_rule():
    # `hpcpar info`: tp and pp left out are 1, dp left out fills the world as the config's dp = 0 does.
    assert topology.resolve_degrees(12, 0, 2, 3) == (2, 2, 3, 1)
    assert topology.resolve_degrees(8, 2, 4, 1) == (2, 4, 1, 1)
    assert topology.resolve_degrees(8, 0, 2, 1, 2) == (2, 2, 1, 2)
    with pytest.raises(MeshError, match=rf"mesh tp={N + 1} x pp=1 = {N + 1} does not divide the world size {N}"):
        info.report(tp=N + 1)
    with pytest.raises(MeshError, match=f"mesh pp=0: pp must be a positive integer \\(dp fills the rest of the {N}"):
        info.report(pp=0)
    with pytest.raises(MeshError, match=rf"= {2 * N} ranks, but the world has {N} ranks"):
        info.report(dp=N, tp=2)


def test_info_report_is_returned_on_rank_zero_only():
    text = info.report()
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert f"world size: {N}" in text and "MPI library: " in text and "mesh:" not in text
        assert "mpi4py: " in text and f"backend: {backend.name()} " in text and "threads per rank: " in text
    else:
        assert text == ""


def test_info_report_with_degrees():
    text = info.report(pp=N)
    nodes = len(set(MPI.COMM_WORLD.allgather(MPI.Get_processor_name())))
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert f"mesh: pp={N} x dp=1 x tp=1" in text
        rows = [line.split() for line in text.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
        assert [tuple(map(int, r[:4])) for r in rows] == [(r, r, 0, 0) for r in range(N)]
        assert f"placement: {nodes} node(s)" in text
    else:
        assert text == ""


def test_info_report_bad_degrees_raise_everywhere():
    with pytest.raises(MeshError, match=f"the world has {N} ranks"):
        info.report(dp=N + 1, tp=1)


# dp, cp, tp, pp -> per world rank (pp, dp, cp, tp) and groups; cp sits between dp and tp.
CP_CASES = {
    (1, 2, 2, 1): dict(coords=[(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1)],
                       groups={"cp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]], ("dp", "cp"): [[0, 2], [1, 3]]},
                       embedding=None),
    (2, 2, 1, 1): dict(coords=[(0, 0, 0, 0), (0, 0, 1, 0), (0, 1, 0, 0), (0, 1, 1, 0)],
                       groups={"cp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], ("dp", "cp"): ALL(4)},
                       embedding=None),
    (1, 2, 1, 2): dict(coords=[(0, 0, 0, 0), (0, 0, 1, 0), (1, 0, 0, 0), (1, 0, 1, 0)],
                       groups={"cp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]], ("dp", "cp"): [[0, 1], [2, 3]]},
                       embedding=[[0, 2], [1, 3]]),
    (1, 2, 1, 1): dict(coords=[(0, 0, 0, 0), (0, 0, 1, 0)],
                       groups={"cp": [[0, 1]], ("dp", "cp"): [[0, 1]], "tp": ONE(2)}, embedding=None),
}


@pytest.mark.parametrize("shape", list(CP_CASES), ids=lambda s: "dp%dxcp%dxtp%dxpp%d" % s)
def test_context_parallel_axis_sits_between_dp_and_tp(make_mesh, shape):
    if np.prod(shape) != N:
        pytest.skip(f"{shape} needs {np.prod(shape)} ranks")
    dp, cp, tp, pp = shape
    case = CP_CASES[shape]
    m = make_mesh(dp=dp, tp=tp, pp=pp, cp=cp)
    me = MPI.COMM_WORLD.Get_rank()
    assert m.coords == dict(zip(("pp", "dp", "cp", "tp"), case["coords"][me]))
    for key, groups in case["groups"].items():
        assert members(m.comm(key)) == next(g for g in groups if me in g), f"axis {key}"
    if case["embedding"] is not None:
        assert members(m.embedding_comm) == next(g for g in case["embedding"] if me in g)
    assert f"cp={cp}" in m.shape_str()
    header = m.rank_table().splitlines()[0].split()
    assert header[:5] == ["rank", "pp", "dp", "cp", "tp"]


def test_info_report_shows_the_cp_axis():
    if N % 2:
        pytest.skip("needs an even world")
    text = info.report(cp=2)
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert f"mesh: pp=1 x dp={N // 2} x cp=2 x tp=1" in text
    if N != 2:
        with pytest.raises(MeshError, match=r"mesh dp=1 x cp=2 x tp=1 x pp=1 = 2 ranks, but the world has"):
            info.report(dp=1, cp=2)


@pytest.mark.skipif(N != 4, reason="needs 4 ranks")
def test_hsdp_splits_dp_into_replicate_and_shard(make_mesh):
    """dp = dp_replicate x dp_shard, dp_shard inner: ranks keep their dp coordinate and their data."""
    m = make_mesh(dp=4, dp_replicate=2)
    me = MPI.COMM_WORLD.Get_rank()
    assert m.coords == {"pp": 0, "dp": me, "cp": 0, "tp": 0}
    assert (m.size("dp"), m.size("dp_replicate"), m.size("dp_shard")) == (4, 2, 2)
    assert (m.rank("dp_replicate"), m.rank("dp_shard")) == (me // 2, me % 2)
    assert members(m.comm("dp_shard")) == [[0, 1], [2, 3]][me // 2]
    assert members(m.comm("dp_replicate")) == [[0, 2], [1, 3]][me % 2]
    assert members(m.comm("dp")) == [0, 1, 2, 3] and m.comm("dp").name == "dp"
    assert m.comm(("dp_shard", "cp")).name == "dp_shard+cp" and m.comm(("dp", "cp")).name == "dp+cp"
    assert m.shape_str() == "pp=1 x dp=4 (dp_replicate=2 x dp_shard=2) x tp=1"
    assert "dp_replicate" in m.rank_table().splitlines()[0]
    assert "every dp_shard group inside one node: yes" in m.placement().report()
    assert m.placement().dp_shard_groups == ((0, 1), (2, 3))
    plain = make_mesh(dp=4)  # without HSDP the shard group is dp itself, under the same name
    assert plain.comm(("dp_shard", "cp")) is plain.comm(("dp", "cp")) and plain.comm("dp_shard").name == "dp"
    assert plain.comm("dp_replicate").size == 1 and plain.size("dp_replicate") == 1
    with pytest.raises(MeshError, match=r"mesh.dp_replicate=3 does not divide mesh.dp=4 .*choose dp_replicate in "
                                        r"\{1, 2, 4\}"):
        Mesh(dp=4, dp_replicate=3)
