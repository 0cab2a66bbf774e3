"""The OLMo/ source-tree route (logic: siamesenorm/models/olmo_patch.py).

  python scripts/olmo_tree.py setup     # OLMo/ from ai2-olmo 0.6.0's PyPI sdist (sha256 checked), git repo tagged
                                        # v0.6.0, changes.patch applied and committed; safe to rerun
  python scripts/olmo_tree.py patch     # regenerate changes.patch from the hook defined in siamesenorm/models/olmo_patch.py
  cd OLMo && pip install -e . && cd .. && pip install -e . --no-deps   # then train as usual
"""

import argparse
from pathlib import Path

from siamesenorm.models import olmo_patch

ROOT = Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["setup", "patch"],
                        help="setup: make OLMo/ with changes.patch applied; patch: regenerate changes.patch")
    parser.add_argument("--dir", default=str(ROOT / "OLMo"), help="where the OLMo checkout lives (default: OLMo/)")
    parser.add_argument("--cache", default=str(ROOT / ".cache" / "sdist"), help="where the sdist is kept")
    args = parser.parse_args()
    target, cache, patch = Path(args.dir), Path(args.cache), ROOT / "changes.patch"
    if args.command == "setup":
        olmo_patch.materialize(target, patch, cache)
        print(f"{target}: ai2-olmo {olmo_patch.VERSION} with changes.patch applied (git log shows both commits)")
    else:
        olmo_patch.materialize(target, None, cache)
        patch.write_text(olmo_patch.render_patch(olmo_patch.pristine_tree(target)))
        print(f"wrote {patch} ({len(patch.read_text().splitlines())} lines)")


if __name__ == "__main__":
    main()
