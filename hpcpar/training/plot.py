"""`hpcpar plot`: training (and validation) loss curves of one or more runs to a PNG; for
mixture-of-experts runs a second panel shows the expert load (max / mean tokens per expert of the
worst MoE layer, 1 = balanced) and the fraction of assignments dropped by the capacity limit.

A step that appears twice in a metrics.jsonl (a run that died after its last checkpoint repeats
the steps since, when resumed) is drawn from its later line (`latest_per_step`), in step order.
The loss is in nats per token, per byte when every run is byte-level (its config.toml says)."""

from __future__ import annotations

import json
import os
import sys

from hpcpar.errors import ConfigError, HpcparError


def read_records(path: str) -> list[dict]:
    """The step records of a metrics.jsonl. A line that is not a JSON record (the last line of a run
    killed while rank 0 wrote it, cut short) is skipped with one warning naming the file and line."""
    records, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and "step" in record and "loss" in record:
                records.append(record)
            else:
                bad.append(number)
    if bad:
        where = f"line {bad[0]}" if len(bad) == 1 else f"lines {', '.join(map(str, bad))}"
        sys.stderr.write(f"hpcpar: warning: {path}: skipped {where}, not a step record (cut short when the run "
                         "was killed?)\n")
    return records


def latest_per_step(records: list[dict]) -> list[dict]:
    """One record per step in step order: where a step appears more than once, its later line."""
    by_step = {r["step"]: r for r in records}
    return [by_step[step] for step in sorted(by_step)]


def loss_unit(runs: list) -> str:
    """"byte" when every run's config.toml says data.format = "bytes" (a token is a byte), else
    "token" (a BPE or token file, or a run without a readable config.toml)."""
    from hpcpar.config.load import load_config
    for run in runs:
        try:
            if load_config(os.path.join(run, "config.toml")).data.format != "bytes":
                return "token"
        except (HpcparError, OSError):
            return "token"
    return "byte"


def plot_runs(runs: list, out: str) -> int:
    histories = []
    for run in runs:
        path = os.path.join(run, "metrics.jsonl")
        if not os.path.isfile(path):
            raise HpcparError(f"{run!r} has no metrics.jsonl; give run directories written by hpcpar train")
        histories.append((os.path.basename(os.path.normpath(run)), latest_per_step(read_records(path))))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise HpcparError("hpcpar plot needs matplotlib: pip install 'hpcpar[bench]'") from None
    suffix = os.path.splitext(out)[1][1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if not suffix:  # as matplotlib saves it
        out += "." + matplotlib.rcParams["savefig.format"]
    elif suffix not in formats:
        raise ConfigError(f"--out {out!r}: matplotlib cannot write .{suffix} files; end the name in one of "
                          f"{', '.join('.' + f for f in sorted(formats))} (e.g. loss.png)")
    from matplotlib.ticker import MaxNLocator
    experts = any("moe_load_imbalance" in r for _, records in histories for r in records)
    fig, axes = plt.subplots(1, 2 if experts else 1, figsize=(13 if experts else 7, 4.5), squeeze=False)
    for a in axes[0]:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 2.5 on a short run's axis
    ax = axes[0][0]
    for label, records in histories:
        line, = ax.plot([r["step"] for r in records], [r["loss"] for r in records], label=f"{label} train")
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        if val:
            ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (nats / {loss_unit(runs)})")
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
