"""`hpcpar plot`: training (and validation) loss curves of one or more runs to a PNG; for
mixture-of-experts runs a second panel shows the expert load (max / mean tokens per expert of the
worst MoE layer, 1 = balanced) and the fraction of assignments dropped by the capacity limit."""

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
    experts = any("moe_load_imbalance" in r for _, records in histories for r in records)
    fig, axes = plt.subplots(1, 2 if experts else 1, figsize=(13 if experts else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for label, records in histories:
        line, = ax.plot([r["step"] for r in records], [r["loss"] for r in records], label=f"{label} train")
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        if val:
            ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    if experts:
        _expert_load(axes[0][1], histories)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


def _expert_load(ax, histories: list) -> None:
    """Max / mean tokens per expert (solid) and the dropped fraction (dashed, right axis) per step."""
    dropped = ax.twinx()
    for label, records in histories:
        moe = [r for r in records if "moe_load_imbalance" in r]
        if not moe:
            continue
        line, = ax.plot([r["step"] for r in moe], [r["moe_load_imbalance"] for r in moe], label=f"{label} load")
        dropped.plot([r["step"] for r in moe], [r["moe_dropped_fraction"] for r in moe], "--",
                     color=line.get_color(), label=f"{label} dropped")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean tokens per expert (worst MoE layer)")
    dropped.set_ylabel("dropped assignments (fraction)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
