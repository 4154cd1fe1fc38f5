"""Run configuration: one TOML file plus `--set section.key=value` overrides.

A `Config` is eight frozen sections: model, mesh, data, train, pipeline, checkpoint, run, ps. The
`[model]` section is the model's own config, `nn.gpt.GPTConfig`, so `GPT(cfg.model)` needs no
translation. Every field carries its documentation in `metadata["doc"]` (and its allowed values in
`metadata["choices"]` where there is a fixed set; see `schema.field`); `to_toml` writes those as
comments, so the shipped `hpcpar/defaults/default.toml` and `docs/config.md` describe the same
fields as the code.

Three steps, all pure (no communication; the only I/O is reading the TOML file), so every rank
reaches the same verdict before the first collective:

1. `load_config(path, overrides)` parses and type-checks: unknown sections or keys and wrong
   types are errors;
2. `validate(cfg, world_size, available_memory_bytes)` checks every value and combination and
   returns the same `Config` with the mesh degrees and pipeline.chunks resolved (no 0 = "auto" left);
3. `to_toml(cfg)` writes the config used into the run directory; it round-trips through
   `load_config`.

Every error is a one-line `ConfigError` (or `MeshError` for a mesh that does not fit the world)
saying what is wrong and what would be right.
"""

import dataclasses
import difflib
import functools
import math
import os
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Any, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from hpcpar import backend
from hpcpar.errors import ConfigError, MeshError
from hpcpar.nn.gpt import DTYPES, PRESETS, RECOMPUTE_MODES, GPTConfig, recomputed
from hpcpar.backend.precision import PRECISIONS
from hpcpar.schema import divisors, field as _field, require_divisible


# train.grad_compression's choices (hpcpar.parallel.dp.compression.compressors.KINDS, which imports MPI: loading a
# config must not) and the old 16-bit wire key it replaces, kept as an alias: every config.toml
# written before it (every checkpoint's too) names train.grad_wire_dtype.
COMPRESSION_KINDS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
WIRE_DTYPE_ALIAS = {"float32": "none", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class MeshConfig:
    """Parallel degrees; their product is the number of ranks. 0 = auto (`mesh.resolve_degrees`)."""

    dp: int = _field(0, "data-parallel degree (0 = auto: world // (tp * pp * cp))")
    tp: int = _field(0, "tensor-parallel degree (0 = auto: 1)")
    pp: int = _field(0, "pipeline stages (0 = auto: 2 when the world is even and >= 4 and dp, tp, "
                        "cp are auto, else 1)")
    sequence_parallel: bool = _field(False, "split LayerNorm/dropout activations along the sequence "
                                            "across tp ranks (Megatron-SP); a no-op when tp == 1")
    cp: int = _field(0, "context-parallel degree: the sequence is split over cp ranks (0 = auto: 1)")
    cp_impl: str = _field("ring", "context parallelism: ring attention (K/V passed around the cp ring, "
                                  "zigzag-balanced; block_size divisible by 2*cp) or ulysses (all-to-all "
                                  "to whole heads; n_head divisible by tp*cp)", ("ring", "ulysses"))
    dp_replicate: int = _field(1, "HSDP: dp = dp_replicate x dp_shard; ZeRO (train.zero >= 1) shards model "
                                  "state over dp_shard (x cp), ideally inside a node, and replicates it across "
                                  "dp_replicate (1 = no HSDP: the shard group is dp x cp); divides dp")
    ep: int = _field(1, "expert parallelism: the MoE experts (model.moe_experts) are divided among ep ranks "
                        "borrowed from dp_shard; divides dp_shard and moe_experts (1 = every rank holds every "
                        "expert)")


@dataclass(frozen=True)
class DataConfig:
    corpus: str = _field("", "bytes: a text file or directory of text files (\"\" = the Python standard "
                             "library's source, embedded); bin/hdf5: a token file, or a directory from "
                             "`hpcpar data prepare` (or nanoGPT's train.bin + val.bin)")
    val_fraction: float = _field(0.05, "fraction of the corpus (its tail) held out for evaluation, "
                                       "0 <= val_fraction < 1 (a directory with val.bin or a val dataset: "
                                       "that instead)")
    format: str = _field("bytes", "how the corpus is read: bytes = text as byte tokens (vocabulary 256); "
                                  "bin = a flat token file, memory-mapped (nanoGPT layout); hdf5 = a 1-D "
                                  "token dataset, read by hyperslab; each rank reads only its samples",
                         ("bytes", "bin", "hdf5"))
    token_dtype: str = _field("uint16", "integer type of a bin token file (hdf5 uses its dataset's type)",
                              ("uint16", "uint32"))


@dataclass(frozen=True)
class TrainConfig:
    steps: int = _field(300, "optimizer steps")
    micro_batch_size: int = _field(12, "sequences per micro-batch per data-parallel rank")
    microbatches: int = _field(2, "micro-batches per step (gradient accumulation / pipeline micro-batches); "
                                  "global batch = dp * micro_batch_size * microbatches sequences")
    lr: float = _field(3e-3, "peak learning rate, after warm-up (> 0)")
    min_lr: float = _field(3e-4, "learning rate at the end of the cosine decay, 0 <= min_lr <= lr")
    warmup: int = _field(20, "linear warm-up steps (>= 0; a warning when >= steps)")
    weight_decay: float = _field(0.1, "decoupled weight decay (AdamW; not applied to biases and LayerNorm)")
    beta1: float = _field(0.9, "AdamW first-moment decay, 0 < beta1 < 1")
    beta2: float = _field(0.95, "AdamW second-moment decay, 0 < beta2 < 1")
    eps: float = _field(1e-8, "AdamW denominator epsilon (> 0)")
    grad_clip: float = _field(1.0, "clip the global gradient norm to this (0 = no clipping)")
    seed: int = _field(1337, "seed of parameter initialisation and batch sampling (>= 0)")
    zero: int = _field(0, "ZeRO stage: 0 = everything replicated, 1 = optimizer state sharded over dp, "
                          "2 = gradients too, 3 = parameters too (FSDP: gathered unit by unit)", (0, 1, 2, 3))
    reshard_after_forward: bool = _field(True, "ZeRO-3: free each unit's gathered parameters after its forward "
                                               "and gather them again for backward (false: keep them from "
                                               "forward to backward, one all-gather fewer, more memory)")
    optimizer: str = _field("adamw", "optimizer", ("adamw", "sgd"))
    momentum: float = _field(0.9, "SGD momentum, 0 <= momentum < 1 (optimizer = \"sgd\" only)")
    bucket_mb: float = _field(25.0, "data-parallel gradient bucket size in MiB (> 0); with ps.servers, the size of "
                              "the push pieces sent during backward")
    grad_compression: str = _field("none", "gradient compression on the data-parallel wire: none; fp16/bf16 = "
                                           "16-bit values summed in float32; int8 = blockwise absmax int8, two "
                                           "compressed phases; topk = the compression_ratio largest entries per "
                                           "bucket as (index, value) pairs; powersgd = rank-powersgd_rank factors "
                                           "of every matrix (zero 0-2; under HSDP the dp_replicate axis is "
                                           "compressed, PowerSGD all of dp)", COMPRESSION_KINDS)
    compression_ratio: float = _field(0.01, "top-k: fraction of each bucket's entries sent, 0 < ratio <= 1")
    powersgd_rank: int = _field(4, "PowerSGD: rank of the factors P [a, r] and Q [b, r] of each [a, b] "
                                   "gradient matrix (>= 1; min(rank, a, b) per matrix)")
    compression_start_step: int = _field(0, "steps before this one reduce gradients uncompressed (warm-up), "
                                            "as PyTorch's PowerSGD hook does; topk and powersgd with error "
                                            "feedback need one (about a third of a short run): from step 0 the "
                                            "residual pays the first steps' large gradients back late")
    error_feedback: bool = _field(True, "int8, topk, powersgd: add what compression dropped (the residual, "
                                        "kept per bucket and saved in checkpoints) to the next step's gradient; "
                                        "the 16-bit wires keep none")
    int8_block_size: int = _field(256, "int8: values per float32 absmax scale (>= 1)")
    max_bad_steps: int = _field(3, "abort after this many consecutive steps with a NaN/Inf loss or "
                                   "gradient norm (each is skipped)")
    recompute: str = _field("none", "activation recomputation: none = keep every activation for backward; "
                                    "full = a block keeps only its input and runs its forward again in "
                                    "backward; selective = attention keeps no [T, T] probabilities and "
                                    "recomputes them (results are bitwise those of none)",
                            RECOMPUTE_MODES)
    recompute_every: int = _field(1, "recompute every k-th block: the blocks whose global index % k == 0 "
                                     "(1 = every block)")
    precision: str = _field("full", "full = every array in model.dtype; bf16 / fp16 = mixed precision: "
                                    "activations stored in 16 bits and computed in float32, weights read "
                                    "rounded to 16 bits; master weights, gradients and optimizer state stay "
                                    "in model.dtype (fp16 with loss scaling)", PRECISIONS)
    grad_reduce_dtype: str = _field("fp32", "dtype of the data-parallel gradient reduction: fp32 = the "
                                            "gradients' own (model.dtype); bf16 / fp16 = 16-bit values summed in "
                                            "float32 (the same as grad_compression = \"bf16\" / \"fp16\")",
                                    ("fp32", "bf16", "fp16"))
    loss_scale: float = _field(0.0, "precision = fp16: a static loss scale (> 0), or 0 = dynamic loss scaling")
    initial_loss_scale: float = _field(65536.0, "dynamic loss scaling: the first scale (> 0)")
    loss_scale_window: int = _field(1000, "dynamic loss scaling: steps without overflow before the scale "
                                          "grows (>= 1)")
    loss_scale_growth: float = _field(2.0, "dynamic loss scaling: growth factor (> 1)")
    loss_scale_backoff: float = _field(0.5, "dynamic loss scaling: backoff factor after an overflow, in (0, 1)")
    loss_scale_hysteresis: int = _field(2, "dynamic loss scaling: overflows tolerated since the last growth "
                                           "before the scale backs off (>= 1)")
    min_loss_scale: float = _field(1.0, "dynamic loss scaling: the scale never backs off below this (> 0); an "
                                        "overflow at the minimum counts as a bad step (train.max_bad_steps)")


@dataclass(frozen=True)
class PipelineConfig:
    schedule: str = _field("1f1b", "pipeline schedule: gpipe, 1f1b, interleaved (chunks > 1), zbh1 / zbv "
                                   "(zero bubble: backward split into B and W; zbv runs two chunks per rank in a V)",
                           ("gpipe", "1f1b", "interleaved", "zbh1", "zbv"))
    chunks: int = _field(0, "model chunks per pipeline rank (0 = the schedule's own: 2 for zbv, else 1; "
                            "> 1 only with schedule = \"interleaved\")")
    trace: bool = _field(False, "write a per-rank timeline of pipeline actions into the run directory")


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = _field("", "checkpoint directory (\"\" = <run.dir>/checkpoints)")
    every: int = _field(0, "save every this many steps (0 = only at the end)")
    keep: int = _field(3, "keep the newest this many checkpoints (>= 1)")
    resume: str = _field("", "\"\" = start fresh, \"auto\" = newest checkpoint in dir if any, "
                             "or a checkpoint path")
    async_save: bool = _field(False, "write checkpoints in a background thread while training goes on")
    format: str = _field("per_rank", "per_rank: every writing rank its own HDF5 file (any h5py); shared: one HDF5 "
                                     "file written collectively through MPI-IO (h5py built with MPI, parallel HDF5)",
                         ("per_rank", "shared"))


@dataclass(frozen=True)
class RunConfig:
    dir: str = _field("runs/default", "run directory: metrics.jsonl, config.toml, summary, checkpoints")
    log_every: int = _field(10, "log training metrics every this many steps (>= 1)")
    eval_every: int = _field(50, "evaluate on held-out data every this many steps (0 = never)")
    eval_batches: int = _field(2, "global batches of held-out samples per evaluation (>= 1)")
    timeout: float = _field(300.0, "watchdog: seconds a collective may wait before the job aborts (> 0)")
    backend: str = _field("auto", "array backend: numpy (CPU), cupy (GPU), or auto = the HPCPAR_BACKEND "
                                  "environment variable, else numpy", ("auto", "numpy", "cupy"))
    progress: bool = _field(True, "progress bar on rank 0")
    debug_slow_ranks: str = _field("", "debug (stragglers for study): comma-separated world ranks whose steps are "
                                   "slowed by run.debug_slow_factor (a sleep after their forward/backward), or "
                                   "\"random\": at every step one worker rank drawn from (seed, step)")
    debug_slow_factor: float = _field(1.0, "debug: the slowed ranks' forward/backward takes this many times as "
                                      "long (>= 1; 1 = off)")
    debug_check_every: int = _field(0, "every this many ops, check that all ranks issued the same "
                                       "collectives (0 = off)")


@dataclass(frozen=True)
class PSConfig:
    servers: int = _field(0, "parameter-server ranks: the last `servers` ranks of the world own the parameters and "
                          "the optimizer; the others train (0 = off: all-reduce data parallelism)")
    staleness: int = _field(0, "parameter server, mode = \"bounded\": a worker replica may run at most this many "
                            "steps ahead of the slowest (0 = synchronous: each step averages every replica's gradient)")
    mode: str = _field("bounded", "parameter server: bounded = staleness-bounded (0: synchronous; k > 0: stale "
                       "synchronous parallel); async = no bound, each replica's push joins the open step as it arrives",
                       ("bounded", "async"))
    stale_weight: float = _field(0.0, "parameter server, SSP and async: a push computed on parameters tau optimizer "
                                 "steps old enters its step's mean with weight stale_weight**tau, 0 <= stale_weight "
                                 "<= 1 (1 = as fresh; 0 = dropped, as a backup worker's)")


@dataclass(frozen=True)
class Config:
    """The whole run configuration; `validate` returns one with the mesh degrees resolved."""

    model: GPTConfig = field(default_factory=GPTConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    ps: PSConfig = field(default_factory=PSConfig)

    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints go: checkpoint.dir, or <run.dir>/checkpoints when that is ""."""
        return self.checkpoint.dir or os.path.join(self.run.dir, "checkpoints")


# Section name -> section class, in file order.
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}
# Section name -> key -> Python type (resolved: a module with postponed annotations, like
# nn/gpt.py, leaves `Field.type` a string).
_TYPES: dict[str, dict[str, type]] = {name: typing.get_type_hints(cls) for name, cls in SECTIONS.items()}

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_SUGGEST_CUTOFF = 0.6


# --------------------------------------------------------------------------- loading


def _fields(section: str) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(SECTIONS[section])}


def _did_you_mean(name: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=_SUGGEST_CUTOFF)
    return f"did you mean {close[0]!r}? " if close else ""


def _check_section(section: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r}; {_did_you_mean(section, list(SECTIONS))}"
                          f"valid sections: {', '.join(SECTIONS)}")


def _check_key(section: str, key: str) -> dataclasses.Field:
    _check_section(section)
    if (section, key) == ("train", "grad_wire_dtype"):
        return _WIRE_DTYPE_FIELD
    fields = _fields(section)
    if key not in fields:
        hint = _did_you_mean(key, list(fields))
        raise ConfigError(f"unknown key '{section}.{key}'; {hint}valid keys in [{section}]: {', '.join(fields)}")
    return fields[key]


@dataclass(frozen=True)
class _WireDtypeAlias:
    """The old key train.grad_wire_dtype: read like a string field, resolved by `_resolve_alias`."""

    grad_wire_dtype: str = _field("float32", "old name of grad_compression", tuple(WIRE_DTYPE_ALIAS))


_WIRE_DTYPE_FIELD = dataclasses.fields(_WireDtypeAlias)[0]


def _resolve_alias(values: dict[str, dict[str, Any]]) -> None:
    """train.grad_wire_dtype -> train.grad_compression: "float16" and "bfloat16" mean "fp16" and
    "bf16", "float32" (the old default) means nothing; a conflict with grad_compression is an error."""
    train = values.get("train", {})
    if "grad_wire_dtype" not in train:
        return
    old = train.pop("grad_wire_dtype")
    if old not in WIRE_DTYPE_ALIAS:
        raise ConfigError(f"train.grad_wire_dtype={_toml_value(old)} is not one of "
                          f"{', '.join(_toml_value(c) for c in WIRE_DTYPE_ALIAS)}; it is the old name of "
                          "train.grad_compression (none, fp16, bf16, int8, topk, powersgd)")
    kind = WIRE_DTYPE_ALIAS[old]
    current = train.get("grad_compression", "none")
    if kind != "none" and current not in ("none", kind):
        raise ConfigError(f"train.grad_wire_dtype={_toml_value(old)} (the old name of train.grad_compression="
                          f"{_toml_value(kind)}) conflicts with train.grad_compression={_toml_value(current)}; "
                          "drop train.grad_wire_dtype")
    if kind != "none":
        train["grad_compression"] = kind


def _describe(value: Any) -> str:
    """A value as the user wrote it, with its TOML type (for type errors)."""
    kinds = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}
    return f"{value!r} ({kinds.get(type(value), type(value).__name__)})"


def _coerce(name: str, ftype: type, value: Any) -> Any:
    """`value` as the field's type, or ConfigError. An integer is accepted where a number is."""
    if ftype is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # bool is an int subclass in Python but a separate type in TOML: never mix them.
    if type(value) is not ftype:
        raise ConfigError(f"{name} must be {_TYPE_NAMES[ftype]}, got {_describe(value)}")
    return value


def _read_toml(path: str | os.PathLike) -> dict:
    shown = os.fsdecode(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        # `--set a=1 b=2` leaves b=2 where the config file goes: say how to give several overrides.
        hint = f" (an override? each takes its own --set: --set {shown})" if "=" in shown else ""
        raise ConfigError(f"config file {shown!r} not found; give an existing TOML file, "
                          f"or none to use the defaults{hint}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {shown!r}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"config file {shown!r} is not UTF-8 text (line {line}); save it as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # The message ends with "(at line L, column C)".
        raise ConfigError(f"config file {shown!r} is not valid TOML: {e}") from None


def _type_of(section: str, f: dataclasses.Field) -> type:
    return str if f is _WIRE_DTYPE_FIELD else _TYPES[section][f.name]


def _section_of_key(key: str) -> str | None:
    for section in SECTIONS:
        if key in _fields(section):
            return section
    return None


def _values_from_file(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    return _values_from_tables(_read_toml(path), os.fsdecode(path))


def _values_from_tables(tables: dict, shown: str) -> dict[str, dict[str, Any]]:
    values: dict[str, dict[str, Any]] = {}
    for section, table in tables.items():
        if not isinstance(table, dict):
            home = _section_of_key(section)
            hint = f"put it under [{home}]" if home else f"sections are {', '.join(SECTIONS)}"
            raise ConfigError(f"{shown}: top-level key {section!r} must be inside a [section]; {hint}")
        try:
            _check_section(section)
            for key, value in table.items():
                f = _check_key(section, key)
                values.setdefault(section, {})[key] = _coerce(f"{section}.{key}", _type_of(section, f), value)
        except ConfigError as e:
            raise ConfigError(f"{shown}: {e}") from None
    return values


def parse_override(text: str) -> tuple[str, str, Any]:
    """`"section.key=value"` -> (section, key, typed value).

    The value is read as a TOML value (`8`, `3e-4`, `true`, `"x"`); for a string field anything
    that is not a TOML string is taken literally, so `data.corpus=/path/x` needs no quotes.
    """
    name, sep, raw = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. --set model.n_layer=8")
    try:
        f = _check_key(section, key)
    except ConfigError as e:
        raise ConfigError(f"--set {text!r}: {e}") from None
    raw = raw.strip()
    try:
        parsed = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        parsed = {}
    # Anything but exactly one value (a bare word, or text that smuggles in more keys) is a string.
    value = parsed["v"] if set(parsed) == {"v"} else raw
    ftype = _type_of(section, f)
    if ftype is str and not isinstance(value, str):
        value = raw
    try:
        return section, key, _coerce(f"{section}.{key}", ftype, value)
    except ConfigError as e:
        raise ConfigError(f"--set {text!r}: {e}") from None


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """The defaults, updated by the TOML file at `path` (if given), then by each override in order.

    Checks names and types only; value ranges and combinations are `validate`'s job.
    Raises ConfigError naming the file (and for TOML syntax the line) or the override.
    """
    values = _values_from_file(path) if path is not None else {}
    for text in overrides:
        section, key, value = parse_override(text)
        values.setdefault(section, {})[key] = value
    _resolve_alias(values)
    _apply_preset(values)
    return Config(**{name: cls(**values.get(name, {})) for name, cls in SECTIONS.items()})


def given_keys(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> set[str]:
    """The "section.key" names the file at `path` and the overrides set (not left to defaults)."""
    values = _values_from_file(path) if path is not None else {}
    names = {f"{section}.{key}" for section, table in values.items() for key in table}
    return names | {f"{section}.{key}" for section, key, _ in map(parse_override, overrides)}


def _apply_preset(values: dict[str, dict[str, Any]]) -> None:
    """Fill in the keys of `model.preset` (`nn.gpt.PRESETS`) that the file and overrides left out.

    An unknown name is left for `validate`, which lists the choices."""
    model = values.get("model", {})
    if model.get("preset") in PRESETS:
        values["model"] = {**PRESETS[model["preset"]], **model}


def loads(text: str, origin: str = "<text>") -> Config:
    """A Config from TOML text (e.g. the copy stored in a checkpoint); `origin` names it in errors."""
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{origin}: not valid TOML: {e}") from None
    values = _values_from_tables(tables, origin)
    _resolve_alias(values)
    _apply_preset(values)
    return Config(**{name: cls(**values.get(name, {})) for name, cls in SECTIONS.items()})


# --------------------------------------------------------------------------- writing


def _toml_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:  # control characters must be escaped in TOML
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_string(value)
    return repr(value)  # int, or float: repr is valid TOML (0.003, 1e-08, 300.0, inf, nan)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} of plain Python values (for JSON metrics and checkpoint metadata)."""
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The config as a commented TOML document; `load_config` of it gives back `cfg`."""
    lines = ["# hpcpar configuration. Every key is optional; see docs/config.md.",
             "# Override any key on the command line: hpcpar train FILE --set section.key=value"]
    for name in SECTIONS:
        section = getattr(cfg, name)
        lines += ["", f"[{name}]"]
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            doc = f.metadata["doc"]
            if "choices" in f.metadata:
                doc += " [" + " | ".join(_toml_value(c) for c in f.metadata["choices"]) + "]"
            if value != f.default:
                doc += f" (default {_toml_value(f.default)})"
            lines += textwrap.wrap(doc, width=98, initial_indent="# ", subsequent_indent="#   ")
            lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- memory


def _rank_chunks(cfg: Config, pp: int, rank: int) -> list[tuple[int, range, bool]]:
    """(virtual stage, its blocks, holds the head) of each model chunk of pipeline rank `rank`:
    the executor's own split (`pipeline.split_layers` with the LM head's cost)."""
    # Imported here: parallel/ pulls in MPI, and loading a config must not.
    from hpcpar.parallel.pp import pipeline, schedules as schedule

    place = schedule.placement(cfg.pipeline.schedule, pp, cfg.pipeline.chunks)
    ranges = pipeline.split_layers(cfg.model.n_layer, place.stages, pipeline.head_cost(cfg.model))
    return [(v, ranges[v], v == place.stages - 1)
            for v in (place.stage(rank, chunk) for chunk in range(place.chunks))]


def _stage_parameters(cfg: Config, tp: int, pp: int, stage: int) -> int:
    """Parameters held by one tp rank of pipeline rank `stage` (all its chunks), counted by the model
    (MoE layers: the E / mesh.ep experts of one ep rank)."""
    return sum(cfg.model.stage_params(blocks, embed=v == 0, head=head, tp=tp, ep=cfg.mesh.ep)
               for v, blocks, head in _rank_chunks(cfg, pp, stage))


def _stage_units(cfg: Config, tp: int, pp: int, stage: int) -> list[int]:
    """Elements each ZeRO-3 unit of pipeline rank `stage` gathers (per tp rank): the embedding,
    each block, the head (ln_f plus its LM-head weight: the embedding's, gathered again, when one
    stage holds both)."""
    m = cfg.model
    sizes = []
    for v, blocks, head in _rank_chunks(cfg, pp, stage):
        if v == 0:
            sizes.append(m.embedding_params(tp))
        sizes += [m.block_params(tp, i, cfg.mesh.ep) for i in blocks]
        if head:
            sizes.append(m.head_params(tp, tied=False) + (m.block_size * m.n_embd if v == 0 else 0))
    return sizes


def _model_state(cfg: Config, params: int, units: list[int], shards: int) -> int:
    """Bytes of weights, gradients and optimizer state of a rank holding `params` parameters (its
    ZeRO-3 units' sizes `units`) with ZeRO sharding over `shards` ranks (dp_shard x cp); see
    docs/config.md. Peaks during a step, not the state between steps:

        zero 0  P s + P s + P k              (k: optimizer bytes per parameter)
        zero 1  P s + P s + P k / n
        zero 2  P s + G + P s / n + P k / n  (G: full gradient buckets alive: up to 3 in flight
                                              with one micro-batch; all with accumulation)
        zero 3  P (s + s + k) / n + 2 U s + G  (two units gathered, the current and the prefetched,
                                              or all P s with reshard_after_forward = false; G:
                                              full unit gradients, up to 4, all with accumulation)
    """
    m, t = cfg.model, cfg.train
    s = DTYPES[m.dtype]
    half = s == 2
    # Optimizer state per parameter: AdamW two moments, SGD one momentum buffer (none at 0);
    # kept in float32 (plus a float32 master copy) under mixed precision.
    n_state = 2 if t.optimizer == "adamw" else int(t.momentum > 0)
    k = n_state * (4 if half else s) + (4 if half else 0)
    p, n, z = params, (shards if t.zero else 1), t.zero
    state = -(-p * k // n)
    accumulate = t.microbatches > 1
    if z <= 1:
        return 2 * p * s + state
    if z == 2:
        bucket = max(1, int(t.bucket_mb * 2**20) // s)
        live = p if accumulate else min(p, 3 * bucket)
        return p * s + live * s + -(-p * s // n) + state
    largest = max(units) if units else 0
    gathered = p * s if not t.reshard_after_forward else min(p, 2 * largest) * s
    grads = p if accumulate else min(p, 4 * largest)
    return 2 * -(-p * s // n) + state + gathered + grads * s


def activation_bytes(cfg: Config) -> int:
    """Bytes per stored activation element: 2 under train.precision bf16/fp16, else model.dtype's."""
    return 2 if cfg.train.precision != "full" else DTYPES[cfg.model.dtype]


def _memory_parts(cfg: Config, dp: int, tp: int, pp: int, cp: int | None = None) -> tuple[int, int]:
    """(weights + grads + optimizer state, activations) in bytes on the busiest rank.
    `cp` defaults to the config's resolved `mesh.cp` (1 when auto)."""
    from hpcpar.parallel.pp import schedules as schedule

    m, t = cfg.model, cfg.train
    # Activations: stored in s bytes (16 bits under mixed precision); an op's working arrays
    # (attention scores while they are computed, the loss's probabilities) in f bytes (float32).
    s = activation_bytes(cfg)
    f = 4 if t.precision != "full" else s
    cp = cp if cp is not None else (cfg.mesh.cp or 1)
    # ZeRO shards over dp_shard x cp (HSDP replicates the shards over dp_replicate).
    replicate = cfg.mesh.dp_replicate if dp % cfg.mesh.dp_replicate == 0 else 1
    shards = dp // replicate * cp

    # Activations kept for backward per block per micro-batch, in elements, for the n = T/cp
    # tokens of a rank (context parallelism divides every token-wise activation by cp):
    #   (6 + 2d) B n C / r   LayerNorm inputs/outputs, residuals (+ dropout masks), r = tp under SP
    #   12 B n C / tp        q, k, v, attention output, MLP hidden before/after GELU
    #   (2 + d) B H T^2 / (tp u)  attention scores and probabilities (+ dropout mask); u = cp for
    #                        Ulysses (whole sequences of H/(tp cp) heads), 1 without cp;
    #   B H n / tp           ring attention instead: the row log-sum-exp only
    # plus, once per rank (freed op by op, not stashed), the attention's working set in backward:
    #   (2 B H / (tp u) + 1) q^2   scores/probabilities and dS, and the causal mask, with q = n
    #                        for ring attention (one block of the ring), q = T otherwise
    bsz, seq, c, heads = t.micro_batch_size, m.block_size, m.n_embd, m.n_head
    n = seq / cp
    d = int(m.dropout > 0)
    r = tp if cfg.mesh.sequence_parallel else 1
    ring = cp > 1 and cfg.mesh.cp_impl == "ring"
    attention = heads / tp * (1 if ring else (2 + d) * seq * seq / (cp * n))  # per token of n
    per_layer = s * bsz * n * ((6 + 2 * d) * c / r + 12 * c / tp + attention)
    # Recomputation (train.recompute, for the blocks of `recomputed`): "full" keeps only the block's
    # input, B n C / r, plus once per rank one block's activations while it is re-run in backward;
    # "selective" drops the (2 + d) B H T^2 / (tp u) probabilities (ring attention keeps none).
    kept = {"none": per_layer, "full": s * bsz * n * c / r,
            "selective": per_layer - (0 if ring else s * bsz * heads / tp * (2 + d) * seq * seq / cp)}

    def chunk_bytes(blocks) -> float:
        return sum(kept[t.recompute if recomputed(i, t.recompute_every) else "none"] for i in blocks)
    q = n if ring else seq
    transient = f * (2 * bsz * heads / (tp * (1 if ring else cp)) + 1) * q * q
    embed = s * bsz * n * 2 * c                        # token + position embeddings
    head = bsz * n * (s * 2 * c + (s + f) * m.vocab_size / tp)  # ln_f, logits and softmax probabilities
    # Peak stashed chunk activations per pipeline rank, from the schedule itself.
    place = schedule.placement(cfg.pipeline.schedule, pp, cfg.pipeline.chunks)
    stash = peak_stash(cfg.pipeline.schedule, pp, t.microbatches, place.chunks)
    worst_state, worst_act, worst = 0, 0, -1.0
    for stage in range(pp):
        p = _stage_parameters(cfg, tp, pp, stage)
        state = _model_state(cfg, p, _stage_units(cfg, tp, pp, stage), shards)  # weights + grads + optimizer
        microbatches = -(-stash[stage] // place.chunks)
        # A stashed chunk activation holds the blocks of one chunk: the rank's largest, as a bound.
        chunks = _rank_chunks(cfg, pp, stage)
        act = stash[stage] * max(chunk_bytes(blocks) for _, blocks, _ in chunks)
        holds_embed, holds_head = any(v == 0 for v, _, _ in chunks), any(h for _, _, h in chunks)
        act += microbatches * ((embed if holds_embed else 0) + (head if holds_head else 0)) + transient
        if t.recompute == "full" and any(recomputed(i, t.recompute_every) for _, blocks, _ in chunks for i in blocks):
            act += per_layer  # the block being re-run
        if state + act > worst:
            worst_state, worst_act, worst = state, math.ceil(act), state + act
    return worst_state, worst_act


@functools.lru_cache(maxsize=1024)
def peak_stash(name: str, pp: int, microbatches: int, chunks: int = 1) -> tuple[int, ...]:
    """Chunk activations each pipeline rank holds at most (the simulator's `peak_stash`), from the
    schedules' closed forms where they have one (their docstrings in parallel/schedule.py; the
    tests hold them to the simulator), so that plans for thousands of ranks need no simulation."""
    m, v = microbatches, chunks
    if name == "gpipe":
        return (m * v,) * pp
    if name == "1f1b" or (name == "interleaved" and v == 1):
        return tuple(min(pp - r, m) for r in range(pp))
    if name == "interleaved":
        return tuple(min(2 * (pp - r - 1) + (v - 1) * pp + 1, m * v) for r in range(pp))
    from hpcpar.parallel.pp import schedules as schedule
    return schedule.timeline(name, pp, m, v).peak_stash


def estimate_memory(cfg: Config, dp: int, tp: int, pp: int, cp: int | None = None) -> int:
    """Estimated bytes per rank on the busiest pipeline stage (see docs/config.md, "Memory").

    weights + grads + optimizer state by ZeRO stage (`_model_state`: 2 P s + 2 P s moments without
    ZeRO; sharded over n = dp_shard x cp: the moments with ZeRO-1, the gradients too with ZeRO-2,
    everything with ZeRO-3 plus two gathered units) + activations stashed by the schedule (peak
    micro-batches in flight x layers x per-layer activations of the rank's T/cp tokens; a layer
    under `train.recompute` counts what it keeps). P counts the rank's share of parameters under
    tp and pp (cp shards no weight); s is the dtype's size. `cp` defaults to the config's `mesh.cp`.
    """
    state, act = _memory_parts(cfg, dp, tp, pp, cp)
    return state + act


def _human(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _check_memory(cfg: Config, available: int) -> None:
    dp, tp, pp = cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.pp
    state, act = _memory_parts(cfg, dp, tp, pp)
    if state + act <= available:
        return
    remedies = []
    if act >= state:
        remedies.append("a smaller train.micro_batch_size or model.block_size")
        if cfg.pipeline.schedule == "gpipe" and pp > 1:
            remedies.append("pipeline.schedule=\"1f1b\" (stashes <= pp micro-batches, not all)")
        if tp > 1 and not cfg.mesh.sequence_parallel:
            remedies.append("mesh.sequence_parallel=true")
        remedies.append("more ranks for mesh.cp (splits the sequence)")
        if cfg.train.recompute != "full":
            remedies.append("train.recompute=\"full\" (keeps a block's input only, re-runs it in backward)")
        elif cfg.train.recompute_every > 1:
            remedies.append("train.recompute_every=1 (recompute every block)")
    if cfg.train.zero < 3 and dp * (cfg.mesh.cp or 1) > 1:
        stages = ", ".join(f"train.zero={z}" for z in range(cfg.train.zero + 1, 4))
        remedies.append(f"{stages} (shards optimizer state, then gradients, then parameters over dp)")
    remedies.append("more ranks for mesh.tp or mesh.pp")
    raise ConfigError(f"estimated memory per rank {_human(state + act)} (weights+grads+optimizer {_human(state)}, "
                      f"activations {_human(act)}) exceeds the available {_human(available)}; try "
                      + ", or ".join(remedies))


# --------------------------------------------------------------------------- validation


def _gt0(v: float) -> bool:
    return v > 0


def _ge0(v: float) -> bool:
    return v >= 0


def _ge1(v: float) -> bool:
    return v >= 1


def _unit(v: float) -> bool:
    return 0 <= v < 1


def _open_unit(v: float) -> bool:
    return 0 < v < 1


# (section.key, test, what it must be) for every single-value range.
_RANGES: tuple[tuple[str, Any, str], ...] = (
    ("model.vocab_size", _ge1, ">= 1"),
    ("model.block_size", lambda v: v >= 2, ">= 2"),
    ("model.n_layer", _ge1, ">= 1"),
    ("model.n_head", _ge1, ">= 1"),
    ("model.n_embd", _ge1, ">= 1"),
    ("model.dropout", _unit, "in [0, 1)"),
    ("mesh.dp", _ge0, ">= 0 (0 = auto)"),
    ("mesh.tp", _ge0, ">= 0 (0 = auto)"),
    ("mesh.pp", _ge0, ">= 0 (0 = auto)"),
    ("mesh.cp", _ge0, ">= 0 (0 = auto)"),
    ("mesh.dp_replicate", _ge1, ">= 1 (1 = no HSDP)"),
    ("mesh.ep", _ge1, ">= 1 (1 = no expert parallelism)"),
    ("model.moe_experts", _ge0, ">= 0 (0 = dense)"),
    ("model.moe_top_k", _ge1, ">= 1"),
    ("model.moe_every", _ge1, ">= 1 (1 = every block)"),
    ("model.moe_capacity_factor", _ge0, ">= 0 (0 = unlimited)"),
    ("model.moe_aux_loss", _ge0, ">= 0 (0 = off)"),
    ("model.moe_z_loss", _ge0, ">= 0 (0 = off)"),
    ("data.val_fraction", _unit, "in [0, 1)"),
    ("train.steps", _ge1, ">= 1"),
    ("train.micro_batch_size", _ge1, ">= 1"),
    ("train.microbatches", _ge1, ">= 1"),
    ("train.lr", _gt0, "> 0"),
    ("train.min_lr", _ge0, ">= 0"),
    ("train.warmup", _ge0, ">= 0"),
    ("train.weight_decay", _ge0, ">= 0"),
    ("train.beta1", _open_unit, "in (0, 1)"),
    ("train.beta2", _open_unit, "in (0, 1)"),
    ("train.eps", _gt0, "> 0"),
    ("train.grad_clip", _ge0, ">= 0 (0 = no clipping)"),
    ("train.seed", _ge0, ">= 0"),
    ("train.momentum", _unit, "in [0, 1)"),
    ("train.bucket_mb", _gt0, "> 0"),
    ("train.compression_ratio", lambda v: 0 < v <= 1, "in (0, 1]: the fraction of each bucket's entries top-k sends"),
    ("train.powersgd_rank", _ge1, ">= 1"),
    ("train.compression_start_step", _ge0, ">= 0"),
    ("train.int8_block_size", _ge1, ">= 1"),
    ("train.max_bad_steps", _ge1, ">= 1"),
    ("train.recompute_every", _ge1, ">= 1 (1 = every block)"),
    ("train.loss_scale", _ge0, ">= 0 (0 = dynamic)"),
    ("train.initial_loss_scale", _gt0, "> 0"),
    ("train.loss_scale_window", _ge1, ">= 1"),
    ("train.loss_scale_growth", lambda v: v > 1, "> 1"),
    ("train.loss_scale_backoff", _open_unit, "in (0, 1)"),
    ("train.loss_scale_hysteresis", _ge1, ">= 1"),
    ("train.min_loss_scale", _gt0, "> 0"),
    ("pipeline.chunks", _ge0, ">= 0 (0 = the schedule's own)"),
    ("checkpoint.every", _ge0, ">= 0 (0 = only at the end)"),
    ("checkpoint.keep", _ge1, ">= 1"),
    ("run.dir", bool, "a non-empty directory path"),
    ("run.log_every", _ge1, ">= 1"),
    ("run.eval_every", _ge0, ">= 0 (0 = never)"),
    ("run.eval_batches", _ge1, ">= 1"),
    ("run.timeout", _gt0, "> 0 seconds"),
    ("run.debug_check_every", _ge0, ">= 0 (0 = off)"),
    ("run.debug_slow_factor", _ge1, ">= 1 (1 = off)"),
    ("ps.servers", _ge0, ">= 0 (0 = no parameter server)"),
    ("ps.staleness", _ge0, ">= 0 (0 = synchronous)"),
    ("ps.stale_weight", lambda v: 0 <= v <= 1, "in [0, 1] (1 = a late push counts as fresh, 0 = dropped)"),
)


def _get(cfg: Config, name: str) -> Any:
    section, key = name.split(".")
    return getattr(getattr(cfg, section), key)


def _check_fields(cfg: Config) -> None:
    """Types (for configs built in code), finite numbers, UTF-8 text, fixed choices."""
    for section in SECTIONS:
        for f in dataclasses.fields(SECTIONS[section]):
            name, ftype = f"{section}.{f.name}", _TYPES[section][f.name]
            value = _coerce(name, ftype, _get(cfg, name))
            if ftype is float and not math.isfinite(value):
                raise ConfigError(f"{name}={value!r} is invalid: must be a finite number")
            if ftype is str:
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ConfigError(f"{name}={value!r} is not valid UTF-8; the config is saved as TOML "
                                      "(UTF-8), so use a UTF-8 name") from None
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                hint = _did_you_mean(value, choices) if isinstance(value, str) else ""
                raise ConfigError(f"{name}={_toml_value(value)} is not one of "
                                  f"{', '.join(_toml_value(c) for c in choices)}; {hint}".rstrip("; "))


def _check_ranges(cfg: Config) -> None:
    for name, ok, requirement in _RANGES:
        value = _get(cfg, name)
        if not ok(value):
            raise ConfigError(f"{name}={_toml_value(value)} is invalid: must be {requirement}")


def _check_model(cfg: Config) -> None:
    m = cfg.model
    require_divisible("model.n_embd", m.n_embd, "model.n_head", m.n_head, "(heads split the width evenly)")
    m.check_dtype()
    if cfg.data.format == "bytes" and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is invalid: must be >= 256 with data.format=\"bytes\" "
                          "(tokens are bytes 0..255)")
    t = cfg.train
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr!r} exceeds train.lr={t.lr!r}; the cosine schedule decays "
                          "from lr down to min_lr, so choose min_lr <= lr")
    if cfg.run.eval_every > 0 and cfg.data.val_fraction == 0:
        raise ConfigError(f"run.eval_every={cfg.run.eval_every} needs held-out data but data.val_fraction=0; "
                          "set data.val_fraction > 0 (e.g. 0.05) or run.eval_every=0")


def _check_data_parallel(cfg: Config, dp: int) -> None:
    """HSDP splits dp into dp_replicate x dp_shard and needs ZeRO; gradient compression works on
    the buckets of zero 0-2, not on ZeRO-3's units."""
    t, r = cfg.train, cfg.mesh.dp_replicate
    require_divisible("mesh.dp", dp, "mesh.dp_replicate", r, "(HSDP: dp = dp_replicate x dp_shard)",
                      alternative="mesh.dp_replicate=1")
    if r > 1 and t.zero == 0:
        raise ConfigError(f"mesh.dp_replicate={r} splits dp for HSDP, which shards model state over dp_shard; "
                          "use train.zero >= 1 with it, or mesh.dp_replicate=1")
    if t.grad_compression != "none" and t.zero == 3:
        raise ConfigError(f"train.grad_compression={_toml_value(t.grad_compression)} compresses the gradient buckets "
                          "of train.zero 0-2; ZeRO-3 reduce-scatters each unit's flat gradient instead (and PowerSGD "
                          "needs whole matrices, which ZeRO-3 never holds); use train.zero <= 2 or "
                          "train.grad_compression=\"none\"")


def _check_tensor_parallel(cfg: Config, tp: int) -> None:
    """The rules the tensor-parallel layers guard (`nn.tensor_parallel.check_config`), reported first
    and in the config's names. (4 * n_embd) % tp == 0, the MLP width, follows from n_head % tp == 0
    and n_embd % n_head == 0. The vocabulary need not divide: it is padded to a multiple of tp."""
    m = cfg.model
    require_divisible("model.n_head", m.n_head, "mesh.tp", tp, "(a tp rank holds whole heads)")
    if cfg.mesh.sequence_parallel:
        require_divisible("model.block_size", m.block_size, "mesh.tp", tp,
                          "with mesh.sequence_parallel=true (the sequence is split over tp)",
                          alternative="mesh.sequence_parallel=false")


def _check_context_parallel(cfg: Config, tp: int, cp: int) -> None:
    """The sequence must cut into the chunks of the cp layout (2cp zigzag chunks for ring, cp for
    Ulysses; times tp under sequence parallelism) and Ulysses needs whole heads on every tp x cp
    rank. One line each, naming the degrees that would fit."""
    if cp == 1:
        return
    m, ring = cfg.model, cfg.mesh.cp_impl == "ring"
    sp = cfg.mesh.sequence_parallel and tp > 1
    factor = (2 if ring else 1) * (tp if sp else 1)   # sequence pieces per cp rank
    if m.block_size % (factor * cp):
        pieces = "*".join((["2"] if ring else []) + ["mesh.cp"] + (["mesh.tp"] if sp else []))
        why = ("ring attention cuts the sequence into 2*cp zigzag chunks" if ring
               else "each cp rank holds block_size/cp tokens")
        if sp:
            why += ", each split over tp by sequence parallelism"
        fits = [c for c in divisors(m.block_size) if m.block_size % (factor * c) == 0]
        raise ConfigError(f"model.block_size={m.block_size} is not divisible by {pieces}={factor * cp} ({why}); "
                          f"choose cp in {{{', '.join(map(str, fits))}}} or use block_size="
                          f"{-(-m.block_size // (factor * cp)) * factor * cp}")
    if not ring and m.n_head % (tp * cp):
        fits = [c for c in divisors(m.n_head) if m.n_head % (tp * c) == 0]
        raise ConfigError(f"model.n_head={m.n_head} is not divisible by mesh.tp*mesh.cp={tp * cp} "
                          f"(mesh.cp_impl=\"ulysses\" gives every tp x cp rank whole heads); choose cp in "
                          f"{{{', '.join(map(str, fits))}}} or use n_head={-(-m.n_head // (tp * cp)) * tp * cp}, "
                          f"or mesh.cp_impl=\"ring\"")


def _check_experts(cfg: Config, dp: int, tp: int, cp: int) -> None:
    """Mixture of experts: top_k <= E, ep divides E and dp_shard, and the combinations not
    implemented with experts (context parallelism, sequence parallelism, ZeRO-3, gradient
    compression, 16-bit precision) refused, one line each."""
    m, ep, t = cfg.model, cfg.mesh.ep, cfg.train
    if m.moe_experts == 0:
        if ep > 1:
            raise ConfigError(f"mesh.ep={ep} divides the experts of a mixture-of-experts model, but "
                              "model.moe_experts=0 (dense); set model.moe_experts (e.g. 4) or mesh.ep=1")
        return
    if m.moe_top_k > m.moe_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} exceeds model.moe_experts={m.moe_experts} (a token is "
                          f"routed to top_k different experts); choose moe_top_k in 1..{m.moe_experts}")
    require_divisible("model.moe_experts", m.moe_experts, "mesh.ep", ep, "(each ep rank holds E/ep whole experts)",
                      alternative="mesh.ep=1")
    shard = dp // cfg.mesh.dp_replicate
    if shard % ep:
        raise ConfigError(f"mesh.ep={ep} does not divide the {shard} dp_shard ranks (dp={dp}"
                          + (f" / dp_replicate={cfg.mesh.dp_replicate}" if cfg.mesh.dp_replicate > 1 else "")
                          + "; expert parallelism borrows data-parallel ranks); choose ep in "
                          f"{{{', '.join(str(d) for d in divisors(shard) if m.moe_experts % d == 0)}}}")
    unsupported = [(cp > 1, f"mesh.cp={cp}", "mesh.cp=1"),
                   (cfg.mesh.sequence_parallel and tp > 1, "mesh.sequence_parallel=true",
                    "mesh.sequence_parallel=false"),
                   (t.zero == 3, "train.zero=3", "train.zero <= 2"),
                   (t.grad_compression != "none", f"train.grad_compression={_toml_value(t.grad_compression)}",
                    "train.grad_compression=\"none\""),
                   (t.precision != "full", f"train.precision={_toml_value(t.precision)} (16-bit expert GEMMs)",
                    "train.precision=\"full\"")]
    for bad, what, fix in unsupported:
        if bad:
            raise ConfigError(f"{what} is not implemented with a mixture-of-experts model (model.moe_experts="
                              f"{m.moe_experts}); use {fix}, or model.moe_experts=0")


def _check_pipeline(cfg: Config, pp: int) -> None:
    from hpcpar.parallel.pp import schedules as schedule

    p, t = cfg.pipeline, cfg.train
    # Schedule-level rules (chunks only with interleaved / fixed by zbv, interleaved needs
    # m % pp == 0, zbv needs pp >= 2, ...).
    schedule.validate(p.schedule, pp, t.microbatches, p.chunks)
    chunks = schedule.resolve_chunks(p.schedule, p.chunks)
    stages = pp * chunks
    if cfg.model.n_layer < stages:
        fixed = f" (pipeline.schedule={p.schedule} runs {chunks} per rank)" if p.schedule == "zbv" else ""
        raise ConfigError(f"model.n_layer={cfg.model.n_layer} is fewer than mesh.pp={pp} x pipeline.chunks="
                          f"{chunks}{fixed} = {stages} virtual stages (each needs a layer); use n_layer >= {stages} "
                          + ("or fewer stages" if cfg.mesh.pp else "or mesh.pp=1 (pp=2 is the auto default)"))


def doubts(cfg: Config) -> list[str]:
    """Legal but doubtful settings of a validated config (mesh resolved), a line each: what a run
    warns about once, on rank 0 (not `validate`, which the planner runs for every candidate and a
    run more than once)."""
    m, t = cfg.mesh, cfg.train
    out = []
    if t.microbatches < m.pp:
        out.append(f"train.microbatches={t.microbatches} < mesh.pp={m.pp}: most of each step is pipeline bubble, "
                   f"(p-1)/(m+p-1) = {100 * (m.pp - 1) / (t.microbatches + m.pp - 1):.0f}%; use microbatches >= "
                   f"{m.pp} (4 x pp is better)")
    if t.grad_compression != "none" and m.dp * m.cp == 1:
        out.append(f"train.grad_compression={t.grad_compression} has nothing to compress: dp x cp = 1 (no "
                   "data-parallel gradient averaging)")
    if t.warmup >= t.steps:
        out.append(f"train.warmup={t.warmup} >= train.steps={t.steps}: the learning rate never reaches train.lr")
    return out


def _fold_reduce_dtype(cfg: Config) -> Config:
    """train.grad_reduce_dtype = "bf16"/"fp16" is the 16-bit wire of train.grad_compression: the
    returned config names it there too (a different compressor beside it is a conflict)."""
    t = cfg.train
    if t.grad_reduce_dtype == "fp32" or t.grad_compression == t.grad_reduce_dtype:
        return cfg
    if t.grad_compression != "none":
        raise ConfigError(f"train.grad_reduce_dtype={_toml_value(t.grad_reduce_dtype)} (16-bit gradients on the "
                          f"wire) conflicts with train.grad_compression={_toml_value(t.grad_compression)}; keep "
                          "one: train.grad_reduce_dtype=\"fp32\" or train.grad_compression=\"none\"")
    return dataclasses.replace(cfg, train=dataclasses.replace(t, grad_compression=t.grad_reduce_dtype))


def _check_precision(cfg: Config) -> None:
    """bfloat16 arrays exist on the CPU only (ml_dtypes); CuPy has float16 but no bfloat16."""
    t = cfg.train
    if t.precision != "bf16":
        return
    gpu = cfg.run.backend == "cupy" or (cfg.run.backend == "auto" and backend.name() == "cupy")
    if gpu:
        raise ConfigError("train.precision=\"bf16\" stores activations as bfloat16, which CuPy arrays cannot "
                          "hold; on the GPU use train.precision=\"fp16\" (or run.backend=\"numpy\")")


def _check_checkpoint(c: CheckpointConfig) -> None:
    if c.format != "shared":
        return
    if c.async_save:
        raise ConfigError("checkpoint.async_save=true needs checkpoint.format=\"per_rank\": a shared-file save "
                          "writes through collective MPI-IO, which cannot run in a background thread while training "
                          "communicates")
    import h5py

    if not h5py.get_config().mpi:
        raise ConfigError("checkpoint.format=\"shared\" needs h5py built with MPI (parallel HDF5), and this h5py "
                          "is not: install parallel HDF5 (e.g. apt-get install libhdf5-openmpi-dev) and build h5py "
                          "against it (HDF5_MPI=ON CC=mpicc pip install --no-binary=h5py h5py; README, Parallel "
                          "HDF5), or use checkpoint.format=\"per_rank\"")


def slow_ranks(cfg: Config) -> tuple[int, ...] | str:
    """run.debug_slow_ranks as ranks ("" = none), or "random"; ConfigError when it is neither a
    comma-separated list nor "random"."""
    text = cfg.run.debug_slow_ranks.strip()
    if text == "random":
        return text
    try:
        return tuple(sorted({int(r) for r in text.split(",")})) if text else ()
    except ValueError:
        raise ConfigError(f"run.debug_slow_ranks={_toml_value(cfg.run.debug_slow_ranks)} is not a comma-separated "
                          "list of ranks or \"random\"; write e.g. \"1\", \"1,3\" or \"random\"") from None


def _check_parameter_server(cfg: Config, world_size: int) -> int:
    """The workers' share of the world (the mesh's ranks) and the combinations a parameter server does
    not support, refused one line each; also run.debug_slow_ranks against the world."""
    ranks = slow_ranks(cfg)
    bad = [r for r in ranks if not 0 <= r < world_size] if ranks != "random" else []
    if bad:
        raise ConfigError(f"run.debug_slow_ranks names rank {bad[0]}, outside the world of {world_size} ranks; "
                          f"use ranks 0..{world_size - 1}")
    s = cfg.ps.servers
    if s == 0:
        if cfg.ps.staleness or cfg.ps.mode != "bounded":
            raise ConfigError("ps.staleness / ps.mode configure a parameter server, but ps.servers=0; set "
                              "ps.servers >= 1 or leave ps.staleness=0 and ps.mode=\"bounded\"")
        return world_size
    if s >= world_size:
        raise ConfigError(f"ps.servers={s} leaves no worker: the world has {world_size} ranks and the last {s} would "
                          f"all be servers; use ps.servers <= {world_size - 1} or launch more ranks")
    if cfg.ps.mode == "async" and cfg.ps.staleness:
        raise ConfigError(f"ps.staleness={cfg.ps.staleness} bounds ps.mode=\"bounded\"; ps.mode=\"async\" has no "
                          "bound: set ps.staleness=0 with it, or ps.mode=\"bounded\"")
    m, t = cfg.mesh, cfg.train
    unsupported = [
        (t.zero > 0, f"train.zero={t.zero}", "the servers already hold the only optimizer state", "train.zero=0"),
        (t.grad_compression != "none", f"train.grad_compression={_toml_value(t.grad_compression)}",
         "pushes are whole gradients", "train.grad_compression=\"none\""),
        (m.cp not in (0, 1), f"mesh.cp={m.cp}", "a replica's cp ranks push partial gradients a per-push norm "
         "cannot see", "mesh.cp=1"),
        (m.dp_replicate > 1, f"mesh.dp_replicate={m.dp_replicate}", "HSDP shards over dp, which servers replace",
         "mesh.dp_replicate=1"),
        (cfg.model.moe_experts > 0, f"model.moe_experts={cfg.model.moe_experts}",
         "expert weights are averaged over their own groups", "model.moe_experts=0"),
        (t.precision != "full", f"train.precision={_toml_value(t.precision)}",
         "the servers keep no loss scale or 16-bit rounding", "train.precision=\"full\""),
    ]
    for refused, what, why, fix in unsupported:
        if refused:
            raise ConfigError(f"{what} is not supported with a parameter server (ps.servers={s}): {why}; use {fix} "
                              "or ps.servers=0")
    return world_size - s


def _resolved_chunks(p: PipelineConfig) -> int:
    from hpcpar.parallel.pp import schedules as schedule

    return schedule.resolve_chunks(p.schedule, p.chunks)


def validate(cfg: Config, world_size: int, available_memory_bytes: int | None = None) -> Config:
    """Check every value and combination for `world_size` ranks; return `cfg` with the mesh resolved.

    Pure (no communication, no I/O) so that every rank reaches the same verdict before any collective.
    The returned config has mesh.dp, mesh.tp, mesh.pp, mesh.cp >= 1 with product `world_size` and
    pipeline.chunks >= 1 (the schedule's own where it was 0); validating
    it again gives it back unchanged. `available_memory_bytes`, when given, is compared with
    `estimate_memory` (pass a value every rank agrees on, e.g. the smallest device's memory).
    Raises ConfigError / MeshError (one line); `doubts` names legal but doubtful settings.
    """
    _check_fields(cfg)
    _check_ranges(cfg)
    _check_model(cfg)
    _check_precision(cfg)
    cfg = _fold_reduce_dtype(cfg)
    from hpcpar.runtime.mesh import resolve_degrees  # here, not at the top: mesh.py loads MPI

    world, world_size = world_size, _check_parameter_server(cfg, world_size)  # the mesh is the workers'
    try:
        dp, tp, pp, cp = resolve_degrees(world_size, cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.cp)
    except MeshError as err:
        if not cfg.ps.servers:
            raise
        raise MeshError(f"{err} (the worker ranks: the world of {world} less ps.servers={cfg.ps.servers})") from None
    _check_data_parallel(cfg, dp)
    _check_tensor_parallel(cfg, tp)
    _check_context_parallel(cfg, tp, cp)
    _check_pipeline(cfg, pp)
    _check_experts(cfg, dp, tp, cp)
    _check_checkpoint(cfg.checkpoint)
    resolved = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp=dp, tp=tp, pp=pp, cp=cp),
                                   pipeline=dataclasses.replace(
                                       cfg.pipeline, chunks=_resolved_chunks(cfg.pipeline)))
    if available_memory_bytes is not None:
        _check_memory(resolved, available_memory_bytes)
    return resolved
