"""Building blocks of the run configuration that the model and the mesh share with `config`.

The config sections are frozen dataclasses whose fields carry their documentation; the `[model]`
section is the model's own `GPTConfig` (in `nn/gpt.py`), and `nn` sits below `config` in the
layer rule, so the field helper lives here, at the foundation. So does the one divisibility rule
that config validation, the mesh and the tensor-parallel layers all report in the same words.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hpcpar.errors import ConfigError

_DIVISOR_SEARCH = 10**5  # trial divisions at most: all of n's divisors up to n = 10**10


def field(default: Any, doc: str, choices: tuple | None = None) -> Any:
    """A dataclass field with its documentation (and fixed set of values) in `metadata`.

    `config.load.to_toml` writes `metadata["doc"]` (and `metadata["choices"]`) as comments, which is
    what `hpcpar/defaults/default.toml` and docs/config.md show; `config.validate` rejects a
    value outside `choices`.
    """
    metadata = {"doc": doc} if choices is None else {"doc": doc, "choices": choices}
    return dataclasses.field(default=default, metadata=metadata)


def divisors(n: int) -> list[int]:
    """The positive divisors of `n` >= 1, ascending (the valid choices of a degree that must divide n).

    Above 10**10 (no real size or degree: a damaged or crafted config) only those up to
    `_DIVISOR_SEARCH` and their cofactors, so that the message naming them comes in bounded time."""
    small = [d for d in range(1, min(math.isqrt(n), _DIVISOR_SEARCH) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _short(name: str) -> str:
    """"mesh.tp" -> "tp": how a remedy names a key inside its own sentence."""
    return name.rsplit(".", 1)[-1]


def require_divisible(what: str, n: int, by_what: str, k: int, hint: str = "", alternative: str = "") -> None:
    """Raise ConfigError unless `k` divides `n`, saying why it must and what would work.

    The one message for every divisibility rule (config validation first, the layers' guards
    later say the same):

        {what}={n} is not divisible by {by_what}={k} {hint}; choose {by} in {divisors of n}
        or use {name}={n rounded up to a multiple of k}[, or {alternative}]

    e.g. `require_divisible("model.n_head", 6, "mesh.tp", 4, "(a tp rank holds whole heads)")`:
    "model.n_head=6 is not divisible by mesh.tp=4 (a tp rank holds whole heads); choose tp in
    {1, 2, 3, 6} or use n_head=8". `hint` says why (or under which setting) the rule applies.
    """
    if n % k == 0:
        return
    choices = ", ".join(map(str, divisors(n)))
    message = (f"{what}={n} is not divisible by {by_what}={k}{' ' + hint if hint else ''}; "
               f"choose {_short(by_what)} in {{{choices}}} or use {_short(what)}={-(-n // k) * k}")
    raise ConfigError(message + (f", or {alternative}" if alternative else ""))
