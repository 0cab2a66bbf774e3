"""Hugging Face transformers for every MODEL_TYPE: export a trained run, load it with the Auto classes, generate.

An exported folder holds ``config.json`` (model_type ``siamesenorm_olmo``; the whole OLMo model config under
``olmo``, MODEL_TYPE and its knobs included), ``model.safetensors`` (OLMo's own parameter names under ``model.``),
``generation_config.json``, the run's tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) and its modelling
code (siamesenorm.export.remote: ``auto_map`` in config.json), so it loads two ways:

    # transformers alone (no siamesenorm, no ai2-olmo): the folder's own code, torch only
    model = AutoModelForCausalLM.from_pretrained("exports/my-run", trust_remote_code=True)

    import siamesenorm.export.hf  # with this package: registers siamesenorm_olmo, builds the model through ai2-olmo
    model = AutoModelForCausalLM.from_pretrained("exports/my-run")
    tokenizer = AutoTokenizer.from_pretrained("exports/my-run", trust_remote_code=True)  # it reads config.json

Here the model is OLMo's own ``olmo.model.OLMo`` inside a thin ``PreTrainedModel``: the logits are OLMo's; the
key/value cache is transformers' ``DynamicCache``, converted to OLMo's per-layer (key, value) pairs at each call.

A ``pre`` model is exported by default as a plain ``LlamaForCausalLM`` folder instead (``llama_state_dict``: the
fused q/k/v and SwiGLU projections split, the norm scales as they are), which transformers loads alone; anything
that Llama cannot compute exactly is refused in one line (``llama_refusal``), never exported approximately.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

from siamesenorm.export.check import check_export, read_json_object
from siamesenorm.export.remote import CHECKED_TRANSFORMERS, remote_refusal, write_remote_code
from siamesenorm.export.remote import modeling_siamesenorm as remote_model
from siamesenorm.models.build import build_model
from siamesenorm.models.config import SiameseModelConfig
from siamesenorm.run.checkpoints import checkpoint_folder, load_model
from siamesenorm.run.data import load_tokenizer
from siamesenorm.run.records import variant_knobs

log = logging.getLogger(__name__)

HF_MODEL_TYPE = remote_model.HF_MODEL_TYPE

__all__ = ["HF_MODEL_TYPE", "SiameseOlmoConfig", "SiameseOlmoForCausalLM", "export", "load_for_generation",
           "is_export", "run_tokenizer", "llama_refusal", "llama_config", "llama_state_dict", "write_export"]

#: What an OLMo model must be for transformers' Llama to compute exactly its logits: Pre-Norm blocks with RMSNorm
#: scales, SwiGLU, RoPE, no biases, no QK norm or clipping, no embedding norm, plain logits. field -> what it may be.
_LLAMA_FIELDS = {"layer_norm_type": ("rms",), "layer_norm_with_affine": (True,), "bias_for_layer_norm": (None, False),
                 "include_bias": (False,), "activation_type": ("swiglu",), "rope": (True,), "alibi": (False,),
                 "attention_layer_norm": (False,), "clip_qkv": (None,), "block_type": ("sequential",),
                 "scale_logits": (False,), "embedding_layer_norm": (False,), "norm_after": (False,),
                 "multi_query_attention": (None, False)}


#: transformers' view of an OLMo model config of any MODEL_TYPE (``olmo`` holds every OLMo field): the remote
#: code's class itself (transformers rebuilds a config subclass's __init__, so it is used as it is).
SiameseOlmoConfig = remote_model.SiameseOlmoConfig


def olmo_config(config: SiameseOlmoConfig) -> SiameseModelConfig:
    """The OLMo model config (ours) of a transformers config."""
    model_config = SiameseModelConfig.new(**config.olmo)
    model_config.init_device = "cpu"
    return model_config


class SiameseOlmoForCausalLM(remote_model.SiameseOlmoForCausalLM):
    """An OLMo model of any MODEL_TYPE as a transformers causal LM, built with ai2-olmo (the forward and the cache
    handling are siamesenorm/export/remote/modeling_siamesenorm.py's, the same an export's remote code runs)."""

    config_class = SiameseOlmoConfig

    @classmethod
    def build_inner(cls, config: SiameseOlmoConfig) -> torch.nn.Module:
        model_config = olmo_config(config)
        return build_model(model_config, model_config.model_type, init_params=False)


AutoConfig.register(HF_MODEL_TYPE, SiameseOlmoConfig)
AutoModelForCausalLM.register(SiameseOlmoConfig, SiameseOlmoForCausalLM)


# ---- from a run or checkpoint ------------------------------------------------------------------------------------
def is_export(path: Union[str, Path]) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and read_json_object(config).get("model_type") == HF_MODEL_TYPE


def run_tokenizer(cfg) -> PreTrainedTokenizerFast:
    """The tokenizer a run trained with, as a transformers fast tokenizer (end-of-text token = OLMo's eos)."""
    tok = load_tokenizer(str(cfg.tokenizer.identifier))
    eos = tok.id_to_token(cfg.model.eos_token_id)
    pad = tok.id_to_token(cfg.model.pad_token_id)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad,
                                   model_max_length=cfg.model.max_sequence_length)  # the model's, not 1e30


def from_run(path: Union[str, Path]) -> tuple[SiameseOlmoForCausalLM, PreTrainedTokenizerFast, Path]:
    """(model, tokenizer, checkpoint folder) from a run folder (its latest checkpoint) or a checkpoint folder."""
    folder = checkpoint_folder(path)
    olmo_model, cfg = load_model(folder)
    config = SiameseOlmoConfig(olmo=cfg.model.asdict())
    model = SiameseOlmoForCausalLM(config, model=olmo_model).eval()
    model.generation_config = GenerationConfig(eos_token_id=cfg.model.eos_token_id,
                                               pad_token_id=cfg.model.pad_token_id)
    return model, run_tokenizer(cfg), folder


def load_for_generation(path: Union[str, Path]) -> tuple[SiameseOlmoForCausalLM, PreTrainedTokenizerFast]:
    """(model, tokenizer) from an exported folder, a run folder or a checkpoint folder."""
    if is_export(path) or is_llama_export(Path(path)):
        from transformers import AutoTokenizer

        check_export(path)  # from elsewhere: bounded, and the weights are the model the config states
        return AutoModelForCausalLM.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(str(path))
    model, tokenizer, _ = from_run(path)
    return model, tokenizer


def llama_refusal(olmo: Dict[str, Any]) -> Optional[str]:
    """Why the OLMo model config ``olmo`` (a dict of its fields) cannot be a Llama exactly, or None if it can."""
    variant = olmo.get("model_type") or "pre"
    if variant != "pre":
        return (f"MODEL_TYPE {variant} is not a Llama (only pre is: Pre-Norm blocks); export it with "
                "--format siamesenorm")
    for name, allowed in _LLAMA_FIELDS.items():
        value = getattr(olmo.get(name, allowed[0]), "value", olmo.get(name, allowed[0]))  # enums by their string
        if value not in allowed:
            return (f"model.{name}={value!r} has no exact Llama equivalent (Llama needs {allowed[0]!r}); export it "
                    "with --format siamesenorm")
    return None


def llama_config(olmo: Dict[str, Any], dtype: torch.dtype = torch.float32):
    """transformers' LlamaConfig of the Pre-Norm OLMo model config ``olmo``."""
    from transformers import LlamaConfig

    d, heads = olmo["d_model"], olmo["n_heads"]
    hidden = olmo.get("mlp_hidden_size") or olmo["mlp_ratio"] * d  # SwiGLU's ff_proj width; half of it gates
    return LlamaConfig(vocab_size=olmo.get("embedding_size") or olmo["vocab_size"], hidden_size=d,
                       intermediate_size=hidden // 2, num_hidden_layers=olmo["n_layers"], num_attention_heads=heads,
                       num_key_value_heads=olmo.get("n_kv_heads") or heads, hidden_act="silu",
                       max_position_embeddings=olmo["max_sequence_length"], rms_norm_eps=olmo["layer_norm_eps"],
                       rope_theta=float(olmo.get("rope_theta", 10000)), attention_bias=False, mlp_bias=False,
                       tie_word_embeddings=bool(olmo.get("weight_tying")), eos_token_id=olmo.get("eos_token_id"),
                       pad_token_id=olmo.get("pad_token_id"), bos_token_id=None, torch_dtype=dtype)


def llama_state_dict(olmo_state: Dict[str, torch.Tensor], olmo: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """OLMo's Pre-Norm parameters under Llama's names: att_proj split into q/k/v, ff_proj into up (its first half,
    OLMo's SwiGLU multiplies it) and gate (its second half, through SiLU), the norm scales as they are."""
    d, heads = olmo["d_model"], olmo["n_heads"]
    kv = (olmo.get("n_kv_heads") or heads) * (d // heads)
    out = {"model.embed_tokens.weight": olmo_state["transformer.wte.weight"],
           "model.norm.weight": olmo_state["transformer.ln_f.weight"]}
    for i in range(olmo["n_layers"]):
        b, L = f"transformer.blocks.{i}.", f"model.layers.{i}."
        q, k, v = olmo_state[b + "att_proj.weight"].split((d, kv, kv), dim=0)
        up, gate = olmo_state[b + "ff_proj.weight"].chunk(2, dim=0)
        out.update({L + "self_attn.q_proj.weight": q, L + "self_attn.k_proj.weight": k,
                    L + "self_attn.v_proj.weight": v, L + "self_attn.o_proj.weight": olmo_state[b + "attn_out.weight"],
                    L + "mlp.up_proj.weight": up, L + "mlp.gate_proj.weight": gate,
                    L + "mlp.down_proj.weight": olmo_state[b + "ff_out.weight"],
                    L + "input_layernorm.weight": olmo_state[b + "attn_norm.weight"],
                    L + "post_attention_layernorm.weight": olmo_state[b + "ff_norm.weight"]})
    if not olmo.get("weight_tying"):
        out["lm_head.weight"] = olmo_state["transformer.ff_out.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def is_llama_export(path: Path) -> bool:
    config = path / "config.json"
    return config.is_file() and read_json_object(config).get("model_type") == "llama" and \
        (path / "README.md").is_file() and "siamesenorm" in (path / "README.md").read_text()


def export(path: Union[str, Path], out: Union[str, Path], overwrite: bool = False,
           dtype: Optional[torch.dtype] = None, format: str = "auto") -> Path:
    """Write a transformers folder for the run or checkpoint at ``path``; returns the checkpoint it came from.
    ``format``: ``siamesenorm`` (any MODEL_TYPE, with its modelling code: transformers alone loads it with
    ``trust_remote_code=True``), ``llama`` (a plain ``LlamaForCausalLM`` folder: pre only, refused in one line
    otherwise) or ``auto`` (llama when exact, else siamesenorm). An existing non-empty ``out`` is refused unless ``overwrite``."""
    _check_arguments(Path(out), overwrite, format)  # before the (slow) load
    model, tokenizer, folder = from_run(path)
    write_export(model, tokenizer, folder, out, dtype=dtype, format=format, overwrite=overwrite)
    return folder


def _check_arguments(out: Path, overwrite: bool, format: str) -> None:
    if format not in ("auto", "siamesenorm", "llama"):
        raise ValueError(f"format {format!r}: use auto, siamesenorm or llama")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it, or another folder.")
        if not (is_export(out) or is_llama_export(out)):
            raise FileExistsError(f"{out} is not an earlier export (no siamesenorm config.json); refusing to "
                                  "delete it.")


def write_export(model: SiameseOlmoForCausalLM, tokenizer: Optional[PreTrainedTokenizerFast], source: Path,
                 out: Union[str, Path], dtype: Optional[torch.dtype] = None, format: str = "auto",
                 overwrite: bool = False) -> str:
    """Write the transformers folder ``out`` for ``model`` (an earlier export there is replaced with
    ``overwrite``; anything else is refused); returns the format written
    (``llama`` or ``siamesenorm``). A siamesenorm folder carries its modelling code (siamesenorm.export.remote) and the
    ``auto_map`` naming it, unless an option has none (``remote_refusal``; the card says which)."""
    out = Path(out)
    _check_arguments(out, overwrite, format)
    source_config = model.config
    refusal = llama_refusal(source_config.olmo)
    if format == "llama" and refusal:
        raise ValueError(refusal)
    as_llama = format == "llama" or (format == "auto" and refusal is None)
    if out.exists():
        shutil.rmtree(out)
    if as_llama:
        from transformers import LlamaForCausalLM

        olmo = model.config.olmo
        config = llama_config(olmo, dtype or torch.float32)
        llama = LlamaForCausalLM(config)
        missing, unexpected = llama.load_state_dict(llama_state_dict(model.model.state_dict(), olmo), strict=False)
        missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(f"Llama conversion left keys unmatched: missing {missing}, unexpected {unexpected}")
        llama.generation_config = GenerationConfig(eos_token_id=olmo.get("eos_token_id"),
                                                   pad_token_id=olmo.get("pad_token_id"))
        model = llama.eval()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    no_remote = None if as_llama else remote_refusal(source_config.olmo)
    if not as_llama and no_remote is None:
        config_file = out / "config.json"
        config = json.loads(config_file.read_text())
        config["auto_map"] = write_remote_code(out, source_config.variant)
        config["siamesenorm_checked_transformers"] = list(CHECKED_TRANSFORMERS)
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    card = _llama_card(source_config, source) if as_llama else _model_card(source_config, source, no_remote)
    (out / "README.md").write_text(card)
    _readable_as_umask_allows(out)
    return "llama" if as_llama else "siamesenorm"


def _readable_as_umask_allows(folder: Path) -> None:
    """Every file of an export with the mode a plain ``open()`` would give it (0666 less the umask): safetensors
    writes model.safetensors 0600, which others on a shared cluster cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _llama_card(config: SiameseOlmoConfig, source: Path) -> str:
    return f"""# OLMo model, MODEL_TYPE `pre` ({config.num_hidden_layers} layers, d_model {config.hidden_size}), as Llama

Exported from `{source}` by siamesenorm's `scripts/export_hf.py --format llama`. A Pre-Norm OLMo (RMSNorm with
scales, SwiGLU, RoPE, no biases) is exactly transformers' `LlamaForCausalLM`: the fused attention projection split
into q/k/v, the fused MLP input into up (first half) and gate (second half), the norm scales as they were. No
remote code; it loads with transformers alone (and in any stack that serves Llama):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
```
"""


def _model_card(config: SiameseOlmoConfig, source: Path, no_remote: Optional[str] = None) -> str:
    knobs = variant_knobs(olmo_config(config), config.variant)
    knob_lines = "\n".join(f"- `{k}`: `{v}`" for k, v in sorted(knobs.items())) or "- (none)"
    if no_remote is None:
        loading = f"""It carries its own modelling code (`modeling_siamesenorm.py`, `olmo_lite.py` and siamesenorm's files for
this MODEL_TYPE: the update rules that trained it, imports of torch and transformers only), so transformers
alone loads it, without siamesenorm or ai2-olmo:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("path/to/this/folder", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder", trust_remote_code=True)  # it reads config.json
```

Checked with transformers {' and '.join(CHECKED_TRANSFORMERS)} (greedy generation with the KV cache equal to
generation without it); the cache is taken as `cache` (5.24 on) or `past_key_values` (before), and an argument
the model cannot honour is refused, never dropped.

With the siamesenorm package installed, `import siamesenorm.export.hf` first loads it through ai2-olmo instead, without
remote code."""
    else:
        loading = f"""It carries no modelling code: {no_remote}. Load it with the siamesenorm package installed (it brings
ai2-olmo):

```python
import siamesenorm.export.hf  # registers the model type with transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
```"""
    return f"""# OLMo model, MODEL_TYPE `{config.variant}` ({config.num_hidden_layers} layers, d_model {config.hidden_size})

Exported from `{source}` by siamesenorm's `scripts/export_hf.py`.

Variant knobs (docs/fidelity.md in siamesenorm explains each):
{knob_lines}

{loading}
"""
