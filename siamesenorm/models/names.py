"""MODEL_TYPE names and display names, read from the variant files' ``VARIANT = Variant(...)`` without importing
them (importing a variant imports torch and OLMo: seconds). For ``--help`` texts and argument choices; everything
else uses the registry (siamesenorm.variants.VARIANTS), and tests/models/test_registry.py checks that the two agree."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path
from typing import Tuple

__all__ = ["declared_variants", "model_type_names", "model_types_help"]

VARIANTS_DIR = Path(__file__).resolve().parents[1] / "variants"


@lru_cache(maxsize=1)
def declared_variants() -> Tuple[Tuple[str, str], ...]:
    """((MODEL_TYPE, display name), ...) in the registry's order."""
    found = []
    for path in sorted(VARIANTS_DIR.glob("*.py")):
        if path.name.startswith("_") or path.name == "spec.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Variant":
                fields = {k.arg: k.value for k in node.keywords if k.arg in ("name", "display_name", "order")}
                values = {k: ast.literal_eval(v) for k, v in fields.items()}
                order = values.get("order")  # as the registry sorts: placed by number, then the rest by name
                found.append(((order is None, order or 0, values["name"]), values["name"],
                              values.get("display_name") or values["name"]))
    return tuple((name, display) for _, name, display in sorted(found))


def model_type_names() -> Tuple[str, ...]:
    return tuple(name for name, _ in declared_variants())


def model_types_help() -> str:
    """One line per MODEL_TYPE: its name and the name the paper's tables use."""
    return "\n".join(f"  {name:<15s}{display}" for name, display in declared_variants())
