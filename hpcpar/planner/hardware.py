"""What the planner knows about a machine: `Hardware` figures per rank, and collective times.

A `Hardware` is a vendor preset (`PRESETS`: a100, h100) or "this": the figures `hpcpar plan
--calibrate` measured (`training.calibrate`) and stored as JSON at `calibration_path()`
(`save_hardware` / `load_hardware`). Calibrated machines add what the cost model's pieces leave
out, each fitted to real steps: per-step and per-micro-batch overheads; the tp traffic's scale
for each tp degree and the cp ring's (not assumed hidden behind attention: the measured ratio
says what is); and, where ranks share cores (`cores_per_rank` = cores / ranks < 1, the layer
times measured with every rank busy), the share of a core a rank computes with.

Collectives follow the alpha-beta model of a ring over n ranks: all-reduce 2(n-1)(alpha +
bytes/(n beta)), all-gather and reduce-scatter half that, a message alpha + bytes/beta; a group
that spans nodes runs at the inter-node link's figures (`Hardware.link`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

from hpcpar.errors import ConfigError


@dataclass(frozen=True)
class Link:
    """A link level's ring figures: `alpha` seconds per message, `beta` bytes/s per rank."""

    alpha: float
    beta: float


@dataclass(frozen=True)
class Hardware:
    """What a plan knows about the machine, per rank.

    `layer_times` (calibrated only): {tp: [a_f, c_f, a_b, c_b, a_h, c_h]}, seconds of one block's
    forward (a_f + c_f * tokens) and backward, and of the LM head + loss forward and backward
    together (a_h + c_h * tokens), for the calibrated model's tp shard; `model` names that model.
    """

    name: str
    peak_flops: float            # dense GEMM FLOP/s of the model's dtype
    gemm_efficiency: float       # fraction of the peak a transformer's GEMMs reach
    memory_bandwidth: float      # bytes/s of elementwise work (activations in and out)
    memory_bytes: int            # memory a rank may fill
    ranks_per_node: int
    intra: Link
    inter: Link
    overlap: float               # fraction of the data-parallel reduction hidden behind backward
    optimizer_seconds_per_param: float
    layer_times: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    tp_scale: float = 1.0             # measured / modelled tp and cp traffic of a real step (calibrated)
    cp_scale: float = 1.0
    tp_scales: dict = field(default_factory=dict)   # tp degree -> its own tp_scale (calibrated)
    cp_hidden: float | None = None    # share of the cp ring hidden behind attention (None: `overlap`)
    cores_per_rank: float = 1.0       # < 1: ranks share cores (calibrated); see `predict`'s pipeline
    step_overhead: float = 0.0        # seconds per step the model above leaves out (calibrated)
    microbatch_overhead: float = 0.0  # seconds per micro-batch and stage likewise

    def link(self, group: int, stride: int) -> Link:
        """The link a ring of `group` ranks spaced `stride` apart in rank order runs on."""
        return self.intra if group * stride <= self.ranks_per_node else self.inter


GiB = 2**30
# Vendor peak dense 16-bit tensor-core FLOP/s and HBM bandwidth; NVLink per direction per GPU;
# one 200 Gb/s (A100, Selene as in Narayanan et al.) or 400 Gb/s (H100) HCA per GPU. The GEMM
# efficiency is the fraction of the peak cuBLAS reaches on transformer-sized 16-bit GEMMs.
PRESETS: dict[str, Hardware] = {
    "a100": Hardware("a100", 312e12, 0.70, 2.0e12, 80 * GiB, 8, Link(5e-6, 300e9), Link(10e-6, 25e9),
                     overlap=0.9, optimizer_seconds_per_param=16 / 2.0e12),
    "h100": Hardware("h100", 989e12, 0.70, 3.35e12, 80 * GiB, 8, Link(5e-6, 450e9), Link(10e-6, 50e9),
                     overlap=0.9, optimizer_seconds_per_param=16 / 3.35e12),
}


def calibration_path() -> str:
    """Where `--calibrate` stores this machine's figures ($HPCPAR_CALIBRATION, else the user cache)."""
    return os.environ.get("HPCPAR_CALIBRATION") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hpcpar", "calibration.json")


def load_hardware(name: str, path: str | None = None) -> Hardware:
    """A preset, or "this": the figures `--calibrate` stored."""
    if name in PRESETS:
        return PRESETS[name]
    if name != "this":
        raise ConfigError(f"--hardware={name!r} is not one of {', '.join([*PRESETS, 'this'])}")
    path = path or calibration_path()
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > CALIBRATION_LIMIT:
                raise ValueError(f"{os.fstat(f.fileno()).st_size} bytes, more than any calibration "
                                 f"({CALIBRATION_LIMIT >> 20} MiB)")
            raw = json.loads(f.read(CALIBRATION_LIMIT + 1))
    except FileNotFoundError:
        raise ConfigError(f"--hardware=this needs a calibration, and {path} does not exist; run "
                          "`mpiexec -n N hpcpar plan --calibrate` first (same model keys), or use "
                          "--hardware a100 or h100") from None
    except (OSError, ValueError, RecursionError) as err:   # unreadable, empty, cut short, not UTF-8 or not JSON
        raise _bad_calibration(path, err) from None
    try:
        return _figures(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as err:   # JSON, but not what --calibrate writes
        raise _bad_calibration(path, err) from None


def _figures(raw) -> Hardware:
    """The Hardware a calibration file's JSON describes, every figure checked to be a number the cost
    model can divide by (KeyError / TypeError / ValueError naming the first that is not)."""
    if not isinstance(raw, dict):
        raise TypeError(f"the file holds a JSON {type(raw).__name__}, not an object")

    def number(key: str, value, positive: bool = False) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or positive and value <= 0:
            raise ValueError(f"{key}={value!r} is not a {'positive' if positive else 'non-negative'} number")
        return value

    raw = dict(raw)
    for key in ("intra", "inter"):
        link = raw[key]
        if not isinstance(link, dict) or set(link) != {"alpha", "beta"}:
            raise ValueError(f"{key}={link!r} is not {{alpha, beta}}")
        raw[key] = Link(number(f"{key}.alpha", link["alpha"]), number(f"{key}.beta", link["beta"], True))
    if not isinstance(raw["layer_times"], dict) or not isinstance(raw.get("tp_scales", {}), dict):
        raise TypeError("layer_times and tp_scales must be JSON objects keyed by tp degree")
    for key, value in raw["layer_times"].items():
        if not isinstance(value, list) or len(value) != 6:
            raise ValueError(f"layer_times[{key!r}] is not 6 numbers")
        for x in value:
            number(f"layer_times[{key!r}]", x)
    raw["layer_times"] = {int(k): v for k, v in raw["layer_times"].items()}
    raw["tp_scales"] = {int(k): number(f"tp_scales[{k!r}]", v) for k, v in raw.get("tp_scales", {}).items()}
    for key, value in raw.items():
        if key in _POSITIVE:
            number(key, value, positive=True)
        elif key in _NON_NEGATIVE or key == "cp_hidden" and value is not None:
            number(key, value)
        if key in _FRACTIONS and value is not None and value > 1:
            raise ValueError(f"{key}={value!r} is not a fraction (at most 1)")
    if not isinstance(raw.get("name"), str) or not isinstance(raw.get("model", {}), dict):
        raise TypeError("name must be a string and model an object")
    if not all(isinstance(raw[k], int) and not isinstance(raw[k], bool) for k in ("memory_bytes", "ranks_per_node")):
        raise TypeError("memory_bytes and ranks_per_node must be integers")
    return Hardware(**raw)


# The figures the cost model divides by, and those it adds or scales with.
_POSITIVE = ("peak_flops", "gemm_efficiency", "memory_bandwidth", "memory_bytes", "ranks_per_node", "cores_per_rank")
_NON_NEGATIVE = ("overlap", "optimizer_seconds_per_param", "tp_scale", "cp_scale", "step_overhead",
                 "microbatch_overhead")
_FRACTIONS = ("gemm_efficiency", "overlap", "cp_hidden", "cores_per_rank")
CALIBRATION_LIMIT = 16 << 20   # a calibration file is a few KiB: a larger file is refused unread


def _bad_calibration(path: str, err: Exception) -> ConfigError:
    what = (err.strerror if isinstance(err, OSError) else f"no {err.args[0]!r} entry" if isinstance(err, KeyError)
            else f"not valid JSON: {err}" if isinstance(err, json.JSONDecodeError) else f"{type(err).__name__}: {err}")
    return ConfigError(f"calibration file {path} cannot be used ({what}); run `mpiexec -n N hpcpar plan --calibrate` "
                       "again to rewrite it (same model keys), or use --hardware a100 or h100")


def save_hardware(hw: Hardware, path: str | None = None) -> str:
    path = path or calibration_path()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(hw), f, indent=1, sort_keys=True)
    return path


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` over n ranks: reduce-scatter then all-gather."""
    return 0.0 if n <= 1 else 2 * (n - 1) * (link.alpha + nbytes / (n * link.beta))


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) whose full result is `nbytes`."""
    return 0.0 if n <= 1 else (n - 1) * (link.alpha + nbytes / (n * link.beta))
