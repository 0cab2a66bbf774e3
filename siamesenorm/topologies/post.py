"""Post-Norm (paper eq. 2), after the attention and after the MLP sublayer:

    X_{i+1} = LN_i(X_i + F_i(X_i))

The embedding enters block 0 un-normalised (X_0 = embedding), as in the original Transformer. OLMo's final norm
``ln_f`` still follows the last block; on an already normalised state it only rescales.
Note: OLMo's own ``norm_after`` flag computes X + LN(F(X)), which is not Post-Norm; this block is.
"""

from __future__ import annotations

from .base import TopologyBlock

__all__ = ["PostNormBlock"]


class PostNormBlock(TopologyBlock):
    """``attn_norm`` and ``ff_norm`` (OLMo's names) are the norms after the two residual additions.

    ``residual_scale`` multiplies X before the addition: 1 here, DeepNorm's alpha in its subclass."""

    residual_scale: float = 1.0

    def post_norm_forward(self, x, attention_bias, layer_past, use_cache, max_doc_len, cu_doc_lens):
        att, cache = self.attention_branch(x, attention_bias, layer_past, use_cache, max_doc_len, cu_doc_lens)
        a = self.residual_scale
        x = self.norm(self.attn_norm, (x if a == 1.0 else a * x) + att)
        o = self.mlp_branch(x)
        x = self.norm(self.ff_norm, (x if a == 1.0 else a * x) + o)
        return x, cache

    def forward(self, x, attention_bias=None, layer_past=None, use_cache=False, max_doc_len=None, cu_doc_lens=None):
        return self.post_norm_forward(x, attention_bias, layer_past, use_cache, max_doc_len, cu_doc_lens)
