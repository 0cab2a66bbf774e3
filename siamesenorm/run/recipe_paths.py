"""Where a recipe is: a missing one named in one line, with the nearest recipe beside it or in configs/.

Light (no torch, no OLMo): the command line checks it before the heavy imports (``recipe_keys.unknown_key``), and
the full load (``recipe.load_config``) again for every other caller.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Optional

__all__ = ["missing_recipe"]


def missing_recipe(path: str) -> Optional[str]:
    """One line when no recipe is at ``path`` (absent, or a folder), naming the nearest recipe beside it or in
    configs/; None otherwise (a pipe or a file: the full load reads it)."""
    if Path(path).exists() and not Path(path).is_dir():
        return None
    recipes = sorted(str(p) for p in Path(path).parent.glob("*.y*ml")) or \
        sorted(str(p) for p in Path("configs").glob("*.yaml"))
    by_name = {Path(r).name: r for r in recipes}
    close = difflib.get_close_matches(Path(path).name, list(by_name), n=1, cutoff=0.75)
    hint = f"did you mean {by_name[close[0]]}? " if close else ""
    return f"config file {path} not found; {hint}pick one from configs/ (docs/training.md lists them)."
