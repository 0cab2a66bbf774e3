"""Thin command-line front-ends; scripts/*.py call these."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from siamesenorm.run.console import setup_logging as _logging


def _model_types_help() -> str:
    from siamesenorm.models.names import model_types_help

    return model_types_help()


def _config_error() -> type:
    """OLMo's configuration error, imported only once a command runs (``--help`` stays fast)."""
    from olmo.exceptions import OLMoConfigurationError

    return OLMoConfigurationError


#: How a command picks the block (both training commands' help).
_MODEL_TYPE_RULE = ("MODEL_TYPE picks the block: the environment variable MODEL_TYPE, else the config's "
                    "model.model_type, else pre.")


def _refuse(problem, leave=sys.exit) -> None:
    """One line on standard error and exit 2; under torchrun every rank sees the same problem, so rank 0 says it."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {problem}", file=sys.stderr)
    leave(2)


def _refuse_unknown_keys(config: str, overrides) -> None:
    """A typo in the recipe or an override: one line and exit 2 before OLMo and torch are imported."""
    from siamesenorm.run.recipe_keys import unknown_key

    message = unknown_key(config, overrides)
    if message:
        _refuse(message)


def train_main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Train an OLMo model of any MODEL_TYPE with OLMo's Trainer (launch with torchrun, or plain "
        "python for one process).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"""\
{_MODEL_TYPE_RULE}
{_model_types_help()}

Overrides: any config field, as --dotted.path=value after the config, e.g.
  --save_folder=runs/x  --optimizer.learning_rate=3e-3  --max_duration=1000  --model.n_layers=16
  --model.siamese_depth_scaling=false   (a variant knob; all knobs and defaults: docs/fidelity.md)
  --save_overwrite                      (start the run folder over instead of resuming it)
Rerunning the same command resumes from the latest checkpoint in save_folder.

The run folder gets config.yaml, run.json (the record: status, losses, perplexity, spikes), metrics.jsonl,
console.log and the checkpoints.

Examples:
  MODEL_TYPE=hybrid_pre python scripts/train.py configs/tiny-cpu.yaml --save_folder=runs/tiny-hybrid_pre
  MODEL_TYPE=hybrid_pre torchrun --nproc_per_node 8 scripts/train.py configs/OLMo-1B-hybrid-2e-3.yaml \\
      --save_folder=runs/OLMo-1B-hybrid_pre
  python scripts/train.py configs/tiny-cpu.yaml --dry-run""",
    )
    parser.add_argument("config", help="YAML recipe in OLMo's TrainConfig format (see configs/)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check everything a real start checks (config, run folder, data), print the resolved "
                        "config, the parameter count and what a real start would do; train nothing")
    args, overrides = parser.parse_known_args(argv)
    _refuse_unknown_keys(args.config, overrides)
    _logging()

    def start() -> int:
        from siamesenorm.ai2_olmo.train import main

        return main(args.config, overrides, dry=args.dry_run)

    _train_to_exit(start)


def _train_to_exit(start, refusals: tuple = (), leave=sys.exit) -> None:
    """How both training commands end (siamesenorm/run/lifecycle.py's table): the run's exit status; a refusal,
    a read-only folder or a full disk as one line and exit 2; a signal as one line and 128 + its number.
    ``leave(code)`` ends the process once the run is settled (``_leave_now`` for the OLMo-core path)."""
    from siamesenorm.run.checkpoints import UnsafeCheckpoint
    from siamesenorm.run.lifecycle import Terminated
    from siamesenorm.run.safeload import refusal_inside

    try:
        code = start()
    except (_config_error(), UnsafeCheckpoint, *refusals) as e:
        _refuse(e, leave)
    except Terminated as e:  # preemption: the record says stopped; the same command resumes
        print(f"stopped: {e}; rerun the same command to resume from the latest checkpoint", file=sys.stderr)
        leave(128 + e.signum)
    except KeyboardInterrupt:  # Ctrl-C: the record says stopped; one line, not a traceback
        print("stopped: interrupted (Ctrl-C); rerun the same command to resume from the latest checkpoint",
              file=sys.stderr)
        leave(130)
    except PermissionError as e:  # a read-only save folder (or a file in it)
        _refuse(f"cannot write {e.filename or 'the run folder'} ({e.strerror}): make the save folder writable, or "
                "pass another --save_folder", leave)
    except BaseException as e:  # torch.distributed.checkpoint wraps a refused item in a CheckpointException
        refused = refusal_inside(e)
        if refused is None:
            raise
        _refuse(refused, leave)
    leave(code)


def _leave_now(code: int) -> None:
    """End an OLMo-core training process whose run is settled (record written, process group destroyed, nothing
    left to run) without Python's finalization: flush, then ``os._exit``. Under torchrun a two-process FSDP run
    stopped before its data ends (``--stop_at``) aborted there now and then after all its work ("terminate called
    without an active exception", SIGABRT with no Python frame left; 3 of about 20 such runs on a 2-core machine,
    torch 2.13): a C++ object torn down with the interpreter. The exit status says how the run ended, not how the
    runtime unwound; OLMo-core's loaders' worker processes notice their parent is gone and end."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
            pass
    os._exit(code)


def olmo_core_train_main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Train an OLMo-core 3 model of any MODEL_TYPE with OLMo-core's own Trainer and "
        "TransformerTrainModule, from one of our recipes (torchrun for more processes: OLMo-core's FSDP).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"""\
{_MODEL_TYPE_RULE}
{_model_types_help()}

Overrides: as scripts/train.py (--save_folder=runs/x --max_duration=1000 --stop_at=500 ...).
Rerunning the same command resumes from the latest checkpoint in save_folder (OLMo-core's distributed checkpoints).
The run folder gets what scripts/train.py writes (config.yaml, run.json, metrics.jsonl, console.log), OLMo-core's
checkpoints step<N>/ and its work files. One run per folder; SIGTERM or Ctrl-C saves a checkpoint, the record says
stopped, the exit status is 143 or 130, and the same command resumes.
docs/training.md, "The OLMo-core path", says what of a recipe is used and what this path does not have yet.

Examples:
  MODEL_TYPE=hybrid_pre python scripts/train_olmo_core.py configs/tiny-cpu.yaml --save_folder=runs/core-hybrid_pre
  MODEL_TYPE=hybrid_pre torchrun --nproc_per_node 2 scripts/train_olmo_core.py configs/tiny-cpu.yaml \\
      --save_folder=runs/core-hybrid_pre-2p --device_train_microbatch_size=8""",
    )
    parser.add_argument("config", help="YAML recipe (configs/*.yaml), the same files scripts/train.py reads")
    args, overrides = parser.parse_known_args(argv)
    _refuse_unknown_keys(args.config, overrides)
    _logging()
    try:
        from olmo_core.exceptions import OLMoConfigurationError as CoreConfigError

        from siamesenorm.olmo_core.train import main
    except ImportError as e:
        _refuse(e)

    _train_to_exit(lambda: main(args.config, overrides), (CoreConfigError, FileNotFoundError, ValueError),
                   leave=_leave_now)


def prepare_data_main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Tokenize documents into OLMo token files (train/ and val/ .npy memmaps plus manifest.json). "
        "With no inputs it streams FineWeb-Edu's sample-10BT from the Hugging Face Hub (network needed). "
        "Resumable: rerunning the same command keeps the finished units.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""Examples:
  python scripts/prepare_data.py data/austen.jsonl.gz --tokenizer data/tokenizer-austen-2k.json \\
      --docs-per-unit 50 --output data/prepared/austen-2k
  python scripts/prepare_data.py --max-documents 2000000 --output data/fineweb-edu   # FineWeb-Edu sample-10BT
  python scripts/prepare_data.py my_corpus.jsonl --train-tokenizer 8192 --output data/my-tokenizer.json""",
    )
    parser.add_argument("inputs", nargs="*",
                        help="files or folders of .txt, .jsonl, .jsonl.gz or .parquet documents, or hf:NAME[:CONFIG] "
                        "for a Hugging Face dataset (streamed); none: hf:HuggingFaceFW/fineweb-edu:sample-10BT")
    parser.add_argument("--output", required=True,
                        help="output folder for the token files (with --train-tokenizer: the tokenizer .json to write)")
    parser.add_argument("--tokenizer", default="tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json",
                        help="a tokenizers .json file, or a path under ai2-olmo's packaged olmo_data/ (default: OLMo's "
                        "GPT-NeoX/Dolma tokenizer, which the paper's recipes use)")
    parser.add_argument("--eos-token-id", type=int, default=None,
                        help="the token appended after each document (default: the tokenizer's end-of-text token)")
    parser.add_argument("--text-field", default="text", help="the field holding the text in .jsonl/.parquet/hf inputs")
    parser.add_argument("--val-fraction", type=float, default=0.05,
                        help="fraction of documents held out for validation (chosen by a hash of the document, so "
                        "reruns agree)")
    parser.add_argument("--docs-per-unit", type=int, default=2000,
                        help="documents per work unit: the grain of parallelism and of resuming")
    parser.add_argument("--max-documents", type=int, default=None,
                        help="stop after this many documents (default: all; needed to bound a streamed dataset)")
    parser.add_argument("--hf-split", default="train", help="the split of an hf: dataset")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="tokenizer processes (default: cores - 1)")
    parser.add_argument("--train-tokenizer", type=int, metavar="VOCAB", default=None,
                        help="instead of tokenizing: train a byte-level BPE tokenizer of this vocabulary size on the "
                        "inputs and write it to --output")
    args = parser.parse_args(argv)
    _logging()
    from siamesenorm.run.data import (
        DataPreparationError,
        PrepareSettings,
        Skips,
        iter_documents,
        prepare,
        train_tokenizer,
    )

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


def export_hf_main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Export a run or checkpoint of any MODEL_TYPE as a Hugging Face transformers folder "
        "(config.json, model.safetensors, tokenizer). pre becomes a plain Llama that transformers loads alone; "
        "every other MODEL_TYPE carries its own modelling code (torch and transformers only), which transformers "
        "loads alone with trust_remote_code=True.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""Examples:
  python scripts/export_hf.py runs/quickstart-pre exports/quickstart-pre
  python scripts/export_hf.py runs/x/step1000-unsharded exports/x-1000 --dtype bfloat16

Then, in Python (transformers alone):
  from transformers import AutoModelForCausalLM, AutoTokenizer
  model = AutoModelForCausalLM.from_pretrained("exports/quickstart-pre")  # pre: a Llama
  model = AutoModelForCausalLM.from_pretrained("exports/quickstart-hybrid_pre", trust_remote_code=True)
  (with siamesenorm installed, `import siamesenorm.export.hf` first loads any export without remote code)""",
    )
    parser.add_argument("source", help="a run folder (its latest checkpoint) or a checkpoint folder "
                        "(stepN-unsharded/ or a sharded stepN/)")
    parser.add_argument("output", help="the folder to write (must be new or empty, or an earlier export with --overwrite)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="dtype of the saved weights (default float32, as trained on CPU)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUTPUT")
    parser.add_argument("--format", choices=["auto", "siamesenorm", "llama"], default="auto",
                        help="llama: a plain transformers LlamaForCausalLM folder, no remote code (pre only: a "
                        "Pre-Norm OLMo is exactly a Llama; refused for anything else); siamesenorm: any MODEL_TYPE, "
                        "with its modelling code (trust_remote_code=True); auto (default): llama when exact, "
                        "else siamesenorm")
    args = parser.parse_args(argv)
    _logging()
    import torch
    from transformers.utils import logging as hf_logging

    from siamesenorm.export.hf import export, is_export
    from siamesenorm.run.checkpoints import UnsafeCheckpoint

    hf_logging.disable_progress_bar()  # one-file models: per-shard progress bars only add console lines

    print(f"exporting {args.source} to {args.output}: loading the checkpoint, then writing ...", file=sys.stderr,
          flush=True)
    try:
        folder = export(args.source, args.output, overwrite=args.overwrite, dtype=getattr(torch, args.dtype),
                        format=args.format)
    except (FileNotFoundError, FileExistsError, ValueError, UnsafeCheckpoint, _config_error()) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if is_export(args.output) and (Path(args.output) / "modeling_siamesenorm.py").is_file():
        print(f"exported {folder} to {args.output} with its modelling code; transformers alone loads it: "
              f"AutoModelForCausalLM.from_pretrained({args.output!r}, trust_remote_code=True)")
    elif is_export(args.output):
        print(f"exported {folder} to {args.output} without modelling code (README.md says why); load it with: "
              f"import siamesenorm.export.hf; AutoModelForCausalLM.from_pretrained({args.output!r})")
    else:
        print(f"exported {folder} to {args.output} as a Llama (LlamaForCausalLM; transformers alone loads it): "
              f"AutoModelForCausalLM.from_pretrained({args.output!r})")


def generate_main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Generate text from a run, a checkpoint or an exported folder (greedy by default; KV cache on).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""Examples:
  python scripts/generate.py runs/quickstart-pre --prompt "It is a truth universally acknowledged"
  python scripts/generate.py exports/quickstart-pre --prompt "Emma" --sample --temperature 0.8 --num-samples 3""",
    )
    parser.add_argument("source", help="a run folder (latest checkpoint), a checkpoint folder or an export_hf folder")
    parser.add_argument("--prompt", action="append", required=True,
                        help="the text to continue; repeat --prompt for several")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="tokens to generate per prompt (default 40)")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0, help="with --sample: softmax temperature")
    parser.add_argument("--top-k", type=int, default=0, help="with --sample: keep the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --sample: nucleus probability mass")
    parser.add_argument("--num-samples", type=int, default=1, help="with --sample: continuations per prompt")
    parser.add_argument("--seed", type=int, default=0, help="with --sample: random seed")
    parser.add_argument("--no-cache", action="store_true", help="recompute every position at each step (slower; "
                        "gives the same tokens as the cache)")
    args = parser.parse_args(argv)
    _logging()
    if args.num_samples > 1 and not args.sample:
        parser.error("--num-samples > 1 needs --sample (greedy decoding gives one continuation)")
    import torch
    from transformers.utils import logging as hf_logging

    from siamesenorm.export.hf import load_for_generation
    from siamesenorm.run.checkpoints import UnsafeCheckpoint

    hf_logging.disable_progress_bar()

    print(f"loading {args.source} ...", file=sys.stderr, flush=True)  # a large checkpoint takes a while
    try:
        model, tokenizer = load_for_generation(args.source)
    except (FileNotFoundError, UnsafeCheckpoint, _config_error()) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    torch.manual_seed(args.seed)
    for prompt in args.prompt:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        options = dict(max_new_tokens=args.max_new_tokens, use_cache=not args.no_cache, do_sample=args.sample,
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        if args.sample:
            options.update(temperature=args.temperature, top_k=args.top_k or None, top_p=args.top_p,
                           num_return_sequences=args.num_samples)
        with torch.no_grad():
            out = model.generate(ids, **options)
        for row in out:
            print(f"{prompt}{tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=True)}")
            print("---")


def evaluate_main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Score a finished model (a run folder: its latest checkpoint; a checkpoint folder; an export "
        "from scripts/export_hf.py) on the paper's downstream tasks with OLMo's own evaluators and data, and on "
        "validation perplexity, through OLMo's Trainer.eval: a checkpoint gets the numbers its run logged in-loop.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""Examples:
  python scripts/evaluate.py runs/quickstart-hybrid_pre --tokens 'data/prepared/austen-2k/val/*.npy'
  python scripts/evaluate.py exports/quickstart-pre --tasks piqa,arc_easy --max-batches 10 --output eval/pre
  python scripts/make_tables.py eval/pre/evaluation.json eval/hybrid_pre/evaluation.json   # one table""",
    )
    parser.add_argument("source", help="a run folder, a checkpoint folder (stepN-unsharded/, stepN/) or an export")
    parser.add_argument("--tasks", default="paper",
                        help="comma-separated OLMo downstream task labels; 'paper' (default): arc_easy, "
                        "arc_challenge, hellaswag, piqa, winogrande, openbook_qa, basic_arithmetic; 'none': only "
                        "perplexity")
    parser.add_argument("--tokens", action="append", default=[],
                        help="OLMo token files (.npy, glob allowed; repeat for more) for validation perplexity")
    parser.add_argument("--max-batches", type=int, default=None,
                        help="at most this many batches per task (default: the whole task)")
    parser.add_argument("--batch-size", type=int, default=16, help="instances per forward (default 16)")
    parser.add_argument("--output", help="write evaluation.json (a record make_tables reads), evaluation.md and "
                        "evaluation.csv into this folder")
    args = parser.parse_args(argv)
    _logging()
    if args.output and Path(args.output).exists() and not Path(args.output).is_dir():
        print(f"error: --output {args.output} is a file; name a folder", file=sys.stderr)
        sys.exit(2)
    if args.max_batches is not None and args.max_batches < 1 or args.batch_size < 1:
        print("error: --max-batches and --batch-size must be >= 1", file=sys.stderr)
        sys.exit(2)
    from transformers.utils import logging as hf_logging

    from siamesenorm.export.evaluate import PAPER_TASKS, EvalSettings, evaluate, to_csv, to_markdown
    from siamesenorm.run.checkpoints import UnsafeCheckpoint

    hf_logging.disable_progress_bar()

    named = {"paper": list(PAPER_TASKS), "none": []}
    tasks = named[args.tasks] if args.tasks in named else [t for t in args.tasks.split(",") if t]
    if not tasks and not args.tokens:
        print("error: nothing to evaluate: --tasks none needs --tokens", file=sys.stderr)
        sys.exit(2)
    print(f"evaluating {args.source}: loading the model, then {len(tasks)} task(s)"
          f"{' and perplexity' if args.tokens else ''} ...", file=sys.stderr, flush=True)
    try:
        record = evaluate(args.source, EvalSettings(tasks=tasks, tokens=args.tokens, max_batches=args.max_batches,
                                                    batch_size=args.batch_size))
    except (FileNotFoundError, ValueError, UnsafeCheckpoint, _config_error()) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(to_markdown(record))
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "evaluation.json").write_text(json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")
        (out / "evaluation.md").write_text(to_markdown(record))
        (out / "evaluation.csv").write_text(to_csv(record))
        print(f"wrote {out}/evaluation.json, .md, .csv", file=sys.stderr)
