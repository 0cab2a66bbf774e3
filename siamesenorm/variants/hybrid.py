"""HybridNorm (Zhuo et al., 2025): QKV-norm inside attention, Post-Norm on the FFN side.

    X'      = X + Attn(X)              Attn normalises Q, K and V per head (RMS/LayerNorm over head_dim)
                                       before RoPE; there is no norm on the attention input
    U       = LN(X')                   (``ff_norm``)
    X_{i+1} = U + FFN(U)               the FFN input and its residual are the normalised U;
                                       the block output is not normalised

With ``model.fused_streams`` the Q/K/V norms of every variant with HybridNorm's attention (hybrid, hybrid_star,
hybrid_pre) and RoPE after them run as one op over the attention projection's output (siamesenorm/nn/fused.py
``head_norm``), which keeps for backward only what attention keeps anyway (its outputs) and rstd.

Reference: the HybridNorm OLMo 1.2B config (see docs/architecture.md).
"""

from __future__ import annotations

import torch

from ..nn.fused import head_norm
from ..nn.topologies import hybrid_norm_update
from ._base import TopologyBlock
from .spec import Variant, fail

__all__ = ["QKVHeadNormAttention", "HybridNormBlock", "validate_qkv_head_norms", "VARIANT"]


def _per_head(norm, t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Apply ``norm`` (over head_dim) to every head of t: (B, T, heads * head_dim)."""
    shape = t.shape
    return norm(t.view(*shape[:-1], shape[-1] // head_dim, head_dim)).view(shape).to(t.dtype)


class QKVHeadNormAttention(TopologyBlock):
    """A block whose attention normalises Q, K and V per head before RoPE (OLMo applies RoPE inside ``attention``)."""

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.head_dim = config.d_model // config.n_heads
        affine = config.attention_layer_norm_with_affine
        self.q_head_norm = self.new_norm(self.head_dim, elementwise_affine=affine)
        self.k_head_norm = self.new_norm(self.head_dim, elementwise_affine=affine)
        self.v_head_norm = self.new_norm(self.head_dim, elementwise_affine=affine)

    def qkv_heads(self, qkv, cached=False):
        """With ``model.fused_streams``, the three per-head norms as one op over the projection's output (one pass
        each way, siamesenorm/nn/fused.py ``head_norm``; q, k, v each a tensor of its own), RoPE included
        (``rotates_in_op``): attention then keeps the op's outputs for its own backward and the op keeps only
        rstd beside them, where it would otherwise keep qkv (3 (B, T, d) tensors a layer at the 1.3B recipe)."""
        if not self.fused_streams:
            return super().qkv_heads(qkv, cached)
        weights = (self.weight(n) for n in (self.q_head_norm, self.k_head_norm, self.v_head_norm))
        return head_norm(qkv, *weights, n_q=self.config.n_heads, n_kv=self.config.effective_n_kv_heads,
                         head_dim=self.head_dim, eps=self.config.layer_norm_eps,
                         rope=self.rope_tables(qkv) if self.rotates_in_op(cached) else None)

    def attention(self, q, k, v, *args, **kwargs):
        if not self.fused_streams:
            q = self.norm(lambda t: _per_head(self.q_head_norm, t, self.head_dim), q)
            k = self.norm(lambda t: _per_head(self.k_head_norm, t, self.head_dim), k)
            v = self.norm(lambda t: _per_head(self.v_head_norm, t, self.head_dim), v)
        # RoPE is applied in there, after our norms (or was, in ``head_norm``: TopologyBlock.attention knows which)
        return super().attention(q, k, v, *args, **kwargs)


def validate_qkv_head_norms(config, model_type: str) -> None:
    """For the variants with HybridNorm's attention (hybrid, hybrid_star, hybrid_pre)."""
    if config.attention_layer_norm:
        fail(f"MODEL_TYPE {model_type} applies its own per-head Q/K/V norms; set model.attention_layer_norm to false.")


class HybridNormBlock(QKVHeadNormAttention):
    @classmethod
    def unused_norms(cls, config, layer_id):
        return ("attn_norm",)  # the Q/K/V norms replace the attention's input norm

    def update(self, x, attention):
        x = hybrid_norm_update(x, attention)
        return hybrid_norm_update(x, self.mlp, self.normed(self.ff_norm))


VARIANT = Variant(name="hybrid", display_name="HybridNorm", colour="tab:red", block=HybridNormBlock, order=2,
                  table_row=7, validate=validate_qkv_head_norms)
