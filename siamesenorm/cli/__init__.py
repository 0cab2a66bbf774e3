"""The command line: one function a command, each behind ``python -m siamesenorm COMMAND``, a console script
``siamesenorm-COMMAND`` (pyproject.toml) and a thin shim in scripts/ (the README's commands).

A command module imports only argparse-level modules at its top, so that ``--help`` and a refused argument answer
before torch or ai2-olmo is imported; what it runs is imported inside its ``main``.

May import: every folder of the package (this is the top floor).
"""

from __future__ import annotations

import importlib
import sys
from typing import Dict, List, Optional, Tuple

#: command -> (module under siamesenorm.cli, function, what it does). The order is the order of a user's work.
COMMANDS: Dict[str, Tuple[str, str, str]] = {
    "prepare-data": ("commands", "prepare_data_main", "tokenize documents into OLMo token files"),
    "train": ("commands", "train_main", "train with ai2-olmo 0.6.0's Trainer (the paper's base)"),
    "train-olmo-core": ("commands", "olmo_core_train_main", "train with OLMo-core 3's Trainer"),
    "launch": ("launch", "main", "torchrun with the run's outcome as the exit status"),
    "sweep": ("sweep", "main", "run a sweep plan (methods x learning rates x seeds), resumable"),
    "make-tables": ("make_tables", "main", "the paper's Table 1 from run records"),
    "analyze": ("analyze", "main", "the paper's analyses on checkpoints and runs"),
    "study-report": ("study_report", "main", "a CPU study's table, figures and numbers"),
    "export-hf": ("commands", "export_hf_main", "export a run as a Hugging Face transformers folder"),
    "generate": ("commands", "generate_main", "greedy or sampled text from a run or an export"),
    "evaluate": ("commands", "evaluate_main", "re-score a checkpoint (perplexity, downstream tasks)"),
    "preflight": ("preflight", "main", "will a recipe fit a GPU, and how long will it take"),
    "benchmark": ("benchmark", "main", "measure step time and memory; the cost model's breakdown"),
    "make-sbatch": ("make_sbatch", "main", "a SLURM batch script for a multi-node run"),
    "gpu-check": ("gpu_check", "main", "the end-to-end check on a GPU machine"),
    "gpu-compare": ("gpu_compare", "main", "a GPU profile beside the cost model of the same configuration"),
    "sinkhorn-convergence": ("sinkhorn_convergence", "main", "mHC's Sinkhorn projection, iterations vs error"),
    "compare-models": ("compare_models", "main", "two source trees build the same models, bit for bit"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, _, what) in COMMANDS.items()]
    return ("usage: python -m siamesenorm COMMAND [options]   (COMMAND --help: its options)\n\ncommands:\n"
            + "\n".join(lines))


def entry(command: str):
    """The function behind ``command`` (imports its module: light, see above)."""
    module, function, _ = COMMANDS[command]
    return getattr(importlib.import_module(f"{__name__}.{module}"), function)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(command, list(COMMANDS), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"error: no command {command!r}; {hint}python -m siamesenorm --help lists them", file=sys.stderr)
        return 2
    sys.argv = [f"siamesenorm {command}", *rest]  # argparse's usage line names the command
    code = entry(command)(rest)
    return code if isinstance(code, int) else 0


def _console(command: str):
    """A console script's function: ``siamesenorm-COMMAND`` is ``python -m siamesenorm COMMAND``."""
    def run() -> int:
        return main([command, *sys.argv[1:]])

    run.__name__ = command.replace("-", "_")
    return run


# The console scripts of pyproject.toml ([project.scripts]) point at these names.
for _name in COMMANDS:
    globals()[_name.replace("-", "_")] = _console(_name)
del _name
