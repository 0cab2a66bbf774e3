"""Mix-LN (Li et al., arXiv 2412.13795): Post-LN in the shallow layers, Pre-LN in the deep ones.

    P = floor(rho * N)                     rho = ``mixln_post_fraction`` (0.25), N = n_layers
    layer l < P:    X = LN(X + F(X))       after attention and after the MLP (post.py)
    layer l >= P:   X = X + F(LN(X))       OLMo's own Pre-Norm sequential block computation

rho = 0 is Pre-Norm, rho = 1 is Post-Norm (both tested). Mix-LN's own code calls this "post_pre"; here that name
is SiameseNorm's, so this one is ``mixln``.
"""

from __future__ import annotations

import math

from olmo.config import ModelConfig

from .post import PostNormBlock
from .spec import Knob, Variant, knob

__all__ = ["MixLNBlock", "mixln_post_layers", "VARIANT"]


def mixln_post_layers(config: ModelConfig) -> int:
    """How many leading layers are Post-LN. The epsilon keeps e.g. 0.29 * 100 at 29 despite rounding."""
    return math.floor(knob(config, "mixln_post_fraction") * config.n_layers + 1e-9)


class MixLNBlock(PostNormBlock):
    position_knob = None  # post_norm_position is post's knob; this block normalises after the addition

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.is_post_ln = layer_id < mixln_post_layers(config)

    def update(self, x, attention):
        if self.is_post_ln:
            return super().update(x, attention)
        return attention.olmo_forward(x)  # OLMo's own Pre-Norm block


VARIANT = Variant(
    name="mixln", display_name="Mix-LN", colour="tab:gray", block=MixLNBlock, order=8, table_row=5,
    knobs=(Knob("mixln_post_fraction", 0.25, type=float, minimum=0, maximum=1, usual="Mix-LN uses 0.25",
                doc="The first floor(fraction * n_layers) layers are Post-LN, the rest Pre-LN (Mix-LN's 0.25)."),),
)
