"""Check that two source trees build the same models, bit for bit (a refactor's check).

Run ``dump`` once per tree (with that tree first on PYTHONPATH), then ``compare``:

  git worktree add /tmp/old <commit>
  PYTHONPATH=/tmp/old python /tmp/old/scripts/compare_models.py dump /tmp/old.pt   (each tree's own script)
  PYTHONPATH=.        python scripts/compare_models.py dump /tmp/new.pt
  python scripts/compare_models.py compare /tmp/old.pt /tmp/new.pt

``dump`` builds every MODEL_TYPE (and five knob variants) on the tests' tiny config with seed 0, perturbs the
weights, runs one forward and backward, and saves state-dict names and values, logits and gradients. ``compare``
says, per case, whether all four are ``torch.equal``; it exits 1 if any case differs.
"""

import argparse
from pathlib import Path

KNOB_CASES = [("post_pre", {"post_pre_x_norm_position": "after_addition"}),
              ("post", {"post_norm_position": "before_sublayer"}), ("hybrid_pre", {"siamese_normalized_input": False}),
              ("post_pre", {"siamese_normalized_input": False}), ("hc", {"hc_expansion_rate": 3})]


def dump(out: str) -> None:
    import importlib.util

    import torch  # here, not at the top: --help stays fast

    # the tests' tiny config (tests/conftest.py), loaded by path: this source tree's, the one being compared
    conftest_path = Path(__file__).resolve().parents[2] / "tests" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_tests_conftest", conftest_path)
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    tiny_config = conftest.tiny_config

    from siamesenorm import MODEL_TYPES, build_model

    result = {}
    for model_type, knobs in [(mt, {}) for mt in MODEL_TYPES] + KNOB_CASES:
        torch.manual_seed(0)
        model = build_model(tiny_config(**knobs), model_type)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        logits = model(torch.randint(0, 100, (2, 16))).logits
        logits.float().pow(2).mean().backward()
        result[f"{model_type}{knobs or ''}"] = {
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "logits": logits.detach(),
            "grads": {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}}
    torch.save(result, out)
    print(f"wrote {len(result)} cases to {out}")


def _same(a: dict, b: dict) -> bool:
    import torch

    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def compare(first: str, second: str) -> int:
    import torch

    a, b = torch.load(first), torch.load(second)
    differ = 0
    for case in a:
        if case not in b:
            print(f"{case}: missing from {second}")
            differ += 1
            continue
        checks = {"names and values": _same(a[case]["state"], b[case]["state"]),
                  "logits": torch.equal(a[case]["logits"], b[case]["logits"]),
                  "gradients": _same(a[case]["grads"], b[case]["grads"])}
        bad = [k for k, ok in checks.items() if not ok]
        differ += bool(bad)
        print(f"{case}: {'identical' if not bad else 'differs in ' + ', '.join(bad)}")
    print(f"{len(a) - differ} of {len(a)} cases identical")
    return 1 if differ else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, help="dump or compare")
    d = sub.add_parser("dump", help="build the models of the tree on PYTHONPATH and save them")
    d.add_argument("out", help="file to write (.pt)")
    c = sub.add_parser("compare", help="compare two dumps")
    c.add_argument("first", help="a dump")
    c.add_argument("second", help="another dump")
    args = parser.parse_args(argv)
    if args.command == "dump":
        dump(args.out)
        return 0
    return compare(args.first, args.second)
