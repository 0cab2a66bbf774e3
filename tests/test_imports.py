"""The package has no import cycle, counting the imports inside functions too (a cycle hidden in a function is
still a cycle: it decides what may be imported first)."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "siamesenorm"


def _modules():
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _edges(name, path, modules):
    """The package modules ``name`` imports anywhere in its file (``from . import x`` counts x, not the package)."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            submodules = {f"{base}.{a.name}" for a in node.names} & modules.keys()
            found.update(submodules or ({base} & modules.keys()))
    return found - {name}


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    modules = {"p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py"}
    modules["p.a"].write_text("from .b import f\n")
    modules["p.b"].write_text("def f():\n    from .a import g\n")
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == [["p.a", "p.b"]]


def test_no_import_cycle_in_the_package():
    modules = _modules()
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 40 and graph["siamesenorm.ai2_olmo.train"]  # the scan sees the package and its imports
    assert _cycles(graph) == []


# Where an import may sit inside a function instead of at the module's top (docs/architecture.md, "Imports").
# 1. The light modules: what `--help`, the console, the sweep's parent process, the Slurm writer, the GPU check's
#    environment report and OLMo's hook import. They must not load torch or ai2-olmo (measured: 0.03-0.15 s to import
#    each against 5-15 s for siamesenorm.ai2_olmo.train or siamesenorm.olmo_core.train), so their heavy imports wait
#    in the function that needs them. Every command module (siamesenorm/cli/) is one.
_COMMANDS = sorted(f"siamesenorm.cli.{p.stem}" for p in (PACKAGE / "cli").glob("*.py") if p.stem != "__init__")
LIGHT = {"siamesenorm", "siamesenorm.cli", *_COMMANDS, "siamesenorm.models.olmo_hook", "siamesenorm.models.names",
         "siamesenorm.models.olmo_patch", "siamesenorm.run.recipe_keys", "siamesenorm.run.recipe_paths",
         "siamesenorm.run.console",
         "siamesenorm.run.data", "siamesenorm.run.records", "siamesenorm.run.stability", "siamesenorm.olmo_core",
         "siamesenorm.cluster.gpucheck", "siamesenorm.cluster.slurm", "siamesenorm.studies.sweep"}
# 2. Third-party modules one feature needs (export, figures, online logging, data preparation, the second framework)
#    and torch's private or version-dependent internals (imported where used, so a torch without them fails that
#    feature with its own message, not every import of the package).
DEFERRED = ("transformers", "matplotlib", "wandb", "datasets", "pyarrow", "tokenizers", "safetensors", "olmo_core",
            "olmo_data", "torch._inductor", "torch._dynamo", "torch._functorch", "torch._subclasses",
            "torch.distributed._shard", "torch.distributed.remote_device", "torch.utils.benchmark",
            "torch.utils.flop_counter", "torch.profiler", "ctypes")
# 3. An export's modelling code (siamesenorm/export/remote/) imports files written next to it at export time.
GENERATED = {"siamesenorm.export.remote.modeling_siamesenorm": {".olmo_lite", ".variant_table"}}
# 4. The ai2-olmo training entry imports OLMo's Trainer and its evaluators (torchmetrics, wandb: about 5 s of CPU) once
#    every check of a start has passed, so that a refused start or a dry run is said without them
#    (tests/cli/test_cli.py::test_the_full_checks_and_a_dry_run_finish_before_olmos_trainer_is_imported).
AFTER_CHECKS = {"siamesenorm.ai2_olmo.train": {"siamesenorm.ai2_olmo.trainer", "olmo.data", "olmo.eval"}}


def _function_imports(path):
    """(line, imported module as written) for every import inside a function of ``path``."""
    out = set()
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    out.update((node.lineno, a.name) for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    out.add((node.lineno, "." * node.level + (node.module or "")))
    return out


def _misplaced(modules):
    found = []
    for name, path in sorted(modules.items()):
        if name in LIGHT:
            continue
        for line, target in sorted(_function_imports(path)):
            deferred = any(target == d or target.startswith(d + ".") for d in DEFERRED)
            if not deferred and target not in GENERATED.get(name, set()) | AFTER_CHECKS.get(name, set()):
                found.append(f"{name}:{line} imports {target} inside a function")
    return found


def test_imports_sit_at_the_top_unless_there_is_a_reason():
    modules = _modules()
    assert LIGHT <= modules.keys() and set(GENERATED) <= modules.keys()
    assert _misplaced(modules) == []


def test_the_placement_check_finds_a_misplaced_import(tmp_path):
    (tmp_path / "heavy.py").write_text("def f():\n    import json\n    from .config import X\n"
                                       "    import matplotlib.pyplot\n    import transformers\n")
    assert _misplaced({"siamesenorm.heavy": tmp_path / "heavy.py"}) == [
        "siamesenorm.heavy:2 imports json inside a function", "siamesenorm.heavy:3 imports .config inside a function"]


def test_the_light_modules_load_neither_torch_nor_olmo():
    code = ("import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "print(sorted(n for n in ('torch', 'olmo', 'olmo_core', 'transformers', 'matplotlib') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, *sorted(LIGHT)], capture_output=True, text=True,
                         cwd=PACKAGE.parent, check=True).stdout.strip()
    assert out == "[]"


# ---- the folder order (docs/architecture.md, "Layout") ------------------------------------------------------------
#: Which folder of the package may import which (besides itself). Floors, from the bottom: nn (torch only) <
#: variants < models < run < the two framework adapters side by side (ai2_olmo, olmo_core) and the tools over a
#: trained model side by side (export, analysis, perf) < cluster, studies < cli. A tool never imports an adapter, and
#: the two adapters never import each other: what both need belongs in run/.
_BASE = {"nn", "variants", "models", "run"}
FOLDER_ORDER = {
    "nn": set(),
    "variants": {"nn"},
    "models": {"nn", "variants"},
    "run": {"nn", "variants", "models"},
    "ai2_olmo": _BASE,
    "olmo_core": _BASE,
    "export": _BASE,
    "analysis": _BASE,
    "perf": _BASE,
    "cluster": _BASE | {"perf", "ai2_olmo"},
    "studies": _BASE | {"analysis"},
    "cli": _BASE | {"ai2_olmo", "olmo_core", "export", "analysis", "perf", "cluster", "studies", "siamesenorm"},
    "siamesenorm": {"models", "run"},  # the package's __init__: the OLMo hook and the console's warning filter
    "__main__": {"cli"},  # python -m siamesenorm
}


def _folder(name, modules):
    parts = name.split(".")
    if len(parts) == 1:
        return "siamesenorm"
    return parts[1] if len(parts) > 2 or modules[name].name == "__init__.py" else parts[1].removesuffix(".py")


def _order_breaks(graph, modules):
    found = []
    for name, targets in sorted(graph.items()):
        here = _folder(name, modules)
        for target in sorted(targets):
            there = _folder(target, modules)
            if there != here and there not in FOLDER_ORDER.get(here, set()):
                found.append(f"{name} imports {target}: {here}/ may import only {sorted(FOLDER_ORDER.get(here, ()))}")
    return found


def test_every_module_sits_in_a_folder_of_the_order():
    modules = _modules()
    folders = {_folder(name, modules) for name in modules}
    assert folders == set(FOLDER_ORDER), f"folders without a place in FOLDER_ORDER: {folders ^ set(FOLDER_ORDER)}"


def test_the_package_keeps_its_folder_order():
    modules = _modules()
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert _order_breaks(graph, modules) == []


def test_the_order_check_finds_an_import_against_the_order(tmp_path):
    files = {"siamesenorm.run.folder": "from siamesenorm.ai2_olmo.train import main\n",
             "siamesenorm.ai2_olmo.train": "from siamesenorm.run.folder import hold\n",
             "siamesenorm.olmo_core.train": "from siamesenorm.ai2_olmo.train import check_data\n"}
    modules = {}
    for name, text in files.items():
        path = tmp_path / (name.replace(".", "_") + ".py")
        path.write_text(text)
        modules[name] = path
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    breaks = _order_breaks(graph, modules)
    assert [b.split(":")[0] for b in breaks] == ["siamesenorm.olmo_core.train imports siamesenorm.ai2_olmo.train",
                                                 "siamesenorm.run.folder imports siamesenorm.ai2_olmo.train"]


def _private_imports(modules):
    """(module, name) for every `from <package module> import _private` (a name another module may rename freely)."""
    found = []
    for name, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("siamesenorm")):
                found += [(name, a.name) for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_another_module_s_private_name(tmp_path):
    assert _private_imports(_modules()) == []
    (tmp_path / "m.py").write_text("from siamesenorm.perf.benchmark import _loss\n")
    assert _private_imports({"p.m": tmp_path / "m.py"}) == [("p.m", "_loss")]


def test_code_and_docs_give_reasons_not_issue_numbers():
    """An issue number means nothing to a reader of the code or the docs; the reason is said instead."""
    import re

    root = PACKAGE.parent
    tracked = subprocess.run(["git", "ls-files", "siamesenorm", "scripts", "tests", "docs", "configs", "README.md"],
                             cwd=root, capture_output=True, text=True).stdout.split()
    if not tracked:  # not a git checkout (an sdist): the folders as they are
        tracked = [str(p.relative_to(root)) for d in ("siamesenorm", "scripts", "tests", "docs", "configs")
                   for p in (root / d).rglob("*") if p.is_file()] + ["README.md"]
    pattern = re.compile(r"\b[Ii]ssues? #?\d+")
    hits = [f"{f}:{i}" for f in tracked if f.endswith((".py", ".md", ".yaml", ".sh", ".toml")) and (root / f).is_file()
            for i, line in enumerate((root / f).read_text(errors="replace").splitlines(), 1)
            if pattern.search(line) and "pattern = re.compile" not in line]
    assert hits == []


def test_ruff_finds_nothing():
    """The lint configuration of pyproject.toml ([tool.ruff]) holds for the whole tree (CI runs this test)."""
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
