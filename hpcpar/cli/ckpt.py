"""`hpcpar ckpt info|verify|export|import PATH`: inspect, check and convert checkpoints, on one process."""

from __future__ import annotations

import argparse

from hpcpar.cli.options import check_output_file

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
        from hpcpar.interop import huggingface
        return huggingface.cli(args.action, args.path, args.out, args.n_head, args.tokenizer, args.dtype)
    if args.action == "export":
        check_output_file(args.out, "--out")
    from hpcpar.checkpoint import checkpoint
    return checkpoint.cli(args.action, args.path, out=args.out, dtype=args.dtype)
