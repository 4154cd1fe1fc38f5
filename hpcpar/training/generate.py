"""`hpcpar sample`: generate text from a trained checkpoint on one process.

The checkpoint is a `step-NNNNNNN` directory, a checkpoint directory (its `latest`) or a run
directory (the newest checkpoint of its checkpoint directory: `checkpoint_of`); which one was
loaded, at which step, is said on stderr, the text alone goes to stdout.
The checkpoint's global tensors load into a single-process GPT whatever layout
trained them (checkpoints hold global tensors). Sampling: temperature-scaled
softmax over the last position's logits, restricted to the top-k tokens. Text goes
in and out through the tokenizer recorded in the checkpoint (bytes for byte-level
runs); ids the tokenizer does not have (a model vocabulary larger than the
tokenizer's, e.g. padded to 50304 for GPT-2's 50257) get no probability.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

from hpcpar import backend
from hpcpar.autograd.tensor import no_grad
from hpcpar.checkpoint.directory import latest
from hpcpar.checkpoint.format import INDEX
from hpcpar.checkpoint.load import load as load_checkpoint
from hpcpar.checkpoint.parts import load_parts
from hpcpar.config.load import load_config, loads
from hpcpar.data import tokenizer
from hpcpar.errors import ConfigError, DataError, HpcparError
from hpcpar.nn.gpt import GPT
from hpcpar.training.routing import ExpertBias
from hpcpar.runtime.solo import SoloCommunicator


def checkpoint_of(path: str) -> str:
    """The checkpoint `path` names: itself (a `step-NNNNNNN` directory), its `latest` (a checkpoint
    directory), or for a run directory (it holds config.toml) the newest checkpoint of its
    checkpoint directory (<path>/checkpoints unless its checkpoint.dir says otherwise). Anything
    else is returned as given, for the checkpoint reader to name what is missing."""
    if os.path.isfile(os.path.join(path, INDEX)):
        return path
    found = latest(path)
    if found is None and os.path.isfile(os.path.join(path, "config.toml")):
        try:
            stored = load_config(os.path.join(path, "config.toml")).checkpoint.dir
        except HpcparError:
            stored = ""
        found = latest(stored or os.path.join(path, "checkpoints"))
    return found or path


def load(path: str) -> tuple[GPT, dict]:
    """A single-process GPT with the weights of the checkpoint at `path` (`checkpoint_of`), and the
    checkpoint's meta."""
    resolved = checkpoint_of(path)
    _, meta = load_checkpoint(resolved, {}, SoloCommunicator())
    cfg = loads(meta["config"], origin=f"config stored in {resolved}")
    model = GPT(cfg.model, seed=cfg.train.seed)
    # The MoE routing bias (model.moe_expert_bias_rate) lives in the metadata, not in the weights.
    load_parts(resolved, [model, ExpertBias(cfg.model, [model])], SoloCommunicator(), weights_only=True)
    return model.eval(), meta


def load_model(path: str) -> GPT:
    """A single-process GPT with the weights of the checkpoint at `path` (or its latest)."""
    return load(path)[0]


def tokenizer_of(meta: dict, path: str, given: str | None = None) -> tokenizer.Tokenizer:
    """The checkpoint's tokenizer; `given` (a tokenizer.json) must match it when both are known.
    Checkpoints from before tokenizers were recorded trained on bytes when data.format is bytes."""
    stored = meta.get("tokenizer")
    if stored is None and loads(meta["config"], origin=f"config stored in {path}").data.format == "bytes":
        stored = tokenizer.BYTES_RECORD
    if given:
        text = tokenizer.read(given)
        tokenizer.require_match(stored, tokenizer.record(text), f"checkpoint {path}", f"--tokenizer {given}")
        return tokenizer.from_json(text, given)
    if stored is None:
        raise DataError(f"checkpoint {path} records no tokenizer (its data came without tokenizer.json); "
                        "give --tokenizer FILE")
    return tokenizer.from_json(stored["json"], f"the tokenizer of checkpoint {path}")


def check_options(tokens: int, temperature: float, top_k: int, seed: int) -> None:
    """The sampling options `hpcpar sample` takes, or a ConfigError naming the first bad one."""
    if not (math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"--temperature must be a finite number > 0, got {temperature}")
    if tokens < 0:
        raise ConfigError(f"--tokens must be >= 0, got {tokens}")
    if top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0 samples from every token), got {top_k}")
    if seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {seed}")


def generate(model: GPT, prompt: list[int], tokens: int, temperature: float = 0.8, top_k: int = 40,
             seed: int = 0, vocab_limit: int | None = None) -> list[int]:
    """Extend the token ids `prompt` by `tokens` sampled ids, from the `top_k` likeliest (0: from
    every id). Ids >= `vocab_limit` (past the tokenizer's vocabulary) get -inf logits: no probability."""
    check_options(tokens, temperature, top_k, seed)
    rng = np.random.default_rng(seed)
    ids = list(prompt) or [0]
    block = model.config.block_size
    with no_grad():
        for _ in range(tokens):
            context = np.array([ids[-block:]], dtype=np.int64)
            logits = backend.to_host(model(context).data[0, -1]).astype(np.float64) / temperature
            if vocab_limit is not None:
                logits[vocab_limit:] = -np.inf
            if 0 < top_k < logits.size:
                cutoff = np.partition(logits, -top_k)[-top_k]
                logits[logits < cutoff] = -np.inf
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            ids.append(int(rng.choice(probs.size, p=probs)))
    return ids


def sample_checkpoint(path: str, prompt: str = "def ", tokens: int = 200, temperature: float = 0.8, top_k: int = 40,
         seed: int = 0, tokenizer_file: str | None = None) -> int:
    """`hpcpar sample` on this process (under mpiexec the CLI runs it on rank 0 alone)."""
    check_options(tokens, temperature, top_k, seed)    # before loading what may be a large checkpoint
    model, meta = load(path)
    tok = tokenizer_of(meta, path, tokenizer_file)
    vocab = model.config.vocab_size
    if tok.vocab_size > vocab:
        raise DataError(f"the {tok.kind} tokenizer has {tok.vocab_size} ids but the model of {path} only {vocab}; "
                        "give the tokenizer the model was trained with")
    sys.stderr.write(f"sampling from {checkpoint_of(path)} (step {meta.get('step', '?')}, "
                     f"{tok.kind} tokenizer with {tok.vocab_size} ids)\n")
    prompt_ids = tok.encode(prompt) or tok.encode("\n")
    ids = generate(model, prompt_ids, tokens, temperature, top_k, seed, vocab_limit=tok.vocab_size)
    sys.stdout.write(tok.decode(ids) + "\n")
    return 0
