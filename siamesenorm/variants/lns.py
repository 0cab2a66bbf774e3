"""LayerNorm Scaling (LNS; Sun et al., "The Curse of Depth in Large Language Models", arXiv 2502.05795, its
equation for the scaled norm; as OLMo-core 3.0.0 builds it, ``LayerNormScaledTransformerBlock``): Pre-Norm with
every norm's output scaled down by the square root of the layer's 1-based depth,

    X'      = X_l  + Attn( LN_attn(X_l) / sqrt(l) )          l = layer_id + 1 (1, 2, ..., n_layers)
    X_{l+1} = X'   + MLP(  LN_ff(X')    / sqrt(l) )

Everything else is Pre-Norm (pre.py): X_0 = embedding, OLMo's final norm after the last block, OLMo's init. The
paper's motivation is the one SiameseNorm's paper names for Pre-Norm (deep layers' updates diluted by a growing
residual stream): LNS shrinks what a deep layer's sublayer sees instead of changing the stream.

Diagram (one sublayer)::

    X ──┬──────────────────────────────(+)── X'
        └─ LN ── x 1/sqrt(l) ── F ──────┘

On the OLMo-core path ``lns`` is this file's topology over OLMo-core's block; tests/olmo_core/test_olmo_core.py
checks that it gives OLMo-core's own ``LayerNormScaledTransformerBlock``'s logits from the same weights.
"""

from __future__ import annotations

import math

from ._base import TopologyBlock
from .spec import Variant

__all__ = ["LayerNormScaledBlock", "layernorm_scale", "VARIANT"]


def layernorm_scale(layer_id: int) -> float:
    """1 / sqrt(l) for the 0-based ``layer_id`` (l = layer_id + 1)."""
    return 1.0 / math.sqrt(layer_id + 1)


class LayerNormScaledBlock(TopologyBlock):
    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.norm_scale = layernorm_scale(layer_id)

    def update(self, x, attention):
        x = x + attention(self.norm(self.attn_norm, x) * self.norm_scale)
        return x + self.mlp(self.norm(self.ff_norm, x) * self.norm_scale)


VARIANT = Variant(name="lns", display_name="LayerNorm Scaling", colour="goldenrod", block=LayerNormScaledBlock,
                  order=20, table_row=20)
