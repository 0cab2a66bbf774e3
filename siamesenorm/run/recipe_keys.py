"""A recipe's and its overrides' keys checked before the heavy imports (a typo is one line in well under a second,
not after the 6-10 s OLMo and torch take to import).

The key tree of the training config (OLMo's TrainConfig with our model section and run settings) is stored in
``recipe_keys.json`` beside this file, generated from the dataclasses themselves
(``python -m siamesenorm.run.recipe_keys --write``); tests/cli/test_cli.py regenerates it and fails when it differs, so it
cannot drift from the config it describes. Reading it needs only ``json`` and ``yaml``.

The check is deliberately one-sided: it names a key only where the tree says for certain that no such field
exists; anything it cannot judge (list items, free-form dicts, a missing key file) is left to the full load,
which checks everything again.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Iterable, List, Optional

from siamesenorm.run.recipe_paths import missing_recipe

__all__ = ["unknown_key", "key_tree", "KEY_FILE"]

KEY_FILE = Path(__file__).with_name("recipe_keys.json")

#: In the tree: a dict is a section (its keys are all there are); None a field with a value; ANY a field whose
#: value is a free-form mapping (any keys below it).
ANY = "*"


def key_tree() -> dict:
    """The training config's keys from its dataclasses (imports OLMo: used to generate and to check the file)."""
    import dataclasses
    import typing

    from siamesenorm.run.recipe import SiameseTrainConfig

    def walk(cls) -> dict:
        hints = typing.get_type_hints(cls)
        out = {}
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            inner = [a for a in typing.get_args(tp) if a is not type(None)]
            if typing.get_origin(tp) is typing.Union and len(inner) == 1:
                tp = inner[0]  # Optional[X] -> X
            if dataclasses.is_dataclass(tp):
                out[f.name] = walk(tp)
            elif tp is typing.Any or tp is dict or typing.get_origin(tp) is dict:
                out[f.name] = ANY
            else:
                out[f.name] = None
        return out

    return walk(SiameseTrainConfig)


def _load_tree() -> Optional[dict]:
    try:
        tree = json.loads(KEY_FILE.read_text())
    except (OSError, ValueError):
        return None
    return tree if isinstance(tree, dict) else None


def _first_unknown(tree: dict, parts: List[str]) -> Optional[str]:
    """The message for the first part of a dotted key that names no field, or None."""
    node = tree
    for depth, part in enumerate(parts):
        if not isinstance(node, dict):
            return None  # below a plain field or a free-form mapping: the full load judges it
        if part not in node:
            where = ".".join(parts[:depth]) or "the config"
            close = difflib.get_close_matches(part, list(node), n=1, cutoff=0.6)
            hint = f"did you mean {'.'.join(parts[:depth] + close[:1])}? " if close else ""
            return f"{'.'.join(parts[:depth + 1])} is not a field of {where}; {hint}" \
                   f"(the fields and the variant knobs: docs/training.md and docs/fidelity.md)"
        node = node[part]
    return None


def _recipe_keys(mapping, prefix: List[str]) -> Iterable[List[str]]:
    for key, value in mapping.items():
        if not isinstance(key, str):
            continue
        yield prefix + [key]
        if isinstance(value, dict):
            yield from _recipe_keys(value, prefix + [key])


def unknown_key(config_path: str, overrides: Iterable[str]) -> Optional[str]:
    """One line naming the first key of the recipe or of the ``--key=value`` overrides that the config has not,
    with the nearest field, or saying the recipe itself is missing (``missing_recipe``); None when every key is
    known (or the check cannot tell)."""
    missing = missing_recipe(config_path)
    if missing:
        return missing
    tree = _load_tree()
    if tree is None:
        return None
    if os.environ.get("SIAMESENORM_VARIANTS"):
        tree["model"] = ANY  # variant folders from elsewhere declare knobs the stored tree cannot know
    for option in overrides:
        if not option.startswith("--"):
            continue  # the full load says what is wrong with it
        key = option[2:].split("=", 1)[0]
        message = _first_unknown(tree, key.split(".")) if key else None
        if message:
            return f"--{message}"
    try:
        import yaml

        with open(config_path, "rb") as f:
            if f.seek(0, 2) > 1 << 20:
                return None  # no recipe is that long; the full load deals with it
            f.seek(0)
            recipe = yaml.safe_load(f)
    except Exception:  # missing, unreadable or not YAML: the full load says so, with the line
        return None
    if not isinstance(recipe, dict):
        return None
    for parts in _recipe_keys(recipe, []):
        message = _first_unknown(tree, parts)
        if message:
            return f"{config_path}: {message}"
    return None


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m siamesenorm.run.recipe_keys --write   (regenerates siamesenorm/run/recipe_keys.json)")
    if os.environ.get("SIAMESENORM_VARIANTS"):
        sys.exit("unset SIAMESENORM_VARIANTS first: the stored keys are the shipped variants' only")
    KEY_FILE.write_text(json.dumps(key_tree(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {KEY_FILE}")
