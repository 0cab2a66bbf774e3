"""scripts/gpu_check.py's code path on the CPU with the tiny recipe: training, stop-and-resume, generation, export and
the preflight's timed run end in a report that says what ran and what failed."""

import json
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_on_the_cpu_with_the_tiny_recipe(tmp_path):
    main = runpy.run_path(str(ROOT / "scripts" / "gpu_check.py"), run_name="gpu_check")["main"]
    report = tmp_path / "report.md"
    code = main(["--recipe", "configs/tiny-cpu.yaml", "--variants", "hybrid_pre", "--exact", "hybrid_pre",
                 "--steps", "4", "--global-batch", "0", "--timed-steps", "2", "--work", str(tmp_path / "work"),
                 "--kernel-sizes", "48:2x5", "48:2x5:bf16", "--timing-types", "pre", "--timing-args",
                 "--recipe configs/tiny-cpu.yaml --layers 2 --batch 2 --seq 32 --repeats 1 --steps-per-timing 1 --modes eager",
                 "--report", str(report)])
    result = json.loads(report.with_suffix(".json").read_text())
    assert code == 0 and result["failures"] == [], result["failures"]
    run = result["runs"]["hybrid_pre"]
    assert run["code"] == 0 and sorted(map(int, run["losses"])) == [1, 2, 3, 4] and run["tokens_per_s"] > 0
    assert result["resume"]["hybrid_pre"] == {"codes": [0, 0], "steps_compared": 4, "max_abs_diff": 0.0,
                                              "exact": True}
    gen = result["generation"]
    assert gen["same_text"] and gen["checkpoint"]["stdout"].strip().startswith("It is a truth universally")
    assert result["preflight"]["timed_run"]["tokens_per_s"] > 0
    assert result["fused"]["mismatches"] == 0 and result["fused"]["combinations"] == 392
    assert [(z["dtype"], z["mismatches"], z["combinations"]) for z in result["fused_sizes"]] == [
        ("fp64", 0, 392), ("bf16", 0, 392)]
    text = report.read_text()
    assert "0 of 392 flag combinations disagree" in text
    assert "| hybrid_pre | 0, 0 | 4 | 0 | yes |" in text and "## Failures\n\nnone" in text
    assert "python scripts/gpu_check.py --recipe configs/tiny-cpu.yaml" in text
    # the timing step: benchmark.py ran fused off and on, eager and compiled, and its table is in the report
    assert {k: r["code"] for k, r in result["timing"].items()} == {"off": 0, "on": 0}
    assert text.count("## Step time against pre") == 1 and "| pre |" in result["timing"]["on"]["table"]
