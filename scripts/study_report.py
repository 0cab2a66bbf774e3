"""The CPU study's table, figures and per-claim numbers from the sweep's results (siamesenorm/studies/lr_grid.py).

Logic: siamesenorm/cli/study_report.py; the same command: python -m siamesenorm study-report.
"""

import sys

from siamesenorm.cli.study_report import main

if __name__ == "__main__":
    sys.exit(main())
