"""The paper's Table 1 from run records, as Markdown, CSV and LaTeX. Rules for each cell: siamesenorm/analysis/tables.py.

  python scripts/make_tables.py runs/                      # every run.json under runs/, Markdown to stdout
  python scripts/make_tables.py runs/ --format all --output tables/   # tables/table1.{md,csv,tex}
"""

import argparse
import sys
from pathlib import Path

from siamesenorm.run.records import RECORD_NAME, read_record

ROOT = Path(__file__).resolve().parents[2]

SUFFIX = {"markdown": "md", "csv": "csv", "latex": "tex"}


def find_records(paths):
    found = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
        elif p.is_dir():
            found.extend(sorted(p.rglob(RECORD_NAME)))
        else:
            raise FileNotFoundError(f"{p} does not exist; pass run folders, run.json files or a folder holding runs.")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="run folders, run.json files, or folders searched for run.json")
    parser.add_argument("--format", choices=[*SUFFIX, "all"], default="markdown",
                        help="table format (default markdown); all: every format, needs --output")
    parser.add_argument("--output", help="write table1.<md|csv|tex> into this folder instead of printing")
    args = parser.parse_args(argv)
    from siamesenorm.analysis.tables import (  # after --help: imports OLMo
        LEGEND,
        build_table,
        formats,
        render,
        subset_note,
    )

    try:
        files = find_records(args.paths)
        if not files:
            raise FileNotFoundError(f"no {RECORD_NAME} under {', '.join(args.paths)}: training runs write one into "
                                    "their save_folder.")
        table = build_table(read_record(f) for f in files)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output and Path(args.output).exists() and not Path(args.output).is_dir():
        print(f"error: --output {args.output} is a file; name a folder (table1.<md|csv|tex> are written into it)",
              file=sys.stderr)
        return 2
    chosen = formats() if args.format == "all" else (args.format,)
    for fmt in chosen:
        text = render(table, fmt)
        note = subset_note(table)
        if note and fmt == "markdown":  # under the table, where a reader of the file sees it
            text += "\n" + note + "\n"
        if args.output:
            out = Path(args.output) / f"table1.{SUFFIX[fmt]}"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            print(f"wrote {out}", file=sys.stderr)
        else:
            print(text)
    if not args.output and "markdown" in chosen:
        print(LEGEND)
    print(f"{len(files)} run records, {len(table.settings)} settings", file=sys.stderr)
    return 0
