"""Weights between the two frameworks, by name: an ai2-olmo state dict (``siamesenorm.build_model``'s names) as the
OLMo-core model's (``olmo_to_core_state``) and back (``core_to_olmo_state``). Pure renames and the two splits
(OLMo's fused q/k/v projection into OLMo-core's three; OLMo's fused SwiGLU input into w1 and w3): no value changes,
so a model of either framework computes the same logits from the other's weights (tests/olmo_core/test_olmo_core.py).
Here, not in the OLMo-core adapter, because the tools (export, evaluate, analyze) read OLMo-core checkpoints through
siamesenorm/run/checkpoints.py without importing an adapter."""

from __future__ import annotations

import re
from typing import Dict

import torch

__all__ = ["olmo_to_core_state", "core_to_olmo_state", "QKV_HEAD_NORM_TYPES"]

#: The MODEL_TYPEs whose attention normalises Q, K and V per head (HybridNorm's attention).
QKV_HEAD_NORM_TYPES = ("hybrid", "hybrid_star", "hybrid_pre")

#: ai2-olmo name (under transformer.blocks.N.) -> OLMo-core name (under blocks.N.), for what only moves.
_BLOCK_RENAMES = {
    "attn_norm": "attention_norm", "ff_norm": "feed_forward_norm", "attn_out": "attention.w_out",
    "ff_out": "feed_forward.w2", "q_norm": "attention.q_norm", "k_norm": "attention.k_norm",
    "q_head_norm": "attention.q_norm", "k_head_norm": "attention.k_norm", "v_head_norm": "attention.v_norm",
}
_TOP_RENAMES = {"transformer.wte.weight": "embeddings.weight", "transformer.ln_f": "lm_head.norm",
                "transformer.ff_out": "lm_head.w_out", "transformer.emb_norm": "embedding_norm"}
_BLOCK = re.compile(r"^transformer\.blocks\.(\d+)\.([^.]+)((?:\..+)?)$")


def _renamed(name: str, table: Dict[str, str], target: str) -> str:
    for old, new in table.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    raise KeyError(f"no {target} name for {name}")


def olmo_to_core_state(state: Dict[str, torch.Tensor], model_config) -> Dict[str, torch.Tensor]:
    """An ai2-olmo state dict (``siamesenorm.build_model``'s names) as the OLMo-core model's."""
    kv = model_config.effective_n_kv_heads * (model_config.d_model // model_config.n_heads)
    out: Dict[str, torch.Tensor] = {}
    for name, value in state.items():
        match = _BLOCK.match(name)
        if match is None:
            out[_renamed(name, _TOP_RENAMES, "OLMo-core")] = value
            continue
        index, module, rest = match.groups()
        prefix = f"blocks.{index}."
        if module == "att_proj":
            q, k, v = value.split((value.shape[0] - 2 * kv, kv, kv), dim=0)
            for part, tensor in zip("qkv", (q, k, v)):
                out[f"{prefix}attention.w_{part}{rest}"] = tensor
        elif module == "ff_proj":
            up, gate = value.chunk(2, dim=0)  # OLMo's SwiGLU: silu(second half) * first half
            out[f"{prefix}feed_forward.w1{rest}"] = gate
            out[f"{prefix}feed_forward.w3{rest}"] = up
        else:
            out[prefix + _BLOCK_RENAMES.get(module, module) + rest] = value
    return out


def core_to_olmo_state(state: Dict[str, torch.Tensor], model_type: str) -> Dict[str, torch.Tensor]:
    """The inverse of ``olmo_to_core_state`` for a model of ``model_type``."""
    inverse_top = {new: old for old, new in _TOP_RENAMES.items()}
    # attention.q_norm / k_norm are the per-head norms in the HybridNorm family, OLMo's q_norm / k_norm elsewhere
    head_norms = ("q_head_norm", "k_head_norm", "v_head_norm") if model_type in QKV_HEAD_NORM_TYPES else ("q_norm",
                                                                                                         "k_norm")
    inverse_block = {new: old for old, new in _BLOCK_RENAMES.items() if not new.startswith("attention.") or
                     old == "attn_out" or old in head_norms}
    out: Dict[str, torch.Tensor] = {}
    parts: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, value in state.items():
        match = re.match(r"^blocks\.(\d+)\.(.+)$", name)
        if match is None:
            out[_renamed(name, inverse_top, "ai2-olmo")] = value
            continue
        index, rest = match.groups()
        prefix = f"transformer.blocks.{index}."
        fused = re.match(r"^(attention\.w_[qkv]|feed_forward\.w[13])(\..+)$", rest)  # weight, bias
        if fused is not None:
            target = "att_proj" if fused.group(1).startswith("attention") else "ff_proj"
            parts.setdefault(prefix + target + fused.group(2), {})[fused.group(1)] = value
            continue
        for new, old in inverse_block.items():
            if rest == new or rest.startswith(new + "."):
                rest = old + rest[len(new):]
                break
        out[prefix + rest] = value
    for name, pieces in parts.items():
        if "att_proj" in name:
            out[name] = torch.cat([pieces["attention.w_q"], pieces["attention.w_k"], pieces["attention.w_v"]], 0)
        else:
            out[name] = torch.cat([pieces["feed_forward.w3"], pieces["feed_forward.w1"]], 0)
    return out
