"""A sweep of methods x learning rates x seeds over one recipe, run a few processes at a time, resumable across
sessions, with the analyses that need a checkpoint computed right after each run so checkpoints need not be kept.

A plan (YAML, e.g. studies/cpu-lr-grid/sweep.yaml)::

    recipe: configs/study-cpu.yaml     # the recipe every cell trains
    runs: runs/study                   # checkpoints and full logs (not committed)
    results: studies/cpu-lr-grid/results         # what is kept per cell (committed): run.json, metrics.jsonl.gz, analyses
    overrides: []                      # --key=value added to every cell
    framework: ai2_olmo                # who trains each cell: ai2_olmo (scripts/train.py, the default) or
                                       # olmo_core (scripts/train_olmo_core.py); records, results and analyses alike
    groups:                            # cells = the product of each group's lists
      - {methods: [pre, hybrid_pre], learning_rates: [1e-2, 1e-1], seeds: [1]}
      - {methods: [hybrid_pre], learning_rates: [1e-2], seeds: [1], knobs: {siamese_depth_scaling: false}}
      - {methods: [pre], learning_rates: [1e-2], seeds: [1], knobs: {n_layers: 4, d_model: 128}}
      - {methods: [pre], learning_rates: [1e-2], seeds: [1], settings: {scheduler.t_warmup: 0}}
      - {methods: [hybrid_pre], learning_rates: [1e-2], seeds: [1], settings: {max_duration: 4000},
         analyse_every: 500}

``knobs`` are model fields (``--model.KEY=VALUE``), ``settings`` any other config path (``--KEY=VALUE``); both name
the cell. ``analyse_every: N`` keeps a checkpoint every N steps and writes ``analysis-steps.json`` (every analysis
at each of them) beside ``analysis.json``: how the streams evolve over training.

A cell is done when ``{results}/{cell}/run.json`` says finished or diverged (both are final results); any other
cell is (re)started with the same command, which resumes from its latest checkpoint (``try_load_latest_save``).
Each finished cell gets ``analysis.json`` (hidden-state magnitudes, stream ratios, fusion weights and logit lens,
the depth probe: each tool's result, or why it does not apply), computed from its last checkpoint on the
validation split, in a process of its own as the training is (a SIGTERM stops it at once, and the next sweep analyses
the cell again without training it); then the checkpoints are deleted unless ``--keep-checkpoints``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from omegaconf import OmegaConf as om

from siamesenorm.models.names import model_type_names
from siamesenorm.run.records import METRICS_COMPRESSED, METRICS_NAME, RECORD_NAME, compress_metrics
from siamesenorm.run.stability import EXIT_DIVERGED

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
FINAL = ("finished", "diverged")
KEPT = (RECORD_NAME, METRICS_NAME, "config.yaml")
#: what a cell that the sweep's own stop (SIGTERM, Ctrl-C) cut off is reported as
STOPPED = "stopped by the signal; it resumes from its latest checkpoint on the next run"
#: in a cell's run folder, beside the trainer's own console.log: what its process printed
CHILD_OUTPUT = "sweep-output.log"


@dataclass(frozen=True)
class Cell:
    model_type: str
    learning_rate: float
    seed: int
    knobs: tuple = ()  # ((model field, value), ...)
    settings: tuple = ()  # ((config path, value), ...)
    analyse_every: Optional[int] = None  # keep and analyse a checkpoint every this many steps

    @property
    def name(self) -> str:
        changes = "".join(f"-{k}={_fmt(v)}" for k, v in self.knobs + self.settings)
        return f"{self.model_type}{changes}-lr{_fmt(self.learning_rate)}-s{self.seed}"

    def overrides(self, framework: str = "ai2_olmo") -> List[str]:
        every = [] if self.analyse_every is None else [  # OLMo-core keeps every periodic checkpoint by default
            f"--save_interval_unsharded={self.analyse_every}", "--save_num_unsharded_checkpoints_to_keep=-1"
        ] if framework == "ai2_olmo" else [f"--save_interval={self.analyse_every}"]
        return ([f"--optimizer.learning_rate={self.learning_rate}", f"--seed={self.seed}"]
                + [f"--model.{k}={_fmt(v)}" for k, v in self.knobs]
                + [f"--{k}={_fmt(v)}" for k, v in self.settings] + every)


def _fmt(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclass
class Plan:
    recipe: str
    runs: str
    results: str
    cells: List[Cell]
    overrides: List[str] = field(default_factory=list)
    analysis_sequences: int = 32
    analysis_tokens: Optional[str] = None  # token files for the analyses; None: the recipe's lm evaluator's
    framework: str = "ai2_olmo"  # FRAMEWORKS: which training command trains each cell


#: A plan's ``framework``: the training command of each cell, and the glob of its checkpoints (``analyse_every``).
FRAMEWORKS = {"ai2_olmo": ("train.py", "step*-unsharded"), "olmo_core": ("train_olmo_core.py", "step[0-9]*")}


class PlanError(ValueError):
    """A sweep plan that cannot be run as written; the message names the file and the field."""


_VALUE = re.compile(r"[A-Za-z0-9_.+-]{1,64}")  # what a knob or setting may be: it becomes part of a folder name


def _plan_list(path, where: str, value, kind, check=None) -> list:
    if not isinstance(value, list) or not value:
        raise PlanError(f"{path}: {where} must be a non-empty list")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, kind) or (check and not check(item)):
            raise PlanError(f"{path}: {where} holds {item!r}; see the plan format in siamesenorm/studies/sweep.py")
    return value


def load_plan(path: str | Path) -> Plan:
    """The plan at ``path``, every value checked before any folder name is made from it (PlanError, one line)."""
    known = set(model_type_names())
    extra = bool(os.environ.get("SIAMESENORM_VARIANTS"))  # variant files outside the package: named plainly

    def model_type(name: str) -> bool:
        return name in known or (extra and re.fullmatch(r"[a-z][a-z0-9_]{0,63}", name) is not None)

    try:
        raw = om.to_container(om.load(str(path)), resolve=False)
    except OSError:
        raise
    except Exception as e:  # YAML and omegaconf errors are many classes
        raise PlanError(f"{path}: not a readable YAML plan ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: a plan is a mapping with recipe, runs, results and groups")
    for key in ("recipe", "runs", "results"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise PlanError(f"{path}: {key} must be a path")
    groups = raw.get("groups")
    _plan_list(path, "groups", groups, dict)
    cells: List[Cell] = []
    for n, group in enumerate(groups, 1):
        where = f"group {n}"
        methods = _plan_list(path, f"{where} methods", group.get("methods"), str, model_type)
        rates = _plan_list(path, f"{where} learning_rates", group.get("learning_rates"), (int, float),
                           lambda v: 0 < v < 10)
        seeds = _plan_list(path, f"{where} seeds", group.get("seeds", [1]), int, lambda v: 0 <= v < 2**31)
        for part in ("knobs", "settings"):
            table = group.get(part) or {}
            if not isinstance(table, dict) or not all(
                    isinstance(k, str) and _VALUE.fullmatch(k) and isinstance(v, (str, int, float, bool))
                    and _VALUE.fullmatch(str(v)) for k, v in table.items()):
                raise PlanError(f"{path}: {where} {part} must map names to plain values (letters, digits, ._+-)")
        every = group.get("analyse_every")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise PlanError(f"{path}: {where} analyse_every must be a positive number of steps")
        knobs = tuple(sorted((group.get("knobs") or {}).items()))
        settings = tuple(sorted((group.get("settings") or {}).items()))
        for mt, lr, seed in itertools.product(methods, rates, seeds):
            cell = Cell(mt, float(lr), int(seed), knobs, settings, None if every is None else int(every))
            if cell not in cells:
                cells.append(cell)
    framework = raw.get("framework", "ai2_olmo")
    if framework not in FRAMEWORKS:
        raise PlanError(f"{path}: framework must be one of {', '.join(FRAMEWORKS)} (got {framework!r})")
    return Plan(raw["recipe"], raw["runs"], raw["results"], cells, list(raw.get("overrides") or []),
                int(raw.get("analysis_sequences", 32)), raw.get("analysis_tokens"), framework)


def check_inputs(plan: Plan) -> None:
    """Before any cell starts: the token files the recipe names (with the plan's overrides) exist. Every cell reads
    the same recipe and data, so a missing file would fail each cell in turn, one error line a cell; one PlanError
    says what to do instead. A recipe this loader cannot read is left to the cells (they report it themselves)."""
    from siamesenorm.run.recipe import RunError, check_data_paths, load_config
    try:
        cfg = load_config(plan.recipe, list(plan.overrides))
    except (RunError, OSError, ValueError):
        return
    try:
        check_data_paths(cfg)
    except RunError as err:
        raise PlanError(f"{plan.recipe}: {err}") from None


def status(plan: Plan, cell: Cell) -> Optional[str]:
    path = Path(plan.results) / cell.name / RECORD_NAME
    try:
        status = json.loads(path.read_text()).get("status")
    except (OSError, ValueError, AttributeError, RecursionError):  # absent, or cut by a kill while it was copied
        return None                                                # (or not a record): run the cell
    return status if isinstance(status, str) else None


class CellStopped(Exception):
    """A cell whose training the sweep's own stop (SIGTERM, Ctrl-C) cut off: it recorded "stopped" and resumes."""


def run_cell(plan: Plan, cell: Cell, keep_checkpoints: bool = False) -> str:
    """Train one cell (resuming if it was cut off), keep its results, analyse it; returns its final status."""
    run_dir = Path(plan.runs) / cell.name
    out = Path(plan.results) / cell.name
    script = FRAMEWORKS[plan.framework][0]
    cmd = [sys.executable, str(ROOT / "scripts" / script), plan.recipe, f"--save_folder={run_dir}",
           "--try_load_latest_save", *plan.overrides, *cell.overrides(plan.framework)]
    env = {**os.environ, "MODEL_TYPE": cell.model_type, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    run_dir.mkdir(parents=True, exist_ok=True)
    # the trainer writes its own console.log in the run folder; what the process printed (the same lines, and what
    # comes before that log exists or after it closes: a traceback, a refusal) goes to a file of the sweep's own
    with open(run_dir / CHILD_OUTPUT, "a") as output:
        code = _run_child(cmd, env, output)
    record_path = run_dir / RECORD_NAME
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    if code not in (0, EXIT_DIVERGED) or record.get("status") not in FINAL:
        # the sweep's own stop is not an error: the run recorded "stopped", or the signal reached the process before
        # its handler was in place (it had just started) and killed it; either way the next sweep resumes it
        if _stopping.is_set() and (record.get("status") == "stopped" or code in (-signal.SIGTERM, -signal.SIGINT)):
            raise CellStopped(cell.name)
        raise RuntimeError(f"{cell.name}: training exited {code} (status {record.get('status')}); see "
                           f"{run_dir / CHILD_OUTPUT}")
    # the results are staged beside the run and moved into place whole: a results folder is complete or absent
    # (a sweep stopped while it analyses leaves none behind, and a reader never sees one half written)
    stage = run_dir / "results-staged"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    if record["status"] == "finished":
        # in a process of their own, as the training: the sweep's stop reaches them at once (they took 15 min for an
        # mHC cell of 64 layers, which in the sweep's own process a SIGTERM could not cut short), and the next sweep
        # reruns them (its training command finds the run at its last step and trains nothing)
        if _stopping.is_set():  # the stop came as the training ended
            raise CellStopped(cell.name)
        with open(run_dir / CHILD_OUTPUT, "a") as output:
            code = _run_child(analysis_command(plan, cell, run_dir, stage), env, output)
        if code != 0:
            if _stopping.is_set() and code in (-signal.SIGTERM, -signal.SIGINT):
                raise CellStopped(cell.name)
            raise RuntimeError(f"{cell.name}: its analyses exited {code}; see {run_dir / CHILD_OUTPUT}")
    for name in KEPT:
        if name == METRICS_NAME and (run_dir / name).is_file():  # kept compressed (a tenth of the bytes)
            compress_metrics(run_dir / name, stage / METRICS_COMPRESSED)
        elif name != RECORD_NAME and (run_dir / name).is_file():
            shutil.copy2(run_dir / name, stage / name)
    shutil.copy2(record_path, stage / RECORD_NAME)  # its presence in results/ marks the cell done
    if out.exists():  # an earlier, incomplete copy (a sweep before staging, stopped while it kept the results)
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(stage), str(out))
    if not keep_checkpoints:
        for path in list(run_dir.glob("step*")) + list(run_dir.glob("latest*")):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return record["status"]


_children: set = set()
_children_lock = threading.Lock()
_stopping = threading.Event()


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the sweep dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG), so
    no training process outlives its sweep."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not Linux: stop_children on SIGTERM / SIGINT still covers the sweep's own exits
        pass


def _run_child(cmd: List[str], env: Dict[str, str], console) -> int:
    if _stopping.is_set():
        raise RuntimeError("the sweep is stopping")
    proc = subprocess.Popen(cmd, env=env, stdout=console, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    with _children_lock:
        _children.add(proc)
    try:
        return proc.wait()
    finally:
        with _children_lock:
            _children.discard(proc)


def stopping() -> bool:
    return _stopping.is_set()


def stop_children(signum: int = signal.SIGTERM) -> None:
    """Pass ``signum`` to every training process of this sweep and start no new one (a run records "stopped" and
    resumes on the next sweep)."""
    _stopping.set()
    with _children_lock:
        for proc in list(_children):
            proc.send_signal(signum)


#: the first argument of this module run as a program: the analyses of one finished cell (``analyse_cell``)
ANALYSE = "analyse-cell"


def analysis_command(plan: Plan, cell: Cell, run_dir: Path, stage: Path) -> List[str]:
    """The child process that analyses a finished cell into ``stage`` (``analyse_cell``)."""
    checkpoints = FRAMEWORKS[plan.framework][1] if cell.analyse_every is not None else ""
    return [sys.executable, "-m", __name__, ANALYSE, str(run_dir), str(stage), str(plan.analysis_sequences),
            plan.analysis_tokens or "", checkpoints]


def analyse_cell(run_dir: Path, stage: Path, max_sequences: int, tokens: Optional[str],
                 checkpoints: Optional[str]) -> None:
    """A finished cell's analyses into ``stage``: ``analysis.json`` from its last checkpoint, and with
    ``checkpoints`` (a glob: the cell keeps a checkpoint every ``analyse_every`` steps) ``analysis-steps.json``."""
    analyses = analyse(run_dir, max_sequences, tokens)
    (stage / "analysis.json").write_text(json.dumps(analyses, indent=1) + "\n")
    if checkpoints:
        steps = {}
        for ckpt in sorted(run_dir.glob(checkpoints), key=lambda p: int(p.name[4:].split("-")[0])):
            steps[ckpt.name[4:].split("-")[0]] = analyse(ckpt, max_sequences, tokens)
        (stage / "analysis-steps.json").write_text(json.dumps(steps, indent=1) + "\n")


def analyse(run_dir: Path, max_sequences: int, tokens: Optional[str] = None) -> Dict:
    """Every checkpoint analysis of siamesenorm.analysis.probes on the run's last checkpoint and validation split."""
    from siamesenorm.analysis import probes as analysis

    model, cfg = analysis.load_model(run_dir)
    batch = analysis.eval_tokens(cfg, tokens=tokens, max_sequences=max_sequences)
    tools = {
        "magnitudes": lambda: analysis.hidden_magnitudes(model, batch),
        "stream_ratios": lambda: analysis.stream_ratios(model),
        "lens": lambda: analysis.fusion_and_lens(model, batch),
        "depth": lambda: analysis.depth_probe(model, batch),
        "massive": lambda: analysis.massive_activations(model, batch),
    }
    results: Dict = {"eval_sequences": int(batch.shape[0])}
    for name, tool in tools.items():
        try:
            results[name] = {"applies": True, **tool()}
        except analysis.NotApplicable as why:
            results[name] = {"applies": False, "reason": str(why)}
    return results


def run_plan(plan: Plan, parallel: int = 2, only: Optional[List[str]] = None, keep_checkpoints: bool = False,
             echo=print) -> Dict[str, str]:
    """Run every cell not done yet, ``parallel`` at a time; returns {cell: final status or error}."""
    todo = [c for c in plan.cells if status(plan, c) not in FINAL and (not only or c.name in only)]
    done = len(plan.cells) - len([c for c in plan.cells if status(plan, c) not in FINAL])
    echo(f"sweep: {len(plan.cells)} cells, {done} done, {len(todo)} to run, {parallel} at a time")
    outcomes: Dict[str, str] = {}
    started = time.time()

    def one(cell: Cell) -> None:
        if _stopping.is_set():
            return
        t0 = time.time()
        try:
            # the list was drawn at the start: a second sweep of the same plan may have finished the cell since
            # (its run folder's lock keeps two from training one cell at once); its record is not trained over
            done_elsewhere = status(plan, cell)
            outcomes[cell.name] = (f"{done_elsewhere} by another process" if done_elsewhere in FINAL else
                                   run_cell(plan, cell, keep_checkpoints))
        except Exception as err:  # a failed cell is reported; the others go on
            outcomes[cell.name] = STOPPED if isinstance(err, CellStopped) else f"error: {err}"
        echo(f"[{len(outcomes)}/{len(todo)}] {cell.name}: {outcomes[cell.name]} ({time.time() - t0:.0f} s; "
             f"{(time.time() - started) / 60:.1f} min in all)")

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        pending = {pool.submit(one, cell) for cell in todo}
        while pending:
            # wake twice a second: Python runs a signal handler in the main thread only, between bytecodes, and a
            # SIGTERM the kernel hands to a worker thread does not interrupt a main thread asleep in one long wait
            # (it would be handled only when a cell ended, perhaps an hour later, its training still running)
            done, pending = wait(pending, timeout=0.5)
            for future in done:
                future.result()
    return outcomes


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == ANALYSE:  # run_cell's child, not a user command
    analyse_cell(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5] or None, sys.argv[6] or None)
