"""`hpcpar data prepare INPUT... --out DIR`: text files to a token file and its tokenizer, on one process."""

from __future__ import annotations

import argparse
import os

HELP = "prepare token files from text (one process)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="data_action", required=True, metavar="ACTION")
    r = actions.add_parser("prepare", help="text files -> DIR/tokens.bin (or tokens.h5), tokenizer.json, meta.json")
    r.add_argument("inputs", nargs="+", help="text files or directories (read as data.format=bytes reads them)")
    r.add_argument("--out", required=True, help="output directory")
    r.add_argument("--tokenizer", choices=["bytes", "bpe", "gpt2"], default="bytes",
                   help="bytes (256 ids), bpe (trained here, needs --vocab-size) or gpt2 (needs --vocab, --merges)")
    r.add_argument("--vocab-size", type=int, default=0, help="bpe: ids of the trained tokenizer (>= 256)")
    r.add_argument("--vocab", help="gpt2: a local vocab.json")
    r.add_argument("--merges", help="gpt2: a local merges.txt")
    r.add_argument("--format", choices=["bin", "hdf5"], default="bin", help="token file format")
    r.add_argument("--token-dtype", choices=["auto", "uint16", "uint32"], default="auto",
                   help="auto: uint16 when the vocabulary fits, else uint32")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")


def one_process(args: argparse.Namespace) -> bool:
    return True


def run(args: argparse.Namespace) -> int:
    from hpcpar.data import formats
    from hpcpar.data.prepare import prepare
    info = prepare(args.inputs, args.out, kind=args.tokenizer, vocab_size=args.vocab_size, vocab=args.vocab or "",
                   merges=args.merges or "", fmt=args.format, token_dtype=args.token_dtype,
                   progress=not args.no_progress)
    print(f"wrote {info['tokens']:,} tokens ({info['dtype']}, largest id {info['max_id']}) from "
          f"{info['documents']} file(s) to {info['path']} in {info['seconds']:.1f} s; "
          f"{info['tokenizer_kind']} tokenizer with {info['vocab_size']} ids in "
          f"{os.path.join(args.out, formats.TOKENIZER)}")
    print(f"train on it with: --set data.format={args.format} --set data.corpus={args.out} "
          f"--set model.vocab_size={info['vocab_size']}"
          + (f" --set data.token_dtype={info['dtype']}" if args.format == "bin" and info["dtype"] != "uint16" else ""))
    return 0
