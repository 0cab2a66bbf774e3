"""SiameseNorm, Post-Norm x Pre-Norm (paper section 3, with the two mechanisms of section 4.2).

Two streams share every sublayer F (attention, then MLP). X is bounded (Post-Norm-like), Y keeps a clean identity
path (Pre-Norm-like). Both start as the embedding, X_0 = Y_0 = embedding. For each sublayer of layer l:

    Y'      = LN^Y(Y)                                  (attn_norm_y / ff_norm_y)
    H       = LN^in(X + Y')  if normalized input       (attn_norm / ff_norm, OLMo's names)
            = X + Y'         otherwise
    O       = F(H)
    X       = LN^X(X + O / c(l))                       (attn_norm_x / ff_norm_x); c(l) = depth-wise scaling or 1
    Y       = Y + O

After the last layer:  output = LN_final(LN^out_X(X) + LN^out_Y(Y)), where LN_final is OLMo's ``ln_f`` and
LN^out_X / LN^out_Y (out_norm_x / out_norm_y) live in the last block; their scales are the fusion weights.

         X ----------------------+---(+ O/c)--LN^X--> X
                                 |       ^
         Y --+--LN^Y--(+)--LN^in-+--F----+
             |         ^ X                |
             +----------------------(+ O)--------> Y

Reductions (section 3, tested): with every LN^X scale zeroed this is Pre-Norm (RMSNorm, normalized input on);
with every LN^Y scale zeroed it is Post-Norm (depth scaling and normalized input off).
The paper's reference code applies LN^X before each sublayer instead of after, so its X_0 = LN(embedding);
we follow the paper's equations, X_0 = embedding.
"""

from __future__ import annotations

import torch
from olmo.config import ModelConfig

from .base import TwoStreamBlock, norm_params

__all__ = ["SiamesePostPreBlock"]


class SiamesePostPreBlock(TwoStreamBlock):
    stream_names = ("x_post", "y_pre")

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.attn_norm_x, self.attn_norm_y = self.new_norm(), self.new_norm()
        self.ff_norm_x, self.ff_norm_y = self.new_norm(), self.new_norm()

    @classmethod
    def removed_olmo_norms(cls, config, layer_id):
        # attn_norm / ff_norm are LN^in, the normalized-input norms: gone when that mechanism is off.
        return () if config.siamese_normalized_input else ("attn_norm", "ff_norm")

    def sublayer_input(self, in_norm_name: str, x_stream, y_stream, y_norm) -> torch.Tensor:
        h = x_stream + self.norm(y_norm, y_stream)
        if self.config.siamese_normalized_input:
            h = self.norm(getattr(self, in_norm_name), h)
        return h

    def forward(self, x, attention_bias=None, layer_past=None, use_cache=False, max_doc_len=None, cu_doc_lens=None):
        xs, ys = self.split_streams(x)
        h = self.sublayer_input("attn_norm", xs, ys, self.attn_norm_y)
        o, cache = self.attention_branch(h, attention_bias, layer_past, use_cache, max_doc_len, cu_doc_lens)
        xs = self.norm(self.attn_norm_x, xs + o / self.depth_scale)
        ys = ys + o
        h = self.sublayer_input("ff_norm", xs, ys, self.ff_norm_y)
        o = self.mlp_branch(h)
        xs = self.norm(self.ff_norm_x, xs + o / self.depth_scale)
        ys = ys + o
        return self.finish([xs, ys]), cache

    def input_scales(self, previous: "SiamesePostPreBlock | None") -> dict:
        """(scale of X, scale of Y) as each sublayer's input receives them (paper figure 6): X was last normalised by
        the previous sublayer's LN^X (None before layer 0's attention: X_0 is the embedding), Y by this LN^Y."""
        x_attn = previous.ff_norm_x if previous is not None else None
        return {"attention": (x_attn, self.attn_norm_y), "mlp": (self.attn_norm_x, self.ff_norm_y)}

    @classmethod
    def extra_params(cls, config: ModelConfig, layer_id: int) -> int:
        return super().extra_params(config, layer_id) + 4 * norm_params(config)  # LN^X, LN^Y per sublayer
