"""Hugging Face transformers for every MODEL_TYPE: export a trained run, load it with the Auto classes, generate.

An exported folder holds ``config.json`` (model_type ``siamesenorm_olmo``; the whole OLMo model config under
``olmo``, MODEL_TYPE and its knobs included), ``model.safetensors`` (OLMo's own parameter names under ``model.``),
``generation_config.json`` and the run's tokenizer (``tokenizer.json`` + ``tokenizer_config.json``). To load it,
the model side needs this package installed (it builds the block through ai2-olmo) and imported once:

    import siamesenorm.hf  # registers siamesenorm_olmo with AutoConfig and AutoModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exports/my-run")
    tokenizer = AutoTokenizer.from_pretrained("exports/my-run")   # plain transformers; no import needed

The model is OLMo's own ``olmo.model.OLMo`` inside a thin ``PreTrainedModel``: the logits are OLMo's; the key/value
cache is transformers' ``DynamicCache``, converted to OLMo's per-layer (key, value) pairs at each call.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .config import SiameseModelConfig
from .model import build_model

log = logging.getLogger(__name__)

HF_MODEL_TYPE = "siamesenorm_olmo"

__all__ = ["HF_MODEL_TYPE", "SiameseOlmoConfig", "SiameseOlmoForCausalLM", "export", "load_for_generation",
           "is_export", "run_tokenizer"]


class SiameseOlmoConfig(PretrainedConfig):
    """transformers' view of an OLMo model config of any MODEL_TYPE; ``olmo`` holds every OLMo field."""

    model_type = HF_MODEL_TYPE

    def __init__(self, olmo: Optional[Dict[str, Any]] = None, **kwargs):
        self.olmo = dict(olmo or {})
        o = self.olmo
        self.variant = o.get("model_type") or "pre"
        self.num_hidden_layers = o.get("n_layers")
        self.hidden_size = o.get("d_model")
        self.num_attention_heads = o.get("n_heads")
        self.max_position_embeddings = o.get("max_sequence_length")
        kwargs.setdefault("vocab_size", o.get("embedding_size") or o.get("vocab_size"))
        kwargs.setdefault("eos_token_id", o.get("eos_token_id"))
        kwargs.setdefault("pad_token_id", o.get("pad_token_id"))
        kwargs["tie_word_embeddings"] = False  # OLMo ties inside its own forward; transformers must not tie again
        super().__init__(**kwargs)

    def olmo_config(self) -> SiameseModelConfig:
        config = SiameseModelConfig.new(**self.olmo)
        config.init_device = "cpu"
        return config


class SiameseOlmoForCausalLM(PreTrainedModel, GenerationMixin):
    """An OLMo model of any MODEL_TYPE as a transformers causal LM (``generate`` with a KV cache included)."""

    config_class = SiameseOlmoConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: SiameseOlmoConfig, model: Optional[torch.nn.Module] = None):
        super().__init__(config)
        olmo_config = config.olmo_config()
        self.model = model if model is not None else build_model(olmo_config, olmo_config.model_type,
                                                                 init_params=False)
        self.post_init()

    def _init_weights(self, module):  # every weight comes from the checkpoint; nothing to initialise
        pass

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[Cache] = None,
        use_cache: Optional[bool] = None,
        labels: Optional[torch.LongTensor] = None,
        return_dict: Optional[bool] = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        past = None
        n_past = 0
        if past_key_values is not None and past_key_values.get_seq_length() > 0:
            past = [(layer.keys, layer.values) for layer in past_key_values.layers]
            n_past = past_key_values.get_seq_length()
        output = self.model(input_ids, attention_mask=attention_mask, past_key_values=past, use_cache=bool(use_cache))
        if use_cache:
            if past_key_values is None:
                past_key_values = DynamicCache()
            for layer, (k, v) in enumerate(output.attn_key_values):  # OLMo returns past + new; the cache adds new
                past_key_values.update(k[:, :, n_past:], v[:, :, n_past:], layer)
        loss = None
        if labels is not None:
            logits = output.logits[:, :-1].float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=output.logits,
                                      past_key_values=past_key_values if use_cache else None)


AutoConfig.register(HF_MODEL_TYPE, SiameseOlmoConfig)
AutoModelForCausalLM.register(SiameseOlmoConfig, SiameseOlmoForCausalLM)


# ---- from a run or checkpoint ------------------------------------------------------------------------------------
def is_export(path: Union[str, Path]) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == HF_MODEL_TYPE


def run_tokenizer(cfg) -> PreTrainedTokenizerFast:
    """The tokenizer a run trained with, as a transformers fast tokenizer (end-of-text token = OLMo's eos)."""
    from .data import load_tokenizer

    tok = load_tokenizer(str(cfg.tokenizer.identifier))
    eos = tok.id_to_token(cfg.model.eos_token_id)
    pad = tok.id_to_token(cfg.model.pad_token_id)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad)


def from_run(path: Union[str, Path]) -> tuple[SiameseOlmoForCausalLM, PreTrainedTokenizerFast, Path]:
    """(model, tokenizer, checkpoint folder) from a run folder (its latest checkpoint) or a checkpoint folder."""
    from .checkpoints import checkpoint_folder, load_model

    folder = checkpoint_folder(path)
    olmo_model, cfg = load_model(folder)
    config = SiameseOlmoConfig(olmo=cfg.model.asdict())
    model = SiameseOlmoForCausalLM(config, model=olmo_model).eval()
    model.generation_config = GenerationConfig(eos_token_id=cfg.model.eos_token_id,
                                               pad_token_id=cfg.model.pad_token_id)
    return model, run_tokenizer(cfg), folder


def load_for_generation(path: Union[str, Path]) -> tuple[SiameseOlmoForCausalLM, PreTrainedTokenizerFast]:
    """(model, tokenizer) from an exported folder, a run folder or a checkpoint folder."""
    if is_export(path):
        from transformers import AutoTokenizer

        return AutoModelForCausalLM.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(str(path))
    model, tokenizer, _ = from_run(path)
    return model, tokenizer


def export(path: Union[str, Path], out: Union[str, Path], overwrite: bool = False,
           dtype: Optional[torch.dtype] = None) -> Path:
    """Write a transformers folder for the run or checkpoint at ``path``; returns the checkpoint it came from.
    An existing non-empty ``out`` is refused unless ``overwrite``."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it, or another folder.")
        if not is_export(out):
            raise FileExistsError(f"{out} is not an earlier export (no siamesenorm config.json); refusing to delete it.")
        shutil.rmtree(out)
    model, tokenizer, folder = from_run(path)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    (out / "README.md").write_text(_model_card(model.config, folder))
    return folder


def _model_card(config: SiameseOlmoConfig, source: Path) -> str:
    from .records import variant_knobs

    knobs = variant_knobs(config.olmo_config(), config.variant)
    knob_lines = "\n".join(f"- `{k}`: `{v}`" for k, v in sorted(knobs.items())) or "- (none)"
    return f"""# OLMo model, MODEL_TYPE `{config.variant}` ({config.num_hidden_layers} layers, d_model {config.hidden_size})

Exported from `{source}` by siamesenorm's `scripts/export_hf.py`.

Variant knobs (docs/fidelity.md in siamesenorm explains each):
{knob_lines}

Load it with transformers; the model needs the siamesenorm package installed (it brings ai2-olmo):

```python
import siamesenorm.hf  # registers the model type with transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
```
"""
