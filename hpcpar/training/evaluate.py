"""`hpcpar eval CHECKPOINT [--data PATH]`: loss and perplexity on held-out tokens, on any mesh.

    mpiexec -n 4 hpcpar eval runs/x [--data data/tok] [--split val|all] [--max-tokens N]
                             [--format bytes|bin|hdf5] [--set section.key=value ...]

CHECKPOINT is a checkpoint, a checkpoint directory or a run directory (`generate.checkpoint_of`).
The run is the checkpoint's own configuration, its data the checkpoint's (data.corpus as it
trained, "" the built-in corpus) or `--data` (format from the path when not given: a .bin file
or a directory with tokens.bin / train.bin is ``bin``, .h5 / .hdf5 or a directory with tokens.h5
is ``hdf5``, anything else ``bytes``; ``--data ""`` the built-in corpus), the mesh back to auto
(any layout: ``--set mesh.tp=2`` etc.) and no optimizer. ``--split val`` (default) evaluates the
part training held out (the tail ``data.val_fraction`` of a single sequence, or val.bin / the
``val`` dataset); ``--split all`` every token of the data.

Unlike training's periodic evaluation (random windows), this is one deterministic pass: the
held-out sequence is cut into W = floor((n - 1) / T) windows of T tokens (or the first
``--max-tokens``), window k is global sample k, the last global batch is padded with ignored
targets, and the loss is the mean over all W*T target tokens: the same number on every mesh.
Perplexity is exp(loss). A run that trained on packed documents (`data.packing = "documents"`,
data/packing.py) is scored the same way: each window's segments attended alone, positions
restarting at each document, the targets that cross a boundary left out, so the loss is the mean
over the W*T - D kept targets (D: document starts inside the windows' targets); `--set
data.packing=none` scores the plain stream instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from hpcpar.checkpoint.load import load as read_checkpoint
from hpcpar.config.load import loads, parse_override
from hpcpar.config.sections import CheckpointConfig, Config, MeshConfig
from hpcpar.data import corpus, formats, packing
from hpcpar.errors import ConfigError, DataError
from hpcpar.runtime.comm import Communicator, mpi_world
from hpcpar.training.generate import checkpoint_of
from hpcpar.training.trainer import Trainer

_BATCHES_PER_CALL = 16   # global batches built and run at a time (bounds memory on long sets)


def infer_format(path: str) -> str:
    """bin, hdf5 or bytes, from the path (see the module docstring)."""
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if names & {formats.BIN_FILE, "train.bin", "val.bin"}:
            return "bin"
        return "hdf5" if formats.HDF5_FILE in names else "bytes"
    ext = os.path.splitext(path)[1].lower()
    return "bin" if ext == ".bin" else "hdf5" if ext in (".h5", ".hdf5") else "bytes"


def eval_config(stored: str, origin: str, data_path: str | None, fmt: str | None, split: str,
                overrides: list[str]) -> Config:
    """The checkpoint's config with `--data` (None: the checkpoint's own data), an auto mesh, no
    periodic work, then `overrides`."""
    cfg = loads(stored, origin=origin)
    if data_path is None:
        data_path, fmt = cfg.data.corpus, fmt or cfg.data.format
        if data_path and not os.path.exists(data_path):
            raise DataError(f"the data {origin.removeprefix('config stored in ')} was trained on, data.corpus="
                            f"{data_path!r}, is not here (a path relative to where it trained?); give --data PATH")
    fmt = fmt or infer_format(data_path)
    dtype = _recorded_dtype(data_path, fmt) or cfg.data.token_dtype
    data_cfg = dataclasses.replace(cfg.data, corpus=data_path, format=fmt, token_dtype=dtype,
                                   val_fraction=0.0 if split == "all" else cfg.data.val_fraction)
    cfg = dataclasses.replace(cfg, data=data_cfg, mesh=MeshConfig(), checkpoint=CheckpointConfig(),
                              run=dataclasses.replace(cfg.run, eval_every=0, progress=False))
    for text in overrides:
        section, key, value = parse_override(text)
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{key: value})})
    return cfg


def _recorded_dtype(path: str, fmt: str) -> str | None:
    """The token dtype meta.json records for a bin file or directory (None: not recorded)."""
    if fmt != "bin":
        return None
    where = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    meta = formats._read_meta(where) or {}
    dtypes = {e.get("dtype") for e in meta.get("files", {}).values()}
    return dtypes.pop() if len(dtypes) == 1 else None


def check_max_tokens(max_tokens: int) -> None:
    """`--max-tokens`: a number of tokens, 0 for all of them."""
    if max_tokens < 0:
        raise ConfigError(f"--max-tokens must be >= 0 (0 evaluates every token), got {max_tokens}")


def evaluate(trainer: Trainer, tokens, max_tokens: int = 0, starts: np.ndarray | None = None) -> dict:
    """Mean loss over the windows of `tokens` (collective): {loss, perplexity, tokens, windows}.
    `starts`: the document starts of `tokens` (packed documents, the module doc); None: the stream."""
    check_max_tokens(max_tokens)
    t = trainer.cfg.model.block_size
    windows = (len(tokens) - 1) // t
    if max_tokens:
        windows = min(windows, max_tokens // t)
    if windows == 0:
        limit = f" (--max-tokens {max_tokens})" if max_tokens else ""
        raise DataError(f"the held-out data has {len(tokens)} tokens{limit}, fewer than one window of "
                        f"block_size + 1 = {t + 1}")
    per_batch = trainer.tokens_per_step // t      # global samples per batch: dp * micro_batch_size * microbatches
    n_batches = -(-windows // per_batch)
    total = 0.0
    for first in range(0, n_batches, _BATCHES_PER_CALL):
        batches = [_window_batch(trainer, tokens, [i * per_batch + k for k in ids], windows, starts)
                   for i in range(first, min(first + _BATCHES_PER_CALL, n_batches)) for ids in trainer.sample_ids()]
        losses = trainer.forward_losses(batches)
        if trainer.is_loss_reporter:   # each micro-batch loss times its targets: the sum over them
            total += sum(_loss_sum(float(loss), batch, trainer.cp.size) for loss, batch in zip(losses, batches))
    kept = windows * t
    if starts is not None:   # the windows' targets are tokens 1 .. W*T; one at each document start is left out
        kept -= int(np.count_nonzero((starts > 0) & (starts <= windows * t)))
    loss = float(trainer.mesh.world.all_reduce(np.array([total]), op="sum")[0]) / kept
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": windows * t, "windows": windows}


def _window_batch(trainer: Trainer, tokens, sample_ids: list, windows: int, starts) -> tuple:
    """Windows `sample_ids` of `tokens` as this rank's micro-batch, its columns under context
    parallelism (`ContextParallel.columns`): (x, y), or packed (`starts` given) (x, y, Documents),
    boundary targets -100 and the Documents counting the micro-batch's kept targets, so that its
    loss is their mean (`GPT._head`)."""
    t = trainer.cfg.model.block_size
    ks = np.asarray(sample_ids, dtype=np.int64)
    documents = crossing = None
    if starts is not None:
        documents, crossing = packing.Documents.of_windows(starts, np.where(ks < windows, ks, 0) * t, t)
        documents.targets, documents.losses = max(int(np.count_nonzero(~crossing[ks < windows])), 1), 1
    cols = trainer.cp.columns(t, documents) if trainer.cp.columns is not None else None
    x, y = corpus.get_window_batch(tokens, sample_ids, t, windows, cols)   # padding windows: targets -100
    if documents is None:
        return x, y
    y[crossing if cols is None else crossing[:, cols]] = packing.IGNORE
    return x, y, documents


def _loss_sum(loss: float, batch: tuple, cp: int) -> float:
    """A micro-batch's loss summed over the targets this rank holds: the loss is their mean
    (plain), or packed their sum * cp / the micro-batch's kept targets (`GPT._head`'s weighting)."""
    if len(batch) == 2:
        return loss * int(np.count_nonzero(batch[1] != -100))
    return loss * batch[2].targets / cp


def evaluate_checkpoint(path: str, data_path: str | None = None, fmt: str | None = None, split: str = "val",
                        max_tokens: int = 0, overrides: list[str] | None = None, json_out: str | None = None) -> int:
    """`hpcpar eval`: prints one line on rank 0 (and writes the figures as JSON to `json_out`, whose
    directory the CLI checks before the evaluation). `data_path` None: the checkpoint's data."""
    check_max_tokens(max_tokens)       # before loading the checkpoint and building the model
    world = mpi_world()
    path = checkpoint_of(path)
    _, meta = read_checkpoint(path, {}, Communicator(world, "world"))
    cfg = eval_config(meta["config"], f"config stored in {path}", data_path, fmt, split, overrides or [])
    trainer = Trainer(cfg, world)
    trainer.load(path, weights_only=True)
    tokens = trainer.val_tokens if split == "val" else trainer.train_tokens
    if split == "val" and len(tokens) == 0:
        why = ("data.val_fraction=0 and no val file" if not cfg.data.val_fraction else
               f"data.val_fraction={cfg.data.val_fraction:g} of its {len(trainer.train_tokens)} tokens is not one "
               "token")
        raise DataError(f"{cfg.data.corpus or 'the built-in corpus'} has no held-out part ({why}); use --split all")
    starts = None
    if cfg.data.packing == "documents":   # scored as it trained: each document alone
        starts = packing.document_starts(trainer.dataset, "val" if split == "val" else "train")
    result = evaluate(trainer, tokens, max_tokens, starts)
    if world.rank == 0:
        mesh = trainer.mesh_text()   # as `hpcpar train` says it
        packed = ", packed documents" if starts is not None else ""
        print(f"eval {path} on {trainer.dataset.description} ({split} split{packed}, {result['tokens']:,} tokens in "
              f"{result['windows']:,} windows of {cfg.model.block_size}): loss {result['loss']:.6f}, "
              f"perplexity {result['perplexity']:.4f} (mesh {mesh})")
        if json_out:
            with open(json_out, "w") as f:
                json.dump({**result, "checkpoint": path, "data": cfg.data.corpus, "split": split, "mesh": mesh,
                           "packing": cfg.data.packing}, f, indent=1)
    return 0
