"""The parts of ai2-olmo 0.6.0 that an exported model runs, in torch alone (siamesenorm's own code, written for
the Hugging Face export; it imports nothing but torch).

An export's variant files (siamesenorm/variants/*.py, copied with their ``olmo`` imports pointed here) subclass
``OLMoSequentialBlock`` exactly as they do inside the package, so the update rules are the package's own; this
file supplies what ai2-olmo would: the config as attributes, the norms, RoPE, the activations, the sequential
block's projections and attention, and the model's forward with a key/value cache. Parameter names are OLMo's, so
the checkpoint loads unchanged. tests/export/test_remote_code.py compares the logits with OLMo's for every MODEL_TYPE.

Inference and fine-tuning, not pretraining: no flash-attn, no activation checkpointing, no initialisation (every
weight comes from the checkpoint). Unsupported options (``UNSUPPORTED``) are refused at export time.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ModelConfig", "BufferCache", "OLMoConfigurationError", "LayerNormBase", "LayerNorm", "RMSLayerNorm",
           "OLMoSequentialBlock", "OLMo", "UNSUPPORTED", "unsupported"]

#: OLMo options this stand-in does not implement: field -> the values it supports.
UNSUPPORTED = {"alibi": (False, None), "block_type": ("sequential",), "block_group_size": (1, None)}


def unsupported(fields: Dict[str, Any]) -> Optional[str]:
    """Why a model with these OLMo config fields cannot run here, or None."""
    for name, allowed in UNSUPPORTED.items():
        if fields.get(name, allowed[0]) not in allowed:
            return f"model.{name}={fields[name]!r} (the exported modelling code supports {allowed[0]!r} only)"
    return None


class OLMoConfigurationError(Exception):
    pass


class ModelConfig:
    """An OLMo model config as plain attributes (the ``olmo`` dict of an export's config.json)."""

    def __init__(self, fields: Dict[str, Any]):
        self.__dict__.update(fields)
        self.init_device = None

    @property
    def effective_n_kv_heads(self) -> int:
        if getattr(self, "n_kv_heads", None) is not None:
            return self.n_kv_heads
        return 1 if getattr(self, "multi_query_attention", None) else self.n_heads


class BufferCache(dict):
    """Tensors shared by the blocks (RoPE's sin/cos, the causal mask), keyed by name."""


class LayerNormBase(nn.Module):
    """OLMo's norm: ``weight`` (and ``bias``) when affine; ``build`` picks LayerNorm or RMSNorm from the config."""

    def __init__(self, config: ModelConfig, *, size: Optional[int] = None,
                 elementwise_affine: Optional[bool] = True):
        super().__init__()
        self.config = config
        self.eps = config.layer_norm_eps
        self.normalized_shape = (size or config.d_model,)
        affine = elementwise_affine or (elementwise_affine is None and config.layer_norm_with_affine)
        self.weight = nn.Parameter(torch.ones(self.normalized_shape)) if affine else None
        use_bias = config.bias_for_layer_norm if config.bias_for_layer_norm is not None else config.include_bias
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape)) if affine and use_bias else None

    @classmethod
    def build(cls, config: ModelConfig, size: Optional[int] = None, **kwargs) -> "LayerNormBase":
        kind = str(config.layer_norm_type)
        if kind in ("default", "low_precision"):  # low_precision differs only under autocast
            return LayerNorm(config, size=size, **kwargs)
        if kind == "rms":
            return RMSLayerNorm(config, size=size, **kwargs)
        raise OLMoConfigurationError(f"unknown layer_norm_type {kind!r}")

    def reset_parameters(self):
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class LayerNorm(LayerNormBase):
    def __init__(self, config, size=None, elementwise_affine=None, **_):
        super().__init__(config, size=size, elementwise_affine=elementwise_affine)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, weight=self.weight, bias=self.bias, eps=self.eps)


class RMSLayerNorm(LayerNormBase):
    """x / rms(x), computed in float32 and cast back, then the scale (and shift)."""

    def __init__(self, config, size=None, elementwise_affine=None):
        super().__init__(config, size=size, elementwise_affine=elementwise_affine)

    def forward(self, x):
        with torch.autocast(enabled=False, device_type=x.device.type):
            dtype = x.dtype
            x = x.to(torch.float32)
            x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        if self.weight is None:
            return x
        return self.weight * x + self.bias if self.bias is not None else self.weight * x


def _rope_tables(cache: BufferCache, config: ModelConfig, length: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """sin and cos of the rotary angles, (1, 1, length, head_dim); the two halves of the head share frequencies."""
    sin, cos = cache.get("rope_sin"), cache.get("rope_cos")
    if sin is None or sin.shape[-2] < length or sin.device != torch.device(device):
        dim = config.d_model // config.n_heads
        with torch.autocast(torch.device(device).type, enabled=False):
            inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim))
            angles = torch.outer(torch.arange(length, device=device, dtype=torch.float), inv_freq)
            angles = torch.cat((angles, angles), dim=-1)[None, None]
        sin, cos = cache["rope_sin"], cache["rope_cos"] = angles.sin(), angles.cos()
    return sin[:, :, :length], cos[:, :, :length]


def _rotate(t: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=-1)
    return ((t * cos) + (torch.cat((-second, first), dim=-1) * sin)).to(t.dtype)


def _activation(config: ModelConfig):
    kind = str(config.activation_type)
    if kind == "swiglu":
        return lambda x: (lambda up, gate: F.silu(gate) * up)(*x.chunk(2, dim=-1)), 0.5
    if kind == "gelu":
        return lambda x: F.gelu(x, approximate="none"), 1.0
    if kind == "relu":
        return F.relu, 1.0
    raise OLMoConfigurationError(f"unknown activation_type {kind!r}")


class _Act(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fn, self.output_multiplier = _activation(config)

    def forward(self, x):
        return self.fn(x)


class OLMoSequentialBlock(nn.Module):
    """OLMo's sequential block: fused q/k/v projection ``att_proj``, ``attn_out``, ``ff_proj``, ``ff_out``, the
    norms ``attn_norm`` / ``ff_norm`` (and q/k norms with ``attention_layer_norm``); ``forward`` is Pre-Norm
    (``pre``), or Post-Norm inside the sublayer with ``norm_after``."""

    def __init__(self, layer_id: int, config: ModelConfig, cache: BufferCache):
        super().__init__()
        self.layer_id, self.config, self._cache = layer_id, config, cache
        d, heads, kv = config.d_model, config.n_heads, config.effective_n_kv_heads
        self.hidden_size = config.mlp_hidden_size if config.mlp_hidden_size is not None else config.mlp_ratio * d
        self._activation_checkpoint_fn = None
        self.dropout = nn.Dropout(config.residual_dropout)
        self.k_norm = self.q_norm = None
        if config.attention_layer_norm:
            affine = config.attention_layer_norm_with_affine
            self.k_norm = LayerNormBase.build(config, size=(d // heads) * kv, elementwise_affine=affine)
            self.q_norm = LayerNormBase.build(config, elementwise_affine=affine)
        self.act = _Act(config)
        bias = config.include_bias
        self.attn_out = nn.Linear(d, d, bias=bias)
        self.ff_out = nn.Linear(int(self.act.output_multiplier * self.hidden_size), d, bias=bias)
        self.fused_dims = (d, kv * (d // heads), kv * (d // heads))
        self.att_proj = nn.Linear(d, sum(self.fused_dims), bias=bias)
        self.ff_proj = nn.Linear(d, self.hidden_size, bias=bias)
        self.attn_norm = LayerNormBase.build(config, size=d)
        self.ff_norm = LayerNormBase.build(config, size=d)

    def reset_parameters(self):
        """Nothing to initialise: an export's weights all come from its checkpoint."""

    def attention(self, q, k, v, attention_bias=None, layer_past=None, use_cache=False, max_doc_len=None,
                  cu_doc_lens=None):
        """Multi-head attention of projected q, k, v (B, T, ...) -> (attn_out(heads), (keys, values) or None)."""
        config = self.config
        B, T, C = q.shape
        dtype = k.dtype
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q).to(dtype=dtype), self.k_norm(k).to(dtype=dtype)
        head_dim = C // config.n_heads
        q = q.view(B, T, config.n_heads, head_dim).transpose(1, 2)
        k = k.view(B, T, config.effective_n_kv_heads, head_dim).transpose(1, 2)
        v = v.view(B, T, config.effective_n_kv_heads, head_dim).transpose(1, 2)
        if layer_past is not None:
            k, v = torch.cat((layer_past[0], k), dim=-2), torch.cat((layer_past[1], v), dim=-2)
        present = (k, v) if use_cache else None
        q_len, k_len = q.shape[-2], k.shape[-2]
        if config.rope:
            q_, k_ = (q.float(), k.float()) if config.rope_full_precision else (q, k)
            with torch.autocast(q.device.type, enabled=False):
                sin, cos = _rope_tables(self._cache, config, k_len, q.device)
                sin, cos = sin.type_as(q_), cos.type_as(q_)
                q_ = _rotate(q_, sin[:, :, k_len - q_len:], cos[:, :, k_len - q_len:])
                k_ = _rotate(k_, sin, cos)
            q, k = q_.type_as(q), k_.type_as(k)
        if attention_bias is not None:  # in q's dtype, -inf clamped to its lowest finite value (as OLMo does)
            attention_bias = attention_bias[:, :, k_len - q_len:k_len, :k_len].to(dtype)
            attention_bias = attention_bias.clamp(min=torch.finfo(dtype).min)
        if q.shape[1] != k.shape[1]:  # grouped-query attention
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias, is_causal=attention_bias is None,
                                             dropout_p=config.attention_dropout if self.training else 0.0)
        return self.attn_out(att.transpose(1, 2).contiguous().view(B, T, C)), present

    def forward(self, x, attention_bias=None, layer_past=None, use_cache=False, max_doc_len=None, cu_doc_lens=None):
        after = bool(self.config.norm_after)
        qkv = self.att_proj(x if after else self.attn_norm(x))
        if self.config.clip_qkv is not None:
            qkv = qkv.clamp(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        att, cache = self.attention(*qkv.split(self.fused_dims, dim=-1), attention_bias, layer_past=layer_past,
                                    use_cache=use_cache)
        x = x + self.dropout(self.attn_norm(att) if after else att)
        h = self.ff_out(self.act(self.ff_proj(x if after else self.ff_norm(x))))
        return x + self.dropout(self.ff_norm(h) if after else h), cache


class OLMoOutput(NamedTuple):
    logits: torch.Tensor
    attn_key_values: Optional[List[Tuple[torch.Tensor, torch.Tensor]]]


class OLMo(nn.Module):
    """OLMo's model around blocks of class ``block``: embedding (``wte``; ``wpe`` without RoPE; ``emb_norm`` with
    ``embedding_layer_norm``), the blocks, ``ln_f`` and the output layer (``ff_out``, or ``wte`` when tied)."""

    def __init__(self, config: ModelConfig, block: type):
        super().__init__()
        self.config = config
        reason = unsupported(vars(config))
        if reason:
            raise OLMoConfigurationError(reason)
        self._cache = BufferCache()
        vocab = config.embedding_size or config.vocab_size
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, config.d_model),
                                              emb_drop=nn.Dropout(config.embedding_dropout),
                                              ln_f=LayerNormBase.build(config)))
        self.transformer["blocks"] = nn.ModuleList(block(i, config, self._cache) for i in range(config.n_layers))
        if not config.rope:
            self.transformer["wpe"] = nn.Embedding(config.max_sequence_length, config.d_model)
        if not config.weight_tying:
            self.transformer["ff_out"] = nn.Linear(config.d_model, vocab, bias=config.include_bias)
        if config.embedding_layer_norm:
            self.transformer["emb_norm"] = LayerNormBase.build(config)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False) -> OLMoOutput:
        B, T = input_ids.shape
        past = 0 if past_key_values is None else past_key_values[0][0].shape[-2]
        x = self.transformer.wte(input_ids)
        if self.config.embedding_layer_norm:
            x = self.transformer.emb_norm(x)
        if not self.config.rope:
            x = x + self.transformer.wpe(torch.arange(past, past + T, device=x.device).unsqueeze(0))
        x = self.transformer.emb_drop(x)
        bias = None
        if attention_mask is not None or past_key_values is not None:  # an explicit additive mask
            length = attention_mask.shape[-1] if attention_mask is not None else past + T
            bias = torch.triu(torch.full((length, length), torch.finfo(torch.float).min, device=x.device),
                              diagonal=1)[None, None]
            if attention_mask is not None:
                keep = attention_mask.to(torch.float).view(B, -1)[:, None, None, :]
                bias = bias + (1.0 - keep) * torch.finfo(torch.float).min
                bias = bias.clamp(min=torch.finfo(torch.float).min)  # no -inf: a fully masked row stays finite
        caches: Optional[list] = [] if use_cache else None
        for i, block in enumerate(self.transformer.blocks):
            x, cache = block(x, attention_bias=bias, layer_past=None if past_key_values is None else past_key_values[i],
                             use_cache=use_cache)
            if caches is not None:
                caches.append(cache)
        x = self.transformer.ln_f(x)
        logits = F.linear(x, self.transformer.wte.weight) if self.config.weight_tying else self.transformer.ff_out(x)
        if self.config.scale_logits:
            logits = logits * (1 / math.sqrt(self.config.d_model))
        return OLMoOutput(logits=logits, attn_key_values=caches)
