"""`hpcpar ckpt info|verify|export|import PATH`: inspect, check and convert checkpoints, on one process."""

from __future__ import annotations

import argparse

from hpcpar.cli.options import check_output_file
from hpcpar.errors import CheckpointError

HELP = "inspect, verify, export or import a checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["info", "verify", "export", "import"])
    p.add_argument("path", help="checkpoint directory (step-NNNNNNN) or its parent (uses latest); import: a GPT-2 "
                                "safetensors file or HuggingFace model directory")
    p.add_argument("--out", help="export: the file (.npz, or .safetensors) or directory (safetensors) to write; "
                                 "import: the checkpoint directory to create")
    p.add_argument("--format", choices=["npz", "safetensors"], default="npz",
                   help="export: npz (every tensor, hpcpar names) or safetensors (HuggingFace GPT-2 names)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"],
                   help="export: write the floating-point tensors in this dtype (default: as stored, the master "
                        "weights); bfloat16/float16 round them as a 16-bit run reads them")
    p.add_argument("--n-head", type=int, help="import: attention heads, when no config.json is beside the weights")
    p.add_argument("--tokenizer", help="import: tokenizer.json to record (default: the model directory's)")


def one_process(args: argparse.Namespace) -> bool:
    return True


def run(args: argparse.Namespace) -> int:
    if args.action == "import" or (args.action == "export" and args.format == "safetensors"):
        return gpt2_weights(args.action, args.path, args.out, args.n_head, args.tokenizer, args.dtype)
    if args.action == "export":
        check_output_file(args.out, "--out")
    return checkpoint_tool(args.action, args.path, out=args.out, dtype=args.dtype)


def checkpoint_tool(action: str, path: str, out: str | None = None, dtype: str | None = None) -> int:
    """`hpcpar ckpt info|verify|export PATH [--out FILE.npz] [--dtype D]` (one process)."""
    from hpcpar.checkpoint import tools
    from hpcpar.checkpoint.directory import resolve
    from hpcpar.checkpoint.format import read_manifest

    if action == "info":
        print(tools.info(path), end="")
    elif action == "verify":
        problems = tools.verify(path)
        if problems:  # one line, whatever the number of problems
            raise CheckpointError("; ".join(problems))
        ckpt = resolve(path)
        print(f"ok: {ckpt}: {len(read_manifest(ckpt)['files'])} files match the manifest")
    elif action == "export":
        if not out:
            raise CheckpointError("ckpt export needs --out FILE.npz (where to write the global tensors)")
        names = tools.export(path, out, dtype)
        print(f"wrote {len(names)} tensors to {out}" + (f" as {dtype}" if dtype else ""))
    else:
        raise CheckpointError(f"unknown ckpt action {action!r}; expected info, verify or export")
    return 0


def gpt2_weights(action: str, path: str, out: str | None, n_head: int | None = None,
                 tokenizer_file: str | None = None, dtype: str | None = None) -> int:
    """`hpcpar ckpt export --format safetensors` and `hpcpar ckpt import` (one process)."""
    from hpcpar.interop import huggingface

    if not out:
        raise CheckpointError(f"ckpt {action} needs --out " + ("FILE.safetensors or DIR" if action == "export"
                                                                 else "DIR (the new checkpoint directory)"))
    if action == "export":
        print(f"wrote {', '.join(huggingface.export(path, out, dtype))} (HuggingFace GPT-2 names)")
    else:
        print(f"imported {path} into {huggingface.import_(path, out, n_head, tokenizer_file)}")
    return 0
