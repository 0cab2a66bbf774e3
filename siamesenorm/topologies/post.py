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
    """``attn_norm`` and ``ff_norm`` (OLMo's names) are the norms after the two residual additions."""

    def forward(self, x, attention_bias=None, layer_past=None, use_cache=False, max_doc_len=None, cu_doc_lens=None):
        att, cache = self.attention_branch(x, attention_bias, layer_past, use_cache, max_doc_len, cu_doc_lens)
        x = self.norm(self.attn_norm, x + att)
        x = self.norm(self.ff_norm, x + self.mlp_branch(x))
        return x, cache
