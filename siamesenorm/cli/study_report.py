"""The CPU study's table, figures and per-claim numbers from the sweep's results (siamesenorm/studies/lr_grid.py).

  python scripts/study_report.py studies/cpu-lr-grid/results --output studies/cpu-lr-grid/figures
  (writes study-*.png, report.json and table.md into --output; studies/cpu-lr-grid/README.md quotes them)
  python scripts/study_report.py studies/cpu-depth-dynamics/results --v2 --earlier studies/cpu-lr-grid/results --output studies/cpu-depth-dynamics/figures
  (the second part, the paper's second version: v2-*.png and report.json; siamesenorm/studies/depth_and_dynamics.py)
  python scripts/study_report.py studies/cpu-2026-field/results --standard --with studies/cpu-lr-grid/results studies/cpu-depth-dynamics/results --output studies/cpu-2026-field/figures
  (the reporting standard over the folders together: best rate, seeds, Welch's t against Pre-Norm, Holm's
  correction, learning-rate tolerance; standard.json and standard.md; siamesenorm/studies/standard.py)
  ... --standard --against hybrid_pre ...
  (the same standard with SiameseNorm in Pre-Norm's place: every other configuration, Pre-Norm included, against
  hybrid_pre at its shape; standard-vs-hybrid_pre.json and .md)
  ... --standard [--against hybrid_pre] --page studies/cpu-2026-field/README.md
  (also writes the verdicts by shape into the page, between its two markers: standard.page_markers; --tag pooled
  with more folders fills the page's tables marked "(pooled)")
"""

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="the sweep's results folder (one sub-folder per cell)")
    parser.add_argument("--output", required=True, help="folder for the figures, report.json and table.md")
    parser.add_argument("--format", choices=["png", "pdf", "svg"], default="png", help="figure file format")
    parser.add_argument("--smooth", type=int, default=20, help="moving-average window of the curves, in steps")
    parser.add_argument("--v2", action="store_true", help="the second part's report (studies/cpu-depth-dynamics/sweep.yaml)")
    parser.add_argument("--earlier", help="with --v2: the first study's results, for the seed groups it completes")
    parser.add_argument("--standard", action="store_true",
                        help="judge every configuration against Pre-Norm by the reporting standard "
                             "(siamesenorm/studies/standard.py): standard.json and standard.md")
    parser.add_argument("--with", dest="also", nargs="*", default=[], metavar="RESULTS",
                        help="with --standard: more results folders, pooled with the first")
    parser.add_argument("--against", default="pre", metavar="MODEL_TYPE",
                        help="with --standard: the MODEL_TYPE every configuration is compared with (default pre)")
    parser.add_argument("--page", metavar="README",
                        help="with --standard: rewrite the verdicts-by-shape table between the page's markers "
                             "(siamesenorm/studies/standard.py: page_markers)")
    parser.add_argument("--tag", default="",
                        help="with --page: which of the page's marked tables these folders fill (markers named with "
                             "the tag, e.g. pooled), so one page can show the tables of several sets of folders")
    args = parser.parse_args(argv)
    if (args.page or args.tag) and not args.standard or args.tag and not args.page:
        print("error: --page goes with --standard, and --tag with --page (the page's tables are the standard's); add "
              "the missing flag", file=sys.stderr)
        return 2
    for folder in [args.results] + args.also:
        if not Path(folder).is_dir():
            print(f"error: {folder} is not a folder; run scripts/sweep.py first.", file=sys.stderr)
            return 2
    try:
        return _report(args)
    except (ValueError, FileNotFoundError) as e:  # a record, metrics line or folder that is not a sweep's
        print(f"error: {e}", file=sys.stderr)
        return 2


def _report(args) -> int:
    out = Path(args.output)
    if args.standard:
        from siamesenorm.studies import standard

        summary = standard.standard_report([args.results] + args.also, reference=args.against)
        ran = sorted({standard.method_of(key) for key in summary["configurations"]})
        if args.against not in ran:
            raise ValueError(f"--against {args.against}: no cell of that MODEL_TYPE in the results; name one the "
                             f"sweep ran ({', '.join(ran)})")
        stem = "standard" if args.against == "pre" else f"standard-vs-{args.against}"
        page = None
        if args.page:  # checked before anything is written
            if not Path(args.page).is_file():
                raise ValueError(f"--page {args.page}: no such file; name the study's README.md")
            page = standard.update_page(Path(args.page).read_text(), summary, args.page, args.tag)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out / f"{stem}.md").write_text(standard.to_markdown(summary))
        if args.against == "pre":
            print(f"wrote {standard.figure(summary, out, args.format)}")
        if page is not None:
            tmp = Path(args.page).with_name(Path(args.page).name + ".tmp")
            tmp.write_text(page)
            tmp.replace(args.page)
            print(f"wrote the verdicts by shape into {args.page}")
        judged = sum(not r["verdict"].startswith("not judged") for r in summary["comparisons"])
        print(f"wrote {out / (stem + '.json')} and {out / (stem + '.md')} ({len(summary['comparisons'])} "
              f"comparisons with {standard.display_name(args.against)}, {judged} judged)")
        return 0
    if args.v2:
        from siamesenorm.studies import depth_and_dynamics

        summary = depth_and_dynamics.report(args.results, args.earlier)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(summary, indent=1) + "\n")
        for path in depth_and_dynamics.figures(summary, out, args.format):
            print(f"wrote {path}")
        print(f"wrote {out / 'report.json'} ({summary['cells']} cells)")
        return 0
    from siamesenorm.studies.lr_grid import figures, report

    summary = report(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "table"}, indent=1) + "\n")
    (out / "table.md").write_text(summary["table"])
    for path in figures(args.results, out, args.format, args.smooth):
        print(f"wrote {path}")
    print(f"wrote {out / 'report.json'} and {out / 'table.md'} ({summary['cells']} cells)")
    return 0
