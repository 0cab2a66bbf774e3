"""An export loads with transformers alone (siamesenorm/export/remote): for every MODEL_TYPE and the knobs and OLMo options
that change the forward, ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` in a Python where
siamesenorm and ai2-olmo cannot be imported gives OLMo's logits and OLMo's greedy tokens."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Optional

import pytest
import torch
from conftest import HIDE_SIAMESENORM_AND_OLMO

from siamesenorm.export.hf import SiameseOlmoConfig, SiameseOlmoForCausalLM, write_export
from siamesenorm.export.remote import AUTO_MAP, CHECKED_TRANSFORMERS, check_imports, files_for
from siamesenorm.models.build import build_model
from siamesenorm.models.config import MODEL_TYPES, SiameseModelConfig

PACKAGE = Path(__file__).resolve().parents[2] / "siamesenorm"
IDS = [5, 17, 99, 3, 50, 10, 7, 42]
#: The newest transformers on PyPI when this was written, installed beside the pinned one by scripts/setup_env.sh
#: (pyproject.toml, [tool.siamesenorm] transformers-newest): an export must generate right under both.
NEWEST_TRANSFORMERS = Path(sys.prefix) / "transformers-newest"
RELEASES = [pytest.param(None, id="pinned"), pytest.param(NEWEST_TRANSFORMERS, id="newest", marks=pytest.mark.skipif(
    not (NEWEST_TRANSFORMERS / "transformers").is_dir(),
    reason=f"the newest transformers is not in {NEWEST_TRANSFORMERS} (bash scripts/setup_env.sh puts it there)"))]

# (MODEL_TYPE, overrides): every variant with its defaults, then the knobs and OLMo options that change the forward.
CASES = [(m, {}) for m in MODEL_TYPES] + [
    ("post_pre", {"post_pre_x_norm_position": "after_addition", "siamese_depth_scaling_form": "inv_sqrt_layer"}),
    ("post_pre", {"layer_norm_type": "default", "include_bias": True}),
    ("hybrid_pre", {"siamese_normalized_input": False, "siamese_depth_scaling": False}),
    ("post", {"post_norm_position": "before_sublayer"}),
    ("hc", {"hc_expansion_rate": 3}),
    ("mhc", {"mhc_sinkhorn_order": "rows_first", "mhc_expansion_rate": 2}),
    ("mixln", {"mixln_post_fraction": 0.5}),
    ("hybrid_pre", {"siamese_mixing": "dynamic"}),
    ("post_pre", {"siamese_mixing": "static", "post_pre_x_norm_position": "after_addition"}),
    ("attnres", {"attnres_blocks": 2}),
    ("pre", {"rope": False, "layer_norm_type": "default", "include_bias": True, "activation_type": "gelu",
             "weight_tying": True}),
    ("pre", {"n_kv_heads": 2, "attention_layer_norm": True, "clip_qkv": 0.5, "scale_logits": True,
             "embedding_layer_norm": True}),
    ("pre", {"norm_after": True}),
]

# Runs in a Python where siamesenorm and olmo cannot be imported: transformers alone, the folder's own code.
_LOAD_ALONE = HIDE_SIAMESENORM_AND_OLMO + """
import json, sys
import torch
from transformers import AutoModelForCausalLM
folders, ids, result = json.loads(sys.argv[1]), torch.tensor([json.loads(sys.argv[2])]), {}
try:
    AutoModelForCausalLM.from_pretrained(folders[0])
    refusal = None
except Exception as e:
    refusal = str(e)
for folder in folders:
    model, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits
        greedy = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True, eos_token_id=None,
                                pad_token_id=0)
        uncached = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False, eos_token_id=None,
                                  pad_token_id=0)
    result[folder] = {"logits": logits, "greedy": greedy.tolist(), "uncached": uncached.tolist(),
                      "class": type(model).__module__,
                      "missing": list(info["missing_keys"]), "unexpected": list(info["unexpected_keys"])}
result["hidden"] = [m for m in sys.modules if m.split(".")[0] in ("siamesenorm", "olmo")]
import transformers
result["transformers"] = transformers.__version__
result["refusal"] = refusal
torch.save(result, sys.argv[3])
"""


def tiny_model(model_type: str, **overrides):
    fields = dict(d_model=32, n_heads=4, n_layers=4, max_sequence_length=32, vocab_size=100, embedding_size=128,
                  rope=True, layer_norm_type="rms", activation_type="swiglu", include_bias=False, weight_tying=False,
                  attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0, init_device="cpu",
                  eos_token_id=0, pad_token_id=1, model_type=model_type)
    fields.update(overrides)
    torch.manual_seed(0)
    model = build_model(SiameseModelConfig.new(**fields), model_type).eval()
    with torch.no_grad():  # away from the init, where norm scales of 1 and zero-initialised weights hide mistakes
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def greedy(model, ids: torch.Tensor, n: int) -> list:
    out = ids
    with torch.no_grad():
        for _ in range(n):
            out = torch.cat([out, model(out).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out.tolist()


def load_alone(folders, tmp_path: Path, transformers_folder: Optional[Path] = None) -> dict:
    """Load each export in a Python that has neither siamesenorm nor ai2-olmo: the environment's transformers, or
    the release installed in ``transformers_folder`` (first on the path)."""
    result = tmp_path / "result.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if transformers_folder is not None:
        env["PYTHONPATH"] = str(transformers_folder)
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf-modules")  # a clean cache: no earlier test's copies
    proc = subprocess.run([sys.executable, "-c", _LOAD_ALONE, json.dumps([str(f) for f in folders]), json.dumps(IDS),
                           str(result)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(result)


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
def test_every_model_type_loads_with_transformers_alone_with_olmos_logits(tmp_path, release):
    folders, references = [], []
    for i, (model_type, overrides) in enumerate(CASES):
        model = tiny_model(model_type, **overrides)
        folder = tmp_path / f"export-{i}-{model_type}"
        hf = SiameseOlmoForCausalLM(SiameseOlmoConfig(olmo=model.config.asdict()), model=model)
        assert write_export(hf, None, Path("test"), folder, format="siamesenorm") == "siamesenorm"
        config = json.loads((folder / "config.json").read_text())
        assert config["auto_map"] == AUTO_MAP and config["olmo"]["model_type"] == model_type
        umask = os.umask(0)
        os.umask(umask)
        assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {0o666 & ~umask}  # readable by the group
        with torch.no_grad():
            references.append((model(torch.tensor([IDS])).logits, greedy(model, torch.tensor([IDS]), 6)))
        folders.append(folder)
    got = load_alone(folders, tmp_path, release)
    want = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["siamesenorm"]["transformers-newest"]
    assert (got["transformers"] == want.split("==")[1]) == (release is not None), got["transformers"]
    assert got["hidden"] == []  # neither package was imported in there
    assert got["refusal"] and "trust_remote_code" in got["refusal"]  # without it: the right fix, not "upgrade"
    for (model_type, overrides), folder, (logits, tokens) in zip(CASES, folders, references):
        result = got[str(folder)]
        assert result["class"].startswith("transformers_modules"), (model_type, result["class"])
        assert result["missing"] == [] and result["unexpected"] == [], (model_type, overrides, result)
        assert result["logits"].shape == logits.shape
        diff = (result["logits"] - logits).abs().max().item()
        assert diff <= 1e-6, (model_type, overrides, diff)
        # greedy with the KV cache: equal to ours and to the same model's greedy without the cache
        assert result["greedy"] == tokens == result["uncached"], (model_type, overrides, result, tokens)


def test_the_releases_an_export_names_are_the_ones_tested():
    pins = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    pinned = next(d for d in pins["project"]["dependencies"] if d.startswith("transformers=="))
    newest = pins["tool"]["siamesenorm"]["transformers-newest"]
    assert CHECKED_TRANSFORMERS == (pinned.split("==")[1], newest.split("==")[1])


def test_arguments_the_export_cannot_honour_are_refused_not_dropped():
    from transformers import DynamicCache

    model = tiny_model("hybrid_pre")
    hf = SiameseOlmoForCausalLM(SiameseOlmoConfig(olmo=model.config.asdict()), model=model).eval()
    ids = torch.tensor([IDS])
    with torch.no_grad():
        first = hf(ids[:, :5], use_cache=True)
        cache = first.past_key_values
        assert cache.get_seq_length() == 5
        # the cache under either name gives the same next logits as the whole sequence
        full = hf(ids[:, :6]).logits[:, -1]
        import copy
        for name in ("cache", "past_key_values"):
            step = hf(ids[:, 5:6], use_cache=True, **{name: copy.deepcopy(cache)})
            assert (step.logits[:, -1] - full).abs().max().item() <= 1e-5, name
        with pytest.raises(ValueError, match="not both"):
            hf(ids[:, 5:6], cache=cache, past_key_values=cache)
        with pytest.raises(TypeError, match="does not take inputs_embeds"):
            hf(ids, inputs_embeds=torch.zeros(1, 8, 32))
        with pytest.raises(ValueError, match="position_ids must run on from the cache's length"):
            hf(ids[:, 5:6], cache=copy.deepcopy(cache), position_ids=torch.tensor([[0]]), use_cache=True)
        assert hf(ids[:, 5:6], cache=copy.deepcopy(cache), position_ids=torch.tensor([[5]])).logits.shape == (1, 1, 128)
        assert isinstance(hf(ids[:, :2], use_cache=True).past_key_values, DynamicCache)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_exported_code_is_the_package_code_with_only_import_lines_changed(model_type):
    files = files_for(model_type)
    assert {"modeling_siamesenorm.py", "olmo_lite.py", "variant_table.py", f"{model_type}.py"} <= set(files)
    for name, text in files.items():
        if name == "variant_table.py":
            continue
        source = (PACKAGE / "export" / "remote" / name if name in ("olmo_lite.py", "modeling_siamesenorm.py") else
                  PACKAGE / "nn" / name if name in ("topologies.py", "fused.py") else PACKAGE / "variants" / name)
        original = source.read_text().splitlines()
        copied = text.splitlines()
        if copied[0].startswith("# Written by siamesenorm's export"):
            copied = copied[1:]
        assert len(copied) == len(original), name
        changed = [(a, b) for a, b in zip(original, copied) if a != b]
        assert all(a.lstrip().startswith("from ") and b.lstrip().startswith("from .") for a, b in changed), changed
        assert "olmo." not in "\n".join(b for _, b in changed)
    for bad in ("import olmo\n", "from olmo.model import OLMo\n", "from ..nn import x\n", "from . import spec\n",
                "import siamesenorm\n"):
        with pytest.raises(RuntimeError):
            check_imports("bad.py", bad)


def test_an_option_without_modelling_code_exports_without_auto_map_and_says_why(tmp_path):
    model = tiny_model("post_pre", rope=False, alibi=True)
    hf = SiameseOlmoForCausalLM(SiameseOlmoConfig(olmo=model.config.asdict()), model=model)
    folder = tmp_path / "alibi"
    write_export(hf, None, Path("test"), folder)
    assert "auto_map" not in json.loads((folder / "config.json").read_text())
    assert not (folder / "modeling_siamesenorm.py").exists()
    assert "model.alibi=True" in (folder / "README.md").read_text()
