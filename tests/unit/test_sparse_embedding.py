"""Untied embeddings (model.tie_embeddings) and the sparse/dense choice of wte's gradient sync.

The config keys and their refusals, the parameter counts of an untied GPT (every tp rank and
pipeline stage against the built model), the untied head's own weight and init, wte's gradient
nonzero only in the rows looked up, and the byte formulas behind the per-step decision
(parallel/dp/sparse.py). The sync itself: tests/parallel/test_sparse_embedding.py.
"""

from dataclasses import replace

import numpy as np
import pytest

from hpcpar import backend
from hpcpar.config.load import load_config
from hpcpar.config.validate import validate
from hpcpar.errors import ConfigError
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.parallel.dp.sparse import (choose_sparse, dense_bytes, owned_dense_bytes, owned_sparse_bytes,
                                      row_owners, sparse_bytes)
from test_gpt import Ranks, elements  # a stand-in tp group, parameter elements of a built model

CFG = GPTConfig(vocab_size=512, block_size=8, n_layer=3, n_head=4, n_embd=16, dtype="float64")
UNTIED = replace(CFG, tie_embeddings=False)




def test_config_keys_defaults_and_refusals():
    cfg = load_config(None, [])
    assert cfg.model.tie_embeddings is True and cfg.train.sparse_embedding == "auto"
    cfg = load_config(None, ["model.tie_embeddings=false", "train.sparse_embedding=never"])
    assert cfg.model.tie_embeddings is False and cfg.train.sparse_embedding == "never"
    with pytest.raises(ConfigError, match="sparse_embedding") as info:
        validate(load_config(None, ["train.sparse_embedding=sometimes"]), 4)
    assert "\n" not in str(info.value) and info.value.exit_status == 2


@pytest.mark.parametrize("bias", [True, False])
def test_untied_parameter_counts_are_the_elements_of_a_built_gpt(bias):
    cfg, tied = replace(UNTIED, bias=bias), replace(CFG, bias=bias)
    v, c = cfg.vocab_size, cfg.n_embd
    assert cfg.num_params() == elements(GPT(cfg)) == tied.num_params() + v * c
    assert cfg.non_embedding_params() == tied.non_embedding_params()  # the head's weight counts as embedding
    for tp in (1, 2, 4):
        for rank in range(tp):
            tp_comm = Ranks(tp, rank) if tp > 1 else None
            assert cfg.num_params(tp) == elements(GPT(cfg, tp_comm=tp_comm))
            for embed, head in ((False, False), (True, False), (False, True), (True, True)):
                stage = GPT(cfg, tp_comm=tp_comm, layers=[1, 2], embed=embed, head=head)
                assert cfg.stage_params(2, embed, head, tp) == elements(stage), (tp, rank, embed, head)


def test_untied_head_is_a_plain_parameter_with_its_own_init():
    model = GPT(UNTIED, seed=3)
    params = dict(model.named_parameters())
    head, wte = params["lm_head.weight"], params["transformer.wte.weight"]
    assert head.tied_to is None and model.head_weight is head and wte.sparse_grad and not head.sparse_grad
    h, w = backend.to_host(head.data), backend.to_host(wte.data)
    assert h.shape == w.shape and not np.array_equal(h, w) and abs(h.std() - 0.02) < 0.002
    # A stage holding the head alone: a plain parameter too, the same values (its own name's stream).
    last = GPT(UNTIED, seed=3, layers=[2], embed=False, head=True)
    assert last.lm_head.weight.tied_to is None
    assert np.array_equal(backend.to_host(last.lm_head.weight.data), h)
    assert [n for n, _ in dict(model.fsdp_units())["head"]][-1] == "lm_head.weight"
    # Tied (the default): no lm_head on the whole model, the copy on a head-only stage.
    tied = GPT(CFG, seed=3)
    assert "lm_head.weight" not in dict(tied.named_parameters()) and not tied.transformer.wte.weight.sparse_grad
    assert GPT(CFG, layers=[2], embed=False, head=True).lm_head.weight.tied_to == "transformer.wte.weight"


def test_untied_wte_gradient_lives_in_the_rows_looked_up():
    x = np.array([[1, 5, 5, 9, 200, 3, 1, 7]])
    y = np.roll(x, -1, axis=1)
    for cfg, dense in ((UNTIED, False), (CFG, True)):
        model = GPT(cfg, seed=0)
        model(x, y).backward()
        g = backend.to_host(model.transformer.wte.weight.grad)
        rows = set(np.flatnonzero(np.abs(g).sum(axis=1)).tolist())
        assert (rows == set(x.ravel().tolist())) is not dense, cfg.tie_embeddings
        assert len(rows) == (cfg.vocab_size if dense else 6)


def test_byte_formulas():
    v, row, n = 32768, 64 * 4, 4
    assert dense_bytes(v, row, n) == 2 * (n - 1) / n * v * row
    counts = [100, 200, 300, 400]
    assert sparse_bytes(counts, row, n) == (n - 1) / n * 1000 * (row + 8)
    assert sparse_bytes(counts, row, 1) == 0.0 and dense_bytes(v, row, 1) == 0.0


def test_the_choice_follows_the_bytes_and_the_mode():
    v, row, n = 1000, 128, 4
    # break-even: sum(k) (row + 8) = 2 V row
    even = 2 * v * row / (row + 8)
    below, above = [int(even // 4) - 1] * 4, [int(even // 4) + 1] * 4
    assert choose_sparse("auto", below, v, row, n)
    assert not choose_sparse("auto", above, v, row, n)
    assert not choose_sparse("never", [0] * 4, v, row, n)
    assert not choose_sparse("auto", [0], v, row, 1)  # one rank: nothing to send either way
    with pytest.raises(ConfigError, match="sparse_embedding"):
        choose_sparse("always", below, v, row, n)


def test_row_owners_tile_the_rows_in_blocks_of_ceil_v_over_n():
    assert row_owners(1024, 4) == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    assert row_owners(1003, 4) == [(0, 251), (251, 502), (502, 753), (753, 1003)]
    assert row_owners(5, 4) == [(0, 2), (2, 4), (4, 5), (5, 5)]  # the last owner holds none
    for v in range(1, 40):
        for n in range(1, 9):
            spans = row_owners(v, n)
            per = -(-v // n)
            assert spans[0][0] == 0 and spans[-1][1] == v and len(spans) == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            # a row's owner is row // ceil(v/n), what OwnedRows sends by
            assert all(spans[r // per][0] <= r < spans[r // per][1] for r in range(v))


def test_owner_byte_formulas_and_break_even():
    row, n = 128, 4
    assert owned_dense_bytes(1024, row, n) == (n - 1) / n * 1024 * row
    assert owned_dense_bytes(1003, row, n) == (n - 1) / n * 4 * 251 * row  # padded to n ceil(V/n) rows
    k = np.arange(16).reshape(4, 4)
    # rows a rank owns itself (the diagonal) never leave it
    assert owned_sparse_bytes(k, row) == (k.sum() - np.trace(k)) / n * (row + 8)
    assert owned_sparse_bytes(np.diag([50, 60, 70, 80]), row) == 0.0
    assert owned_sparse_bytes([[7]], row) == 0.0
    # every rank touching every row: (n-1)/n V (row + 8) > the reduce-scatter's (n-1)/n V row
    full = np.full((n, n), 1024 // n)
    assert owned_sparse_bytes(full, row) > owned_dense_bytes(1024, row, n)


def test_untied_checkpoint_exports_lm_head_and_imports_untied(tmp_path):
    import dataclasses
    import json

    from hpcpar.checkpoint.save import save
    from hpcpar.config.load import to_toml
    from hpcpar.config.sections import Config
    from hpcpar.data import tokenizer
    from hpcpar.interop import huggingface, safetensors
    from hpcpar.runtime.comm import Communicator
    from hpcpar.training import generate

    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=16, tie_embeddings=False)
    model = GPT(cfg, seed=1)
    meta = {"config": to_toml(dataclasses.replace(Config(), model=cfg)), "tokenizer": tokenizer.BYTES_RECORD}
    ckpt = save(str(tmp_path / "ck"), 1, {f"model/{n}": (p.data, p.layout) for n, p in model.named_parameters()},
                meta, Communicator.local(), keep=None)
    written = huggingface.export(ckpt, str(tmp_path / "hf"))
    hf = safetensors.read(written[0])
    head = backend.to_host(model.lm_head.weight.data)
    assert np.array_equal(hf["lm_head.weight"], head)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is False
    back = huggingface.import_(str(tmp_path / "hf"), str(tmp_path / "back"))
    loaded = generate.load_model(back)
    assert not loaded.config.tie_embeddings
    assert np.array_equal(backend.to_host(loaded.lm_head.weight.data), head)
    ids = np.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert np.allclose(backend.to_host(loaded(ids).data), backend.to_host(model(ids).data), rtol=1e-6, atol=1e-6)
