"""The modelling code an export carries, so that transformers alone loads it (``trust_remote_code=True``).

``write_remote_code(folder, model_type)`` writes into an export folder:

- ``modeling_siamesenorm.py`` (this package's, as it is): the transformers config and causal LM;
- ``olmo_lite.py`` (this package's, as it is): what ai2-olmo would supply, in torch alone;
- the package's own files for that MODEL_TYPE: ``siamesenorm/nn/topologies.py``, ``siamesenorm/variants/spec.py``,
  ``_base.py``, the variant's file and the variant files it imports, with nothing changed but the import lines
  (``olmo.*`` -> ``.olmo_lite``, ``..nn.topologies`` -> ``.topologies``; ``REWRITES``), so the update rules that
  run in an export are the ones that trained it: generated, not a second copy that could drift;
- ``variant_table.py`` (generated): that MODEL_TYPE's block and knobs.

and returns the ``auto_map`` for config.json. Every written file is checked to import only the standard library,
torch, transformers and its sibling files (``check_imports``); tests/export/test_remote_code.py loads every MODEL_TYPE in
a Python where siamesenorm and ai2-olmo cannot be imported and compares the logits with OLMo's.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

from siamesenorm import variants

from .olmo_lite import unsupported

__all__ = ["write_remote_code", "remote_refusal", "AUTO_MAP", "REWRITES", "check_imports", "CHECKED_TRANSFORMERS"]

#: The transformers releases an export's remote code is tested under (tests/export/test_remote_code.py: greedy generation
#: with the cache equal to generation without it, and to OLMo's): pyproject.toml's pin and its
#: ``[tool.siamesenorm] transformers-newest``. An export's README and config.json name them.
CHECKED_TRANSFORMERS = ("5.23.0", "5.24.0")

PACKAGE = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

AUTO_MAP = {"AutoConfig": "modeling_siamesenorm.SiameseOlmoConfig",
            "AutoModelForCausalLM": "modeling_siamesenorm.SiameseOlmoForCausalLM"}

#: (pattern, replacement) for the import lines of the copied package files; nothing else is changed.
REWRITES = (
    (re.compile(r"^(\s*)from olmo\.(?:model|config|exceptions) import ", re.M), r"\1from .olmo_lite import "),
    (re.compile(r"^(\s*)from \.\.nn\.topologies import ", re.M), r"\1from .topologies import "),
    (re.compile(r"^(\s*)from \.\.nn\.fused import ", re.M), r"\1from .fused import "),
    (re.compile(r"^(\s*)from \. import KNOBS\b", re.M), r"\1from .variant_table import KNOBS"),
)

_RELATIVE = re.compile(r"^\s*from\s+\.(\w+)\s+import", re.M)  # what transformers copies along with a module file
_ALLOWED = set(sys.stdlib_module_names) | {"torch", "transformers", "triton"}  # triton: optional (fused.py)


def remote_refusal(olmo: Dict) -> Optional[str]:
    """Why the model with OLMo config fields ``olmo`` cannot carry remote code, or None."""
    return unsupported(olmo)


def _source(name: str) -> Path:
    """The package file that becomes ``name`` in an export."""
    if name in ("topologies.py", "fused.py"):
        return PACKAGE / "nn" / name
    if name in ("olmo_lite.py", "modeling_siamesenorm.py"):
        return HERE / name
    for folder in variants.__path__:  # the package's folder, then SIAMESENORM_VARIANTS' folders
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return PACKAGE / "variants" / name


def _rewrite(name: str, text: str) -> str:
    for pattern, replacement in REWRITES:
        text = pattern.sub(replacement, text)
    source = _source(name)
    origin = source.relative_to(PACKAGE.parent) if source.is_relative_to(PACKAGE.parent) else source
    header = (f"# Written by siamesenorm's export from {origin} (import lines pointed at this folder's files, "
              "nothing else changed).\n")
    return header + text


def _variant_table(model_type: str) -> str:
    return f'''"""Written by siamesenorm's export: this folder's MODEL_TYPE ({model_type}), its block and knobs, as
siamesenorm/variants/__init__.py registers them."""

from .{model_type} import VARIANT

VARIANTS = {{VARIANT.name: VARIANT}}
KNOBS = {{k.name: k for k in VARIANT.knobs}}


def block_class(model_type: str):
    if model_type not in VARIANTS:
        raise ValueError(f"this folder holds the modelling code of MODEL_TYPE {model_type!r} only, "
                         f"not {{model_type!r}}")
    from .olmo_lite import OLMoSequentialBlock

    return VARIANT.block or OLMoSequentialBlock
'''


def check_imports(name: str, text: str) -> None:
    """Raise if the module ``name`` imports anything but the standard library, torch, transformers and sibling files
    (``from .x import``); transformers copies exactly the siblings named that way."""
    for node in ast.walk(ast.parse(text, filename=name)):
        if isinstance(node, ast.Import):
            modules = [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [(node.module, node.level)]
        else:
            continue
        for module, level in modules:
            if level == 0 and module.split(".")[0] not in _ALLOWED:
                raise RuntimeError(f"{name}: imports {module}, which an export cannot rely on")
            if level > 1 or (level == 1 and not module):
                raise RuntimeError(f"{name}: a relative import transformers would not copy (line {node.lineno})")


def files_for(model_type: str) -> Dict[str, str]:
    """{file name: text} of the modelling code for ``model_type``: the closure of the relative imports."""
    files: Dict[str, str] = {"variant_table.py": _variant_table(model_type)}
    todo: List[str] = ["modeling_siamesenorm.py"] + [f"{m}.py" for m in _RELATIVE.findall(files["variant_table.py"])]
    while todo:
        name = todo.pop()
        if name in files:
            continue
        path = _source(name)
        if not path.is_file():
            raise RuntimeError(f"modelling code for MODEL_TYPE {model_type}: no file {path} for {name}")
        text = path.read_text(encoding="utf-8")
        files[name] = text if path.parent == HERE else _rewrite(name, text)
        todo.extend(f"{m}.py" for m in _RELATIVE.findall(files[name]))
    for name, text in files.items():
        check_imports(name, text)
    return files


def write_remote_code(folder: Path, model_type: str) -> Dict[str, str]:
    """Write the modelling code for ``model_type`` into ``folder``; returns config.json's ``auto_map``."""
    for name, text in files_for(model_type).items():
        (Path(folder) / name).write_text(text, encoding="utf-8")
    return dict(AUTO_MAP)
