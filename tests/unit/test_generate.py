"""`hpcpar sample` and `hpcpar eval`: ids past the tokenizer's vocabulary get no probability; which tokenizer
decodes; which checkpoint a path names, and which data eval reads by default."""

from __future__ import annotations

import dataclasses
import shutil

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


def tiny_checkpoint(checkpoint_dir, step: int = 7, data: DataConfig = DataConfig()) -> str:
    """A committed checkpoint of a tiny model at `step` in `checkpoint_dir` (its config: `data`)."""
    from hpcpar.checkpoint.save import save
    from hpcpar.runtime.comm import Communicator
    model_cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16)
    model = GPT(model_cfg, seed=0)
    cfg = dataclasses.replace(Config(), model=model_cfg, data=data)
    return save(str(checkpoint_dir), step, {f"model/{n}": (p.data, p.layout) for n, p in model.named_parameters()},
                {"config": to_toml(cfg), "tokenizer": tokenizer.BYTES_RECORD, "step": step}, Communicator.local(),
                keep=None)


def test_a_run_directory_names_its_newest_checkpoint(tmp_path, capsys):
    """`hpcpar sample runs/x` (and `eval`) find the run's checkpoints; sample says which it loaded."""
    run = tmp_path / "run"
    tiny_checkpoint(run / "checkpoints", step=3)
    newest = tiny_checkpoint(run / "checkpoints", step=7)
    (run / "config.toml").write_text(to_toml(Config()))
    assert generate.checkpoint_of(str(run)) == newest                      # a run directory
    assert generate.checkpoint_of(str(run / "checkpoints")) == newest      # a checkpoint directory
    assert generate.checkpoint_of(newest) == newest                        # a checkpoint
    assert generate.checkpoint_of(str(tmp_path / "nothing")) == str(tmp_path / "nothing")   # the reader says why
    elsewhere = tmp_path / "ckpts"
    moved = tiny_checkpoint(elsewhere, step=5)
    (run / "config.toml").write_text(to_toml(dataclasses.replace(
        Config(), checkpoint=dataclasses.replace(Config().checkpoint, dir=str(elsewhere)))))
    shutil.rmtree(run / "checkpoints")
    assert generate.checkpoint_of(str(run)) == moved                       # its config.toml's checkpoint.dir
    assert generate.sample_checkpoint(str(run), prompt="ab", tokens=3) == 0
    said = capsys.readouterr()
    assert said.out.startswith("ab") and said.err == f"sampling from {moved} (step 5, bytes tokenizer with 256 ids)\n"


def test_eval_defaults_to_the_checkpoints_data(tmp_path):
    """`hpcpar eval CHECKPOINT` without --data evaluates on the data the checkpoint trained on
    (the built-in corpus is ""); data that is not here is one line naming --data."""
    from hpcpar.training.evaluate import eval_config
    text = tmp_path / "corpus.txt"
    text.write_text("hello " * 100)
    own = to_toml(dataclasses.replace(Config(), data=DataConfig(corpus=str(text), val_fraction=0.1)))
    cfg = eval_config(own, "config stored in ck", None, None, "val", [])
    assert (cfg.data.corpus, cfg.data.format, cfg.data.val_fraction) == (str(text), "bytes", 0.1)
    builtin = eval_config(to_toml(Config()), "config stored in ck", None, None, "all", [])
    assert (builtin.data.corpus, builtin.data.format, builtin.data.val_fraction) == ("", "bytes", 0.0)
    assert eval_config(own, "config stored in ck", "", None, "val", []).data.corpus == ""      # --data ""
    gone = to_toml(dataclasses.replace(Config(), data=DataConfig(corpus=str(tmp_path / "gone"))))
    with pytest.raises(DataError, match=r"the data ck was trained on, data.corpus='.*gone', is not here .* give "
                                        r"--data PATH"):
        eval_config(gone, "config stored in ck", None, None, "val", [])


def test_sampling_loads_the_moe_routing_bias(tmp_path):
    """The expert bias (model.moe_expert_bias_rate) is in the checkpoint's metadata: `hpcpar sample`'s
    model routes with the bias the run trained to, not with zeros."""
    from hpcpar.checkpoint.save import save
    from hpcpar.runtime.comm import Communicator
    model_cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=16, moe_experts=4,
                          moe_expert_bias_rate=0.1)
    model = GPT(model_cfg, seed=0)
    bias = np.random.default_rng(0).standard_normal((2, 4)) / 3
    cfg = dataclasses.replace(Config(), model=model_cfg)
    path = save(str(tmp_path), 1, {f"model/{n}": (p.data, p.layout) for n, p in model.named_parameters()},
                {"config": to_toml(cfg), "tokenizer": tokenizer.BYTES_RECORD, "step": 1,
                 "moe_expert_bias": bias.tolist()}, Communicator.local(), keep=None)
    loaded, _ = generate.load(path)
    assert [layer.expert_bias.tolist() for layer in loaded.moe_layers()] == bias.tolist()
