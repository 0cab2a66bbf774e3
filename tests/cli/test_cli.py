"""The command line as a new user meets it: every script's --help explains every option, training prints what
runs once and then one line per logged step, the console log lands in the run folder, nothing from our pins warns."""

import argparse
import json
import logging
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from siamesenorm.models.config import MODEL_TYPES

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(str(p.relative_to(ROOT / "scripts")) for p in [*(ROOT / "scripts").glob("*.py"),
                                                                *(ROOT / "scripts").glob("*/*.py")]
                 if p.name != "launch.py")


class _Parser(Exception):
    def __init__(self, parser):
        self.parser = parser


def _capture(monkeypatch):
    def stop(self, *args, **kwargs):
        raise _Parser(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_of_every_script_has_help(script, monkeypatch):
    """The parser each script builds, caught at parse time: every argument and option says what it does."""
    _capture(monkeypatch)
    module = runpy.run_path(str(ROOT / "scripts" / script), run_name="help_check")
    entry = next(v for k, v in module.items() if k.endswith("main") and callable(v))
    with pytest.raises(_Parser) as caught:
        entry()
    parser = caught.value.parser
    assert parser.description, f"{script}: no description"
    missing = [a.dest for a in parser._actions if not isinstance(a, argparse._HelpAction)
               and (not a.help or a.help == argparse.SUPPRESS)]
    assert not missing, f"{script}: options without help: {missing}"


def test_train_help_lists_model_types_and_overrides():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    for name in MODEL_TYPES:
        assert f"  {name} " in proc.stdout, name
    assert "--optimizer.learning_rate=" in proc.stdout and "resumes" in proc.stdout


def test_launch_help_exits_zero_and_no_config_fails_with_one_line():
    ok = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch.py"), "--help"], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0 and "torchrun options" in ok.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch.py"), "--nproc_per_node", "2"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no CONFIG.yaml" in bad.stderr


def test_step_and_eval_lines():
    from siamesenorm.run.console import eval_line, step_line

    line = step_line(10, 300, {"train/CrossEntropyLoss": 5.12345, "optim/total_grad_norm": 0.5321,
                               "optim/learning_rate_group0": 1e-3, "throughput/device/tokens_per_second": 5379.2,
                               "stability/loss_spikes": 0, "stability/grad_spikes": 2})
    assert line == "step 10/300 | loss 5.1235 | grad_norm 0.532 | lr 1.00e-03 | 5,379 tok/s | spikes loss 0, grad 2"
    quiet = step_line(10, 300, {"train/CrossEntropyLoss": 5.0, "stability/loss_spikes": 0})
    assert "spikes" not in quiet and "elapsed" not in quiet
    timed = step_line(100, 300, {"train/CrossEntropyLoss": 5.0}, elapsed=95.4, eta=3725.0)
    assert timed == "step 100/300 | loss 5.0000 | 0:01:35 elapsed, eta 1:02:05"
    assert step_line(1, 9, {}, elapsed=0.0).endswith("| 0:00:00 elapsed")
    assert step_line(1, 9, {}, elapsed=1.0, eta=3 * 86400).endswith("eta 3.0 days")
    assert eval_line("val", 100, {"eval/val/CrossEntropyLoss": 4.0, "eval/val/Perplexity": 54.598}) == \
        "eval val at step 100: CrossEntropyLoss 4.0000 | Perplexity 54.60"


def test_olmo_narration_is_dropped_but_its_warnings_pass():
    from siamesenorm.run.console import QuietOlmo

    f = QuietOlmo()

    def record(name, level, msg):
        return logging.LogRecord(name, level, __file__, 1, msg, None, None)

    assert not f.filter(record("olmo.train", logging.INFO, "[eval_step=10/-1]"))
    assert not f.filter(record("olmo.checkpoint", logging.INFO, "Saving model state..."))
    assert f.filter(record("olmo.train", logging.WARNING, "Saving model state failed"))
    assert f.filter(record("olmo.train", logging.INFO, "Unsharded checkpoint saved to x"))
    assert f.filter(record("siamesenorm.ai2_olmo.train", logging.INFO, "[eval_step=1]"))


@pytest.mark.slow
def test_training_console_is_short_and_saved_in_the_run_folder(tmp_path, austen_prepared):
    run = tmp_path / "my-run"
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), str(ROOT / "configs" / "tiny-cpu.yaml"),
           f"--save_folder={run}", "--max_duration=6", "--console_log_interval=2", "--eval_interval=3",
           "--model.n_layers=2", "--model.d_model=32", "--model.n_heads=2", "--model.max_sequence_length=32"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    lines = console.splitlines()
    assert "Warning" not in console and "deprecated" not in console  # no warnings from our pins or our code
    assert len(lines) <= 16, console  # what runs (3 lines), 3 steps, 2 evaluations, the checkpoint, the result
    assert sum("MODEL_TYPE=pre (the default" in line for line in lines) == 1
    steps = [line for line in lines if " | loss " in line and "step " in line]
    assert len(steps) == 3 and all(" elapsed" in line for line in steps)
    assert "eta " not in steps[0] and all(", eta " in line for line in steps[1:])  # a rate needs two lines
    assert any(f"run folder: {run}" in line for line in lines)
    assert not any(line.strip().startswith(("eval/", "train/", "optim/")) for line in lines)  # no metric per line
    saved = (run / "console.log").read_text()
    for needle in ("MODEL_TYPE=pre", "step 6/6", "eval austen-val at step 6", "final training loss"):
        assert needle in saved, needle
    record = json.loads((run / "run.json").read_text())
    assert record["run_name"] == "my-run"  # the run's own name, not the recipe's
    assert "data/prepared/austen-2k" in (run / "config.yaml").read_text()  # the full config went to the folder

    again = subprocess.run(cmd + ["--max_duration=8", "--try_load_latest_save"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = (run / "console.log").read_text()
    assert resumed.startswith(saved) and "step 8/8" in resumed  # a resume appends to the same log


@pytest.mark.parametrize("script", ["quickstart.sh", "check_python_range.sh"])
def test_shell_scripts_answer_help_at_once_and_refuse_unknown_options(script):
    import time

    started = time.time()
    ok = subprocess.run(["bash", str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "bash scripts/" + script in ok.stdout and time.time() - started < 2
    bad = subprocess.run(["bash", str(ROOT / "scripts" / script), "--bogus"], capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "usage: bash scripts/" + script in bad.stderr


_HELP_IMPORTS = """
import runpy, sys
script = sys.argv[1]
sys.argv = [script, "--help"]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    code = e.code
else:
    code = 0
heavy = [m for m in ("torch", "olmo", "transformers") if m in sys.modules]  # seconds each
print("HEAVY", code, ",".join(heavy), file=sys.stderr)
"""


@pytest.mark.parametrize("script", SCRIPTS + ["launch.py"])
def test_help_imports_neither_torch_nor_olmo(script):
    """--help answers at once (the issue measured 6-19 s, the import of OLMo alone 9.5 s): a device-independent
    check, the heavy modules it must not import before printing."""
    proc = subprocess.run([sys.executable, "-c", _HELP_IMPORTS, str(ROOT / "scripts" / script)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("HEAVY"))
    code, heavy = line.split(" ")[1], line.split(" ")[2] if len(line.split(" ")) > 2 else ""
    assert code in ("0", "None") and proc.stdout.strip(), (script, proc.stdout[-500:], proc.stderr[-2000:])
    assert heavy == "", f"{script} --help imports {heavy}"


def test_setup_and_test_scripts_answer_help_without_installing_or_testing():
    for script in ("setup_env.sh", "test.sh"):
        ok = subprocess.run(["bash", str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True,
                            timeout=30, env={**os.environ, "VENV": "/nonexistent/venv"})
        assert ok.returncode == 0 and f"usage: bash scripts/{script}" in ok.stdout, ok.stderr
        assert not Path("/nonexistent/venv").exists()
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "setup_env.sh"), "--bogus"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--help" in bad.stderr


def test_the_model_type_list_for_help_is_the_registry():
    from siamesenorm.analysis.tables import METHOD_NAMES
    from siamesenorm.models.names import declared_variants

    assert [name for name, _ in declared_variants()] == list(MODEL_TYPES)
    assert dict(declared_variants()) == METHOD_NAMES


@pytest.mark.slow
def test_importing_siamesenorm_is_cheap_and_still_hooks_olmo_in_any_order():
    script = """
import os, sys
order = sys.argv[1]
if order == "first":
    import siamesenorm
    assert "olmo" not in sys.modules and "torch" not in sys.modules
    import olmo.model
else:
    import olmo.model
    import siamesenorm
from olmo.config import ModelConfig
from olmo.model import OLMo
fields = dict(d_model=16, n_heads=2, n_layers=2, max_sequence_length=8, vocab_size=50, init_device="cpu")
os.environ["MODEL_TYPE"] = "hc"
hc = type(OLMo(ModelConfig(**fields)).transformer.blocks[0]).__name__
os.environ["MODEL_TYPE"] = "pre"
pre = type(OLMo(ModelConfig(**fields)).transformer.blocks[0]).__name__
print(hc, pre)
"""
    for order in ("first", "after"):
        proc = subprocess.run([sys.executable, "-c", script, order], capture_output=True, text=True, timeout=300,
                              cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.split() == ["HyperConnectionBlock", "OLMoSequentialBlock"], (order, proc.stdout)


def test_a_mistyped_model_type_gets_did_you_mean():
    from olmo.exceptions import OLMoConfigurationError

    from siamesenorm.models.config import SiameseModelConfig, validate_model_config

    for typo, meant in (("hybrid-pre", "hybrid_pre"), ("Post_Pre", "post_pre"), ("hybrdi", "hybrid")):
        with pytest.raises(OLMoConfigurationError, match=f"did you mean '{meant}'"):
            validate_model_config(SiameseModelConfig(), typo)
    with pytest.raises(OLMoConfigurationError) as caught:
        validate_model_config(SiameseModelConfig(), "transformer")
    assert "did you mean" not in str(caught.value) and "valid values are" in str(caught.value)


def test_a_mistyped_recipe_path_gets_did_you_mean():
    from siamesenorm.run.recipe import RunError, load_config

    with pytest.raises(RunError, match=r"did you mean configs/OLMo-1B-hybrid-2e-3.yaml\?"):
        load_config(str(Path("configs") / "OLMo-1B-hybrid-2e3.yaml"))
    with pytest.raises(RunError, match="not found; pick one from configs/"):
        load_config("configs/zzzzzzzzzzzzzzzzzzzzzzzzz.yaml")


def test_missing_shipped_corpus_names_the_exact_command_to_prepare_it(tmp_path, monkeypatch):
    """A fresh machine's sweep or study recipe before the quickstart: the missing token files are the shipped
    corpus's, so the one line gives the command that prepares exactly them (the quickstart's); other missing files
    get the general advice, which names no corpus."""
    from siamesenorm.run.recipe import PREPARE_SHIPPED_CORPUS, SHIPPED_CORPUS, RunError, check_data_paths, load_config

    cfg = load_config(str(ROOT / "configs" / "study-cpu.yaml"))
    monkeypatch.chdir(tmp_path)  # no data/prepared/austen-2k here
    with pytest.raises(RunError) as caught:
        check_data_paths(cfg)
    assert "no data at 'data/prepared/austen-2k/train/" in str(caught.value)
    assert str(caught.value).endswith(PREPARE_SHIPPED_CORPUS + "."), str(caught.value)
    quickstart = " ".join((ROOT / "scripts" / "quickstart.sh").read_text().replace("\\\n", " ").split())
    assert PREPARE_SHIPPED_CORPUS in quickstart.replace('"$DATA"', SHIPPED_CORPUS), "the quickstart's command differs"
    cfg = load_config(str(ROOT / "configs" / "study-cpu.yaml"), [f"--data.paths=[{tmp_path}/other/*.npy]"])
    with pytest.raises(RunError) as caught:
        check_data_paths(cfg)
    assert "prepare data with scripts/prepare_data.py" in str(caught.value) and "austen" not in str(caught.value)
    # The command writes under the working directory: a corpus named one folder up is not what it would prepare,
    # while the same folder named by its absolute path is.
    from siamesenorm.run.recipe import _how_to_prepare

    assert "austen" not in _how_to_prepare(f"../{SHIPPED_CORPUS}/train/*.npy")
    assert _how_to_prepare(f"./{SHIPPED_CORPUS}/train/*.npy").endswith(PREPARE_SHIPPED_CORPUS)
    assert _how_to_prepare(f"{tmp_path}/{SHIPPED_CORPUS}/val/part-0.npy").endswith(PREPARE_SHIPPED_CORPUS)
    assert "austen" not in _how_to_prepare(f"{SHIPPED_CORPUS}-other/train/*.npy")


def test_the_stored_recipe_keys_are_the_config_s_fields():
    """siamesenorm/run/recipe_keys.json (read before the heavy imports) is regenerated from the dataclasses; a field added
    to the config or a knob added to a variant without `python -m siamesenorm.run.recipe_keys --write` fails here."""
    from siamesenorm.run.recipe_keys import KEY_FILE, key_tree

    assert json.loads(KEY_FILE.read_text()) == json.loads(json.dumps(key_tree())), \
        "run: python -m siamesenorm.run.recipe_keys --write"


#: Runs a command's function, then says its exit status and which heavy modules it had imported by then.
_EXIT_AND_IMPORTS = """
import sys
from siamesenorm.cli import commands as cli
try:
    getattr(cli, sys.argv[1])(sys.argv[2:])
except SystemExit as e:
    heavy = ("torch", "olmo", "olmo_core", "olmo.train", "olmo.eval", "torchmetrics", "wandb")
    print("EXIT", e.code, ",".join(m for m in heavy if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize("main,args,says", [
    ("train_main", ["configs/tiny-cpu.yaml", "--optimizer.learnig_rate=1e-3"],
     "--optimizer.learnig_rate is not a field of optimizer; did you mean optimizer.learning_rate?"),
    ("train_main", ["configs/tiny-cpu.yaml", "--dry-run", "--model.n_layer=2"],
     "--model.n_layer is not a field of model; did you mean model.n_layers?"),
    ("olmo_core_train_main", ["configs/tiny-cpu.yaml", "--modle.n_layers=2"],
     "--modle is not a field of the config; did you mean model?"),
    ("train_main", ["RECIPE"], "model.d_modle is not a field of model; did you mean model.d_model?"),
    ("train_main", ["configs/tiny-cpu.yml"], "config file configs/tiny-cpu.yml not found; did you mean "
                                             "configs/tiny-cpu.yaml? pick one from configs/"),
    ("olmo_core_train_main", ["configs", "--dry-run"], "config file configs not found; pick one from configs/"),
])
def test_a_typo_is_one_line_before_torch_or_olmo_is_imported(main, args, says, tmp_path):
    """The issue measured 6-7 s of imports before a typo was reported; the check is on what was imported when the
    command exited (device-independent), not on time."""
    recipe = tmp_path / "typo.yaml"
    recipe.write_text((ROOT / "configs" / "tiny-cpu.yaml").read_text().replace("  d_model:", "  d_modle:", 1))
    args = [str(recipe) if a == "RECIPE" else a for a in args]
    proc = subprocess.run([sys.executable, "-c", _EXIT_AND_IMPORTS, main, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and says in lines[0], proc.stderr[-2000:]
    assert lines[1].rstrip() == "EXIT 2", f"exit status or heavy imports: {lines[1]}"


@pytest.mark.slow
@pytest.mark.parametrize("args,says", [
    (["--model.init_std=inf"], "model.init_std is inf"),
    (["--data.paths=[DATA/none/*.npy]"], "no data at"),
    (["--dry-run"], None),
])
def test_the_full_checks_and_a_dry_run_finish_before_olmos_trainer_is_imported(args, says, tmp_path, austen_prepared):
    """A start refused by the full load (OLMo's config, the data) or a dry run, which run every check a start makes,
    end before OLMo's Trainer and its evaluators (torchmetrics, wandb: about 5 s of CPU of imports) are imported."""
    folder = tmp_path / "run"
    args = [a.replace("DATA", str(tmp_path)) for a in args]
    proc = subprocess.run([sys.executable, "-c", _EXIT_AND_IMPORTS, "train_main", "configs/tiny-cpu.yaml", *args,
                           f"--save_folder={folder}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MODEL_TYPE": "hybrid_pre"})
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"EXIT {2 if says else 0} torch,olmo", proc.stderr[-2000:]  # OLMo's config, not its Trainer
    if says:
        assert says in proc.stderr and not folder.exists(), proc.stderr[-2000:]
    else:
        assert "a real start would: fresh" in proc.stdout and "model_type: hybrid_pre" in proc.stdout


def test_known_keys_and_list_items_pass_the_light_check():
    """One-sided: a known key, a bare flag, a list item or a free-form value is never named (the full load judges)."""
    from siamesenorm.run.recipe_keys import unknown_key

    recipes = sorted((ROOT / "configs").glob("*.yaml"))
    assert recipes and all(unknown_key(str(r), []) is None for r in recipes)
    assert unknown_key("configs/tiny-cpu.yaml", ["--save_overwrite", "--model.siamese_depth_scaling=false",
                                                   "--optimizer.learning_rate=1", "--evaluators.0.label=x",
                                                   "--model.n_layers.x=1", "positional"]) is None


# ---- the front door: python -m siamesenorm COMMAND, console scripts, thin shims --------------------------------------
def test_every_command_is_a_console_script_and_has_its_shim():
    import tomllib

    from siamesenorm.cli import COMMANDS

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"siamesenorm": "siamesenorm.cli:main",
                       **{f"siamesenorm-{c}": f"siamesenorm.cli:{c.replace('-', '_')}" for c in COMMANDS}}
    shims = {p: p.read_text() for p in [*(ROOT / "scripts").glob("*.py"), *(ROOT / "scripts").glob("*/*.py")]}
    for command, (module, function, _) in COMMANDS.items():
        calling = [p for p, text in shims.items() if f"from siamesenorm.cli.{module} import {function}" in text]
        assert calling, f"no scripts/ shim runs {command}"
    for path, text in shims.items():  # thin: a docstring, the import, the call
        assert "sys.path" not in text, path
    assert not [p for p in (ROOT / "siamesenorm").rglob("*.py") if "sys.path.insert" in p.read_text()]


@pytest.mark.parametrize("command", ["train", "sweep", "make-tables", "generate", "gpu-check", "compare-models"])
def test_the_front_door_answers_help_without_torch_and_names_the_command(command):
    code = ("import runpy, sys\nsys.argv = ['siamesenorm', sys.argv[1], '--help']\ntry:\n"
            "    runpy.run_module('siamesenorm', run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\n"
            "print('HEAVY', code, ','.join(m for m in ('torch', 'olmo') if m in sys.modules), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stderr.strip().splitlines()[-1].rstrip() in ("HEAVY 0", "HEAVY None"), proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: ") and proc.stdout.strip(), proc.stdout[:300]


def test_the_front_door_lists_commands_and_refuses_an_unknown_one_in_one_line():
    from siamesenorm.cli import COMMANDS

    listed = subprocess.run([sys.executable, "-m", "siamesenorm", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert listed.returncode == 0 and all(f"  {c} " in listed.stdout for c in COMMANDS)
    typo = subprocess.run([sys.executable, "-m", "siamesenorm", "trian"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert typo.returncode == 2 and typo.stderr.count("\n") == 1 and "did you mean train?" in typo.stderr


_TORN_DOWN_WITH_THE_INTERPRETER = """
import logging, sys, threading, time
import numpy as np, torch
from siamesenorm.cli.commands import _leave_now, _train_to_exit

tokens = np.arange(1 << 16, dtype=np.uint16)
def read():  # a thread still inside torch's C++ when the interpreter ends: what Python tears down badly
    while True:
        torch.tensor(tokens.astype(np.int64)).sum()
for _ in range(4):
    threading.Thread(target=read, daemon=True).start()
time.sleep(0.05)
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
logging.getLogger("run").info("final training loss: 7.5872")
print("record written", flush=False)
_train_to_exit(lambda: int(sys.argv[2]), leave={"sys.exit": sys.exit, "_leave_now": _leave_now}[sys.argv[1]])
"""


def test_an_olmo_core_run_ends_with_its_own_exit_status_whatever_the_interpreter_tears_down():
    """The OLMo-core command leaves through ``_leave_now``: with a C++ thread still running (here a daemon thread
    inside torch; under torchrun, what aborted two-process runs stopped early), Python's own exit aborts (SIGABRT,
    "terminate called without an active exception"); ours exits with the run's status, its last lines flushed."""
    def end(leave, code):
        return subprocess.run([sys.executable, "-c", _TORN_DOWN_WITH_THE_INTERPRETER, leave, str(code)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))

    plain = [end("sys.exit", 0) for _ in range(2)]
    assert any(p.returncode == -6 for p in plain), [(p.returncode, p.stderr[-300:]) for p in plain]  # the hazard
    for code in (0, 143):  # finished; stopped by SIGTERM
        ours = end("_leave_now", code)
        assert ours.returncode == code, ours.stderr[-1000:]
        assert "record written" in ours.stdout and "final training loss: 7.5872" in ours.stderr
