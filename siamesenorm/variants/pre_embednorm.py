"""Pre-Norm with a parameter-free RMSNorm on the embedding: the paper's figure-2 probe.

    X_0 = RMSNorm(embedding)          (no learnable scale: ``emb_norm`` in block 0)
    X   = X + F(LN(X))                OLMo's own Pre-Norm sequential block computation, unchanged

It separates "the embedding's scale" from "the residual stream's growth" in the hidden-state magnitude analysis
(paper figure 2a): its parameters are exactly Pre-Norm's.
"""

from __future__ import annotations

from olmo.model import RMSLayerNorm

from ._base import TopologyBlock
from .peri import validate_own_embedding_norm
from .spec import Variant

__all__ = ["PreEmbedNormBlock", "VARIANT"]


class PreEmbedNormBlock(TopologyBlock):
    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        if self.is_first:
            self.emb_norm = RMSLayerNorm(config, size=config.d_model, elementwise_affine=False)

    def update(self, x, attention):
        if self.is_first:
            x = self.norm(self.emb_norm, x)
        return attention.olmo_forward(x)  # OLMo's own Pre-Norm block

    def skip(self, x):
        return self.norm(self.emb_norm, x) if self.is_first else x


VARIANT = Variant(name="pre_embednorm", display_name="Pre-Norm + EmbedNorm", colour="navy", block=PreEmbedNormBlock,
                  order=12, table_row=1, validate=validate_own_embedding_norm)
