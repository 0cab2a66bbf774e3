"""The registry is derived from the variant files: a new file is a new MODEL_TYPE, with its knobs, names and colour."""

import importlib
import sys
import textwrap

import pytest

import siamesenorm.variants as variants
from siamesenorm.config import KNOB_OWNERS, LEGACY_KNOBS, MODEL_TYPES, SiameseModelConfig
from siamesenorm.figures import COLOURS
from siamesenorm.registry import BLOCKS
from siamesenorm.tables import METHOD_NAMES


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
        from siamesenorm.variants._block import TopologyBlock
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
])
def test_a_broken_variant_file_is_named(monkeypatch, tmp_path, name, source, message):
    with pytest.raises(ImportError, match=message):
        _discover_with(monkeypatch, tmp_path, source, name)


def test_knob_checks_are_declared_on_every_knob_and_fail_in_one_sentence():
    """Every str knob declares its choices and every numeric knob its range (siamesenorm/variants/spec.py: Knob);
    validate_model_config runs them for the knob's variants, each failure one sentence naming the field."""
    from siamesenorm.config import validate_model_config
    from siamesenorm.variants import KNOB_OWNERS, KNOBS
    from olmo.exceptions import OLMoConfigurationError

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
