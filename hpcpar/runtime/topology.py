"""Mesh topology without MPI: the axis names, the degree rules, and where ranks run.

Pure arithmetic that imports no mpi4py (not even transitively): config validation, the planner
and `hpcpar info` use it on login nodes, where MPI_Init may fail. `Mesh` (runtime/mesh.py) builds
its communicators from it.

- `Axis` and the axis tuples: the four degrees pp, dp, cp, tp (pp outermost, tp innermost); dp is
  the two Cartesian axes dp_replicate x dp_shard (`CART_AXES`); the expert groups ep, edp and
  edp_shard borrow ranks of dp_shard x cp (`EXPERT_AXES`). `cart_axes_of` maps axis names to the
  Cartesian axes they span.
- `resolve_degrees`: the one rule that turns the `[mesh]` section's degrees (0 = auto) into
  (dp, tp, pp, cp) for a world size; config validation calls it on every rank before any
  collective. `validate_degrees`, `check_dp_replicate` and `check_ep`: the guards `Mesh` applies
  to the degrees it is given.
- `Placement`: each rank's host and node, and whether every tp (and dp_shard) group lies inside
  one node (gathered by `Mesh` at creation).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from hpcpar.errors import ConfigError, MeshError
from hpcpar.schema import divisors


class Axis(str, enum.Enum):
    """A mesh axis. A str too, so `Axis.DP` and "dp" name the same axis everywhere (keys, arguments,
    config values); code says `Axis.DP`, users and files say "dp"."""

    PP = "pp"
    DP = "dp"              # dp_replicate x dp_shard together
    CP = "cp"
    TP = "tp"
    DP_REPLICATE = "dp_replicate"  # HSDP: the replicas of a sharded model (across nodes)
    DP_SHARD = "dp_shard"          # the ranks ZeRO/FSDP shard over (with cp: dp_shard x cp)
    # Expert parallelism borrows ranks from dp_shard x cp (not Cartesian axes: `Cart.Split`s of them).
    EP = "ep"                      # ranks that divide the experts among them (all-to-all dispatch)
    EDP = "edp"                    # expert data parallelism: the ranks holding the same experts
    EDP_SHARD = "edp_shard"        # those of them inside dp_shard x cp (ZeRO shards expert state over them)

    __str__ = str.__str__
    __format__ = str.__format__


AXES = (Axis.PP, Axis.DP, Axis.CP, Axis.TP)  # the four degrees, pp outermost, tp innermost
EXPERT_AXES = (Axis.EP, Axis.EDP, Axis.EDP_SHARD)
# The Cartesian axes: dp is dp_replicate x dp_shard, dp_shard the inner one.
CART_AXES = (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP, Axis.TP)


def is_positive_int(value) -> bool:
    """Whether `value` is a degree: an int (Python's or NumPy's, not a bool) of at least 1."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def _shape(degrees: dict) -> str:
    """"dp=2 x tp=1 x pp=2", with "cp=.." after dp only when context parallelism is used (cp != 1)."""
    return " x ".join(f"{k}={v}" for k, v in degrees.items() if k != "cp" or v != 1)


def _axes_named(degrees: dict) -> str:
    """"dp, tp and pp" (or "dp, cp, tp and pp" when cp is shown): the degrees whose product counts."""
    names = [k for k in degrees if k != "cp" or degrees[k] != 1]
    return ", ".join(names[:-1]) + " and " + names[-1]


def _fits_message(degrees: dict, world: int) -> str:
    """A suggestion that fits `world`: keep tp, pp (and cp) when they divide it, fill dp."""
    tp, pp, cp = degrees["tp"], degrees["pp"], degrees.get("cp", 1)
    if is_positive_int(tp) and is_positive_int(pp) and is_positive_int(cp) and world % (tp * pp * cp) == 0:
        return "e.g. " + _shape({"dp": world // (tp * pp * cp), "cp": cp, "tp": tp, "pp": pp})
    return f"e.g. dp={world} x tp=1 x pp=1"


def validate_degrees(dp: int, tp: int, pp: int, world: int, cp: int = 1, dp_replicate: int = 1) -> None:
    """Raise MeshError unless dp, tp, pp, cp are positive integers whose product is `world` and
    `dp_replicate` divides dp.

    The guard of explicitly given degrees (`Mesh`); degrees a user may leave to "auto" go
    through `resolve_degrees` first, which reports in the config's terms.
    """
    degrees = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
    shape, axes = _shape(degrees), _axes_named(degrees)
    bad = [k for k, v in degrees.items() if not is_positive_int(v)]
    if bad:
        raise MeshError(f"mesh {shape}: {', '.join(bad)} must be a positive integer; the product of {axes} "
                        f"must equal the number of ranks ({world}), {_fits_message(degrees, world)}")
    product = dp * tp * pp * cp
    if product != world:
        raise MeshError(f"mesh {shape} = {product} ranks, but the world has {world} ranks; the product of "
                        f"{axes} must equal the number of ranks ({_fits_message(degrees, world)})")
    check_dp_replicate(dp, dp_replicate)


def check_dp_replicate(dp: int, dp_replicate: int) -> None:
    """Raise MeshError unless `dp_replicate` is a positive divisor of dp (dp = dp_replicate x dp_shard)."""
    if not is_positive_int(dp_replicate) or dp % dp_replicate:
        raise MeshError(f"mesh.dp_replicate={dp_replicate} does not divide mesh.dp={dp} (HSDP splits dp into "
                        f"dp_replicate x dp_shard); choose dp_replicate in "
                        f"{{{', '.join(map(str, divisors(dp)))}}}")


def check_ep(ep: int, dp_shard: int, cp: int = 1) -> None:
    """Raise MeshError unless `ep` is a positive divisor of dp_shard x cp (the ranks it borrows)."""
    if not is_positive_int(ep) or (dp_shard * cp) % ep:
        shard = "dp_shard x cp" if cp > 1 else "dp_shard (dp / dp_replicate)"
        raise MeshError(f"mesh.ep={ep} does not divide {shard}={dp_shard * cp} (expert parallelism borrows the "
                        f"data-parallel ranks); choose ep in {{{', '.join(map(str, divisors(dp_shard * cp)))}}}")


def resolve_degrees(world: int, dp: int = 0, tp: int = 0, pp: int = 0, cp: int = 0) -> tuple[int, int, int, int]:
    """(dp, tp, pp, cp) for `world` ranks, filling in the degrees given as 0 (auto): the `[mesh]` rule.

    Rule: tp = 1 and cp = 1 when auto; pp = 2 when auto, the world is even and >= 4, and dp, tp and
    cp are all auto, else 1; dp = world // (tp * pp * cp) when auto. So 4 ranks give dp=2 x pp=2
    and one rank 1x1x1. Pure (no MPI), so config validation calls it on every rank before any
    collective. Raises ConfigError for a negative degree, MeshError when tp * pp * cp does not
    divide the world (dp auto) or when the degrees do not multiply to `world`.
    """
    if world < 1:
        raise MeshError(f"world size must be >= 1, got {world}")
    given = {Axis.DP: dp, Axis.TP: tp, Axis.PP: pp, Axis.CP: cp}
    for axis, value in given.items():
        if value < 0:
            raise ConfigError(f"mesh.{axis}={value} is invalid: use a positive degree or 0 (auto)")
    tp, cp = tp or 1, cp or 1
    if not pp:
        everything_auto = dp == 0 and given[Axis.TP] == 0 and given[Axis.CP] == 0
        pp = 2 if world >= 4 and world % 2 == 0 and everything_auto else 1
    if not dp:
        if world % (tp * pp * cp):
            what = _shape({"cp": cp, "tp": tp, "pp": pp})
            size = f"{'cp * ' if cp != 1 else ''}tp * pp"
            raise MeshError(f"mesh {what} = {tp * pp * cp} does not divide the world size {world}; "
                            f"choose {size} in {{{', '.join(map(str, divisors(world)))}}} or launch a multiple "
                            f"of {tp * pp * cp} ranks")
        dp = world // (tp * pp * cp)
    if dp * tp * pp * cp != world:
        resolved = {Axis.DP: dp, Axis.CP: cp, Axis.TP: tp, Axis.PP: pp}
        shown = ", ".join(f"{axis}={resolved[axis]}{'' if given[axis] else ' (auto)'}" for axis in resolved
                          if axis != Axis.CP or cp != 1)
        raise MeshError(f"mesh {shown}: product {dp * tp * pp * cp} != world size {world}; choose degrees "
                        f"whose product is {world}, or set some to 0 (auto)")
    return dp, tp, pp, cp


def cart_axes_of(axes: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Cartesian axes in order, checked: "tp" -> ("tp",); ("tp", "dp") -> ("dp_replicate",
    "dp_shard", "tp") (dp is both dp sub-axes)."""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    expanded = [x for a in names for x in ((Axis.DP_REPLICATE, Axis.DP_SHARD) if a == Axis.DP else (a,))]
    unknown = [a for a in names if a not in AXES and a not in CART_AXES]
    if unknown or not names or len(set(expanded)) != len(expanded):
        raise MeshError(f"unknown or repeated mesh axes {list(names)}; the axes are pp, dp, cp and tp "
                        "(dp = dp_replicate x dp_shard), the expert groups ep, edp and edp_shard (alone)")
    return tuple(a for a in CART_AXES if a in expanded)


@dataclass(frozen=True)
class Placement:
    """Where the ranks run and whether every tp group lies inside one node.

    Attributes:
        hostnames: processor name of each mesh rank (index = rank in the mesh's world).
        nodes: node index of each mesh rank (ranks that share memory share a node).
        tp_groups: the mesh ranks of each tp group.
        tp_in_one_node: per tp group, whether all its ranks are on one node.
        dp_shard_groups: the mesh ranks of each dp_shard group (those ZeRO/FSDP shard over).
        dp_shard_in_one_node: per dp_shard group, whether all its ranks are on one node.
    """

    hostnames: tuple[str, ...]
    nodes: tuple[int, ...]
    tp_groups: tuple[tuple[int, ...], ...]
    tp_in_one_node: tuple[bool, ...]
    dp_shard_groups: tuple[tuple[int, ...], ...] = ()
    dp_shard_in_one_node: tuple[bool, ...] = ()

    @property
    def ok(self) -> bool:
        """True when every tp group is inside one node."""
        return all(self.tp_in_one_node)

    def warning(self) -> str | None:
        """One line for the job's log when a tp group spans nodes (None when none does): its
        all-reduces, two per layer and micro-batch, then cross the network."""
        spanning = [list(g) for g, inside in zip(self.tp_groups, self.tp_in_one_node) if not inside]
        if not spanning:
            return None
        return (f"placement: {len(spanning)} of {len(self.tp_groups)} tp group(s) span nodes (first: ranks "
                f"{spanning[0]} on {', '.join(sorted({self.hostnames[r] for r in spanning[0]}))}): tp's all-reduces "
                "cross the network; place consecutive ranks on one node (e.g. mpiexec -ppn, srun "
                "--ntasks-per-node, a multiple of tp) or lower mesh.tp")

    def report(self) -> str:
        lines = [f"placement: {len(set(self.nodes))} node(s); every tp group inside one node: "
                 f"{'yes' if self.ok else 'NO'}"]
        for group, inside in zip(self.tp_groups, self.tp_in_one_node):
            hosts = sorted({self.hostnames[r] for r in group})
            lines.append(f"  tp group ranks {list(group)}: {'one node' if inside else 'SPANS NODES'} "
                         f"({', '.join(hosts)})")
        if self.dp_shard_groups:
            lines.append(f"every dp_shard group inside one node: {'yes' if all(self.dp_shard_in_one_node) else 'NO'}")
            for group, inside in zip(self.dp_shard_groups, self.dp_shard_in_one_node):
                hosts = sorted({self.hostnames[r] for r in group})
                lines.append(f"  dp_shard group ranks {list(group)}: {'one node' if inside else 'SPANS NODES'} "
                             f"({', '.join(hosts)})")
        return "\n".join(lines)
