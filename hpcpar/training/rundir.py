"""A run directory holds one run: a fresh start never overwrites another run's files silently.

`hpcpar train` with `checkpoint.resume = ""` starts a new run. When its run directory already
holds a run (a non-empty metrics.jsonl, or committed checkpoints in the checkpoint directory),
starting there would append a second curve to that run's metrics.jsonl and replace its
checkpoints step by step, so `claim` refuses it with one line naming the ways on: continue that
run (`checkpoint.resume=auto`), start this one elsewhere (a new `run.dir`), or replace it
(`run.overwrite=true`, which deletes the old run's metrics, summary, trace and checkpoints first).
A resume (`"auto"` or a path) continues in the directory as before.

On node-local checkpoint disks (`checkpoint.location`) every node's copy counts: each node's
leader looks at (and with `run.overwrite`, empties) its own checkpoint directory.
"""

from __future__ import annotations

import logging
import os
import shutil

from hpcpar.checkpoint import directory
from hpcpar.checkpoint.replicate import NODE_LOCAL
from hpcpar.config.sections import Config
from hpcpar.errors import ConfigError
from hpcpar.runtime.comm import Communicator

log = logging.getLogger("hpcpar")

METRICS = "metrics.jsonl"
RUN_FILES = (METRICS, "summary.json", "trace.json")   # what a run leaves in run.dir besides config and ranks


def metrics_lines(run_dir: str) -> int:
    """Lines in `run_dir`'s metrics.jsonl (0 when it is missing or empty)."""
    try:
        with open(os.path.join(run_dir, METRICS), "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b"")) or int(f.tell() > 0)
    except OSError:
        return 0


def checkpoints_here(checkpoint_dir: str) -> list[str]:
    """The committed checkpoints in `checkpoint_dir` (names, oldest first)."""
    try:
        names = os.listdir(checkpoint_dir)
    except OSError:
        return []
    steps = sorted((directory.step_of(n), n) for n in names if directory.step_of(n) is not None
                   and os.path.isdir(os.path.join(checkpoint_dir, n)))
    return [n for _, n in steps]


def claim(cfg: Config, world: Communicator) -> None:
    """Make run.dir this run's (collective over `world`, before anything is written there): a
    fresh start where another run's files are is refused with the same ConfigError on every rank,
    or with `run.overwrite` those files are deleted first. A resume claims nothing."""
    if cfg.checkpoint.resume:
        return
    node = world.split_by_node() if cfg.checkpoint.location == NODE_LOCAL else None
    looks = world.rank == 0 or (node is not None and node.rank == 0)   # whose checkpoint directory counts
    mine = (metrics_lines(cfg.run.dir) if world.rank == 0 else 0,
            (checkpoints_here(cfg.checkpoint_dir) or [""])[-1] if looks else "")
    views = world.all_gather_object(mine) if node is not None else [world.broadcast_object(mine)]
    lines = views[0][0]
    newest = max((v[1] for v in views), key=lambda n: directory.step_of(n) if n else -1)
    if not lines and not newest:
        return
    held = ", ".join(filter(None, [f"{METRICS} with {lines} line(s)" if lines else "",
                                   f"checkpoints up to {os.path.join(cfg.checkpoint_dir, newest)}" if newest else ""]))
    if not cfg.run.overwrite:
        raise ConfigError(f"run.dir {cfg.run.dir!r} already holds a run ({held}), and checkpoint.resume=\"\" would "
                          "start a new one over it; continue that run with --set checkpoint.resume=auto, start this "
                          "one in a new directory with --set run.dir=DIR, or replace it with --set run.overwrite=true")
    if world.rank == 0:
        log.warning("run.overwrite=true: deleting the run that was in %s (%s) before starting a new one", cfg.run.dir,
                    held)
        for name in RUN_FILES:
            _remove(os.path.join(cfg.run.dir, name))
    if looks:
        _remove_checkpoints(cfg.checkpoint_dir)
    world.barrier()   # every copy is gone before any rank writes the new run's files


def _remove_checkpoints(checkpoint_dir: str) -> None:
    """Delete the committed checkpoints, the `latest` pointer and leftovers of killed saves."""
    for name in checkpoints_here(checkpoint_dir):
        shutil.rmtree(os.path.join(checkpoint_dir, name), ignore_errors=True)
    try:
        leftovers = [n for n in os.listdir(checkpoint_dir) if n.startswith(directory.TMP_PREFIX)]
    except OSError:
        return
    for name in leftovers:
        shutil.rmtree(os.path.join(checkpoint_dir, name), ignore_errors=True)
    _remove(os.path.join(checkpoint_dir, directory.LATEST))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
