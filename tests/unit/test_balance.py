"""Token-balanced data parallelism (data.balance, hpcpar/data/balance.py) and the per-token loss, in one process.

- the dealing: every window of the global batch exactly once, micro_batch_size per slot,
  deterministic, a hand-worked greedy example, and better balanced than the sample-id order on
  long-tailed documents (the metrics' work_imbalance);
- the per-token weights: the Documents of a global batch's micro-batches count its kept targets
  and its dp * microbatches losses, and training is the same float64 run whatever the grouping of
  the windows into micro-batches (which the mean of micro-batch means was not);
- what is refused: balance without packing, balance with experts (one line, exit 2).
"""

import subprocess
import sys

import numpy as np
import pytest

from hpcpar.config.load import load_config
from hpcpar.config.validate import validate
from hpcpar.data import balance, formats, packing
from hpcpar.errors import ConfigError, DataError
from hpcpar.training.trainer import Trainer

_rng = np.random.default_rng(0)
TOKENS = _rng.integers(0, 256, 20_000).astype(np.uint8)
# Long-tailed document lengths (as tests/parallel/test_packing.py): windows of 16 tokens hold 1 to several segments.
STARTS = np.unique(np.concatenate([[0], np.cumsum(np.ceil(_rng.pareto(1.2, 4000) * 6)).astype(np.int64)]))
DATA = formats.from_tokens(TOKENS, 0.05, STARTS[STARTS < len(TOKENS)])
BASE = ["model.vocab_size=256", "model.block_size=16", "model.n_layer=2", "model.n_head=4", "model.n_embd=16",
        "model.dtype=float64", "train.steps=3", "train.warmup=1", "train.lr=0.01", "train.seed=7",
        "run.progress=false", "data.packing=documents", "mesh.pp=1"]


def test_window_work_is_the_sum_of_squared_segment_lengths():
    d, _ = packing.Documents.of_windows(np.array([0, 5, 9, 10, 30]), np.array([0, 3, 8]), 8)
    # segments [5, 3], [2, 4, 1, 1], [1, 1, 6]
    assert balance.window_work(d).tolist() == [25 + 9, 4 + 16 + 1 + 1, 1 + 1 + 36]


def test_greedy_longest_first_by_hand():
    # By work: ids 1, 6 (9), 2, 3 (4), 0, 4, 5, 7 (1). Ranks: 1 -> 0, 6 -> 1, 2 -> 0 (a tie at 9: the
    # lower rank), 3 -> 1, 0 -> 0, 4 -> 1, 5 -> 0 (now full), 7 -> 1. Rank 0's micro-batches: 1 -> 0,
    # 2 -> 1, 0 -> 1 (full), 5 -> 0; rank 1's: 6 -> 0, 3 -> 1, 4 -> 1, 7 -> 0.
    ids = balance.by_work(np.array([1, 9, 4, 4, 1, 1, 9, 1]), dp=2, microbatches=2, micro_batch_size=2)
    assert ids.tolist() == [[[1, 5], [0, 2]], [[6, 7], [3, 4]]]
    # Equal work: ties by sample id, dealt round the ranks.
    assert balance.by_work(np.ones(6, dtype=np.int64), 3, 1, 2).tolist() == [[[0, 3]], [[1, 4]], [[2, 5]]]


@pytest.mark.parametrize("dp, m, mbs", [(4, 3, 5), (2, 4, 1), (3, 1, 7), (1, 4, 2)])
def test_every_window_once_in_full_slots_deterministically(dp, m, mbs):
    work = (np.random.default_rng(dp * 10 + m).pareto(1.2, dp * m * mbs) * 50).astype(np.int64) + 1
    ids = balance.by_work(work, dp, m, mbs)
    assert ids.shape == (dp, m, mbs)
    assert sorted(ids.reshape(-1).tolist()) == list(range(dp * m * mbs))
    assert all((np.diff(slot) > 0).all() for slot in ids.reshape(-1, mbs))
    assert np.array_equal(ids, balance.by_work(work.copy(), dp, m, mbs))
    plain = balance.in_order(dp, m, mbs)
    assert plain.tolist() == [[list(range((j * dp + d) * mbs, (j * dp + d + 1) * mbs)) for j in range(m)]
                              for d in range(dp)]
    rank_work = work[ids.reshape(dp, -1)].sum(axis=1)
    assert rank_work.max() <= work[plain.reshape(dp, -1)].sum(axis=1).max()


def test_attention_dealing_balances_long_tailed_windows():
    dp, m, mbs = 4, 2, 4
    for step in range(5):
        plain = balance.deal(DATA, "train", 7, step, dp, m, mbs, 16, "documents", "none")
        dealt = balance.deal(DATA, "train", 7, step, dp, m, mbs, 16, "documents", "attention")
        assert dealt.targets == plain.targets and dealt.work.sum() == plain.work.sum()
        assert dealt.kept.sum() == plain.targets
        before, after = plain.figures()["work_imbalance"], dealt.figures()["work_imbalance"]
        assert 1.0 <= after <= before and after < 1.1, (step, before, after)
        # Greedy by work: no rank exceeds another by more than the largest window's work.
        window = balance.window_work(packing.get_batch(DATA, "train", 7, step, range(dp * m * mbs), 16,
                                                       packing="documents")[2])
        assert dealt.work.max() - dealt.work.min() <= window.max()
    assert balance.deal(DATA, "train", 7, 0, dp, m, mbs, 16).figures() == {}   # unpacked: no figures


def test_the_documents_count_the_global_batch():
    dp, m = 2, 3
    cfg = load_config(None, BASE + ["train.micro_batch_size=2", f"train.microbatches={m}", "data.balance=attention"])
    kept = 0
    for rank in range(dp):
        batches = balance.GlobalBatches(DATA, cfg.data, cfg.train, 16, dp, rank).batches("train", 1)
        assert len(batches) == m
        for x, y, documents in batches:
            assert x.shape == (2, 16) and documents.losses == dp * m
            kept += int((y != packing.IGNORE).sum())
    assert kept == documents.targets == balance.deal(DATA, "train", 7, 1, dp, m, 2, 16, "documents").targets


def run(overrides):
    t = Trainer(load_config(None, BASE + overrides), tokens=DATA)
    records = []
    t.train(steps=2, files=False, on_step=records.append)
    params, val = t.global_parameters(), t.evaluate(2)
    t.free()
    return [(r["loss"], r["grad_norm"]) for r in records], params, val, records


def test_the_per_token_loss_does_not_depend_on_the_grouping():
    """One global batch of 8 windows as 1 x 8, 4 x 2 and (dealt by work) 4 x 2: the same losses,
    gradient norms, parameters and validation loss in float64; the mean of micro-batch means was not."""
    whole = run(["train.micro_batch_size=8", "train.microbatches=1"])
    for overrides in (["train.micro_batch_size=2", "train.microbatches=4"],
                      ["train.micro_batch_size=2", "train.microbatches=4", "data.balance=attention"]):
        steps, params, val, records = run(overrides)
        assert np.allclose(steps, whole[0], rtol=1e-12, atol=0)
        for name, p in params.items():
            assert np.abs(p - whole[1][name]).max() <= 1e-10 * np.abs(whole[1][name]).max(), name
        assert val == pytest.approx(whole[2], rel=1e-12)
        assert all(r["work_imbalance"] == 1.0 and r["target_imbalance"] == 1.0 for r in records)   # dp = 1
    t = Trainer(load_config(None, BASE + ["train.micro_batch_size=2", "train.microbatches=4"]), tokens=DATA)
    batches = t.microbatches(0)
    means = t.forward_losses(batches)     # weighted: kept_here * 4 / kept_global each
    per_token = sum(means) / 4
    unweighted = [loss * b[2].targets / (b[2].losses * int((b[1] != packing.IGNORE).sum()))
                  for loss, b in zip(means, batches)]
    t.free()
    assert per_token == pytest.approx(whole[0][0][0], rel=1e-12)
    assert abs(sum(unweighted) / 4 - per_token) > 1e-6   # the grouping mattered to the old rule


def test_balance_needs_packing_and_refuses_experts():
    with pytest.raises(ConfigError, match="data.balance = \"attention\" deals packed documents: set data.packing"):
        validate(load_config(None, ["data.balance=attention"]), 1)
    with pytest.raises(ConfigError, match="does not compose with model.moe_experts > 0"):
        validate(load_config(None, ["data.balance=attention", "data.packing=documents", "model.moe_experts=4"]), 1)
    validate(load_config(None, ["data.balance=attention", "data.packing=documents"]), 1)


def test_hpcpar_train_refuses_balance_without_packing_with_exit_2(tmp_path):
    job = subprocess.run([sys.executable, "-m", "hpcpar", "train", "--set", "data.balance=attention",
                          "--set", f"run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert job.returncode == 2, job.stdout + job.stderr
    assert "data.packing" in job.stderr and "Traceback" not in job.stderr
    assert len([line for line in job.stderr.splitlines() if line.strip()]) == 1, job.stderr


def test_a_global_batch_without_a_kept_target_is_a_one_line_data_error():
    """Documents of one token each: every target crosses a boundary, nothing is left to average."""
    ones = formats.from_tokens(TOKENS[:2000], 0.05, np.arange(2000, dtype=np.int64))
    with pytest.raises(DataError, match="no target is left") as info:
        balance.deal(ones, "train", 7, 0, 2, 1, 2, 16, "documents")
    assert "\n" not in str(info.value)
