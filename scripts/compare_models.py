"""Check that two source trees build the same models, bit for bit (a refactor's check).

Logic: siamesenorm/cli/compare_models.py; the same command: python -m siamesenorm compare-models.
"""

import sys

from siamesenorm.cli.compare_models import main

if __name__ == "__main__":
    sys.exit(main())
