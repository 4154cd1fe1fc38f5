"""metrics.JsonLines: appending to a metrics file that a killed run left with a half-written line."""

import json

import pytest

from hpcpar import metrics


def records(path) -> list[dict]:
    """Every line of `path` as JSON: fails on a line that is not whole."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("chunk", [4, 1 << 16])  # the last newline found in the first chunk read, or further back
def test_a_half_written_last_line_is_dropped_before_appending(tmp_path, chunk, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    whole = [{"step": s, "loss": 5.0 - s} for s in range(3)]
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in whole)
    path.write_text(text + '{"loss": 1.5, "st')
    monkeypatch.setattr(metrics, "_drop_partial_last_line",
                        lambda p, _f=metrics._drop_partial_last_line: _f(p, chunk=chunk))
    writer = metrics.JsonLines(str(path))
    writer.write({"step": 3, "loss": 1.0})
    writer.close()
    assert records(path) == whole + [{"step": 3, "loss": 1.0}]


@pytest.mark.parametrize("before", ["", '{"step": 0}\n', '{"ste'])
def test_appending_keeps_whole_lines(tmp_path, before):
    path = tmp_path / "metrics.jsonl"
    if before:
        path.write_text(before)
    writer = metrics.JsonLines(str(path))
    writer.write({"step": 1})
    writer.close()
    kept = [{"step": 0}] if before.endswith("\n") else []
    assert records(path) == kept + [{"step": 1}]
