"""What a run tells its user: each step's output, and the summary at its end.

`setup_console` sends `hpcpar train`'s log where a batch job wants it: rank 0's lines (the run's
figures, each logged step, the summary) to stdout, warnings and errors to stderr. `StepLog` takes
each step's metrics record (the fields of a metrics.jsonl line) to the file, to the caller's
`on_step`, and to rank 0's progress bar when stderr is a terminal, else to a plain log line every
`run.log_every` steps (no carriage returns in an output file); while a bar is drawn, log lines are
written above it, never glued to it. The summary (summary.json) gets its
parts here: `traffic_summary` (bytes per step over the run), `server_summary` (the parameter
servers' reports); `format_summary` is its text as `hpcpar train` prints it. `moe_text` and
`ps_text` are the short forms a step's line and the run's first line use.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

from hpcpar import metrics
from hpcpar.config.sections import Config

log = logging.getLogger("hpcpar")

_MIB = 2 ** 20


def setup_console(rank: int) -> None:
    """`hpcpar train`'s log on this rank: rank 0 logs from INFO up, its INFO lines on stdout, the
    others WARNING and up tagged "[rank N]"; warnings and errors on stderr. Both streams write
    above rank 0's progress bar while it is drawn. A program that configured logging keeps its own."""
    root = logging.getLogger()
    if root.handlers:
        return
    form = logging.Formatter("%(message)s" if rank == 0 else f"[rank {rank}] %(message)s")
    out, err = _ConsoleHandler(sys.stdout), _ConsoleHandler(sys.stderr)
    out.addFilter(lambda record: record.levelno < logging.WARNING)
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(form)
        root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


class _ConsoleHandler(logging.StreamHandler):
    """A stream handler that, while a progress bar is drawn, writes each line above the bar."""

    def emit(self, record: logging.LogRecord) -> None:
        if _Progress.active is None:
            super().emit(record)
            return
        try:
            _Progress.active.write(self.format(record), self.stream)
        except Exception:  # noqa: BLE001 - as logging does: a failed log line never stops the run
            self.handleError(record)


def on_terminal() -> bool:
    """Whether stderr, where the progress bar goes, is a terminal (not a batch job's file or a pipe)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):   # replaced by an object without isatty, or closed
        return False


class StepLog:
    """Where each step's record goes: a JSON line in `metrics_path` (None: no file), the caller's
    `on_step` (with `cpu_time_s`), and on rank 0 the progress bar (`draw`, when stderr is a
    terminal) or, without it, a plain log line every `log_every` steps, at evaluations and at the
    last step. `end`, `first`: the run's last step + 1 and its first step (the bar's total and start)."""

    def __init__(self, rank0: bool, draw: bool, metrics_path: str | None, on_step: Callable[[dict], None] | None,
                 log_every: int, end: int, first: int):
        self.writer = metrics.JsonLines(metrics_path) if metrics_path else None
        draw = draw and on_terminal()
        self.bar = _Progress(draw, end, first)
        self.log_lines = rank0 and not draw
        self.on_step, self.log_every = on_step, log_every
        self.end, self.first, self.start = end, first, time.monotonic()

    def write(self, record: dict, cpu_time: float, last: bool) -> None:
        """Report one step's `record` (`last`: the run's last step)."""
        if self.writer:
            self.writer.write(record)
        if self.on_step:
            self.on_step({**record, "cpu_time_s": cpu_time})
        extra = (f" | scale {record['loss_scale']:g}" if "loss_scale" in record else "") + moe_text(record)
        self.bar.update(f"loss {record['loss']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
                        f"MFU {record['mfu']:.1%}{extra}")
        if self.log_lines and (record["step"] % self.log_every == 0 or last or "val_loss" in record):
            log.info("%s", self.line(record, extra))

    def line(self, record: dict, extra: str = "") -> str:
        """A step's plain log line: "step    10 (11/300) | loss 4.1234 | lr 1.50e-03 | 12,345 tok/s |
        MFU 12.3% | 0:00:12 elapsed, 0:05:48 left": the step (0-based, as in metrics.jsonl), the
        steps done of the run's, its figures (`extra`: the fp16 scale, the experts') and the time."""
        step = record["step"]
        elapsed = time.monotonic() - self.start
        left = elapsed / max(step + 1 - self.first, 1) * max(self.end - step - 1, 0)
        return (f"step {step:5d} ({step + 1}/{self.end}) | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                f"{record['tokens_per_s']:,.0f} tok/s | MFU {record['mfu']:.1%}"
                + (f" | val {record['val_loss']:.4f}" if "val_loss" in record else "") + extra
                + f" | {_clock(elapsed)} elapsed, {_clock(left)} left")

    def close(self) -> None:
        self.bar.close()
        if self.writer:
            self.writer.close()


def _clock(seconds: float) -> str:
    """"0:05:48"."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _Progress:
    """A progress bar on rank 0 (tqdm), silent elsewhere. `active`: the bar being drawn, if any,
    which log lines are written above (`write`)."""

    active: "_Progress | None" = None

    def __init__(self, enabled: bool, total: int, initial: int):
        self.bar = None
        if enabled:
            from tqdm import tqdm  # only rank 0 of an interactive run draws one
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=1.0)
            _Progress.active = self

    def write(self, text: str, stream) -> None:
        """`text` as a line of its own on `stream`, the bar cleared first and drawn again after."""
        from tqdm import tqdm
        tqdm.write(text, file=stream)

    def update(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            if _Progress.active is self:
                _Progress.active = None


def moe_text(figures: dict) -> str:
    """" | aux 0.0102 | load 1.31 | dropped 2.1%" for a mixture-of-experts step's routing figures
    (`routing.figures`, or a record holding them); "" without experts."""
    if "moe_aux_loss" not in figures:
        return ""
    return (f" | aux {figures['moe_aux_loss']:.4f} | load {figures['moe_load_imbalance']:.2f}"
            f" | dropped {figures['moe_dropped_fraction']:.1%}")


def ps_text(cfg: Config) -> str:
    """", parameter server: 2 servers, synchronous" (or "SSP k=2, stale_weight 0", "async, ...");
    "" without servers."""
    ps = cfg.ps
    if not ps.servers:
        return ""
    mode = "async" if ps.mode == "async" else f"SSP k={ps.staleness}" if ps.staleness else "synchronous"
    if mode != "synchronous":
        mode += f", stale_weight {ps.stale_weight:g}"
    return f", parameter server: {ps.servers} server(s), {mode}"


def traffic_summary(traffic: list[dict]) -> dict:
    """Bytes per step from every step's `traffic_record`: means over ranks and over the steps
    after the compression warm-up (over all steps when every one was a warm-up step), and the
    compression ratio."""
    steps = [t for t in traffic if t["grad_compressed"]] or traffic
    if not steps:
        return {"bytes_sent_per_step": None, "grad_bytes_sent_per_step": None,
                "grad_bytes_uncompressed_per_step": None, "compression_ratio": None}
    mean = {k: sum(t[k] for t in steps) / len(steps) for k in ("bytes_sent", "grad_bytes_sent",
                                                               "grad_bytes_uncompressed")}
    return {"bytes_sent_per_step": mean["bytes_sent"], "grad_bytes_sent_per_step": mean["grad_bytes_sent"],
            "grad_bytes_uncompressed_per_step": mean["grad_bytes_uncompressed"],
            "compression_ratio": (mean["grad_bytes_sent"] / mean["grad_bytes_uncompressed"]
                                  if mean["grad_bytes_uncompressed"] else 1.0)}


def sync_summary(train, replicas: int, traffic: list[dict]) -> dict:
    """The summary's "sync" entry with train.sync = "local" / "diloco" (else {}): the mode, its
    period, fragments and delay, the replicas, and the bytes a rank sent per step (mean over the
    run's steps) for the replicas' synchronisation."""
    if train.sync == "step":
        return {}
    sent = [t.get("outer_bytes_sent", 0.0) for t in traffic]
    return {"sync": {"mode": train.sync, "every": train.sync_every, "replicas": replicas,
                     "fragments": train.sync_fragments, "delay": train.sync_delay,
                     "outer_compression": train.outer_compression,
                     "outer_bytes_sent_per_step": sum(sent) / len(sent) if sent else None}}


def server_summary(reports: list, steps: int) -> dict:
    """The summary's "ps" entry from every rank's report (`ParameterServer.report`; workers give
    None) over `steps` steps: per server its range and bytes in and out per step, and the staleness
    and lateness (SSP, async) of every applied push, summarised."""
    servers = [r for r in reports if r is not None]
    stale = [s for r in servers[:1] for s in r["staleness"]]   # server 0 saw every push
    late = [s for r in servers[:1] for s in r["late"]]
    per_step = max(steps, 1)
    hist: dict[str, int] = {}
    for s in stale:
        hist[str(s)] = hist.get(str(s), 0) + 1
    return {"servers": [{"rank": r["rank"], "range": r["range"], "bytes_in_per_step": r["bytes_in"] / per_step,
                         "bytes_out_per_step": r["bytes_out"] / per_step} for r in servers],
            "staleness_max": max(stale, default=0), "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
            "staleness_histogram": hist, "pushes_applied": len(stale),
            "pushes_late": sum(1 for s in late if s > 0), "late_max": max(late, default=0)}


def format_summary(s: dict) -> str:
    """The summary `s` (summary.json's content) as printed at the end of `hpcpar train`."""
    mem = ", ".join(f"{b / _MIB:.0f}" for b in s["peak_memory_bytes_per_rank"])
    estimate = s.get("estimated_memory_bytes_per_rank")
    measured = s["pipeline_bubble_measured"]
    lines = [
        "── summary ─────────────────────────────────────────────",
        f"steps            {s['steps']}",
        f"loss             {s['first_loss']:.4f} -> {s['final_loss']:.4f}" if s["final_loss"] is not None
        else "loss             (no completed step)",
        f"val loss         {s['val_loss']:.4f}" if s["val_loss"] is not None else "val loss         (not evaluated)",
        f"throughput       {s['tokens_per_s']:,.0f} tokens/s",
        f"MFU              {s['mfu']:.1%} of the "
        + (s.get("mfu_peak") or f"measured GEMM peak, {s['gemm_peak_flops'] / 1e9:.1f} GFLOP/s")
        + (f"; capped at 100% in {s['mfu_capped_steps']} step(s)" if s.get("mfu_capped_steps") else ""),
        _mesh_line(s),
        *_traffic_line(s),
        *_sync_line(s),
        *_failure_lines(s),
        *_ps_line(s),
        *([f"precision        {s['precision']}: activations {s['activation_dtype']}, masters and optimizer state "
           "in model.dtype"
           + (f"; loss scale {s['loss_scale']:g}, {s['overflow_steps']} overflow step(s) skipped"
              if s.get("loss_scale") is not None else "")] if s.get("precision", "full") != "full" else []),
        *([f"experts          ep={s.get('ep', 1)}; last step: aux loss {s['moe_aux_loss']:.4f}, max/mean tokens "
           f"per expert {s['moe_load_imbalance']:.2f}, dropped {s['moe_dropped_fraction']:.1%} of assignments"]
          if "moe_aux_loss" in s else []),
        *([f"pipeline bubble  {s['pipeline_bubble_predicted']:.1%} predicted"
           + (f", {measured:.1%} measured" if measured is not None else "")] if s["mesh"]["pp"] > 1 else []),
        f"peak memory      {mem} MiB per rank (RSS)"
        + (f"; estimated for model state + activations: {estimate / _MIB:.1f} MiB (busiest rank)"
           if estimate else ""),
        f"run directory    {s['run_dir']}",
    ]
    return "\n".join(lines)


def _mesh_line(s: dict) -> str:
    """The summary's mesh line: degrees, HSDP and ZeRO, the schedule, the micro-batches."""
    return (f"mesh             dp={s['mesh']['dp']}"
            + (f" x cp={s['mesh']['cp']} ({s.get('cp_impl', 'ring')})" if s["mesh"].get("cp", 1) > 1 else "")
            + f" x tp={s['mesh']['tp']} x pp={s['mesh']['pp']}"
            + (f" (dp_replicate={s['dp_replicate']})" if s.get("dp_replicate", 1) > 1 else "")
            + (f", zero={s['zero']}" if s.get("zero") else "")
            + (f", schedule {s['schedule']}" if s["mesh"]["pp"] > 1 else "")
            + f", {s['microbatches']} micro-batch{'es' if s['microbatches'] != 1 else ''}")


def _traffic_line(s: dict) -> list[str]:
    """The summary's line on bytes: gradient sync per rank per step, compressed vs uncompressed;
    without gradient sync only the bytes in all; none when nothing was sent (one rank)."""
    if s.get("grad_bytes_sent_per_step") is None:
        return ["bytes sent       (no step)"]
    if not s["bytes_sent_per_step"]:
        return []
    if not s["grad_bytes_sent_per_step"]:
        return [f"bytes sent       {s['bytes_sent_per_step'] / _MIB:.2f} MiB per rank per step (no gradient sync)"]
    kind = s.get("grad_compression", "none")
    return [f"bytes sent       {s['grad_bytes_sent_per_step'] / _MIB:.2f} MiB per rank per step for gradients"
            + (f" ({kind}: {s['compression_ratio']:.3f}x of {s['grad_bytes_uncompressed_per_step'] / _MIB:.2f} MiB "
               "uncompressed)" if kind != "none" else "")
            + f"; {s['bytes_sent_per_step'] / _MIB:.2f} MiB in all"]


def _sync_line(s: dict) -> list[str]:
    """The summary's line on the replicas' synchronisation ([] with train.sync = "step")."""
    sync = s.get("sync")
    if not sync:
        return []
    per = sync["outer_bytes_sent_per_step"]
    return [f"replica sync     {sync['mode']} every {sync['every']} steps over {sync['replicas']} replicas"
            + (f", {sync['fragments']} fragments" if sync["fragments"] > 1 else "")
            + (f" landing {sync['delay']} steps late" if sync["delay"] else "")
            + (f" ({sync['outer_compression']})" if sync["outer_compression"] != "none" else "")
            + (f": {per / _MIB:.3f} MiB per rank per step" if per is not None else "")]


def _failure_lines(s: dict) -> list[str]:
    """The summary's lines on failures survived (training/resilience.py), one each."""
    out = []
    for f in s.get("failures", []):
        where = f"rank(s) {f['lost_ranks']}" + (f" (node(s) {', '.join(f['lost_nodes'])})" if f["lost_nodes"] else "")
        back = (f"rolled back to step {f['rollback_to']} (partner snapshots)" if f["rollback_to"] is not None
                else f"went on from {f['source']}")
        out.append(f"failure          step {f['failed_at_step']}: {where} lost; {back}; mesh {f['mesh']}; "
                   f"recovered in {f['recovery_s']:.1f} s")
    return out


def _ps_line(s: dict) -> list[str]:
    """The summary's parameter-server line ([] without servers)."""
    ps = s.get("ps")
    if not ps:
        return []
    per = "; ".join(f"rank {v['rank']} [{v['range'][0]}, {v['range'][1]}) in {v['bytes_in_per_step'] / _MIB:.2f} / "
                    f"out {v['bytes_out_per_step'] / _MIB:.2f} MiB per step" for v in ps["servers"])
    return [f"parameter server {per}; staleness max {ps['staleness_max']}, mean {ps['staleness_mean']:.2f} "
            f"over {ps['pushes_applied']} pushes, {ps['pushes_late']} late (by at most {ps['late_max']} steps)"]
