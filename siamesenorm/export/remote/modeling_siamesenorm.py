"""transformers' view of an OLMo model of any MODEL_TYPE: the config and the causal LM (``generate`` with a KV cache).

Two homes, one code:
- inside the package, siamesenorm/export/hf.py subclasses both classes and builds the model with ai2-olmo
  (``build_model``): loading an export after ``import siamesenorm.export.hf`` needs no remote code;
- in an exported folder this file is the remote code ``config.json``'s ``auto_map`` names: ``build_inner`` builds
  the model from the folder's own copies of the variant files over ``olmo_lite`` (torch alone), so
  ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` works where neither siamesenorm nor
  ai2-olmo is installed.
This file imports only torch and transformers at the top; the folder-only imports sit in ``build_inner``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

HF_MODEL_TYPE = "siamesenorm_olmo"
#: The output's cache field: ``cache`` from transformers 5.24, ``past_key_values`` before.
_CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"

__all__ = ["HF_MODEL_TYPE", "SiameseOlmoConfig", "SiameseOlmoForCausalLM"]


class SiameseOlmoConfig(PretrainedConfig):
    """An OLMo model config of any MODEL_TYPE; ``olmo`` holds every OLMo field (MODEL_TYPE and its knobs too)."""

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


class SiameseOlmoForCausalLM(PreTrainedModel, GenerationMixin):
    """An OLMo model of any MODEL_TYPE as a transformers causal LM; ``self.model`` is the OLMo model (OLMo's
    parameter names under ``model.``)."""

    config_class = SiameseOlmoConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: SiameseOlmoConfig, model: Optional[torch.nn.Module] = None):
        super().__init__(config)
        self.model = model if model is not None else self.build_inner(config)
        self.post_init()

    @classmethod
    def build_inner(cls, config: SiameseOlmoConfig) -> torch.nn.Module:
        """The OLMo model, from the export folder's modelling code (olmo_lite and the variant files)."""
        from .olmo_lite import ModelConfig, OLMo
        from .variant_table import block_class

        fields = ModelConfig(config.olmo)
        return OLMo(fields, block_class(config.variant))

    def _init_weights(self, module):  # every weight comes from the checkpoint; nothing to initialise
        pass

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Optional[Cache] = None,
        past_key_values: Optional[Cache] = None,
        use_cache: Optional[bool] = None,
        labels: Optional[torch.LongTensor] = None,
        return_dict: Optional[bool] = None,
        position_ids: Optional[torch.LongTensor] = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """The KV cache comes as ``cache`` (transformers 5.24 and later) or ``past_key_values`` (earlier releases);
        either way it is read and extended. Positions are the cache's length onward (OLMo's RoPE), so
        ``position_ids`` / ``cache_position`` are checked to say exactly that; any other argument that is not at
        its default is refused (``TypeError``), never dropped."""
        if cache is not None and past_key_values is not None:
            raise ValueError("pass the KV cache as `cache` or as `past_key_values`, not both")
        cache = cache if cache is not None else past_key_values
        cache_position = kwargs.pop("cache_position", None)  # passed by releases before 5.24 (not named above, so
        # that 5.24 does not warn that remote code expects it)
        unsupported = sorted(k for k, v in kwargs.items() if v is not None and v is not False)
        if unsupported:
            raise TypeError(f"{type(self).__name__} (OLMo {self.config.variant}) does not take "
                            f"{', '.join(unsupported)}; it takes input_ids, attention_mask, cache (or "
                            "past_key_values), use_cache and labels")
        if cache is not None and getattr(cache, "is_compileable", False):
            raise ValueError(f"{type(self).__name__} supports transformers' dynamic KV cache only (the default), not "
                             f"{type(cache).__name__}; drop cache_implementation")
        n_past = cache.get_seq_length() if cache is not None else 0
        for name, given in (("position_ids", position_ids), ("cache_position", cache_position)):
            if given is not None and not torch.equal(
                    given.reshape(-1, given.shape[-1]).cpu(),
                    torch.arange(n_past, n_past + input_ids.shape[1]).expand(given.reshape(-1, given.shape[-1]).shape)):
                raise ValueError(f"{name} must run on from the cache's length ({n_past}): this model places tokens "
                                 "by their position in the sequence (left padding is not supported)")
        past = None
        if n_past > 0:
            past = [(layer.keys, layer.values) for layer in cache.layers]
        output = self.model(input_ids, attention_mask=attention_mask, past_key_values=past, use_cache=bool(use_cache))
        if use_cache:
            if cache is None:
                cache = DynamicCache()
            for layer, (k, v) in enumerate(output.attn_key_values):  # OLMo returns past + new; the cache adds new
                cache.update(k[:, :, n_past:], v[:, :, n_past:], layer)
        loss = None
        if labels is not None:
            logits = output.logits[:, :-1].float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=output.logits, **{_CACHE_FIELD: cache if use_cache else None})
