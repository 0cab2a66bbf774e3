"""SiameseNorm, HybridNorm x Pre-Norm: the paper's main model (figure 3, section 4.2).

X is the HybridNorm stream (bounded), Y the Pre-Norm stream; X_0 = Y_0 = embedding. In layer l, with c(l) the
depth-wise scaling (1 when off), gamma a learnable vector initialised to 1, and Attn HybridNorm's attention
(per-head Q/K/V norms before RoPE, no norm on its input):

    H = gamma * X + LN^Y_attn(Y)                   (attn_norm_y)
    R = Attn(H);        X = X + R / c(l);   Y = Y + R
    X = LN^X_attn(X)                               (attn_norm_x: HybridNorm's norm after the attention residual)
    M = LN^in(X + LN^Y_ffn(Y))  if normalized input (ff_norm; ff_norm_y)
      = X + LN^Y_ffn(Y)         otherwise
    O = MLP(M);         X = X + O / c(l);   Y = Y + O

After the last layer: output = LN_final(LN^out_X(X) + LN^out_Y(Y)) with LN_final = OLMo's ``ln_f``.
gamma stands in for the norm HybridNorm omits after the MLP (section 4.2); it is always a parameter.

      X --*gamma--(+)--Attn--+--(+R/c)--LN^X--(+)--LN^in--MLP--+--(+O/c)--> X
                   ^         |                 ^               |
      Y --LN^Y-----+         |           LN^Y--+               |
      Y ---------------------+--(+R)-------------------------+-(+O)-----> Y
"""

from __future__ import annotations

import torch
import torch.nn as nn
from olmo.config import ModelConfig

from .base import TwoStreamBlock, norm_params
from .hybrid import QKVHeadNormAttention

__all__ = ["SiameseHybridPreBlock"]


class SiameseHybridPreBlock(TwoStreamBlock, QKVHeadNormAttention):
    stream_names = ("x_hybrid", "y_pre")

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.gamma = nn.Parameter(torch.ones(config.d_model, device=config.init_device, dtype=torch.float32))
        self.attn_norm_y = self.new_norm()
        self.attn_norm_x = self.new_norm()
        self.ff_norm_y = self.new_norm()

    @classmethod
    def removed_olmo_norms(cls, config, layer_id):
        # No attention-input norm (the Q/K/V norms replace it); ff_norm is LN^in, gone without normalized input.
        return ("attn_norm",) if config.siamese_normalized_input else ("attn_norm", "ff_norm")

    def reset_parameters(self):
        super().reset_parameters()
        nn.init.ones_(self.gamma)

    def forward(self, x, attention_bias=None, layer_past=None, use_cache=False, max_doc_len=None, cu_doc_lens=None):
        xs, ys = self.split_streams(x)
        h = self.gamma.to(xs.dtype) * xs + self.norm(self.attn_norm_y, ys)
        r, cache = self.attention_branch(h, attention_bias, layer_past, use_cache, max_doc_len, cu_doc_lens)
        xs = self.norm(self.attn_norm_x, xs + r / self.depth_scale)
        ys = ys + r
        m = xs + self.norm(self.ff_norm_y, ys)
        if self.config.siamese_normalized_input:
            m = self.norm(self.ff_norm, m)
        o = self.mlp_branch(m)
        return self.finish([xs + o / self.depth_scale, ys + o]), cache

    def input_scales(self, previous: "SiameseHybridPreBlock | None") -> dict:
        """(scale of X, scale of Y) as each sublayer's input receives them (paper figure 6): gamma and LN^Y_attn for
        the attention, LN^X_attn (X's last norm) and LN^Y_ffn for the MLP."""
        return {"attention": (self.gamma, self.attn_norm_y), "mlp": (self.attn_norm_x, self.ff_norm_y)}

    @classmethod
    def extra_params(cls, config: ModelConfig, layer_id: int) -> int:
        return super().extra_params(config, layer_id) + config.d_model + 3 * norm_params(config)
