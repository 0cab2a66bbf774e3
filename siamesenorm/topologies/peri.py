"""Peri-LN (Kim et al., 2025; as in OLMo-core and Megatron): a norm on both sides of every sublayer.

    X_0 = LN^emb(embedding)                           (``emb_norm``, in block 0)
    X   = X + LN^out(F(LN^in(X)))                     attention, then MLP

LN^in are OLMo's ``attn_norm`` / ``ff_norm``; LN^out are ``attn_out_norm`` / ``ff_out_norm``, applied to the
sublayer output before dropout. The residual stream itself is never normalised (Pre-Norm's identity path), but
every update written into it has a bounded scale.
"""

from __future__ import annotations

from olmo.config import ModelConfig

from .base import TopologyBlock, norm_params

__all__ = ["PeriNormBlock"]


class PeriNormBlock(TopologyBlock):
    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.attn_out_norm = self.new_norm()
        self.ff_out_norm = self.new_norm()
        if self.is_first:
            self.emb_norm = self.new_norm()

    def forward(self, x, attention_bias=None, layer_past=None, use_cache=False, max_doc_len=None, cu_doc_lens=None):
        if self.is_first:
            x = self.norm(self.emb_norm, x)
        att, cache = self.attention_branch(
            self.norm(self.attn_norm, x),
            attention_bias,
            layer_past,
            use_cache,
            max_doc_len,
            cu_doc_lens,
            out_norm=self.attn_out_norm,
        )
        x = x + att
        x = x + self.mlp_branch(self.norm(self.ff_norm, x), out_norm=self.ff_out_norm)
        return x, cache

    @classmethod
    def extra_params(cls, config: ModelConfig, layer_id: int) -> int:
        return super().extra_params(config, layer_id) + (3 if layer_id == 0 else 2) * norm_params(config)

    def skip(self, x):
        return self.norm(self.emb_norm, x) if self.is_first else x
