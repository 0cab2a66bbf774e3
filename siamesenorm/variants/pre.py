"""Pre-Norm (paper eq. 1), for the attention and for the MLP sublayer:

    X_{i+1} = X_i + F_i(LN_i(X_i))

This is OLMo's own ``OLMoSequentialBlock`` (with ``norm_after: false``), built by OLMo's own factory: nothing is
re-implemented, so ``pre`` is bit-identical to stock OLMo.

With ``model.fused_streams`` (the fused path the SiameseNorm variants take, so that the comparison stays fair),
``FusedPreBlock`` computes the same equation on OLMo's weights with the attention's residual add and the MLP's
input norm as one op each way (siamesenorm/nn/fused.py, one stream):

    H = LN_attn(X);   X' = X + Attn(H);   H' = LN_ff(X');   X_{i+1} = X' + MLP(H')
        (one op)      (one op: the add and LN_ff)
"""

from __future__ import annotations

from olmo.model import OLMoSequentialBlock as PreNormBlock

from ..nn.fused import stream_input
from ._base import TopologyBlock
from .spec import Variant

__all__ = ["PreNormBlock", "FusedPreBlock", "VARIANT"]


class FusedPreBlock(TopologyBlock):
    """Pre-Norm with ``model.fused_streams``: OLMo's parameters and names (a checkpoint loads either way)."""

    def update(self, x, attention):
        eps = self.config.layer_norm_eps
        # x comes back as a copy: the MLP's op uses it again, and its gradient then returns into this op's backward
        _, x, h = stream_input(None, x, y_weight=self.weight(self.attn_norm), eps=eps, copy=True)
        _, x, h = stream_input(None, x, attention(h), y_weight=self.weight(self.ff_norm), eps=eps)
        return x + self.mlp(h)


VARIANT = Variant(name="pre", display_name="Pre-Norm", colour="tab:blue", block=None, fused_block=FusedPreBlock,
                  order=0, table_row=0)
