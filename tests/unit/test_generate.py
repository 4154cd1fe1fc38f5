"""`hpcpar sample`: ids past the tokenizer's vocabulary get no probability; which tokenizer decodes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hpcpar.config.load import to_toml
from hpcpar.config.sections import Config, DataConfig
from hpcpar.training import generate
from hpcpar.data import tokenizer
from hpcpar.errors import DataError
from hpcpar.nn.gpt import GPT, GPTConfig


class Padded:
    """A stand-in model over 300 ids whose ids 256.. (past a byte tokenizer) have the largest logits."""

    config = GPTConfig(vocab_size=300, block_size=8)

    def __call__(self, ids):
        logits = np.zeros((1, ids.shape[1], 300))
        logits[..., 256:] = 10.0
        return type("Out", (), {"data": logits})()


def test_padding_past_the_tokenizer_is_never_sampled():
    free = generate.generate(Padded(), [1, 2, 3], 40, temperature=1.0, top_k=0, seed=1)
    assert min(free[3:]) >= 256                                  # without the limit the padding wins
    limited = generate.generate(Padded(), [1, 2, 3], 40, temperature=1.0, top_k=0, seed=1, vocab_limit=256)
    assert max(limited) < 256 and len(set(limited[3:])) > 10     # with it: none, and the rest evenly


def test_sampling_a_real_model_with_the_limit():
    model = GPT(GPTConfig(vocab_size=300, block_size=8, n_layer=1, n_head=2, n_embd=16), seed=0).eval()
    assert max(generate.generate(model, [104, 105], 30, top_k=0, vocab_limit=256)) < 256


def meta(data_format="bytes", tok=None):
    cfg = dataclasses.replace(Config(), data=DataConfig(format=data_format))
    return {"config": to_toml(cfg), **({"tokenizer": tok} if tok is not None else {})}


def test_tokenizer_of_a_checkpoint(tmp_path):
    assert generate.tokenizer_of(meta(), "ck").kind == "bytes"        # before tokenizers were recorded
    with pytest.raises(DataError, match="records no tokenizer .* give --tokenizer FILE"):
        generate.tokenizer_of(meta("bin"), "ck")
    (tmp_path / "bytes.json").write_text(tokenizer.BYTES_JSON)
    assert generate.tokenizer_of(meta("bin"), "ck", str(tmp_path / "bytes.json")).kind == "bytes"
    other = {"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(256)}, "merges": []}}
    (tmp_path / "other.json").write_text(__import__("json").dumps(other))
    with pytest.raises(DataError, match="tokenizer mismatch: checkpoint ck .* but --tokenizer"):
        generate.tokenizer_of(meta(tok=tokenizer.BYTES_RECORD), "ck", str(tmp_path / "other.json"))
