"""``python -m siamesenorm COMMAND``: the front door (the commands: siamesenorm/cli/__init__.py)."""

import sys

from siamesenorm.cli import main

sys.exit(main())
