"""scripts/evaluate.py (siamesenorm/export/evaluate.py): a finished model scored with OLMo's own evaluators through OLMo's
Trainer.eval gets the numbers its run logged in-loop; an export scores as the run it came from; the record it
writes is one make_tables reads."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from siamesenorm.run.records import split_eval_metrics

ROOT = Path(__file__).resolve().parents[2]
TASKS = ["piqa", "arc_easy"]  # a len_norm task and an acc task
VAL = str(ROOT / "data" / "prepared" / "austen-2k" / "val" / "*.npy")


def test_every_accuracy_metric_of_olmo_lands_in_the_record():
    perplexity, downstream = split_eval_metrics({
        "eval/downstream/piqa_len_norm": 0.5, "eval/downstream/arc_easy_acc": 0.25,
        "eval/downstream/copa_pmi_dc": 0.75, "eval/downstream/copa_rc_0shot_bpb": 2.0,
        "eval/val/Perplexity": 30.0, "eval/val/CrossEntropyLoss": 3.4})
    assert downstream == {"piqa": 0.5, "arc_easy": 0.25, "copa": 0.75}  # bpb is not an accuracy
    assert perplexity == {"val": 30.0}


@pytest.fixture(scope="module")
def run_with_downstream(tmp_path_factory, austen_prepared):
    """A tiny hybrid_pre run that evaluates piqa and arc_easy in-loop (2 batches of 8) at its last step."""
    import os

    from siamesenorm.ai2_olmo.train import main

    tmp = tmp_path_factory.mktemp("eval")
    recipe = yaml.safe_load((ROOT / "configs" / "tiny-cpu.yaml").read_text())
    recipe["evaluators"] = [{"label": t, "type": "downstream", "subset_num_batches": 2} for t in TASKS]
    recipe["device_eval_batch_size"] = 8
    config = tmp / "recipe.yaml"
    config.write_text(yaml.safe_dump(recipe))
    run = tmp / "run"
    old = os.getcwd()
    os.chdir(ROOT)
    os.environ["MODEL_TYPE"] = "hybrid_pre"
    try:
        assert main(str(config), ["--model.d_model=32", "--model.n_heads=2", "--model.n_layers=2",
                                  "--model.max_sequence_length=64", "--global_train_batch_size=4",
                                  "--device_train_microbatch_size=4", "--max_duration=4", "--scheduler.t_warmup=1",
                                  "--eval_interval=4", "--console_log_interval=1", "--no_pre_train_checkpoint=true",
                                  f"--save_folder={run}"]) == 0
    finally:
        os.chdir(old)
        os.environ.pop("MODEL_TYPE", None)
    return run


def test_a_checkpoint_scores_what_its_run_logged_in_loop(run_with_downstream):
    from siamesenorm.export.evaluate import EvalSettings, evaluate

    logged = json.loads((run_with_downstream / "run.json").read_text())["downstream"]
    assert set(logged) == set(TASKS)  # piqa's len_norm included
    record = evaluate(run_with_downstream, EvalSettings(tasks=TASKS, max_batches=2, batch_size=8, tokens=[VAL]))
    assert record["downstream"] == pytest.approx(logged, abs=1e-6)
    assert all(0.0 <= v <= 1.0 for v in record["downstream"].values())
    assert 1.0 < record["val_perplexity"] < 2100 and record["model_type"] == "hybrid_pre"


@pytest.mark.slow
def test_an_export_scores_as_its_run_and_make_tables_reads_the_result(run_with_downstream, tmp_path):
    from siamesenorm.export.hf import export

    export(run_with_downstream, tmp_path / "export")
    outputs = []
    for source in (run_with_downstream, tmp_path / "export"):
        out = tmp_path / f"eval-{source.name}"
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), str(source), "--tasks",
                               ",".join(TASKS), "--max-batches", "2", "--batch-size", "8", "--tokens", VAL,
                               "--output", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.startswith("| model | ppl val | piqa | arc_easy | avg |")
        outputs.append(json.loads((out / "evaluation.json").read_text()))
        assert (out / "evaluation.csv").read_text().startswith("model,ppl val,piqa,arc_easy,avg")
    run, exported = outputs
    assert exported["downstream"] == pytest.approx(run["downstream"], abs=1e-6)
    assert exported["val_perplexity"] == pytest.approx(run["val_perplexity"], rel=1e-5)
    # make_tables reads the evaluation record as it reads run.json (this 4-step run is marked "too short" there,
    # so its numbers are checked on a copy that says the run converged)
    record = tmp_path / "long" / "evaluation.json"
    record.parent.mkdir()
    record.write_text(json.dumps({**run, "converged": True}))
    for path, expect in ((tmp_path / f"eval-{run_with_downstream.name}" / "evaluation.json", "too short"),
                         (record, f"| {100 * run['downstream']['piqa']:.1f}‡ |")):  # a subset: marked, not bold
        table = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tables.py"), str(path)], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
        assert table.returncode == 0, table.stderr[-2000:]
        assert expect in table.stdout, table.stdout


@pytest.mark.slow
def test_bad_input_gets_one_line(tmp_path):
    for args, expect in ((["--tasks", "piqaa"], "did you mean piqa"), (["--tokens", "nope/*.npy"], "no such token"),
                         (["--tasks", "none"], "needs --tokens")):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), str(tmp_path)] + args,
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and expect in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1].startswith("error:")
