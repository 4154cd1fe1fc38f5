"""`hpcpar plot`: training (and validation) loss curves of one or more runs to a PNG."""

from __future__ import annotations

import os

from hpcpar import metrics
from hpcpar.errors import HpcparError


def main(runs: list, out: str) -> int:
    histories = []
    for run in runs:
        path = os.path.join(run, "metrics.jsonl")
        if not os.path.isfile(path):
            raise HpcparError(f"{run!r} has no metrics.jsonl; give run directories written by hpcpar train")
        histories.append((os.path.basename(os.path.normpath(run)), metrics.read_json_lines(path)))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HpcparError("hpcpar plot needs matplotlib: pip install 'hpcpar[bench]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, records in histories:
        line, = ax.plot([r["step"] for r in records], [r["loss"] for r in records], label=f"{label} train")
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        if val:
            ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0
