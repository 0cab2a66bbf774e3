"""HybridNorm* (Zhuo et al., 2025): HybridNorm whose first layer is a full Pre-Norm layer.

    layer 0:    X = X + Attn(LN(X));   X = X + FFN(LN(X))            (``attn_norm``, ``ff_norm``: Pre-Norm)
    layer l>0:  X' = X + Attn(X);      U = LN(X');   X = U + FFN(U)   (hybrid.py)

Attn is HybridNorm's attention in every layer, layer 0 included: per-head Q/K/V norms before RoPE.
"""

from __future__ import annotations

from .hybrid import HybridNormBlock, validate_qkv_head_norms
from .spec import Variant

__all__ = ["HybridStarBlock", "VARIANT"]


class HybridStarBlock(HybridNormBlock):
    @classmethod
    def unused_norms(cls, config, layer_id):
        return () if layer_id == 0 else ("attn_norm",)

    def update(self, x, attention):
        if not self.is_first:
            return super().update(x, attention)
        x = x + attention(self.norm(self.attn_norm, x))
        return x + self.mlp(self.norm(self.ff_norm, x))


VARIANT = Variant(name="hybrid_star", display_name="HybridNorm*", colour="darkred", block=HybridStarBlock, order=11,
                  table_row=8, validate=validate_qkv_head_norms)
