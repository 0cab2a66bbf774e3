"""Peri-LN (Kim et al., 2025; as in OLMo-core and Megatron): a norm on both sides of every sublayer.

    X_0 = LN^emb(embedding)                           (``emb_norm``, in block 0)
    X   = X + LN^out(F(LN^in(X)))                     attention, then MLP

LN^in are OLMo's ``attn_norm`` / ``ff_norm``; LN^out are ``attn_out_norm`` / ``ff_out_norm``, applied to the
sublayer output before dropout. The residual stream itself is never normalised (Pre-Norm's identity path), but
every update written into it has a bounded scale.
"""

from __future__ import annotations

from ._base import TopologyBlock
from .spec import Variant, fail

__all__ = ["PeriNormBlock", "VARIANT"]


class PeriNormBlock(TopologyBlock):
    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.attn_out_norm = self.new_norm()
        self.ff_out_norm = self.new_norm()
        if self.is_first:
            self.emb_norm = self.new_norm()

    def update(self, x, attention):
        if self.is_first:
            x = self.norm(self.emb_norm, x)
        x = x + attention(self.norm(self.attn_norm, x), out_norm=self.attn_out_norm)
        return x + self.mlp(self.norm(self.ff_norm, x), out_norm=self.ff_out_norm)

    def skip(self, x):
        return self.norm(self.emb_norm, x) if self.is_first else x


def validate_own_embedding_norm(config, model_type: str) -> None:
    """For the variants that normalise the embedding themselves (peri, pre_embednorm)."""
    if getattr(config, "embedding_layer_norm", False):
        fail(f"MODEL_TYPE {model_type} normalises the embedding itself; "
             "set model.embedding_layer_norm to false.")


VARIANT = Variant(name="peri", display_name="Peri-LN", colour="tab:cyan", block=PeriNormBlock, order=9, table_row=2,
                  validate=validate_own_embedding_norm)
