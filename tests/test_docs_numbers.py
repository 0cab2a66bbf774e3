"""Numbers in the docs come from runs, not typing: every quickstart figure the README and docs/ quote is
marked ``88.28<!-- quickstart hybrid_pre val_perplexity -->`` (the comment is invisible in rendered Markdown), and
this test trains the quickstart's run for each MODEL_TYPE quoted, exactly as scripts/quickstart.sh does, and
compares. CPU results are deterministic on one machine; across machines the order of float sums in torch's CPU
kernels may differ with the instruction set, hence a tolerance of 0.05 (a changed recipe or model moves the
figure by far more: 87.82 -> 88.28 was one such drift)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUOTE = re.compile(r"(\d+\.\d+)<!-- quickstart (\w+) (val_perplexity|final_train_loss) -->")
TOLERANCE = 0.05


def quotes(files: List[Path]) -> List[Tuple[Path, int, float, str, str]]:
    """(file, line, value, MODEL_TYPE, record field) of every marked quickstart figure in ``files``."""
    found = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            found += [(path, n, float(m.group(1)), m.group(2), m.group(3)) for m in QUOTE.finditer(line)]
    return found


def wrong_quotes(found, measured: Dict[str, Dict[str, float]]) -> List[str]:
    """One line per quote that differs from the measured record by more than TOLERANCE."""
    return [f"{path}:{n}: quotes {value} for {model_type} {field}, a run gives {measured[model_type][field]:.2f}"
            for path, n, value, model_type, field in found
            if abs(value - measured[model_type][field]) > TOLERANCE]


def doc_files() -> List[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_docs_check_catches_a_planted_wrong_number(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("a fresh run gives 87.82<!-- quickstart hybrid_pre val_perplexity --> here\n"
                   "and 4.36<!-- quickstart hybrid_pre final_train_loss --> there\n")
    found = quotes([doc])
    assert [(n, v, m, f) for _, n, v, m, f in found] == [(1, 87.82, "hybrid_pre", "val_perplexity"),
                                                        (2, 4.36, "hybrid_pre", "final_train_loss")]
    measured = {"hybrid_pre": {"val_perplexity": 88.28, "final_train_loss": 4.3608}}
    assert wrong_quotes(found, measured) == [f"{doc}:1: quotes 87.82 for hybrid_pre val_perplexity, a run gives "
                                             "88.28"]


@pytest.mark.slow
def test_the_docs_quote_the_quickstart_as_it_runs_now(tmp_path, austen_prepared):
    found = quotes(doc_files())
    assert found, "no marked quickstart figure in the docs: the check would pass vacuously"
    measured, procs = {}, {}
    for model_type in sorted({q[3] for q in found}):  # side by side: each run takes one CPU thread, bitwise alike
        run = tmp_path / f"quickstart-{model_type}"
        procs[model_type] = (run, subprocess.Popen(
            [sys.executable, str(ROOT / "scripts" / "train.py"), "configs/tiny-cpu.yaml", f"--save_folder={run}",
             "--save_overwrite"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{model_type}.err", "w"),
            env={**os.environ, "MODEL_TYPE": model_type}))
    for model_type, (run, proc) in procs.items():
        assert proc.wait(timeout=900) == 0, (tmp_path / f"{model_type}.err").read_text()[-3000:]
        measured[model_type] = json.loads((run / "run.json").read_text())
    assert wrong_quotes(found, measured) == []
