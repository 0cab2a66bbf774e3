"""Thin command-line front-ends; scripts/*.py call these."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from olmo.exceptions import OLMoConfigurationError


def _logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
    )


def train_main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Train an OLMo model of any MODEL_TYPE with OLMo's Trainer (launch with torchrun).",
        epilog="Example: MODEL_TYPE=hybrid_pre torchrun --nproc_per_node 8 scripts/train.py "
        "configs/OLMo-1B-2e-3.yaml --save_folder=runs/x",
    )
    parser.add_argument("config", help="YAML recipe in OLMo's TrainConfig format (see configs/)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and parameter count, exit")
    args, overrides = parser.parse_known_args(argv)
    _logging()
    from .checkpoints import UnsafeCheckpoint
    from .train import Terminated, main

    try:
        code = main(args.config, overrides, dry=args.dry_run)
    except (OLMoConfigurationError, UnsafeCheckpoint) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Terminated as e:  # preemption: the record says stopped; the same command resumes
        print(f"stopped: {e}; rerun the same command to resume from the latest checkpoint", file=sys.stderr)
        sys.exit(128 + e.signum)
    sys.exit(code)


def prepare_data_main(argv=None) -> None:
    from .data import DataPreparationError, PrepareSettings, iter_documents, prepare, train_tokenizer, Skips

    parser = argparse.ArgumentParser(description="Tokenize text into OLMo memmap token files (resumable).")
    parser.add_argument("inputs", nargs="*", help="files/folders (.txt .jsonl[.gz] .parquet), or hf:NAME[:CONFIG]")
    parser.add_argument("--output", required=True, help="output folder (or the tokenizer file with --train-tokenizer)")
    parser.add_argument("--tokenizer", default="tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json")
    parser.add_argument("--eos-token-id", type=int, default=None)
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--docs-per-unit", type=int, default=2000)
    parser.add_argument("--max-documents", type=int, default=None)
    parser.add_argument("--hf-split", default="train")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--train-tokenizer", type=int, metavar="VOCAB", default=None,
                        help="instead: train a byte-level BPE of this vocabulary size on the inputs")
    args = parser.parse_args(argv)
    _logging()
    inputs = args.inputs or ["hf:HuggingFaceFW/fineweb-edu:sample-10BT"]
    settings = PrepareSettings(
        inputs=inputs,
        tokenizer=args.tokenizer,
        eos_token_id=args.eos_token_id,
        text_field=args.text_field,
        val_fraction=args.val_fraction,
        docs_per_unit=args.docs_per_unit,
        max_documents=args.max_documents,
        hf_split=args.hf_split,
    )
    try:
        if args.train_tokenizer:
            train_tokenizer(iter_documents(settings, Skips()), args.train_tokenizer, args.output)
            print(f"tokenizer written to {args.output}")
            return
        manifest = prepare(settings, args.output, num_workers=args.workers)
    except DataPreparationError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    t = manifest["totals"]
    print(
        f"{args.output}: train {t['train']['tokens']:,d} tokens / {t['train']['documents']:,d} documents, "
        f"val {t['val']['tokens']:,d} tokens / {t['val']['documents']:,d} documents, dtype {manifest['memmap_dtype']}"
    )
