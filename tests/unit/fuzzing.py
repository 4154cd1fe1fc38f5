"""The fuzzing harness of test_fuzz_*.py: mutations of files, one reader call per mutation, outcomes.

Each mutation of a valid file (random byte flips, truncations, appended bytes, JSON header fields
replaced by hostile values, size lies) is written in place and the reader runs on it under
`Case`: it must load the same numbers ("same"), load other valid numbers where the format has no
checksum to tell ("other", only where the test allows it), or raise the reader's HpcparError
subclass with a one-line message ("refused"). Anything else fails the test naming the mutation:
another exception, a hang (`deadline`: SIGALRM), or a write outside the test's directory (an audit
hook sees every open for writing, rename, removal and mkdir while a case runs). The counts are
printed (`pytest -s`) and kept in docs/troubleshooting.md.

HPCPAR_FUZZ_ROUNDS=N multiplies every reader's mutation count (default 1: a few seconds each), and
HPCPAR_FUZZ_SEED=S shifts every seed (default 0: the same mutations on every run), for longer runs.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import sys

import numpy as np

ROUNDS = max(1, int(os.environ.get("HPCPAR_FUZZ_ROUNDS", "1") or 1))
SEED = int(os.environ.get("HPCPAR_FUZZ_SEED", "0") or 0)
# Values a crafted or damaged JSON field may hold: wrong types, size lies, paths that lead out.
HOSTILE = [None, True, False, -1, 0, 1, 3, 2**31, 2**63, -2**63, 10**30, 1.5, -0.0, float("inf"), "", "x",
           "../../secret.h5", "/etc/passwd", "rank-00000.h5/../../x", "O", "<f8", "|O", "V8", "S1000000", [], {},
           [0], [-1, 2], [[0, 2**40]], {"a": 1}, "é" * 3, "\u0000"]
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def rng(seed: int) -> np.random.Generator:
    """The generator of one test's mutations: `seed`, shifted by HPCPAR_FUZZ_SEED."""
    return np.random.default_rng(seed + SEED)


class Hang(Exception):
    """A case ran past its deadline."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise Hang in this (the main) thread after `seconds`."""
    def ring(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _Watch:
    """One audit hook for the process (hooks cannot be removed): while `roots` is set, every write-like
    event on a path outside them, and every open of a path in `forbidden`, is recorded."""

    def __init__(self):
        self.roots: list[str] = []
        self.forbidden: set[str] = set()
        self.seen: list[str] = []
        sys.addaudithook(self.hook)

    def hook(self, event: str, args) -> None:
        if not self.roots or event not in ("open", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.mkdir",
                                           "shutil.rmtree", "os.truncate", "os.symlink", "os.link"):
            return
        two = event in ("os.rename", "os.replace", "os.symlink", "os.link")
        # The directory a relative name is resolved in: a dir_fd (shutil.rmtree removes names under one).
        dir_fds = {"os.remove": (1,), "os.rmdir": (1,), "os.mkdir": (2,), "os.rename": (2, 3), "os.replace": (2, 3),
                   "shutil.rmtree": (1,)}.get(event, ())
        for k, path in enumerate(args[:2] if two else args[:1]):
            if isinstance(path, int) or path is None:
                continue
            fd = args[dir_fds[k]] if k < len(dir_fds) and dir_fds[k] < len(args) else None
            base = os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) and fd >= 0 else os.getcwd()
            real = os.path.realpath(os.path.join(base, os.fsdecode(path)))
            if real in self.forbidden:
                self.seen.append(f"{event} {real}")
            writing = event != "open" or (args[2] or 0) & _WRITING or (isinstance(args[1], str) and
                                                                        any(c in args[1] for c in "wax+"))
            if writing and "__pycache__" not in real and \
                    not any(real == r or real.startswith(r + os.sep) for r in self.roots):
                self.seen.append(f"{event} {real} (outside {self.roots})")


WATCH = _Watch()


@contextlib.contextmanager
def watched(root: str, forbidden: tuple = ()):
    """Record writes outside `root` and opens of `forbidden` paths while the block runs."""
    WATCH.roots, WATCH.forbidden, WATCH.seen = [os.path.realpath(root)], {os.path.realpath(p) for p in forbidden}, []
    try:
        yield WATCH.seen
    finally:
        WATCH.roots, WATCH.forbidden = [], set()


class Outcomes:
    """Counts of outcomes per reader, and the check of each case."""

    def __init__(self, reader: str, error: type, other_allowed: bool, root: str):
        self.reader, self.error, self.other_allowed, self.root = reader, error, other_allowed, root
        self.counts: collections.Counter = collections.Counter()
        self.kinds: collections.Counter = collections.Counter()

    def run(self, label: str, kind: str, call, same, timeout: float = 20.0):
        """`call()` under the deadline and the write watch; `same(result)` says whether it loaded the
        original numbers. Returns the outcome ("same", "other", "refused")."""
        self.kinds[kind] += 1
        with watched(self.root) as seen:
            try:
                with deadline(timeout):
                    result = call()
            except self.error as err:
                text = str(err)
                assert text and "\n" not in text, f"{label}: a refusal of more than one line: {text!r}"
                assert "Traceback" not in text, f"{label}: {text}"
                outcome = "refused"
            except Hang as err:
                raise AssertionError(f"{self.reader}, {label}: hangs ({err})") from None
            except Exception as err:  # noqa: BLE001 - the point: nothing but the reader's error
                raise AssertionError(f"{self.reader}, {label}: {type(err).__name__}: {err}") from err
            else:
                outcome = "same" if same(result) else "other"
                assert outcome == "same" or self.other_allowed, \
                    f"{self.reader}, {label}: loaded other numbers without an error"
        assert not seen, f"{self.reader}, {label}: wrote outside {self.root}: {seen}"
        self.counts[outcome] += 1
        return outcome

    def report(self) -> str:
        total = sum(self.counts.values())
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.kinds.items()))
        line = (f"fuzz {self.reader}: {total} mutations ({kinds}): {self.counts['same']} loaded the same, "
                f"{self.counts['other']} loaded other valid numbers, {self.counts['refused']} refused in one line")
        print(line)
        return line


# ------------------------------------------------------------------------------------ mutations


def byte_mutation(data: bytes, rng: np.random.Generator) -> tuple[str, bytes]:
    """One random byte-level mutation: flips, a truncation or appended bytes."""
    kind = rng.choice(["flip", "flips", "truncate", "append", "zero-run"], p=[0.35, 0.2, 0.2, 0.1, 0.15])
    out = bytearray(data)
    if kind == "flip":
        at = int(rng.integers(len(out)))
        out[at] ^= int(rng.integers(1, 256))
        return f"flip byte {at}", bytes(out)
    if kind == "flips":
        at = sorted(int(i) for i in rng.integers(0, len(out), int(rng.integers(2, 9))))
        for i in at:
            out[i] ^= int(rng.integers(1, 256))
        return f"flip bytes {at}", bytes(out)
    if kind == "truncate":
        n = int(rng.integers(0, len(out)))
        return f"truncate to {n} bytes", bytes(out[:n])
    if kind == "zero-run":
        at, n = int(rng.integers(len(out))), int(rng.integers(1, 64))
        out[at:at + n] = bytes(len(out[at:at + n]))
        return f"zero bytes {at}-{at + n - 1}", bytes(out)
    n = int(rng.integers(1, 4096))
    return f"append {n} bytes", bytes(out) + rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def _paths(obj, prefix=()) -> list[tuple]:
    """Every path into a JSON value (its own included)."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:64]):
            out += _paths(v, prefix + (i,))
    return out


def _set(obj, path: tuple, value):
    if not path:
        return value
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return obj


def json_mutation(obj, rng: np.random.Generator) -> tuple[str, object | str]:
    """One mutation of a JSON value: a field replaced by a hostile value, a number lied about (doubled,
    off by one, huge), a key deleted or renamed, or a field nested too deep for a parser. Returns
    (label, the mutated value or, for the deep nesting, its JSON text)."""
    obj = json.loads(json.dumps(obj))
    paths = _paths(obj)
    path = paths[int(rng.integers(len(paths)))]
    current = obj
    for key in path:
        current = current[key]
    kind = rng.choice(["hostile", "size-lie", "delete", "rename", "deep"], p=[0.45, 0.3, 0.12, 0.08, 0.05])
    where = "/".join(map(str, path)) or "(root)"
    if kind == "size-lie" and isinstance(current, (int, float)) and not isinstance(current, bool):
        lie = [current * 2, current + 1, current - 1, -current, current * 1000 + 7, 2**62][int(rng.integers(6))]
        return f"{where}: {current} -> {lie}", _set(obj, path, lie)
    if kind in ("delete", "rename") and path:
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict):
            value = parent.pop(path[-1])
            if kind == "rename":
                parent[f"{path[-1]}~"] = value
            return f"{kind} {where}", obj
        if isinstance(parent, list):
            parent.pop(path[-1])
            return f"delete {where}", obj
    if kind == "deep":
        marker = "\"@@deep@@\""
        text = json.dumps(_set(obj, path, "@@deep@@")).replace(marker, "[" * 100_000 + "]" * 100_000)
        return f"{where}: nested 100000 deep", text
    value = HOSTILE[int(rng.integers(len(HOSTILE)))]
    return f"{where} = {json.dumps(value)}", _set(obj, path, value)


def json_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)
