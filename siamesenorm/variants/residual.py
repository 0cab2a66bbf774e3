"""ResiDual (Xie et al., arXiv 2304.14802): a Post-LN main stream X plus an accumulator D of raw sublayer outputs.

    X_0 = D_0 = embedding
    for each sublayer F (attention, then MLP):   O = F(X);   X = LN(X + O);   D = D + O
    output  = X + LN^D(D)                         (``out_norm_dual`` in the last block; OLMo's ``ln_f`` follows)

D feeds no sublayer input: it only collects every raw output, so it gives the embedding and every layer a
Pre-Norm-like identity path to the output, while every sublayer sees the bounded Post-LN state. This is the
difference from SiameseNorm, whose Pre-Norm stream also feeds the sublayers (paper, appendix A.1).

    X --+--F--+--(+)--LN--> X
        |     |
    D --------+--(+)------> D
"""

from __future__ import annotations

from ._base import TopologyBlock, mean_weight
from .spec import Variant

__all__ = ["ResiDualBlock", "VARIANT"]


class ResiDualBlock(TopologyBlock):
    """``attn_norm`` / ``ff_norm`` (OLMo's names) are the Post-LN norms of X."""

    STREAMS = ("post_ln", "accumulator")

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        if self.is_last:
            self.out_norm_dual = self.new_norm()

    def update(self, x, attention):
        xs, ds = self.split_streams(x)
        for branch, norm in ((attention, self.attn_norm), (self.mlp, self.ff_norm)):
            o = branch(xs)
            xs = self.norm(norm, xs + o)  # X: Post-LN
            ds = ds + o  # D collects the raw sublayer output
        return self.finish([xs, ds])

    def contributions(self, streams):  # X + LN^D(D)
        xs, ds = streams
        return [xs, self.norm(self.out_norm_dual, ds)]

    def fusion_weights(self):
        return [1.0, mean_weight(self.out_norm_dual)]


VARIANT = Variant(name="residual", display_name="ResiDual", colour="tab:pink", block=ResiDualBlock, order=7,
                  table_row=6, stream_labels={"post_ln": "Post-LN stream", "accumulator": "accumulator D"})
