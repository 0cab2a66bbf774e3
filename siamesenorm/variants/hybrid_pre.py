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

With ``siamese_mixing`` (not in the paper; its appendix A.1 names the omission): before each sublayer
[X; Y] <- H [X; Y], H doubly stochastic (siamesenorm.nn.StreamMixing); before the MLP the mix comes before
LN^X_attn, which restores X's bound; before the attention no norm on X follows, so X <- LN^mix(X) (``attn_mix_norm_x``).
With ``model.fused_streams`` the mix is one op (siamesenorm.nn.fused.pair_mix, the attention's add folded into the
MLP's mix) before the sublayer's fused norms. gamma stands in for the norm HybridNorm omits after the MLP (section
4.2); it is always a parameter.

      X --*gamma--(+)--Attn--+--(+R/c)--LN^X--(+)--LN^in--MLP--+--(+O/c)--> X
                   ^         |                 ^               |
      Y --LN^Y-----+         |           LN^Y--+               |
      Y ---------------------+--(+R)-------------------------+-(+O)-----> Y
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..nn.fused import stream_input
from ..nn.topologies import siamese_hybrid_attention, siamese_update
from ._base import SIAMESE_KNOBS, TwoStreamBlock
from .hybrid import QKVHeadNormAttention, validate_qkv_head_norms
from .spec import Variant, fail, knob

__all__ = ["SiameseHybridPreBlock", "VARIANT"]


class SiameseHybridPreBlock(TwoStreamBlock, QKVHeadNormAttention):
    STREAMS = ("x_hybrid", "y_pre")

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.gamma = nn.Parameter(torch.ones(config.d_model, device=config.init_device, dtype=torch.float32))
        self.attn_norm_y = self.new_norm()
        self.attn_norm_x = self.new_norm()
        self.ff_norm_y = self.new_norm()
        if hasattr(self, "attn_mix"):  # no LN^X follows the attention's mix: X's bound restored by its own norm
            self.attn_mix_norm_x = self.new_norm()

    @classmethod
    def unused_norms(cls, config, layer_id):
        # No attention-input norm (the Q/K/V norms replace it); ff_norm is LN^in, gone without normalized input.
        return ("attn_norm",) if knob(config, "siamese_normalized_input") else ("attn_norm", "ff_norm")

    def reset_parameters(self):
        super().reset_parameters()
        nn.init.ones_(self.gamma)

    def update(self, x, attention):
        if self.fused_streams:
            return self.fused_update(x, attention)
        xs, ys = self.split_streams(x)
        xs, ys = self.mix("attn", xs, ys, x_norm="attn_mix_norm_x")
        # LN^X_attn (attn_norm_x) is applied at the start of the MLP's input fusion rather than at the end of the
        # attention sublayer: the same X, one tensor fewer kept for backward
        xs, ys = siamese_hybrid_attention(xs, ys, attention, gamma=self.gamma, y_norm=self.attn_norm_y, x_norm=None,
                                          c=self.depth_scale, run=self.cheap)
        in_norm = self.ff_norm if knob(self.config, "siamese_normalized_input") else None
        xs, ys = self.mix("ff", xs, ys)  # LN^X_attn follows: X's bound restored by it
        xs, ys = siamese_update(xs, ys, self.mlp, y_norm=self.ff_norm_y, x_norm=self.attn_norm_x,
                                in_norm=in_norm, c=self.depth_scale, x_norm_position="before_sublayer",
                                run=self.cheap)
        return self.finish([xs, ys])

    def fused_update(self, state, attention):
        """The same equations through the fused ops (model.fused_streams): one op before each sublayer (the first on
        the stacked state itself, ``fused_input``, which hands X and Y on), one after the MLP. With stream mixing,
        each mix is one op more before the sublayer's (``fused_mix``, the attention's add folded into the MLP's
        mix). After the MLP's mix the op writes the Y it passes on (``copy``: its second gradient comes back into
        it); after the attention's it does not: the MLP's mix keeps its input streams for its backward, so a copy
        would be one more (B, T, d) tensor kept a layer, for one pass saved."""
        eps = self.config.layer_norm_eps
        y_weight = self.weight(self.attn_norm_y)
        if hasattr(self, "attn_mix"):  # X <- LN^mix(X) right after the mix: the op's LN^X
            xs, ys = self.fused_mix("attn", None, state)
            xs, ys, h = stream_input(xs, ys, x_norm=True, x_weight=self.weight(self.attn_mix_norm_x),
                                     gamma=self.gamma, y_weight=y_weight, eps=eps)
        else:
            xs, ys, h = self.fused_input(state, gamma=self.gamma, y_weight=y_weight, eps=eps)
        r = attention(h)
        if hasattr(self, "ff_mix"):
            (xs, ys), r = self.fused_mix("ff", xs, ys, r), None
        normalized = knob(self.config, "siamese_normalized_input")
        xs, ys, m = stream_input(xs, ys, r, scale=1.0 / self.depth_scale, x_norm=True,
                                 x_weight=self.weight(self.attn_norm_x), y_weight=self.weight(self.ff_norm_y),
                                 in_norm=normalized, in_weight=self.weight(self.ff_norm) if normalized else None,
                                 eps=eps, copy=r is None)
        return self.end(xs, ys, self.mlp(m))

    def input_scales(self, previous: "SiameseHybridPreBlock | None") -> dict:
        """(scale of X, scale of Y) as each sublayer's input receives them (paper figure 6): gamma and LN^Y_attn for
        the attention, LN^X_attn (X's last norm) and LN^Y_ffn for the MLP."""
        return {"attention": (self.gamma, self.attn_norm_y), "mlp": (self.attn_norm_x, self.ff_norm_y)}


def validate(config, model_type: str) -> None:
    validate_qkv_head_norms(config, model_type)
    if not config.layer_norm_with_affine:
        fail("MODEL_TYPE hybrid_pre learns its stream-mixing through norm scales; "
             "set model.layer_norm_with_affine to true.")


VARIANT = Variant(
    name="hybrid_pre", display_name="SiameseNorm", colour="tab:green", block=SiameseHybridPreBlock, order=5,
    table_row=12, validate=validate, knobs=SIAMESE_KNOBS,
    stream_labels={"x_hybrid": "X (bounded, HybridNorm)", "y_pre": "Y (Pre-Norm)"},
)
