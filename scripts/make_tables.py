"""The paper's Table 1 from run records, as Markdown, CSV and LaTeX. Rules for each cell:
siamesenorm/analysis/tables.py.

Logic: siamesenorm/cli/make_tables.py; the same command: python -m siamesenorm make-tables.
"""

import sys

from siamesenorm.cli.make_tables import main

if __name__ == "__main__":
    sys.exit(main())
