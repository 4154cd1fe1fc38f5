"""`hpcpar sample`: generate bytes from a trained checkpoint on one process.

The checkpoint's global tensors load into a single-process GPT whatever layout
trained them (checkpoints hold global tensors). Sampling: temperature-scaled
softmax over the last position's logits, restricted to the top-k tokens.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from hpcpar import backend, checkpoint, config
from hpcpar.comm import Communicator
from hpcpar.errors import ConfigError
from hpcpar.layout import Layout
from hpcpar.nn import GPT
from hpcpar.tensor import no_grad


def load_model(path: str) -> GPT:
    """A single-process GPT with the weights of the checkpoint at `path` (or its latest)."""
    resolved = checkpoint.latest(path) or path
    _, meta = checkpoint.load(resolved, {}, Communicator.local())
    cfg = config.loads(meta["config"], origin=f"config stored in {resolved}")
    model = GPT(cfg.model, seed=cfg.train.seed)
    wanted = {f"model/{name}": Layout.replicated(p.shape) for name, p in model.named_parameters()}
    arrays, _ = checkpoint.load(resolved, wanted, Communicator.local())
    model.load_state_dict({name[len("model/"):]: a for name, a in arrays.items()})
    return model.eval()


def generate(model: GPT, prompt: bytes, tokens: int, temperature: float = 0.8, top_k: int = 40,
             seed: int = 0) -> bytes:
    """Extend `prompt` by `tokens` bytes sampled from the model."""
    if temperature <= 0:
        raise ConfigError(f"--temperature must be > 0, got {temperature}")
    if tokens < 0:
        raise ConfigError(f"--tokens must be >= 0, got {tokens}")
    rng = np.random.default_rng(seed)
    ids = list(prompt) or [ord("\n")]
    block = model.config.block_size
    with no_grad():
        for _ in range(tokens):
            context = np.array([ids[-block:]], dtype=np.int64)
            logits = backend.to_host(model(context).data[0, -1]).astype(np.float64) / temperature
            if 0 < top_k < logits.size:
                cutoff = np.partition(logits, -top_k)[-top_k]
                logits[logits < cutoff] = -np.inf
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            ids.append(int(rng.choice(probs.size, p=probs)))
    return bytes(ids)


def main(path: str, prompt: str = "def ", tokens: int = 200, temperature: float = 0.8, top_k: int = 40,
         seed: int = 0) -> int:
    if MPI.COMM_WORLD.rank != 0:
        return 0
    model = load_model(path)
    text = generate(model, prompt.encode(), tokens, temperature, top_k, seed)
    sys.stdout.write(text.decode("utf-8", errors="replace") + "\n")
    return 0
