"""`hpcpar sample CHECKPOINT`: generate text from a trained checkpoint, on one process."""

from __future__ import annotations

import argparse

HELP = "generate text from a trained checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint directory (step-NNNNNNN), a run's checkpoint dir (its latest) "
                                      "or a run directory (its newest checkpoint)")
    p.add_argument("--prompt", default="def ", help="text to start from")
    p.add_argument("--tokens", type=int, default=200, help="number of tokens to generate (>= 0)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature, a finite number > 0")
    p.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest tokens (0: from every token)")
    p.add_argument("--seed", type=int, default=0, help="random seed (>= 0)")
    p.add_argument("--tokenizer", help="tokenizer.json to decode with (default: the one recorded in the checkpoint; "
                                       "must match it)")


def one_process(args: argparse.Namespace) -> bool:
    return True


def run(args: argparse.Namespace) -> int:
    from hpcpar.training import generate
    return generate.sample_checkpoint(args.checkpoint, prompt=args.prompt, tokens=args.tokens,
                                      temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                                      tokenizer_file=args.tokenizer)
