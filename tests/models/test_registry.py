"""The registry is derived from the variant files: a new file is a new MODEL_TYPE, with its knobs, names and colour."""

import importlib
import sys
import textwrap

import pytest

import siamesenorm.variants as variants
from siamesenorm.analysis.figures import COLOURS
from siamesenorm.analysis.tables import METHOD_NAMES
from siamesenorm.models.config import KNOB_OWNERS, LEGACY_KNOBS, MODEL_TYPES, SiameseModelConfig
from siamesenorm.models.registry import BLOCKS


def test_every_view_of_the_variants_comes_from_the_files():
    files = sorted(p.stem for p in __import__("pathlib").Path(variants.__file__).parent.glob("*.py")
                   if not p.stem.startswith("_") and p.stem != "spec")
    assert sorted(MODEL_TYPES) == files
    assert list(BLOCKS) == list(MODEL_TYPES) and set(METHOD_NAMES) == set(COLOURS) == set(files)
    assert MODEL_TYPES[:6] == ("pre", "post", "hybrid", "hc", "post_pre", "hybrid_pre")  # the paper's seeds first
    assert KNOB_OWNERS["siamese_depth_scaling"] == ("post_pre", "hybrid_pre")
    assert LEGACY_KNOBS["siamese_depth_scaling_form"] == "inv_sqrt_layer"
    assert SiameseModelConfig().hc_expansion_rate == 2 and SiameseModelConfig().mhc_expansion_rate == 4


def _discover_with(monkeypatch, tmp_path, source: str, name: str):
    """variants._discover() with one more file, ``name``.py, in the package's search path."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.setattr(variants, "__path__", [*variants.__path__, str(tmp_path)])
    importlib.invalidate_caches()
    try:
        return variants._discover()
    finally:
        sys.modules.pop(f"siamesenorm.variants.{name}", None)


def test_a_new_file_is_a_new_variant(monkeypatch, tmp_path):
    found = _discover_with(monkeypatch, tmp_path, """
        from siamesenorm.variants._base import TopologyBlock
        from siamesenorm.variants.spec import Knob, Variant

        class ToyBlock(TopologyBlock):
            pass

        VARIANT = Variant(name="toy", block=ToyBlock, knobs=(Knob("toy_scale", 0.5, doc="a toy knob"),))
    """, "toy")  # no order, table row, display name or colour: nothing about the other files to know
    assert list(found)[-1] == "toy" and found["toy"].block.__name__ == "ToyBlock"
    assert found["toy"].knobs[0].default == 0.5 and len(found) == len(MODEL_TYPES) + 1
    assert found["toy"].display_name == "toy"
    assert found["toy"].colour and found["toy"].colour not in {v.colour for k, v in found.items() if k != "toy"}


@pytest.mark.parametrize("name,source,message", [
    ("toy_none", "X = 1\n", "toy_none.py must define VARIANT"),
    ("toy_order", "from siamesenorm.variants.spec import Variant\n"
     "VARIANT = Variant(name='toy_order', display_name='T', colour='k', block=None, order=5)\n",
     "two VARIANTs share order 5"),
    ("toy_moved", "from siamesenorm.config import knob\n",
     "toy_moved.py imports siamesenorm.config, which is now siamesenorm.models.config .*change that import"),
])
def test_a_broken_variant_file_is_named(monkeypatch, tmp_path, name, source, message):
    with pytest.raises(ImportError, match=message):
        _discover_with(monkeypatch, tmp_path, source, name)


def test_knob_checks_are_declared_on_every_knob_and_fail_in_one_sentence():
    """Every str knob declares its choices and every numeric knob its range (siamesenorm/variants/spec.py: Knob);
    validate_model_config runs them for the knob's variants, each failure one sentence naming the field."""
    from olmo.exceptions import OLMoConfigurationError

    from siamesenorm.models.config import validate_model_config
    from siamesenorm.variants import KNOB_OWNERS, KNOBS

    for name, declared in KNOBS.items():
        if isinstance(declared.default, bool):
            continue  # OmegaConf's bool field type checks these
        if isinstance(declared.default, str):
            assert declared.choices and declared.default in declared.choices, name
            bad = "no-such-" + name
        else:
            assert declared.minimum is not None and declared.check(declared.default) is None, name
            bad = declared.minimum - 1
        assert declared.check(bad).startswith(f"model.{name} ") and declared.check(bad).count(".") >= 1
        with pytest.raises(OLMoConfigurationError, match=f"^model.{name} ") as caught:
            validate_model_config(SiameseModelConfig(**{name: bad}), KNOB_OWNERS[name][0])
        assert "\n" not in str(caught.value)
    whole = KNOBS["hc_expansion_rate"]
    assert whole.check(2.5) and whole.check(True) and whole.check(3) is None  # a whole number, not a bool


THROWAWAY = '''"""Pre-Norm with a learned scale on each residual branch (a throwaway variant, kept outside the package):

    X = X + a_attn * Attn(LN(X)),    X = X + a_ff * MLP(LN(X)),    a initialised to toy_branch_scale_init
"""

import torch
import torch.nn as nn

from ._base import TopologyBlock
from .spec import Knob, Variant


class ScaledBranchBlock(TopologyBlock):
    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.branch_scale = nn.Parameter(torch.empty(2, device=config.init_device))
        self.reset_parameters()

    def reset_parameters(self):
        super().reset_parameters()
        if hasattr(self, "branch_scale"):
            nn.init.constant_(self.branch_scale, self.config.toy_branch_scale_init)

    def update(self, x, attention):
        x = x + self.branch_scale[0] * attention(self.norm(self.attn_norm, x))
        return x + self.branch_scale[1] * self.mlp(self.norm(self.ff_norm, x))


VARIANT = Variant(name="toy_scaled", block=ScaledBranchBlock,
                  knobs=(Knob("toy_branch_scale_init", 0.5, minimum=0.0, doc="a, at initialisation"),))
'''


@pytest.mark.slow
def test_a_variant_in_one_file_outside_the_package_trains_and_reaches_tables_and_figures(tmp_path):
    """The proof that a variant is one file: a throwaway one, written to a folder of its own and named by
    SIAMESENORM_VARIANTS, with nothing else edited: it is a MODEL_TYPE with its knob, trains through OLMo's
    Trainer (its coefficient moves), has a run record, a row in the tables and a curve in the figures."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_training import SMALL, TINY, learnable_tokens

    root = Path(__file__).resolve().parents[2]
    folder = tmp_path / "my-variants"
    folder.mkdir()
    (folder / "toy_scaled.py").write_text(THROWAWAY)
    data = learnable_tokens(tmp_path / "data" / "train.npy")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(SIAMESENORM_VARIANTS=str(folder), MODEL_TYPE="toy_scaled", OMP_NUM_THREADS="1")
    run = tmp_path / "run"

    def call(*args, timeout=300):
        proc = subprocess.run([sys.executable, *map(str, args)], cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return proc.stdout

    call(root / "scripts" / "train.py", TINY, *SMALL, f"--data.paths=[{data}]", "--max_duration=6",
         "--save_interval_unsharded=6", "--model.toy_branch_scale_init=0.25", f"--save_folder={run}")
    record = json.loads((run / "run.json").read_text())
    assert record["model_type"] == "toy_scaled" and record["status"] == "finished"
    probe = ("import sys, torch; from siamesenorm.run.checkpoints import load_model_state; "
             "s = load_model_state(sys.argv[1]); print(s['transformer.blocks.0.branch_scale'].tolist())")
    scale = json.loads(call("-c", probe, run / "step6-unsharded"))
    assert scale != [0.25, 0.25] and all(abs(v - 0.25) < 0.2 for v in scale)  # trained from its knob's value
    table = call(root / "scripts" / "make_tables.py", run)
    assert "| toy_scaled (toy_branch_scale_init=0.25) |" in table  # its row, with its changed knob
    out = tmp_path / "figures"
    call(root / "scripts" / "analyze.py", "loss-curves", run, "--output", out)
    assert (out / "loss-curves.png").stat().st_size > 0
    assert "toy_scaled" in (out / "loss-curves.json").read_text()
    env["MODEL_TYPE"] = "pre"  # the extra folder changes nothing for the package's own variants
    assert call("-c", "from siamesenorm.models.config import MODEL_TYPES; print(MODEL_TYPES[-1], len(MODEL_TYPES))"
                ).split()[0] == "toy_scaled"


@pytest.mark.slow
def test_a_variant_folder_that_is_missing_or_shadows_a_variant_is_one_line(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "pre.py").write_text("VARIANT = None\n")
    for folder, message in ((tmp_path / "absent", "is not a folder"), (tmp_path, "has the name of a variant")):
        env = dict(os.environ, SIAMESENORM_VARIANTS=str(folder))
        proc = subprocess.run([sys.executable, "-c", "import siamesenorm.variants"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode != 0 and message in proc.stderr.strip().splitlines()[-1]
