"""Reading and writing the run configuration: TOML files, `--set` overrides, model presets.

`load_config(path, overrides)` gives the defaults updated by the TOML file at `path`, then by each
`section.key=value` override in order; `loads` reads TOML text (the copy a checkpoint stores).
Both check names and types only, with a one-line `ConfigError` naming the file (and for TOML
syntax the line) or the override: unknown sections or keys (with a "did you mean"), wrong types.
Value ranges and combinations are `config.validate`'s job. The old key train.grad_wire_dtype is
read as an alias of train.grad_compression, and `model.preset` fills in the keys left out.

`to_toml(cfg)` writes a config as commented TOML (each field's doc and choices) that round-trips
through `load_config`; `to_dict` gives plain values for JSON.
"""

import dataclasses
import difflib
import os
import textwrap
from dataclasses import dataclass
from typing import Any, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from hpcpar.config.sections import FIELD_TYPES, SECTIONS, WIRE_DTYPE_ALIAS, Config
from hpcpar.errors import ConfigError
from hpcpar.nn.gpt import PRESETS
from hpcpar.schema import field as _field


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
CONFIG_LIMIT = 16 << 20   # the largest config file read
_SUGGEST_CUTOFF = 0.6


def _fields(section: str) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(SECTIONS[section])}


def did_you_mean(name: str, valid: Sequence[str]) -> str:
    """"did you mean 'x'? " for the closest of `valid` to a misspelt `name`, or "" when none is close."""
    close = difflib.get_close_matches(name, valid, n=1, cutoff=_SUGGEST_CUTOFF)
    return f"did you mean {close[0]!r}? " if close else ""


def _check_section(section: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r}; {did_you_mean(section, list(SECTIONS))}"
                          f"valid sections: {', '.join(SECTIONS)}")


def _check_key(section: str, key: str) -> dataclasses.Field:
    _check_section(section)
    if (section, key) == ("train", "grad_wire_dtype"):
        return _WIRE_DTYPE_FIELD
    fields = _fields(section)
    if key not in fields:
        hint = did_you_mean(key, list(fields))
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
        raise ConfigError(f"train.grad_wire_dtype={toml_value(old)} is not one of "
                          f"{', '.join(toml_value(c) for c in WIRE_DTYPE_ALIAS)}; it is the old name of "
                          "train.grad_compression (none, fp16, bf16, int8, topk, powersgd)")
    kind = WIRE_DTYPE_ALIAS[old]
    current = train.get("grad_compression", "none")
    if kind != "none" and current not in ("none", kind):
        raise ConfigError(f"train.grad_wire_dtype={toml_value(old)} (the old name of train.grad_compression="
                          f"{toml_value(kind)}) conflicts with train.grad_compression={toml_value(current)}; "
                          "drop train.grad_wire_dtype")
    if kind != "none":
        train["grad_compression"] = kind


def _describe(value: Any) -> str:
    """A value as the user wrote it, with its TOML type (for type errors)."""
    kinds = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}
    return f"{value!r} ({kinds.get(type(value), type(value).__name__)})"


def coerce(name: str, ftype: type, value: Any) -> Any:
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
            size = os.fstat(f.fileno()).st_size
            if size > CONFIG_LIMIT:  # refused unread: a config is a few KiB
                raise ConfigError(f"config file {shown!r} is {size} bytes, more than any config "
                                  f"({CONFIG_LIMIT >> 20} MiB); give a TOML config file")
            raw = f.read(CONFIG_LIMIT + 1)
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
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise ConfigError(f"config file {shown!r} is not valid TOML: nested too deep") from None


def _type_of(section: str, f: dataclasses.Field) -> type:
    return str if f is _WIRE_DTYPE_FIELD else FIELD_TYPES[section][f.name]


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
                values.setdefault(section, {})[key] = coerce(f"{section}.{key}", _type_of(section, f), value)
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
        return section, key, coerce(f"{section}.{key}", ftype, value)
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
    return _config_of(values)


def given_keys(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> set[str]:
    """The "section.key" names the file at `path` and the overrides set (not left to defaults)."""
    values = _values_from_file(path) if path is not None else {}
    names = {f"{section}.{key}" for section, table in values.items() for key in table}
    return names | {f"{section}.{key}" for section, key, _ in map(parse_override, overrides)}


def _config_of(values: dict[str, dict[str, Any]]) -> Config:
    """The defaults updated by `values` ({section: {key: typed value}}, names checked), once the old
    alias is resolved and `model.preset` filled in."""
    _resolve_alias(values)
    _apply_preset(values)
    return Config(**{name: cls(**values.get(name, {})) for name, cls in SECTIONS.items()})


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
    except RecursionError:
        raise ConfigError(f"{origin}: not valid TOML: nested too deep") from None
    values = _values_from_tables(tables, origin)
    return _config_of(values)


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


def toml_value(value: Any) -> str:
    """`value` as TOML writes it (how error messages quote a config value)."""
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
                doc += " [" + " | ".join(toml_value(c) for c in f.metadata["choices"]) + "]"
            if value != f.default:
                doc += f" (default {toml_value(f.default)})"
            lines += textwrap.wrap(doc, width=98, initial_indent="# ", subsequent_indent="#   ")
            lines.append(f"{f.name} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- memory
