"""DeepNorm (DeepNet, Wang et al., arXiv 2203.00555), decoder-only form, N = n_layers:

    X_{i+1} = LN(alpha * X_i + F(X_i))        after the attention and after the MLP sublayer
    alpha   = (2N)^(1/4)
    beta    = (8N)^(-1/4)                     init: the value projection (V rows of OLMo's fused att_proj), the
                                              attention output projection (attn_out) and both MLP weights
                                              (ff_proj, ff_out) are multiplied by beta after OLMo's own init;
                                              the query and key projections are left as OLMo initialises them

Both constants follow from N of the model being built (a public copy hard-coded them for 32 layers and inverted
the init scale; tests check N = 6 and N = 24). Everything else is Post-Norm (post.py): X_0 = embedding.
"""

from __future__ import annotations

import torch

from .post import PostNormBlock
from .spec import Variant

__all__ = ["DeepNormBlock", "deepnorm_alpha", "deepnorm_beta", "VARIANT"]


def deepnorm_alpha(n_layers: int) -> float:
    return (2.0 * n_layers) ** 0.25


def deepnorm_beta(n_layers: int) -> float:
    return (8.0 * n_layers) ** -0.25


class DeepNormBlock(PostNormBlock):
    position_knob = None  # post_norm_position is post's knob; this block normalises after the addition

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.residual_scale = deepnorm_alpha(config.n_layers)
        self.init_scale = deepnorm_beta(config.n_layers)

    def reset_parameters(self):
        super().reset_parameters()
        v_rows = self.fused_dims[2]
        with torch.no_grad():
            self.att_proj.weight[-v_rows:].mul_(self.init_scale)
            for linear in (self.attn_out, self.ff_proj, self.ff_out):
                linear.weight.mul_(self.init_scale)


VARIANT = Variant(name="deepnorm", display_name="DeepNorm", colour="tab:brown", block=DeepNormBlock, order=6,
                  table_row=4)
