"""The paper's analyses on checkpoints and runs; each tool writes <output>/<tool>.json and <output>/<tool>.png.

  python scripts/analyze.py magnitudes    CHECKPOINT_OR_RUN [...] [--tokens F | --text F]   # figure 2a (overlaid)
  python scripts/analyze.py magnitudes    --fresh configs/tiny-cpu.yaml --model-type post   # at initialisation
  python scripts/analyze.py grad-norms    RUN [RUN ...]                                # figure 5
  python scripts/analyze.py stream-ratios CHECKPOINT_OR_RUN                            # figure 6
  python scripts/analyze.py lens          CHECKPOINT_OR_RUN [--tokens F | --text F]   # section 5.2
  python scripts/analyze.py depth         CHECKPOINT_OR_RUN [--tokens F | --text F]   # layer pruning
  python scripts/analyze.py loss-curves   RUN [RUN ...] [--smooth 20]                  # figures 2b, 4, 8

Evaluation tokens: --tokens (OLMo token files), --text (.txt/.jsonl[.gz]; its held-out documents), or by default
the run's own validation split. A tool that does not apply to a model says so and writes {"applies": false}.
Figures: --format png|pdf|svg; colours, names and markers are the same in every figure
(siamesenorm/analysis/figures.py).
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


MODEL_TOOLS = ("magnitudes", "stream-ratios", "lens", "depth")
RUN_TOOLS = ("grad-norms", "loss-curves")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tool", choices=MODEL_TOOLS + RUN_TOOLS, help="the analysis to run (see above)")
    parser.add_argument("paths", nargs="*", help="a checkpoint or run folder (model tools; magnitudes takes several "
                        "and overlays them), run folders (curve tools)")
    parser.add_argument("--output", default="analysis", help="folder for <tool>.json and the figure")
    parser.add_argument("--format", choices=("png", "pdf", "svg"), default="png", help="the figure's file format")
    parser.add_argument("--tokens", help="OLMo token file(s) to evaluate on (glob allowed)")
    parser.add_argument("--text", help=".txt / .jsonl / .jsonl.gz documents to evaluate on (held-out ones)")
    parser.add_argument("--max-sequences", type=int, default=32, help="evaluation sequences to use (default 32)")
    parser.add_argument("--fresh", metavar="CONFIG", help="analyse a freshly initialised model of this recipe")
    parser.add_argument("--model-type", default="pre", help="with --fresh: the MODEL_TYPE to build")
    parser.add_argument("--max-k", type=int, default=None, help="depth: remove up to the last k layers")
    parser.add_argument("--smooth", type=int, default=1, help="curves: moving-average window in logged steps")
    args = parser.parse_args(argv)
    from siamesenorm.analysis import probes as analysis
    from siamesenorm.run.checkpoints import UnsafeCheckpoint


    out = Path(args.output)
    try:
        if args.tool in RUN_TOOLS:
            if not args.paths:
                parser.error(f"{args.tool} needs one or more run folders")
            result = (analysis.grad_norm_curves if args.tool == "grad-norms" else analysis.loss_curves)(args.paths)
        elif args.tool == "magnitudes" and len(args.paths) > 1:
            result = {"models": {}}
            for path in args.paths:  # several models overlaid, as the paper's figure 2a
                model, cfg = analysis.load_model(path)
                batch = analysis.eval_tokens(cfg, args.tokens, args.text, args.max_sequences)
                label = analysis.run_label(path)
                result["models"][label if label not in result["models"] else f"{label} ({path})"] = {
                    **analysis.hidden_magnitudes(model, batch), "eval_sequences": int(batch.shape[0])}
        else:
            if args.fresh:
                model, cfg = analysis.fresh_model(args.fresh, args.model_type)
            elif len(args.paths) == 1:
                model, cfg = analysis.load_model(args.paths[0])
            else:
                parser.error(f"{args.tool} needs one checkpoint or run folder (or --fresh CONFIG)")
            if args.tool == "stream-ratios":
                result = analysis.stream_ratios(model)
            else:
                batch = analysis.eval_tokens(cfg, args.tokens, args.text, args.max_sequences)
                if args.tool == "magnitudes":
                    result = analysis.hidden_magnitudes(model, batch)
                elif args.tool == "lens":
                    result = analysis.fusion_and_lens(model, batch)
                else:
                    result = analysis.depth_probe(model, batch, args.max_k)
                result["eval_sequences"] = int(batch.shape[0])
    except analysis.NotApplicable as e:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.tool}.json").write_text(json.dumps({"applies": False, "reason": str(e)}, indent=2) + "\n")
        print(f"{args.tool}: does not apply: {e}")
        return 0
    except (FileNotFoundError, ValueError, UnsafeCheckpoint) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tool}.json").write_text(json.dumps({"applies": True, **result}, indent=2) + "\n")
    figure = analysis.plot(args.tool, result, out / f"{args.tool}.{args.format}", smooth=args.smooth)
    print(f"wrote {out / (args.tool + '.json')} and {figure}")
    return 0
