"""Bad input to the one-process verbs, in process through `cli.main(argv)`: one line
`hpcpar: error: ...` naming what is wrong and what would be right, status 2, no traceback; and
output-file problems found before the work, not after it.

The checkpoint comes from one tiny `hpcpar train` subprocess shared by the module.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest

from hpcpar.cli import main

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=8", "train.micro_batch_size=1",
        "train.microbatches=1", "train.steps=2", "train.warmup=0", "run.progress=false", "run.eval_every=0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A finished 2-step run: its directory, checkpoint directory and corpus."""
    tmp = tmp_path_factory.mktemp("cli-errors")
    corpus = tmp / "corpus.txt"
    corpus.write_bytes(np.random.default_rng(0).integers(32, 127, size=4000, dtype=np.uint8).tobytes())
    sets = [a for item in [*TINY, f"data.corpus={corpus}", f"run.dir={tmp / 'run'}"] for a in ("--set", item)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    made = subprocess.run([sys.executable, "-m", "hpcpar", "train", *sets], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    return {"run": str(tmp / "run"), "ckpt": str(tmp / "run" / "checkpoints"), "corpus": str(corpus)}


@pytest.fixture
def hpcpar(capsys, monkeypatch):
    """`hpcpar(*argv) -> (status, stdout, stderr)`, in process (the exception hooks `cli.main`
    installs are put back afterwards)."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)

    def call(*argv: str):
        capsys.readouterr()
        status = main.main(list(argv))
        out, err = capsys.readouterr()
        return status, out, err
    return call


def one_error(status: int, err: str, expected: str) -> None:
    assert status == 2, err
    assert "Traceback" not in err, err
    assert err.splitlines() == [f"hpcpar: error: {expected}"], err


# --------------------------------------------------------------------------- sample


@pytest.mark.parametrize("flags,expected", [
    (["--temperature", "nan"], "--temperature must be a finite number > 0, got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number > 0, got inf"),
    (["--temperature", "-1"], "--temperature must be a finite number > 0, got -1.0"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--top-k", "-3"], "--top-k must be >= 0 (0 samples from every token), got -3"),
    (["--tokens", "-2"], "--tokens must be >= 0, got -2"),
], ids=["temperature-nan", "temperature-inf", "temperature-negative", "seed", "top-k", "tokens"])
def test_sample_refuses_bad_options_in_one_line(trained, hpcpar, flags, expected):
    status, out, err = hpcpar("sample", trained["ckpt"], "--tokens", "3", *flags)
    one_error(status, err, expected)
    assert out == ""


def test_sample_top_k_0_samples_from_every_token(trained, hpcpar):
    status, out, err = hpcpar("sample", trained["ckpt"], "--tokens", "3", "--top-k", "0", "--prompt", "ab")
    assert status == 0, err
    assert out.startswith("ab")


# --------------------------------------------------------------------------- eval


def test_eval_refuses_negative_max_tokens(trained, hpcpar):
    status, out, err = hpcpar("eval", trained["ckpt"], "--data", trained["corpus"], "--max-tokens", "-5")
    one_error(status, err, "--max-tokens must be >= 0 (0 evaluates every token), got -5")
    assert out == ""


def test_eval_of_data_too_small_to_hold_out_names_the_cause(trained, hpcpar, tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"hello world\n")  # 12 bytes: 5 % of them is not one token
    status, _, err = hpcpar("eval", trained["ckpt"], "--data", str(tiny))
    one_error(status, err, f"{tiny} has no held-out part (data.val_fraction=0.05 of its 12 tokens is not one "
                           "token); use --split all")


def test_eval_json_in_a_missing_directory_is_refused_before_evaluating(trained, hpcpar, tmp_path, monkeypatch):
    from hpcpar.training import evaluate
    monkeypatch.setattr(evaluate, "evaluate_checkpoint", lambda *a, **k: pytest.fail("evaluated before checking --json"))
    target = tmp_path / "no" / "such" / "x.json"
    status, out, err = hpcpar("eval", trained["ckpt"], "--data", trained["corpus"], "--json", str(target))
    one_error(status, err, f"--json {str(target)!r}: directory {str(target.parent)!r} does not exist; create it "
                           "first or give a path in an existing directory")


def test_eval_json_that_is_a_directory_is_refused(trained, hpcpar, tmp_path):
    status, _, err = hpcpar("eval", trained["ckpt"], "--data", trained["corpus"], "--json", str(tmp_path))
    one_error(status, err, f"--json {str(tmp_path)!r} is a directory; give a file name inside it")


# --------------------------------------------------------------------------- plot


def metrics_run(tmp_path: pathlib.Path, tail: str = "") -> pathlib.Path:
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"step": s, "loss": 5.0 - 0.1 * s}) for s in range(4)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)
    return run


def test_plot_out_in_a_missing_directory(hpcpar, tmp_path):
    run = metrics_run(tmp_path)
    target = tmp_path / "no" / "x.png"
    status, _, err = hpcpar("plot", str(run), "--out", str(target))
    one_error(status, err, f"--out {str(target)!r}: directory {str(target.parent)!r} does not exist; create it "
                           "first or give a path in an existing directory")


def test_plot_out_of_a_format_matplotlib_cannot_write(hpcpar, tmp_path):
    pytest.importorskip("matplotlib")
    run = metrics_run(tmp_path)
    status, _, err = hpcpar("plot", str(run), "--out", str(tmp_path / "x.txt"))
    assert status == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "matplotlib cannot write .txt files; end the name in one of" in err and ".png" in err
    assert not (tmp_path / "x.txt").exists()


def test_plot_skips_a_line_cut_short_with_one_warning(hpcpar, tmp_path):
    """A run killed while rank 0 wrote metrics.jsonl leaves half a line: plotted without it."""
    pytest.importorskip("matplotlib")
    run = metrics_run(tmp_path, tail='{"step": 4, "loss": 4.')
    status, out, err = hpcpar("plot", str(run), "--out", str(tmp_path / "loss.png"))
    assert status == 0, err
    path = os.path.join(str(run), "metrics.jsonl")
    assert err.splitlines() == [f"hpcpar: warning: {path}: skipped line 5, not a step record (cut short when the "
                                "run was killed?)"]
    assert out == f"wrote {tmp_path / 'loss.png'}\n" and (tmp_path / "loss.png").stat().st_size > 0


def test_plot_read_records_names_every_bad_line(tmp_path, capsys):
    from hpcpar.training import plot
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 1}\n[1, 2]\n\n{"step": 1, "loss": 0.5}\nnot json\n')
    assert plot.read_records(str(path)) == [{"step": 0, "loss": 1}, {"step": 1, "loss": 0.5}]
    assert capsys.readouterr().err.splitlines() == [f"hpcpar: warning: {path}: skipped lines 2, 5, not a step "
                                                    "record (cut short when the run was killed?)"]


# --------------------------------------------------------------------------- plan


@pytest.mark.parametrize("content,expected", [
    ("", "not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ('{"intra": {"alpha": 1e-6,', "not valid JSON"),
    ("{}", "no 'intra' entry"),
    ("[1, 2]", "TypeError"),
], ids=["empty", "truncated", "empty-object", "not-an-object"])
def test_plan_with_a_broken_calibration_file(hpcpar, tmp_path, monkeypatch, content, expected):
    path = tmp_path / "calibration.json"
    path.write_text(content)
    monkeypatch.setenv("HPCPAR_CALIBRATION", str(path))
    status, out, err = hpcpar("plan", "--ranks", "4")
    assert status == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"hpcpar: error: calibration file {path} cannot be used (") and expected in err, err
    assert "run `mpiexec -n N hpcpar plan --calibrate` again to rewrite it" in err
    assert out == ""


def test_plan_out_in_a_missing_directory_is_refused_before_planning(hpcpar, tmp_path):
    target = tmp_path / "no" / "plan.toml"
    status, out, err = hpcpar("plan", "--ranks", "4", "--hardware", "a100", "--out", str(target))
    one_error(status, err, f"--out {str(target)!r}: directory {str(target.parent)!r} does not exist; create it "
                           "first or give a path in an existing directory")
    assert out == ""


# --------------------------------------------------------------------------- ckpt, --debug


def test_ckpt_export_npz_in_a_missing_directory(trained, hpcpar, tmp_path):
    target = tmp_path / "no" / "w.npz"
    status, out, err = hpcpar("ckpt", "export", trained["ckpt"], "--out", str(target))
    one_error(status, err, f"--out {str(target)!r}: directory {str(target.parent)!r} does not exist; create it "
                           "first or give a path in an existing directory")


def test_debug_after_the_verb_is_a_plain_usage_error(hpcpar):
    status, out, err = hpcpar("train", "--debug")
    one_error(status, err, "unrecognized arguments: --debug (see: hpcpar --help)")


def test_debug_before_the_verb_shows_the_traceback(hpcpar):
    status, _, err = hpcpar("--debug", "train", "--steps", "3")
    assert status == 2 and "Traceback (most recent call last)" in err, err
    assert err.splitlines()[-1] == "hpcpar: error: unrecognized arguments: --steps (see: hpcpar --help)"


@pytest.mark.parametrize("argv,debug", [
    (["--debug", "train"], True), (["train", "--debug"], False), (["sample", "x", "--debug"], False),
    (["-h", "--debug", "plot"], True), ([], False), (["train", "--set", "x=1"], False),
])
def test_debug_counts_only_before_the_verb(argv, debug):
    assert main._debug(argv) is debug
