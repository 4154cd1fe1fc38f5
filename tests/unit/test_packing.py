"""Packed documents (data.packing = "documents", hpcpar/data/packing.py), in one process, float64.

- a packed batch's per-segment losses and gradients equal each segment run alone through the
  same model (positions from 0, no attention across a boundary, crossing targets left out);
- the windows, their segments and the loss mask from document starts;
- document starts of a corpus directory, the index `hpcpar data prepare` writes (file starts and
  end-of-text tokens) and its checks; packing "none" is today's batch, bit for bit;
- what is refused: layouts without document masking, data without boundaries, a resume that
  changes the packing;
- context parallelism's ring plan of packed windows (which blocks are computed, which K/V messages
  are sent) against the masks spelled out pair by pair.
"""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from hpcpar.config.load import load_config
from hpcpar.config.validate import validate
from hpcpar.data import corpus, formats, packing, prepare
from hpcpar.errors import CheckpointError, ConfigError, DataError
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.parallel.cp.attention import ContextParallel, positions
from hpcpar.training.trainer import Trainer

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, dtype="float64")


def grads(model) -> dict:
    return {n: p.grad.copy() for n, p in model.named_parameters()}


def zero_grads(model) -> None:
    for _, p in model.named_parameters():
        p.grad = None


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_packed_batch_equals_its_segments_run_alone(recompute):
    model = GPT(CFG, seed=3)
    model.set_recompute(recompute)
    rng = np.random.default_rng(1)
    stream = rng.integers(0, CFG.vocab_size, 400)
    doc_starts = np.array([0, 7, 9, 10, 30, 41, 60, 61, 62, 200], dtype=np.int64)
    windows = np.array([0, 5, 25, 55, 190])
    x = stream[windows[:, None] + np.arange(16)]
    y = stream[windows[:, None] + np.arange(1, 17)]
    documents, crossing = packing.Documents.of_windows(doc_starts, windows, 16)
    y[crossing] = packing.IGNORE
    assert not documents.whole and sum(len(s) for s in documents.starts) > len(windows) + 3
    loss = model(x, y, documents=documents)
    loss.backward()
    packed, valid = grads(model), int((y != packing.IGNORE).sum())
    zero_grads(model)
    total = 0.0
    for b, st in enumerate(documents.starts):
        for a, e in zip(st, list(st[1:]) + [16]):
            xs, ys = x[b:b + 1, a:e], y[b:b + 1, a:e]
            n = int((ys != packing.IGNORE).sum())
            alone = model(xs, ys)                 # no documents: one sequence, positions 0 .. e-a-1
            if n:
                total += float(alone.data) * n
                (alone * (n / valid)).backward()  # the packed loss is the mean over all valid targets
    assert abs(float(loss.data) * valid - total) <= 1e-12 * total
    for name, g in grads(model).items():
        err = np.abs(g - packed[name]).max() / np.abs(packed[name]).max()
        assert err < 1e-12, f"{name}: {err:.2e}"


def test_documents_of_windows_segments_positions_and_mask():
    d, crossing = packing.Documents.of_windows(np.array([0, 5, 9, 10, 30]), np.array([0, 3, 8]), 8)
    assert [s.tolist() for s in d.starts] == [[0, 5], [0, 2, 6, 7], [0, 1, 2]]
    # targets predicting a document start: window 0 y[4] = token 5; window 1 token 5 (y[1]),
    # 9 (y[5]) and 10 (y[6]); window 2 tokens 9 and 10 (y[0], y[1]).
    assert np.argwhere(crossing).tolist() == [[0, 4], [1, 1], [1, 5], [1, 6], [2, 0], [2, 1]]
    assert d.positions().tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 0, 1, 2, 3, 0, 0],
                                      [0, 0, 0, 1, 2, 3, 4, 5]]
    covered = np.zeros((3, 8), dtype=int)
    for length, rows, offsets in d.segments():
        for r, a in zip(rows, offsets):
            covered[r, a:a + length] += 1
    assert (covered == 1).all()
    whole, _ = packing.Documents.of_windows(np.array([0, 100]), np.array([10, 50]), 8)
    assert whole.whole


def test_packing_none_is_todays_batch_and_documents_only_adds_the_mask():
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
    data = formats.from_tokens(tokens, 0.1, np.arange(0, 5000, 37))
    plain = packing.get_batch(data, "train", 3, 2, range(4), 16)
    x, y = corpus.get_batch(data.train, 3, 2, range(4), 16)
    assert len(plain) == 2 and np.array_equal(plain[0], x) and np.array_equal(plain[1], y)
    px, py, documents = packing.get_batch(data, "train", 3, 2, range(4), 16, packing="documents")
    assert np.array_equal(px, x)
    assert np.array_equal(py[py != packing.IGNORE], y[py != packing.IGNORE]) and (py == packing.IGNORE).any()
    vx, _, _ = packing.get_batch(data, "val", 3, 1, range(4), 16, packing="documents")
    assert np.array_equal(vx, corpus.get_eval_batch(data.val, 3, 1, range(4), 16)[0])


def test_a_trainer_without_packing_draws_pairs():
    cfg = load_config(None, ["model.block_size=8", "model.n_layer=1", "model.n_head=2", "model.n_embd=8",
                             "train.micro_batch_size=2", "run.progress=false"])
    tokens = np.random.default_rng(0).integers(0, 256, 3000).astype(np.uint8)
    t = Trainer(cfg, tokens=formats.from_tokens(tokens, 0.1, np.array([0, 100])))
    assert all(len(b) == 2 for b in t.microbatches(0))
    t.free()


def test_corpus_directory_is_one_document_per_file(tmp_path):
    for name, text in (("a.txt", b"hello"), ("b.txt", b""), ("c.txt", b"xyz")):
        (tmp_path / name).write_bytes(text)
    tokens, starts = corpus.load_documents(str(tmp_path))
    assert tokens.tobytes() == b"hello\n\nxyz\n" and starts.tolist() == [0, 6, 7]
    assert corpus.load_documents(str(tmp_path / "a.txt"))[1].tolist() == [0]
    default, default_starts = corpus.load_documents()
    assert default_starts[0] == 0 and default_starts[-1] < len(default) and len(default_starts) > 100
    data = formats.load(load_config(None, [f"data.corpus={tmp_path}", "data.val_fraction=0.3",
                                           "data.packing=documents"]).data, 256)
    assert data.train_starts.tolist() == [0, 6, 7] and data.val_starts.tolist() == [0]  # val: "xyz\n" cut at 8


def prepared(tmp_path, **kw) -> str:
    src = tmp_path / "src"
    src.mkdir()
    for name, text in (("a.txt", "first doc"), ("b.txt", "second"), ("c.txt", "the third one")):
        (src / name).write_text(text)
    out = str(tmp_path / "out")
    prepare.prepare([str(src)], out, progress=False, **kw)
    return out


@pytest.mark.parametrize("fmt", ["bin", "hdf5"])
def test_prepare_writes_the_document_index(tmp_path, fmt):
    out = prepared(tmp_path, fmt=fmt)
    meta = json.load(open(os.path.join(out, formats.META)))
    entry = next(iter(meta["files"].values()))
    assert entry["documents"] == {"file": formats.DOCS_FILE, "count": 3}
    assert np.fromfile(os.path.join(out, formats.DOCS_FILE), "<i8").tolist() == [0, 10, 17]
    data = formats.load(load_config(None, [f"data.corpus={out}", f"data.format={fmt}", "data.val_fraction=0",
                                           "data.packing=documents"]).data, 256)
    assert data.train_starts.tolist() == [0, 10, 17]


def test_prepare_splits_on_the_end_of_text_token(tmp_path):
    writer = prepare._Writer(str(tmp_path), "bin", np.dtype("uint16"), eot_id=7)
    writer.begin_document()
    writer.write([1, 2, 7, 3, 7])
    writer.write([4, 7, 5])
    writer.begin_document()
    writer.write([6, 6])
    writer.close(True)
    assert writer.document_index(str(tmp_path)) == {"file": formats.DOCS_FILE, "count": 5}
    assert np.fromfile(tmp_path / formats.DOCS_FILE, "<i8").tolist() == [0, 3, 5, 7, 8]


def load_packed(out: str, vocab: int = 256):
    return formats.load(load_config(None, [f"data.corpus={out}", "data.format=bin", "data.val_fraction=0",
                                           "data.packing=documents"]).data, vocab)


@pytest.mark.parametrize("offsets,count,expected", [
    ([0, 17, 10], 3, "out of order"),
    ([0, 10, 10_000], 3, "beyond the end"),
    ([5, 10, 17], 3, "begin with offset 0"),
    ([0, 10], 3, "does not match its token file"),
])
def test_a_bad_document_index_is_one_line(tmp_path, offsets, count, expected):
    out = prepared(tmp_path)
    np.array(offsets, dtype="<i8").tofile(os.path.join(out, formats.DOCS_FILE))
    meta = json.load(open(os.path.join(out, formats.META)))
    next(iter(meta["files"].values()))["documents"]["count"] = count
    json.dump(meta, open(os.path.join(out, formats.META), "w"))
    with pytest.raises(DataError, match=expected) as err:
        load_packed(out)
    assert "\n" not in str(err.value)


def test_an_end_of_text_id_outside_the_vocabulary_and_a_file_without_index_are_refused(tmp_path):
    out = prepared(tmp_path)
    meta = json.load(open(os.path.join(out, formats.META)))
    json.dump({**meta, "eot_id": 300}, open(os.path.join(out, formats.META), "w"))
    with pytest.raises(DataError, match="end-of-text id 300 is outside"):
        load_packed(out)
    del next(iter(meta["files"].values()))["documents"]
    json.dump(meta, open(os.path.join(out, formats.META), "w"))
    with pytest.raises(DataError, match="has no document index"):
        load_packed(out)
    plain = formats.load(load_config(None, [f"data.corpus={out}", "data.format=bin", "data.val_fraction=0"]).data, 256)
    assert plain.train_starts is None   # without packing an index-less file trains as today


def test_layouts_without_document_masking_are_refused():
    cfg = load_config(None, ["data.packing=documents", "model.block_size=8", "run.backend=cupy"])
    with pytest.raises(ConfigError, match="data.packing = \"documents\" does not yet work with the GPU backend"):
        validate(cfg, 2)
    # Synchronous parameter servers take packed batches (tests/parallel/test_packing.py) ...
    validate(load_config(None, ["data.packing=documents", "model.block_size=8", "ps.servers=1"]), 2)
    # ... but not a replica stepping alone: the per-token weights count the whole global batch.
    for extra, what in ((["mesh.dp=2", "mesh.dp_replicate=2", "train.sync=local"], "train.sync = \"local\""),
                        (["ps.servers=1", "ps.mode=async"], "synchronous parameter servers only"),
                        (["ps.servers=1", "ps.staleness=2"], "synchronous parameter servers only")):
        with pytest.raises(ConfigError, match=what):
            validate(load_config(None, ["data.packing=documents", "model.block_size=8", *extra]), 2)


def test_a_resume_cannot_change_the_packing():
    def stored(packing_line: str, weights_only: bool = False):
        return types.SimpleNamespace(path="ckpt", weights_only=weights_only,
                                     meta={"config": f"[data]\n{packing_line}\n"})
    packing.require_resumable(stored('packing = "documents"'), "documents")
    packing.require_resumable(stored(""), "none")                     # older checkpoints: "none"
    packing.require_resumable(stored('packing = "none"', weights_only=True), "documents")
    with pytest.raises(CheckpointError, match="trained with data.packing = \"none\""):
        packing.require_resumable(stored(""), "documents")
    with pytest.raises(CheckpointError, match="trained with data.packing = \"documents\""):
        packing.require_resumable(stored('packing = "documents"'), "none")


def test_hpcpar_train_refuses_a_bad_index_in_one_line_with_exit_2(tmp_path):
    out = prepared(tmp_path)
    np.array([0, 17, 10], dtype="<i8").tofile(os.path.join(out, formats.DOCS_FILE))
    sets = [f"data.corpus={out}", "data.format=bin", "data.packing=documents", f"run.dir={tmp_path / 'run'}",
            "model.block_size=4", "model.n_layer=1", "model.n_head=1", "model.n_embd=8", "train.steps=1",
            "train.micro_batch_size=1", "run.eval_every=0", "run.progress=false", "data.val_fraction=0"]
    job = subprocess.run([sys.executable, "-m", "hpcpar", "train", *[a for s in sets for a in ("--set", s)]],
                         capture_output=True, text=True, timeout=120)
    assert job.returncode == 2, job.stdout + job.stderr
    assert "out of order" in job.stderr and "Traceback" not in job.stderr


class _Rank:
    """A stand-in cp communicator: the plan needs only the group's size and my rank."""

    def __init__(self, size, rank):
        self.size, self.rank = size, rank


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_ring_plan_of_packed_windows_computes_and_sends_only_what_is_attended(size, layout):
    t = 4 * size
    rng = np.random.default_rng(size)
    doc_starts = np.concatenate([[0], np.cumsum(rng.integers(1, 6, 4 * t))]).astype(np.int64)
    documents, _ = packing.Documents.of_windows(doc_starts, np.array([0, 2, t + 1]), t)
    first = np.arange(t) - documents.positions()                        # each token's segment start
    where = ContextParallel(_Rank(size, 0), "ring", layout).held(t, documents)   # zigzag: dealt by work
    assert sorted(np.concatenate(where).tolist()) == list(range(t))
    # allowed[q, k][b, i, j]: rank q's query i attends to rank k's key j in window b
    allowed = {(q, k): (where[q][:, None] >= where[k][None, :])
               & (where[k][None, None, :] >= first[:, where[q]][..., None])
               for q in range(size) for k in range(size)}
    plans = [ContextParallel(_Rank(size, r), "ring", layout)._plan(t // size, 3, documents, np, np.float64)
             for r in range(size)]
    for q, plan in enumerate(plans):
        for k, block in enumerate(plan.blocks):
            mask = allowed[q, k]
            assert (block is None) == (not mask.any()), (q, k)
            if block is not None:   # a box per row and (chunk, chunk) with pairs: all of them, tightly
                assert mask.sum() == block.pairs
                covered = np.zeros_like(mask)
                for box in block.boxes:
                    row = mask[box.rows][0]
                    inside = row[box.r0:box.r1, box.c0:box.c1]     # a pair on each edge, the bias masks the rest
                    assert inside[[0, -1]].any(axis=1).all() and inside[:, [0, -1]].any(axis=0).all()
                    assert inside.all() if box.bias is None else np.array_equal(box.bias == 0, inside)
                    assert not covered[box.rows, box.r0:box.r1, box.c0:box.c1].any()       # boxes are disjoint
                    covered[box.rows, box.r0:box.r1, box.c0:box.c1] = True
                    c = len(where[q]) // (2 if layout == "zigzag" else 1)          # within one chunk each
                    assert box.r0 // c == (box.r1 - 1) // c and box.c0 // c == (box.c1 - 1) // c
                assert not (mask & ~covered).any()
                assert block.elements == covered.sum()
        # what I send at a step is what the next rank receives, and a K/V block reaches every rank
        # that attends to it (it has travelled from its owner through every rank before)
        after = plans[(q + 1) % size]
        assert plan.send == after.recv
        for step in range(1, size):
            src = (q - step) % size
            if plan.blocks[src] is not None:
                assert all(plans[(src + j) % size].send[j] for j in range(step)), (q, src)
    # (these windows' zigzag chunks are dealt otherwise than token-zigzag, r and 2cp-1-r: the plan
    # follows the layout it is given)
    assert layout == "contiguous" or any(not np.array_equal(w, positions(layout, t, size, r))
                                         for r, w in enumerate(where))
    assert any(block is None for plan in plans for block in plan.blocks)
    # a K/V block stops early where the last ranks on its way attend to none of it
    assert any(not sent for plan in plans for sent in plan.send)
