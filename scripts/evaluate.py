"""Score a finished model on the paper's downstream tasks and validation perplexity. Logic: siamesenorm/export/evaluate.py.

  python scripts/evaluate.py --help
"""

from siamesenorm.cli.commands import evaluate_main

if __name__ == "__main__":
    evaluate_main()
